"""Agent workload: many sessions re-sending a long shared prompt, ember beside llama-server.

S sessions (default 8) run T turns each (default 6) concurrently. Every request is a
shared ~1,500-token system prompt with tool definitions, that session's conversation so
far, and 100-200 new tokens; each turn generates 64 tokens. The conversation history uses
fixed assistant replies, so both engines see identical prompts (token ids). A control run
sends the same amount of text with nothing shared between requests.

Reports, per engine and run: prefix-cache hit rate (and the theoretical maximum: each
request's longest common prefix with any request sent before it), prompt tokens actually
computed, TTFT p50/p99 for cache hits (>= half the prompt cached) and misses, total time,
generated tokens/s. Writes bench/results/agent.json.

    python bench/agent.py [--model smollm2] [--sessions 8] [--turns 6] [--threads 2] [--skip-peer]
                          [--skip-http] [--control-reps 3]

ember runs twice: through its Python API, and as `ember serve` driven over HTTP (/completion)
exactly like llama-server.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402
from ember.engine import LLM, FinishEvent, Request, TokenEvent  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

HERE = Path(__file__).resolve().parent
WORDS = ("file", "query", "result", "user", "table", "error", "value", "search", "window", "report", "update",
         "status", "account", "message", "calendar", "weather", "tomorrow", "please", "check", "list", "send",
         "open", "the", "a", "and", "for", "with", "from", "this", "that", "which", "when", "where", "how")
GEN_TOKENS = 64


# ---- the workload ----
def system_prompt(target_tokens: int, tokenize) -> str:
    """Instructions plus tool definitions (from bench/schemas) up to about target_tokens."""
    text = ("You are an agent that completes tasks by calling tools. Think step by step, call one tool at a "
            "time, and answer the user when you have what you need.\n\n# Tools\n")
    for path in sorted((HERE / "schemas").glob("*.json")):
        if path.name.endswith((".examples.json", ".invalid.json")):
            continue
        text += f"\n## {path.stem}\n{json.dumps(json.loads(path.read_text()), separators=(',', ':'))}\n"
        if len(tokenize(text)) >= target_tokens:
            break
    return text


def user_text(rng: random.Random, n_tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_tokens))


@dataclass
class Session:
    messages: list[dict] = field(default_factory=list)


def build_requests(llm: LLM, sessions: int, turns: int, seed: int, shared: bool) -> list[list[list[int]]]:
    """prompts[session][turn] as token ids."""
    rng = random.Random(seed)
    system = system_prompt(1500, llm.tokenize)
    out = []
    for s in range(sessions):
        sys_text = system if shared else user_text(rng, 1100)  # control: nothing in common
        msgs = [{"role": "system", "content": sys_text}]
        prompts = []
        for t in range(turns):
            msgs.append({"role": "user", "content": user_text(rng, rng.randrange(75, 150))})
            ids = llm.chat_ids(msgs)
            if not shared:
                prompts.append(ids)
                msgs = [{"role": "system", "content": user_text(rng, 1100 + 150 * t)}]
                continue
            prompts.append(ids)
            msgs.append({"role": "assistant", "content": user_text(rng, 48)})
        out.append(prompts)
    return out


def theoretical_hit_rate(prompts: list[list[list[int]]]) -> float:
    """Requests in send order (turn by turn, session by session); each may reuse its longest
    common prefix with any request sent before it."""
    order = [prompts[s][t] for t in range(len(prompts[0])) for s in range(len(prompts))]
    reusable = total = 0
    for i, ids in enumerate(order):
        best = 0
        for prev in order[:i]:
            n = min(len(ids) - 1, len(prev))
            k = 0
            while k < n and ids[k] == prev[k]:
                k += 1
            best = max(best, k)
        reusable += best
        total += len(ids)
    return reusable / total


# ---- measurements ----
@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    ttft: float
    generated: int


def summarize(turns: list[Turn], wall: float) -> dict:
    hits = [t.ttft for t in turns if 2 * t.cached_tokens >= t.prompt_tokens]
    misses = [t.ttft for t in turns if 2 * t.cached_tokens < t.prompt_tokens]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    return {
        "requests": len(turns), "wall_s": wall, "prompt_tokens": prompt, "computed_prompt_tokens": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "ttft_hit_p50": _pct(hits, 50), "ttft_hit_p99": _pct(hits, 99), "n_hits": len(hits),
        "ttft_miss_p50": _pct(misses, 50), "ttft_miss_p99": _pct(misses, 99), "n_misses": len(misses),
        "generated_tps": sum(t.generated for t in turns) / wall,
    }


def alone_ttft(llm: LLM, agent: list[list[list[int]]], control: list[list[list[int]]], reps: int = 3) -> dict:
    """TTFT of one request on an idle engine: a cache hit (an agent turn whose earlier turns are
    cached) and a miss (a control prompt of about the same length), medians of reps: the
    cache's effect on latency without the queueing of the concurrent run."""
    turn = ember_turn(llm)
    hits, misses = [], []
    for rep in range(reps):
        llm.engine.clear_cache()
        session = agent[rep % len(agent)]
        for ids in session[:-1]:  # earlier turns: they fill the cache
            turn(ids)
        hits.append(turn(session[-1]).ttft)
        llm.engine.clear_cache()
        misses.append(turn(control[rep % len(control)][-1]).ttft)
    hit, miss = sorted(hits)[reps // 2], sorted(misses)[reps // 2]
    return {"hit_s": hit, "miss_s": miss, "ratio": hit / miss, "hit_prompt": len(agent[0][-1]),
            "miss_prompt": len(control[0][-1])}


def _median_run(runs: list[dict]) -> dict:
    """The run of median wall time."""
    return sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def run_sessions(prompts, one_turn) -> tuple[list[Turn], float]:
    """Each session in its own thread, turns in order; returns every turn's figures and the wall time."""
    results: list[Turn] = []
    lock = threading.Lock()

    def session(s: int):
        for ids in prompts[s]:
            turn = one_turn(ids)
            with lock:
                results.append(turn)

    threads = [threading.Thread(target=session, args=(s,)) for s in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def ember_turn(llm: LLM):
    params = SamplingParams(temperature=0.0, ignore_eos=True)

    def turn(ids: list[int]) -> Turn:
        t0 = time.perf_counter()
        ttft, n, cached = None, 0, 0
        for ev in llm.engine.submit(Request(ids, GEN_TOKENS, params)):
            if isinstance(ev, TokenEvent):
                ttft = ttft or time.perf_counter() - t0
                n += 1
            elif isinstance(ev, FinishEvent):
                cached = ev.cached_tokens
                if ev.error:
                    raise RuntimeError(ev.error)
        return Turn(len(ids), cached, ttft or 0.0, n)

    return turn


def server_turn(port: int):
    def turn(ids: list[int]) -> Turn:
        body = json.dumps({"prompt": ids, "n_predict": GEN_TOKENS, "cache_prompt": True, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft, n, timings = None, 0, {}
        with urllib.request.urlopen(req, timeout=600) as resp:
            for line in resp:
                if not line.startswith(b"data: "):
                    continue
                data = json.loads(line[6:])
                if data.get("content") or data.get("tokens"):
                    ttft = ttft or time.perf_counter() - t0
                    n += 1
                if data.get("stop"):
                    timings = data.get("timings", {})
        cached = int(timings.get("cache_n", len(ids) - timings.get("prompt_n", len(ids))))
        return Turn(len(ids), cached, ttft or 0.0, int(timings.get("predicted_n", n)))

    return turn


def start_llama_server(path: Path, sessions: int, threads: int, ctx_per_slot: int) -> tuple[object, int]:
    port = _free_port()
    args = ["-m", str(path), "-t", str(threads), "-np", str(sessions), "-c", str(ctx_per_slot * sessions),
            "--port", str(port), "--host", "127.0.0.1", "--no-webui"]
    proc = peer.popen("llama-server", args, probe_model=str(path))
    return _when_ready(proc, port, "llama-server"), port


def start_ember_server(model: str, sessions: int, threads: int, ctx_per_slot: int) -> tuple[object, int]:
    """`ember serve` in its own process, driven through HTTP like llama-server."""
    import subprocess

    port = _free_port()
    cmd = [sys.executable, "-m", "ember", "serve", model, "--port", str(port), "--slots", str(sessions),
           "--threads", str(threads), "--ctx", str(ctx_per_slot), "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return _when_ready(proc, port, "ember serve"), port


def _when_ready(proc, port: int, name: str):
    """proc once its /health answers 200 (killed, and an error, if it never does)."""
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{name} did not become ready")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-peer", action="store_true", help="ember only")
    ap.add_argument("--skip-http", action="store_true", help="do not also run ember through `ember serve`")
    ap.add_argument("--control-reps", type=int, default=3, help="control runs with the cache on and off, each")
    ap.add_argument("--alone-only", action="store_true", help="only the idle-engine TTFT probe (hit vs miss)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "agent.json")
    args = ap.parse_args()
    ctx = 4096
    llm = LLM(args.model, device="cpu", threads=args.threads, ctx=ctx, slots=args.sessions)
    workloads = {"agent": build_requests(llm, args.sessions, args.turns, args.seed, shared=True),
                 "control": build_requests(llm, args.sessions, args.turns, args.seed + 1, shared=False)}
    results = {"model": args.model, "sessions": args.sessions, "turns": args.turns, "threads": args.threads}
    if args.alone_only:
        a = alone_ttft(llm, workloads["agent"], workloads["control"])
        print(f"one request on an idle engine: TTFT cache hit {a['hit_s']:.3f} s, miss {a['miss_s']:.3f} s: "
              f"hit / miss {a['ratio']:.2f}")
        return
    for name, prompts in workloads.items():
        r = results[name] = {"theoretical_hit_rate": theoretical_hit_rate(prompts)}
        llm.engine.clear_cache()
        r["ember"] = summarize(*run_sessions(prompts, ember_turn(llm)))
        if name == "control":  # the cache must cost nothing when nothing is shared
            off = LLM(args.model, device="cpu", threads=args.threads, ctx=ctx, slots=args.sessions,
                      prefix_cache=False)
            # on and off alternately, medians: the machine's drift must not decide the comparison
            runs = {"on": [r["ember"]], "off": []}
            for rep in range(args.control_reps):
                runs["off"].append(summarize(*run_sessions(prompts, ember_turn(off))))
                if rep + 1 < args.control_reps:
                    llm.engine.clear_cache()
                    runs["on"].append(summarize(*run_sessions(prompts, ember_turn(llm))))
            off.close()
            r["ember"] = _median_run(runs["on"])
            r["ember_cache_off"] = _median_run(runs["off"])
            r["control_walls_s"] = {k: [x["wall_s"] for x in v] for k, v in runs.items()}
        if not args.skip_http:
            proc, port = start_ember_server(args.model, args.sessions, args.threads, ctx)
            try:
                r["ember_http"] = summarize(*run_sessions(prompts, server_turn(port)))
            finally:
                proc.terminate()
                proc.wait(30)
        if not args.skip_peer:
            proc, port = start_llama_server(hub.resolve(args.model), args.sessions, args.threads, ctx)
            try:
                r["llama_server"] = summarize(*run_sessions(prompts, server_turn(port)))
            finally:
                proc.terminate()
                proc.wait(30)
        report(name, r)
    a = results["alone_ttft"] = alone_ttft(llm, workloads["agent"], workloads["control"])
    print(f"\n== one request on an idle engine: TTFT cache hit {a['hit_s']:.3f} s ({a['hit_prompt']} prompt tokens), "
          f"miss {a['miss_s']:.3f} s ({a['miss_prompt']}): hit / miss {a['ratio']:.2f}")
    ag, ct = results["agent"]["ember"], results["control"]["ember"]
    if ag["ttft_hit_p50"] and ct["ttft_miss_p50"]:
        print(f"   under the concurrent load: agent hit p50 {ag['ttft_hit_p50']:.3f} s / control miss p50 "
              f"{ct['ttft_miss_p50']:.3f} s = {ag['ttft_hit_p50'] / ct['ttft_miss_p50']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


def report(name: str, r: dict) -> None:
    print(f"\n== {name}: theoretical max hit rate {r['theoretical_hit_rate']:.1%}")
    cols = [k for k in ("ember", "ember_http", "ember_cache_off", "llama_server") if k in r]
    print(f"  {'':26}" + "".join(f"{c:>16}" for c in cols))
    for key, fmt in (("hit_rate", "{:.1%}"), ("computed_prompt_tokens", "{:d}"), ("wall_s", "{:.1f}"),
                     ("generated_tps", "{:.1f}"), ("ttft_hit_p50", "{:.3f}"), ("ttft_hit_p99", "{:.3f}"),
                     ("ttft_miss_p50", "{:.3f}"), ("ttft_miss_p99", "{:.3f}")):
        cells = [(fmt.format(r[c][key]) if r[c][key] is not None else "-") for c in cols]
        print(f"  {key:26}" + "".join(f"{x:>16}" for x in cells))
    if "llama_server" in r:
        print(f"  total time ember / llama-server: {r['ember']['wall_s'] / r['llama_server']['wall_s']:.2f}")
        if "ember_http" in r:
            print(f"  total time ember over HTTP / llama-server: "
                  f"{r['ember_http']['wall_s'] / r['llama_server']['wall_s']:.2f}")
    if "ember_cache_off" in r:
        print(f"  throughput cache on / off (median of {len(r['control_walls_s']['on'])} runs each, by wall time): "
              f"{r['ember_cache_off']['wall_s'] / r['ember']['wall_s']:.3f}")


if __name__ == "__main__":
    main()
