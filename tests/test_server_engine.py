"""ember serve where the engine meets the request: a full KV pool, stop strings, fairness between
clients, requests the sampler or the model cannot serve -- over real HTTP (httpx)."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from test_server_harness import MODEL_CFG, LiveServer, pages_leaked, serve_model, server, smollm  # noqa: F401
from ember.app import ServerConfig, create_app, load_model


@pytest.fixture(scope="module")
def one_small_slot():
    """`ember serve smollm2 --slots 1 --ctx 64`: 4 KV pages of 16 tokens."""
    model = load_model(MODEL_CFG.__class__(MODEL_CFG.model, device="cpu", threads=2, ctx=64, slots=1))
    with LiveServer(create_app(ServerConfig(), lambda: model)) as live:
        live.wait_ready()
        yield live


def test_a_generation_that_fills_the_kv_pool_answers(one_small_slot):
    """The prompt and its 50 tokens need all 4 pages, the one the cached prompt held included: the
    request answers (stop_type "limit", every token), and so do the requests queued behind it."""
    url = one_small_slot.url + "/completion"
    body = {"prompt": "Write a very long book.", "ignore_eos": True, "n_predict": 50}
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda b: httpx.post(url, json=b, timeout=120),
                                [body, {**body, "prompt": "Write a very long poem."}, {**body, "n_predict": -1}]))
    for r in replies:
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["stop_type"] == "limit"
    assert [r.json()["tokens_predicted"] for r in replies[:2]] == [50, 50]
    n_prompt = replies[2].json()["tokens_evaluated"]
    assert replies[2].json()["tokens_predicted"] == 64 - n_prompt  # -1: until the context is full
    assert pages_leaked(one_small_slot.state.model.engine) == 0


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/completion", {"prompt": "Hi", "n_predict": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
])
def test_stop_strings_over_the_length_limit_are_refused(server, route, body):
    """A stop string of 1,000 characters is accepted; one longer is a 400 naming the entry and the limit,
    whether stop is an array or a single string."""
    ok = httpx.post(server.url + route, json={**body, "stop": ["\n", "x" * 1000]}, timeout=60)
    assert ok.status_code == 200, ok.text
    for stop, param in ((["\n", "x" * 1001], "stop[1]"), ("y" * 300_000, "stop")):
        r = httpx.post(server.url + route, json={**body, "stop": stop}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "invalid_value"
        assert f"{len(stop) if isinstance(stop, str) else 1001} characters" in err["message"]
        assert "at most 1000" in err["message"]


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_clients_take_turns_by_api_key(one_small_slot):
    """One slot, two API keys: while alice's long request holds the slot, alice queues 10 more and
    bob one after them; bob's runs next, not after alice's 10. The engine tells clients apart by a
    digest of their key (the key itself stays out of it)."""
    model = one_small_slot.state.model
    eng = model.engine
    with serve_model(model, api_keys=("alice-key", "bob-key")) as live:
        live.wait_ready()
        url = live.url + "/completion"

        def ask(key: str, n: int, done: list, name: str):
            r = httpx.post(url, json={"prompt": "Once upon a time", "n_predict": n, "ignore_eos": True},
                           headers={"Authorization": f"Bearer {key}"}, timeout=120)
            assert r.status_code == 200, r.text
            done.append(name)

        done: list[str] = []
        with ThreadPoolExecutor(12) as pool:
            holder = pool.submit(ask, "alice-key", 40, done, "holder")
            wait_until(lambda: eng.scheduler.running)
            futures = [pool.submit(ask, "alice-key", 6, done, f"alice{i}") for i in range(10)]
            wait_until(lambda: len(eng.scheduler.waiting) == 10)
            futures.append(pool.submit(ask, "bob-key", 6, done, "bob"))
            wait_until(lambda: len(eng.scheduler.waiting) == 11)
            clients = {s.client for s in eng.scheduler.waiting + eng.scheduler.running}
            assert len(clients) == 2 and all(c.startswith("key:") and "alice" not in c for c in clients)
            for f in [holder] + futures:
                f.result()
    assert done[0] == "holder" and done.index("bob") <= 2, done


# ---- requests that leave no token, and a model that produces NaN ----

ASK = [{"role": "user", "content": "Tell me about dragons."}]
BAN_ALL = {str(i): False for i in range(49152)}  # SmolLM2's whole vocabulary


def no_token_error(r: httpx.Response, param) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "no_token_allowed" and err["param"] == param
    assert err["message"].startswith("no token is allowed")


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 3, "logit_bias": BAN_ALL}),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 3, "logit_bias": BAN_ALL, "stream": True}),
    ("/completion", {"prompt": "Hi", "n_predict": 3, "logit_bias": [[i, False] for i in range(49152)],
                     "presence_penalty": 1.5, "repeat_penalty": 1.3, "temperature": 0.8}),
    ("/completion", {"prompt": "Hi", "n_predict": 3, "ignore_eos": True,
                     "logit_bias": [[i, False] for i in range(49152) if i not in (0, 2)]}),  # 0, 2: end tokens
])
def test_a_logit_bias_that_bans_every_token_is_a_400(server, route, body):
    """Before any work, streaming or not, with penalties, or with ignore_eos banning the rest."""
    no_token_error(httpx.post(server.url + route, json=body, timeout=60), "logit_bias")


def test_a_logit_bias_that_leaves_one_token_gives_that_token(server):
    body = {"prompt": "Hi", "n_predict": 3, "logit_bias": {**BAN_ALL, "7": -5}, "return_tokens": True}
    r = httpx.post(server.url + "/completion", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == [7, 7, 7]


@pytest.mark.parametrize("body", [
    {"grammar": 'root ::= "a"', "logit_bias": [["a", False]]},  # the grammar allows only what the bias bans
    {"grammar": 'root ::= "a"', "ignore_eos": True},  # after "a" the grammar allows only the end, which is banned
    {"grammar": 'root ::= "a" | "b"', "logit_bias": [["a", False], ["b", False]], "presence_penalty": 1.0,
     "temperature": 0.7},
])
def test_a_grammar_left_without_tokens_is_a_400(server, body):
    """Found while generating: a 400 (an error event once a stream has begun), and the server goes on."""
    url = server.url + "/completion"
    no_token_error(httpx.post(url, json={"prompt": "Say a", "n_predict": 4, **body}, timeout=60), None)
    events = httpx.post(url, json={"prompt": "Say a", "n_predict": 4, "stream": True, **body}, timeout=60)
    assert events.status_code == 200
    last = json.loads(events.text.strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["code"] == "no_token_allowed"
    ok = httpx.post(url, json={"prompt": "Say a", "n_predict": 2, "grammar": 'root ::= "a"'}, timeout=60)
    assert ok.status_code == 200 and ok.json()["content"] == "a"
    assert pages_leaked(server.state.model.engine) == 0


@pytest.fixture(scope="module")
def nan_server(tmp_path_factory):
    """SmolLM2 with a NaN final norm: every logit of every request is NaN."""
    from gguf_edit import EditableCopy

    from ember import hub

    copy = EditableCopy(hub.resolve("smollm2"), tmp_path_factory.mktemp("nan") / "smollm2-nan.gguf")
    with copy.edit() as e:  # the file is mapped, not read: the edit lasts as long as the server
        e.set_bytes("output_norm.weight", 0, np.full(576, np.nan, np.float32).tobytes())
        model = load_model(MODEL_CFG.__class__(str(copy.path), device="cpu", threads=2, ctx=256, slots=2))
        with LiveServer(create_app(ServerConfig(), lambda: model)) as live:
            live.wait_ready()
            yield live
    copy.path.unlink()  # 100 MB: not for pytest's kept temp dirs


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 3}, {"mirostat": 2}])
def test_nan_weights_give_a_clear_500_per_request(nan_server, sampling):
    """Each request fails alone with a 500 that says the model produced non-finite logits (the model,
    not the request, is at fault), greedy (best ids found by the backend) or sampled; streams end
    with the same error; the server stays up and keeps no pages."""
    url = nan_server.url + "/v1/chat/completions"
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda _: httpx.post(url, json={"messages": ASK, "max_tokens": 4, **sampling},
                                                     timeout=60), range(3)))
    for r in replies:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "non_finite_logits"
        assert "the model produced non-finite logits (NaN" in err["message"] and "token -1" not in err["message"]
    events = httpx.post(url, json={"messages": ASK, "max_tokens": 4, "stream": True, **sampling}, timeout=60)
    last = json.loads(events.text.strip().split("\n\n")[-1].removeprefix("data: "))
    assert last["error"]["code"] == "non_finite_logits"
    assert httpx.get(nan_server.url + "/health").status_code == 200
    assert nan_server.state.model.engine.last_error is None  # no engine-wide failure
    assert pages_leaked(nan_server.state.model.engine) == 0
