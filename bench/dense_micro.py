"""Speed of the CUDA dense prompt products alone, at Llama-3.1-8B's matrix shapes (not a test).

For each weight type, matrix shape and step size, the time of one product y (n, m) = x (n, k) @ W.T:

  - old: matmul.cu's mm_tile (or mm_tile64, as Matmul._tile_rows picks): weights decoded to f16 in
    shared memory, f16 tensor cores (mma.sync m16n8k16), x read as f32;
  - new: the backend's path for quantized prompts: quant_x, then experts.cu's dense_tile (weights
    decoded once a tile to int8, int8 tensor cores, mma.sync m16n8k32);
  - the backend's choice (Backend.matmul): mm_split up to 64 rows where it fits, else the new path.

Outputs are compared with each other (relative error; int8 x gives ~5e-3). Times are per product:
10 products captured in a CUDA graph, the graph launched --reps times between CUDA events, the
median (bench/expert_micro.py's time_us); TFLOP/s = 2 n m k over it.

    python bench/dense_micro.py [--types Q4_K Q6_K Q8_0] [--shapes qkv-o up down] [--tokens 16 64 512]
                                [--reps 20] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from ember.backends.cuda import Backend  # noqa: E402
from ember.backends.cuda.ops.matmul import Matmul, dense_q8  # noqa: E402
from ember.quant import GGMLType  # noqa: E402


def expert_micro():
    """bench/expert_micro.py (its timing and error helpers), loaded by path: bench/ on sys.path
    would put bench/cuda.py in place of NVIDIA's `cuda` package that CuPy imports."""
    spec = importlib.util.spec_from_file_location("expert_micro", ROOT / "bench" / "expert_micro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_em = expert_micro()
rel, time_us = _em.rel, _em.time_us

# name: (rows m, columns k) of Llama-3.1-8B
SHAPES = {"qkv-o": (4096, 4096), "up": (14336, 4096), "down": (4096, 14336)}
DISTINCT_ROWS = 512  # random rows made once and repeated over the matrix (numpy is slow at 8B sizes)


def matrix(b: Backend, qtype: GGMLType, m: int, k: int, rng):
    from synth import weight

    base = np.asarray(weight(rng, qtype, DISTINCT_ROWS, k, 0.05)).reshape(DISTINCT_ROWS, -1)
    data = np.ascontiguousarray(np.tile(base, (-(-m // DISTINCT_ROWS), 1))[:m])
    return b.weight(SimpleNamespace(name=f"{qtype.name}-{m}x{k}", type=qtype, shape=(m, k), data=data.reshape(-1)))


def bench_one(b: Backend, w, n: int, reps: int, rng) -> dict:
    cp = b.cp
    m, k = w.shape
    x = cp.asarray(rng.normal(0, 1, (n, k)).astype(np.float32))
    y_old, y_new = cp.full((n, m), np.nan, np.float32), cp.full((n, m), np.nan, np.float32)
    old = Matmul([w], x, [y_old], mv_rows=8, n_sm=b.n_sm)._tile(b.kernels, [0])
    new = Matmul([w], x, [y_new], xq=b._xq_for(x), mv_rows=8, n_sm=b.n_sm).launches(b.kernels)
    assert dense_q8(w.type, n) and b.kernels.name_of(new[-1].fn).endswith(".dense_tile")
    y_b = cp.full((n, m), np.nan, np.float32)
    t_old = time_us(cp, old.run, reps)
    t_new = time_us(cp, lambda: [la.run() for la in new], reps)
    t_b = time_us(cp, lambda: b.matmul(w, x, y_b), reps)  # the backend's choice (mm_split up to 64 rows)
    flop = 2 * n * m * k
    return {"type": w.type.name, "m": m, "k": k, "tokens": n, "old_kernel": b.kernels.name_of(old.fn),
            "old_us": round(t_old, 2), "new_us": round(t_new, 2), "speedup": round(t_old / t_new, 2),
            "old_tflops": round(flop / t_old / 1e6, 1), "new_tflops": round(flop / t_new / 1e6, 1),
            "backend_us": round(t_b, 2), "err": rel(cp.asnumpy(y_new), cp.asnumpy(y_old)),
            "backend_err": rel(cp.asnumpy(y_b), cp.asnumpy(y_old))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    b = Backend()
    t0 = time.time()
    rows = []
    for name in args.types:
        for shape in args.shapes:
            w = matrix(b, GGMLType[name], *SHAPES[shape], rng)
            for n in args.tokens:
                r = bench_one(b, w, n, args.reps, rng)
                rows.append(r)
                print(f"{name:5} {shape:6} {r['m']:5}x{r['k']:<5} {n:4} tok: old {r['old_kernel']:24} "
                      f"{r['old_us']:9.1f} us {r['old_tflops']:6.1f} TFLOP/s   dense_tile {r['new_us']:9.1f} us "
                      f"{r['new_tflops']:6.1f} TFLOP/s = {r['speedup']:.2f}x   (err {r['err']:.1e})   "
                      f"backend's choice {r['backend_us']:9.1f} us", flush=True)
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"bench": "dense_micro", "device": b.describe(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
