"""Load test of the HTTP server: many streaming clients, random disconnects, ember beside
llama-server in the same run. Writes bench/results/load.json.

    python bench/load.py [--model smollm2] [--clients 64] [--duration 60] [--slots 8] [--threads 2]
                         [--disconnect 0.1] [--skip-peer]

Each of C clients loops until the deadline: a streaming chat completion (a shared system
prompt and one of a few dozen questions, 16-64 new tokens); with probability --disconnect it
hangs up after a random number of chunks. A separate process probes GET /health every 100 ms
throughout. Per server it reports requests/s, generated tokens/s (tokens the clients received),
TTFT p50/p99, /health latency p50/p99/max, and every unexpected error (non-200, an error
event, a broken stream that the client did not cut). Afterwards it checks that nothing leaked:
no slot busy, and for ember no KV page taken once the prefix cache is erased
(POST /slots/0?action=erase). Both servers get the same model, threads, slots and context.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402

HERE = Path(__file__).resolve().parent
SYSTEM = ("You are a concise assistant for a travel company. Answer in one or two sentences, "
          "with concrete facts, and never invent prices.")
TOPICS = ("Paris", "Kyoto", "Lisbon", "Oslo", "Cairo", "Lima", "Hanoi", "Quebec", "Seville", "Nairobi", "Tallinn",
          "Hobart")
QUESTIONS = ("What is the best season to visit {}?", "Name one museum in {}.", "How do I get around {}?",
             "What food should I try in {}?", "Is {} expensive for travellers?", "Describe {} in one sentence.")
CTX_PER_SLOT = 1024


@dataclass
class Outcome:
    ok: bool
    cut: bool  # the client hung up on purpose
    ttft: float | None
    tokens: int
    error: str | None = None


@dataclass
class Summary:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    unexpected_errors: int = 0
    error_kinds: dict = field(default_factory=dict)
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    health_probes: int = 0
    health_p50_ms: float | None = None
    health_p99_ms: float | None = None
    health_max_ms: float | None = None
    health_failures: int = 0
    wall_s: float = 0.0
    leaks: dict = field(default_factory=dict)


# ---- clients ----

def request_body(rng: random.Random, model: str) -> dict:
    question = rng.choice(QUESTIONS).format(rng.choice(TOPICS))
    return {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": rng.randint(16, 64), "temperature": 0.8, "stream": True,
            "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, url: str, body: dict, cut_after: int | None) -> Outcome:
    t0, ttft, chunks, usage = time.perf_counter(), None, 0, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Outcome(False, False, None, 0, f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return Outcome(False, False, ttft, chunks, f"error event: {data['error'].get('code')}")
                if data.get("usage"):
                    usage = data["usage"]
                if data.get("choices") and data["choices"][0]["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        return Outcome(True, True, ttft, chunks)  # leaving the block closes the connection
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Outcome(False, False, ttft, chunks, type(e).__name__)
    tokens = usage["completion_tokens"] if usage else chunks
    return Outcome(usage is not None, False, ttft, tokens, None if usage else "stream ended without usage")


async def client_loop(url: str, model: str, deadline: float, seed: int, p_cut: float, out: list[Outcome]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        while time.perf_counter() < deadline:
            body = request_body(rng, model)
            cut = rng.randint(1, max(1, body["max_tokens"] // 2)) if rng.random() < p_cut else None
            out.append(await one_request(client, url, body, cut))


async def run_clients(url: str, model: str, n: int, duration: float, p_cut: float, seed: int) -> tuple[list, float]:
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client_loop(url, model, t0 + duration, seed * 1000 + i, p_cut, outcomes)
                           for i in range(n)))
    return outcomes, time.perf_counter() - t0


# ---- /health prober (its own process, so the clients' event loop does not delay it) ----

def probe_health(url: str, stop, results) -> None:
    latencies, failures = [], 0
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                ok = client.get(url + "/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - t0)
            failures += not ok
            time.sleep(0.1)
    results.put((latencies, failures))


# ---- servers ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become ready")


def start_ember(model: str, port: int, slots: int, threads: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ember", "serve", model, "--port", str(port), "--slots", str(slots),
           "--threads", str(threads), "--ctx", str(CTX_PER_SLOT), "--log-level", "warning", "--device", "cpu"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def start_llama_server(path: Path, port: int, slots: int, threads: int, log) -> subprocess.Popen:
    """The AVX2 build: the AVX-512 one faults on this machine's CPU."""
    base = peer.llama_cpp_dir()
    env = {**os.environ, "LD_LIBRARY_PATH": f"{base / 'lib-avx2'}:{base / 'lib'}"}
    cmd = [str(base / "lib" / "llama-server.real"), "-m", str(path), "-t", str(threads), "-np", str(slots),
           "-c", str(CTX_PER_SLOT * slots), "--port", str(port), "--host", "127.0.0.1", "--metrics", "--no-webui"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)


def ember_leaks(url: str) -> dict:
    """Busy slots, waiting/running sequences, and KV pages still taken after erasing the cache."""
    busy = sum(s["is_processing"] for s in httpx.get(url + "/slots").json())
    httpx.post(url + "/slots/0?action=erase")
    time.sleep(0.5)
    m = metrics(httpx.get(url + "/metrics").text)
    pages = {k: m.get(f'ember:kv_pages{{state="{k}"}}') for k in ("in_use", "cached", "free")}
    return {"busy_slots": busy, "running": m.get("ember:requests_running"), "waiting": m.get("ember:requests_waiting"),
            "kv_pages": pages, "pages_taken_after_erase": pages["in_use"] + pages["cached"]}


def llama_leaks(url: str) -> dict:
    slots = httpx.get(url + "/slots").json()
    m = metrics(httpx.get(url + "/metrics").text)
    return {"busy_slots": sum(bool(s.get("is_processing")) for s in slots),
            "running": m.get("llamacpp:requests_processing"), "waiting": m.get("llamacpp:requests_deferred")}


def metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(\S+) (\S+)$", line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


# ---- one run ----

def load_test(name: str, url: str, model_id: str, args, leaks) -> Summary:
    stop, results = multiprocessing.Event(), multiprocessing.Queue()
    prober = multiprocessing.Process(target=probe_health, args=(url, stop, results), daemon=True)
    prober.start()
    outcomes, wall = asyncio.run(run_clients(url, model_id, args.clients, args.duration, args.disconnect, args.seed))
    stop.set()
    latencies, failures = results.get(timeout=30)
    prober.join(10)
    s = summarize(outcomes, wall, latencies, failures)
    s.leaks = leaks(url)
    print(f"{name}: {s.requests} requests ({s.disconnected} cut by the client), {s.unexpected_errors} unexpected "
          f"errors, {s.requests_per_s:.2f} req/s, {s.tokens_per_s:.1f} tokens/s, TTFT p50 {s.ttft_p50_s:.2f} s "
          f"p99 {s.ttft_p99_s:.2f} s, /health p99 {s.health_p99_ms:.1f} ms (max {s.health_max_ms:.1f}), "
          f"leaks {s.leaks}")
    return s


def summarize(outcomes: list[Outcome], wall: float, health: list[float], health_failures: int) -> Summary:
    s = Summary(requests=len(outcomes), wall_s=wall, health_probes=len(health), health_failures=health_failures)
    s.completed = sum(o.ok and not o.cut for o in outcomes)
    s.disconnected = sum(o.cut for o in outcomes)
    for o in outcomes:
        if not o.ok:
            s.unexpected_errors += 1
            s.error_kinds[o.error] = s.error_kinds.get(o.error, 0) + 1
    s.requests_per_s = len(outcomes) / wall
    s.tokens_per_s = sum(o.tokens for o in outcomes) / wall
    ttfts = sorted(o.ttft for o in outcomes if o.ttft is not None)
    s.ttft_p50_s, s.ttft_p99_s = pct(ttfts, 50), pct(ttfts, 99)
    ms = sorted(x * 1000 for x in health)
    s.health_p50_ms, s.health_p99_ms, s.health_max_ms = pct(ms, 50), pct(ms, 99), (ms[-1] if ms else None)
    return s


def pct(xs: list[float], q: float) -> float | None:
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def run_server(name: str, start, leaks, model_id: str, args) -> tuple[Summary, int, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: a full pipe would stall the server
        proc = start(port, log)
        try:
            wait_healthy(url, proc)
            summary = load_test(name, url, model_id, args, leaks)
        finally:
            status = stop_server(proc)
            log.seek(0)
            stderr = log.read().decode(errors="replace")
    return summary, status, stderr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of requests the client cuts short")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-peer", action="store_true", help="ember only")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "load.json")
    args = ap.parse_args()
    path = hub.resolve(args.model)
    out = {"model": args.model, "clients": args.clients, "duration_s": args.duration, "slots": args.slots,
           "threads": args.threads, "disconnect_share": args.disconnect, "ctx_per_slot": CTX_PER_SLOT,
           "machine": {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg()}}
    ember, status, stderr = run_server("ember", lambda p, log: start_ember(args.model, p, args.slots, args.threads, log),
                                       ember_leaks, args.model, args)
    out["ember"] = {**asdict(ember), "exit_status": status, "traceback_in_log": "Traceback" in stderr}
    if not args.skip_peer:
        peer_run, status, _ = run_server("llama-server", lambda p, log: start_llama_server(path, p, args.slots, args.threads, log),
                                         llama_leaks, args.model, args)
        out["llama_server"] = {**asdict(peer_run), "exit_status": status}
        out["ratio_ember_over_llama_server"] = {
            k: getattr(ember, k) / getattr(peer_run, k) if getattr(peer_run, k) else None
            for k in ("requests_per_s", "tokens_per_s", "ttft_p50_s", "ttft_p99_s")}
        print("ember / llama-server:", {k: round(v, 3) for k, v in out["ratio_ember_over_llama_server"].items() if v})
    out["machine"]["load_avg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
