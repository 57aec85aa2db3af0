"""Headless Chromium driven over the DevTools protocol, for the chat page's tests (no tests here).

The browser is Debian's `chromium-headless-shell` or `chromium` (or a Chrome on PATH). It speaks
the protocol over a pipe (`--remote-debugging-pipe`: JSON messages ended by a NUL byte, read from
its descriptor 3 and written to its descriptor 4), so neither a port nor a websocket client is
needed. Every wait has a deadline, and the browser is killed on the way out.

Run as a script, it serves SmolLM2, asks the chat page one question and saves a screenshot:
    python tests/browser.py docs/chat-page.png
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NAMES = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-pipe")
# Puts the two pipe ends on descriptors 3 and 4 in the child, then becomes the browser (a child
# process of its own rather than a preexec_fn, which is unsafe beside the server's threads).
EXEC_ON_3_AND_4 = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
                   "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])")


def find() -> str | None:
    """The first Chromium-like browser on PATH, or None."""
    return next((path for path in map(shutil.which, NAMES) if path), None)


class ProtocolError(RuntimeError):
    pass


class Pipe:
    """The DevTools protocol on a pair of descriptors: `call` sends a command and waits for its
    reply; events are kept, in order, in `events`."""

    def __init__(self, read_fd: int, write_fd: int):
        self.read_fd, self.write_fd = read_fd, write_fd
        self.buffer = b""
        self.replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self.last_id = 0

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self.last_id += 1
        message = {"id": self.last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        call_id = self.last_id
        self.read_until(lambda: call_id in self.replies, timeout, method)
        reply = self.replies.pop(call_id)
        if "error" in reply:
            raise ProtocolError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def event(self, method: str, timeout: float = 30, start: int = 0, session: str | None = None,
              where=lambda params: True) -> dict:
        """The params of the first event `method` (of the session, if given; for which `where` holds)
        at or after index `start` of `events`."""
        def found():
            return next((e for e in self.events[start:] if e["method"] == method and where(e["params"])
                         and (session is None or e.get("sessionId") == session)), None)
        self.read_until(lambda: found() is not None, timeout, method)
        return found()["params"]

    def read_until(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise TimeoutError(f"no answer from the browser to {what} in {timeout} s")
            chunk = os.read(self.read_fd, 1 << 20)
            if not chunk:
                raise ProtocolError("the browser closed its pipe")
            self.take(chunk)

    def take(self, chunk: bytes) -> None:
        *messages, self.buffer = (self.buffer + chunk).split(b"\0")
        for raw in messages:
            message = json.loads(raw)
            if "id" in message:
                self.replies[message["id"]] = message
            else:
                self.events.append(message)


class Page:
    """One tab, attached through the browser's pipe."""

    def __init__(self, pipe: Pipe, session: str):
        self.pipe, self.session = pipe, session

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        return self.pipe.call(method, params, self.session, timeout)

    def evaluate(self, expression: str, timeout: float = 30):
        """The value of a JavaScript expression (awaited if it is a promise)."""
        params = {"expression": expression, "awaitPromise": True, "returnByValue": True, "timeout": timeout * 1000}
        result = self.pipe.call("Runtime.evaluate", params, self.session, timeout)
        if "exceptionDetails" in result:
            raise ProtocolError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait(self, expression: str, timeout: float = 60, interval: float = 0.02):
        """Polls until the expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"still false after {timeout} s: {expression}")
            time.sleep(interval)
        return value

    def goto(self, url: str, timeout: float = 30) -> None:
        self.load("Page.navigate", timeout, url=url)

    def reload(self, timeout: float = 30) -> None:
        self.load("Page.reload", timeout)

    def load(self, method: str, timeout: float, **params) -> None:
        """Runs a command and waits for the page's load event that follows it."""
        start = len(self.pipe.events)
        self.call(method, **params)
        self.pipe.event("Page.loadEventFired", timeout, start, self.session)

    def fill(self, values: dict[str, str]) -> None:
        """Sets form fields by id as a user would (each gets a change event)."""
        self.evaluate(f"""for (const [id, v] of Object.entries({json.dumps(values)})) {{
          const e = document.getElementById(id); e.value = v; e.dispatchEvent(new Event('change')); }}""")

    def enter(self, element_id: str, text: str) -> None:
        """Types `text` into the element and presses Enter."""
        self.evaluate(f"document.getElementById({json.dumps(element_id)}).focus()")
        self.type(text)
        self.press("Enter", 13)

    def type(self, text: str) -> None:
        """Text typed into the focused element."""
        self.call("Input.insertText", text=text)

    def press(self, key: str, code: int) -> None:
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code,
                      text="\r" if key == "Enter" and kind == "keyDown" else "")

    def click(self, selector: str) -> None:
        """A mouse click in the middle of the element (which must be visible)."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                            " return r.width ? [r.x + r.width / 2, r.y + r.height / 2] : null; })()")
        if box is None:
            raise ProtocolError(f"{selector} is not visible")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def screenshot(self, path: Path) -> None:
        Path(path).write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


class Browser:
    """A headless Chromium on a fresh profile: `with Browser(path) as b: page = b.page()`."""

    def __init__(self, path: str, size: tuple[int, int] = (1100, 700)):
        self.path, self.size = path, size
        self.process = None

    def __enter__(self) -> Browser:
        self.profile = tempfile.TemporaryDirectory(prefix="ember-browser-")
        to_browser, from_browser = os.pipe(), os.pipe()
        # The child's ends away from 3 and 4, so that moving them there overwrites neither.
        child_r, child_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 5) for fd in (to_browser[0], from_browser[1]))
        for fd in (to_browser[0], from_browser[1]):
            os.close(fd)
        args = [self.path, *FLAGS, f"--user-data-dir={self.profile.name}", "--window-size=%d,%d" % self.size, "about:blank"]
        self.process = subprocess.Popen([sys.executable, "-c", EXEC_ON_3_AND_4, str(child_r), str(child_w), *args],
                                        pass_fds=(child_r, child_w), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(child_r)
        os.close(child_w)
        self.pipe = Pipe(from_browser[0], to_browser[1])
        try:
            self.pipe.call("Browser.getVersion")
        except BaseException:
            self.__exit__()
            raise
        return self

    def page(self) -> Page:
        target = self.pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        page = Page(self.pipe, self.pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"])
        for domain in ("Page", "Runtime", "Network"):
            page.call(f"{domain}.enable")
        width, height = self.size
        page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        return page

    def __exit__(self, *exc) -> None:
        try:
            self.pipe.call("Browser.close", timeout=5)
        except (ProtocolError, TimeoutError, OSError, AttributeError):
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        for fd in (self.pipe.read_fd, self.pipe.write_fd):
            os.close(fd)
        self.profile.cleanup()


def screenshot(path: Path, question: str = "Write a Python function that reverses a string.") -> None:
    """The chat page on SmolLM2 after one question, as a PNG."""
    from test_server_harness import MODEL_CFG, serve_model

    from ember.app import load_model

    model = load_model(MODEL_CFG)
    try:
        with serve_model(model) as live, Browser(find() or sys.exit("no Chromium on PATH"), (960, 600)) as chromium:
            live.wait_ready()
            page = chromium.page()
            page.goto(live.url + "/")
            page.wait("document.getElementById('model').options.length > 0")
            page.fill({"temperature": "0", "max_tokens": "160"})
            page.enter("input", question)
            page.wait("document.querySelectorAll('.message.assistant').length && document.getElementById('stop').hidden", 120)
            page.screenshot(path)
    finally:
        model.close()


if __name__ == "__main__":
    screenshot(Path(sys.argv[1]))
