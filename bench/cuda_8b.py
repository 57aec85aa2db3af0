"""Batch-1 decode of a Llama-3.1-8B-shaped synthetic model on the GPU machine: the step's time,
weight bytes read per token against the device copy bandwidth, and each launch of one layer timed
alone (graph-replayed) beside the per-kernel totals. The files are written here (bench/cuda.py's
write_big_model, 5-7 s each on the H200 machine) and deleted after. No llama.cpp build runs here:
its figures for this shape are issue 28's (tg128 294 tok/s in Q4_K, 254 in Q8_0, H200).

    python bench/cuda_8b.py [--types Q4_K Q8_0 Q4_K_M] [--variants prologue_k_2048] [--steps 200]
                            [--out cuda_8b.json]

Q4_K_M is llama.cpp's mix of that name (bench/cuda.py q4_k_m_type: Q6_K for the output head and
half the layers' attn_v and ffn_down), with an output head of its own as Llama-3.1-8B has.
--variants: the step again (no per-kernel timing) with the backend's CudaConfig changed, in the
same process: prologue_k_2048 leaves every norm of this shape to a quant_x launch (rows of 4096
are past mv_n1's norm prologue; mv_xs normalises them itself by default).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import importlib.util  # noqa: E402

# bench/cuda.py by path: a module named `cuda` on sys.path would shadow NVIDIA's package CuPy imports
_spec = importlib.util.spec_from_file_location("ember_bench_cuda", ROOT / "bench" / "cuda.py")
bc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bc)

VARIANTS = {"prologue_k_2048": {"prologue_k": 2048}}

LLAMA_8B = {"n_layer": 32, "d_model": 4096, "d_ff": 14336, "n_head": 32, "n_kv_head": 8, "head_dim": 128,
            "n_vocab": 128256}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="*", default=["Q4_K", "Q8_0"])
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import cupy as cp

    copy_gbs = bc.copy_bandwidth(cp)
    print(f"device copy bandwidth {copy_gbs:.0f} GB/s")
    results = {"copy_gbs": copy_gbs, "types": {}}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for qtype in args.types:
            path = Path(tmp) / f"llama8b-{qtype}.gguf"
            t0 = time.perf_counter()
            step_bytes = bc.write_big_model(path, qtype, LLAMA_8B)
            print(f"wrote {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")
            r = bc.decode_bandwidth(path, step_bytes, copy_gbs, args.steps, listed=20)
            results["types"][qtype] = r
            print(f"{qtype}: step {r['step_ms']:.3f} ms (gpu {r['gpu_step_ms']:.3f}), {r['tokens_per_s']:.0f} tok/s, "
                  f"{r['weight_gbs']:.0f} GB/s = {100 * r['fraction_of_copy']:.1f}% of copy, "
                  f"{r['launches_per_step']} launches")
            print("  per kernel (launches, us a step):", json.dumps(r["profile"]["kernels"]))
            print("  kernels alone sum", r["profile"]["sum_us"], "us")
            for row in r["listed"]:
                print("   ", *row)
            for label in args.variants:
                v = bc.variant(VARIANTS[label], bc.decode_bandwidth, path, step_bytes, copy_gbs, args.steps, 0, False)
                r.setdefault("variants", {})[label] = v
                print(f"  {label}: step {v['step_ms']:.3f} ms, {v['tokens_per_s']:.0f} tok/s, "
                      f"{100 * v['fraction_of_copy']:.1f}% of copy, {v['launches_per_step']} launches")
            path.unlink()
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
