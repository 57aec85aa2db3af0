// GGUF blocks read in place from W (the bytes of whole rows, 4-byte words): one function per
// type decodes the c-th run of 32 values of the row starting at byte `base` into o.
@group(0) @binding(1) var<storage, read> W: array<u32>;

// 4 bytes at any byte address (the buffer is padded past its end)
fn w32(b: u32) -> u32 {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    if (s == 0u) { return W[i]; }
    return (W[i] >> s) | (W[i + 1u] << (32u - s));
}
fn w8(b: u32) -> u32 { return (W[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu; }
fn f16at(b: u32) -> f32 { return unpack2x16float(w32(b) & 0xffffu).x; }
fn byte_of(q: u32, j: u32) -> u32 { return (q >> (8u * j)) & 0xffu; }

// Q4_0: d (f16), 16 bytes of nibbles: value j low nibble, value j + 16 high nibble, minus 8
fn deq_q4_0(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + c * 18u;
    let d = f16at(blk);
    for (var j = 0u; j < 4u; j++) {
        let q = w32(blk + 2u + 4u * j);
        for (var b = 0u; b < 4u; b++) {
            let x = byte_of(q, b);
            (*o)[4u * j + b] = (f32(x & 15u) - 8.0) * d;
            (*o)[4u * j + b + 16u] = (f32(x >> 4u) - 8.0) * d;
        }
    }
}

// Q4_1: d, m (f16), nibbles as Q4_0: d * q + m
fn deq_q4_1(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + c * 20u;
    let d = f16at(blk);
    let m = f16at(blk + 2u);
    for (var j = 0u; j < 4u; j++) {
        let q = w32(blk + 4u + 4u * j);
        for (var b = 0u; b < 4u; b++) {
            let x = byte_of(q, b);
            (*o)[4u * j + b] = f32(x & 15u) * d + m;
            (*o)[4u * j + b + 16u] = f32(x >> 4u) * d + m;
        }
    }
}

// Q5_0: d, 32 high bits (bit j: value j), nibbles as Q4_0; minus 16
fn deq_q5_0(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + c * 22u;
    let d = f16at(blk);
    let qh = w32(blk + 2u);
    for (var j = 0u; j < 4u; j++) {
        let q = w32(blk + 6u + 4u * j);
        for (var b = 0u; b < 4u; b++) {
            let i = 4u * j + b;
            let x = byte_of(q, b);
            let lo = (x & 15u) | (((qh >> i) & 1u) << 4u);
            let hi = (x >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u);
            (*o)[i] = (f32(lo) - 16.0) * d;
            (*o)[i + 16u] = (f32(hi) - 16.0) * d;
        }
    }
}

// Q5_1: d, m, high bits, nibbles: d * q + m
fn deq_q5_1(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + c * 24u;
    let d = f16at(blk);
    let m = f16at(blk + 2u);
    let qh = w32(blk + 4u);
    for (var j = 0u; j < 4u; j++) {
        let q = w32(blk + 8u + 4u * j);
        for (var b = 0u; b < 4u; b++) {
            let i = 4u * j + b;
            let x = byte_of(q, b);
            let lo = (x & 15u) | (((qh >> i) & 1u) << 4u);
            let hi = (x >> 4u) | (((qh >> (i + 16u)) & 1u) << 4u);
            (*o)[i] = f32(lo) * d + m;
            (*o)[i + 16u] = f32(hi) * d + m;
        }
    }
}

// Q8_0: d, 32 int8
fn deq_q8_0(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + c * 34u;
    let d = f16at(blk);
    for (var j = 0u; j < 8u; j++) {
        let q = w32(blk + 2u + 4u * j);  // each byte sign-extended by an arithmetic shift
        (*o)[4u * j] = f32(bitcast<i32>(q << 24u) >> 24u) * d;
        (*o)[4u * j + 1u] = f32(bitcast<i32>(q << 16u) >> 24u) * d;
        (*o)[4u * j + 2u] = f32(bitcast<i32>(q << 8u) >> 24u) * d;
        (*o)[4u * j + 3u] = f32(bitcast<i32>(q) >> 24u) * d;
    }
}

fn deq_f16(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    for (var j = 0u; j < 16u; j++) {
        let v = unpack2x16float(w32(base + c * 64u + 4u * j));
        (*o)[2u * j] = v.x;
        (*o)[2u * j + 1u] = v.y;
    }
}

fn deq_bf16(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    for (var j = 0u; j < 16u; j++) {
        let v = w32(base + c * 64u + 4u * j);
        (*o)[2u * j] = bitcast<f32>(v << 16u);
        (*o)[2u * j + 1u] = bitcast<f32>(v & 0xffff0000u);
    }
}

fn deq_f32(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    for (var j = 0u; j < 32u; j++) { (*o)[j] = bitcast<f32>(w32(base + c * 128u + 4u * j)); }
}

// K-quant 6-bit scale and min of sub-block j from the 12 bytes at s (ggml's get_scale_min_k4)
fn scale_min_k4(s: u32, j: u32) -> vec2<f32> {
    if (j < 4u) { return vec2<f32>(f32(w8(s + j) & 63u), f32(w8(s + j + 4u) & 63u)); }
    let sc = (w8(s + j + 4u) & 15u) | ((w8(s + j - 4u) >> 6u) << 4u);
    let m = (w8(s + j + 4u) >> 4u) | ((w8(s + j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Q4_K / Q5_K super-block at blk: sub-block s's scale d * sc and offset dmin * m
fn k_sub_dm(blk: u32, s: u32) -> vec2<f32> {
    let sm = scale_min_k4(blk + 4u, s);
    return unpack2x16float(w32(blk)) * sm;  // d and dmin: the block's first word
}

// Q4_K: 256-value super-blocks of d, dmin, 12 scale bytes, 128 bytes of nibbles; sub-block s of
// 32 is the low (s even) or high nibbles of bytes 32 * (s / 2) ..
fn deq_q4_k(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + (c / 8u) * 144u;
    let s = c % 8u;
    let dm = k_sub_dm(blk, s);
    let d = dm.x;
    let m = dm.y;
    let qs = blk + 16u + 32u * (s / 2u);
    let shift = (s & 1u) * 4u;
    for (var j = 0u; j < 8u; j++) {
        let q = w32(qs + 4u * j) >> shift;
        for (var b = 0u; b < 4u; b++) { (*o)[4u * j + b] = d * f32(byte_of(q, b) & 15u) - m; }
    }
}

// Q5_K: as Q4_K with 32 bytes of fifth bits (bit s of byte l: value l of sub-block s)
fn deq_q5_k(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + (c / 8u) * 176u;
    let s = c % 8u;
    let dm = k_sub_dm(blk, s);
    let d = dm.x;
    let m = dm.y;
    let qs = blk + 48u + 32u * (s / 2u);
    let shift = (s & 1u) * 4u;
    for (var j = 0u; j < 8u; j++) {
        let q = w32(qs + 4u * j) >> shift;
        let h = w32(blk + 16u + 4u * j) >> s;
        for (var b = 0u; b < 4u; b++) {
            let v = (byte_of(q, b) & 15u) | ((byte_of(h, b) & 1u) << 4u);
            (*o)[4u * j + b] = d * f32(v) - m;
        }
    }
}

// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d; minus 32
fn deq_q6_k(base: u32, c: u32, o: ptr<function, array<f32, 32>>) {
    let blk = base + (c / 8u) * 210u;
    let s = c % 8u;
    let h = s / 4u;
    let p = s % 4u;
    let d = f16at(blk + 208u);
    let ql = blk + 64u * h + 32u * (p & 1u);
    let nib = (p >> 1u) * 4u;
    let qh = blk + 128u + 32u * h;
    for (var half = 0u; half < 2u; half++) {
        let sc = f32(extractBits(bitcast<i32>(w8(blk + 192u + 8u * h + 2u * p + half)), 0u, 8u)) * d;
        for (var j = 0u; j < 4u; j++) {
            let l = 16u * half + 4u * j;
            let lo = w32(ql + l) >> nib;
            let hi = w32(qh + l) >> (2u * p);
            for (var b = 0u; b < 4u; b++) {
                let v = (byte_of(lo, b) & 15u) | ((byte_of(hi, b) & 3u) << 4u);
                (*o)[l + b] = sc * (f32(v) - 32.0);
            }
        }
    }
}
