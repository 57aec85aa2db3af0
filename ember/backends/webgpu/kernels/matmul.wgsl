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

// Prompts: a 32 x 32 tile of Y a workgroup; each 32-value slice of k decoded once into shared
// memory for 32 activation rows (every thread 2 of its 128 pieces and 4 of its 256 x vec4s),
// each thread 4 x 4 outputs.
const TS: u32 = 33u;  // padded row of a shared tile
var<workgroup> ws: array<f32, 1056>;
var<workgroup> xs: array<f32, 1056>;

fn put4(at: u32, v: vec4<f32>, x: bool) {
    if (x) {
        xs[at] = v.x;
        xs[at + 1u] = v.y;
        xs[at + 2u] = v.z;
        xs[at + 3u] = v.w;
    } else {
        ws[at] = v.x;
        ws[at + 1u] = v.y;
        ws[at + 2u] = v.z;
        ws[at + 3u] = v.w;
    }
}

@compute @workgroup_size(64)
fn mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let r0 = wid.x * 32u;
    let n0 = wid.y * 32u;
    let tr = (t % 8u) * 4u;
    let tn = (t / 8u) * 4u;
    var acc: array<f32, 16>;
    for (var c = 0u; c < k / 32u; c++) {
        for (var u = 0u; u < 2u; u++) {
            let r = t / 2u;  // a tile row, pieces 4c + q of it
            let q = 2u * (t % 2u) + u;
            let w = PIECE(row_base(min(r0 + r, rows - 1u)), 4u * c + q);
            let live = r0 + r < rows;
            put4(r * TS + 4u * w.xa - 32u * c, select(vec4<f32>(), w.a, live), false);
            put4(r * TS + 4u * w.xb - 32u * c, select(vec4<f32>(), w.b, live), false);
        }
        for (var u = 0u; u < 4u; u++) {
            let e = 4u * t + u;
            let j = e / 8u;  // a tile row of x, its vec4 e % 8
            var v = vec4<f32>();
            if (n0 + j < n) { v = X4[((n0 + j) * k + c * 32u) / 4u + e % 8u]; }
            put4(j * TS + 4u * (e % 8u), v, true);
        }
        workgroupBarrier();
        for (var i = 0u; i < 32u; i++) {
            var wv: array<f32, 4>;
            for (var a = 0u; a < 4u; a++) { wv[a] = ws[(tr + a) * TS + i]; }
            for (var b = 0u; b < 4u; b++) {
                let xv = xs[(tn + b) * TS + i];
                for (var a = 0u; a < 4u; a++) { acc[a * 4u + b] += wv[a] * xv; }
            }
        }
        workgroupBarrier();
    }
    for (var a = 0u; a < 4u; a++) {
        for (var b = 0u; b < 4u; b++) {
            let r = r0 + tr + a;
            let j = n0 + tn + b;
            if (r < rows && j < n) { store(j, r, acc[a * 4u + b]); }
        }
    }
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
