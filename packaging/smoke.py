"""Smoke test of a built ember, as a user without network would run it:

    python packaging/smoke.py --model SmolLM2-135M-Instruct.Q4_1.gguf -- EMBER-COMMAND...

EMBER-COMMAND runs ember: the bundle's or the one-file `ember`, a venv's `bin/ember`, or
`/path/to/python3.11 ember.pyz`. Each check runs it in a scrubbed environment (env -i,
PATH=/usr/bin:/bin, a fresh HOME, from a folder outside any checkout): --version, info --system,
import of the model file, run (greedy, 8 tokens), serve with one OpenAI-client request, and
serve --offline of a model that is not there (one clear line, exit status 1).

No network: the whole test runs in a new network namespace (`unshare -n`, or `unshare -rn` where
only user namespaces are allowed), with loopback up for the server. Where neither is permitted, each
ember process runs under `strace -f -e trace=connect` instead and any connection to an address that
is not loopback fails the check; without strace either, the test says so and runs unisolated.
This script needs the `openai` package (ember's test extra) for the client request.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT, CONTINUATION = "The capital of France is", " Paris."  # SmolLM2's greedy continuation (llama.cpp's too)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the SmolLM2 GGUF file to import")
    p.add_argument("--isolation", choices=["auto", "unshare -n", "unshare -rn", "strace", "none"], default="auto")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in the namespace
    p.add_argument("ember", nargs="+", help="the command that runs ember")
    args = p.parse_args()
    isolation = choose_isolation() if args.isolation == "auto" else args.isolation
    if isolation.startswith("unshare") and not args.inside:
        cmd = [*isolation.split(), sys.executable, __file__, "--inside", "--isolation", isolation,
               "--model", args.model, "--", *args.ember]
        return subprocess.run(cmd).returncode
    if isolation.startswith("unshare"):
        loopback_up()
        assert_no_network()
    print(f"smoke: {' '.join(args.ember)}; network isolation: {describe(isolation)}", flush=True)
    return Smoke(args.ember, Path(args.model).resolve(), isolation).run_all()


def choose_isolation() -> str:
    for cmd in ("unshare -n", "unshare -rn"):
        if shutil.which("unshare") and subprocess.run([*cmd.split(), "true"], capture_output=True).returncode == 0:
            return cmd
    return "strace" if shutil.which("strace") else "none"


def describe(isolation: str) -> str:
    return {"unshare -n": "a new network namespace (unshare -n)",
            "unshare -rn": "a new network namespace in a user namespace (unshare -rn)",
            "strace": "none permitted here; every connect() traced with strace, only loopback allowed",
            "none": "NONE: unshare is not permitted and strace is missing; the run is not isolated"}[isolation]


def loopback_up() -> None:
    """A new network namespace starts with `lo` down: bring it up (SIOCGIFFLAGS / SIOCSIFFLAGS)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, req)[:18])[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 0x1))


def assert_no_network() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(("192.0.2.1", 80))  # TEST-NET-1: unreachable without a route, as it must be here
        except OSError:
            return
    sys.exit("smoke: the network namespace has a route out; refusing to go on")


class Smoke:
    def __init__(self, ember: list[str], model: Path, isolation: str):
        self.ember, self.model, self.isolation = ember, model, isolation
        self.home = Path(tempfile.mkdtemp(prefix="ember-smoke-"))
        self.cwd = self.home / "work"
        self.cwd.mkdir()
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(self.home), "LANG": "C.UTF-8", "TMPDIR": str(self.home)}
        self.failures: list[str] = []

    def run_all(self) -> int:
        checks = [self.version, self.system, self.import_model, self.run, self.serve, self.serve_offline_missing]
        try:
            for check in checks:
                t0 = time.monotonic()
                try:
                    check()
                    print(f"ok    {check.__name__} ({time.monotonic() - t0:.1f} s)", flush=True)
                except Exception as e:  # noqa: BLE001 - any error fails the check, the others still run
                    self.failures.append(check.__name__)
                    print(f"FAIL  {check.__name__}: {type(e).__name__}: {e}", flush=True)
        finally:
            shutil.rmtree(self.home, ignore_errors=True)
        print(f"smoke: {len(checks) - len(self.failures)} of {len(checks)} checks passed", flush=True)
        return 1 if self.failures else 0

    def command(self, *args: str) -> tuple[list[str], Path | None]:
        if self.isolation != "strace":
            return [*self.ember, *args], None
        trace = Path(tempfile.mkstemp(prefix="connect-", dir=self.home)[1])
        return ["strace", "-f", "-qq", "-e", "trace=connect", "-e", "signal=none", "-o", str(trace), *self.ember, *args], trace

    def call(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd, trace = self.command(*args)
        out = subprocess.run(cmd, env=self.env, cwd=self.cwd, capture_output=True, text=True, timeout=timeout)
        self.check_trace(trace)
        return out

    def check_trace(self, trace: Path | None) -> None:
        if trace is None:
            return
        outside = [line for line in trace.read_text().splitlines()
                   if ("AF_INET" in line and not re.search(r'inet_(addr|pton)\([^)]*"(127\.[0-9.]+|::1)"', line))]
        assert not outside, f"a connection that is not loopback: {outside[0]}"

    def version(self):
        out = self.call("--version")
        assert out.returncode == 0 and out.stdout.startswith("ember "), out.stdout + out.stderr

    def system(self):
        out = self.call("info", "--system")
        assert out.returncode == 0 and "cpu kernels:" in out.stdout and "device auto -> cpu" in out.stdout, \
            out.stdout + out.stderr

    def import_model(self):
        out = self.call("import", str(self.model))
        assert out.returncode == 0 and "run it with: ember run smollm2" in out.stdout, out.stdout + out.stderr
        assert (self.home / ".cache/ember/models" / self.model.name).is_file()

    def run(self):
        out = self.call("run", "smollm2", "-p", PROMPT, "-n", "8", "--temp", "0")
        assert out.returncode == 0 and out.stdout.startswith(CONTINUATION), out.stdout + out.stderr

    def serve(self):
        port = free_port()
        cmd, trace = self.command("serve", "smollm2", "--port", str(port), "--slots", "1")
        server = subprocess.Popen(cmd, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        try:
            wait_healthy(port, server)
            from openai import OpenAI

            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
            r = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
            text = r.choices[0].message.content
            assert r.usage.completion_tokens > 0 and text, f"an empty reply: {r}"
        finally:
            log = stop(server, traced=trace is not None)
        assert server.returncode == 0, f"serve exited with {server.returncode}:\n{log}"
        self.check_trace(trace)

    def serve_offline_missing(self):
        out = self.call("serve", "--offline", "gemma3-270m", "--port", str(free_port()))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, out.stderr
        assert "ember is offline" in lines[0] and "ember import PATH" in lines[0], lines[0]


def stop(server: subprocess.Popen, traced: bool) -> str:
    """SIGTERM to the server (under strace: to the process strace started), SIGKILL after 60 s; its log."""
    pids = traced_children(server.pid) if traced else [server.pid]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    try:
        return server.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        for pid in pids + [server.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return server.communicate()[0] + "\n(killed: no exit within 60 s of SIGTERM)"


def traced_children(pid: int) -> list[int]:
    """The processes strace started: they get the signal (strace would only detach)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, server: subprocess.Popen, limit_s: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"serve exited with {server.returncode}:\n{server.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"serve did not become healthy within {limit_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
