"""The exact shape of what ember serve writes back, over real HTTP on SmolLM2: every reply's keys in
order, nested, with each value's JSON type (the values that name a kind of thing -- object,
finish_reason, stop_type, ... -- kept as they are), each stream as its sequence of event shapes,
and every error body whole (message included). Compared with tests/data/server_shapes.json, a
record of the server's replies; when a shape changes on purpose, rewrite the record with
`python tests/test_server_shapes.py` and review its diff."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from test_server_harness import server, smollm  # noqa: F401 (fixtures)

RECORD = Path(__file__).parent / "data" / "server_shapes.json"
KEEP = {"object", "finish_reason", "role", "stop_type", "type", "code", "param", "stopping_word", "status",
        "chat_template_tools", "owned_by"}  # string values that name a kind of thing
ASK = [{"role": "user", "content": "Say hi."}]
GREEDY = {"temperature": 0, "ignore_eos": True}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
LONG = "word " * 1500  # more tokens than the test server's context of 1024
BAN = {str(i): False for i in range(49152)}  # SmolLM2's whole vocabulary

CHAT, COMPLETIONS, COMPLETION = "/v1/chat/completions", "/v1/completions", "/completion"
REPLIES = {  # name: (path, body); replies and streams
    "chat": (CHAT, {"messages": ASK, "max_tokens": 3, **GREEDY}),
    "chat n=2 logprobs stop": (CHAT, {"messages": ASK, "max_tokens": 3, "n": 2, "logprobs": True, "top_logprobs": 2,
                                      "stop": ["\n\n\n"], "seed": 5, "ignore_eos": True}),
    "chat tools": (CHAT, {"messages": ASK, "tools": [TOOL], "tool_choice": "required", "max_tokens": 40,
                          "temperature": 0}),
    "chat prefill": (CHAT, {"messages": [*ASK, {"role": "assistant", "content": "Hello"}], "max_tokens": 2,
                            **GREEDY}),
    "chat json_schema": (CHAT, {"messages": ASK, "max_tokens": 20, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "integer"}}, "required": ["a"]}}}}),
    "chat stream": (CHAT, {"messages": ASK, "max_tokens": 3, "stream": True, **GREEDY}),
    "chat stream usage logprobs": (CHAT, {"messages": ASK, "max_tokens": 3, "stream": True, "logprobs": True,
                                          "top_logprobs": 1, "stream_options": {"include_usage": True}, **GREEDY}),
    "chat stream tools": (CHAT, {"messages": ASK, "tools": [TOOL], "tool_choice": "required", "max_tokens": 40,
                                 "temperature": 0, "stream": True}),
    "chat stream tools logprobs": (CHAT, {"messages": ASK, "tools": [TOOL], "tool_choice": "required",
                                          "max_tokens": 40, "temperature": 0, "stream": True, "logprobs": True}),
    "chat stream prefill": (CHAT, {"messages": [*ASK, {"role": "assistant", "content": "Hello"}], "max_tokens": 2,
                                   "stream": True, **GREEDY}),
    "completions": (COMPLETIONS, {"prompt": ["The capital of France is", [1, 2, 3]], "max_tokens": 3, "logprobs": 2,
                                  **GREEDY}),
    "completions stream usage": (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 3, "stream": True,
                                               "logprobs": 1, "stream_options": {"include_usage": True}, **GREEDY}),
    "completions stream": (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 3, "stream": True,
                                         **GREEDY}),
    "completion": (COMPLETION, {"prompt": "The capital of France is", "n_predict": 3, "n_probs": 2,
                                "return_tokens": True, "stop": ["zz"], **GREEDY}),
    "completion post_sampling_probs": (COMPLETION, {"prompt": "The capital of France is", "n_predict": 2, "n_probs": 2,
                                                    "post_sampling_probs": True, **GREEDY}),
    "completion grammar": (COMPLETION, {"prompt": "Yes or no?", "n_predict": 4, "grammar": 'root ::= " yes" | " no"',
                                        "temperature": 0}),
    "completion prompts response_fields": (COMPLETION, {"prompt": ["A", {"prompt_string": "B"}], "n_predict": 1,
                                                        "response_fields": ["index", "timings/predicted_n", "content"],
                                                        **GREEDY}),
    "completion stream": (COMPLETION, {"prompt": "The capital of France is", "n_predict": 3, "stream": True,
                                       "n_probs": 1, **GREEDY}),
    "completion stream progress timings": (COMPLETION, {"prompt": "The capital of France is", "n_predict": 3,
                                                        "stream": True, "return_progress": True,
                                                        "timings_per_token": True, **GREEDY}),
    "completion stream response_fields": (COMPLETION, {"prompt": "Hi", "n_predict": 2, "stream": True,
                                                       "response_fields": ["content", "stop"], **GREEDY}),
    "native completions": ("/completions", {"prompt": "Hi", "n_predict": 2, **GREEDY}),
    "tokenize": ("/tokenize", {"content": "Hello wörld", "with_pieces": True}),
    "tokenize ids": ("/tokenize", {"content": "Hello", "add_special": True}),
    "detokenize": ("/detokenize", {"tokens": [19556, 905]}),
    "apply-template": ("/apply-template", {"messages": ASK, "tools": [TOOL]}),
}
GETS = ["/health", "/v1/health", "/props", "/v1/models", "/models", "/slots"]
ERRORS = {  # name: (path, body): each error body whole
    "chat two mistakes: messages first": (CHAT, {"messages": [{"role": "robot"}], "n": 0, "stop": 5}),
    "chat two mistakes: tools before n": (CHAT, {"messages": ASK, "tools": "x", "n": 0}),
    "chat two mistakes: template options before sampling": (CHAT, {"messages": [*ASK, {"role": "assistant",
                                                                                       "content": "x"}],
                                                                   "add_generation_prompt": True, "top_k": "x"}),
    "chat two mistakes: stream before n": (CHAT, {"messages": ASK, "stream": 1, "n": "x"}),
    "chat two mistakes: stop before sampling": (CHAT, {"messages": ASK, "stop": [1], "temperature": "x"}),
    "chat two mistakes: bias before logprobs": (CHAT, {"messages": ASK, "logit_bias": {"99999": 1},
                                                       "top_logprobs": 2}),
    "chat two mistakes: format before tools conflict": (CHAT, {"messages": ASK, "tools": [TOOL],
                                                               "response_format": {"type": "x"}}),
    "chat two mistakes: fields before the prompt": (CHAT, {"messages": [{"role": "user", "content": LONG}],
                                                          "grammar": 'root ::= "a"', "json_schema": {}}),
    "chat tools and grammar": (CHAT, {"messages": ASK, "tools": [TOOL], "grammar": 'root ::= "a"'}),
    "chat tools and a response_format schema": (CHAT, {"messages": ASK, "tools": [TOOL], "response_format": {
        "type": "json_object", "schema": {"type": "object"}}}),
    "chat response_format and grammar": (CHAT, {"messages": ASK, "grammar": 'root ::= "a"', "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"type": "string"}}}}),
    "chat response_format schema": (CHAT, {"messages": ASK, "response_format": {"type": "json_object", "schema": 5}}),
    "chat context": (CHAT, {"messages": [{"role": "user", "content": LONG}]}),
    "chat template kwargs": (CHAT, {"messages": ASK, "chat_template_kwargs": {"tools": 1}}),
    "chat continue with tools": (CHAT, {"messages": [*ASK, {"role": "assistant", "content": "x"}], "tools": [TOOL]}),
    "chat bad grammar": (CHAT, {"messages": ASK, "grammar": "root ::= nothing"}),
    "chat bans every token": (CHAT, {"messages": ASK, "max_tokens": 2, "logit_bias": BAN}),
    "completions two mistakes: echo first": (COMPLETIONS, {"prompt": 5, "echo": True, "n": 0}),
    "completions two mistakes: grammar before prompt": (COMPLETIONS, {"grammar": "root ::= x y"}),
    "completions two mistakes: sequences before prompts": (COMPLETIONS, {"prompt": [[1, "x", {}]] * 4, "n": 5}),
    "completions suffix": (COMPLETIONS, {"prompt": "x", "suffix": "y"}),
    "completions empty text": (COMPLETIONS, {"prompt": ""}),
    "completions empty second": (COMPLETIONS, {"prompt": ["a", []]}),
    "completions context": (COMPLETIONS, {"prompt": [LONG, "a"]}),
    "completions id in the second": (COMPLETIONS, {"prompt": ["a", [1, 49152]]}),
    "completions huge first, malformed second": (COMPLETIONS, {"prompt": ["y" * 200_000, [1, "x", {}]]}),
    "completion huge text and a bad id": (COMPLETION, {"prompt": [5, 99_999_999, "y" * 200_000]}),
    "completion two mistakes: n_predict first": (COMPLETION, {"n_predict": -2, "n_probs": -1}),
    "completion two mistakes: stop before sampling": (COMPLETION, {"prompt": "x", "stop": 1, "top_p": 5}),
    "completion two mistakes: stream before grammar": (COMPLETION, {"prompt": "x", "stream": 1, "grammar": 1}),
    "completion two mistakes: fields before prompt": (COMPLETION, {"prompt": 5, "response_fields": 5}),
    "completion mixed prompt": (COMPLETION, {"prompt": ["ok", [1, 2.5]]}),
    "completion prompt object": (COMPLETION, {"prompt": {"multimodal_data": []}}),
    "completion context": (COMPLETION, {"prompt": LONG}),
    "completion token": (COMPLETION, {"prompt": [5, -1]}),
    "completion sequences": (COMPLETION, {"prompt": ["a"] * 17}),
    "completion grammar without tokens": (COMPLETION, {"prompt": "a", "grammar": 'root ::= "a"', "ignore_eos": True,
                                                       "n_predict": 3}),
    "tokenize two mistakes": ("/tokenize", {"content": 5, "with_pieces": 1}),
    "detokenize two mistakes": ("/detokenize", {"tokens": [49152, "a"]}),
    "apply-template tools": ("/apply-template", {"messages": ASK, "tools": [{"type": "function"}]}),
    "apply-template empty": ("/apply-template", {"messages": []}),
    "slot action": ("/slots/0?action=restore", None),
}
STREAM_ERRORS = {  # errors found once a stream has begun: the last event whole
    "chat stream bans every token": (CHAT, {"messages": ASK, "max_tokens": 2, "logit_bias": BAN, "stream": True}),
    "completion stream grammar without tokens": (COMPLETION, {"prompt": "a", "grammar": 'root ::= "a"',
                                                              "ignore_eos": True, "n_predict": 3, "stream": True}),
    "completions stream grammar without tokens": (COMPLETIONS, {"prompt": "a", "grammar": 'root ::= "a"',
                                                                "ignore_eos": True, "max_tokens": 3, "stream": True}),
}


def skeleton(value, key: str | None = None):
    """`value` with each string, number and count replaced by its JSON type (KEEP's kept)."""
    if isinstance(value, dict):
        return {k: skeleton(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(v, key) for v in value]
    if isinstance(value, str):
        return value if key in KEEP else "string"
    if isinstance(value, bool) or value is None:
        return value
    return "integer" if isinstance(value, int) else "number"


def events(r: httpx.Response) -> list:
    """A stream's event shapes in order, a run of equal shapes written once."""
    out: list = []
    for block in r.text.split("\n\n"):
        if not block:
            continue
        data = block.removeprefix("data: ")
        shape = data if data == "[DONE]" else skeleton(json.loads(data))
        if not out or out[-1] != shape:
            out.append(shape)
    return out


def observe(url: str) -> dict:
    """What the server at `url` writes back for every case."""
    out = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        for name, (path, body) in REPLIES.items():
            r = client.post(path, json=body)
            is_stream = r.headers["content-type"].startswith("text/event-stream")
            out[name] = {"status": r.status_code, "reply": events(r) if is_stream else skeleton(r.json())}
        for path in GETS:
            r = client.get(path)
            out["GET " + path] = {"status": r.status_code, "reply": skeleton(r.json())}
        for name, (path, body) in ERRORS.items():
            r = client.post(path, json=body)
            out[name] = {"status": r.status_code, "reply": r.json()}
        for name, (path, body) in STREAM_ERRORS.items():
            r = client.post(path, json=body)
            last = json.loads(r.text.strip().split("\n\n")[-1].removeprefix("data: "))
            out[name] = {"status": r.status_code, "reply": events(r)[:-1] + [last]}
    return out


@pytest.fixture(scope="module")
def observed(server):
    return observe(server.url)


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


@pytest.mark.parametrize("name", [*REPLIES, *("GET " + p for p in GETS), *ERRORS, *STREAM_ERRORS])
def test_reply_shape_is_as_recorded(observed, record, name):
    # compared as JSON text: the order of keys counts too
    assert json.dumps(observed[name], indent=1) == json.dumps(record[name], indent=1)


def test_the_record_covers_every_case(record):
    assert set(record) == {*REPLIES, *("GET " + p for p in GETS), *ERRORS, *STREAM_ERRORS}


if __name__ == "__main__":  # rewrite the record from the server as it is now
    from test_server_harness import MODEL_CFG, serve_model
    from ember.app import load_model

    model = load_model(MODEL_CFG)
    try:
        with serve_model(model) as live:
            live.wait_ready()
            RECORD.write_text(json.dumps(observe(live.url), indent=1, ensure_ascii=False) + "\n")
    finally:
        model.close()
    sys.exit(0)
