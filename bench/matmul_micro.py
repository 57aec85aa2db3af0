"""Speed of ember_matmul alone on the layer shapes of the real models and of a Llama-3.2-1B-shaped
Q4_K_M file (not a test).

For each weight matrix: n=1 (one generated token; weights streamed from DRAM: the script cycles
through enough copies of the matrix to defeat the L3, as a real decode step over all layers does, and
so for every n below 20, the rows of a speculative step) and n=512 (a prompt batch: compute bound).
Prints the best time per call of several (other processes only ever add time), GFLOP/s and the effective weight bandwidth (bytes of W / time), then
what the products alone would allow per token for each model: matmul-only tg and pp512 rates (the
output head runs for the last prompt token only, as in llama.cpp). The activations are rounded as the
model's file makes the backend round them: as llama.cpp does (int8 for the 32-value types too) in the
files that hold K-quants, exactly (int16) in the others. Note the machine's load alongside.

    python bench/matmul_micro.py [--threads 2] [--models smollm2 gemma3 llama-1b] [--ns 1 512] [--isa avx2]
                                 [--hot-rows 192]
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np

from ember.backends.cpu import rounding_for
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
# products of fewer tokens than this (decode and speculative steps) stream W from memory, as a step over
# all the layers does: they cycle through the copies too
STREAMED_TOKENS = 20

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


def llama_q4_k_m(d: int, d_kv: int, ffn: int, layers: int, vocab: int) -> list[Shape]:
    """A llama's matrices in llama.cpp's Q4_K_M mix: Q4_K, with Q6_K attn_v and ffn_down in half the
    layers and a Q6_K head."""
    half = layers // 2
    return [
        Shape(f"q/o {d}->{d}", T.Q4_K, d, d, 2 * layers),
        Shape(f"k {d}->{d_kv}", T.Q4_K, d_kv, d, layers + half),
        Shape(f"v {d}->{d_kv}", T.Q6_K, d_kv, d, half),
        Shape(f"gate/up {d}->{ffn}", T.Q4_K, ffn, d, 2 * layers),
        Shape(f"down {ffn}->{d}", T.Q4_K, d, ffn, half),
        Shape(f"down {ffn}->{d}", T.Q6_K, d, ffn, half),
        Shape(f"output {d}->{vocab}", T.Q6_K, vocab, d, 1, head=True),
    ]


MODELS = {
    "smollm2": [  # 30 layers, d 576, ffn 1536, all Q4_1; tied Q8_0 output head
        Shape("q/o 576->576", T.Q4_1, 576, 576, 60),
        Shape("k/v 576->192", T.Q4_1, 192, 576, 60),
        Shape("gate/up 576->1536", T.Q4_1, 1536, 576, 60),
        Shape("down 1536->576", T.Q4_1, 576, 1536, 30),
        Shape("output 576->49152", T.Q8_0, 49152, 576, 1, head=True),
    ],
    "llama-1b": llama_q4_k_m(2048, 512, 8192, 16, 128256),
    "llama-8b": llama_q4_k_m(4096, 1024, 14336, 32, 128256),
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


def bench_model(runner: Runner, name: str, shapes: list[Shape], ns: list[int], hot_rows: int = 0) -> None:
    rng = np.random.default_rng(0)
    rounding = rounding_for(s.qtype for s in shapes)
    print(f"\n{name} ({'exact' if rounding == lib.EMBER_ROUND_EXACT else 'llama.cpp'} rounding of the activations)")
    print(f"  {'matrix':22s} {'type':6s} {'n':>4s} {'ms':>9s} {'GFLOP/s':>8s} {'W GB/s':>7s} {'median':>7s}"
          + ("   hot best / median" if hot_rows else ""))
    totals = {n: 0.0 for n in ns}
    for s in shapes:
        w = random_weight(s.qtype, s.m, s.k, rng)
        copies = [w] + [w.copy() for _ in range(max(0, COLD_BYTES // w.nbytes - 1))]
        for n in ns:
            t, t_med = runner.time_call(s, copies if n < STREAMED_TOKENS else [w], n, rounding)
            # per token of the model: prompt tokens need the head once per batch only
            totals[n] += t * s.per_token if not (s.head and n > 1) else 0.0
            gflops = 2.0 * s.m * s.k * n / t / 1e9
            hot = ""
            if hot_rows and n < STREAMED_TOKENS:
                # the first rows alone, called back to back: W stays in L2, so this is the kernel's own
                # rate (arithmetic and loads), without the memory
                wh = w[:min(hot_rows, s.m)]
                h_best, h_med = runner.time_call(Shape(s.name, s.qtype, wh.shape[0], s.k), [wh], n, rounding)
                hot = f" {wh.nbytes / h_best / 1e9:9.2f} / {wh.nbytes / h_med / 1e9:.2f}"
            print(f"  {s.name:22s} {s.qtype.name:6s} {n:4d} {t * 1e3:9.3f} {gflops:8.1f} {w.nbytes / t / 1e9:7.2f} {w.nbytes / t_med / 1e9:7.2f}{hot}")
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
    ap.add_argument("--hot-rows", type=int, default=0,
                    help="also time the first N rows alone, resident in L2 (below 20 tokens): the kernel's rate "
                         "without the memory, e.g. 192 (1 thread: rows x row bytes well inside the L2)")
    args = ap.parse_args()
    if args.isa and lib.ember_cpu_set_isa(args.isa.encode()) != 0:
        raise SystemExit(f"SIMD path {args.isa} is not available here")
    print(f"ember_matmul, {args.threads} threads, SIMD path {ffi.string(lib.ember_cpu_isa()).decode()}, "
          f"load average {os.getloadavg()[0]:.2f} at start")
    runner = Runner(args.threads)
    for name in args.models:
        shapes = [s for s in MODELS[name] if not args.only or args.only in s.name]
        bench_model(runner, name, shapes, args.ns, args.hot_rows)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
