// The 32-value block types' decode products on int8 activations (XQ, XS: quant_q8's blocks):
// mvp's pieces of 8 values (the same lanes, rows, gating and sums) read as integers (IPIECE,
// pieces.wgsl) and met by 2 packed 4 x 8-bit dot products; x's 8 values' sum (for the types'
// offsets and mins) once for all NR weight rows; a piece lies in one block of x, whose d scales it.
@compute @workgroup_size(32)
fn mvq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) tw: u32 MV_SUM_ARGS) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let nb = k / 32u;
    let g = flat_group(wid, nwg) * MV_TEAMS + tw / MV_WG;  // this team's rows
    let t = tw % MV_WG;  // its lane
    let bases = mv_bases(g, rows);
    var acc: array<f32, NR * NX>;
    for (var p = t; p < k / 8u; p += MV_WG) {
        var ws: array<IPiece, NR>;
        for (var r = 0u; r < NR; r++) { ws[r] = IPIECE(bases[r], p); }
        let xa = ws[0].xa;
        let xb = ws[0].xb;
        for (var a = 0u; a < NX; a++) {
            if (a < n) {
                let row = 8u * nb * a;  // the row's first word
                let va = XQ[(row + xa) / 4u][(row + xa) % 4u];
                let vb = XQ[(row + xb) / 4u][(row + xb) % 4u];
                let dx = XS[xs_at(a, p / 4u, nb, n)].x;
                let sx = dot4I8Packed(0x01010101u, va) + dot4I8Packed(0x01010101u, vb);
                for (var r = 0u; r < NR; r++) {
                    let w = ws[r];
                    let s = dot4I8Packed(w.a, va) + dot4I8Packed(w.b, vb) + w.off * sx;
                    acc[r * NX + a] += dx * (w.d * f32(s) + w.m * f32(sx));
                }
            }
        }
    }
    MV_SUM_CALL
}
