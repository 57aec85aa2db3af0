// mvp's lanes summed by subgroupAdd, then the subgroups' sums (where a subgroup is narrower than
// the workgroup: lavapipe's 8 lanes, Intel's 8-16) through workgroup memory after one barrier.
var<workgroup> mv_part: array<array<f32, NR * NX>, MV_WG>;

fn mv_sum(acc: array<f32, NR * NX>, t: u32, sg_size: u32, sg_lane: u32, g: u32, rows: u32, n: u32) {
    var s: array<f32, NR * NX>;
    for (var i = 0u; i < NR * NX; i++) { s[i] = subgroupAdd(acc[i]); }
    if (sg_lane == 0u) { mv_part[t / sg_size] = s; }
    workgroupBarrier();
    if (t == 0u) {
        for (var g = 1u; g < (MV_WG + sg_size - 1u) / sg_size; g++) {
            for (var i = 0u; i < NR * NX; i++) { s[i] += mv_part[g][i]; }
        }
        mv_store(s, g, rows, n);
    }
}
