// The decode products of a layer's queries, keys and values with rope and the cache stores taken
// in (the "+kv" builds; Backend._products_store makes them out of the product dispatches and the
// rope that followed them). A team's NR = 2 rows are one rope pair where rope pairs adjacent
// values (llama's layout, not neox's): rows below param 27 are queries, rotated; rows from 27 to
// 28 keys, rotated and stored into the key cache KH as f16 pairs; rows from 28 on values, stored
// into the value cache VH. Every row also goes to its output as before. Token j's position is
// IDS[param 18 + j] and its cache slot IDS[param 19 + j].
// params: the product's 0-14, 16 hd, 17 n_rot, 18 positions offset, 19 slots offset, 20 freq_base,
// 21 freq_scale, 22 ext_factor, 23 mscale, 24 low, 25 high, 26 has factors (RB), 27 queries' end,
// 28 keys' end, 29 key cache row width, 30 value cache row width
@group(0) @binding(11) var<storage, read> RB: array<f32>;  // rope's frequency factors
@group(0) @binding(12) var<storage, read_write> KH: array<u32>;  // key cache: f16 pairs a slot's row
@group(0) @binding(13) var<storage, read_write> VH: array<u32>;  // value cache

fn mv_store(s: array<f32, NR * NX>, g: u32, rows: u32, n: u32) {
    let r0 = g * NR;
    if (r0 >= rows) { return; }
    let q_end = pu(27u);
    let k_end = pu(28u);
    var e = r0 % pu(16u);  // the row's place in its head
    if (r0 >= q_end) { e = (r0 - q_end) % pu(16u); }
    let rotated = r0 < k_end && e < pu(17u);
    var factor = 1.0;
    if (rotated && pu(26u) != 0u) { factor = RB[e / 2u]; }
    for (var j = 0u; j < NX; j++) {
        if (j < n) {
            var a = s[j];
            var b = s[NX + j];
            if (rotated) {
                let cs = rope_rotation(e / 2u, f32(IDS[pu(18u) + j]), pu(17u), pf(20u), pf(21u), pf(22u), pf(23u),
                                       pf(24u), pf(25u), factor);
                let x = a;
                a = x * cs.x - b * cs.y;
                b = x * cs.y + b * cs.x;
            }
            store(j, r0, a);
            store(j, r0 + 1u, b);
            if (r0 >= q_end) {
                let slot = u32(IDS[pu(19u) + j]);
                let pair = pack2x16float(vec2<f32>(a, b));
                if (r0 < k_end) {
                    KH[slot * (pu(29u) / 2u) + (r0 - q_end) / 2u] = pair;
                } else {
                    VH[slot * (pu(30u) / 2u) + (r0 - k_end) / 2u] = pair;
                }
            }
        }
    }
}
