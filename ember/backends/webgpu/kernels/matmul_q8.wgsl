// Prompts on int8 activations (mmq): tiles of 128 weight rows by 64 activation rows (mm2's shape,
// matmul.wgsl) with the weights' runs of 32 values staged as their integer quants (4 a word) and x
// as quant_q8's blocks (ops.wgsl), met by packed 4 x 8-bit dot products; each run's scales then
// applied once per output. A run's weights are d_lo * q + m_lo (values 0-15) and d_hi * q + m_hi
// (16-31), so its share of an output is dx * (d_lo * q.qx_lo + d_hi * q.qx_hi) + m_lo * s0 +
// m_hi * s1, x's block being (dx, s0, s1): its scale and its halves' scaled sums. Where the halves
// share the scale and offset (every type but Q6_K: RUN_HALVES, a constant of the module, false) a
// run is one integer sum an output, dx * d * q.qx + m * (s0 + s1). One run reader a type, named
// IRUN in the module.
@group(0) @binding(8) var<storage, read> QX: array<u32>;  // quant_q8's int8 words, then
@group(0) @binding(9) var<storage, read> QS: array<vec4<f32>>;  // its (d, s0, s1, 0) a block
@group(0) @binding(10) var<storage, read_write> SP: array<f32>;  // split k: each split's (n, rows) sums

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

// The tiles: word i of the run, 4 rows (weights) or activation rows a vec4 at [i * 32 + (row / 4 ^
// mq_sw(i))][row % 4] (weight rows 64 .. 127: the second 16 vec4s of each word's row) and
// [i * 16 + ..] (activations); the xor puts a warp's 32 staging stores (8 rows by 4 readers,
// whichever two words a reader holds) on 32 distinct banks.
var<workgroup> mq_w: array<vec4<u32>, 256>;
var<workgroup> mq_x: array<vec4<u32>, 128>;
var<workgroup> mq_ws: array<vec4<f32>, 128>;  // each weight row's run scales
var<workgroup> mq_xs: array<vec4<f32>, 64>;  // each activation row's block (dx, s0, s1, 0)

fn mq_sw(i: u32) -> u32 { return ((i ^ (i >> 1u)) & 3u) << 1u; }

// 4 weight rows' words against one activation row's
fn dots(w: vec4<u32>, x: u32) -> vec4<i32> {
    return vec4<i32>(dot4I8Packed(w.x, x), dot4I8Packed(w.y, x), dot4I8Packed(w.z, x), dot4I8Packed(w.w, x));
}

// A thread's integer sums over words first .. first + count - 1 of the run: its 4 activation rows
// (c_b, d_b: row 4 tn + b) against weight rows 4 tm .. (c) and 64 + 4 tm .. (d)
struct QSums { c0: vec4<i32>, c1: vec4<i32>, c2: vec4<i32>, c3: vec4<i32>,
               d0: vec4<i32>, d1: vec4<i32>, d2: vec4<i32>, d3: vec4<i32> }

fn mq_dots(first: u32, count: u32, tm: u32, tn: u32) -> QSums {
    var s = QSums(vec4<i32>(), vec4<i32>(), vec4<i32>(), vec4<i32>(), vec4<i32>(), vec4<i32>(), vec4<i32>(), vec4<i32>());
    for (var i = first; i < first + count; i++) {
        let wa = mq_w[i * 32u + (tm ^ mq_sw(i))];
        let wb = mq_w[i * 32u + 16u + (tm ^ mq_sw(i))];
        let xv = mq_x[i * 16u + (tn ^ mq_sw(i))];
        s.c0 += dots(wa, xv.x);
        s.c1 += dots(wa, xv.y);
        s.c2 += dots(wa, xv.z);
        s.c3 += dots(wa, xv.w);
        s.d0 += dots(wb, xv.x);
        s.d1 += dots(wb, xv.y);
        s.d2 += dots(wb, xv.z);
        s.d3 += dots(wb, xv.w);
    }
    return s;
}

// component part of weight rows row4 .. row4 + 3's run scales (0: d_lo, 1: d_hi, 2: m_lo, 3: m_hi)
fn mq_scale(row4: u32, part: u32) -> vec4<f32> {
    return vec4<f32>(mq_ws[row4][part], mq_ws[row4 + 1u][part], mq_ws[row4 + 2u][part], mq_ws[row4 + 3u][part]);
}

// Where the tiles are too few to fill the GPU, k is split (wid.z: runs z * rps .. of rps a split)
// and each split's sums go to SP for mmq_sum to add up and store.
// params: mm's (matmul.wgsl), 13 runs a split (0: the whole of k, the sums stored); x (n rows of k)
// as quant_q8's blocks in QX / QS. A thread stages
// reader q of weight rows r and 64 + r and of activation row r (rows past the end: the last one's)
// and keeps 32 sums (mm's places, lanes_of, and the same 64 rows on): each x word read from
// workgroup memory meets 8 weight rows.
@compute @workgroup_size(256)
fn mmq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let nb = k / 32u;
    let r0 = wid.x * 128u;
    let n0 = wid.y * 64u;
    let l = lanes_of(t);
    let base = row_base(min(r0 + l.r, rows - 1u));
    let base2 = row_base(min(r0 + 64u + l.r, rows - 1u));
    let xrow = min(n0 + l.r, n - 1u) * nb;
    let scales = 2u * n * nb;  // QS's first block scale
    // the sums in named registers (a private array indexed in a loop may live in local memory)
    var acc0 = vec4<f32>();  // activation row 4 tn + b: weight rows 4 tm .. (acc_b), 64 + 4 tm .. (bcc_b)
    var acc1 = vec4<f32>();
    var acc2 = vec4<f32>();
    var acc3 = vec4<f32>();
    var bcc0 = vec4<f32>();
    var bcc1 = vec4<f32>();
    var bcc2 = vec4<f32>();
    var bcc3 = vec4<f32>();
    let rps = pu(13u);
    var c0 = 0u;
    var c1 = nb;
    if (rps > 0u) {
        c0 = wid.z * rps;
        c1 = min(nb, c0 + rps);
    }
    var w = IRUN(base, c0, l.q);
    var w2 = IRUN(base2, c0, l.q);
    var x0 = QX[8u * (xrow + c0) + l.q];
    var x1 = QX[8u * (xrow + c0) + l.q + 4u];
    var xs = QS[scales + xrow + c0];
    let halves = select(1u, 2u, RUN_HALVES);
    for (var c = c0; c < c1; c++) {
        let r4 = l.r / 4u;
        mq_w[w.ia * 32u + (r4 ^ mq_sw(w.ia))][l.r % 4u] = w.wa;
        mq_w[w.ib * 32u + (r4 ^ mq_sw(w.ib))][l.r % 4u] = w.wb;
        mq_w[w2.ia * 32u + 16u + (r4 ^ mq_sw(w2.ia))][l.r % 4u] = w2.wa;
        mq_w[w2.ib * 32u + 16u + (r4 ^ mq_sw(w2.ib))][l.r % 4u] = w2.wb;
        mq_x[l.q * 16u + (r4 ^ mq_sw(l.q))][l.r % 4u] = x0;
        mq_x[(l.q + 4u) * 16u + (r4 ^ mq_sw(l.q + 4u))][l.r % 4u] = x1;
        if (l.q == 0u) {
            mq_ws[l.r] = w.sc;
            mq_ws[64u + l.r] = w2.sc;
            mq_xs[l.r] = xs;
        }
        workgroupBarrier();
        if (c + 1u < c1) {  // the next run into registers while this one is multiplied
            w = IRUN(base, c + 1u, l.q);
            w2 = IRUN(base2, c + 1u, l.q);
            x0 = QX[8u * (xrow + c + 1u) + l.q];
            x1 = QX[8u * (xrow + c + 1u) + l.q + 4u];
            xs = QS[scales + xrow + c + 1u];
        }
        let e0 = mq_xs[4u * l.tn];
        let e1 = mq_xs[4u * l.tn + 1u];
        let e2 = mq_xs[4u * l.tn + 2u];
        let e3 = mq_xs[4u * l.tn + 3u];
        for (var h = 0u; h < halves; h++) {  // the whole run, or (Q6_K) its halves' words 0-3, 4-7
            let s = mq_dots(4u * h, 8u / halves, l.tm, l.tn);
            let da = mq_scale(4u * l.tm, h);
            let db = mq_scale(64u + 4u * l.tm, h);
            let ma = mq_scale(4u * l.tm, 2u + h);
            let mb = mq_scale(64u + 4u * l.tm, 2u + h);
            // x's scaled sums: of the half (s0 or s1), or the whole block's (s0 + s1)
            let x0s = select(e0.y + e0.z, e0[1u + h], RUN_HALVES);
            let x1s = select(e1.y + e1.z, e1[1u + h], RUN_HALVES);
            let x2s = select(e2.y + e2.z, e2[1u + h], RUN_HALVES);
            let x3s = select(e3.y + e3.z, e3[1u + h], RUN_HALVES);
            acc0 += e0.x * da * vec4<f32>(s.c0) + ma * x0s;
            acc1 += e1.x * da * vec4<f32>(s.c1) + ma * x1s;
            acc2 += e2.x * da * vec4<f32>(s.c2) + ma * x2s;
            acc3 += e3.x * da * vec4<f32>(s.c3) + ma * x3s;
            bcc0 += e0.x * db * vec4<f32>(s.d0) + mb * x0s;
            bcc1 += e1.x * db * vec4<f32>(s.d1) + mb * x1s;
            bcc2 += e2.x * db * vec4<f32>(s.d2) + mb * x2s;
            bcc3 += e3.x * db * vec4<f32>(s.d3) + mb * x3s;
        }
        workgroupBarrier();
    }
    let jt = n0 + l.tn * 4u;
    if (rps > 0u) {
        let at = wid.z * n;
        sp_tile(at + jt, r0 + l.tm * 4u, acc0, acc1, acc2, acc3, rows, select(0u, n - jt, jt < n));
        sp_tile(at + jt, r0 + 64u + l.tm * 4u, bcc0, bcc1, bcc2, bcc3, rows, select(0u, n - jt, jt < n));
        return;
    }
    store_tile(jt, r0 + l.tm * 4u, acc0, acc1, acc2, acc3, rows, n);
    store_tile(jt, r0 + 64u + l.tm * 4u, bcc0, bcc1, bcc2, bcc3, rows, n);
}

// A split's 4 x 4 sums into SP: rows j .. j + 3 (those of the first `left`) of `rows` values, at r ..
fn sp_tile(j: u32, r: u32, c0: vec4<f32>, c1: vec4<f32>, c2: vec4<f32>, c3: vec4<f32>, rows: u32, left: u32) {
    for (var a = 0u; a < 4u; a++) {
        if (r + a < rows) {
            if (left > 0u) { SP[j * rows + r + a] = c0[a]; }
            if (left > 1u) { SP[(j + 1u) * rows + r + a] = c1[a]; }
            if (left > 2u) { SP[(j + 2u) * rows + r + a] = c2[a]; }
            if (left > 3u) { SP[(j + 3u) * rows + r + a] = c3[a]; }
        }
    }
}

// The splits' sums added up and stored (a thread an output). params: mmq's, 14 splits
@compute @workgroup_size(256)
fn mmq_sum(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let size = rows * pu(2u);
    let i = flat_group(wid, nwg) * 256u + t;
    if (i >= size) { return; }
    var v = 0.0;
    for (var z = 0u; z < pu(14u); z++) { v += SP[z * size + i]; }
    store(i / rows, i % rows, v);
}
