// mvp's lanes summed without subgroups: a tree in workgroup memory.
var<workgroup> mv_part: array<array<f32, NR * NX>, MV_WG>;

fn mv_sum(acc: array<f32, NR * NX>, t: u32, g: u32, rows: u32, n: u32) {
    mv_part[t] = acc;
    workgroupBarrier();
    for (var s = MV_WG / 2u; s > 0u; s >>= 1u) {
        if (t < s) {
            for (var i = 0u; i < NR * NX; i++) { mv_part[t][i] += mv_part[t + s][i]; }
        }
        workgroupBarrier();
    }
    if (t == 0u) { mv_store(mv_part[0], g, rows, n); }
}
