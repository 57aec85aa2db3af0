"""Speed of the CUDA decode products alone (the matrix-vector kernels mv_nN) over 1-8 activation
rows, at Llama-3.1-8B's and Llama-3.2-1B's matrix shapes in the Q4_K_M mix, and float ones (MoE
routers in F32, an F16 model's products) (not a test).

The weights of one decode step are read once whatever the rows: a product of n rows should cost
about what one row's does. For each shape and n, the time of one product (its quant_x launch
included, as in a step without fusions): copies of the matrix (at their own addresses, 400 MB in all,
more than any L2 holds, as a step over all the layers streams them from memory) multiplied in turn,
captured in a CUDA graph, the graph launched --reps times between events, the median per product
(bench/expert_micro.py's timing).
GB/s is the matrix's bytes over that time; "x n=1" the time against the same shape's one-row product.
Outputs are checked against the dequantized weights in numpy (relative error; int8 x gives ~5e-3).
Variants are CudaConfig changes (k=v[,k=v]); ratios against the first.

    python bench/mv_micro.py [--shapes 8b-qkv 8b-gate-up 8b-down 1b-gate-up] [--rows 1 2 4 8]
                             [--variants ""] [--reps 20] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from ember.backends.cuda import Backend  # noqa: E402
from ember.backends.cuda.config import CudaConfig  # noqa: E402
from ember.quant import GGMLType, dequantize  # noqa: E402

# the graph timing and error of bench/expert_micro.py (by path: bench/ is off sys.path, see above)
_spec = importlib.util.spec_from_file_location("expert_micro", Path(__file__).resolve().parent / "expert_micro.py")
expert_micro = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(expert_micro)
time_us, rel = expert_micro.time_us, expert_micro.rel

T = GGMLType
# name: (type, [rows of each matrix sharing x], columns k)
SHAPES = {
    "8b-qkv": (T.Q4_K, [4096, 1024, 1024], 4096),
    "8b-gate-up": (T.Q4_K, [14336, 14336], 4096),
    "8b-down": (T.Q6_K, [4096], 14336),
    "8b-down-q4k": (T.Q4_K, [4096], 14336),
    "8b-o": (T.Q4_K, [4096], 4096),
    "1b-gate-up": (T.Q4_K, [8192, 8192], 2048),
    "1b-down": (T.Q6_K, [2048], 8192),
    # float matrices: a MoE router (Qwen3-30B-A3B's 128 experts; gpt-oss's 32) and an F16 model's products
    "router-qwen3": (T.F32, [128], 2048),
    "router-gpt-oss": (T.F32, [32], 2880),
    "8b-qkv-f16": (T.F16, [4096, 1024, 1024], 4096),
    "1b-gate-up-f16": (T.F16, [8192, 8192], 2048),
}
BASE_ROWS = 512  # distinct rows made (random blocks); the matrices repeat them
STREAM_BYTES = 400 << 20  # copies of a shape's matrices cycled through: several times any L2


class Tensor:
    """A matrix as the loader hands one to Backend.weight."""

    def __init__(self, name: str, qtype: GGMLType, base: np.ndarray, rows: int, k: int):
        self.name, self.type, self.shape = name, qtype, (rows, k)
        self.data = np.ascontiguousarray(np.tile(base, (-(-rows // len(base)), 1))[:rows])


def bench_shape(name: str, rows_list: list[int], variants: list[str], reps: int, rng) -> list[dict]:
    from synth import random_blocks, weight

    qtype, ms, k = SHAPES[name]
    float_type = qtype in (T.F32, T.F16, T.BF16)  # random bytes would be NaNs: normal values instead
    base = (weight if float_type else random_blocks)(rng, qtype, BASE_ROWS, k, 0.05).reshape(BASE_ROWS, -1)
    w_ref = dequantize(base.reshape(-1), qtype).reshape(BASE_ROWS, k).astype(np.float64)
    tensors = [Tensor(f"{name}.{j}", qtype, base, m, k) for j, m in enumerate(ms)]
    nbytes = sum(t.data.nbytes for t in tensors)
    copies = max(2, -(-STREAM_BYTES // nbytes))
    out = []
    for v in variants:
        changes = {kk: int(x) for kk, x in (kv.split("=") for kv in v.split(","))} if v else {}
        b = Backend(config=CudaConfig(**changes))
        cp = b.cp
        sets = [[b.weight(t) for t in tensors] for _ in range(copies)]
        base_us = None
        for n in rows_list:
            x_h = rng.normal(0, 1, (n, k)).astype(np.float32)
            x = cp.asarray(x_h)
            ys = [cp.full((n, m), np.nan, np.float32) for m in ms]
            cycle = itertools.cycle(sets)  # each call takes the next copy: one graph goes over them all
            us = time_us(cp, lambda: b.matmuls(next(cycle), x, ys), reps, per_graph=len(sets))
            ref = x_h.astype(np.float64) @ w_ref.T
            err = max(rel(cp.asnumpy(y)[:, :BASE_ROWS], ref[:, :min(m, BASE_ROWS)]) for y, m in zip(ys, ms))
            base_us = us if n == rows_list[0] else base_us
            row = {"shape": name, "variant": v, "type": qtype.name, "rows": ms, "k": k, "n": n, "us": round(us, 2),
                   "gb_s": round(nbytes / us / 1e3, 1), "vs_first_n": round(us / base_us, 2), "err": err}
            out.append(row)
            print(f"{name:12} {v or 'default':24} n={n}: {us:8.1f} us  {row['gb_s']:7.1f} GB/s  "
                  f"x{row['vs_first_n']:.2f} of n={rows_list[0]}  err {err:.1e}", flush=True)
        del sets
        cp.get_default_memory_pool().free_all_blocks()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["8b-qkv", "8b-gate-up", "8b-down", "1b-gate-up"],
                    choices=sorted(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--variants", nargs="*", default=[""], help="CudaConfig changes, each k=v[,k=v] ('' as is)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.time()
    rows = [r for s in args.shapes for r in bench_shape(s, args.rows, args.variants, args.reps, rng)]
    if len(args.variants) > 1:
        first = {(r["shape"], r["n"]): r["us"] for r in rows if r["variant"] == args.variants[0]}
        for r in rows:
            if r["variant"] != args.variants[0]:
                print(f"{r['shape']:12} {r['variant']:24} n={r['n']}: {r['us'] / first[r['shape'], r['n']]:.2f}x "
                      f"of {args.variants[0] or 'default'}")
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"bench": "mv_micro", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
