// mvp's lanes summed without subgroups: a tree in workgroup memory within each team.
var<workgroup> mv_part: array<array<f32, NR * NX>, MV_WG * MV_TEAMS>;

fn mv_sum(acc: array<f32, NR * NX>, tw: u32, g: u32, rows: u32, n: u32) {
    let lane = tw % MV_WG;
    mv_part[tw] = acc;
    workgroupBarrier();
    for (var s = MV_WG / 2u; s > 0u; s >>= 1u) {
        if (lane < s) {
            for (var i = 0u; i < NR * NX; i++) { mv_part[tw][i] += mv_part[tw + s][i]; }
        }
        workgroupBarrier();
    }
    if (lane == 0u) { mv_store(mv_part[tw], g, rows, n); }
}
