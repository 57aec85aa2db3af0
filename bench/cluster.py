"""ember replicas behind SGLang's Model Gateway: routing policies against one replica.

The agent workload of agent.py, sent through the gateway's /v1/chat/completions: S sessions run
concurrently, each T turns one after another; every turn re-sends the shared system prompt (tool
definitions), the session's conversation so far and a new user message,
and names its session in smg's routing-key header (policies that read no keys ignore it).
Runs, each on freshly started replicas (deploy/replicas.py): one replica (the ceiling: every
prefix lands where it was cached), then R replicas under each policy; `POLICY+sticky` adds the
gateway's sticky sessions (deploy/replicas.py's default), plain `POLICY` routes without them.

Reports per run: prefix-cache hit rate summed over the replicas and per replica (from their
vllm:prefix_cache_queries / _hits), prompt tokens computed (llamacpp:prompt_tokens), each
replica's share of the queried tokens and of the sessions, where the computed tokens went
(sessions' first turns, turns that stayed on the previous turn's replica, turns that moved: from
the gateway's x-smg-routed-worker-id and each response's usage), time to first token p50/p99 as
the client sees it (streamed), total time, and the load average before and after (the machine
may be shared: compare runs of one invocation, not across invocations).
Writes bench/results/cluster.json.

The history's assistant turns are fixed replies by default (every run sends identical prompts);
they differ from what the replica generated and cached, so every later turn recomputes the
previous reply wherever it lands. `--history generated` sends back what the model said, as an
agent does: those tokens are cached where they were generated.

    python bench/cluster.py [--replicas 3] [--sessions 24] [--turns 6] [--system-tokens 700] [--gen 16]
                            [--policies round_robin cache_aware cache_aware+sticky] [--no-single]
                            [--repeat 1] [--kv-memory 768M] [--history fixed|generated] [--out PATH]
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "deploy"))
from agent import system_prompt, user_text  # noqa: E402
from replicas import Cluster  # noqa: E402


@dataclass
class Script:
    """One session: the system prompt, each turn's user message, and the assistant replies its
    history carries when it does not carry what was generated."""
    system: str
    users: list[str]
    replies: list[str]


def conversations(sessions: int, turns: int, system_tokens: int, seed: int) -> list[Script]:
    rng = random.Random(seed)
    system = system_prompt(system_tokens, lambda text: range(len(text) // 4))  # about 4 characters a token
    out = []
    for _ in range(sessions):
        users, replies = [], []
        for _ in range(turns):
            users.append(user_text(rng, rng.randrange(40, 80)))
            replies.append(user_text(rng, 24))
        out.append(Script(system, users, replies))
    return out


@dataclass
class Turn:
    session: int
    turn: int
    worker: str  # the replica that served it, as the gateway names it (x-smg-routed-worker-id)
    prompt: int
    cached: int
    ttft: float


def ask(url: str, model: str, messages: list[dict], gen: int, key: str) -> tuple[str, str, dict, float]:
    """One streamed chat completion, read to its end: (worker, text, usage, time to the first chunk
    with text). The conversation's key rides in smg's routing-key header; policies that do not
    read keys ignore it."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": gen, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    headers = {"Content-Type": "application/json", "x-smg-routing-key": key}
    req = urllib.request.Request(url + "/v1/chat/completions", body, headers)
    t0, ttft, usage, text = time.perf_counter(), None, {}, []
    with urllib.request.urlopen(req, timeout=600) as r:
        worker = r.headers.get("x-smg-routed-worker-id", "")
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            text += [c["delta"]["content"] for c in chunk.get("choices", []) if c.get("delta", {}).get("content")]
            if ttft is None and text:
                ttft = time.perf_counter() - t0
    return worker, "".join(text), usage, ttft if ttft is not None else float("nan")


def scrape(url: str) -> dict[str, float]:
    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "llamacpp:prompt_tokens_total")
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in wanted:
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def run(cluster: Cluster, convs: list[Script], gen: int, generated: bool) -> dict:
    """All sessions at once; with `generated` each turn's history carries the replies the model
    gave (as an agent does), else the script's fixed replies (identical prompts in every run)."""
    with urllib.request.urlopen(cluster.url + "/v1/models") as r:
        model = json.loads(r.read())["data"][0]["id"]
    turns: list[Turn] = []
    lock = threading.Lock()

    def session(s: int) -> None:
        script = convs[s]
        messages = [{"role": "system", "content": script.system}]
        for t, (user, fixed) in enumerate(zip(script.users, script.replies)):
            messages.append({"role": "user", "content": user})
            worker, reply, usage, ttft = ask(cluster.url, model, messages, gen, f"session-{s}")
            messages.append({"role": "assistant", "content": reply if generated else fixed})
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            with lock:
                turns.append(Turn(s, t, worker, usage.get("prompt_tokens", 0), cached, ttft))

    load_before = os.getloadavg()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=session, args=(s,)) for s in range(len(convs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    per = [scrape(u) for u in cluster.worker_urls]
    queries = sum(p["vllm:prefix_cache_queries_total"] for p in per)
    hits = sum(p["vllm:prefix_cache_hits_total"] for p in per)
    ttfts = [t.ttft for t in turns]
    return {
        "policy": label(cluster), "replicas": cluster.replicas, "requests": len(turns), "wall_s": round(wall, 2),
        "hit_rate": hits / queries if queries else 0.0, "prompt_tokens": queries,
        "computed_prompt_tokens": sum(p["llamacpp:prompt_tokens_total"] for p in per),
        "per_replica": [_replica(cluster.worker_urls[i], p, queries, turns) for i, p in enumerate(per)],
        "routing": routing(turns),
        "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
        "load_before": [round(x, 2) for x in load_before], "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def label(cluster: Cluster) -> str:
    if cluster.replicas == 1:
        return "single"
    return cluster.policy + ("+sticky" if cluster.sticky else "")


def _replica(url: str, p: dict[str, float], queries: float, turns: list[Turn]) -> dict:
    q, h = p["vllm:prefix_cache_queries_total"], p["vllm:prefix_cache_hits_total"]
    return {"url": url, "queries": q, "hits": h, "hit_rate": h / q if q else 0.0,
            "share": q / queries if queries else 0.0, "requests": sum(t.worker == url for t in turns),
            "sessions": len({t.session for t in turns if t.worker == url and t.turn == 0})}


def routing(turns: list[Turn]) -> dict:
    """Where the prompt tokens computed went (from each response's usage): a session's first turn,
    a later turn on the replica of the turn before it, or a later turn that moved to another."""
    prev = {(t.session, t.turn): t.worker for t in turns}
    out = {"first": [0, 0], "stayed": [0, 0], "moved": [0, 0]}  # [requests, prompt tokens computed]
    for t in turns:
        kind = "first" if t.turn == 0 else "stayed" if prev[(t.session, t.turn - 1)] == t.worker else "moved"
        out[kind][0] += 1
        out[kind][1] += t.prompt - t.cached
    return {k: {"requests": n, "computed": c} for k, (n, c) in out.items()}


def _pct(values: list[float], q: float) -> float:
    data = sorted(values)
    return round(data[min(len(data) - 1, int(round(q / 100 * (len(data) - 1))))], 4) if data else 0.0


def report(results: list[dict]) -> None:
    """One line a run: against the single replica's hit rate and round_robin's tokens computed."""
    ceiling = next((r["hit_rate"] for r in results if r["policy"] == "single"), None)
    rr = next((r["computed_prompt_tokens"] for r in results if r["policy"] == "round_robin"), None)
    print(f"{'run':24}{'hit rate':>10}{'/single':>9}{'computed':>10}{'/rr':>7}  {'shares':18}{'moved':>6}"
          f"{'ttft p50':>10}{'p99':>8}{'wall':>8}")
    for r in results:
        shares = "/".join(f"{x['share']:.0%}" for x in r["per_replica"])
        print(f"{r['policy']:24}{r['hit_rate']:>10.1%}{r['hit_rate'] / ceiling if ceiling else 0:>9.1%}"
              f"{r['computed_prompt_tokens']:>10.0f}{r['computed_prompt_tokens'] / rr if rr else 0:>7.2f}  "
              f"{shares:18}{r['routing']['moved']['requests']:>6}{r['ttft_p50_s']:>10.1f}{r['ttft_p99_s']:>8.1f}"
              f"{r['wall_s']:>8.0f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=700)
    p.add_argument("--gen", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "cache_aware+sticky"],
                   help="the gateway's policies; +sticky: with sticky sessions (deploy/replicas.py's default)")
    p.add_argument("--no-single", action="store_true", help="skip the one-replica ceiling run")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all runs (order reversed every other round)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-memory", default=None, help="each replica's KV budget (default ctx x slots)")
    p.add_argument("--port", type=int, default=18900)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--history", choices=("fixed", "generated"), default="fixed",
                   help="the assistant turns each request re-sends: the script's fixed replies, or what was generated")
    p.add_argument("--out", type=Path, default=HERE / "results" / "cluster.json")
    a = p.parse_args()
    convs = conversations(a.sessions, a.turns, a.system_tokens, a.seed)
    runs = ([(1, "round_robin")] if not a.no_single else []) + [(a.replicas, pol) for pol in a.policies]
    results = []
    for rnd in range(a.repeat):
        for n, spec in (runs if rnd % 2 == 0 else runs[::-1]):
            policy, sticky = spec.removesuffix("+sticky"), spec.endswith("+sticky")
            with Cluster(n, policy, port=a.port, ctx=a.ctx, slots=a.slots, threads=a.threads, sticky=sticky,
                         kv_memory=a.kv_memory) as cluster:
                res = run(cluster, convs, a.gen, a.history == "generated")
            res["round"] = rnd
            results.append(res)
            print(json.dumps(res), flush=True)
    report(results)
    out = {"config": vars(a), "cpu_count": os.cpu_count(), "runs": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
