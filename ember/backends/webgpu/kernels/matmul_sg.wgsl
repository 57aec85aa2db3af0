
// Decode with subgroup sums (devices with the subgroup feature): a weight row a workgroup of 64
// lanes, a lane a 32-value slice at a time, each lane's sums added across its subgroup, the
// subgroups' sums through workgroup memory (one barrier whatever the subgroup size).
var<workgroup> sg_part: array<array<f32, 8>, 64>;

@compute @workgroup_size(64)
fn mv_sg(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) t: u32, @builtin(subgroup_size) sg_size: u32,
         @builtin(subgroup_invocation_id) sg_lane: u32) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let row = flat_group(wid, nwg);
    var acc: array<f32, 8>;
    if (row < rows) {
        var o: array<f32, 32>;
        for (var c = t; c < k / 32u; c += 64u) {
            DEQ(row_base(row), c, &o);
            for (var j = 0u; j < n; j++) {
                let xb = (j * k + c * 32u) / 4u;
                var s = 0.0;
                for (var i = 0u; i < 8u; i++) {
                    s += dot(vec4<f32>(o[4u * i], o[4u * i + 1u], o[4u * i + 2u], o[4u * i + 3u]), X4[xb + i]);
                }
                acc[j] += s;
            }
        }
    }
    for (var j = 0u; j < MV_N; j++) {
        let s = subgroupAdd(acc[j]);
        if (sg_lane == 0u) { sg_part[t / sg_size][j] = s; }
    }
    workgroupBarrier();
    if (t == 0u && row < rows) {
        for (var j = 0u; j < n; j++) {
            var s = 0.0;
            for (var g = 0u; g < (64u + sg_size - 1u) / sg_size; g++) { s += sg_part[g][j]; }
            store(j, row, s);
        }
    }
}
