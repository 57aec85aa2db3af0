"""ember behind SGLang's Model Gateway (deploy/replicas.py), and the vLLM metric names routers read."""
from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
from replicas import STICKY_GATEWAYS, Cluster, gateway_module  # noqa: E402
from test_server_harness import server, smollm, wait_idle  # noqa: E402,F401


def scrape(url: str) -> dict[str, float]:
    """Unlabelled-by-le samples of /metrics: name -> value (labels dropped)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and 'le="' not in (m.group(2) or ""):
            out[m.group(1)] = float(m.group(3))
    return out


def test_vllm_metric_names_count_what_vllm_counts(server):
    before = scrape(server.url)
    prompt = "The prefix cache keeps this sentence for the second request. " * 3
    usages = []
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    wait_idle(server.state.model.engine)
    after = scrape(server.url)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert d["vllm:prefix_cache_queries_total"] == sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert d["vllm:prefix_cache_hits_total"] == cached and cached >= usages[1]["prompt_tokens"] - 16
    assert d["vllm:time_to_first_token_seconds_count"] == 2 and d["vllm:time_to_first_token_seconds_sum"] > 0
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0  # pages only the prefix cache holds count as free
    text = httpx.get(server.url + "/metrics").text
    assert re.search(r'^vllm:num_requests_waiting\{model_name="[^"]+"\} ', text, re.M)
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def cluster_port(replicas: int = 2) -> int:
    """A gateway port whose cluster's ports (the gateway's, replica i's at +1 + i, their KV events'
    at +101 + i, the metrics' at +200) are all free now. Taken below the kernel's ephemeral range
    (32768 on): an ephemeral port next to another, as free_port() gives, may be an outgoing
    connection's a moment later, and a replica then fails to bind."""
    import random
    import socket

    offsets = [0, 200] + [1 + i for i in range(replicas)] + [101 + i for i in range(replicas)]
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - 300)
        try:
            for off in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports for a cluster")


@pytest.mark.skipif(gateway_module() is None,
                    reason="SGLang's Model Gateway is not installed (pip install smg, or sglang-router)")
def test_a_sessions_turns_keep_hitting_one_replicas_cache(tmp_path):
    port = cluster_port()
    with Cluster(replicas=2, policy="cache_aware", port=port, ctx=1024, slots=1, log_dir=str(tmp_path)) as cluster:
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        sessions = [[{"role": "system", "content": f"You are assistant {name}. " + f"{name} knows {topic}. " * 30}]
                    for name, topic in (("Ada", "the tides"), ("Brook", "old maps"))]
        served: list[list[tuple[int, float]]] = [[], []]
        for turn in range(3):
            for s, msgs in enumerate(sessions):
                msgs.append({"role": "user", "content": f"Question {turn}: tell me one fact."})
                before = [scrape(u) for u in cluster.worker_urls]
                r = httpx.post(cluster.url + "/v1/chat/completions", timeout=300,
                               json={"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0})
                assert r.status_code == 200, r.text
                msgs.append({"role": "assistant", "content": "One fact."})  # fixed: the next turn extends it
                after = [scrape(u) for u in cluster.worker_urls]
                grew = [i for i in range(2) if after[i]["vllm:prefix_cache_queries_total"]
                        > before[i]["vllm:prefix_cache_queries_total"]]
                assert len(grew) == 1, grew
                i = grew[0]
                hits = after[i]["vllm:prefix_cache_hits_total"] - before[i]["vllm:prefix_cache_hits_total"]
                queries = after[i]["vllm:prefix_cache_queries_total"] - before[i]["vllm:prefix_cache_queries_total"]
                served[s].append((i, hits / queries))
    for turns in served:
        assert len({i for i, _ in turns}) == 1, served  # one replica for all of a session's turns
        assert all(rate > 0.8 for _, rate in turns[1:]), served  # and its cache for all but the first


@pytest.mark.skipif(gateway_module() not in STICKY_GATEWAYS, reason="sticky sessions need smg (pip install smg)")
def test_keyed_conversations_sharing_a_system_prompt_spread_and_stick(tmp_path):
    """Text alone would send both to the replica holding the shared system prompt; the conversations'
    keys (a header for one, a body rid with turn suffixes for the other) spread them and keep them."""
    port = cluster_port()
    system = {"role": "system", "content": "You answer questions about tides and old maps. " * 40}
    with Cluster(replicas=2, policy="cache_aware", port=port, ctx=1024, slots=1, log_dir=str(tmp_path)) as cluster:
        model = httpx.get(cluster.url + "/v1/models").json()["data"][0]["id"]
        convs = {"a": [system], "b": [system]}

        def turn(name: str, t: int) -> tuple[str, dict]:
            msgs = convs[name]
            msgs.append({"role": "user", "content": f"Conversation {name}, question {t}: one fact."})
            body = {"model": model, "messages": msgs, "max_tokens": 4, "temperature": 0}
            headers = {"x-smg-routing-key": "conv-a"} if name == "a" else {}
            if name == "b":
                body["rid"] = f"conv-b_t{t}"
            r = httpx.post(cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
            assert r.status_code == 200, r.text
            msgs.append({"role": "assistant", "content": "One fact."})
            return r.headers["x-smg-routed-worker-id"], r.json()["usage"]

        with ThreadPoolExecutor(2) as pool:  # both first turns in flight at once
            first = dict(zip("ab", pool.map(turn, "ab", (0, 0))))
        later = {name: [turn(name, t) for t in (1, 2)] for name in "ab"}
    assert first["a"][0] != first["b"][0], first  # spread, though both share the system prompt
    for name in "ab":
        assert {w for w, _ in later[name]} == {first[name][0]}, (name, first, later)
        for _, usage in later[name]:
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"], later


# Bodies as the gateways forward them (captured from smg 1.13.0 and sglang-router 0.3.2): they
# re-serialize the request and add their defaults, SGLang's own fields included.
GATEWAY_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": False, "max_tokens": 4,
                              "stream": False, "temperature": 0.0}),
    ("/v1/completions", {"prompt": "hi", "echo": False, "max_tokens": 4, "stream": False}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": False,
                              "max_completion_tokens": 4, "stream": False, "no_stop_trim": False,
                              "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
                              "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": False, "echo": False, "no_stop_trim": False,
                         "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False}),
]


@pytest.mark.parametrize("route, body", GATEWAY_BODIES)
def test_what_the_gateways_forward_is_served(server, route, body):
    r = httpx.post(server.url + route, json={"model": "smollm2", **body}, timeout=120)
    assert r.status_code == 200, r.text
    assert 1 <= r.json()["usage"]["completion_tokens"] <= 4
