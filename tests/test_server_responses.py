"""OpenAI's Responses API on SmolLM2 through the official `openai` client: the same greedy text as
the chat route for the same conversation, previous_response_id carrying the conversation, the
stream's events adding up to the response, function calls and their outputs, structured output,
and the 4xx answers."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import OpenAI

from test_server_harness import assert_error, server, smollm  # noqa: F401 (fixtures)

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_tokens(client, messages, **kw):
    r = client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_same_text_as_the_chat_route(client):
    r = client.responses.create(model="m", instructions="Be brief.", input="Say hello", max_output_tokens=12,
                                temperature=0)
    text, prompt = chat_tokens(client, [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Say hello"}], max_tokens=12)
    assert r.object == "response" and r.output_text == text and r.usage.input_tokens == prompt
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"


def test_previous_response_carries_the_conversation(client):
    first = client.responses.create(model="m", input="Say hello", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="m", previous_response_id=first.id, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Again"}]}], max_output_tokens=8, temperature=0)
    text, prompt = chat_tokens(client, [{"role": "user", "content": "Say hello"},
                                        {"role": "assistant", "content": first.output_text},
                                        {"role": "user", "content": "Again"}], max_tokens=8)
    assert second.output_text == text and second.usage.input_tokens == prompt
    assert second.previous_response_id == first.id
    kept = client.responses.retrieve(second.id)
    assert kept.id == second.id and kept.output_text == second.output_text
    client.responses.delete(first.id)
    with pytest.raises(Exception, match="404|not_found|no response"):
        client.responses.retrieve(first.id)


def test_stream_adds_up_to_the_response(client):
    ask = dict(model="m", input="Name a colour", max_output_tokens=10, temperature=0)
    whole = client.responses.create(**ask)
    with client.responses.stream(**ask) as s:
        kinds, deltas = [], []
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = s.get_final_response()
    assert "".join(deltas) == whole.output_text == final.output_text
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]


def test_function_calls(client):
    ask = dict(model="m", input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
               max_output_tokens=60, temperature=0)
    r = client.responses.create(**ask)
    call = r.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(**ask) as s:
        streamed = s.get_final_response().output[-1]
    assert streamed.arguments == call.arguments
    after = client.responses.create(model="m", previous_response_id=r.id, tools=[WEATHER], max_output_tokens=4,
                                    temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                           "output": "Sunny, 21 C"}])
    assert after.usage.input_tokens > r.usage.input_tokens


def test_structured_output(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    r = client.responses.create(model="m", input="Give a name", max_output_tokens=40, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_refusals(server):
    url = server.url + "/v1/responses"
    assert_error(httpx.post(url, json={"model": "m"}), 400, "input", "missing_field")
    assert_error(httpx.post(url, json={"input": "hi", "previous_response_id": "resp_nope"}), 404,
                 "previous_response_id", "not_found")
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
    assert_error(httpx.post(url, json={"input": [image]}), 400, "input[0].content[0].type", "unsupported")
    assert_error(httpx.post(url, json={"input": "hi", "tools": [{"type": "web_search"}]}), 400, "tools[0].type",
                 "unsupported")
    assert_error(httpx.post(url, json={"input": "hi", "max_output_tokens": 0}), 400, "max_output_tokens")
