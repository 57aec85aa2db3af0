// Weights read a piece of 8 values at a time (the GPUs' decode products, matvec.wgsl, and the
// prompt tiles, matmul.wgsl): piece 4c + q of a row is 8 values of its 32-value run c (a quarter
// of a block, of a K-quant sub-block), decoded from 4-byte words of the blocks (unpack4xU8 /
// unpack4xI8 on 4 bytes at once, no per-value loop) into two vec4s of weights and the places in
// the row (vec4 indices) of the values they meet. One reader a type, named PIECE in the module.

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
// Decoded once, as integers (ip_* below, which the int8 decode products read as they are).
fn piece_of(i: IPiece) -> Piece {
    let off = f32(i.off);  // the quants, signed or (Q4, Q5: under 32) not, as signed bytes
    return Piece((vec4<f32>(unpack4xI8(i.a)) + off) * i.d + i.m, (vec4<f32>(unpack4xI8(i.b)) + off) * i.d + i.m,
                 i.xa, i.xb);
}

fn pc_q4_0(base: u32, p: u32) -> Piece { return piece_of(ip_q4_0(base, p)); }
fn pc_q4_1(base: u32, p: u32) -> Piece { return piece_of(ip_q4_1(base, p)); }
fn pc_q5_0(base: u32, p: u32) -> Piece { return piece_of(ip_q5_0(base, p)); }
fn pc_q5_1(base: u32, p: u32) -> Piece { return piece_of(ip_q5_1(base, p)); }
fn pc_q8_0(base: u32, p: u32) -> Piece { return piece_of(ip_q8_0(base, p)); }

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
    let dm = k_sub_dm(blk, s);
    let d = dm.x;
    let m = dm.y;
    let at = (blk + 16u + 32u * (s / 2u) + 8u * q) / 4u;
    let shift = (s & 1u) * 4u;
    return Piece(lo4(W[at] >> shift) * d - m, lo4(W[at + 1u] >> shift) * d - m, 2u * p, 2u * p + 1u);
}

fn pc_q5_k(base: u32, p: u32) -> Piece {
    let blk = base + (p / 32u) * 176u;  // 4-byte aligned
    let s = (p / 4u) % 8u;
    let q = p % 4u;
    let dm = k_sub_dm(blk, s);
    let d = dm.x;
    let m = dm.y;
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

// The 32-value block types' pieces as integers (the float pieces above, and the int8 decode
// products, mvq in matvec_q8.wgsl): a and b hold values 0-3 and 4-7 of the piece as 4 bytes each
// (meeting words xa and xb of the row's int8 x: the Piece's vec4 indices, 4 values a word); a value
// is d * (q + off) + m, so the piece's sum is d * (a . x + off * sum x) + m * sum x.
struct IPiece { a: u32, b: u32, xa: u32, xb: u32, d: f32, m: f32, off: i32 }

fn ip_q4_0(base: u32, p: u32) -> IPiece {
    let blk = base + (p / 4u) * 18u;
    let q = p % 4u;
    let qs = w32(blk + 2u + 4u * q);
    let xa = (p / 4u) * 8u + q;
    return IPiece(qs & 0x0f0f0f0fu, (qs >> 4u) & 0x0f0f0f0fu, xa, xa + 4u, f16at(blk), 0.0, -8);
}

fn ip_q4_1(base: u32, p: u32) -> IPiece {
    let blk = (base + (p / 4u) * 20u) / 4u;  // 4-byte aligned
    let q = p % 4u;
    let dm = unpack2x16float(W[blk]);
    let qs = W[blk + 1u + q];
    let xa = (p / 4u) * 8u + q;
    return IPiece(qs & 0x0f0f0f0fu, (qs >> 4u) & 0x0f0f0f0fu, xa, xa + 4u, dm.x, dm.y, 0);
}

fn ip_q5_0(base: u32, p: u32) -> IPiece {
    let blk = base + (p / 4u) * 22u;
    let q = p % 4u;
    let qh = w32(blk + 2u);
    let qs = w32(blk + 6u + 4u * q);
    let xa = (p / 4u) * 8u + q;
    return IPiece((qs & 0x0f0f0f0fu) | fifth(qh >> (4u * q)), ((qs >> 4u) & 0x0f0f0f0fu) | fifth(qh >> (16u + 4u * q)),
                  xa, xa + 4u, f16at(blk), 0.0, -16);
}

fn ip_q5_1(base: u32, p: u32) -> IPiece {
    let blk = (base + (p / 4u) * 24u) / 4u;  // 4-byte aligned
    let q = p % 4u;
    let dm = unpack2x16float(W[blk]);
    let qh = W[blk + 1u];
    let qs = W[blk + 2u + q];
    let xa = (p / 4u) * 8u + q;
    return IPiece((qs & 0x0f0f0f0fu) | fifth(qh >> (4u * q)), ((qs >> 4u) & 0x0f0f0f0fu) | fifth(qh >> (16u + 4u * q)),
                  xa, xa + 4u, dm.x, dm.y, 0);
}

fn ip_q8_0(base: u32, p: u32) -> IPiece {
    let blk = base + (p / 4u) * 34u;
    let at = blk + 2u + 8u * (p % 4u);
    return IPiece(w32(at), w32(at + 4u), 2u * p, 2u * p + 1u, f16at(blk), 0.0, 0);
}
