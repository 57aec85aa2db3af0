"""Speed of ember_matmul alone on the layer shapes of the real models and of a Llama-3.2-1B-shaped
Q4_K_M file (not a test).

For each weight matrix: n=1 (one generated token; weights streamed from DRAM: the script cycles
through enough copies of the matrix to defeat the 32 MB L3, as a real decode step over all layers
does) and n=512 (a prompt batch: compute bound). Prints the best time per call of several (other
processes only ever add time), GFLOP/s and the effective weight bandwidth (bytes of W / time), then
what the products alone would allow per token for each model: matmul-only tg and pp512 rates (the
output head runs for the last prompt token only, as in llama.cpp). The activations are rounded as the
model's file makes the backend round them: as llama.cpp does (int8 for the 32-value types too) in the
files that hold K-quants, exactly (int16) in the others. Note the machine's load alongside.

    python bench/matmul_micro.py [--threads 2] [--models smollm2 gemma3 llama-1b] [--ns 1 512] [--isa avx2]
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


def last_level_cache_bytes() -> int:
    """The L3's size as Linux reports it (0 where it does not)."""
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
    except OSError:
        return 0
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text)


# copies of W cycled through for n=1: three times the L3 (some server parts have 480 MB), at least 96 MB
COLD_BYTES = max(96 << 20, 3 * last_level_cache_bytes())

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
    "llama-1b": [  # 16 layers, d 2048, ffn 8192, Q4_K_M: Q6_K attn_v and ffn_down in 8 of 16 layers, Q6_K head
        Shape("q/o 2048->2048", T.Q4_K, 2048, 2048, 32),
        Shape("k 2048->512", T.Q4_K, 512, 2048, 16 + 8),
        Shape("v 2048->512", T.Q6_K, 512, 2048, 8),
        Shape("gate/up 2048->8192", T.Q4_K, 8192, 2048, 32),
        Shape("down 8192->2048", T.Q4_K, 2048, 8192, 8),
        Shape("down 8192->2048", T.Q6_K, 2048, 8192, 8),
        Shape("output 2048->128256", T.Q6_K, 128256, 2048, 1, head=True),
    ],
    "llama-8b": [  # 32 layers, d 4096, ffn 14336, Q4_K_M: Q6_K attn_v and ffn_down in 16 of 32 layers, Q6_K head
        Shape("q/o 4096->4096", T.Q4_K, 4096, 4096, 64),
        Shape("k 4096->1024", T.Q4_K, 1024, 4096, 32 + 16),
        Shape("v 4096->1024", T.Q6_K, 1024, 4096, 16),
        Shape("gate/up 4096->14336", T.Q4_K, 14336, 4096, 64),
        Shape("down 14336->4096", T.Q4_K, 4096, 14336, 16),
        Shape("down 14336->4096", T.Q6_K, 4096, 14336, 16),
        Shape("output 4096->128256", T.Q6_K, 128256, 4096, 1, head=True),
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


# Models whose files hold no K-quants: their 32-value types keep exact (int16) activations.
EXACT_MODELS = {"smollm2"}


def random_weight(qtype: GGMLType, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    lay = layout(qtype)
    blocks = rng.integers(0, 256, (m * (k // lay.block_size), lay.type_size), dtype=np.uint8)
    for off in SCALE_FIELDS.get(qtype, []):
        blocks[:, off:off + 2] = np.array([0.01], np.float16).view(np.uint8)
    return blocks.reshape(m, -1)


class Runner:
    def __init__(self, threads: int):
        self.pool = ffi.gc(lib.ember_pool_create(threads), lib.ember_pool_destroy)

    def time_call(self, s: Shape, ws: list[np.ndarray], n: int, rounding: int,
                  min_time: float = 0.3) -> tuple[float, float]:
        """Best and median seconds of one ember_matmul over `ws` in turn (several copies: cold weights):
        the minimum, since other processes on a 2-core machine only ever add time, and the median, the
        figure a decode step sees."""
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
                             args[3], rounding)

        call(0)
        times, i, t_end = [], 0, time.perf_counter() + min_time
        while time.perf_counter() < t_end or len(times) < 5:
            t0 = time.perf_counter()
            call(i)
            times.append(time.perf_counter() - t0)
            i += 1
        return float(np.min(times)), float(np.median(times))


def bench_model(runner: Runner, name: str, shapes: list[Shape], ns: list[int]) -> None:
    rng = np.random.default_rng(0)
    rounding = lib.EMBER_ROUND_EXACT if name in EXACT_MODELS else lib.EMBER_ROUND_LLAMA
    print(f"\n{name} ({'exact' if name in EXACT_MODELS else 'llama.cpp'} rounding of the activations)")
    print(f"  {'matrix':22s} {'type':6s} {'n':>4s} {'ms':>9s} {'GFLOP/s':>8s} {'W GB/s':>7s} {'median':>7s}")
    totals = {n: 0.0 for n in ns}
    for s in shapes:
        w = random_weight(s.qtype, s.m, s.k, rng)
        copies = [w] + [w.copy() for _ in range(max(0, COLD_BYTES // w.nbytes - 1))]
        for n in ns:
            t, t_med = runner.time_call(s, copies if n == 1 else [w], n, rounding)
            # per token of the model: prompt tokens need the head once per batch only
            totals[n] += t * s.per_token if not (s.head and n > 1) else 0.0
            gflops = 2.0 * s.m * s.k * n / t / 1e9
            print(f"  {s.name:22s} {s.qtype.name:6s} {n:4d} {t * 1e3:9.3f} {gflops:8.1f} {w.nbytes / t / 1e9:7.2f} {w.nbytes / t_med / 1e9:7.2f}")
        if any(n > 1 for n in ns) and 1 in ns and s.head:
            head_1 = runner.time_call(s, copies, 1, rounding)[0]
            for n in ns:
                if n > 1:
                    totals[n] += head_1
        del copies
    for n in ns:
        label = "tg (n=1)" if n == 1 else f"pp{n}"
        print(f"  matmuls only, {label} per {'step' if n == 1 else 'batch'}: {totals[n] * 1e3:.2f} ms -> "
              f"{n / totals[n]:.0f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ns", nargs="+", type=int, default=[1, 512])
    ap.add_argument("--isa", help="force a SIMD path (scalar, avx2, avx512, neon)")
    ap.add_argument("--only", help="only the matrices whose name contains this")
    args = ap.parse_args()
    if args.isa and lib.ember_cpu_set_isa(args.isa.encode()) != 0:
        raise SystemExit(f"SIMD path {args.isa} is not available here")
    print(f"ember_matmul, {args.threads} threads, SIMD path {ffi.string(lib.ember_cpu_isa()).decode()}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    runner = Runner(args.threads)
    for name in args.models:
        shapes = [s for s in MODELS[name] if not args.only or args.only in s.name]
        bench_model(runner, name, shapes, args.ns)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
