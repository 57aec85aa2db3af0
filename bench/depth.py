"""CPU decode at depth: generation speed after a prompt of D tokens (the keys every step's attention
reads), ember beside llama.cpp (`llama-bench -p 0 -n N -d D`) in the same run.

For each depth and each rep, in turn: ember generates N tokens greedily after a fresh random prompt of D
tokens (generation tokens/s, first token to last: the prompt's time is not counted, as llama-bench's
depth is filled before its timer starts), then one llama-bench run at that depth. Medians over reps;
ratios are ember / llama.cpp. Run on an otherwise idle machine (llama.cpp's spinning thread pool
collapses beside another busy process). Writes JSON to bench/results/depth.json.

    python bench/depth.py [--models smollm2] [--depths 0 1024 3072] [--threads 2] [--n-gen 64] [--reps 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ladder  # noqa: E402
import peer  # noqa: E402
from cpu import cpu_name, machine_load, write  # noqa: E402

from ember.engine import LLM  # noqa: E402
from ember.sampler import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def ember_tg(llm: LLM, rng, depth: int, n_gen: int) -> float:
    """Generation tokens/s of n_gen greedy tokens after a random prompt of depth tokens (at least one)."""
    vocab = min(llm.model.n_vocab, 32000)
    prompt = rng.integers(0, vocab, max(1, depth)).tolist()  # fresh tokens: the prefix cache holds none
    return llm.generate(prompt, max_tokens=n_gen, sampling=GREEDY).timings.generation_tps


def llama_tg(path: Path, threads: int, depth: int, n_gen: int) -> tuple[float, str]:
    proc, variant = peer.run("llama-bench", ["-m", str(path), "-t", str(threads), "-p", "0", "-n", str(n_gen),
                                             "-d", str(depth), "-r", "1", "-o", "json"])
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({proc.returncode}): {proc.stderr[-500:]}")
    return statistics.median(json.loads(proc.stdout)[0]["samples_ts"]), variant


def bench_model(name: str, args) -> dict:
    path = ladder.ensure(name)
    llm = LLM(str(path), device="cpu", threads=args.threads, ctx=max(args.depths) + args.n_gen + 64)
    rng = np.random.default_rng(0)
    ember_tg(llm, rng, 64, 8)  # warm-up
    llm.backend.settled()
    rows, variant = {}, "?"
    for depth in args.depths:
        e, p = [], []
        for _ in range(args.reps):
            e.append(ember_tg(llm, rng, depth, args.n_gen))
            tps, variant = llama_tg(path, args.threads, depth, args.n_gen)
            p.append(tps)
        rows[depth] = {"ember_tps": statistics.median(e), "llama_tps": statistics.median(p),
                       "ratio": statistics.median(e) / statistics.median(p), "ember_samples": e, "llama_samples": p}
        r = rows[depth]
        print(f"{name} depth {depth:>5}: ember {r['ember_tps']:7.1f}  llama.cpp {r['llama_tps']:7.1f} tok/s  "
              f"({r['ratio']:.2f}x)", flush=True)
    llm.close()
    return {"depths": rows, "variant": variant, "n_gen": args.n_gen, "threads": args.threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2"], choices=[*ladder.LADDER, *ladder.FAMILIES])
    ap.add_argument("--depths", nargs="+", type=int, default=[0, 1024, 3072])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "depth.json")
    args = ap.parse_args()
    if not peer.available():
        sys.exit(f"llama.cpp's programs are not in {peer.llama_cpp_dir()} (set LLAMA_CPP_DIR)")
    results = {"machine": cpu_name(), "load_before": machine_load(), "models": {}}
    for name in args.models:
        results["models"][name] = bench_model(name, args)
    results["load_after"] = machine_load()
    write(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
