"""Speed of ember_matmul alone on the layer shapes of the two real models (not a test).

For each weight matrix: n=1 (one generated token; weights streamed from DRAM: the script cycles
through enough copies of the matrix to defeat the 32 MB L3, as a real decode step over all layers
does) and n=512 (a prompt batch: compute bound). Each is timed with 16-bit activations (two int8
levels, the default) and with 8-bit ones (one level, as llama.cpp), interleaved, and the ratio
printed. Prints the median time per call, GFLOP/s and the effective weight bandwidth (bytes of W /
time; the machine copies about 19.5 GB/s), then what the products alone would allow per token for
each model: matmul-only tg and pp512 rates (the output head runs for the last prompt token only, as
in llama.cpp). Medians, since the machine may be shared: note its load alongside.

    python bench/matmul_micro.py [--threads 2] [--models smollm2 gemma3] [--ns 1 512] [--isa avx2]
                                 [--act-bits 16 8]
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np

from ember.backends.cpu._native import ffi, lib
from ember.quant.types import GGMLType, layout

T = GGMLType
COLD_BYTES = 96 << 20  # copies of W cycled through for n=1, well above the L3

# Offsets of the f16 scale fields in each block; every other byte may be random.
SCALE_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.IQ4_NL: [0],
                T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_XS: [0]}


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    qtype: GGMLType
    m: int  # output features (rows of W)
    k: int  # input features
    per_token: int = 1  # how many of these a token goes through (layers)
    head: bool = False  # the output projection: only the last prompt token needs it


MODELS = {
    "smollm2": [  # 30 layers, d 576, ffn 1536, all Q4_1; tied Q8_0 output head
        Shape("q/o 576->576", T.Q4_1, 576, 576, 60),
        Shape("k/v 576->192", T.Q4_1, 192, 576, 60),
        Shape("gate/up 576->1536", T.Q4_1, 1536, 576, 60),
        Shape("down 1536->576", T.Q4_1, 576, 1536, 30),
        Shape("output 576->49152", T.Q8_0, 49152, 576, 1, head=True),
    ],
    "gemma3": [  # 18 layers, d 640, ffn 2048; tied Q8_0 output head
        Shape("q 640->1024", T.Q5_0, 1024, 640, 18),
        Shape("k 640->256", T.Q5_0, 256, 640, 18),
        Shape("v 640->256", T.Q8_0, 256, 640, 18),
        Shape("o 1024->640", T.Q4_K, 640, 1024, 18),
        Shape("gate/up 640->2048", T.Q5_0, 2048, 640, 36),
        Shape("down 2048->640", T.Q6_K, 640, 2048, 18),
        Shape("output 640->262144", T.Q8_0, 262144, 640, 1, head=True),
    ],
}


def random_weight(qtype: GGMLType, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    lay = layout(qtype)
    blocks = rng.integers(0, 256, (m * (k // lay.block_size), lay.type_size), dtype=np.uint8)
    for off in SCALE_FIELDS.get(qtype, []):
        blocks[:, off:off + 2] = np.array([0.01], np.float16).view(np.uint8)
    return blocks.reshape(m, -1)


class Runner:
    def __init__(self, threads: int):
        self.pool = ffi.gc(lib.ember_pool_create(threads), lib.ember_pool_destroy)

    def time_call(self, s: Shape, ws: list[np.ndarray], n: int, min_time: float = 0.3) -> float:
        """Best seconds of one ember_matmul over `ws` in turn (several copies: cold weights); the
        minimum, since other processes on a 2-core machine only ever add time."""
        x = np.random.default_rng(1).standard_normal((n, s.k), dtype=np.float32)
        y = np.empty((n, s.m), np.float32)
        size = lib.ember_matmul_scratch_size(int(s.qtype), s.k, n)
        scratch = np.empty(size + 64, np.uint8)
        scratch = scratch[(-scratch.ctypes.data) % 64:]
        args = (ffi.cast("float *", ffi.from_buffer(x)), n, ffi.cast("float *", ffi.from_buffer(y)),
                ffi.from_buffer(scratch))
        ptrs = [ffi.from_buffer(w) for w in ws]

        def call(i: int) -> None:
            lib.ember_matmul(self.pool, int(s.qtype), ptrs[i % len(ptrs)], s.m, s.k, args[0], args[1], args[2],
                             args[3])

        call(0)
        times, i, t_end = [], 0, time.perf_counter() + min_time
        while time.perf_counter() < t_end or len(times) < 5:
            t0 = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - t0)
            i += 1
        return float(np.median(times))


def set_act_bits(bits: int) -> None:
    if lib.ember_matmul_set_act_bits(bits) != 0:
        raise SystemExit(f"activation bits must be 8 or 16, not {bits}")


def bench_model(runner: Runner, name: str, shapes: list[Shape], ns: list[int], modes: list[int]) -> None:
    rng = np.random.default_rng(0)
    first = modes[0]
    print(f"\n{name}")
    cols = " ".join(f"{f'ms act{b}':>9s}" for b in modes)
    ratio = f" {f'{first}/{modes[1]}':>6s}" if len(modes) > 1 else ""
    print(f"  {'matrix':22s} {'type':6s} {'n':>4s} {cols}{ratio} {'GFLOP/s':>8s} {'W GB/s':>7s}  (act{first})")
    totals = {(n, b): 0.0 for n in ns for b in modes}
    for s in shapes:
        w = random_weight(s.qtype, s.m, s.k, rng)
        copies = [w] + [w.copy() for _ in range(max(0, COLD_BYTES // w.nbytes - 1))]
        for n in ns:
            t = {}
            for b in modes:
                set_act_bits(b)
                t[b] = runner.time_call(s, copies if n == 1 else [w], n)
                # per token of the model: prompt tokens need the head once per batch only
                totals[n, b] += t[b] * s.per_token if not (s.head and n > 1) else 0.0
            times = " ".join(f"{t[b] * 1e3:9.3f}" for b in modes)
            ratio = f" {t[first] / t[modes[1]]:6.2f}" if len(modes) > 1 else ""
            gflops = 2.0 * s.m * s.k * n / t[first] / 1e9
            print(f"  {s.name:22s} {s.qtype.name:6s} {n:4d} {times}{ratio} {gflops:8.1f} {w.nbytes / t[first] / 1e9:7.2f}")
        if any(n > 1 for n in ns) and 1 in ns and s.head:
            for b in modes:
                set_act_bits(b)
                head_1 = runner.time_call(s, copies, 1)
                for n in ns:
                    if n > 1:
                        totals[n, b] += head_1
        del copies
    for n in ns:
        label = "tg (n=1)" if n == 1 else f"pp{n}"
        rates = ", ".join(f"act{b} {totals[n, b] * 1e3:.2f} ms -> {n / totals[n, b]:.0f} tok/s" for b in modes)
        print(f"  matmuls only, {label} per {'step' if n == 1 else 'batch'}: {rates}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ns", nargs="+", type=int, default=[1, 512])
    ap.add_argument("--isa", help="force a SIMD path (scalar, avx2, avx512, neon)")
    ap.add_argument("--act-bits", nargs="+", type=int, default=[16, 8], choices=[8, 16],
                    help="activation precisions to time (the first is the one GFLOP/s refer to)")
    args = ap.parse_args()
    if args.isa and lib.ember_cpu_set_isa(args.isa.encode()) != 0:
        raise SystemExit(f"SIMD path {args.isa} is not available here")
    print(f"ember_matmul, {args.threads} threads, SIMD path {ffi.string(lib.ember_cpu_isa()).decode()}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    start = lib.ember_matmul_act_bits()
    runner = Runner(args.threads)
    for name in args.models:
        bench_model(runner, name, MODELS[name], args.ns, args.act_bits)
    set_act_bits(start)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
