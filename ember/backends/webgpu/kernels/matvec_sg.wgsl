// mvp's lanes summed by subgroups, a team at a time. A subgroup within a team (NVIDIA's 32 lanes for
// a team of 32, Intel's 8-16): subgroupAdd, then, where the team spans several subgroups, their sums
// through workgroup memory after one barrier. A subgroup wider than a team (AMD's 64 lanes for 32):
// a butterfly over the team's lanes (subgroupShuffleXor), which stays inside it.
var<workgroup> mv_part: array<array<f32, NR * NX>, MV_WG * MV_TEAMS>;

fn mv_sum(acc: array<f32, NR * NX>, tw: u32, sg_size: u32, sg_lane: u32, g: u32, rows: u32, n: u32) {
    let lane = tw % MV_WG;
    var s: array<f32, NR * NX>;
    for (var i = 0u; i < NR * NX; i++) {
        if (sg_size > MV_WG) {
            var v = acc[i];
            for (var m = MV_WG / 2u; m > 0u; m >>= 1u) { v += subgroupShuffleXor(v, m); }
            s[i] = v;
        } else {
            s[i] = subgroupAdd(acc[i]);
        }
    }
    if (sg_size >= MV_WG) {
        if (lane == 0u) { mv_store(s, g, rows, n); }
        return;
    }
    if (sg_lane == 0u) { mv_part[tw / sg_size] = s; }
    workgroupBarrier();
    if (lane == 0u) {
        for (var p = 1u; p < MV_WG / sg_size; p++) {
            for (var i = 0u; i < NR * NX; i++) { s[i] += mv_part[tw / sg_size + p][i]; }
        }
        mv_store(s, g, rows, n);
    }
}
