"""ember serve's hard edges over real HTTP (httpx): every client mistake is a 4xx with an
OpenAI-style error body, disconnects cancel work, a full queue answers 503 while /health and
/metrics keep answering, /health says 503 while loading, keys/CORS/body limits. (Shutdown and
hostile clients: test_server_hardening.py.)"""
from __future__ import annotations

import re
import threading
from dataclasses import replace

import httpx
import pytest

from test_server_harness import (MODEL_CFG, LiveServer, assert_error, pages_leaked, serve_model, server,  # noqa: F401
                                 smollm, wait_for, wait_idle)
from ember.app import ServerConfig, create_app, load_model

ASK = [{"role": "user", "content": "Tell me a long story about a dragon."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


CHAT_MISTAKES = [
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": []}, "messages", "missing_field"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type", "unsupported_content"),
    ({"messages": ASK, "n": "2"}, "n", "invalid_type"),
    ({"messages": ASK, "n": 17}, "n", "invalid_value"),
    ({"messages": ASK, "n": 0}, "n", "invalid_value"),
    ({"messages": ASK, "max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"messages": ASK, "max_completion_tokens": 1.5}, "max_completion_tokens", "invalid_type"),
    ({"messages": ASK, "stream": "yes"}, "stream", "invalid_type"),
    ({"messages": ASK, "stop": [1]}, "stop[0]", "invalid_type"),
    ({"messages": ASK, "temperature": "hot"}, "temperature", "invalid_value"),
    ({"messages": ASK, "top_p": 2}, "top_p", "invalid_value"),
    ({"messages": ASK, "seed": "x"}, "seed", "invalid_value"),
    ({"messages": ASK, "mirostat": 3}, "mirostat", "invalid_value"),
    ({"messages": ASK, "samplers": ["infill"]}, "samplers", "invalid_value"),
    ({"messages": ASK, "model": 4}, "model", "invalid_type"),
    ({"messages": ASK, "logit_bias": {"999999": 5}}, "logit_bias", "invalid_value"),
    ({"messages": ASK, "logit_bias": {"12": "x"}}, "logit_bias", "invalid_value"),
    ({"messages": ASK, "logit_bias": [1, 2, 3]}, "logit_bias", "invalid_value"),
    ({"messages": ASK, "top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"messages": ASK, "logprobs": True, "top_logprobs": 50}, "top_logprobs", "invalid_value"),
    ({"messages": ASK, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"messages": ASK, "response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing_field"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"messages": ASK, "json_schema": {"type": "string", "pattern": "(?=a)b"}}, "json_schema", "invalid_json_schema"),
    ({"messages": ASK, "json_schema": {"allOf": [{"required": 5}, {"required": ["a"]}]}}, "json_schema",
     "invalid_json_schema"),
    ({"messages": ASK, "grammar": "root ::= ( \"a\""}, "grammar", "invalid_grammar"),
    ({"messages": ASK, "grammar": "root ::= undefined-rule"}, "grammar", "invalid_grammar"),
    ({"messages": ASK, "grammar": 'root ::= "a"', "json_schema": {}}, "grammar", "conflicting_fields"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name", "invalid_value"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "color"}}}}}]},
     "tools[0].function.parameters", "invalid_json_schema"),
    ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": ["date"]}}}}}]},
     "tools[0].function.parameters", "invalid_json_schema"),
    ({"messages": ASK, "tools": [TOOL, TOOL]}, "tools", "invalid_value"),
    ({"messages": ASK, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"messages": ASK, "tools": [TOOL], "tool_choice": "always"}, "tool_choice", "invalid_value"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"messages": ASK, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "conflicting_fields"),
    ({"messages": ASK, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "invalid_value"),
]


@pytest.mark.parametrize("body,param,code", CHAT_MISTAKES, ids=[p for _, p, _ in CHAT_MISTAKES])
def test_chat_mistakes_are_400_naming_the_field(server, body, param, code):
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body), 400, param, code)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'{"messages": NaN}', b"\xff\xfe", b"[" * 100000])
def test_malformed_bodies(server, raw):
    assert_error(httpx.post(server.url + "/v1/chat/completions", content=raw), 400, None, "invalid_json")


OTHER_MISTAKES = [
    ("/v1/completions", {"prompt": 5}, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt[1]", "invalid_token"),
    ("/v1/completions", {"prompt": []}, "prompt", "empty_prompt"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echo", "unsupported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs", "invalid_value"),
    ("/completion", {"prompt": "x", "n_predict": -2}, "n_predict", "invalid_value"),
    ("/completion", {"prompt": "x", "n_probs": "3"}, "n_probs", "invalid_type"),
    ("/completion", {"prompt": ["a", "b"], "stream": True}, "prompt", "unsupported"),
    ("/completion", {"prompt": [[1, 2], [3, "x", {}]]}, "prompt[1][2]", "invalid_type"),
    ("/completion", {"n_predict": 3}, "prompt", "missing_field"),
    ("/tokenize", {}, "content", "missing_field"),
    ("/tokenize", {"content": "x", "add_special": 1}, "add_special", "invalid_type"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]", "invalid_token"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "invalid_type"),
    ("/apply-template", {"messages": [{"content": "no role"}]}, "messages[0].role", "missing_field"),
]


@pytest.mark.parametrize("path,body,param,code", OTHER_MISTAKES, ids=[f"{p}:{q}" for p, _, q, _ in OTHER_MISTAKES])
def test_other_route_mistakes(server, path, body, param, code):
    assert_error(httpx.post(server.url + path, json=body), 400, param, code)


def test_prompt_too_long_names_both_lengths(server, smollm):
    text = "word " * 1500
    n = len(smollm.tokenizer.encode(text, add_special=True, parse_special=True))
    both = {"n_prompt_tokens", "n_ctx"}  # llama-server's error type and counts, with OpenAI's code
    for path in ("/v1/completions", "/completion"):
        err = assert_error(httpx.post(server.url + path, json={"prompt": text}), 400, "prompt",
                           "context_length_exceeded", extra=both)
        assert re.search(rf"\b{n}\b", err["message"]) and "1024" in err["message"]
        assert err["type"] == "exceed_context_size_error" and (err["n_prompt_tokens"], err["n_ctx"]) == (n, 1024)
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
    err = assert_error(chat, 400, "messages", "context_length_exceeded", extra=both)
    assert err["n_prompt_tokens"] > 1500 and "1024" in err["message"]


def test_unknown_route_and_method(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404, None, "not_found")
    assert_error(httpx.get(server.url + "/v1/chat/completions"), 405, None, "method_not_allowed")


def test_disconnect_mid_stream_cancels_and_frees_pages(server, smollm):
    engine = smollm.engine
    wait_idle(engine)
    cancelled = engine.metrics.requests_cancelled
    body = {"messages": ASK, "max_tokens": 1000, "stream": True, "temperature": 1.0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
        assert engine.scheduler.running and engine.kv_usage().pages_in_use > 0
    # the connection is closed: the sequence is cancelled and its pages come back
    wait_idle(engine, timeout=20)
    assert engine.metrics.requests_cancelled == cancelled + 1
    assert pages_leaked(engine) == 0 and engine.kv_usage().pages_in_use == 0
    assert not server.state.active and any(line.startswith("data: ") for line in got)


def test_disconnect_while_waiting_for_a_whole_answer(server, smollm):
    engine = smollm.engine
    wait_idle(engine)
    cancelled = engine.metrics.requests_cancelled
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 1000, "ignore_eos": True},
                   timeout=0.5)
    wait_idle(engine, timeout=20)
    assert engine.metrics.requests_cancelled == cancelled + 1 and pages_leaked(engine) == 0


def test_queue_full_is_503_while_health_and_metrics_answer():
    model = load_model(replace(MODEL_CFG, slots=1, max_queue=1))
    try:
        with serve_model(model) as live:
            live.wait_ready()
            long = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=long) as running:
                lines = running.iter_lines()  # kept: dropping the iterator would close the connection
                next(lines)  # the first sequence runs (holds the only slot)
                with httpx.stream("POST", live.url + "/v1/completions", json=long) as waiting:
                    wait_for(lambda: len(model.engine.scheduler.waiting) == 1)
                    r = httpx.post(live.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                    assert_error(r, 503, None, "queue_full")
                    assert int(r.headers["retry-after"]) >= 1
                    assert httpx.get(live.url + "/health").status_code == 200
                    metrics = httpx.get(live.url + "/metrics").text
                    assert "ember:requests_rejected_queue_full_total 1.0" in metrics
                    assert "llamacpp:requests_deferred 1.0" in metrics
                    assert waiting.status_code == 200
            wait_idle(model.engine)
            assert pages_leaked(model.engine) == 0
    finally:
        model.close()


def test_health_is_503_while_loading(smollm):
    release = threading.Event()

    def slow_loader():
        release.wait(30)
        return smollm

    with LiveServer(create_app(ServerConfig(), slow_loader, close_model=False)) as live:
        r = httpx.get(live.url + "/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert_error(httpx.post(live.url + "/v1/chat/completions", json={"messages": ASK}), 503)
        release.set()
        live.wait_ready()
        assert httpx.get(live.url + "/health").json() == {"status": "ok"}


def test_api_keys(smollm):
    with serve_model(smollm, api_keys=("k1", "k2")) as live:
        live.wait_ready()
        url = live.url + "/v1/models"
        assert_error(httpx.get(url), 401, None, "invalid_api_key")
        assert_error(httpx.get(url, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(httpx.get(url, headers={"Authorization": "k1"}), 401)  # not a Bearer header
        assert httpx.get(url, headers={"Authorization": "Bearer k2"}).status_code == 200
        assert httpx.get(url, headers={"X-Api-Key": "k1"}).status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200  # open for probes
        assert_error(httpx.get(live.url + "/metrics"), 401)


def test_cors_origins(server, smollm):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    with serve_model(smollm, cors_origins=("http://app.example",), api_keys=("k",)) as live:
        live.wait_ready()
        r = httpx.options(live.url + "/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.get(live.url + "/v1/models", headers={"Origin": "http://app.example", "X-Api-Key": "k"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.options(live.url + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"


def test_body_size_limit(smollm):
    with serve_model(smollm, max_body_bytes=4096) as live:
        live.wait_ready()
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        assert_error(httpx.post(live.url + "/v1/chat/completions", json=big), 413, None, "body_too_large")

        def chunks():  # no Content-Length: the limit applies while reading
            for _ in range(10):
                yield b" " * 1000

        r = httpx.post(live.url + "/v1/chat/completions", content=chunks())
        assert_error(r, 413, None, "body_too_large")
        ok = httpx.post(live.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 1})
        assert ok.status_code == 200
