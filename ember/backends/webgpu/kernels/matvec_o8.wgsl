// Gated decode products whose outputs go on as the next product's int8 blocks (quant_q8's layout,
// ops.wgsl): MV_TEAMS = 32 teams, each one output (gate row g and up row g), so a workgroup's 32
// outputs are one whole block of each activation row; the block made as put_q8 makes it (the same
// scale, values and half sums from the same f32 values), beside the f32 outputs. QO: the n rows'
// blocks (nb = the gated rows / 32 a row), then their scales and sums from word 8 * n * nb.
@group(0) @binding(11) var<storage, read_write> QO: array<u32>;
var<workgroup> mv_part: array<array<f32, NR * NX>, MV_WG * MV_TEAMS>;
var<workgroup> mv_out: array<array<f32, MV_TEAMS>, NX>;  // act(gate) * up of each team
var<workgroup> mv_q: array<f32, MV_WG * MV_TEAMS>;

fn mv_sum(acc: array<f32, NR * NX>, tw: u32, sg_size: u32, sg_lane: u32, g: u32, rows: u32, n: u32) {
    let lane = tw % MV_WG;
    var s = acc;
    if (sg_size >= MV_WG) {  // a team inside one subgroup: a butterfly over its lanes
        for (var i = 0u; i < NR * NX; i++) {
            for (var m = MV_WG / 2u; m > 0u; m >>= 1u) { s[i] += subgroupShuffleXor(s[i], m); }
        }
    } else {  // a tree in workgroup memory
        mv_part[tw] = acc;
        workgroupBarrier();
        for (var m = MV_WG / 2u; m > 0u; m >>= 1u) {
            if (lane < m) {
                for (var i = 0u; i < NR * NX; i++) { mv_part[tw][i] += mv_part[tw + m][i]; }
            }
            workgroupBarrier();
        }
        s = mv_part[tw - lane];
    }
    if (lane == 0u) {
        let h = mv_gated(s, g, n);
        for (var j = 0u; j < NX; j++) { mv_out[j][tw / MV_WG] = h[j]; }
    }
    workgroupBarrier();
    // activation row j's block: threads 8j .. 8j + 7, thread 8j + w its values 4w .. 4w + 3
    let j = tw / 8u;
    let w = tw % 8u;
    let nb = pu(7u) / 32u;
    let blk = j * nb + g / MV_TEAMS;
    let live = j < n;
    var x = vec4<f32>(0.0);
    if (live) { x = vec4<f32>(mv_out[j][4u * w], mv_out[j][4u * w + 1u], mv_out[j][4u * w + 2u], mv_out[j][4u * w + 3u]); }
    let a = abs(x);
    mv_q[tw] = max(max(a.x, a.y), max(a.z, a.w));
    workgroupBarrier();
    let b0 = tw & ~7u;
    var mx = 0.0;
    for (var i = 0u; i < 8u; i++) { mx = max(mx, mv_q[b0 + i]); }
    workgroupBarrier();
    let d = mx / 127.0;
    let inv = select(0.0, 1.0 / d, mx > 0.0);
    let q = vec4<i32>(round(x * inv));
    if (live) { QO[8u * blk + w] = pack4xI8(q); }
    mv_q[tw] = f32(q.x + q.y + q.z + q.w);  // exact: at most 4 * 127
    workgroupBarrier();
    if (live && w == 0u) {
        let o = 8u * n * nb + 4u * blk;
        QO[o] = bitcast<u32>(d);
        QO[o + 1u] = bitcast<u32>(d * (mv_q[b0] + mv_q[b0 + 1u] + mv_q[b0 + 2u] + mv_q[b0 + 3u]));
        QO[o + 2u] = bitcast<u32>(d * (mv_q[b0 + 4u] + mv_q[b0 + 5u] + mv_q[b0 + 6u] + mv_q[b0 + 7u]));
        QO[o + 3u] = 0u;
    }
}
