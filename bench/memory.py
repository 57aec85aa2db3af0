"""KV memory: how many long sessions fit a KV budget per cache type, and the time to first token of
a repeated long prompt whose pages left the pool: computed again, restored from host memory, from
page files, or after a restart from page files -- beside llama-server computing it and restoring a
saved slot (its --slot-save-path) in the same run, alternating.

    python bench/memory.py [--model gemma3-270m] [--lengths 2048 8192] [--reps 3] [--threads 2]

Prints one JSON object. Disk figures read files the OS has in its page cache (the usual case for a
prompt that was just evicted); the load average is recorded at the start and end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402
from agent import _free_port, _when_ready  # noqa: E402

from ember import hub  # noqa: E402
from ember.engine import LLM  # noqa: E402
from ember.engine.llm import kv_bytes_per_token  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0)


def prompt_of(llm: LLM, n: int) -> list[int]:
    text = (ROOT / "tests" / "data" / "GPL-3.txt").read_text()
    ids = llm.tokenize(text)
    while len(ids) < n:
        ids += llm.tokenize(text, add_special=False)
    return ids[:n]


def sessions_that_fit(llm: LLM, budget: int, context: int) -> dict:
    per = {t: kv_bytes_per_token(llm.model, t, t) for t in ("f16", "q8_0", "q4_0")}
    fit = {t: budget // (context * b) for t, b in per.items()}
    return {"budget_bytes": budget, "context": context, "bytes_per_token": per, "sessions": fit,
            "vs_f16": {t: fit[t] / fit["f16"] for t in fit}}


def ttft(llm: LLM, ids: list[int]) -> tuple[float, list[int], int]:
    before = llm.engine.metrics.prompt_tokens_computed
    t0 = time.perf_counter()
    c = llm.generate(ids, 1, GREEDY)
    return time.perf_counter() - t0, c.token_ids, llm.engine.metrics.prompt_tokens_computed - before


def evict_all(llm: LLM, keep: bool = True) -> None:
    """Every cached page out of the pool: to the tiers below (keep) or dropped."""
    engine = llm.engine
    engine.call(lambda: engine.tree.evict(engine.pool.n_pages + 1, keep=keep)).result()


def open_ember(model: str, n: int, threads: int, **tiers) -> LLM:
    return LLM(model, device="cpu", threads=threads, ctx=n + 64, slots=1, kv_tokens=n + 64, **tiers)


def llama_server(path: Path, n: int, threads: int, slot_dir: str):
    port = _free_port()
    # --swa-full: Gemma 3's sliding-window layers keep every position, else a restored slot is not reused
    args = ["-m", str(path), "-t", str(threads), "-np", "1", "-c", str(n + 64), "--port", str(port),
            "--host", "127.0.0.1", "--no-webui", "--slot-save-path", slot_dir, "--cache-ram", "0", "--swa-full"]
    return _when_ready(peer.popen("llama-server", args), port, "llama-server"), port


def _post(port: int, path: str, body: dict) -> tuple[dict, float]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def llama_round(port: int, ids: list[int]) -> dict:
    """Compute the prompt, save the slot, erase it, restore it, ask again."""
    body = {"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": True, "return_tokens": True}
    first, computed_s = _post(port, "/completion", body)
    _post(port, "/slots/0?action=save", {"filename": "bench.bin"})
    _post(port, "/slots/0?action=erase", {})
    restored, restore_s = _post(port, "/slots/0?action=restore", {"filename": "bench.bin"})
    again, again_s = _post(port, "/completion", body)
    return {"recompute_s": computed_s, "restore_s": restore_s + again_s,
            "restored_tokens": restored.get("n_restored"), "tail_tokens": again.get("timings", {}).get("prompt_n"),
            "same": first.get("tokens") == again.get("tokens") if "tokens" in first else None}


def ember_round(model: str, n: int, threads: int, ids: list[int], folder: str) -> dict:
    out = {}
    llm = open_ember(model, n, threads, cache_ram=2 * n * kv_bytes_per_token_of(model, n, threads))
    try:
        out["recompute_s"], first, _ = ttft(llm, ids)
        evict_all(llm)
        out["ram_s"], again, out["ram_computed"] = ttft(llm, ids)
        out["same_ram"] = again == first
    finally:
        llm.close()
    llm = open_ember(model, n, threads, cache_disk=folder, cache_disk_size=4 << 30)
    try:
        ttft(llm, ids)
        evict_all(llm)
        out["disk_s"], again, out["disk_computed"] = ttft(llm, ids)
        out["same_disk"] = again == first
    finally:
        llm.close()  # persists the pages
    llm = open_ember(model, n, threads, cache_disk=folder, cache_disk_size=4 << 30)
    try:
        out["restart_disk_s"], again, out["restart_computed"] = ttft(llm, ids)
        out["same_restart"] = again == first
    finally:
        llm.close()
    for f in Path(folder).iterdir():
        f.unlink()
    return out


_PER_TOKEN: dict = {}


def kv_bytes_per_token_of(model: str, n: int, threads: int) -> int:
    if model not in _PER_TOKEN:
        llm = open_ember(model, 64, threads)
        _PER_TOKEN[model] = kv_bytes_per_token(llm.model)
        llm.close()
    return _PER_TOKEN[model]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = hub.resolve(a.model)
    res = {"model": a.model, "threads": a.threads, "load_avg_start": os.getloadavg(), "ttft": {}}
    probe = open_ember(a.model, 64, a.threads)
    res["fit"] = sessions_that_fit(probe, 8 << 30, 16384)
    ids_all = prompt_of(probe, max(a.lengths))
    probe.close()
    for n in a.lengths:
        ids = ids_all[:n]
        rows = {"ember": [], "llama-server": []}
        with tempfile.TemporaryDirectory() as slots, tempfile.TemporaryDirectory() as pages:
            for _ in range(a.reps):  # ember and llama-server alternate
                rows["ember"].append(ember_round(a.model, n, a.threads, ids, pages))
                if peer.available():
                    proc, port = llama_server(path, n, a.threads, slots)
                    try:
                        rows["llama-server"].append(llama_round(port, ids))
                    finally:
                        proc.terminate()
                        proc.wait()
                print(n, rows["ember"][-1], rows["llama-server"][-1:], file=sys.stderr, flush=True)
        res["ttft"][n] = {"runs": rows, "median": _medians(rows)}
    res["load_avg_end"] = os.getloadavg()
    print(json.dumps(res, indent=1))
    return 0


def _medians(rows: dict) -> dict:
    out = {}
    for who, runs in rows.items():
        keys = [k for k in (runs[0] if runs else {}) if k.endswith("_s")]
        out[who] = {k: statistics.median(r[k] for r in runs) for k in keys}
    e = out.get("ember", {})
    if e.get("recompute_s"):
        for k in ("ram_s", "disk_s", "restart_disk_s"):
            out["ember"][k.replace("_s", "_over_recompute")] = e[k] / e["recompute_s"]
    ls = out.get("llama-server", {})
    if ls.get("recompute_s"):
        out["llama-server"]["restore_over_recompute"] = ls["restore_s"] / ls["recompute_s"]
    return out


if __name__ == "__main__":
    sys.exit(main())
