"""ember replicas behind SGLang's Model Gateway: cache_aware against round_robin routing.

The agent workload of agent.py, sent through the gateway's /v1/chat/completions: S sessions run
concurrently, each T turns one after another; every turn re-sends the shared system prompt (tool
definitions), the session's conversation so far (fixed assistant replies) and a new user message.
Runs, each on freshly started replicas (deploy/replicas.py): one replica (the ceiling: every
prefix lands where it was cached), then R replicas under each policy.

Reports per run: prefix-cache hit rate summed over the replicas and per replica (from their
vllm:prefix_cache_queries / _hits), prompt tokens computed (llamacpp:prompt_tokens), time to
first token p50/p99 as the client sees it (streamed), total time, and the load average before and
after (the machine may be shared: compare runs of one invocation, not across invocations).
Writes bench/results/cluster.json.

    python bench/cluster.py [--replicas 3] [--sessions 12] [--turns 4] [--system-tokens 700] [--gen 16]
                            [--policies cache_aware round_robin] [--no-single] [--repeat 1] [--kv-memory 384M]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "deploy"))
from agent import system_prompt, user_text  # noqa: E402
from replicas import Cluster  # noqa: E402


def conversations(sessions: int, turns: int, system_tokens: int, seed: int) -> list[list[list[dict]]]:
    """messages[session][turn]: what each request sends."""
    rng = random.Random(seed)
    system = system_prompt(system_tokens, lambda text: range(len(text) // 4))  # about 4 characters a token
    out = []
    for _ in range(sessions):
        msgs, turns_out = [{"role": "system", "content": system}], []
        for _ in range(turns):
            msgs.append({"role": "user", "content": user_text(rng, rng.randrange(40, 80))})
            turns_out.append(list(msgs))
            msgs.append({"role": "assistant", "content": user_text(rng, 24)})
        out.append(turns_out)
    return out


def ask(url: str, model: str, messages: list[dict], gen: int) -> float:
    """Time to the first streamed chunk with text of one chat completion (read to its end)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": gen, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0, ttft = time.perf_counter(), None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if ttft is None and line.startswith(b"data: {") and _has_text(json.loads(line[6:])):
                ttft = time.perf_counter() - t0
    return ttft if ttft is not None else float("nan")


def _has_text(chunk: dict) -> bool:
    return any(c.get("delta", {}).get("content") for c in chunk.get("choices", []))


def scrape(url: str) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "llamacpp:prompt_tokens_total")
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in wanted:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def run(cluster: Cluster, convs: list[list[list[dict]]], gen: int) -> dict:
    with urllib.request.urlopen(cluster.url + "/v1/models") as r:
        model = json.loads(r.read())["data"][0]["id"]
    ttfts: list[float] = []
    lock = threading.Lock()

    def session(turns: list[list[dict]]) -> None:
        for messages in turns:
            t = ask(cluster.url, model, messages, gen)
            with lock:
                ttfts.append(t)

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=session, args=(turns,)) for turns in convs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    per = [scrape(u) for u in cluster.worker_urls]
    queries = sum(p["vllm:prefix_cache_queries_total"] for p in per)
    hits = sum(p["vllm:prefix_cache_hits_total"] for p in per)
    return {
        "policy": cluster.policy if cluster.replicas > 1 else "single", "replicas": cluster.replicas,
        "requests": len(ttfts), "wall_s": round(wall, 2),
        "hit_rate": hits / queries if queries else 0.0, "prompt_tokens": queries,
        "computed_prompt_tokens": sum(p["llamacpp:prompt_tokens_total"] for p in per),
        "per_replica": [{"queries": p["vllm:prefix_cache_queries_total"], "hits": p["vllm:prefix_cache_hits_total"],
                         "hit_rate": (p["vllm:prefix_cache_hits_total"] / p["vllm:prefix_cache_queries_total"]
                                      if p["vllm:prefix_cache_queries_total"] else 0.0)} for p in per],
        "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def _pct(values: list[float], q: float) -> float:
    data = sorted(values)
    return round(data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))], 4) if data else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=700)
    p.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--no-single", action="store_true", help="skip the one-replica ceiling run")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all runs (order reversed every other round)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-memory", default=None, help="each replica's KV budget (default ctx x slots)")
    p.add_argument("--port", type=int, default=18900)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    convs = conversations(a.sessions, a.turns, a.system_tokens, a.seed)
    runs = ([(1, "round_robin")] if not a.no_single else []) + [(a.replicas, pol) for pol in a.policies]
    results = []
    for rnd in range(a.repeat):
        for n, policy in (runs if rnd % 2 == 0 else runs[::-1]):
            with Cluster(n, policy, port=a.port, ctx=a.ctx, slots=a.slots, threads=a.threads,
                         kv_memory=a.kv_memory) as cluster:
                res = run(cluster, convs, a.gen)
            res["round"] = rnd
            results.append(res)
            print(json.dumps(res), flush=True)
    out = {"config": vars(a), "cpu_count": os.cpu_count(), "runs": results}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "cluster.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
