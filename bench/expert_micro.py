"""Speed of the CUDA grouped expert products alone, at the MoE shapes of issue 28 (not a test).

For each stack of experts (random blocks at the real shape) and each step size, the time of one
product over the step's selections (random routing, a token's experts distinct):

  - old: expert_matmul on the quantized stack (a warp a row, float dot products, every selection's
    f32 x read per row) -- kept in experts.cu for float experts, timed here as the baseline;
  - mv: the decode path (quant_x + expert_mv), at every size;
  - tile: the prompt path (quant_x + expert_group + expert_tile, or expert_tile_sb for the K-quants),
    at every size;
  - unit (the K-quants): the prompt path with expert_tile in place of expert_tile_sb -- each unit's
    sums scaled into floats, where expert_tile_sb scales a super-block's integer sums once;
  - the backend's choice (takes_mv: by step and row length) is the one of the two the shape falls to.

Outputs are compared with the old kernel's (relative error; int8 x gives ~5e-3). Times are per
product: 10 products captured in a CUDA graph, the graph launched --reps times between CUDA events,
the median; "tok/s" is the step's tokens over that time (one matrix of one layer), TFLOP/s the
step's 2 * selections * m * k over it.

    python bench/expert_micro.py [--shapes qwen3-gate qwen3-down gpt-oss] [--tokens 1 8 64 512]
                                 [--reps 20] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
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
from ember.backends.cuda.ops.experts import takes_mv  # noqa: E402
from ember.backends.cuda.ops.base import Launch, i32, i64, ptr  # noqa: E402
from ember.backends.cuda.ops.experts import EXP_ROWS, SB_TYPES, ExpertMatmul, experts_module  # noqa: E402
from ember.quant import GGMLType, quantize  # noqa: E402

# name: (type, n_expert, rows m, columns k, experts a token)
SHAPES = {
    "qwen3-gate": (GGMLType.Q4_K, 128, 768, 2048, 8),  # Qwen3-30B-A3B ffn_{gate,up}_exps
    "qwen3-down": (GGMLType.Q4_K, 128, 2048, 768, 8),  # its ffn_down_exps (Q4_K layers of Q4_K_M)
    "qwen3-down-q6k": (GGMLType.Q6_K, 128, 2048, 768, 8),  # (Q6_K layers of Q4_K_M)
    "qwen3-gate-q8": (GGMLType.Q8_0, 128, 768, 2048, 8),
    "gpt-oss": (GGMLType.MXFP4, 32, 2880, 2880, 4),  # gpt-oss-20b ffn_{gate,up,down}_exps
}


DISTINCT = 4


class Stack:
    """A stacked-experts tensor as the loader hands one to Backend.weight."""

    def __init__(self, name: str, qtype: GGMLType, n_expert: int, m: int, k: int, rng):
        from synth import weight

        self.name, self.type, self.shape = name, qtype, (n_expert, m, k)
        # a few experts of random blocks repeated over the stack (each expert still at its own
        # addresses: the bytes read are the same; making 128 of them takes minutes in numpy)
        if qtype == GGMLType.MXFP4:
            blocks = quantize(rng.normal(0, 0.05, (DISTINCT * m, k)).astype(np.float32), qtype)
        else:
            blocks = weight(rng, qtype, DISTINCT * m, k, 0.05)
        base = np.asarray(blocks).reshape(DISTINCT, m, -1)
        self.data = np.ascontiguousarray(np.tile(base, (-(-n_expert // DISTINCT), 1, 1))[:n_expert])


def old_launch(b: Backend, w, x, x_div: int, ids, y) -> Launch:
    """expert_matmul (experts.cu) on a quantized stack: the kernel every type took before."""
    n_expert, m, k = w.shape
    args = (ptr(w.data.buf), i64(w.data.row_bytes), i64(m * w.data.row_bytes), i32(m), i32(k), ptr(x), i32(x_div),
            ptr(ids), i32(ids.size), ptr(y), ptr(None))  # no biases
    fn = b.kernels.fn(experts_module(w.type), "expert_matmul")
    return Launch(fn, (-(-m // EXP_ROWS), n_expert, 1), (32 * EXP_ROWS, 1, 1), args)


def unit_tile_call(b: Backend, w, x, used: int, ids, y):
    """The prompt path with expert_tile where the backend takes expert_tile_sb (a benchmark variant)."""
    launches = ExpertMatmul([w], x, used, ids, [y], b._expert_scratch(x, ids.size, w.shape[0]), 0).launches(b.kernels)
    last = launches[-1]
    launches[-1] = Launch(b.kernels.fn(experts_module(w.type), "expert_tile"), last.grid, last.block, last.args)

    def call():
        for la in launches:
            la.run()
    return call


def time_us(cp, call, reps: int, per_graph: int = 10) -> float:
    """Median time of one call: per_graph calls captured in a CUDA graph (so that launching from
    Python adds nothing between kernels), the graph launched reps times between events."""
    call()  # the first call compiles and allocates its buffers (nothing may allocate while capturing)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(per_graph):
            call()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(reps):
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / per_graph)
    return statistics.median(times)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench_shape(name: str, n_tokens: list[int], reps: int, rng) -> list[dict]:
    qtype, n_expert, m, k, used = SHAPES[name]
    mv = Backend(config=CudaConfig(moe_mv_tokens=64))  # mv up to 64 tokens
    tile = Backend(config=CudaConfig(moe_mv_tokens=0))  # tiles at every size
    cp = mv.cp
    stack = Stack(name, qtype, n_expert, m, k, rng)
    w_mv, w_tile = mv.weight(stack), tile.weight(stack)
    rows = []
    for n in n_tokens:
        ids_h = np.stack([rng.permutation(n_expert)[:used] for _ in range(n)]).astype(np.int32)
        x_h = rng.normal(0, 1, (n, k)).astype(np.float32)
        x, ids = cp.asarray(x_h), cp.asarray(ids_h)
        y_old, y_mv, y_tile = (cp.full((n * used, m), np.nan, np.float32) for _ in range(3))
        launch = old_launch(mv, w_mv, x, used, ids, y_old)
        t_old = time_us(cp, launch.run, reps)
        t_mv = time_us(cp, lambda: mv.expert_matmuls([w_mv], x, ids, [y_mv]), reps) if n <= 64 else None
        t_tile = time_us(cp, lambda: tile.expert_matmuls([w_tile], x, ids, [y_tile]), reps)
        ref = cp.asnumpy(y_old)
        row = {"shape": name, "type": qtype.name, "n_expert": n_expert, "m": m, "k": k, "top_k": used, "tokens": n,
               "old_us": round(t_old, 2), "tile_us": round(t_tile, 2), "tile_err": rel(cp.asnumpy(y_tile), ref)}
        if qtype in SB_TYPES and k % 256 == 0:
            y_unit = cp.full((n * used, m), np.nan, np.float32)
            t_unit = time_us(cp, unit_tile_call(tile, w_tile, x, used, ids, y_unit), reps)
            row.update(unit_us=round(t_unit, 2), unit_err=rel(cp.asnumpy(y_unit), ref))
            print(f"{name:15} {qtype.name:6} {n:4} tok: unit (expert_tile) {t_unit:9.1f} us "
                  f"(err {row['unit_err']:.1e}), super-block {t_tile:9.1f} us: {t_unit / t_tile:.2f}x", flush=True)
        if t_mv is not None:
            row.update(mv_us=round(t_mv, 2), mv_err=rel(cp.asnumpy(y_mv), ref))
        new = t_mv if takes_mv(n, k) and t_mv is not None else t_tile
        row.update(new_us=round(new, 2), speedup=round(t_old / new, 2), new_tok_s=round(n / new * 1e6, 1),
                   new_tflops=round(2 * n * used * m * k / new / 1e6, 2))
        rows.append(row)
        mv_part = f"mv {t_mv:9.1f} us (err {row['mv_err']:.1e})" if t_mv is not None else " " * 28
        print(f"{name:15} {qtype.name:6} {n:4} tok: old {t_old:9.1f} us  {mv_part}  tile {t_tile:9.1f} us "
              f"(err {row['tile_err']:.1e})  chosen {new:9.1f} us = {row['speedup']:.2f}x old, "
              f"{row['new_tflops']:.1f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-gate", "qwen3-down", "qwen3-down-q6k", "gpt-oss"],
                    choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16, 64, 512])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    t0 = time.time()
    rows = [r for s in args.shapes for r in bench_shape(s, args.tokens, args.reps, rng)]
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"bench": "expert_micro", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
