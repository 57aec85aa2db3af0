// Products with one weight type's GGUF blocks (DEQ is that type's decoder, dequant.wgsl), and
// rows of it looked up (embeddings). W holds the blocks of up to three matrices of the type (rows
// of k values each, at byte bases in W); a product runs over their rows back to back (rows r1 ..
// are the second matrix's, r2 .. the third's) into outputs of their own: X (n, k) f32,
// Y[j, y_col0 + r] = X[j] . W[r] (row stride y_stride), Y2 and Y3 the others' (strides ys2, ys3).
// params: 0 rows (all), 1 k, 2 n, 3 row bytes, 4 y_stride, 5 y_col0, 6 base, 7 r1, 8 r2,
// 9 base2, 10 base3, 11 ys2, 12 ys3
@group(0) @binding(2) var<storage, read> X4: array<vec4<f32>>;  // X, 4 values an element (k: 32s)
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read> IDS: array<i32>;
@group(0) @binding(5) var<storage, read_write> Y2: array<f32>;
@group(0) @binding(6) var<storage, read_write> Y3: array<f32>;

// the byte where (virtual) row r's blocks start
fn row_base(r: u32) -> u32 {
    if (r < pu(7u)) { return pu(6u) + r * pu(3u); }
    if (r < pu(8u)) { return pu(9u) + (r - pu(7u)) * pu(3u); }
    return pu(10u) + (r - pu(8u)) * pu(3u);
}

// Y[j, r] of (virtual) row r, into its matrix's output
fn store(j: u32, r: u32, v: f32) {
    if (r < pu(7u)) {
        Y[j * pu(4u) + pu(5u) + r] = v;
    } else if (r < pu(8u)) {
        Y2[j * pu(11u) + r - pu(7u)] = v;
    } else {
        Y3[j * pu(12u) + r - pu(8u)] = v;
    }
}

// Prompts: a 64 x 64 tile of Y a workgroup of 256 threads (64 weight rows by 64 activation rows),
// k taken 32 values (a block, a K-quant sub-block) at a time. Each run of 32 is decoded once into
// workgroup memory (a thread one 8-value piece) beside the activations' (a thread a vec4 of two
// activation rows, 8 threads reading a row's 128 bytes), both stored k-major, so that a thread
// reads the 4 weight rows and the 4 activation rows of its 4 x 4 outputs as one vec4 each. The
// next run is read from global memory into registers while the current one is multiplied.
// 16 KiB of workgroup memory (WebGPU's default limit).
var<workgroup> ws: array<vec4<f32>, 512>;  // [i * 16 + (r / 4 ^ mm_sw(i))][r % 4]: value i of tile row r
var<workgroup> xs: array<vec4<f32>, 512>;  // [i * 16 + (j / 4 ^ mm_sx(i))][j % 4]: value i of activation row j

// Each k's 16 vec4s permuted (an xor with a function of k alone) so that the 32 scalar stores of
// a warp's staging meet 32 distinct banks: of the weights, 8 rows by 4 pieces for every piece
// layout (values 4q.. and 16 + 4q.. of the 32-value block types, 8q.. of the others); of the
// activations, 4 rows by 8 vec4s. Both are constant over 4 consecutive k.
fn mm_sw(i: u32) -> u32 { return (((i >> 2u) ^ (i >> 4u)) & 3u) << 1u; }
fn mm_sx(i: u32) -> u32 { return (i >> 2u) & 7u; }

// What a thread reads of one run c: its weight row's piece and a vec4 of each of its activation rows.
struct Staged { w: Piece, x0: vec4<f32>, x1: vec4<f32> }

fn mm_read(base: u32, q: u32, x0: u32, x1: u32, c: u32) -> Staged {
    return Staged(PIECE(base, 4u * c + q), X4[x0 + 8u * c], X4[x1 + 8u * c]);
}

// The places in a weight tile of a piece's two vec4s of run c (weight row r; stride: vec4s a k,
// 16 for mm's 64 rows): the piece's values' places in the run are multiples of 4, one swizzle each 4
fn mm_w_places(w: Piece, r: u32, c: u32, stride: u32) -> vec2<u32> {
    let ia = 4u * (w.xa - 8u * c);
    let ib = 4u * (w.xb - 8u * c);
    return vec2<u32>(ia * stride + ((r / 4u) ^ mm_sw(ia)), ib * stride + ((r / 4u) ^ mm_sw(ib)));
}

// s's activations into xs: rows j and j + 32 (values 4v .. 4v + 3 of the run)
fn mm_stage_x(s: Staged, j: u32, v: u32) {
    let xo = 4u * v * 16u + ((j / 4u) ^ mm_sx(4u * v));
    for (var i = 0u; i < 4u; i++) {
        xs[xo + 16u * i][j % 4u] = s.x0[i];
        xs[(xo ^ 8u) + 16u * i][j % 4u] = s.x1[i];  // row j + 32: (j + 32) / 4 = j / 4 + 8, swizzled alike
    }
}

// s into the tiles: weight row r; activation rows j and j + 32
fn mm_stage(s: Staged, r: u32, j: u32, v: u32, c: u32) {
    let at = mm_w_places(s.w, r, c, 16u);
    for (var i = 0u; i < 4u; i++) {
        ws[at.x + 16u * i][r % 4u] = s.w.a[i];
        ws[at.y + 16u * i][r % 4u] = s.w.b[i];
    }
    mm_stage_x(s, j, v);
}

// activation rows j and j + 32 of a tile at n0 (the last row where they are past n): their vec4 v's
// places in X4 (4 values an element, k a row)
fn mm_x_rows(n0: u32, j: u32, v: u32, n: u32, k: u32) -> vec2<u32> {
    return vec2<u32>(min(n0 + j, n - 1u) * (k / 4u) + v, min(n0 + j + 32u, n - 1u) * (k / 4u) + v);
}

// Y[j, r .. r + 3] of a thread's (virtual) rows r .. (those that exist)
fn store4(j: u32, r: u32, v: vec4<f32>, rows: u32) {
    for (var a = 0u; a < 4u; a++) {
        if (r + a < rows) { store(j, r + a, v[a]); }
    }
}

// Y of a thread's 4 activation rows jt .. (those under n) at its weight rows rt .. (c_b: row jt + b's)
fn store_tile(jt: u32, rt: u32, c0: vec4<f32>, c1: vec4<f32>, c2: vec4<f32>, c3: vec4<f32>, rows: u32, n: u32) {
    if (jt < n) { store4(jt, rt, c0, rows); }
    if (jt + 1u < n) { store4(jt + 1u, rt, c1, rows); }
    if (jt + 2u < n) { store4(jt + 2u, rt, c2, rows); }
    if (jt + 3u < n) { store4(jt + 3u, rt, c3, rows); }
}

// A thread's places in a tile of 256 threads. Staging: piece q of weight row r, vec4 v of activation
// rows j and j + 32. Products: weight rows 4 tm .., activation rows 4 tn ..; a 32-lane warp takes 8
// tm by 4 tn (its loads of each k: 8 vec4s of weights, 4 of activations).
struct Lanes { r: u32, q: u32, j: u32, v: u32, tm: u32, tn: u32 }

fn lanes_of(t: u32) -> Lanes {
    return Lanes(t / 4u, t % 4u, t / 8u, t % 8u, t % 8u + 8u * ((t / 32u) % 2u), (t % 32u) / 8u + 4u * (t / 64u));
}

@compute @workgroup_size(256)
fn mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let r0 = wid.x * 64u;
    let n0 = wid.y * 64u;
    // rows past the matrix or the activations read the last one's (their outputs are never stored)
    let l = lanes_of(t);
    let base = row_base(min(r0 + l.r, rows - 1u));
    let xr = mm_x_rows(n0, l.j, l.v, n, k);
    var c0 = vec4<f32>();  // c_b: the sums of activation row 4 tn + b
    var c1 = vec4<f32>();
    var c2 = vec4<f32>();
    var c3 = vec4<f32>();
    let runs = k / 32u;
    var next = mm_read(base, l.q, xr.x, xr.y, 0u);
    for (var c = 0u; c < runs; c++) {
        mm_stage(next, l.r, l.j, l.v, c);
        workgroupBarrier();
        if (c + 1u < runs) { next = mm_read(base, l.q, xr.x, xr.y, c + 1u); }
        for (var g = 0u; g < 8u; g++) {  // k 4g .. 4g + 3: one swizzle
            let wc = l.tm ^ mm_sw(4u * g);
            let xc = l.tn ^ mm_sx(4u * g);
            for (var u = 0u; u < 4u; u++) {
                let i = (4u * g + u) * 16u;
                let w = ws[i + wc];
                let x = xs[i + xc];
                c0 += w * x.x;
                c1 += w * x.y;
                c2 += w * x.z;
                c3 += w * x.w;
            }
        }
        workgroupBarrier();
    }
    store_tile(n0 + l.tn * 4u, r0 + l.tm * 4u, c0, c1, c2, c3, rows, n);
}

// The same with 128 weight rows a tile (where the adapter allows 24 KiB of workgroup memory): a
// thread stages piece q of weight rows r and r + 64 and multiplies both halves' rows 4 tm .. by its
// 4 activation rows, 32 sums from 3 vec4 reads of each k (mm: 16 from 2). The halves' values of a
// k sit 16 vec4s apart (the swizzle moves within each half: its values are under 16).
var<workgroup> ws2: array<vec4<f32>, 1024>;  // [i * 32 + h * 16 + (r / 4 ^ mm_sw(i))][r % 4]: row 64 h + r

fn mm2_stage_w(w: Piece, r: u32, c: u32, h: u32) {
    let at = mm_w_places(w, r, c, 32u) + vec2<u32>(16u * h);
    for (var i = 0u; i < 4u; i++) {
        ws2[at.x + 32u * i][r % 4u] = w.a[i];
        ws2[at.y + 32u * i][r % 4u] = w.b[i];
    }
}

@compute @workgroup_size(256)
fn mm2(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let r0 = wid.x * 128u;
    let n0 = wid.y * 64u;
    let l = lanes_of(t);
    let base = row_base(min(r0 + l.r, rows - 1u));
    let base2 = row_base(min(r0 + 64u + l.r, rows - 1u));
    let xr = mm_x_rows(n0, l.j, l.v, n, k);
    var c0 = vec4<f32>();
    var c1 = vec4<f32>();
    var c2 = vec4<f32>();
    var c3 = vec4<f32>();
    var d0 = vec4<f32>();
    var d1 = vec4<f32>();
    var d2 = vec4<f32>();
    var d3 = vec4<f32>();
    let runs = k / 32u;
    var next = mm_read(base, l.q, xr.x, xr.y, 0u);
    var next2 = PIECE(base2, l.q);
    for (var c = 0u; c < runs; c++) {
        mm2_stage_w(next.w, l.r, c, 0u);
        mm2_stage_w(next2, l.r, c, 1u);
        mm_stage_x(next, l.j, l.v);
        workgroupBarrier();
        if (c + 1u < runs) {
            next = mm_read(base, l.q, xr.x, xr.y, c + 1u);
            next2 = PIECE(base2, 4u * (c + 1u) + l.q);
        }
        for (var g = 0u; g < 8u; g++) {
            let wc = l.tm ^ mm_sw(4u * g);
            let xc = l.tn ^ mm_sx(4u * g);
            for (var u = 0u; u < 4u; u++) {
                let i = 4u * g + u;
                let w = ws2[i * 32u + wc];
                let w2 = ws2[i * 32u + 16u + wc];
                let x = xs[i * 16u + xc];
                c0 += w * x.x;
                c1 += w * x.y;
                c2 += w * x.z;
                c3 += w * x.w;
                d0 += w2 * x.x;
                d1 += w2 * x.y;
                d2 += w2 * x.z;
                d3 += w2 * x.w;
            }
        }
        workgroupBarrier();
    }
    store_tile(n0 + l.tn * 4u, r0 + l.tm * 4u, c0, c1, c2, c3, rows, n);
    store_tile(n0 + l.tn * 4u, r0 + 64u + l.tm * 4u, d0, d1, d2, d3, rows, n);
}

// Y (n, k) = rows IDS[ids_off + j] of the matrix, for those in this part (rows row0 ..).
// params: 0 rows, 1 k, 2 n, 3 row bytes, 4 row0, 5 ids_off, 6 base; a thread a 32-value slice
@compute @workgroup_size(64)
fn get_rows(@builtin(global_invocation_id) g: vec3<u32>) {
    let k = pu(1u);
    let c = g.x;
    let j = g.y;
    if (c >= k / 32u || j >= pu(2u)) { return; }
    let id = IDS[pu(5u) + j] - pi(4u);
    if (id < 0 || u32(id) >= pu(0u)) { return; }
    var o: array<f32, 32>;
    DEQ(pu(6u) + u32(id) * pu(3u), c, &o);
    for (var i = 0u; i < 32u; i++) { Y[j * k + c * 32u + i] = o[i]; }
}

// A thread a weight row and up to 8 activation rows (y: which 8), no shared memory.
@compute @workgroup_size(64)
fn mv_row(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let row = wid.x * 64u + t;
    let j0 = wid.y * 8u;
    if (row >= rows) { return; }
    var acc: array<f32, 8>;
    var o: array<f32, 32>;
    let base = row_base(row);
    for (var c = 0u; c < k / 32u; c++) {
        DEQ(base, c, &o);
        for (var j = 0u; j < 8u; j++) {
            if (j0 + j < n) {
                let xb = ((j0 + j) * k + c * 32u) / 4u;
                var s = 0.0;
                for (var i = 0u; i < 8u; i++) {
                    s += dot(vec4<f32>(o[4u * i], o[4u * i + 1u], o[4u * i + 2u], o[4u * i + 3u]), X4[xb + i]);
                }
                acc[j] += s;
            }
        }
    }
    for (var j = 0u; j < 8u; j++) {
        if (j0 + j < n) { store(j0 + j, row, acc[j]); }
    }
}
