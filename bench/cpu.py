"""CPU speed: ember beside llama.cpp (llama-bench, llama-completion) in the same run.

For each model: load time, prompt processing (pp512: 512 tokens in one batch from an
empty context) and generation (tg128: 128 tokens one at a time from an empty context),
as llama-bench defines them, plus cold start (process start to one generated token).
Medians of --reps runs; ratios are ember / llama.cpp (above 1: ember is faster, or for
times, slower). Writes JSON to bench/results/cpu.json.

    python bench/cpu.py [--models smollm2 gemma3-270m] [--threads 2] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer  # noqa: E402

from ember import hub  # noqa: E402
from ember.engine import LLM  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def ember_speed(model: str, threads: int, reps: int, n_prompt: int, n_gen: int) -> dict:
    loads = []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm = LLM(model, device="cpu", threads=threads, ctx=max(n_prompt, n_gen) + 16, batch=n_prompt)
        loads.append(time.perf_counter() - t0)
        llm.close()
    llm = LLM(model, device="cpu", threads=threads, ctx=max(n_prompt, n_gen) + 16, batch=n_prompt)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, llm.model.n_vocab, n_prompt).tolist() for _ in range(reps + 1)]
    ignore = lambda logits, positions: None  # noqa: E731 - the logits are not needed, only computed
    llm.evaluate(prompts[0], ignore, logits_from=n_prompt - 1)  # warm-up: first touch of the weights
    pp = [n_prompt / _timed(lambda p=p: llm.evaluate(p, ignore, logits_from=n_prompt - 1)) for p in prompts[1:]]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    # n_gen single-token steps from a one-token context, each sampled greedily (what a user gets)
    tg = [n_gen / _timed(lambda t=t: llm.generate([int(t)], n_gen, greedy)) for t in rng.integers(0, 1000, reps)]
    result = {"load_s": statistics.median(loads), "pp_tps": statistics.median(pp), "tg_tps": statistics.median(tg),
              "pp_samples": pp, "tg_samples": tg, "isa": getattr(llm.backend, "isa", "?")}
    llm.close()
    return result


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def llama_bench(path: Path, threads: int, reps: int, n_prompt: int, n_gen: int) -> dict:
    proc, build = peer.run("llama-bench", ["-m", str(path), "-t", str(threads), "-p", str(n_prompt),
                                           "-n", str(n_gen), "-r", str(reps), "-o", "json"])
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}")
    out = {"build": build}
    for test in json.loads(proc.stdout):
        key = "pp_tps" if test["n_gen"] == 0 else "tg_tps"
        out[key] = statistics.median(test["samples_ts"])
        out[key.replace("tps", "samples")] = test["samples_ts"]
    return out


def cold_starts(model: str, path: Path, threads: int, reps: int) -> dict:
    """Seconds from process start to exit after generating one token from a short prompt."""
    prompt = "The capital of France is"
    ember_cmd = [sys.executable, "-m", "ember", "run", model, "-p", prompt, "-n", "1", "--temp", "0",
                 "-t", str(threads)]
    ember_t, peer_t = [], []
    for _ in range(reps):
        ember_t.append(_timed(lambda: subprocess.run(ember_cmd, capture_output=True, check=True)))
        peer_t.append(_timed(lambda: peer.run("llama-completion", ["-m", str(path), "-p", prompt, "-n", "1",
                                                                   "-t", str(threads), "-no-cnv", "--temp", "0"])))
    return {"ember_s": statistics.median(ember_t), "llama_cpp_s": statistics.median(peer_t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu.json")
    args = ap.parse_args()
    if not peer.available():
        sys.exit(f"llama.cpp not found at {peer.llama_cpp_dir()} (set LLAMA_CPP_DIR)")
    results = {"threads": args.threads, "reps": args.reps, "models": {}}
    for model in args.models:
        path = hub.resolve(model)
        e = ember_speed(model, args.threads, args.reps, args.n_prompt, args.n_gen)
        p = llama_bench(path, args.threads, args.reps, args.n_prompt, args.n_gen)
        c = cold_starts(model, path, args.threads, args.reps)
        results["models"][model] = {"ember": e, "llama_cpp": p, "cold_start": c}
        print(f"\n{model} ({args.threads} threads, median of {args.reps}; ember ISA {e['isa']}, "
              f"llama.cpp {p['build']} build)")
        print(f"  {'':8} {'ember':>10} {'llama.cpp':>10} {'ratio':>7}")
        for key, label in (("pp_tps", f"pp{args.n_prompt}"), ("tg_tps", f"tg{args.n_gen}")):
            print(f"  {label:8} {e[key]:10.1f} {p[key]:10.1f} {e[key] / p[key]:7.2f}  tokens/s")
        print(f"  {'cold':8} {c['ember_s']:10.2f} {c['llama_cpp_s']:10.2f} {c['ember_s'] / c['llama_cpp_s']:7.2f}  s to first token")
        print(f"  ember load (in process): {e['load_s'] * 1000:.0f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
