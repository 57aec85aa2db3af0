"""Embeddings per second: ember serve --embeddings beside llama-server --embeddings, same model
file, same threads, alternating in one run (medians of --reps).

    python bench/embed.py [--model minilm|smollm2|PATH] [--texts 1000] [--clients 64] [--reps 3] [--threads 2]

Two loads per server: `batch`, one /v1/embeddings request holding --texts short texts; and
`clients`, --clients concurrent clients sending one text a request until --texts are done. The
default model is a synthetic BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide, F16; written
by tests/encoders.py), `smollm2` the real SmolLM2 (mean pooled). Prints texts/s and ember's ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import peer  # noqa: E402

WORDS = ("the a of to in on cat dog sat mat fish sea blue sky rain sun river tree bird book code data model "
         "search query document answer city night day good small large").split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))) + "." for _ in range(n)]


def model_path(name: str, tmp: Path) -> Path:
    if name == "minilm":
        from encoders import write_bert

        return write_bert(tmp / "minilm-shape.gguf", n_layer=6, d_model=384, n_head=12, d_ff=1536, n_ctx=512)
    from ember import hub

    return hub.resolve(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, model: Path, threads: int, port: int, pooling: str | None, clients: int = 64):
    pool = ["--pooling", pooling] if pooling else []
    if kind == "ember":
        return subprocess.Popen([sys.executable, "-m", "ember", "serve", str(model), "--embeddings", "-t", str(threads),
                                 "--port", str(port), "--batch", "2048", "--log-level", "warning", *pool],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return peer.popen("llama-server", ["-m", str(model), "--embeddings", "-t", str(threads), "--port", str(port),
                                       "-c", "8192", "-np", "16", "-b", "2048", "-ub", "2048", *pool,
                                       # an HTTP thread per client: with fewer, a kept-alive connection
                                       # holds its thread and the other clients wait
                                       "--threads-http", str(max(clients, 8))])


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


def batch(url: str, items: list[str]) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/embeddings", json={"input": items, "model": "m"}, timeout=600)
    r.raise_for_status()
    assert len(r.json()["data"]) == len(items)
    return len(items) / (time.perf_counter() - t0)


async def clients(url: str, items: list[str], n_clients: int) -> float:
    queue = list(items)

    async def client(http: httpx.AsyncClient):
        while queue:
            text = queue.pop()
            r = await http.post(url + "/v1/embeddings", json={"input": text, "model": "m"})
            r.raise_for_status()

    # each client its own connection pool: one shared pool of 64 connections scans all of them
    # for each idle one whenever a request comes or goes, which costs the benchmark's own process
    # more than either server once replies come in bunches
    https = [httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1)) for _ in range(n_clients)]
    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(client(http) for http in https))
    finally:
        for http in https:
            await http.aclose()
    return len(items) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    items = texts(args.texts)
    pooling = "mean" if args.model == "smollm2" else None
    results: dict = {(k, load): [] for k in ("ember", "llama.cpp") for load in ("batch", "clients")}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_path(args.model, Path(tmp))
        for rep in range(args.reps):
            for kind in ("ember", "llama.cpp"):
                port = free_port()
                proc = start(kind, model, args.threads, port, pooling, args.clients)
                try:
                    url = f"http://127.0.0.1:{port}"
                    wait_ready(url)
                    batch(url, items[:16])  # warm up
                    results[(kind, "batch")].append(batch(url, items))
                    results[(kind, "clients")].append(asyncio.run(clients(url, items, args.clients)))
                finally:
                    proc.terminate()
                    proc.wait()
                print(f"rep {rep} {kind}: batch {results[(kind, 'batch')][-1]:.1f}/s, "
                      f"clients {results[(kind, 'clients')][-1]:.1f}/s", flush=True)
    print(f"model {args.model}, {args.texts} texts, {args.clients} clients, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    for load in ("batch", "clients"):
        e, p = statistics.median(results[("ember", load)]), statistics.median(results[("llama.cpp", load)])
        print(f"{load:8s} ember {e:8.1f} texts/s   llama.cpp {p:8.1f} texts/s   ratio {e / p:.2f}")


if __name__ == "__main__":
    main()
