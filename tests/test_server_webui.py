"""The chat page at `/`: its files served from the package (nothing from the network), open
without an API key while the API is not, left out with --no-webui; and its streaming code
(render.js: the event parser, the delta accumulation, the request body, markdown) run in Node
against the live server on SmolLM2: the streamed reply equals the whole one, and stopping cancels
the request. (The whole page in a browser: test_server_webui_browser.py.)"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib import resources

import httpx
import pytest

from test_server_harness import serve_model, server, smollm, wait_for  # noqa: F401 (fixtures)

NODE = shutil.which("node")
WEBUI = resources.files("ember.server.webui")


def test_page_and_files(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert refs and all(ref.startswith("/webui/") for ref in refs)  # nothing from another host
    for ref in refs:
        f = httpx.get(server.url + ref)
        assert f.status_code == 200 and f.headers["content-type"].split(";")[0] in ("text/css", "text/javascript")
    assert httpx.get(server.url + "/webui/nope.js").status_code == 404
    for name in ("app.js", "render.js"):
        assert not re.search(r"(fetch|import)\([\"']https?:", (WEBUI / name).read_text())


def test_page_needs_no_key_but_the_api_does(smollm):  # noqa: F811
    with serve_model(smollm, api_keys=("sesame",)) as live:
        assert httpx.get(live.url + "/").status_code == 200
        assert httpx.get(live.url + "/webui/app.js").status_code == 200
        assert httpx.get(live.url + "/v1/models").status_code == 401
    with serve_model(smollm, webui=False) as live:
        assert httpx.get(live.url + "/").status_code == 404


def node(script: str, tmp_path) -> dict:
    (tmp_path / "render.mjs").write_text((WEBUI / "render.js").read_text())
    main = tmp_path / "main.mjs"
    main.write_text(script)
    out = subprocess.run([NODE, str(main)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_render_helpers(tmp_path):
    got = node("""
import { markdown, EventParser, applyDelta } from "./render.mjs";
const p = new EventParser();
const events = [...p.push('data: {"a":1}\\n\\ndata: {"b"'), ...p.push(':2}\\n\\ndata: [DONE]\\n\\n')];
let reply = { content: "", reasoning: "", tool_calls: [] };
for (const c of [{choices: [{delta: {reasoning_content: "hm"}}]}, {choices: [{delta: {content: "Hi"}}]},
                 {choices: [{delta: {tool_calls: [{index: 0, function: {name: "f", arguments: "{\\"x\\""}}]}}]},
                 {choices: [{delta: {tool_calls: [{index: 0, function: {arguments: ": 1}"}}]}, finish_reason: "tool_calls"}]}])
  reply = applyDelta(reply, c);
console.log(JSON.stringify({
  code: markdown("text <b>\\n```py\\nx = '<a>'\\n```\\n- one\\n- **two**"),
  open: markdown("```\\nstill streaming"),
  events, reply }));
""", tmp_path)
    assert got["code"] == ('<p>text &lt;b&gt;</p>\n<pre><code class="language-py">x = &#39;&lt;a&gt;&#39;</code></pre>\n'
                           '<ul><li>one</li><li><strong>two</strong></li></ul>')
    assert got["open"] == "<pre><code>still streaming</code></pre>"
    assert got["events"] == [{"a": 1}, {"b": 2}]
    assert got["reply"]["reasoning"] == "hm" and got["reply"]["content"] == "Hi"
    assert got["reply"]["tool_calls"] == [{"name": "f", "arguments": '{"x": 1}'}]


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_the_page_streams_and_stops(server, tmp_path):
    whole = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 24, "temperature": 0,
        "top_p": 0.95}, timeout=120).json()["choices"][0]["message"]["content"]
    got = node(f"""
import {{ EventParser, applyDelta, requestBody }} from "./render.mjs";
const url = "{server.url}/v1/chat/completions";
const conversation = {{ messages: [{{ role: "user", content: "Tell me about the sea." }}] }};
const body = requestBody(conversation, {{ model: "smollm2", system: "", temperature: 0, top_p: 0.95, max_tokens: 24 }});
async function stream(stopAfter) {{
  const controller = new AbortController();
  const r = await fetch(url, {{ method: "POST", body: JSON.stringify(body), signal: controller.signal,
                               headers: {{ "Content-Type": "application/json" }} }});
  const reader = r.body.getReader(), decoder = new TextDecoder(), parser = new EventParser();
  const reply = {{ content: "", reasoning: "", tool_calls: [] }};
  let chunks = 0;
  try {{
    for (;;) {{
      const {{ value, done }} = await reader.read();
      if (done) break;
      for (const c of parser.push(decoder.decode(value, {{ stream: true }}))) {{ applyDelta(reply, c); chunks++; }}
      if (stopAfter && chunks >= stopAfter) controller.abort();
    }}
  }} catch (e) {{ if (e.name !== "AbortError") throw e; }}
  return reply;
}}
const full = await stream(0);
const stopped = await stream(3);
console.log(JSON.stringify({{ full, stopped }}));
""", tmp_path)
    assert got["full"]["content"] == whole and got["full"]["finish_reason"] == "length"
    assert "finish_reason" not in got["stopped"] and len(got["stopped"]["content"]) < len(whole)
    wait_for(lambda: not server.state.active)  # the stopped request was cancelled


@pytest.mark.skipif(NODE is None, reason="needs node")
def test_app_js_parses():
    for name in ("app.js", "render.js"):
        out = subprocess.run([NODE, "--check", "--input-type=module"], input=(WEBUI / name).read_text(),
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
