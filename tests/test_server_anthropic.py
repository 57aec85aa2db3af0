"""Anthropic's Messages API on SmolLM2 through the official `anthropic` client: the same greedy
text as the OpenAI chat route for the same conversation (one translation onto one engine), the
stream's events adding up to the whole message, tool use and tool results, count_tokens, x-api-key
authentication, and 400s for what a text model cannot take."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from test_server_harness import assert_error, serve_model, server, smollm  # noqa: F401 (fixtures)

anthropic = pytest.importorskip("anthropic")

GREEDY = {"extra_body": {"temperature": 0}}  # newer clients take sampling fields only as extra fields
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oai(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_same_text_as_the_chat_route(claude, oai):
    r = claude.messages.create(model="claude-anything", max_tokens=16, system="Be brief.",
                               messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}],
                               **GREEDY)
    ref = oai.chat.completions.create(model="m", max_tokens=16, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}])
    assert r.type == "message" and r.role == "assistant" and r.model == "claude-anything"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ref.choices[0].message.content
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 16
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == ref.usage.prompt_tokens


def test_stream_adds_up_to_the_message(claude, server):
    ask = dict(model="m", max_tokens=12, messages=[{"role": "user", "content": "Name a colour"}], **GREEDY)
    whole = claude.messages.create(**ask)
    with claude.messages.stream(**ask) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    body = {"model": "m", "max_tokens": 12, "messages": ask["messages"], "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/messages", json=body) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(claude):
    ask = dict(model="m", max_tokens=40, messages=[{"role": "user", "content": "Tell me about the sea."}], **GREEDY)
    free = claude.messages.create(**ask).content[0].text
    word = free.split()[3]  # a word the reply is known to reach
    r = claude.messages.create(**ask, stop_sequences=[word, "zzzz"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    assert free.startswith(r.content[0].text) and word not in r.content[0].text
    with claude.messages.stream(**ask, stop_sequences=[word]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


def test_tool_use_and_results(claude, oai):
    ask = dict(model="m", max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"},
               messages=[{"role": "user", "content": "What is the weather in Paris?"}], **GREEDY)
    r = claude.messages.create(**ask)
    call = r.content[-1]
    assert r.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    assert isinstance(call.input.get("city"), str)
    with claude.messages.stream(**ask) as s:
        streamed = s.get_final_message()
    assert streamed.content[-1].input == call.input and streamed.stop_reason == "tool_use"
    turn = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny"}]}]
    counted = claude.messages.count_tokens(model="m", tools=[WEATHER], messages=turn).input_tokens
    ref = oai.chat.completions.create(model="m", max_tokens=1, temperature=0, tools=[
        {"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                          "parameters": WEATHER["input_schema"]}}], messages=[
        turn[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}])
    assert counted == ref.usage.prompt_tokens


def test_api_key_in_x_api_key(smollm):  # noqa: F811
    with serve_model(smollm, api_keys=("sesame",)) as live:
        live.wait_ready()
        ask = dict(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0).messages.create(**ask)
        r = anthropic.Anthropic(base_url=live.url, api_key="sesame", max_retries=0).messages.create(**ask)
        assert r.usage.output_tokens == 2


def test_refusals(server):
    url = server.url + "/v1/messages"
    hi = [{"role": "user", "content": "hi"}]
    assert_error(httpx.post(url, json={"messages": hi}), 400, "max_tokens", "missing_field")
    assert_error(httpx.post(url, json={"max_tokens": 4, "messages": []}), 400, "messages", "missing_field")
    assert_error(httpx.post(url, json={"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}), 400,
                 "messages[0].role")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    assert_error(httpx.post(url, json={"max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}), 400,
                 "messages[0].content[0].type", "unsupported")
    assert_error(httpx.post(url, json={"max_tokens": 4, "messages": hi, "tools": [{"input_schema": {}}]}), 400,
                 "tools[0].name", "missing_field")
