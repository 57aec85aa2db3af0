"""The chat page in a real browser (headless Chromium over the DevTools protocol, tests/browser.py)
against the live server on SmolLM2: a message typed and sent with Enter streams its reply into the
page token by token, and the reply is the one the server gives whole to the request the page sent;
the second turn carries the first; Stop cancels a generation on the server; a reload finds the
conversation and the settings in the browser's storage; with --api-key the page asks for the key;
reasoning is shown collapsed and tool calls shown; Export downloads the conversations and Import
brings them back; with several models (the router) the picker lists them and the one picked answers.
Skipped where no Chromium is installed (.ci/run installs Debian's chromium-headless-shell)."""
from __future__ import annotations

import json
import time

import httpx
import pytest

import browser
from test_server_harness import serve_model, server, smollm, wait_for  # noqa: F401 (fixtures)

BROWSER = browser.find()
pytestmark = pytest.mark.skipif(BROWSER is None, reason="needs Chromium (apt-get install chromium-headless-shell)")

ASSISTANT = "[...document.querySelectorAll('#messages .message.assistant')]"
BUSY = "!document.getElementById('stop').hidden"
STORED = "JSON.parse(localStorage.getItem('ember.conversations'))"
# Records the length of the last reply's text at each change of the messages, to see it grow.
WATCH = """window.seen = []; new MutationObserver(() => {
  const m = document.querySelector('#messages .message.assistant:last-child');
  if (m) window.seen.push(m.textContent.length);
}).observe(document.getElementById('messages'), { childList: true, subtree: true, characterData: true }); true"""


def answered(n: int) -> str:
    """The page shows n replies and is not busy."""
    return f"{ASSISTANT}.length === {n} && !({BUSY})"


@pytest.fixture(scope="module")
def chromium():
    with browser.Browser(BROWSER) as b:
        yield b


def sent_bodies(page) -> list[dict]:
    """The bodies of the chat requests the page has sent, from the browser's network events."""
    return [json.loads(e["params"]["request"]["postData"]) for e in page.pipe.events
            if e["method"] == "Network.requestWillBeSent" and e.get("sessionId") == page.session
            and e["params"]["request"]["url"].endswith("/v1/chat/completions")]


def whole_reply(url: str, body: dict) -> str:
    r = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=120)
    return r.json()["choices"][0]["message"]["content"]


def test_chat_streams_keeps_history_stops_and_persists(chromium, server):  # noqa: F811
    page = chromium.page()
    page.goto(server.url + "/")
    page.wait("document.getElementById('model').options.length > 0")
    page.fill({"temperature": "0", "max_tokens": "32"})

    page.evaluate(WATCH)
    page.enter("input", "What is the capital of France?")
    page.wait(answered(1))
    first = sent_bodies(page)[-1]
    assert first["stream"] and first["temperature"] == 0 and first["max_tokens"] == 32
    assert first["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    reply = page.evaluate(STORED)[0]["messages"][1]
    assert reply["content"] == whole_reply(server.url, first) and reply["finish_reason"]
    growing = sorted(set(page.evaluate("window.seen")))
    assert len(growing) >= 3, growing  # empty, in part, whole: it did not come at once
    shown = page.evaluate(f"{ASSISTANT}[0].innerHTML")
    rendered = page.evaluate(f"import('/webui/render.js').then((r) => r.markdown({json.dumps(reply['content'])}))")
    assert shown == '<div class="role">assistant</div>' + rendered

    page.enter("input", "And of Italy?")
    page.wait(answered(2))
    second = sent_bodies(page)[-1]
    assert second["messages"] == [first["messages"][0], {"role": "assistant", "content": reply["content"]},
                                  {"role": "user", "content": "And of Italy?"}]
    assert page.evaluate(STORED)[0]["messages"][3]["content"] == whole_reply(server.url, second)

    page.fill({"max_tokens": "600"})
    page.evaluate("window.seen = []")
    page.enter("input", "Write a long story about a lighthouse keeper.")
    page.wait(f"{ASSISTANT}.length === 3 && {ASSISTANT}[2].textContent.length > 200")
    page.click("#stop")
    page.wait(answered(3) + " && !document.getElementById('send').hidden", timeout=10)
    assert len(set(page.evaluate("window.seen"))) >= 5  # token by token
    stopped = page.evaluate(STORED)[0]["messages"][5]
    assert stopped["content"] and "finish_reason" not in stopped and "error" not in stopped
    wait_for(lambda: not server.state.active)  # the server cancelled the generation
    shown = page.evaluate(f"{ASSISTANT}[2].textContent")
    time.sleep(0.5)
    assert page.evaluate(f"{ASSISTANT}[2].textContent") == shown  # and nothing more came

    page.reload()
    page.wait(f"{ASSISTANT}.length === 3")
    assert page.evaluate("[...document.querySelectorAll('#conversations li span')].map((s) => s.textContent)") == [
        "What is the capital of France?"]
    assert page.evaluate(f"{ASSISTANT}[2].textContent") == shown
    assert page.evaluate("[document.getElementById('temperature').value, document.getElementById('max_tokens').value]") == [
        "0", "600"]


def test_the_page_asks_for_the_api_key(chromium, smollm):  # noqa: F811
    with serve_model(smollm, api_keys=("sesame",)) as live:
        live.wait_ready()
        page = chromium.page()
        start = len(page.pipe.events)
        page.call("Page.navigate", url=live.url + "/")
        dialog = page.pipe.event("Page.javascriptDialogOpening", 30, start, page.session)
        assert dialog["type"] == "prompt" and "API key" in dialog["message"]
        page.call("Page.handleJavaScriptDialog", accept=True, promptText="sesame")
        page.wait("document.getElementById('model').options.length > 0")
        assert page.evaluate("localStorage.getItem('ember.apiKey')") == "sesame"
        page.fill({"temperature": "0", "max_tokens": "4"})
        page.enter("input", "Hi")
        page.wait(answered(1))
        reply = page.evaluate(STORED)[0]["messages"][1]
        assert reply["content"] and "error" not in reply


SAVED = [{"id": 1, "title": "Saved", "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Calling it:\n```py\nget_weather('Paris')\n```", "reasoning": "The user wants **weather**.",
     "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], "finish_reason": "tool_calls"}]}]


def test_rendering_export_and_import(chromium, server, tmp_path):  # noqa: F811
    page = chromium.page()
    page.goto(server.url + "/")
    page.evaluate(f"localStorage.setItem('ember.conversations', {json.dumps(json.dumps(SAVED))})")
    page.reload()
    reply = f"{ASSISTANT}[0]"
    assert page.evaluate(f"{reply}.querySelector('details').open") is False  # reasoning shown collapsed
    assert page.evaluate(f"{reply}.querySelector('details strong').textContent") == "weather"
    assert page.evaluate(f"{reply}.querySelector('pre code').textContent") == "get_weather('Paris')"
    assert page.evaluate(f"{reply}.querySelector('.tool code').textContent") == "get_weather"

    chromium.pipe.call("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path),
                                                       "eventsEnabled": True})
    start = len(chromium.pipe.events)
    page.click("#export")
    chromium.pipe.event("Browser.downloadProgress", 30, start, where=lambda p: p["state"] == "completed")
    exported = tmp_path / "ember-conversations.json"
    assert json.loads(exported.read_text()) == SAVED

    page.evaluate("localStorage.clear()")
    page.reload()
    assert page.evaluate(f"{ASSISTANT}.length") == 0
    document = page.call("DOM.getDocument")["root"]["nodeId"]
    node = page.call("DOM.querySelector", nodeId=document, selector="#import")["nodeId"]
    page.call("DOM.setFileInputFiles", files=[str(exported)], nodeId=node)
    page.wait(f"{ASSISTANT}.length === 1")
    assert page.evaluate(STORED) == SAVED


def test_model_picker_lists_and_picks_the_router_models(chromium, tmp_path):
    """Several models (--models-dir): the picker lists every model, and the one picked serves the
    conversation (loaded on that first use) while the other stays unloaded."""
    from families import write_family
    from test_server_router import RouterServer

    from ember.server.router import models_in

    write_family(tmp_path / "qwen2.gguf", "qwen2")
    write_family(tmp_path / "smollm3.gguf", "smollm3")
    with RouterServer(models_in(tmp_path), models_max=2) as s:
        page = chromium.page()
        page.goto(s.url + "/")
        page.wait("document.getElementById('model').options.length === 2")
        listed = page.evaluate("[...document.getElementById('model').options].map((o) => o.value)")
        assert sorted(listed) == ["qwen2", "smollm3"]
        page.fill({"model": "smollm3", "temperature": "0", "max_tokens": "8"})
        page.enter("input", "Hello")
        page.wait(answered(1))
        body = sent_bodies(page)[-1]
        assert body["model"] == "smollm3"
        reply = page.evaluate(STORED)[0]["messages"][1]
        r = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=120)
        assert reply["content"] == r.json()["choices"][0]["message"]["content"]
        assert s.statuses() == {"qwen2": "unloaded", "smollm3": "loaded"}
