"""Runs the CUDA grouped expert kernels (kernels/experts.cu) on the CPU, without a GPU.

experts.cu is compiled as host C++ (g++) with a fiber per CUDA thread (ucontext, all on one OS
thread): a block's threads run in turn and switch only at barriers -- __syncthreads is a barrier
of the block, a warp shuffle writes a slot per lane between two barriers of the warp --, so
what a thread does between two barriers runs alone; __shared__ variables are the kernel's static
locals (blocks run one at a time). A block whose threads wait at a barrier some never reach
ends the run. expert_group, expert_tile and expert_mv then run
on random stacks of several types with x quantized in quant_x's format (numpy, as
tests/test_cuda_experts.py quantizes it), and their outputs are compared with the float64 product
of the reference dequantizer; every selection's row must be written (the output starts as NaN).
expert_tile runs both of its paths: tensor-core
products (the fragments' layout emulated as the PTX ISA gives it) and dp4a. expert_mv runs as a launch of two
matrices (grid z = 2, the same stack twice), whose two outputs must be equal.
This checks the kernels' own indexing, staging and barriers, which the numpy runs of the algorithm
in the tests do not see; not their speed, nor what only a GPU does (memory model, occupancy).

    python bench/cuda_experts_check.py [--types Q4_K Q6_K ...] [--tokens 3 64]
"""
from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from ember.backends.cuda._kernels import kernel_source, low_bit_source  # noqa: E402
from ember.backends.cuda.ops.experts import (  # noqa: E402
    EG_THREADS, EMV_THREADS, ET_ROWS, ET_THREADS, ET_TOK, SB_TYPES, device_row_bytes, mv_group, mv_team_log2,
    regroup_mxfp4, tile_bound)
from ember.quant import GGMLType, dequantize, layout, quantize  # noqa: E402

KERNELS = ROOT / "ember" / "backends" / "cuda" / "kernels"

# What the kernels use of CUDA, for host threads (after common.cuh's EMBER_HOST_TEST part).
PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <ucontext.h>
#include <vector>
using std::min;
using std::max;
struct int4 { int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct dim3 { unsigned x = 0, y = 0, z = 0; };
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
static inline uint4 make_uint4(u32 x, u32 y, u32 z, u32 w) { return {x, y, z, w}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline float2 make_float2(float x, float y) { return {x, y}; }
static dim3 threadIdx, blockIdx, blockDim, gridDim;

// A block's threads are fibers of one OS thread, switched only at barriers: what a thread does
// between two barriers runs alone, as if every other thread were before or after it.
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done;
};
static ucontext_t g_main;
static std::vector<Fiber> g_fibers;
static int g_cur;
static bool g_progress;
static void yield_fiber() { swapcontext(&g_fibers[g_cur].ctx, &g_main); }
struct Barrier {
    int n = 0, count = 0, gen = 0;
    void wait() {
        const int g = gen;
        g_progress = true;
        if (++count == n) {
            count = 0, gen++;
            return;
        }
        while (gen == g) yield_fiber();
    }
};
static Barrier g_block;
static Barrier g_warp[32];
static unsigned long long g_slot[32][32];
static inline void __syncthreads() { g_block.wait(); }
template <class T>
static inline T shfl_from(T v, int src) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    g_slot[w][l] = bits;
    g_warp[w].wait();
    T r;
    bits = g_slot[w][src];
    memcpy(&r, &bits, sizeof(T));
    g_warp[w].wait();  // every lane has read before the next exchange writes
    return r;
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int o) {
    return shfl_from(v, (int)(threadIdx.x % 32) ^ o);
}
template <class T> static inline T __shfl_up_sync(unsigned, T v, int o) {
    const int l = threadIdx.x % 32;
    return shfl_from(v, l >= o ? l - o : l);
}
// mma.sync m16n8k32 (int8) of a warp, as the PTX ISA lays its fragments out over lanes 4 g + q:
// A (16 x 32) a0 = A[g][4q ..], a1 = A[g+8][4q ..], a2 = A[g][16+4q ..], a3 = A[g+8][16+4q ..];
// B (32 x 8) b0 = B[4q ..][g], b1 = B[16+4q ..][g]; C c0, c1 = C[g][2q, 2q+1], c2, c3 = C[g+8][2q, 2q+1].
static u32 g_frag[32][32][6];
static void mma_s8_16832(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    const int w = threadIdx.x / 32, l = threadIdx.x % 32, g = l / 4, q = l % 4;
    const u32 mine[6] = {a0, a1, a2, a3, b0, b1};
    memcpy(g_frag[w][l], mine, sizeof(mine));
    g_warp[w].wait();
    auto byte = [](u32 reg, int k) { return (int)(i8)(reg >> (8 * (k % 4))); };
    for (int e = 0; e < 4; e++) {
        const int row = g + 8 * (e >> 1), col = 2 * q + (e & 1);
        int sum = 0;
        for (int k = 0; k < 32; k++) {
            const int a = byte(g_frag[w][4 * (row % 8) + (k % 16) / 4][(row >= 8) + 2 * (k >= 16)], k);
            const int b = byte(g_frag[w][4 * col + (k % 16) / 4][4 + (k >= 16)], k);
            sum += a * b;
        }
        c[e] += sum;
    }
    g_warp[w].wait();  // every lane has read before the next product writes
}
static inline float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
static inline int atomicAdd(int *p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
static inline unsigned atomicOr(unsigned *p, unsigned v) {
    const unsigned old = *p;
    *p = old | v;
    return old;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int dp4a(int a, int b, int c) {
    for (int j = 0; j < 4; j++) c += (int)(i8)(a >> (8 * j)) * (int)(i8)(b >> (8 * j));
    return c;
}
alignas(16) static u8 g_dyn_smem[1 << 20];
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define PDL_ENTER()
"""

HARNESS = r"""
static std::function<void()> g_call;
static void fiber_main() {
    g_call();
    g_fibers[g_cur].done = true;
    g_progress = true;
}

// Runs `call` as every thread of every block of the grid, one block at a time; a block whose
// threads all wait at barriers that cannot complete (a thread returned early) ends the program.
template <class F>
static void launch(dim3 grid, dim3 block, F call) {
    gridDim = grid, blockDim = block;
    const unsigned n = block.x;
    g_call = call;
    g_fibers.resize(n);
    for (auto &f : g_fibers) f.stack.resize(256 * 1024);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = {x, y, z};
                g_block = Barrier{(int)n};
                for (unsigned w = 0; w < (n + 31) / 32; w++) g_warp[w] = Barrier{32};
                for (unsigned t = 0; t < n; t++) {
                    Fiber &f = g_fibers[t];
                    f.done = false;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = &g_main;
                    makecontext(&f.ctx, fiber_main, 0);
                }
                for (unsigned left = n, pass = 0; left > 0; pass++) {
                    g_progress = false;
                    left = 0;
                    for (unsigned i = 0; i < n; i++) {
                        const unsigned t = pass & 1 ? n - 1 - i : i;  // both orders: a missing barrier shows
                        if (g_fibers[t].done) continue;
                        g_cur = (int)t;
                        threadIdx = {t, 0, 0};
                        swapcontext(&g_main, &g_fibers[t].ctx);
                        left += !g_fibers[t].done;
                    }
                    if (left && !g_progress) {
                        fprintf(stderr, "block (%u, %u, %u): threads wait at a barrier others never reach\n", x, y, z);
                        exit(6);
                    }
                }
            }
}

template <class T>
static std::vector<T> read_vec(FILE *f, size_t n) {
    std::vector<T> v(n + 64);  // padding past the end, as the device buffers carry
    if (fread(v.data(), sizeof(T), n, f) != n) exit(3);
    return v;
}

int main(int argc, char **argv) {
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    int h[11];
    long long row_bytes;
    if (fread(h, 4, 11, in) != 11 || fread(&row_bytes, 8, 1, in) != 1) return 2;
    const int n_expert = h[0], m = h[1], k = h[2], x_rows = h[3], x_div = h[4], n_sel = h[5], tile = h[6],
              bound = h[7], group = h[8], has_bias = h[9], team_log2 = h[10];
    const int mv_rows = (EMV_T >> team_log2) * EMV_RW;
    auto w = read_vec<u8>(in, (size_t)n_expert * m * row_bytes);
    auto xq = read_vec<u8>(in, (size_t)x_rows * k + (size_t)x_rows * (k / 32) * 16);
    auto ids = read_vec<int>(in, n_sel);
    auto bias_v = read_vec<float>(in, has_bias ? (size_t)n_expert * m : 0);
    const float *bias = has_bias ? bias_v.data() : nullptr;
    std::vector<float> y((size_t)n_sel * m, NAN);
    const long long expert_bytes = (long long)m * row_bytes;
    if (tile) {
        std::vector<int> order(n_sel + 1, -1), tiles(4 * (size_t)bound + 4, -1), n_tiles(1, -1);
        launch({1, 1, 1}, {EG_T, 1, 1}, [&] {
            expert_group(ids.data(), n_sel, n_expert, order.data(), (int4 *)tiles.data(), n_tiles.data());
        });
        if (n_tiles[0] > bound) return 5;
        launch({(unsigned)((m + ET_R - 1) / ET_R), (unsigned)bound, 1}, {ET_T, 1, 1}, [&] {
#if IS_KQ(QT)
            if (tile == 2) {
                expert_tile_sb(w.data(), row_bytes, expert_bytes, m, k, xq.data(), x_rows, x_div, order.data(),
                               (const int4 *)tiles.data(), n_tiles.data(), y.data(), bias);
                return;
            }
#endif
            expert_tile(w.data(), row_bytes, expert_bytes, m, k, xq.data(), x_rows, x_div, order.data(),
                        (const int4 *)tiles.data(), n_tiles.data(), y.data(), bias);
        });
    } else {  // two matrices in one launch (grid z), the second the same stack: the same outputs twice
        std::vector<float> y_b((size_t)n_sel * m, NAN);
        launch({(unsigned)((m + mv_rows - 1) / mv_rows), (unsigned)std::min(n_expert, n_sel), 2}, {EMV_T, 1, 1}, [&] {
            expert_mv(w.data(), row_bytes, expert_bytes, m, k, xq.data(), x_rows, x_div, ids.data(), n_sel, n_expert,
                      group, y.data(), bias, w.data(), y_b.data(), bias, team_log2);
        });
        for (size_t i = 0; i < y.size(); i++)
            if (!(y[i] == y_b[i]) && !(std::isnan(y[i]) && std::isnan(y_b[i]))) return 7;  // z = 1's blocks differ
    }
    fwrite(y.data(), 4, y.size(), out);
    fclose(out);
    return 0;
}
"""


def host_source() -> str:
    experts = kernel_source("experts.cu").replace("extern __shared__ __align__(16) u8 xs_s[];",
                                                  "u8 *xs_s = g_dyn_smem;")
    return ("#define EMBER_HOST_TEST\n" + kernel_source("common.cuh") + PRELUDE + kernel_source("quant.cuh")
            + low_bit_source() + experts + HARNESS)


def build(workdir: Path, qtype: GGMLType, dp4a: bool = False) -> Path:
    """The program for one type; dp4a: expert_tile's path without tensor cores (HIP, pre-sm_80)."""
    name = f"experts_{int(qtype)}{'_dp4a' if dp4a else ''}"
    src, exe = workdir / f"{name}.cpp", workdir / name
    src.write_text(host_source())
    defines = [f"-DQT={int(qtype)}", *(["-DET_DP4A"] if dp4a else []), f"-DEG_T={EG_THREADS}",
               f"-DET_T={ET_THREADS}", f"-DET_R={ET_ROWS}", f"-DET_TK={ET_TOK}", f"-DEMV_T={EMV_THREADS}"]
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", *defines, str(src), "-o", str(exe)], check=True)
    return exe


def quant_x(x: np.ndarray, group: int = 32) -> bytes:
    """x (rows, k) in quant_x's format: int8 values, then per 32 a float4 (d, d * sum of each half, 0),
    d shared by each group of values (32, or 256 as quant_x_llama rounds x for the K-quants)."""
    groups = x.reshape(x.shape[0], -1, group).astype(np.float32)
    dg = (np.abs(groups).max(-1) / np.float32(127)).astype(np.float32)
    d = np.repeat(dg, group // 32, axis=1)
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)
    halves = q.reshape(q.shape[0], q.shape[1], 2, 16).sum(-1).astype(np.float32)
    meta = np.concatenate([d[..., None], d[..., None] * halves, np.zeros_like(d)[..., None]], -1).astype(np.float32)
    return q.astype(np.int8).tobytes() + meta.tobytes()


def random_stack(rng, qtype: GGMLType, n_expert: int, m: int, k: int) -> np.ndarray:
    from synth import weight

    if qtype == GGMLType.MXFP4:
        return quantize(rng.normal(0, 0.05, (n_expert * m, k)).astype(np.float32), qtype).reshape(n_expert, m, -1)
    return np.asarray(weight(rng, qtype, n_expert * m, k, 0.05)).reshape(n_expert, m, -1)


def check(exe: Path, workdir: Path, qtype: GGMLType, n: int, top_k: int, per_row: bool, tile: bool, rng,
          n_expert: int = 8, m: int = 72, bias: bool = False, sb: bool = False, team_log2: int | None = None) -> float:
    """The relative error of one kernel's product (NaN: an output row left unwritten). 72 rows: a
    tile of 64 and one of 8, expert_mv blocks of 32 or 64 rows (teams by row length) and a last part-way; rows of 32-value blocks take 352
    values (chunks of 8 units and one of 3), the K types 512. sb: expert_tile_sb (the K types), x
    rounded in groups of 256. team_log2: expert_mv's teams (default: the backend's mv_team_log2)."""
    k = 512 if layout(qtype).block_size == 256 else 352
    team_log2 = mv_team_log2(qtype, k) if team_log2 is None else team_log2
    raw = random_stack(rng, qtype, n_expert, m, k)
    ids = np.stack([rng.permutation(n_expert)[:top_k] for _ in range(n)]).astype(np.int32)
    x_div = 1 if per_row else top_k
    x = rng.normal(0, 1, (n * top_k if per_row else n, k)).astype(np.float32)
    n_sel = ids.size
    b = rng.normal(0, 1, (n_expert, m)).astype(np.float32) if bias else np.zeros((0,), np.float32)
    header = struct.pack("<11iq", n_expert, m, k, x.shape[0], x_div, n_sel, 2 if sb else int(tile),
                         tile_bound(n_sel, n_expert), mv_group(k), int(bias), team_log2, device_row_bytes(qtype, k))
    # the stack as the backend uploads it (MXFP4 regrouped: ops.cu mxfp4_regroup)
    dev = regroup_mxfp4(raw.reshape(n_expert * m, -1), k) if qtype == GGMLType.MXFP4 else raw
    inp, outp = workdir / "in.bin", workdir / "out.bin"
    inp.write_bytes(header + dev.tobytes() + quant_x(x, 256 if sb else 32) + ids.tobytes() + b.tobytes())
    subprocess.run([str(exe), str(inp), str(outp)], check=True, timeout=600)
    got = np.fromfile(outp, np.float32).reshape(n_sel, m)
    if not np.isfinite(got).all():
        return float("nan")  # a row left unwritten
    dense = dequantize(raw.reshape(-1), qtype).reshape(n_expert, m, k).astype(np.float64)
    want = np.einsum("sij,sj->si", dense[ids.reshape(-1)], x[np.arange(n_sel) // x_div])
    if bias:
        want += b[ids.reshape(-1)]
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+",
                    default=["Q4_K", "Q6_K", "Q8_0", "MXFP4", "Q5_K", "Q4_0", "Q2_K", "Q3_K", "IQ4_XS"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[3, 40])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for name in args.types:
            qtype = GGMLType[name]
            t0 = time.time()
            exe, exe_dp4a = build(workdir, qtype), build(workdir, qtype, dp4a=True)
            for n in args.tokens:
                kernels = ["expert_mv", "expert_tile", "expert_tile (dp4a)"]
                if qtype in SB_TYPES:
                    kernels += ["expert_tile_sb", "expert_tile_sb (dp4a)"]
                for kernel in kernels:
                    for top_k, per_row in ((8, False), (4, True)):
                        err = check(exe_dp4a if "dp4a" in kernel else exe, workdir, qtype, n, top_k, per_row,
                                    kernel != "expert_mv", rng, bias=per_row,  # biases: half the runs
                                    sb="_sb" in kernel)
                        ok = err < 2e-2
                        failed += not ok
                        print(f"{name:7} {kernel:21} {n:4} tok top-{top_k} "
                              f"{'x per selection, biases' if per_row else 'shared x':23} rel err {err:.2e} "
                              f"{'ok' if ok else 'FAIL'}", flush=True)
            print(f"  ({time.time() - t0:.0f} s)", flush=True)
    print("every run within the int8 products' error" if not failed else f"{failed} runs FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
