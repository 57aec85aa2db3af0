"""Dense prompt products on CUDA at Llama-3.1-8B shapes: the backend's tensor-core tiles beside the
weights dequantized to f16 and multiplied by the BLAS library (cuBLAS, called through ctypes), not a test.

For each matrix shape and step size: the time of one product of n activation rows by the backend's
own choice without that route (CudaConfig(blas_rows=0): mm_split up to 64 rows, the tile kernels
beyond), of the backend as it is (the route from blas_rows rows), and of the BLAS route
split into its parts: dequant_f16 (the weight's blocks into an f16 scratch matrix), x_to_f16 (the
activations, rows that would overflow scaled by a power of two), cublasGemmEx (f16 in, f32 out, f32
accumulation) and unscale_rows. Times per product: 10 products captured in a CUDA graph, the graph
launched --reps times between events, the median. Outputs of the two routes are compared
(relative error). TFLOP/s = 2 n m k over the time.

    python bench/prompt_gemm.py [--shapes ...] [--tokens 64 128 256 512 2048] [--reps 20] [--out FILE]

With --model NAME (one of bench/cuda_peer.py's synthetic files, written to --dir): whole-model pp512
and tg128 (--many: and 64 streams x (512 + 128) total) through the engine instead, for each of
--variants alternating, --rounds times each (bench/cuda_peer.py's measurement): tiles (no BLAS
route), blas (the backend as it is: the route from 64 rows, ahead of mm_split), split64 (mm_split
keeps 64-row steps), blas48 (the route from 48 rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from ember.backends.cuda import Backend  # noqa: E402
from ember.backends.cuda.config import CudaConfig  # noqa: E402
from ember.backends.cuda.ops import Matmul  # noqa: E402
from ember.quant import GGMLType  # noqa: E402

# name: (type, rows m, columns k)  -- Llama-3.1-8B's layer matrices
SHAPES = {
    "q-q4k": (GGMLType.Q4_K, 4096, 4096),
    "kv-q4k": (GGMLType.Q4_K, 1024, 4096),
    "up-q4k": (GGMLType.Q4_K, 14336, 4096),
    "down-q4k": (GGMLType.Q4_K, 4096, 14336),
    "down-q6k": (GGMLType.Q6_K, 4096, 14336),
    "q-q8": (GGMLType.Q8_0, 4096, 4096),
    "up-q8": (GGMLType.Q8_0, 14336, 4096),
}


class Tensor:
    def __init__(self, name, qtype, m, k, rng):
        from synth import weight

        self.name, self.type, self.shape = name, qtype, (m, k)
        self.data = np.ascontiguousarray(weight(rng, qtype, m, k, 0.05))


def _bench_module(name: str):
    """bench/NAME.py by path (this folder is off sys.path: a module named `cuda` would shadow NVIDIA's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"ember_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def time_us(cp, call, reps: int) -> float:
    """expert_micro's timing: 10 calls captured in a CUDA graph, the graph launched reps times."""
    return _bench_module("expert_micro").time_us(cp, call, reps)


def route_launches(b: Backend, w, x, y) -> list:
    """The BLAS route's launches for y = x @ w.T as the backend plans them, at any row count
    (blas_rows 1): x_to_f16, dequant_f16, the cuBLAS call (one run of rows: these shapes fit the
    scratch), unscale_rows."""
    op = Matmul([w], x, [y], mv_rows=1, cfg=CudaConfig(blas_rows=1), n_sm=b.n_sm)
    launches = replace(op, blas_buf=b._blas_scratch([w], x)).launches(b.kernels)
    assert len(launches) == 4, "one run of rows"
    return launches


def run_all(launches) -> None:
    for launch in launches:
        launch.run()


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


VARIANTS = {"tiles": {"blas_rows": 0},  # mm_split to 64 rows, the tiles beyond
            "blas": {},  # the backend as it is
            "blas48": {"blas_rows": 48},  # the BLAS route from 48 rows, ahead of mm_split
            "split64": {"blas_rows": 65}}  # mm_split to 64 rows, the BLAS route beyond (before 2026-12-06)


def whole_model(name: str, folder: Path, rounds: int, reps: int, many: bool, labels: list) -> dict:
    peer = _bench_module("cuda_peer")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.gguf"
    if not path.exists():
        t0 = time.time()
        peer.write(path, name)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB, {time.time() - t0:.0f} s)", flush=True)
    variants = {label: VARIANTS[label] for label in labels}
    runs: dict = {v: [] for v in variants}
    for r in range(rounds):
        for label, changes in variants.items():
            res = peer.bc.with_config(changes, peer.ember_single, path, "cuda", reps)
            line = f"round {r} {label:7}: pp512 {res['pp512']:8.1f} tok/s  tg128 {res['tg128']:6.1f}"
            if many:
                res["many"] = peer.bc.with_config(changes, peer.ember_many, path, "cuda")
                m = res["many"]
                line += (f"  64 x (512 + 128) total {m['total_tps']:8.1f} tok/s (decode {m['gen_tps']:.0f} tok/s, "
                         f"a 64-row step {m.get('decode_replay_ms') or float('nan'):.2f} ms replayed)")
            runs[label].append(res)
            print(line, flush=True)
    out = {"model": name, "runs": runs}
    for label in variants:
        out[label] = {"pp512": statistics.median(x["pp512"] for x in runs[label]),
                      "tg128": statistics.median(x["tg128"] for x in runs[label])}
        if many:
            out[label]["many_total"] = statistics.median(x["many"]["total_tps"] for x in runs[label])
    for label in variants:
        print(f"{name} {label:7}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[label].items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a bench/cuda_peer.py model name: whole-model pp512 and tg128")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/ember_models"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--many", action="store_true", help="with --model: 64 streams x (512 + 128) as well")
    ap.add_argument("--variants", nargs="+", default=["tiles", "blas"], choices=sorted(VARIANTS),
                    help="with --model: the backend configurations run, alternating")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[64, 128, 256, 512, 2048])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.model:
        res = whole_model(args.model, args.dir, args.rounds, 3, args.many, args.variants)
        if args.out:
            args.out.write_text(json.dumps({"bench": "prompt_gemm", "whole_model": res}, indent=1, default=str))
        return
    rng = np.random.default_rng(0)
    b = Backend(config=CudaConfig(blas_rows=0))  # the tiles (and mm_split) only
    route = Backend()  # the backend as it is: the BLAS route from CudaConfig.blas_rows rows
    cp = b.cp
    print(b.describe(), flush=True)
    t0 = time.time()
    rows = []
    for name in args.shapes:
        qtype, m, k = SHAPES[name]
        t = Tensor(name, qtype, m, k, rng)
        w, w_route = b.weight(t), route.weight(t)
        for n in args.tokens:
            x = cp.asarray(rng.normal(0, 1, (n, k)).astype(np.float32))
            y_own, y_blas = cp.full((n, m), np.nan, np.float32), cp.full((n, m), np.nan, np.float32)
            y_route = cp.full((n, m), np.nan, np.float32)
            convert, dequant, gemm, unscale = parts = route_launches(route, w_route, x, y_blas)
            t_own = time_us(cp, lambda: b.matmuls([w], x, [y_own]), args.reps)
            t_route = time_us(cp, lambda: route.matmuls([w_route], x, [y_route]), args.reps)
            t_all = time_us(cp, lambda: run_all(parts), args.reps)
            t_deq = time_us(cp, dequant.run, args.reps)
            t_cvt = time_us(cp, convert.run, args.reps)
            t_gemm = time_us(cp, gemm.run, args.reps)
            t_uns = time_us(cp, unscale.run, args.reps)
            run_all(parts)
            err = rel(cp.asnumpy(y_blas), cp.asnumpy(y_own))
            err_route = rel(cp.asnumpy(y_route), cp.asnumpy(y_own))
            fl = 2.0 * n * m * k
            row = {"shape": name, "type": qtype.name, "m": m, "k": k, "tokens": n, "own_us": round(t_own, 2), "backend_us": round(t_route, 2),
                   "backend_err": err_route,
                   "blas_us": round(t_all, 2), "dequant_us": round(t_deq, 2), "x_f16_us": round(t_cvt, 2),
                   "gemm_us": round(t_gemm, 2), "unscale_us": round(t_uns, 2), "rel_err": err,
                   "own_tflops": round(fl / t_own / 1e6, 1), "blas_tflops": round(fl / t_all / 1e6, 1),
                   "gemm_tflops": round(fl / t_gemm / 1e6, 1), "speedup": round(t_own / t_all, 2)}
            rows.append(row)
            print(f"{name:9} {qtype.name:5} n={n:5}: own {t_own:8.1f} us ({row['own_tflops']:6.1f} TF/s)  blas "
                  f"{t_all:8.1f} us ({row['blas_tflops']:6.1f})  = deq {t_deq:6.1f} + x {t_cvt:5.1f} + gemm "
                  f"{t_gemm:7.1f} ({row['gemm_tflops']:6.1f}) + uns {t_uns:4.1f}  -> {row['speedup']:.2f}x  "
                  f"err {err:.1e}; backend now {t_route:8.1f} us (err {err_route:.1e})", flush=True)
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        args.out.write_text(json.dumps({"bench": "prompt_gemm", "device": b.describe(), "rows": rows}, indent=1,
                                       default=str))


if __name__ == "__main__":
    main()
