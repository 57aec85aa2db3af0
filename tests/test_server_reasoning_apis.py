"""Reasoning through the Anthropic and Responses routes: SmolLM2 with DeepSeek-R1's template (it
opens the reasoning block in the prompt), the same reply as the chat route's reasoning_content,
as a `thinking` block / a `reasoning` item, whole and streamed; thinking disabled turns it off."""
from __future__ import annotations

import httpx
import pytest

from test_server_chat_formats import ASK, with_template
from test_server_harness import serve_model, smollm  # noqa: F401 (fixture)

anthropic = pytest.importorskip("anthropic")
from openai import OpenAI  # noqa: E402

R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"


@pytest.fixture(scope="module")
def thinker(smollm):  # noqa: F811
    with serve_model(with_template(smollm, R1)) as live:
        live.wait_ready()
        yield live


def chat_reasoning(live) -> str:
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 12, "temperature": 0})
    return r.json()["choices"][0]["message"]["reasoning_content"]


def test_thinking_blocks(thinker):
    want = chat_reasoning(thinker)
    claude = anthropic.Anthropic(base_url=thinker.url, api_key="unused", max_retries=0)
    ask = dict(model="m", max_tokens=12, messages=ASK, extra_body={"temperature": 0})
    r = claude.messages.create(**ask)
    assert r.content[0].type == "thinking" and r.content[0].thinking == want
    with claude.messages.stream(**ask) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].type == "thinking" and streamed.content[0].thinking == want
    off = claude.messages.create(**ask, thinking={"type": "disabled"})
    assert all(b.type != "thinking" for b in off.content)


def test_reasoning_items(thinker):
    want = chat_reasoning(thinker)
    client = OpenAI(base_url=thinker.url + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="m", input=ASK[0]["content"], max_output_tokens=12, temperature=0)
    r = client.responses.create(**ask)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == want
    with client.responses.stream(**ask) as s:
        deltas = [ev.delta for ev in s if ev.type == "response.reasoning_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == want and final.output[0].type == "reasoning"
