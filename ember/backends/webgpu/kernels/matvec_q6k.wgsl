// Q6_K decode products, 32 weights a lane's item: 8 bytes of each of the two nibble runs and of the
// high bits, read as aligned words whatever the block's alignment (a 210-byte block starts on any
// even byte), give values l .. l + 7 of the four 32-value quarters of a 128-value half (l = 8q);
// 8 lanes take a 256-value block. Each quarter's sum of q * x is taken with one scale, its -32
// offset against x's sum (the same for all NR weight rows). Rows, gating and the lanes' sum as
// mvp's (matvec.wgsl).

// 8 bytes at any even byte address (the buffer is padded past its end)
fn w64(b: u32) -> vec2<u32> {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    let a = W[i];
    let c = W[i + 1u];
    let e = W[i + 2u];
    return select(vec2<u32>((a >> s) | (c << (32u - s)), (c >> s) | (e << (32u - s))), vec2<u32>(a, c), s == 0u);
}

// item (b, h, q) of the row at byte blk0: the four quarters' 8 values (6-bit, unsigned) as two
// words each (x, y), and the quarters' scales times d
struct Q6Item { v: array<vec2<u32>, 4>, sc: vec4<f32> }

fn q6k_item(blk0: u32, b: u32, h: u32, q: u32) -> Q6Item {
    let blk = blk0 + 210u * b;
    let la = w64(blk + 64u * h + 8u * q);  // low nibbles: quarters 0 and 2 (high nibbles)
    let lb = w64(blk + 64u * h + 32u + 8u * q);  // quarters 1 and 3
    let hb = w64(blk + 128u + 32u * h + 8u * q);  // 2 high bits of each quarter
    let sw = w64(blk + 192u + 8u * h);  // the half's 8 scales: quarter j's is byte q / 2 + 2j
    let d = f16at(blk + 208u);
    let sh = 8u * (q / 2u);
    let sc = d * vec4<f32>(f32(extractBits(bitcast<i32>(sw.x), sh, 8u)), f32(extractBits(bitcast<i32>(sw.x), sh + 16u, 8u)),
                           f32(extractBits(bitcast<i32>(sw.y), sh, 8u)), f32(extractBits(bitcast<i32>(sw.y), sh + 16u, 8u)));
    let m4 = vec2<u32>(0x0f0f0f0fu);
    let m2 = vec2<u32>(0x03030303u);
    let four = vec2<u32>(4u);
    // quarter j: nibbles of la (j even) or lb, low (j < 2) or high; high bits 2j .. 2j + 1
    return Q6Item(array<vec2<u32>, 4>((la & m4) | ((hb & m2) << four),
                                      (lb & m4) | (((hb >> vec2<u32>(2u)) & m2) << four),
                                      ((la >> four) & m4) | (((hb >> four) & m2) << four),
                                      ((lb >> four) & m4) | (((hb >> vec2<u32>(6u)) & m2) << four)), sc);
}

@compute @workgroup_size(32)
fn mvk(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
       @builtin(local_invocation_index) tw: u32 MV_SUM_ARGS) {
    let rows = pu(0u);
    let k = pu(1u);
    let n = pu(2u);
    let g = flat_group(wid, nwg) * MV_TEAMS + tw / MV_WG;  // this team's rows
    let t = tw % MV_WG;  // its lane
    let bases = mv_bases(g, rows);
    var acc: array<f32, NR * NX>;
    let one = vec4<f32>(1.0);
    for (var i = t; i < k / 32u; i += MV_WG) {
        let b = i / 8u;
        let h = (i / 4u) % 2u;
        let q = i % 4u;
        let x0 = (256u * b + 128u * h + 8u * q) / 4u;  // vec4 of x of the first quarter's values
        // each activation row's 8 vec4s (2 a quarter) and the quarters' sums of x
        var xs: array<vec4<f32>, 8 * NX>;
        var sx: array<vec4<f32>, NX>;
        for (var a = 0u; a < NX; a++) {
            if (a < n) {
                let xo = a * (k / 4u) + x0;
                for (var e = 0u; e < 4u; e++) {
                    xs[8u * a + 2u * e] = X4[xo + 8u * e];
                    xs[8u * a + 2u * e + 1u] = X4[xo + 8u * e + 1u];
                }
                sx[a] = vec4<f32>(dot(xs[8u * a] + xs[8u * a + 1u], one), dot(xs[8u * a + 2u] + xs[8u * a + 3u], one),
                                  dot(xs[8u * a + 4u] + xs[8u * a + 5u], one), dot(xs[8u * a + 6u] + xs[8u * a + 7u], one));
            }
        }
        for (var r = 0u; r < NR; r++) {
            let it = q6k_item(bases[r], b, h, q);
            for (var a = 0u; a < NX; a++) {
                if (a < n) {
                    var s = vec4<f32>(0.0);
                    for (var j = 0u; j < 4u; j++) {
                        s[j] = dot(vec4<f32>(unpack4xU8(it.v[j].x)), xs[8u * a + 2u * j])
                             + dot(vec4<f32>(unpack4xU8(it.v[j].y)), xs[8u * a + 2u * j + 1u]);
                    }
                    acc[r * NX + a] += dot(it.sc, s - 32.0 * sx[a]);
                }
            }
        }
    }
    MV_SUM_CALL
}

// The same items on int8 activations (XQ, XS): each quarter's 8 values (6-bit, unsigned) against
// the 8 int8 of x's block that hold them as 2 packed dot products, the -32 offset against their
// sum, scaled once by the quarter's scale times x's d.
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
    for (var i = t; i < nb; i += MV_WG) {
        let b = i / 8u;
        let h = (i / 4u) % 2u;
        let q = i % 4u;
        let xb = 8u * b + 4u * h;  // quarter j's values are x's block xb + j, its words 2q, 2q + 1
        var xq: array<vec4<u32>, 2 * NX>;  // quarters 0 and 1, then 2 and 3: two words each
        var xd: array<vec4<f32>, NX>;  // the quarters' d
        var xo: array<vec4<i32>, NX>;  // 32 * the quarters' sums of q (the offset's share)
        for (var a = 0u; a < NX; a++) {
            if (a < n) {
                var w: array<vec2<u32>, 4>;
                for (var j = 0u; j < 4u; j++) {
                    let e = XQ[2u * (a * nb + xb + j) + q / 2u];
                    w[j] = select(e.xy, e.zw, (q & 1u) == 1u);
                    xd[a][j] = XS[xs_at(a, xb + j, nb, n)].x;
                    xo[a][j] = 32 * (dot4I8Packed(0x01010101u, w[j].x) + dot4I8Packed(0x01010101u, w[j].y));
                }
                xq[2u * a] = vec4<u32>(w[0], w[1]);
                xq[2u * a + 1u] = vec4<u32>(w[2], w[3]);
            }
        }
        for (var r = 0u; r < NR; r++) {
            let it = q6k_item(bases[r], b, h, q);
            for (var a = 0u; a < NX; a++) {
                if (a < n) {
                    let p = xq[2u * a];
                    let o = xq[2u * a + 1u];
                    let s = vec4<i32>(dot4I8Packed(it.v[0].x, p.x) + dot4I8Packed(it.v[0].y, p.y),
                                      dot4I8Packed(it.v[1].x, p.z) + dot4I8Packed(it.v[1].y, p.w),
                                      dot4I8Packed(it.v[2].x, o.x) + dot4I8Packed(it.v[2].y, o.y),
                                      dot4I8Packed(it.v[3].x, o.z) + dot4I8Packed(it.v[3].y, o.w)) - xo[a];
                    acc[r * NX + a] += dot(it.sc * xd[a], vec4<f32>(s));
                }
            }
        }
    }
    MV_SUM_CALL
}
