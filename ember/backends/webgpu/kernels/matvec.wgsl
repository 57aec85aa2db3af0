// Decode products for GPUs: NR weight rows a team of MV_WG lanes, the lanes splitting each
// row's blocks into pieces of 8 values (a quarter of a 32-value block, a 32nd of a 256-value
// super-block), so that all lanes work from k = 256 on whatever the type, and each piece's x is
// read once for the NR rows (pieces.wgsl). NX (the activation rows built for: 1, 2, 4 or 8) and
// the lanes' sum (subgroupAdd, or a tree in workgroup memory) come with the module (_kernels.py).
const MV_WG: u32 = 32u;  // lanes of a team
const MV_TEAMS: u32 = 1u;  // teams of a workgroup, each on rows of its own (more warps resident a multiprocessor)
const NR: u32 = 2u;  // weight rows of a workgroup

// The integer decode products' activations (mvq; quant_q8 in ops.wgsl writes them): a 32-value
// block of x as 32 int8 (XQ: two 16-byte elements), the n rows' blocks back to back, then each
// block's (d, d * sum of q over values 0-15, over 16-31, 0) (XS).
@group(0) @binding(8) var<storage, read> XQ: array<vec4<u32>>;
@group(0) @binding(9) var<storage, read> XS: array<vec4<f32>>;

// the XS element of block b of activation row a (nb blocks a row, n rows)
fn xs_at(a: u32, b: u32, nb: u32, n: u32) -> u32 { return 2u * n * nb + a * nb + b; }

// Row r of workgroup g: rows NR * g .. of the (virtual) matrix; or, gated (param 13: 1 SiLU,
// 2 GELU-tanh, gate and up of as many rows back to back, NR = 2), row g of the gate and row g of
// the up matrix, the workgroup then writing act(gate) * up over the gate's output (over the up's
// where param 14 is set, the gate's raw sums then in the other).
fn mv_row_at(g: u32, r: u32) -> u32 {
    if (pu(13u) != 0u) { return g + r * pu(7u); }
    return g * NR + r;
}

// the byte where each of workgroup g's rows starts (a row past the end: the last, read, not stored)
fn mv_bases(g: u32, rows: u32) -> array<u32, NR> {
    var bases: array<u32, NR>;
    for (var r = 0u; r < NR; r++) { bases[r] = row_base(min(mv_row_at(g, r), rows - 1u)); }
    return bases;
}

// x (n <= NX rows) read a piece at a time for all of a workgroup's rows.
@compute @workgroup_size(32)
fn mvp(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) tw: u32 MV_SUM_ARGS) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let g = flat_group(wid, nwg) * MV_TEAMS + tw / MV_WG;  // this team's rows
    let t = tw % MV_WG;  // its lane
    let bases = mv_bases(g, rows);
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
