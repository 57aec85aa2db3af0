"""Where clients written for llama-server rely on its behaviour, ember serve behaves the same
(reply shapes checked against llama-server's on the same model file): any model name, the
native /completions, CORS, assistant prefill, template variables, /completion's reply fields
and streaming extras, chat stream details, the context-overflow error, /metrics, /slots,
/v1/models, server-wide sampling defaults and sleeping when idle. Official openai client or
raw HTTP, on SmolLM2."""
from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone

import httpx
import openai
import pytest
from openai import OpenAI

from conftest import golden
from test_server_harness import (MODEL_CFG, LiveServer, assert_error, serve_model, server, smollm,  # noqa: F401
                                 wait_for, wait_idle)
from ember.app import ServerConfig, create_app, load_model
from ember.cli import build_parser, server_config

ASK = [{"role": "user", "content": "Hi"}]
PREFILL = [*ASK, {"role": "assistant", "content": "Hello, my name"}]


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def sse(r: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def stream(url: str, body: dict) -> list:
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return sse(r)


# ---- names and routes ----

def test_any_model_name_is_served(client, smollm):
    for name in ("gpt-3.5-turbo", "gpt-4o", "whatever"):
        r = client.chat.completions.create(model=name, messages=ASK, max_tokens=1)
        assert r.model == smollm.id == "SmolLM2-135M-Instruct.Q4_1"
    r = client.completions.create(model="text-davinci-003", prompt="Hi", max_tokens=1)
    assert r.model == smollm.id


def test_completions_without_v1_is_the_native_route(server):
    r = httpx.post(server.url + "/completions", json={"prompt": "1, 2, 3,", "n_predict": 2, "temperature": 0}).json()
    assert r["stop_type"] == "limit" and r["tokens_predicted"] == 2 and "choices" not in r
    assert r["content"] == httpx.post(server.url + "/completion", json={
        "prompt": "1, 2, 3,", "n_predict": 2, "temperature": 0}).json()["content"]


def test_models_lists_aliases_and_tags(smollm):
    with serve_model(smollm, aliases=("smol", "smollm"), tags=("t1", "t2")) as live:
        live.wait_ready()
        client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == "smol" and model.aliases == ["smol", "smollm"] and model.tags == ["t1", "t2"]
        raw = httpx.get(live.url + "/models").json()
        assert raw["models"][0]["name"] == "smol" and raw["models"][0]["tags"] == ["t1", "t2"]
        assert client.chat.completions.create(model="anything", messages=ASK, max_tokens=1).model == "smol"


def test_models_without_aliases(server, smollm):
    data = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert data["aliases"] == [smollm.id] and data["tags"] == []
    assert set(data["meta"]) >= {"n_vocab", "n_ctx_train", "n_ctx", "size"}


# ---- CORS as llama-server does it ----

PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}


def test_preflight_from_an_allowed_origin(server):
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173"):
        r = httpx.options(server.url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        allowed = [h.strip() for h in r.headers["access-control-allow-headers"].split(",")]
        assert "*" in allowed and "authorization" in allowed  # "*" never covers Authorization


def test_preflight_from_a_refused_origin(server):
    r = httpx.options(server.url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/health")  # no Origin: still 200, as llama-server answers
    assert r.status_code == 200


def test_listed_origins(smollm):
    with serve_model(smollm, cors_origins=("https://app.example",)) as live:
        live.wait_ready()
        ok = httpx.get(live.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        assert_error(httpx.get(live.url + "/v1/models", headers={"Origin": "http://localhost:3000"}), 403)


# ---- chat: prefill and template variables ----

def test_final_assistant_message_is_continued(server, client):
    prompt = httpx.post(server.url + "/apply-template", json={"messages": PREFILL}).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\nHello, my name")
    r = client.chat.completions.create(model="x", messages=PREFILL, max_tokens=4, temperature=0)
    native = httpx.post(server.url + "/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0}).json()
    # the reply is the whole message: the prefill and its continuation, as llama-server returns it
    assert r.choices[0].message.content == "Hello, my name" + native["content"]
    assert r.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="x", messages=PREFILL, max_tokens=4, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_continue_final_message_and_its_refusals(server):
    ok = {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False}
    same = httpx.post(server.url + "/apply-template", json=ok).json()["prompt"]
    assert same == httpx.post(server.url + "/apply-template", json={"messages": PREFILL}).json()["prompt"]
    cases = [
        ({"messages": PREFILL, "continue_final_message": True}, "continue_final_message"),
        ({"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ({"messages": [*PREFILL, {"role": "assistant", "content": "again"}]}, "messages"),
        ({"messages": ASK, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ]
    for body, param in cases:
        for path in ("/apply-template", "/v1/chat/completions"):
            assert_error(httpx.post(server.url + path, json=body), 400, param)


def test_closing_the_final_assistant_message_on_request(server):
    closed = httpx.post(server.url + "/apply-template", json={"messages": [*PREFILL, {"role": "user", "content": "?"}]})
    assert closed.json()["prompt"].endswith("Hello, my name<|im_end|>\n<|im_start|>user\n?<|im_end|>\n"
                                            "<|im_start|>assistant\n")


VARIABLES_TEMPLATE = ("{{ date_string }}|{{ strftime_now('%Y-%m-%d') }}|{{ datetime }}|{{ functions }}|"
                      "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "vars.jinja"
    path.write_text(VARIABLES_TEMPLATE)
    model = load_model(replace(MODEL_CFG, chat_template_file=str(path), slots=1))
    with serve_model(model) as live:
        live.wait_ready()
        yield live
    model.close()


def test_template_variables(templated):
    before = datetime.now()
    text = httpx.post(templated.url + "/apply-template", json={"messages": ASK}).json()["prompt"]
    date_string, today, stamp, functions, rest = text.split("|")
    assert date_string == before.strftime("%d %b %Y") and today == before.strftime("%Y-%m-%d")
    assert stamp.endswith(" GMT") and stamp.startswith(datetime.now(timezone.utc).strftime("%b %d %Y"))
    assert functions == "" and rest == "user:Hi;"
    override = {"messages": ASK, "chat_template_kwargs": {"date_string": "26 Jul 2024"}}
    assert httpx.post(templated.url + "/apply-template", json=override).json()["prompt"].startswith("26 Jul 2024|")


# ---- /completion's reply ----

def test_completion_reply_fields(server, smollm):
    r = httpx.post(server.url + "/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                                     "temperature": 0, "stop": ["xyz"], "top_k": 7}).json()
    settings = r["generation_settings"]
    assert settings["temperature"] == 0 and settings["top_k"] == 7 and settings["n_predict"] == 4
    assert settings["stop"] == ["xyz"] and settings["seed"] == 0xFFFFFFFF and settings["samplers"]
    assert r["prompt"] == "The capital of France is" and r["tokens_evaluated"] == 5
    assert r["content"] == " Paris.\n\n" and r["has_new_line"] is True  # llama.cpp's greedy reply (golden data)
    assert r["tokens"] == [] and r["truncated"] is False and r["stop_type"] == "limit"


def test_completion_stream_carries_token_ids(server):
    events = stream(server.url + "/completion", {"prompt": "The capital of France is", "n_predict": 3,
                                                 "temperature": 0, "stream": True})
    assert [e["tokens"] for e in events[:-1]] == [[7042], [30], [198]]  # llama.cpp's greedy ids (golden data)
    assert all(e["tokens_evaluated"] == 5 and e["stop"] is False for e in events[:-1])
    final = events[-1]
    assert final["stop"] is True and final["tokens"] == [] and final["generation_settings"]["stream"] is True


def test_response_fields(server):
    body = {"prompt": "The capital of France is", "n_predict": 2, "temperature": 0,
            "response_fields": ["content", "generation_settings/n_predict", "timings/predicted_n", "nope"]}
    assert httpx.post(server.url + "/completion", json=body).json() == {
        "content": " Paris.", "generation_settings/n_predict": 2, "timings/predicted_n": 2}
    several = httpx.post(server.url + "/completion", json={**body, "prompt": ["A", "B"], "n_predict": 1,
                                                           "response_fields": ["index"]}).json()
    assert several == [{"index": 0}, {"index": 1}]
    final = stream(server.url + "/completion", {**body, "stream": True})[-1]
    assert set(final) == {"content", "generation_settings/n_predict", "timings/predicted_n"}


def test_return_progress_and_timings_per_token(server):
    events = stream(server.url + "/completion", {"prompt": "Once upon a time there was", "n_predict": 3,
                                                 "stream": True, "return_progress": True, "timings_per_token": True})
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert len(progress) == 2 and all(p["total"] == 6 for p in progress)  # the prompt starts, its step ran
    assert progress[0]["processed"] == progress[0]["cache"] == progress[1]["cache"] <= 5
    assert progress[1]["processed"] == events[1]["tokens_evaluated"] == 6
    assert 0 <= progress[0]["time_ms"] <= progress[1]["time_ms"]
    assert all(e["content"] == "" and e["tokens"] == [] and e["tokens_predicted"] == 0 for e in events[:2])
    tokens = events[2:-1]
    assert len(tokens) == 3 and all("prompt_progress" not in e for e in tokens)
    assert [e["timings"]["predicted_n"] for e in tokens] == [1, 2, 3]
    assert all(e["timings"]["prompt_n"] + e["timings"]["cache_n"] == 6 for e in tokens)
    plain = stream(server.url + "/completion", {"prompt": "Once upon a time there was", "n_predict": 3, "stream": True})
    assert all("prompt_progress" not in e for e in plain) and len(plain) == 4


@pytest.fixture(scope="module")
def small_steps():
    """A server computing at most 32 tokens a step: a longer prompt takes several."""
    model = load_model(replace(MODEL_CFG, batch=32, slots=1))
    with serve_model(model) as live:
        live.wait_ready()
        yield live
    model.close()


def test_return_progress_reports_each_prompt_step(small_steps):
    """A prompt of 101 tokens computed 32 a step gets progress as llama-server (-b 32) sends it:
    once when it starts (0 processed), then after each step (32, 64, 96, 101), before its first
    token; the same prompt extended starts from what the cache holds of it."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    body = {"prompt": prompt, "n_predict": 2, "stream": True, "return_progress": True}
    events = stream(small_steps.url + "/completion", body)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert [(p["processed"], p["cache"], p["total"]) for p in progress] == [(n, 0, 101) for n in (0, 32, 64, 96, 101)]
    assert [p["time_ms"] for p in progress] == sorted(p["time_ms"] for p in progress)
    assert events[len(progress)]["tokens_predicted"] == 1 and "prompt_progress" not in events[len(progress)]
    longer = stream(small_steps.url + "/completion", {**body, "prompt": prompt + " And more text here.", "n_predict": 1})
    progress = [e["prompt_progress"] for e in longer if "prompt_progress" in e]
    cached = progress[0]["cache"]
    assert 96 <= cached <= 101 and progress[0]["processed"] == cached  # whole pages of the first prompt
    assert [p["processed"] for p in progress] == [cached, 106] and all(p["total"] == 106 for p in progress)


def test_prompt_string_objects(server):
    one = httpx.post(server.url + "/completion", json={"prompt": {"prompt_string": "The capital of France is"},
                                                       "n_predict": 2, "temperature": 0}).json()
    assert one["content"] == " Paris." and one["prompt"] == "The capital of France is"
    two = httpx.post(server.url + "/completion", json={"prompt": [{"prompt_string": "A"}, {"prompt_string": "B"}],
                                                       "n_predict": 1}).json()
    assert [r["prompt"] for r in two] == ["A", "B"]
    bad = {"prompt": {"prompt_string": "x", "multimodal_data": ["aGk="]}}
    assert_error(httpx.post(server.url + "/completion", json=bad), 400, "prompt.multimodal_data", "unsupported")


# ---- chat streams ----

def test_chat_stream_starts_with_null_content_and_ends_with_timings(server, client):
    events = stream(server.url + "/v1/chat/completions", {"messages": ASK, "max_tokens": 3, "stream": True})
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["timings"]["predicted_n"] == 3 and all("timings" not in e for e in events[:-1])
    with_usage = stream(server.url + "/v1/chat/completions", {"messages": ASK, "max_tokens": 3, "stream": True,
                                                              "stream_options": {"include_usage": True}})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["timings"]["predicted_n"] == 3
    chunks = list(client.chat.completions.create(model="x", messages=ASK, max_tokens=2, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None


def test_context_overflow_with_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "word " * 1500}])
    assert e.value.code == "context_length_exceeded"
    err = e.value.body
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1500


# ---- /metrics and /slots ----

def test_metrics_additions(server, smollm):
    httpx.post(server.url + "/completion", json={"prompt": "The capital of France is", "n_predict": 3})
    httpx.post(server.url + "/completion", json={"prompt": "The capital of France is", "n_predict": 3})
    r = httpx.get(server.url + "/metrics")
    assert abs(int(r.headers["process-start-time-unix"]) - server.state.started) < 1
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in r.text.splitlines() if line[0] != "#"}
    m = smollm.engine.metrics
    assert values["llamacpp:prompt_tokens_cached_total"] == m.prompt_tokens_cached > 0
    assert values["llamacpp:n_tokens_max"] >= 8
    assert 1 <= values["llamacpp:n_busy_slots_per_decode"] <= 4


def test_slots_next_token_is_a_list(server, smollm):
    with httpx.stream("POST", server.url + "/completion", json={"prompt": "Once", "n_predict": 200, "stream": True,
                                                                "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(lines)
        busy = [s for s in httpx.get(server.url + "/slots").json() if s["is_processing"]]
    assert len(busy) == 1
    (nxt,) = busy[0]["next_token"]
    assert nxt["has_next_token"] is True and nxt["n_decoded"] >= 1 and nxt["n_remain"] == 200 - nxt["n_decoded"]
    wait_idle(smollm.engine)
    idle = httpx.get(server.url + "/slots").json()
    assert all(s["next_token"] == [{"has_next_token": False, "n_decoded": 0, "n_remain": -1}] for s in idle)


# ---- server-wide sampling defaults ----

def test_sampling_default_flags(smollm):
    args = build_parser().parse_args(["serve", "--temp", "0", "--top-k", "7", "--top-p", "0.5", "--min-p", "0.1",
                                      "--seed", "42", "-n", "5"])
    config = server_config(args)
    with serve_model(smollm, **{f: getattr(config, f) for f in ("sampling", "n_predict")}) as live:
        live.wait_ready()
        params = httpx.get(live.url + "/props").json()["default_generation_settings"]["params"]
        assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"], params["seed"],
                params["n_predict"]) == (0.0, 7, 0.5, 0.1, 42, 5)
        r = httpx.post(live.url + "/completion", json={"prompt": "1, 2, 3, 4, 5,", "return_tokens": True}).json()
        count = next(c for c in golden("smollm2", "greedy")["cases"] if c["name"] == "count")
        assert r["tokens"] == count["completion_ids"][:5]  # greedy: llama.cpp's tokens
        settings = r["generation_settings"]
        assert (settings["temperature"], settings["top_k"], settings["seed"]) == (0.0, 7, 42)
        hot = httpx.post(live.url + "/completion", json={"prompt": "Hi", "temp": 1.5, "n_predict": 1}).json()
        assert hot["generation_settings"]["temperature"] == 1.5  # a request's own value wins, either spelling


def test_default_flags_are_validated():
    with pytest.raises(ValueError, match="top_p"):
        ServerConfig(sampling=(("top_p", 2.0),))


# ---- sleeping when idle ----

def test_sleep_when_idle_and_wake_on_request():
    app = create_app(ServerConfig(sleep_idle_s=0.5), lambda: load_model(replace(MODEL_CFG, slots=1)))
    with LiveServer(app) as live:
        live.wait_ready()
        state = live.state
        first = httpx.post(live.url + "/completion", json={"prompt": "Hi", "n_predict": 2}).json()
        wait_for(lambda: httpx.get(live.url + "/props").json()["is_sleeping"])
        assert state.model is None and httpx.get(live.url + "/health").json() == {"status": "ok"}
        assert httpx.get(live.url + "/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
        asleep = httpx.get(live.url + "/metrics").text
        assert "llamacpp:tokens_predicted_total 2.0" in asleep
        # the next request loads the model again and is served
        again = httpx.post(live.url + "/completion", json={"prompt": "Hi", "n_predict": 2})
        assert again.status_code == 200 and again.json()["tokens_predicted"] == 2
        # the counters went on from where they were
        assert "llamacpp:tokens_predicted_total 4.0" in httpx.get(live.url + "/metrics").text
        assert first["tokens_predicted"] == 2
