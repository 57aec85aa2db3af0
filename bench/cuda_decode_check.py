"""Checks the CUDA backend's GGUF block decoders without a GPU.

The decoders in ember/backends/cuda/kernels/quant.cuh build as host C++ (EMBER_HOST_TEST); this
script compiles them with nvcc into a small program, feeds it random blocks of every supported
type, and compares
  - every decoded value with ember.quant.dequantize (the numpy reference), and
  - a row-times-vector product done the way the decode kernels do it (x quantized to int8 per
    32 values, slices of two 16-value halves, integer dot products, per-half scales and offsets)
    with float64 numpy.

    python bench/cuda_decode_check.py            # nvcc, else g++ (the decoders are plain C++ there)
"""
from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from synth import weight

from ember.backends.cuda._kernels import low_bit_source
from ember.backends.cuda.ops.experts import device_row_bytes, regroup_mxfp4
from ember.quant import QUANTIZABLE, GGMLType, dequantize, layout, quantize

KERNELS = ROOT / "ember" / "backends" / "cuda" / "kernels"
TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1,
         GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K,
         GGMLType.IQ4_NL, GGMLType.IQ4_XS, GGMLType.IQ2_XXS, GGMLType.IQ2_XS, GGMLType.IQ2_S, GGMLType.IQ3_XXS,
         GGMLType.IQ3_S, GGMLType.IQ1_S, GGMLType.IQ1_M, GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.MXFP4]

HARNESS = r"""
#define EMBER_HOST_TEST
#include "common.cuh"
#include "quant.cuh"
#include "quant_iq.cuh"
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>

static int dp4a_host(int a, int b, int c) {
    for (int j = 0; j < 4; j++) c += (int)(i8)(a >> (8 * j)) * (int)(i8)(b >> (8 * j));
    return c;
}

// x quantized as the decode products read it (q8_store_warp): int8 per value, and per 32-value
// block (d, d * sum of the first 16 q, d * sum of the last 16 q).
static void quantize_x(const float *x, int k, std::vector<int> &xq, std::vector<float> &meta) {
    xq.assign(k / 4, 0);
    meta.assign(3 * (k / 32), 0.f);
    for (int b = 0; b < k / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int sum[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            const int q = (int)lrintf(v[i] * id);
            sum[i / 16] += q;
            xq[8 * b + i / 4] |= (int)(((u32)q & 0xFFu) << (8 * (i % 4)));
        }
        meta[3 * b] = d, meta[3 * b + 1] = d * (float)sum[0], meta[3 * b + 2] = d * (float)sum[1];
    }
}

// The decode kernels' product of one row with x: slice by slice, as a lane of mv_body does.
template <int TT>
static float row_dot(const u8 *row, int k, const float *x) {
    float acc = 0.f;
    if constexpr (TT == T_F32 || TT == T_F16 || TT == T_BF16) {
        for (int u = 0; u < k / 32; u++) {
            float w[32];
            unit_f<TT>(row, u, w);
            for (int i = 0; i < 32; i++) acc += w[i] * x[32 * u + i];
        }
    } else {
        std::vector<int> xq;
        std::vector<float> meta;
        quantize_x(x, k, xq, meta);
        for (int s = 0; s < k / 32; s++) {
            QSlice o;
            slice_q<TT>(row, s, o);
            if constexpr (TT == T_Q4_K || TT == T_Q5_K) {  // the paired decoder gives the same slices
                QSlice p0, p1;
                slice2_q<TT>(row, s / 2, p0, p1);
                const QSlice &pw = s % 2 ? p1 : p0;
                for (int i = 0; i < 8; i++)
                    if (pw.q[i] != o.q[i]) return NAN;
                for (int h = 0; h < 2; h++)
                    if (pw.a[h] != o.a[h] || pw.b[h] != o.b[h]) return NAN;
            }
            int xo[2];
            slice_offsets<TT>(s, xo);
            for (int h = 0; h < 2; h++) {
                int dot = 0;
                for (int i = 0; i < 4; i++) dot = dp4a_host(o.q[4 * h + i], xq[xo[h] / 4 + i], dot);
                const float *m = &meta[3 * (xo[h] / 32)];
                acc += m[0] * o.a[h] * (float)dot + o.b[h] * ((xo[h] & 16) ? m[2] : m[1]);
            }
        }
    }
    return acc;
}

template <int TT>
static void run(FILE *in, FILE *out, int rows, int cols, long long row_bytes) {
    std::vector<u8> w((size_t)rows * row_bytes + 64, 0);
    std::vector<float> x(cols), v(32);
    if (fread(w.data(), 1, (size_t)rows * row_bytes, in) != (size_t)rows * row_bytes) exit(3);
    if (fread(x.data(), 4, cols, in) != (size_t)cols) exit(3);
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < cols / 32; u++) {
            unit_f<TT>(w.data() + (size_t)r * row_bytes, u, v.data());
            fwrite(v.data(), 4, 32, out);
        }
    for (int r = 0; r < rows; r++) {
        const float d = row_dot<TT>(w.data() + (size_t)r * row_bytes, cols, x.data());
        fwrite(&d, 4, 1, out);
    }
}

int main(int argc, char **argv) {
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    int hdr[3];
    long long row_bytes;
    if (fread(hdr, 4, 3, in) != 3 || fread(&row_bytes, 8, 1, in) != 1) return 2;
    const int qt = hdr[0], rows = hdr[1], cols = hdr[2];
    switch (qt) {
#define CASE(t) case t: run<t>(in, out, rows, cols, row_bytes); break;
        CASE(0) CASE(1) CASE(2) CASE(3) CASE(6) CASE(7) CASE(8) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14)
        CASE(20) CASE(23) CASE(30) CASE(16) CASE(17) CASE(18) CASE(19) CASE(21) CASE(22) CASE(29) CASE(34) CASE(35) CASE(39)
        default: return 4;
    }
    fclose(out);
    return 0;
}
"""


def build(workdir: Path) -> Path:
    exe = workdir / "decode_check"
    # quant_iq.cuh with its grid tables in place, found beside the harness before the -I copy
    (workdir / "quant_iq.cuh").write_text(low_bit_source())
    if shutil.which("nvcc"):
        src = workdir / "decode_check.cu"
        src.write_text(HARNESS)
        cmd = ["nvcc", "-std=c++17", "-O1", "-I", str(KERNELS), str(src), "-o", str(exe)]
    else:
        src = workdir / "decode_check.cpp"
        src.write_text(HARNESS)
        cmd = ["g++", "-std=c++17", "-O1", "-I", str(KERNELS), str(src), "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def check(exe: Path, workdir: Path, qtype: GGMLType, rows: int, cols: int, rng) -> tuple[float, float]:
    if qtype in QUANTIZABLE:  # MXFP4 has no scale field to set in random bytes: quantized values
        blocks = quantize(rng.normal(0.0, 0.05, (rows, cols)).astype(np.float32), qtype)
    else:
        blocks = weight(rng, qtype, rows, cols, 0.05)
    raw = blocks.view(np.uint8).reshape(rows, -1)
    assert raw.shape[1] == layout(qtype).row_bytes(cols)
    # the rows as the backend holds them on the device (MXFP4 regrouped: ops.cu mxfp4_regroup)
    dev = regroup_mxfp4(raw, cols) if qtype == GGMLType.MXFP4 else raw
    row_bytes = device_row_bytes(qtype, cols)
    x = rng.normal(0, 1, cols).astype(np.float32)
    inp, outp = workdir / "in.bin", workdir / "out.bin"
    inp.write_bytes(struct.pack("<iiiq", int(qtype), rows, cols, row_bytes) + dev.tobytes() + x.tobytes())
    subprocess.run([str(exe), str(inp), str(outp)], check=True)
    got = np.fromfile(outp, np.float32)
    values, dots = got[:rows * cols].reshape(rows, cols), got[rows * cols:]
    want = dequantize(raw, qtype).reshape(rows, cols)
    value_err = float(np.abs(values - want).max() / max(np.abs(want).max(), 1e-30))
    ref = want.astype(np.float64) @ x.astype(np.float64)
    dot_err = float(np.linalg.norm(dots - ref) / np.linalg.norm(ref))
    return value_err, dot_err


def main() -> int:
    rng = np.random.default_rng(0)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        exe = build(workdir)
        print(f"{'type':8} {'decode err':>11} {'int8 dot err':>13}")
        for qtype in TYPES:
            value_err, dot_err = check(exe, workdir, qtype, rows=7, cols=512, rng=rng)
            ok = value_err < 1e-6 and dot_err < (1e-5 if qtype in TYPES[:3] else 2e-2)
            failed += not ok
            print(f"{qtype.name:8} {value_err:11.2e} {dot_err:13.2e} {'ok' if ok else 'FAIL'}")
    print("all decoders match the numpy references" if not failed else f"{failed} types FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
