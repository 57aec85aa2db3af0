"""ember serve where the engine meets the request: a full KV pool, stop strings, fairness between
clients, requests the sampler or the model cannot serve -- over real HTTP (httpx)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
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
