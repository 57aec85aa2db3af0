// Decode products for GPUs: NR weight rows a workgroup of MV_WG lanes, the lanes splitting each
// row's blocks into pieces of 8 values (a quarter of a 32-value block, a 32nd of a 256-value
// super-block), so that all lanes work from k = 256 on whatever the type, and each piece's x is
// read once for the NR rows. A piece is decoded from 4-byte words of the blocks (unpack4xU8 /
// unpack4xI8 on 4 bytes at once, no per-value loop) into two vec4s of weights and the x vec4s
// they meet. NX (the activation rows built for: 1, 2, 4 or 8) and the lanes' sum (MV_SUM:
// subgroupAdd, or a tree in workgroup memory) come with the module (_kernels.py).
const MV_WG: u32 = 32u;  // lanes of a workgroup
const NR: u32 = 2u;  // weight rows of a workgroup

// 8 weights: a meets X4[xa] of the activation row, b meets X4[xb]
struct Piece { a: vec4<f32>, b: vec4<f32>, xa: u32, xb: u32 }

fn lo4(q: u32) -> vec4<f32> { return vec4<f32>(unpack4xU8(q & 0x0f0f0f0fu)); }
fn hi4(q: u32) -> vec4<f32> { return vec4<f32>(unpack4xU8((q >> 4u) & 0x0f0f0f0fu)); }
// bits 0..3 of h onto bit 4 of bytes 0..3 (the fifth bits of 4 values)
fn fifth(h: u32) -> u32 {
    return ((h & 1u) | ((h & 2u) << 7u) | ((h & 4u) << 14u) | ((h & 8u) << 21u)) << 4u;
}

// The 32-value block types: piece p is block p / 4, quarter q = p % 4. Q4/Q5: bytes 4q .. 4q + 3
// of the nibbles, values 4q .. 4q + 3 (low) and 16 + 4q .. (high); Q8_0: values 8q .. 8q + 7.
fn pc_q4_0(base: u32, p: u32) -> Piece {
    let blk = base + (p / 4u) * 18u;
    let q = p % 4u;
    let d = f16at(blk);
    let qs = w32(blk + 2u + 4u * q);
    let xa = (p / 4u) * 8u + q;
    return Piece((lo4(qs) - 8.0) * d, (hi4(qs) - 8.0) * d, xa, xa + 4u);
}

fn pc_q4_1(base: u32, p: u32) -> Piece {
    let blk = base + (p / 4u) * 20u;  // 4-byte aligned: whole words
    let q = p % 4u;
    let dm = unpack2x16float(W[blk / 4u]);
    let qs = W[blk / 4u + 1u + q];
    let xa = (p / 4u) * 8u + q;
    return Piece(lo4(qs) * dm.x + dm.y, hi4(qs) * dm.x + dm.y, xa, xa + 4u);
}

fn pc_q5_0(base: u32, p: u32) -> Piece {
    let blk = base + (p / 4u) * 22u;
    let q = p % 4u;
    let d = f16at(blk);
    let qh = w32(blk + 2u);
    let qs = w32(blk + 6u + 4u * q);
    let lo = vec4<f32>(unpack4xU8((qs & 0x0f0f0f0fu) | fifth(qh >> (4u * q))));
    let hi = vec4<f32>(unpack4xU8(((qs >> 4u) & 0x0f0f0f0fu) | fifth(qh >> (16u + 4u * q))));
    let xa = (p / 4u) * 8u + q;
    return Piece((lo - 16.0) * d, (hi - 16.0) * d, xa, xa + 4u);
}

fn pc_q5_1(base: u32, p: u32) -> Piece {
    let blk = base + (p / 4u) * 24u;  // 4-byte aligned
    let q = p % 4u;
    let dm = unpack2x16float(W[blk / 4u]);
    let qh = W[blk / 4u + 1u];
    let qs = W[blk / 4u + 2u + q];
    let lo = vec4<f32>(unpack4xU8((qs & 0x0f0f0f0fu) | fifth(qh >> (4u * q))));
    let hi = vec4<f32>(unpack4xU8(((qs >> 4u) & 0x0f0f0f0fu) | fifth(qh >> (16u + 4u * q))));
    let xa = (p / 4u) * 8u + q;
    return Piece(lo * dm.x + dm.y, hi * dm.x + dm.y, xa, xa + 4u);
}

fn pc_q8_0(base: u32, p: u32) -> Piece {
    let blk = base + (p / 4u) * 34u;
    let q = p % 4u;
    let d = f16at(blk);
    let at = blk + 2u + 8u * q;
    return Piece(vec4<f32>(unpack4xI8(w32(at))) * d, vec4<f32>(unpack4xI8(w32(at + 4u))) * d, 2u * p, 2u * p + 1u);
}

fn pc_f16(base: u32, p: u32) -> Piece {
    let at = base + 16u * p;
    return Piece(vec4<f32>(unpack2x16float(w32(at)), unpack2x16float(w32(at + 4u))),
                 vec4<f32>(unpack2x16float(w32(at + 8u)), unpack2x16float(w32(at + 12u))), 2u * p, 2u * p + 1u);
}

fn bf2(v: u32) -> vec2<f32> { return vec2<f32>(bitcast<f32>(v << 16u), bitcast<f32>(v & 0xffff0000u)); }

fn pc_bf16(base: u32, p: u32) -> Piece {
    let at = base + 16u * p;
    return Piece(vec4<f32>(bf2(w32(at)), bf2(w32(at + 4u))), vec4<f32>(bf2(w32(at + 8u)), bf2(w32(at + 12u))),
                 2u * p, 2u * p + 1u);
}

fn pc_f32(base: u32, p: u32) -> Piece {
    let at = base + 32u * p;
    return Piece(bitcast<vec4<f32>>(vec4<u32>(w32(at), w32(at + 4u), w32(at + 8u), w32(at + 12u))),
                 bitcast<vec4<f32>>(vec4<u32>(w32(at + 16u), w32(at + 20u), w32(at + 24u), w32(at + 28u))),
                 2u * p, 2u * p + 1u);
}

// The K-quants: piece p is super-block p / 32, sub-block s = (p / 4) % 8 of 32 values, values
// 8q .. 8q + 7 of it (q = p % 4): contiguous in x.
fn pc_q4_k(base: u32, p: u32) -> Piece {
    let blk = base + (p / 32u) * 144u;  // 4-byte aligned
    let s = (p / 4u) % 8u;
    let q = p % 4u;
    let sm = scale_min_k4(blk + 4u, s);
    let dm = unpack2x16float(W[blk / 4u]);
    let d = dm.x * sm.x;
    let m = dm.y * sm.y;
    let at = (blk + 16u + 32u * (s / 2u) + 8u * q) / 4u;
    let shift = (s & 1u) * 4u;
    return Piece(lo4(W[at] >> shift) * d - m, lo4(W[at + 1u] >> shift) * d - m, 2u * p, 2u * p + 1u);
}

fn pc_q5_k(base: u32, p: u32) -> Piece {
    let blk = base + (p / 32u) * 176u;  // 4-byte aligned
    let s = (p / 4u) % 8u;
    let q = p % 4u;
    let sm = scale_min_k4(blk + 4u, s);
    let dm = unpack2x16float(W[blk / 4u]);
    let d = dm.x * sm.x;
    let m = dm.y * sm.y;
    let at = (blk + 48u + 32u * (s / 2u) + 8u * q) / 4u;
    let hat = (blk + 16u + 8u * q) / 4u;  // bit s of byte l: the fifth bit of value l
    let shift = (s & 1u) * 4u;
    let a = ((W[at] >> shift) & 0x0f0f0f0fu) | (((W[hat] >> s) & 0x01010101u) << 4u);
    let b = ((W[at + 1u] >> shift) & 0x0f0f0f0fu) | (((W[hat + 1u] >> s) & 0x01010101u) << 4u);
    return Piece(vec4<f32>(unpack4xU8(a)) * d - m, vec4<f32>(unpack4xU8(b)) * d - m, 2u * p, 2u * p + 1u);
}

fn pc_q6_k(base: u32, p: u32) -> Piece {
    let blk = base + (p / 32u) * 210u;  // 2-byte aligned
    let s = (p / 4u) % 8u;
    let q = p % 4u;
    let h = s / 4u;
    let r = s % 4u;
    let l = 8u * q;
    let sc = f32(extractBits(bitcast<i32>(w8(blk + 192u + 8u * h + 2u * r + q / 2u)), 0u, 8u)) * f16at(blk + 208u);
    let ql = blk + 64u * h + 32u * (r & 1u) + l;
    let nib = (r >> 1u) * 4u;
    let qh = blk + 128u + 32u * h + l;
    let a = ((w32(ql) >> nib) & 0x0f0f0f0fu) | (((w32(qh) >> (2u * r)) & 0x03030303u) << 4u);
    let b = ((w32(ql + 4u) >> nib) & 0x0f0f0f0fu) | (((w32(qh + 4u) >> (2u * r)) & 0x03030303u) << 4u);
    return Piece((vec4<f32>(unpack4xU8(a)) - 32.0) * sc, (vec4<f32>(unpack4xU8(b)) - 32.0) * sc, 2u * p, 2u * p + 1u);
}

// Row r of workgroup g: rows NR * g .. of the (virtual) matrix; or, gated (param 13: 1 SiLU,
// 2 GELU-tanh, gate and up of as many rows back to back, NR = 2), row g of the gate and row g of
// the up matrix, the workgroup then writing act(gate) * up over the gate's output (over the up's
// where param 14 is set, the gate's raw sums then in the other).
fn mv_row_at(g: u32, r: u32) -> u32 {
    if (pu(13u) != 0u) { return g + r * pu(7u); }
    return g * NR + r;
}

// x (n <= NX rows) read a piece at a time for all of a workgroup's rows.
@compute @workgroup_size(32)
fn mvp(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) t: u32 MV_SUM_ARGS) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let g = flat_group(wid, nwg);
    var bases: array<u32, NR>;
    for (var r = 0u; r < NR; r++) { bases[r] = row_base(min(mv_row_at(g, r), rows - 1u)); }  // past the end: read, not stored
    var acc: array<f32, NR * NX>;
    for (var p = t; p < k / 8u; p += MV_WG) {
        for (var r = 0u; r < NR; r++) {
            let w = PIECE(bases[r], p);
            for (var j = 0u; j < NX; j++) {
                if (j < n) {
                    let xo = j * (k / 4u);
                    acc[r * NX + j] += dot(w.a, X4[xo + w.xa]) + dot(w.b, X4[xo + w.xb]);
                }
            }
        }
    }
    MV_SUM_CALL
}

// The summed rows into their outputs (lane 0)
fn mv_store(s: array<f32, NR * NX>, g: u32, rows: u32, n: u32) {
    let gated = pu(13u);
    if (gated != 0u) {
        if (g >= pu(7u)) { return; }
        for (var j = 0u; j < NX; j++) {
            if (j < n) {
                let a = s[j];
                var act: f32;
                if (gated == 1u) {
                    act = a / (1.0 + exp(-a));
                } else {
                    act = 0.5 * a * (1.0 + tanh(clamp(0.7978845608028654 * (a + 0.044715 * a * a * a), -15.0, 15.0)));
                }
                let u = s[NX + j];
                if (pu(14u) != 0u) {
                    store(j, g, a);
                    store(j, pu(7u) + g, act * u);
                } else {
                    store(j, g, act * u);
                    store(j, pu(7u) + g, u);
                }
            }
        }
        return;
    }
    for (var r = 0u; r < NR; r++) {
        for (var j = 0u; j < NX; j++) {
            if (g * NR + r < rows && j < n) { store(j, g * NR + r, s[r * NX + j]); }
        }
    }
}
