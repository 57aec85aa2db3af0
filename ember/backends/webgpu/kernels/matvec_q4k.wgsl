// Q4_K decode products read 16 bytes at a time (W4: the same buffer as W, 16-byte words; a
// matrix's blocks start 16-byte aligned and a row is whole 144-byte super-blocks). A lane's item
// is 32 weights of a super-block: the 16 bytes 32j + 16h .. of its nibbles hold values 16h ..
// 16h + 15 of sub-blocks 2j (low nibbles) and 2j + 1 (high), so 8 lanes take a super-block, its
// first 16 bytes (d, dmin and the 12 scale bytes) one more load each. Each sub-block's sum of q * x
// is taken before its scale, and its min against the sub-block's sum of x, which is the same for
// all NR weight rows. Rows, gating and the lanes' sum as mvp's (matvec.wgsl). The decode builds
// of 32 lanes take it (Backend._product).
@group(0) @binding(7) var<storage, read> W4: array<vec4<u32>>;

// sub-blocks 2j and 2j + 1's 6-bit scales (x, y) and mins (z, w) from the header's words 1-3
fn q4k_scales(hd: vec4<u32>, j: u32) -> vec4<f32> {
    var sc: u32;
    var mn: u32;
    if (j < 2u) {
        sc = hd.y & 0x3f3f3f3fu;
        mn = hd.z & 0x3f3f3f3fu;
    } else {
        sc = (hd.w & 0x0f0f0f0fu) | (((hd.y >> 6u) & 0x03030303u) << 4u);
        mn = ((hd.w >> 4u) & 0x0f0f0f0fu) | (((hd.z >> 6u) & 0x03030303u) << 4u);
    }
    let sh = 16u * (j & 1u);  // bytes 2j % 4 and 2j % 4 + 1
    return vec4<f32>(f32((sc >> sh) & 0xffu), f32((sc >> (sh + 8u)) & 0xffu),
                     f32((mn >> sh) & 0xffu), f32((mn >> (sh + 8u)) & 0xffu));
}

// item (b, j, h) of the row at 16-byte word blk0: its 16 nibble bytes, the two sub-blocks' scales
// (dl) and mins (ml) times d and dmin
struct Q4Item { qv: vec4<u32>, dl: vec2<f32>, ml: vec2<f32> }

fn q4k_item(blk0: u32, b: u32, j: u32, h: u32) -> Q4Item {
    let blk = blk0 + 9u * b;
    let hd = W4[blk];
    let dm = unpack2x16float(hd.x);
    let sm = q4k_scales(hd, j);
    return Q4Item(W4[blk + 1u + 2u * j + h], dm.x * sm.xy, dm.y * sm.zw);
}

@compute @workgroup_size(32)
fn mvk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) tw: u32 MV_SUM_ARGS) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let g = flat_group(wid, nwg) * MV_TEAMS + tw / MV_WG;  // this team's rows
    let t = tw % MV_WG;  // its lane
    var bases = mv_bases(g, rows);
    for (var r = 0u; r < NR; r++) { bases[r] /= 16u; }  // in W4's 16-byte words
    var acc: array<f32, NR * NX>;
    let one = vec4<f32>(1.0);
    for (var i = t; i < k / 32u; i += MV_WG) {
        let b = i / 8u;
        let j = (i / 2u) % 4u;
        let h = i % 2u;
        let xlo = (256u * b + 64u * j + 16u * h) / 4u;  // vec4 of x where the low nibbles' values start
        // each activation row's four sums: q . x of the two sub-blocks (below), x's sums (here)
        var xs: array<vec4<f32>, 8 * NX>;
        var sx: array<vec2<f32>, NX>;
        for (var a = 0u; a < NX; a++) {
            if (a < n) {
                let xo = a * (k / 4u) + xlo;
                for (var e = 0u; e < 4u; e++) {
                    xs[8u * a + e] = X4[xo + e];
                    xs[8u * a + 4u + e] = X4[xo + 8u + e];
                }
                sx[a] = vec2<f32>(dot(xs[8u * a] + xs[8u * a + 1u] + xs[8u * a + 2u] + xs[8u * a + 3u], one),
                                  dot(xs[8u * a + 4u] + xs[8u * a + 5u] + xs[8u * a + 6u] + xs[8u * a + 7u], one));
            }
        }
        for (var r = 0u; r < NR; r++) {
            let it = q4k_item(bases[r], b, j, h);
            for (var a = 0u; a < NX; a++) {
                if (a < n) {
                    var lo = 0.0;
                    var hi = 0.0;
                    for (var e = 0u; e < 4u; e++) {
                        lo += dot(lo4(it.qv[e]), xs[8u * a + e]);
                        hi += dot(hi4(it.qv[e]), xs[8u * a + 4u + e]);
                    }
                    acc[r * NX + a] += it.dl.x * lo + it.dl.y * hi - dot(it.ml, sx[a]);
                }
            }
        }
    }
    MV_SUM_CALL
}

// The same items on int8 activations (XQ, XS): a sub-block's 16 nibbles of the item against the
// matching half of x's block as 4 packed dot products (x's 32-value blocks are Q4_K's sub-blocks),
// scaled once by the sub-block's scale times x's; the mins against x's half sums.
@compute @workgroup_size(32)
fn mvq(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) tw: u32 MV_SUM_ARGS) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let nb = k / 32u;
    let g = flat_group(wid, nwg) * MV_TEAMS + tw / MV_WG;  // this team's rows
    let t = tw % MV_WG;  // its lane
    var bases = mv_bases(g, rows);
    for (var r = 0u; r < NR; r++) { bases[r] /= 16u; }
    var acc: array<f32, NR * NX>;
    let m4 = vec4<u32>(0x0f0f0f0fu);
    for (var i = t; i < nb; i += MV_WG) {
        let b = i / 8u;
        let j = (i / 2u) % 4u;
        let h = i % 2u;
        let xb = 8u * b + 2u * j;  // x's blocks of sub-blocks 2j (low nibbles) and 2j + 1
        var xq: array<vec4<u32>, 2 * NX>;
        var xd: array<vec4<f32>, NX>;  // the two blocks' d, then their halves' sums
        for (var a = 0u; a < NX; a++) {
            if (a < n) {
                xq[2u * a] = XQ[2u * (a * nb + xb) + h];
                xq[2u * a + 1u] = XQ[2u * (a * nb + xb + 1u) + h];
                let s0 = XS[xs_at(a, xb, nb, n)];
                let s1 = XS[xs_at(a, xb + 1u, nb, n)];
                xd[a] = select(vec4<f32>(s0.x, s1.x, s0.y, s1.y), vec4<f32>(s0.x, s1.x, s0.z, s1.z), h == 1u);
            }
        }
        for (var r = 0u; r < NR; r++) {
            let it = q4k_item(bases[r], b, j, h);
            let lo = it.qv & m4;
            let hi = (it.qv >> vec4<u32>(4u)) & m4;
            for (var a = 0u; a < NX; a++) {
                if (a < n) {
                    let p = xq[2u * a];
                    let q = xq[2u * a + 1u];
                    let sl = dot4I8Packed(lo.x, p.x) + dot4I8Packed(lo.y, p.y) + dot4I8Packed(lo.z, p.z) + dot4I8Packed(lo.w, p.w);
                    let sh = dot4I8Packed(hi.x, q.x) + dot4I8Packed(hi.y, q.y) + dot4I8Packed(hi.z, q.z) + dot4I8Packed(hi.w, q.w);
                    acc[r * NX + a] += it.dl.x * xd[a].x * f32(sl) + it.dl.y * xd[a].y * f32(sh) - dot(it.ml, xd[a].zw);
                }
            }
        }
    }
    MV_SUM_CALL
}
