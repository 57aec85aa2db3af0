// Prompts on int8 activations (mmq): the 64 x 64 tiles of mm (matmul.wgsl) with the weights' runs
// of 32 values staged as their integer quants (4 a word) and x as quant_q8's blocks (ops.wgsl), met
// by packed 4 x 8-bit dot products; each run's scales then applied once per output. A run's weights
// are d_lo * q + m_lo (values 0-15) and d_hi * q + m_hi (16-31), so its share of an output is
// dx * (d_lo * q.qx_lo + d_hi * q.qx_hi) + m_lo * s0 + m_hi * s1, x's block being (dx, s0, s1):
// its scale and its halves' scaled sums. One run reader a type, named IRUN in the module.
@group(0) @binding(8) var<storage, read> QX: array<u32>;  // quant_q8's int8 words, then
@group(0) @binding(9) var<storage, read> QS: array<vec4<f32>>;  // its (d, s0, s1, 0) a block

// Words wa and wb of a row's run (4 quants each, unsigned but for Q8_0) at word places ia and ib
// of the run (0-7: values 4 ia ..), and the run's (d_lo, d_hi, m_lo, m_hi). Reader q of 4 (0-3)
// takes two of the run's 8 words.
struct IRun { wa: u32, wb: u32, ia: u32, ib: u32, sc: vec4<f32> }

// the 32-value block types through their decode pieces (IPiece: piece 4c + q of the row)
fn ir_of(p: IPiece, c: u32) -> IRun {
    let m = p.d * f32(p.off) + p.m;
    return IRun(p.a, p.b, p.xa - 8u * c, p.xb - 8u * c, vec4<f32>(p.d, p.d, m, m));
}
fn ir_q4_0(base: u32, c: u32, q: u32) -> IRun { return ir_of(ip_q4_0(base, 4u * c + q), c); }
fn ir_q4_1(base: u32, c: u32, q: u32) -> IRun { return ir_of(ip_q4_1(base, 4u * c + q), c); }
fn ir_q5_0(base: u32, c: u32, q: u32) -> IRun { return ir_of(ip_q5_0(base, 4u * c + q), c); }
fn ir_q5_1(base: u32, c: u32, q: u32) -> IRun { return ir_of(ip_q5_1(base, 4u * c + q), c); }
fn ir_q8_0(base: u32, c: u32, q: u32) -> IRun { return ir_of(ip_q8_0(base, 4u * c + q), c); }

// Q4_K: run c is sub-block s = c % 8 of super-block c / 8 (deq_q4_k's layout): nibbles of bytes
// 32 (s / 2) .., words q and q + 4
fn ir_q4_k(base: u32, c: u32, q: u32) -> IRun {
    let blk = base + (c / 8u) * 144u;
    let s = c % 8u;
    let dm = k_sub_dm(blk, s);
    let qs = blk + 16u + 32u * (s / 2u) + 4u * q;
    let shift = (s & 1u) * 4u;
    return IRun((w32(qs) >> shift) & 0x0f0f0f0fu, (w32(qs + 16u) >> shift) & 0x0f0f0f0fu, q, q + 4u,
                vec4<f32>(dm.x, dm.x, -dm.y, -dm.y));
}

// Q5_K: Q4_K's nibbles and the fifth bits (bit s of byte l: value l of sub-block s)
fn ir_q5_k(base: u32, c: u32, q: u32) -> IRun {
    let blk = base + (c / 8u) * 176u;
    let s = c % 8u;
    let dm = k_sub_dm(blk, s);
    let qs = blk + 48u + 32u * (s / 2u) + 4u * q;
    let qh = blk + 16u + 4u * q;
    let shift = (s & 1u) * 4u;
    let a = ((w32(qs) >> shift) & 0x0f0f0f0fu) | (((w32(qh) >> s) & 0x01010101u) << 4u);
    let b = ((w32(qs + 16u) >> shift) & 0x0f0f0f0fu) | (((w32(qh + 16u) >> s) & 0x01010101u) << 4u);
    return IRun(a, b, q, q + 4u, vec4<f32>(dm.x, dm.x, -dm.y, -dm.y));
}

// Q6_K: 6-bit quants 0-63 (the -32 folded into m), a scale for each 16 values (deq_q6_k's layout)
fn q6_word(ql: u32, qh: u32, nib: u32, p: u32) -> u32 {
    return ((w32(ql) >> nib) & 0x0f0f0f0fu) | (((w32(qh) >> (2u * p)) & 0x03030303u) << 4u);
}

fn ir_q6_k(base: u32, c: u32, q: u32) -> IRun {
    let blk = base + (c / 8u) * 210u;
    let s = c % 8u;
    let h = s / 4u;
    let p = s % 4u;
    let ql = blk + 64u * h + 32u * (p & 1u) + 4u * q;
    let qh = blk + 128u + 32u * h + 4u * q;
    let nib = (p >> 1u) * 4u;
    let d = f16at(blk + 208u);
    let sc = blk + 192u + 8u * h + 2u * p;
    let s0 = f32(extractBits(bitcast<i32>(w8(sc)), 0u, 8u)) * d;
    let s1 = f32(extractBits(bitcast<i32>(w8(sc + 1u)), 0u, 8u)) * d;
    return IRun(q6_word(ql, qh, nib, p), q6_word(ql + 16u, qh + 16u, nib, p), q, q + 4u,
                vec4<f32>(s0, s1, -32.0 * s0, -32.0 * s1));
}

// The tiles: word i of the run, 4 rows (weights) or activation rows a vec4 at [i * 16 + (row / 4 ^
// mq_sw(i))][row % 4]; the xor puts a warp's 32 staging stores (8 rows by 4 readers, whichever
// two words a reader holds) on 32 distinct banks.
var<workgroup> mq_w: array<vec4<u32>, 128>;
var<workgroup> mq_x: array<vec4<u32>, 128>;
var<workgroup> mq_ws: array<vec4<f32>, 64>;  // each weight row's run scales
var<workgroup> mq_xs: array<vec4<f32>, 64>;  // each activation row's block (dx, s0, s1, 0)

fn mq_sw(i: u32) -> u32 { return ((i ^ (i >> 1u)) & 3u) << 1u; }

// 4 weight rows' words against one activation row's
fn dots(w: vec4<u32>, x: u32) -> vec4<i32> {
    return vec4<i32>(dot4I8Packed(w.x, x), dot4I8Packed(w.y, x), dot4I8Packed(w.z, x), dot4I8Packed(w.w, x));
}

// a run's share of 4 outputs of an activation row (its block e: dx, s0, s1) from their integer sums
fn run_share(e: vec4<f32>, dlo: vec4<f32>, dhi: vec4<f32>, mlo: vec4<f32>, mhi: vec4<f32>,
             lo: vec4<i32>, hi: vec4<i32>) -> vec4<f32> {
    return e.x * (dlo * vec4<f32>(lo) + dhi * vec4<f32>(hi)) + mlo * e.y + mhi * e.z;
}

// params: mm's (matmul.wgsl); x (n rows of k) as quant_q8's blocks in QX / QS
@compute @workgroup_size(256)
fn mmq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let nb = k / 32u;
    let r0 = wid.x * 64u;
    let n0 = wid.y * 64u;
    // staging: reader q of weight row r and of activation row r (rows past the end: the last one's);
    // products: mm's (lanes_of)
    let l = lanes_of(t);
    let base = row_base(min(r0 + l.r, rows - 1u));
    let xrow = min(n0 + l.r, n - 1u) * nb;
    let scales = 2u * n * nb;  // QS's first block scale
    // the sums in named registers (a private array indexed in a loop may live in local memory)
    var acc0 = vec4<f32>();  // activation row 4 tn + b's sums in acc_b: weight rows 4 tm .. 4 tm + 3
    var acc1 = vec4<f32>();
    var acc2 = vec4<f32>();
    var acc3 = vec4<f32>();
    var w = IRUN(base, 0u, l.q);
    var x0 = QX[8u * xrow + l.q];
    var x1 = QX[8u * xrow + l.q + 4u];
    var xs = QS[scales + xrow];
    for (var c = 0u; c < nb; c++) {
        mq_w[w.ia * 16u + ((l.r / 4u) ^ mq_sw(w.ia))][l.r % 4u] = w.wa;
        mq_w[w.ib * 16u + ((l.r / 4u) ^ mq_sw(w.ib))][l.r % 4u] = w.wb;
        mq_x[l.q * 16u + ((l.r / 4u) ^ mq_sw(l.q))][l.r % 4u] = x0;
        mq_x[(l.q + 4u) * 16u + ((l.r / 4u) ^ mq_sw(l.q + 4u))][l.r % 4u] = x1;
        if (l.q == 0u) {
            mq_ws[l.r] = w.sc;
            mq_xs[l.r] = xs;
        }
        workgroupBarrier();
        if (c + 1u < nb) {  // the next run into registers while this one is multiplied
            w = IRUN(base, c + 1u, l.q);
            x0 = QX[8u * (xrow + c + 1u) + l.q];
            x1 = QX[8u * (xrow + c + 1u) + l.q + 4u];
            xs = QS[scales + xrow + c + 1u];
        }
        var lo0 = vec4<i32>();  // each run's integer sums: values 0-15 (lo) and 16-31 (hi)
        var lo1 = vec4<i32>();
        var lo2 = vec4<i32>();
        var lo3 = vec4<i32>();
        var hi0 = vec4<i32>();
        var hi1 = vec4<i32>();
        var hi2 = vec4<i32>();
        var hi3 = vec4<i32>();
        for (var i = 0u; i < 4u; i++) {
            let wv = mq_w[i * 16u + (l.tm ^ mq_sw(i))];
            let xv = mq_x[i * 16u + (l.tn ^ mq_sw(i))];
            lo0 += dots(wv, xv.x);
            lo1 += dots(wv, xv.y);
            lo2 += dots(wv, xv.z);
            lo3 += dots(wv, xv.w);
            let wh = mq_w[(i + 4u) * 16u + (l.tm ^ mq_sw(i + 4u))];
            let xh = mq_x[(i + 4u) * 16u + (l.tn ^ mq_sw(i + 4u))];
            hi0 += dots(wh, xh.x);
            hi1 += dots(wh, xh.y);
            hi2 += dots(wh, xh.z);
            hi3 += dots(wh, xh.w);
        }
        let s0 = mq_ws[4u * l.tm];
        let s1 = mq_ws[4u * l.tm + 1u];
        let s2 = mq_ws[4u * l.tm + 2u];
        let s3 = mq_ws[4u * l.tm + 3u];
        let dlo = vec4<f32>(s0.x, s1.x, s2.x, s3.x);
        let dhi = vec4<f32>(s0.y, s1.y, s2.y, s3.y);
        let mlo = vec4<f32>(s0.z, s1.z, s2.z, s3.z);
        let mhi = vec4<f32>(s0.w, s1.w, s2.w, s3.w);
        acc0 += run_share(mq_xs[4u * l.tn], dlo, dhi, mlo, mhi, lo0, hi0);
        acc1 += run_share(mq_xs[4u * l.tn + 1u], dlo, dhi, mlo, mhi, lo1, hi1);
        acc2 += run_share(mq_xs[4u * l.tn + 2u], dlo, dhi, mlo, mhi, lo2, hi2);
        acc3 += run_share(mq_xs[4u * l.tn + 3u], dlo, dhi, mlo, mhi, lo3, hi3);
        workgroupBarrier();
    }
    store_tile(n0 + l.tn * 4u, r0 + l.tm * 4u, acc0, acc1, acc2, acc3, rows, n);
}
