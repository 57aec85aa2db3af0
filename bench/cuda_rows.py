"""Decode steps of a few to a few dozen sequences on the GPU machine: which kernels the products of
2-64 activation rows should take (the matrix-vector kernels mv_nN up to 8 rows, mm_split, the cuBLAS
route from CudaConfig.blas_rows). For each shape (synthetic files in llama.cpp's Q4_K_M mix with a
vocabulary, written here with bench/cuda.py's write_big_model and deleted after) and each variant
(CudaConfig changes), one engine serves n concurrent greedy requests for each n of --counts (each
n-sequence decode step is recorded as it first comes; past 8 sequences a step is padded to a power of
two), then each recorded n-sequence step is replayed alone: its median time, the GPU's share of a step
(bench/cuda.py replay_step_ms). Ratios are against the first variant. No peer: a choice between
ember's own kernels (bench/cuda_peer.py sets them beside llama.cpp).

    python bench/cuda_rows.py [--shapes small llama-1b llama-8b] [--variants blas_rows=64 blas_rows=16]
                              [--counts 1 2 3 4 5 6 8 16 32 64] [--out cuda_rows.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # ember from this checkout, after bench/ (the script's folder)

import ladder  # noqa: E402
# bench/cuda.py as cuda_8b loads it (by path); importing cuda_8b also takes bench/ off sys.path, where a
# module named `cuda` would shadow NVIDIA's package CuPy imports
from cuda_8b import bc  # noqa: E402

SHAPES = {
    # SmolLM2-135M's depth and vocabulary, widths rounded to Q4_K's 256-value blocks
    "small": {"n_layer": 30, "d_model": 768, "d_ff": 2048, "n_head": 12, "n_kv_head": 4, "head_dim": 64,
              "n_vocab": 49152},
    "llama-1b": {"n_layer": 16, "d_model": 2048, "d_ff": 8192, "n_head": 32, "n_kv_head": 8, "head_dim": 64,
                 "n_vocab": 128256},
    "llama-8b": {"n_layer": 32, "d_model": 4096, "d_ff": 14336, "n_head": 32, "n_kv_head": 8, "head_dim": 128,
                 "n_vocab": 128256},
}
COUNTS = (1, 2, 3, 4, 5, 6, 8)


def step_times(path: Path, counts=COUNTS) -> dict:
    """Replay ms of the recorded decode step of n sequences, for each n."""
    from ember.engine import LLM
    from ember.sampler import SamplingParams

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    out = {}
    with bc.LLM(str(path), device="cuda", slots=max(counts), ctx=256, batch=512) as llm:
        rng = np.random.default_rng(0)
        assert isinstance(llm, LLM)
        for n in counts:
            prompts = [rng.integers(0, 1000, 16).tolist() for _ in range(n)]
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p: llm.generate(p, max_tokens=24, sampling=greedy), prompts))
            out[n] = bc.replay_step_ms(llm, 100, n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--variants", nargs="*", default=["mv_rows=8", "mv_rows=4"],
                    help="CudaConfig changes, each k=v[,k=v]; ratios are against the first")
    ap.add_argument("--counts", nargs="*", type=int, default=list(COUNTS),
                    help="sequences decoding at once (past 8 a step is padded to a power of two)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for name in args.shapes:
            path = Path(tmp) / f"{name}-Q4_K_M.gguf"
            t0 = time.perf_counter()
            bc.write_big_model(path, "Q4_K_M", SHAPES[name],
                               lambda w, v=SHAPES[name]["n_vocab"]: ladder.add_vocab(w, v))  # the engine tokenizes
            print(f"wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            r = results[name] = {}
            for v in args.variants:
                changes = {k: int(x) for k, x in (kv.split("=") for kv in v.split(","))}
                r[v] = bc.with_config(changes, step_times, path, args.counts)
                print(f"{name} {v}: " + ", ".join(f"{n}: {ms:.3f}" if ms else f"{n}: -"
                                                  for n, ms in r[v].items()) + " ms", flush=True)
            base = args.variants[0]
            for v in args.variants[1:]:
                print(f"{name} {v} / {base}: " + ", ".join(
                    f"{n}: {r[v][n] / r[base][n]:.2f}" for n in r[base] if r[base][n] and r[v][n]), flush=True)
            path.unlink()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
