// Every op but the products. Y is the op's output (read_write); A, B its f32 inputs; I the step's
// host ints (positions, slots, page tables, ids) at the word offsets the params give; H a paged
// f16 cache (pairs of halves a word), KC and VC the caches attention reads; OI int outputs.
// A buffer bound as Y cannot be bound again in the same dispatch: where an input is the output
// itself, a flag says so and the op reads Y.
@group(0) @binding(1) var<storage, read_write> Y: array<f32>;
@group(0) @binding(2) var<storage, read> A: array<f32>;
@group(0) @binding(3) var<storage, read> B: array<f32>;
@group(0) @binding(4) var<storage, read> I: array<i32>;
@group(0) @binding(5) var<storage, read_write> H: array<u32>;
@group(0) @binding(6) var<storage, read> KC: array<u32>;
@group(0) @binding(7) var<storage, read> VC: array<u32>;
@group(0) @binding(8) var<storage, read_write> OI: array<i32>;
@group(0) @binding(9) var<storage, read_write> Z: array<f32>;  // a second output
@group(0) @binding(10) var<storage, read_write> HV: array<u32>;  // a second cache

const WG: u32 = 256u;

fn elem(wid: vec3<u32>, nwg: vec3<u32>, t: u32) -> u32 { return flat_group(wid, nwg) * WG + t; }
// tanh of arguments held where every implementation's tanh is finite
fn tanh_safe(x: f32) -> f32 { return tanh(clamp(x, -15.0, 15.0)); }

// Y = a + b, silu(a) * b or gelu_tanh(a) * b (mode 0, 1, 2). params: 0 size, 1 a is Y, 2 b is Y, 3 mode
@compute @workgroup_size(256)
fn binary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
          @builtin(local_invocation_index) t: u32) {
    let i = elem(wid, nwg, t);
    if (i >= pu(0u)) { return; }
    var a: f32;
    var b: f32;
    if (pu(1u) != 0u) { a = Y[i]; } else { a = A[i]; }
    if (pu(2u) != 0u) { b = Y[i]; } else { b = B[i]; }
    let mode = pu(3u);
    if (mode == 0u) {
        Y[i] = a + b;
    } else if (mode == 1u) {
        Y[i] = a / (1.0 + exp(-a)) * b;
    } else {
        Y[i] = 0.5 * a * (1.0 + tanh_safe(0.7978845608028654 * (a + 0.044715 * a * a * a))) * b;
    }
}

// Y *= s (mode 0) or Y = s * tanh(Y / s) (mode 1). params: 0 size, 1 mode, 2 s
@compute @workgroup_size(256)
fn unary(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) t: u32) {
    let i = elem(wid, nwg, t);
    if (i >= pu(0u)) { return; }
    let s = pf(2u);
    if (pu(1u) == 0u) { Y[i] *= s; } else { Y[i] = s * tanh_safe(Y[i] / s); }
}

// Y (n, d) += A (d,). params: 0 size, 1 d
@compute @workgroup_size(256)
fn add_row(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) t: u32) {
    let i = elem(wid, nwg, t);
    if (i >= pu(0u)) { return; }
    Y[i] += A[i % pu(1u)];
}

// Y[r] = A[I[off + r]] for rows of d. params: 0 size (rows * d), 1 d, 2 off
@compute @workgroup_size(256)
fn gather_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
               @builtin(local_invocation_index) t: u32) {
    let i = elem(wid, nwg, t);
    if (i >= pu(0u)) { return; }
    let d = pu(1u);
    Y[i] = A[u32(I[pu(2u) + i / d]) * d + i % d];
}

// Row t of Y (n, d) *= 1 + scale * log(floor((pos_t + offset) / length) + 1).
// params: 0 size, 1 d, 2 pos_off, 3 length, 4 scale, 5 offset
@compute @workgroup_size(256)
fn pos_scale(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
             @builtin(local_invocation_index) t: u32) {
    let i = elem(wid, nwg, t);
    if (i >= pu(0u)) { return; }
    let pos = f32(I[pu(2u) + i / pu(1u)]);
    Y[i] *= 1.0 + pf(4u) * log(floor((pos + pf(5u)) / f32(pu(3u))) + 1.0);
}

// RMS norm of rows of d, a workgroup a row: Y = A / rms(A) (* B where given). Rows past the
// first `rows`: a second array normed in place, Z (rows_z rows, times A where given: queries' and
// keys' norms in one dispatch).
// params: 0 d, 1 rows, 2 A is Y, 3 has weight, 4 eps, 5 rows_z, 6 Z has weight
var<workgroup> part: array<f32, 256>;

// the sum of v over the workgroup's threads (every thread gets it; part free again after): 16
// threads each add 16 values, then every thread adds their 16 sums (two barriers, not a tree's 9)
var<workgroup> part16: array<f32, 16>;

fn wg_sum(t: u32, v: f32) -> f32 {
    part[t] = v;
    workgroupBarrier();
    if (t < 16u) {
        var s = 0.0;
        for (var i = 0u; i < 16u; i++) { s += part[16u * t + i]; }
        part16[t] = s;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < 16u; i++) { total += part16[i]; }
    return total;
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) t: u32) {
    let d = pu(0u);
    let row = flat_group(wid, nwg);
    if (row >= pu(1u)) {
        rms_norm_z(t, d, row - pu(1u));
        return;
    }
    let in_place = pu(2u) != 0u;
    var ss = 0.0;
    if (row < pu(1u)) {
        for (var i = t; i < d; i += WG) {
            var x: f32;
            if (in_place) { x = Y[row * d + i]; } else { x = A[row * d + i]; }
            ss += x * x;
        }
    }
    let total = wg_sum(t, ss);
    if (row >= pu(1u)) { return; }
    let r = 1.0 / sqrt(total / f32(d) + pf(4u));
    for (var i = t; i < d; i += WG) {
        var x: f32;
        if (in_place) { x = Y[row * d + i]; } else { x = A[row * d + i]; }
        x *= r;
        if (pu(3u) != 0u) { x *= B[i]; }
        Y[row * d + i] = x;
    }
}

// row r of Z normed in place (times A where given)
fn rms_norm_z(t: u32, d: u32, r: u32) {
    var ss = 0.0;
    if (r < pu(5u)) {
        for (var i = t; i < d; i += WG) { ss += Z[r * d + i] * Z[r * d + i]; }
    }
    let total = wg_sum(t, ss);
    if (r >= pu(5u)) { return; }
    let s = 1.0 / sqrt(total / f32(d) + pf(4u));
    for (var i = t; i < d; i += WG) {
        var x = Z[r * d + i] * s;
        if (pu(6u) != 0u) { x *= A[i]; }
        Z[r * d + i] = x;
    }
}

// A block's output normed, added to the residual stream, and the next norm, in one pass over
// each row (post-norm families: Gemma): Z (h) = Z / rms(Z) (* B), Y (x) += Z, Z = Y / rms(Y) (* A).
// params: 0 d, 1 rows, 2 has B, 3 has A, 4 eps, 5 Z's int8 blocks into H too, 6 their S
@compute @workgroup_size(256)
fn norm_add_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                     @builtin(local_invocation_index) t: u32) {
    let d = pu(0u);
    let row = flat_group(wid, nwg);
    let live = row < pu(1u);
    let at = row * d;
    var ss = 0.0;
    if (live) {
        for (var i = t; i < d; i += WG) { ss += Z[at + i] * Z[at + i]; }
    }
    let r1 = 1.0 / sqrt(wg_sum(t, ss) / f32(d) + pf(4u));
    ss = 0.0;
    if (live) {
        for (var i = t; i < d; i += WG) {
            var h = Z[at + i] * r1;
            if (pu(2u) != 0u) { h *= B[i]; }
            let x = Y[at + i] + h;
            Y[at + i] = x;
            ss += x * x;
        }
    }
    let r2 = 1.0 / sqrt(wg_sum(t, ss) / f32(d) + pf(4u));
    if (!live) { return; }
    if (pu(5u) != 0u) {  // and its int8 blocks for the next product
        normed_q8(t, row, d, r2, select(0u, 1u, pu(3u) != 0u), pu(6u));
        return;
    }
    for (var i = t; i < d; i += WG) {
        var x = Y[at + i] * r2;
        if (pu(3u) != 0u) { x *= A[i]; }
        Z[at + i] = x;
    }
}

// The residual add and the norm after it in one pass over each row: Y (x) += A (h), then
// Z = Y / rms(Y) (* B where given); A is read from Z where the norm writes over h (a flag).
// params: 0 d, 1 rows, 2 h is Z, 3 has weight, 4 eps, 5 Z's int8 blocks into H too, 6 their S
@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) t: u32) {
    let d = pu(0u);
    let row = flat_group(wid, nwg);
    if (pu(5u) != 0u && d % 32u == 0u && d <= 16u * WG) {
        add_rms_norm_q8(t, row, d);
        return;
    }
    var ss = 0.0;
    if (row < pu(1u)) {  // 4 values a thread at a time (the loads in flight together), then d's tail
        let at = row * d;
        let d4 = d & ~3u;
        for (var i = 4u * t; i < d4; i += 4u * WG) {
            var h: vec4<f32>;
            if (pu(2u) != 0u) {
                h = vec4<f32>(Z[at + i], Z[at + i + 1u], Z[at + i + 2u], Z[at + i + 3u]);
            } else {
                h = vec4<f32>(A[at + i], A[at + i + 1u], A[at + i + 2u], A[at + i + 3u]);
            }
            let x = vec4<f32>(Y[at + i], Y[at + i + 1u], Y[at + i + 2u], Y[at + i + 3u]) + h;
            Y[at + i] = x.x;
            Y[at + i + 1u] = x.y;
            Y[at + i + 2u] = x.z;
            Y[at + i + 3u] = x.w;
            ss += dot(x, x);
        }
        for (var i = d4 + t; i < d; i += WG) {
            var h: f32;
            if (pu(2u) != 0u) { h = Z[at + i]; } else { h = A[at + i]; }
            let x = Y[at + i] + h;
            Y[at + i] = x;
            ss += x * x;
        }
    }
    let total = wg_sum(t, ss);
    if (row >= pu(1u)) { return; }
    let r = 1.0 / sqrt(total / f32(d) + pf(4u));
    if (pu(5u) != 0u) {  // and its int8 blocks for the next product
        normed_q8(t, row, d, r, select(0u, 2u, pu(3u) != 0u), pu(6u));
        return;
    }
    for (var i = t; i < d; i += WG) {
        var x = Y[row * d + i] * r;
        if (pu(3u) != 0u) { x *= B[i]; }
        Z[row * d + i] = x;
    }
}

// add_rms_norm with int8 blocks for rows of up to 16 * WG values in blocks of 32: a thread's 4
// values at 4t + Q8_SPAN v (v < 4: the loads of a warp contiguous) held from the add to the blocks, the
// norm's weights loaded with them; each Q8_SPAN values' 32 blocks as put_q8 makes them (8 threads a
// block), all four at once (two barriers, not three for each).
var<workgroup> q8_max: array<vec4<f32>, 256>;
var<workgroup> q8_sum: array<vec4<f32>, 256>;

const Q8_SPAN: u32 = 4u * WG;  // values a pass of the workgroup's vec4s covers

fn add_rms_norm_q8(t: u32, row: u32, d: u32) {
    let on = row < pu(1u);
    let at = row * d;
    var x: array<vec4<f32>, 4>;
    var w: array<vec4<f32>, 4>;
    var ss = 0.0;
    for (var v = 0u; v < 4u; v++) {
        let c = Q8_SPAN * v + 4u * t;
        if (on && c < d) {
            let i = at + c;
            var h: vec4<f32>;
            if (pu(2u) != 0u) {
                h = vec4<f32>(Z[i], Z[i + 1u], Z[i + 2u], Z[i + 3u]);
            } else {
                h = vec4<f32>(A[i], A[i + 1u], A[i + 2u], A[i + 3u]);
            }
            w[v] = vec4<f32>(1.0);
            if (pu(3u) != 0u) { w[v] = vec4<f32>(B[c], B[c + 1u], B[c + 2u], B[c + 3u]); }
            x[v] = vec4<f32>(Y[i], Y[i + 1u], Y[i + 2u], Y[i + 3u]) + h;
            Y[i] = x[v].x;
            Y[i + 1u] = x[v].y;
            Y[i + 2u] = x[v].z;
            Y[i + 3u] = x[v].w;
            ss += dot(x[v], x[v]);
        }
    }
    let total = wg_sum(t, ss);
    if (!on) { return; }
    let r = 1.0 / sqrt(total / f32(d) + pf(4u));
    var m = vec4<f32>(0.0);
    for (var v = 0u; v < 4u; v++) {
        let c = Q8_SPAN * v + 4u * t;
        if (c < d) {
            x[v] = x[v] * r * w[v];
            let i = at + c;
            Z[i] = x[v].x;
            Z[i + 1u] = x[v].y;
            Z[i + 2u] = x[v].z;
            Z[i + 3u] = x[v].w;
            let a = abs(x[v]);
            m[v] = max(max(a.x, a.y), max(a.z, a.w));
        }
    }
    q8_max[t] = m;
    workgroupBarrier();
    let g = t & ~7u;
    var mx = vec4<f32>(0.0);
    for (var i = 0u; i < 8u; i++) { mx = max(mx, q8_max[g + i]); }
    let dq = mx / 127.0;
    let blk = row * (d / 32u) + t / 8u;  // the block of pass v: blk + v Q8_SPAN / 32
    var qs = vec4<f32>(0.0);
    for (var v = 0u; v < 4u; v++) {
        if (Q8_SPAN * v + 4u * t < d) {
            let inv = select(0.0, 1.0 / dq[v], mx[v] > 0.0);
            let q = vec4<i32>(round(x[v] * inv));
            H[8u * (blk + Q8_SPAN / 32u * v) + (t & 7u)] = pack4xI8(q);
            qs[v] = f32(q.x + q.y + q.z + q.w);  // exact: at most 4 * 127
        }
    }
    q8_sum[t] = qs;
    workgroupBarrier();
    if ((t & 7u) == 0u) {
        for (var v = 0u; v < 4u; v++) {
            if (Q8_SPAN * v + 4u * t < d) {
                let o = pu(6u) + 4u * (blk + Q8_SPAN / 32u * v);
                H[o] = bitcast<u32>(dq[v]);
                H[o + 1u] = bitcast<u32>(dq[v] * (q8_sum[g][v] + q8_sum[g + 1u][v] + q8_sum[g + 2u][v] + q8_sum[g + 3u][v]));
                H[o + 2u] = bitcast<u32>(dq[v] * (q8_sum[g + 4u][v] + q8_sum[g + 5u][v] + q8_sum[g + 6u][v] + q8_sum[g + 7u][v]));
                H[o + 3u] = 0u;
            }
        }
    }
}

// Rotary embedding of Y (n, n_head * hd) and of Z (n, n_head_z * hd) (queries and keys; n_head_z
// may be 0) in place at positions I[pos_off ..], ggml's parametrisation with YaRN (ramp bounds and
// magnitude scale from the host) and frequency factors B. A thread a rotated pair; x: pair + head
// * n_rot/2 over Y's heads then Z's, y: token.
// params: 0 n, 1 n_head, 2 hd, 3 n_rot, 4 neox, 5 pos_off, 6 freq_base, 7 freq_scale,
// 8 ext_factor, 9 mscale, 10 low, 11 high, 12 has factors, 13 n_head_z
@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) g: vec3<u32>) {
    let half = pu(3u) / 2u;
    let i = g.x % half;
    var h = g.x / half;
    let tok = g.y;
    if (h >= pu(1u) + pu(13u) || tok >= pu(0u)) { return; }
    let in_z = h >= pu(1u);
    var heads = pu(1u);
    if (in_z) {
        h -= pu(1u);
        heads = pu(13u);
    }
    let cs = rope_cs(i, f32(I[pu(5u) + tok]));
    let c = cs.x;
    let s = cs.y;
    let base = tok * heads * pu(2u) + h * pu(2u);
    var i0 = base + 2u * i;
    var i1 = i0 + 1u;
    if (pu(4u) != 0u) {
        i0 = base + i;
        i1 = i0 + half;
    }
    if (in_z) {
        let a = Z[i0];
        let b = Z[i1];
        Z[i0] = a * c - b * s;
        Z[i1] = a * s + b * c;
    } else {
        let a = Y[i0];
        let b = Y[i1];
        Y[i0] = a * c - b * s;
        Y[i1] = a * s + b * c;
    }
}

// The rotation of pair i at position pos (rope's parametrisation, common.wgsl's rope_rotation)
fn rope_cs(i: u32, pos: f32) -> vec2<f32> {
    var factor = 1.0;
    if (pu(12u) != 0u) { factor = B[i]; }
    return rope_rotation(i, pos, pu(3u), pf(6u), pf(7u), pf(8u), pf(9u), pf(10u), pf(11u), factor);
}

// Rope of queries Y and keys Z (rope's params 0-13) and the keys and values A (n, vd) stored into
// the caches H, HV at slots I[param 14 ..] (kv_store's), in one dispatch: a workgroup a head of
// queries, then of keys (x: head, y: token; the head staged in workgroup memory, so that a thread
// rotates and stores whole f16 pairs), then 128 values of v a workgroup. Where the queries' and
// keys' per-head RMS norms came just before (param 16), the head is normed first (times the
// weights in KC for queries, VC for keys, as f32 bits, where params 17, 18 say).
// params: rope's 0-13, 14 slots offset, 15 vd, 16 normed, 17 q weight, 18 k weight, 19 eps
var<workgroup> head_row: array<f32, 256>;
var<workgroup> head_part: array<f32, 64>;

@compute @workgroup_size(64)
fn rope_store(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let tok = wid.y;
    let hd = pu(2u);
    let nq = pu(1u);
    let nk = pu(13u);
    let slot = u32(I[pu(14u) + tok]);
    if (wid.x >= nq + nk) {  // values: a word (two values) a thread, 64 words a workgroup
        let vw = pu(15u) / 2u;
        let w = (wid.x - nq - nk) * 64u + t;
        if (w < vw) {
            let src = tok * pu(15u) + 2u * w;
            HV[slot * vw + w] = pack2x16float(vec2<f32>(A[src], A[src + 1u]));
        }
        return;
    }
    let in_z = wid.x >= nq;
    var at = tok * nq * hd + wid.x * hd;
    if (in_z) { at = tok * nk * hd + (wid.x - nq) * hd; }
    var ss = 0.0;
    for (var e = t; e < hd; e += 64u) {
        var x: f32;
        if (in_z) { x = Z[at + e]; } else { x = Y[at + e]; }
        head_row[e] = x;
        ss += x * x;
    }
    if (pu(16u) != 0u) {  // the head's RMS norm: its sum of squares over the 64 threads
        head_part[t] = ss;
        workgroupBarrier();
        for (var s = 32u; s > 0u; s >>= 1u) {
            if (t < s) { head_part[t] += head_part[t + s]; }
            workgroupBarrier();
        }
        let r = 1.0 / sqrt(head_part[0] / f32(hd) + pf(19u));
        for (var e = t; e < hd; e += 64u) {
            var x = head_row[e] * r;
            if (!in_z && pu(17u) != 0u) { x *= bitcast<f32>(KC[e]); }
            if (in_z && pu(18u) != 0u) { x *= bitcast<f32>(VC[e]); }
            head_row[e] = x;
        }
    }
    workgroupBarrier();
    let pos = f32(I[pu(5u) + tok]);
    let n_rot = pu(3u);
    let half = n_rot / 2u;
    for (var w = t; w < hd / 2u; w += 64u) {
        var out: vec2<f32>;
        for (var u = 0u; u < 2u; u++) {
            let e = 2u * w + u;
            var v = head_row[e];
            if (e < n_rot) {
                var i = e / 2u;
                var first = (e & 1u) == 0u;
                var other = e + 1u;
                if (!first) { other = e - 1u; }
                if (pu(4u) != 0u) {
                    first = e < half;
                    i = e % half;
                    other = e + half;
                    if (!first) { other = e - half; }
                }
                let cs = rope_cs(i, pos);
                if (first) { v = v * cs.x - head_row[other] * cs.y; } else { v = head_row[other] * cs.y + v * cs.x; }
            }
            out[u] = v;
        }
        if (in_z) {
            Z[at + 2u * w] = out.x;
            Z[at + 2u * w + 1u] = out.y;
            H[slot * (nk * hd / 2u) + (at - tok * nk * hd) / 2u + w] = pack2x16float(out);
        } else {
            Y[at + 2u * w] = out.x;
            Y[at + 2u * w + 1u] = out.y;
        }
    }
}

// Keys A (n, kd) and values B (n, vd) rounded to f16 into the caches H (slots, kd/2 words of f16
// pairs) and HV at slots I[off + j]. params: 0 n, 1 kd, 2 off, 3 vd
@compute @workgroup_size(64)
fn kv_store(@builtin(global_invocation_id) g: vec3<u32>) {
    if (g.y >= pu(0u)) { return; }
    let slot = u32(I[pu(2u) + g.y]);
    let kw = pu(1u) / 2u;
    let vw = pu(3u) / 2u;
    if (g.x < kw) {
        let src = g.y * pu(1u) + 2u * g.x;
        H[slot * kw + g.x] = pack2x16float(vec2<f32>(A[src], A[src + 1u]));
    }
    if (g.x < vw) {
        let src = g.y * pu(3u) + 2u * g.x;
        HV[slot * vw + g.x] = pack2x16float(vec2<f32>(B[src], B[src + 1u]));
    }
}

// Page dst = page src of H for each pair (src, dst) at I[off ..]. params: 0 words a page, 1 pairs, 2 off
@compute @workgroup_size(64)
fn copy_pages(@builtin(global_invocation_id) g: vec3<u32>) {
    let words = pu(0u);
    if (g.x >= words || g.y >= pu(1u)) { return; }
    let src = u32(I[pu(2u) + 2u * g.y]);
    let dst = u32(I[pu(2u) + 2u * g.y + 1u]);
    H[dst * words + g.x] = H[src * words + g.x];
}

// Paged causal attention: `attention` a workgroup a (query head, token) row (prompts on GPUs),
// attn_tile a tile of rows a workgroup (every step on CPU adapters), attn_part and attn_merge for
// decode rows on GPUs. `attention`: keys of the token's sequence in tiles of 64 (a thread a key's
// score and its weight), online softmax, a thread 1-4 of the value dimensions.
// A = q (n, n_head * hd_k), Y = out (n, n_head * hd_v), KC/VC caches of f16 pairs.
// params: 0 n_head, 1 n_kv, 2 hd_k, 3 hd_v, 4 max_pages, 5 page_size, 6 window, 7 scale,
// 8 softcap, 9 pos_off, 10 seq_off, 11 table_off
const ATT_MAX_D: u32 = 256u;
var<workgroup> qv: array<f32, 256>;
var<workgroup> score: array<f32, 64>;
var<workgroup> slot_of: array<u32, 64>;

fn key_slot(table: u32, p: u32) -> u32 {
    let ps = pu(5u);
    return u32(I[table + p / ps]) * ps + p % ps;
}

// The staged query's share of a key's score from 4 of its f16-pair words, KC[base + d + i * step]
// (i < 4): their loads in flight together
fn key_words4(base: u32, d: u32, step: u32) -> f32 {
    let k0 = unpack2x16float(KC[base + d]);
    let k1 = unpack2x16float(KC[base + d + step]);
    let k2 = unpack2x16float(KC[base + d + 2u * step]);
    let k3 = unpack2x16float(KC[base + d + 3u * step]);
    let e = 2u * d;
    let f = 2u * step;
    return dot(vec4<f32>(qv[e], qv[e + 1u], qv[e + f], qv[e + f + 1u]), vec4<f32>(k0, k1))
        + dot(vec4<f32>(qv[e + 2u * f], qv[e + 2u * f + 1u], qv[e + 3u * f], qv[e + 3u * f + 1u]), vec4<f32>(k2, k3));
}

fn key_score(slot: u32, kvh: u32) -> f32 {
    let hd = pu(2u);
    let base = slot * (pu(1u) * hd / 2u) + kvh * hd / 2u;
    var s = 0.0;
    var d = 0u;
    for (; d + 4u <= hd / 2u; d += 4u) { s += key_words4(base, d, 1u); }
    for (; d < hd / 2u; d++) {
        let k = unpack2x16float(KC[base + d]);
        s += qv[2u * d] * k.x + qv[2u * d + 1u] * k.y;
    }
    s *= pf(7u);
    if (pf(8u) > 0.0) { s = pf(8u) * tanh_safe(s / pf(8u)); }
    return s;
}

// A query token's position, where its page table starts in I, and the first key it attends
struct AttRow { pos: u32, table: u32, first: u32 }

fn att_row(tok: u32) -> AttRow {
    let pos = u32(I[pu(9u) + tok]);
    var first = 0u;
    if (pu(6u) > 0u && pos + 1u > pu(6u)) { first = pos + 1u - pu(6u); }
    return AttRow(pos, pu(11u) + u32(I[pu(10u) + tok]) * pu(4u), first);
}

fn value_at(slot: u32, kvh: u32, d: u32) -> f32 {
    let hd = pu(3u);
    let w = VC[slot * (pu(1u) * hd / 2u) + kvh * hd / 2u + d / 2u];
    let v = unpack2x16float(w);
    if ((d & 1u) == 0u) { return v.x; }
    return v.y;
}

@compute @workgroup_size(64)
fn attention(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wid.x;
    let tok = wid.y;
    let n_head = pu(0u);
    let hd_k = pu(2u);
    let hd_v = pu(3u);
    let kvh = h / (n_head / pu(1u));
    let row = att_row(tok);
    let pos = row.pos;
    let table = row.table;
    let first = row.first;
    for (var d = t; d < hd_k; d += 64u) { qv[d] = A[(tok * n_head + h) * hd_k + d]; }
    workgroupBarrier();
    var m = -1e30;
    var l = 0.0;
    var acc: array<f32, 4>;
    let n_tiles = (pos - first + 64u) / 64u;
    for (var tile = 0u; tile < n_tiles; tile++) {
        let p = first + tile * 64u + t;
        var s = -1e30;
        if (p <= pos) {
            let slot = key_slot(table, p);
            slot_of[t] = slot;
            s = key_score(slot, kvh);
        }
        score[t] = s;
        workgroupBarrier();
        var top = m;
        for (var j = 0u; j < 64u; j++) { top = max(top, score[j]); }
        workgroupBarrier();
        score[t] = exp(s - top);  // each key's weight, once
        workgroupBarrier();
        let keep = exp(m - top);
        l *= keep;
        for (var a = 0u; a < 4u; a++) { acc[a] *= keep; }
        let n_keys = min(64u, pos + 1u - (first + tile * 64u));
        var j = 0u;
        for (; j + 4u <= n_keys; j += 4u) {  // 4 keys' values in flight
            let w = vec4<f32>(score[j], score[j + 1u], score[j + 2u], score[j + 3u]);
            l += w.x + w.y + w.z + w.w;
            for (var a = 0u; a < 4u; a++) {
                let d = t + 64u * a;
                if (d < hd_v) {
                    acc[a] += dot(w, vec4<f32>(value_at(slot_of[j], kvh, d), value_at(slot_of[j + 1u], kvh, d),
                                               value_at(slot_of[j + 2u], kvh, d), value_at(slot_of[j + 3u], kvh, d)));
                }
            }
        }
        for (; j < n_keys; j++) {
            let w = score[j];
            l += w;
            for (var a = 0u; a < 4u; a++) {
                let d = t + 64u * a;
                if (d < hd_v) { acc[a] += w * value_at(slot_of[j], kvh, d); }
            }
        }
        m = top;
        workgroupBarrier();
    }
    for (var a = 0u; a < 4u; a++) {
        let d = t + 64u * a;
        if (d < hd_v) { Y[(tok * n_head + h) * hd_v + d] = acc[a] / l; }
    }
}

// Paged causal attention a tile of rows a workgroup: tp consecutive tokens x hp query heads that
// share a kv head (at most 8 rows), so that each key and value word loaded serves every row. Keys in
// tiles of 128 (a thread two keys' scores for every row), online softmax per row, a thread the value
// words t and t + 64 of every row. Tokens of different sequences in one tile take turns, a segment of
// the tile's tokens at a time, the other rows' scores masked (a masked key weighs 0).
// params: attention's 0-11, 12 hp, 13 tp, 14 tokens
const AT_ROWS: u32 = 8u;
const AT_KEYS: u32 = 128u;
const AT_MASK: f32 = -1e30;
var<workgroup> at_q: array<vec2<f32>, 1024>;  // row r's word d at r * 128 + d
var<workgroup> at_w: array<f32, 1024>;        // row r's key j at r * 128 + j: scores, then weights
var<workgroup> at_red: array<f32, 64>;
var<workgroup> at_slot: array<u32, 128>;

@compute @workgroup_size(64)
fn attn_tile(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let n_head = pu(0u);
    let kw = pu(2u) / 2u;
    let wv = pu(3u) / 2u;
    let hp = pu(12u);
    let tp = pu(13u);
    let h0 = wid.x * hp;
    let kvh = h0 / (n_head / pu(1u));
    let tok0 = wid.y * tp;
    let nt = min(tp, pu(14u) - tok0);
    let rows = nt * hp;
    for (var i = t; i < rows * kw; i += 64u) {
        let r = i / kw;
        let d = i % kw;
        let src = ((tok0 + r / hp) * n_head + h0 + r % hp) * kw * 2u + 2u * d;
        at_q[r * 128u + d] = vec2<f32>(A[src], A[src + 1u]);
    }
    var pos: array<u32, 8>;
    var first: array<u32, 8>;
    for (var i = 0u; i < AT_ROWS; i++) {
        if (i < nt) {
            let row = att_row(tok0 + i);
            pos[i] = row.pos;
            first[i] = row.first;
        }
    }
    var m: array<f32, 8>;
    var l: array<f32, 8>;
    var acc0: array<vec2<f32>, 8>;
    var acc1: array<vec2<f32>, 8>;
    for (var r = 0u; r < AT_ROWS; r++) {
        m[r] = AT_MASK;
        l[r] = 0.0;
        acc0[r] = vec2<f32>(0.0);
        acc1[r] = vec2<f32>(0.0);
    }
    workgroupBarrier();
    let scale = pf(7u);
    let cap = pf(8u);
    var s0 = 0u;
    loop {
        if (s0 >= nt) { break; }
        // the segment: the tokens s0 .. s1 - 1 of one sequence, its keys lo ..= hi
        let seq = I[pu(10u) + tok0 + s0];
        var s1 = s0 + 1u;
        var lo = first[s0];
        var hi = pos[s0];
        for (; s1 < nt; s1++) {
            if (I[pu(10u) + tok0 + s1] != seq) { break; }
            lo = min(lo, first[s1]);
            hi = max(hi, pos[s1]);
        }
        let table = pu(11u) + u32(seq) * pu(4u);
        let r0 = s0 * hp;
        let r1 = s1 * hp;
        for (var base = lo; base <= hi; base += AT_KEYS) {
            var sc: array<vec2<f32>, 8>;  // rows' scores of the thread's keys base + t, base + t + 64
            for (var r = 0u; r < AT_ROWS; r++) { sc[r] = vec2<f32>(0.0); }
            let pa = base + t;
            let pb = pa + 64u;
            var sa = 0u;
            var sb = 0u;
            if (pa <= hi) { sa = key_slot(table, pa); }
            if (pb <= hi) { sb = key_slot(table, pb); }
            at_slot[t] = sa;
            at_slot[t + 64u] = sb;
            let ka = sa * (pu(1u) * kw) + kvh * kw;
            let kb = sb * (pu(1u) * kw) + kvh * kw;
            for (var d = 0u; d < kw; d++) {
                let xa = unpack2x16float(KC[ka + d]);
                let xb = unpack2x16float(KC[kb + d]);
                for (var r = 0u; r < AT_ROWS; r++) {
                    if (r < rows) {
                        let q = at_q[r * 128u + d];
                        sc[r] += vec2<f32>(dot(q, xa), dot(q, xb));
                    }
                }
            }
            for (var r = 0u; r < AT_ROWS; r++) {
                if (r < rows) {
                    let i = r / hp;
                    var v = sc[r] * scale;
                    if (cap > 0.0) { v = cap * vec2<f32>(tanh_safe(v.x / cap), tanh_safe(v.y / cap)); }
                    let live = r >= r0 && r < r1;
                    if (!live || pa > pos[i] || pa < first[i]) { v.x = AT_MASK; }
                    if (!live || pb > pos[i] || pb < first[i]) { v.y = AT_MASK; }
                    at_w[r * 128u + t] = v.x;
                    at_w[r * 128u + t + 64u] = v.y;
                }
            }
            workgroupBarrier();
            {  // each row's max over the tile: 8 threads a row, 16 keys each
                let r = t / 8u;
                var top = AT_MASK;
                if (r < rows) {
                    let j0 = (t % 8u) * 16u;
                    for (var j = j0; j < j0 + 16u; j++) { top = max(top, at_w[r * 128u + j]); }
                }
                at_red[t] = top;
            }
            workgroupBarrier();
            var tops: array<f32, 8>;
            for (var r = 0u; r < AT_ROWS; r++) {
                var top = m[r];
                if (r < rows) {
                    for (var j = 0u; j < 8u; j++) { top = max(top, at_red[r * 8u + j]); }
                }
                tops[r] = top;
            }
            for (var r = 0u; r < AT_ROWS; r++) {  // the thread's two keys' weights, once
                if (r < rows) {
                    let va = at_w[r * 128u + t];
                    let vb = at_w[r * 128u + t + 64u];
                    at_w[r * 128u + t] = select(exp(va - tops[r]), 0.0, va <= AT_MASK);
                    at_w[r * 128u + t + 64u] = select(exp(vb - tops[r]), 0.0, vb <= AT_MASK);
                }
            }
            workgroupBarrier();
            for (var r = 0u; r < AT_ROWS; r++) {
                let keep = exp(m[r] - tops[r]);
                l[r] *= keep;
                acc0[r] *= keep;
                acc1[r] *= keep;
                m[r] = tops[r];
            }
            let n_keys = min(AT_KEYS, hi + 1u - base);
            for (var j = 0u; j < n_keys; j++) {
                let slot = at_slot[j] * (pu(1u) * wv) + kvh * wv;
                var v0 = vec2<f32>(0.0);
                var v1 = vec2<f32>(0.0);
                if (t < wv) { v0 = unpack2x16float(VC[slot + t]); }
                if (t + 64u < wv) { v1 = unpack2x16float(VC[slot + t + 64u]); }
                for (var r = 0u; r < AT_ROWS; r++) {
                    if (r < rows) {
                        let w = at_w[r * 128u + j];
                        l[r] += w;
                        acc0[r] += w * v0;
                        acc1[r] += w * v1;
                    }
                }
            }
            workgroupBarrier();
        }
        s0 = s1;
    }
    for (var r = 0u; r < AT_ROWS; r++) {
        if (r < rows) {
            let dst = ((tok0 + r / hp) * n_head + h0 + r % hp) * wv * 2u;
            if (t < wv) {
                Y[dst + 2u * t] = acc0[r].x / l[r];
                Y[dst + 2u * t + 1u] = acc0[r].y / l[r];
            }
            if (t + 64u < wv) {
                Y[dst + 2u * t + 128u] = acc1[r].x / l[r];
                Y[dst + 2u * t + 129u] = acc1[r].y / l[r];
            }
        }
    }
}

// Decode attention split over the keys (flash-decoding): a workgroup a (query head, token, chunk
// of the keys from the window's first), passes of 32 keys with 4 lanes a key's score (so that a
// lane's loads are few), then the value words a lane each, groups of lanes taking every G-th key;
// the chunk's max score, sum of weights and weighted values into Z (rows of hd_v + 2, a row a
// (token, head, chunk); a chunk past the token's position writes nothing). attn_merge then combines a
// (token, head)'s chunks into Y. A decode step reads as many chunks as it has; the chunks cover
// the page table's reach, so that a recorded step serves every position.
// params: attention's 0-11, 12 keys a chunk (a multiple of 32), 13 chunks
const AP_WG: u32 = 128u;
var<workgroup> ap_part: array<f32, 128>;
var<workgroup> ap_acc: array<vec2<f32>, 128>;

@compute @workgroup_size(128)
fn attn_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wid.x;
    let tok = wid.y;
    let chunk = wid.z;
    let n_head = pu(0u);
    let hd_k = pu(2u);
    let hd_v = pu(3u);
    let kvh = h / (n_head / pu(1u));
    let row = att_row(tok);
    let pos = row.pos;
    let table = row.table;
    let first = row.first;
    let lo = first + chunk * pu(12u);
    let hi = min(pos + 1u, lo + pu(12u));
    let out = ((tok * n_head + h) * pu(13u) + chunk) * (hd_v + 2u);
    if (lo > pos) { return; }  // no keys: attn_merge reads only the chunks that hold some
    for (var d = t; d < hd_k; d += AP_WG) { qv[d] = A[(tok * n_head + h) * hd_k + d]; }
    let wv = hd_v / 2u;  // value words a key
    let word = t % wv;
    let group = t / wv;
    let groups = AP_WG / wv;
    let kw = hd_k / 2u;
    let kbase = kvh * kw;
    let lane = t & 3u;
    let key = t >> 2u;
    workgroupBarrier();
    var m = -1e30;
    var l = 0.0;
    var acc = vec2<f32>(0.0, 0.0);
    for (var tile = lo; tile < hi; tile += 32u) {
        let p = tile + key;
        var s = 0.0;
        var slot = 0u;
        if (p < hi) {
            slot = key_slot(table, p);
            let base = slot * (pu(1u) * kw) + kbase;
            var d = lane;
            for (; d + 12u < kw; d += 16u) { s += key_words4(base, d, 4u); }  // a long head: 32 words a lane
            for (; d < kw; d += 4u) {
                let kk = unpack2x16float(KC[base + d]);
                s += qv[2u * d] * kk.x + qv[2u * d + 1u] * kk.y;
            }
        }
        ap_part[t] = s;
        workgroupBarrier();
        if (lane == 0u) {
            var sc = -1e30;
            if (p < hi) {
                sc = (ap_part[t] + ap_part[t + 1u] + ap_part[t + 2u] + ap_part[t + 3u]) * pf(7u);
                if (pf(8u) > 0.0) { sc = pf(8u) * tanh_safe(sc / pf(8u)); }
            }
            score[key] = sc;
            slot_of[key] = slot;
        }
        workgroupBarrier();
        var top = m;
        for (var j = 0u; j < 32u; j++) { top = max(top, score[j]); }
        workgroupBarrier();
        if (t < 32u) { score[t] = exp(score[t] - top); }  // each key's weight, once (0 past the range)
        workgroupBarrier();
        let keep = exp(m - top);
        l *= keep;
        acc *= keep;
        let n_keys = min(32u, hi - tile);
        if (group < groups) {
            let vs = pu(1u) * wv;  // words a cache slot
            let vw = kvh * wv + word;
            var j = group;
            for (; j + 3u * groups < n_keys; j += 4u * groups) {  // 4 keys' loads in flight
                let v0 = unpack2x16float(VC[slot_of[j] * vs + vw]);
                let v1 = unpack2x16float(VC[slot_of[j + groups] * vs + vw]);
                let v2 = unpack2x16float(VC[slot_of[j + 2u * groups] * vs + vw]);
                let v3 = unpack2x16float(VC[slot_of[j + 3u * groups] * vs + vw]);
                acc += score[j] * v0 + score[j + groups] * v1 + score[j + 2u * groups] * v2 + score[j + 3u * groups] * v3;
            }
            for (; j < n_keys; j += groups) {
                acc += score[j] * unpack2x16float(VC[slot_of[j] * vs + vw]);
            }
        }
        if (t == 0u) {
            for (var j = 0u; j < n_keys; j++) { l += score[j]; }
        }
        m = top;
        workgroupBarrier();
    }
    ap_acc[t] = acc;
    workgroupBarrier();
    if (group == 0u) {
        var sum = acc;
        for (var g = 1u; g < groups; g++) { sum += ap_acc[g * wv + word]; }
        Z[out + 2u + 2u * word] = sum.x;
        Z[out + 3u + 2u * word] = sum.y;
    }
    if (t == 0u) { Z[out] = m; Z[out + 1u] = l; }
}

// attn_part's chunks of a (token, head) combined: Y = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,
// a workgroup a (head, token), over the chunks that hold keys of the token's range (the others are
// empty): a thread a chunk's max, then its weight e^(m_c - M) once, then a thread a value dimension.
// params: attention's 0-11, 12 keys a chunk, 13 chunks (at most 64, the workgroup's threads), 14 the
// output's int8 blocks into H too, 15 their S (put_q8)
var<workgroup> am_w: array<f32, 64>;

@compute @workgroup_size(64)
fn attn_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let h = wid.x;
    let tok = wid.y;
    let n_head = pu(0u);
    let hd_v = pu(3u);
    let a = att_row(tok);
    let busy = min((a.pos - a.first) / pu(12u) + 1u, pu(13u));
    let row = (tok * n_head + h) * pu(13u);
    if (t < busy) { am_w[t] = Z[(row + t) * (hd_v + 2u)]; }
    workgroupBarrier();
    var top = -1e30;
    for (var c = 0u; c < busy; c++) { top = max(top, am_w[c]); }
    workgroupBarrier();
    if (t < busy) { am_w[t] = exp(am_w[t] - top); }
    workgroupBarrier();
    var l = 0.0;
    for (var c = 0u; c < busy; c++) { l += am_w[c] * Z[(row + c) * (hd_v + 2u) + 1u]; }
    let o = (tok * n_head + h) * hd_v;
    if (pu(14u) == 0u) {
        for (var d = t; d < hd_v; d += 64u) {
            var v = 0.0;
            for (var c = 0u; c < busy; c++) { v += am_w[c] * Z[(row + c) * (hd_v + 2u) + 2u + d]; }
            Y[o + d] = v / l;
        }
        return;
    }
    // and the int8 blocks of the output for the next product (hd_v a multiple of 32): 4 values a thread
    for (var d0 = 0u; d0 < hd_v; d0 += 256u) {
        let d = d0 + 4u * t;
        let live = d < hd_v;
        var v = vec4<f32>(0.0);
        if (live) {
            for (var c = 0u; c < busy; c++) {
                let at = (row + c) * (hd_v + 2u) + 2u + d;
                v += am_w[c] * vec4<f32>(Z[at], Z[at + 1u], Z[at + 2u], Z[at + 3u]);
            }
            v /= l;
            Y[o + d] = v.x;
            Y[o + d + 1u] = v.y;
            Y[o + d + 2u] = v.z;
            Y[o + d + 3u] = v.w;
        }
        put_q8(t, v, (o + d) / 32u, live, pu(15u));
    }
}

// Each row of A (n, vocab) reduced to its k best, best first (lowest id among equal values):
// k rounds of a workgroup's arg-max over the values ranked below the round before's. One
// workgroup a row, or two dispatches for long rows: a workgroup a chunk of a row (x: chunk)
// leaving the chunk's k best, then a workgroup a row over those candidates (their ids in I).
// Y values, OI ids: (n, k) out, or (n, chunks * k) candidates (id -1 past a short chunk's end).
// params: 0 values a row, 1 k, 2 chunk (values a stage-1 workgroup; 0: all), 3 candidates (ids in I)
var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;
const NONE: u32 = 0xffffffffu;

fn ranks_above(v: f32, i: u32, w: f32, j: u32) -> bool { return j == NONE || v > w || (v == w && i < j); }

@compute @workgroup_size(256)
fn top_k(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let vocab = pu(0u);
    let k = pu(1u);
    let row = wid.y;
    var lo = 0u;
    var hi = vocab;
    var out = row * k;  // where this workgroup's k results go
    if (pu(2u) != 0u) {
        lo = wid.x * pu(2u);
        hi = min(vocab, lo + pu(2u));
        out = (row * (vocab + pu(2u) - 1u) / pu(2u) + wid.x) * k;
    }
    let from_ids = pu(3u) != 0u;
    var prev_v = 0.0;
    var prev_i = NONE;
    for (var r = 0u; r < k; r++) {
        var bv = 0.0;
        var bi = NONE;
        for (var i = lo + t; i < hi; i += WG) {
            let v = A[row * vocab + i];
            var id = i;
            if (from_ids) { id = u32(I[row * vocab + i]); }
            if (id != NONE && (r == 0u || (prev_i != NONE && ranks_above(prev_v, prev_i, v, id))) && ranks_above(v, id, bv, bi)) {
                bv = v;
                bi = id;
            }
        }
        best_v[t] = bv;
        best_i[t] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (t < s && best_i[t + s] != NONE && ranks_above(best_v[t + s], best_i[t + s], best_v[t], best_i[t])) {
                best_v[t] = best_v[t + s];
                best_i[t] = best_i[t + s];
            }
            workgroupBarrier();
        }
        prev_v = best_v[0];
        prev_i = best_i[0];
        if (t == 0u) {
            Y[out + r] = prev_v;
            OI[out + r] = i32(prev_i);
        }
        workgroupBarrier();
    }
}

// The token ids of a decode step queued before the host read the step before it, chosen on the
// device: OI (the step's host ints, bound writable here) holds the n ids at word ids_off, where
// -r - 1 names the first of row r of I (that step's best ids, k a row, best first) that the
// token's row of bans (k ids at bans_off + j * k, -1 for none) lacks; -1 where every one is banned.
// The ids are rewritten in place, where the embedding lookup reads them next.
// params: 0 n, 1 k, 2 ids_off, 3 bans_off, 4 rows of I
@compute @workgroup_size(64)
fn chain_ids(@builtin(global_invocation_id) g: vec3<u32>) {
    let j = g.x;
    let k = pu(1u);
    if (j >= pu(0u)) { return; }
    let id = OI[pu(2u) + j];
    if (id >= 0) { return; }
    let r = u32(-id - 1);
    var got = -1;
    if (r < pu(4u)) {
        let ban = pu(3u) + j * k;
        for (var c = 0u; c < k && got < 0; c++) {
            let best = I[r * k + c];
            var banned = false;
            for (var b = 0u; b < k; b++) { banned = banned || OI[ban + b] == best; }
            if (!banned) { got = best; }
        }
    }
    OI[pu(2u) + j] = got;
}

// Activations for the integer decode products (mvq): each 32-value block of X (A: n rows of k)
// as 32 int8 (rounded to d = max|x| / 127) in 8 words of H, its scale and the scaled sums of its
// two halves (d * sum q) at word S + 4 (row * k/32 + block) as (d, s0, s1, 0). A workgroup 32
// blocks, 8 threads a block (a word each), so the loads and stores are coalesced.
// params: 0 k, 1 n, 2 S (words)
@compute @workgroup_size(256)
fn quant_q8(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) t: u32) {
    let blk = flat_group(wid, nwg) * (WG / 8u) + t / 8u;
    let live = blk < pu(1u) * (pu(0u) / 32u);
    var x = vec4<f32>(0.0);
    if (live) {
        let c = 32u * blk + 4u * (t & 7u);
        x = vec4<f32>(A[c], A[c + 1u], A[c + 2u], A[c + 3u]);
    }
    put_q8(t, x, blk, live, pu(2u));
}

// The norms' last pass with int8 blocks for the next product: row `row` of Y (d values) times r (and
// the norm's weight: 1 A, 2 B, 0 none) into Z, each 32-value block of it also through put_q8 (block
// row * d/32 + b, scales from word s). Every thread of the workgroup calls it (put_q8's barriers).
fn normed_q8(t: u32, row: u32, d: u32, r: f32, weight: u32, s: u32) {
    let nb = d / 32u;
    for (var b0 = 0u; b0 < nb; b0 += WG / 8u) {
        let b = b0 + t / 8u;
        let live = b < nb;
        var x = vec4<f32>(0.0);
        if (live) {
            let c = 32u * b + 4u * (t & 7u);
            x = vec4<f32>(Y[row * d + c], Y[row * d + c + 1u], Y[row * d + c + 2u], Y[row * d + c + 3u]) * r;
            if (weight == 1u) {
                x *= vec4<f32>(A[c], A[c + 1u], A[c + 2u], A[c + 3u]);
            } else if (weight == 2u) {
                x *= vec4<f32>(B[c], B[c + 1u], B[c + 2u], B[c + 3u]);
            }
            Z[row * d + c] = x.x;
            Z[row * d + c + 1u] = x.y;
            Z[row * d + c + 2u] = x.z;
            Z[row * d + c + 3u] = x.w;
        }
        put_q8(t, x, row * nb + b, live, s);
    }
}

// Block blk of the int8 activations (quant_q8's layout, scales from word s), made by its 8 threads:
// thread t holds the block's word t % 8 (4 values x) and the threads t - t % 8 .. + 7 the rest.
// Every thread of the workgroup calls it (barriers); only live threads store.
fn put_q8(t: u32, x: vec4<f32>, blk: u32, live: bool, s: u32) {
    let g = t & ~7u;
    let a = abs(x);
    part[t] = max(max(a.x, a.y), max(a.z, a.w));
    workgroupBarrier();
    var m = 0.0;
    for (var i = 0u; i < 8u; i++) { m = max(m, part[g + i]); }
    workgroupBarrier();
    let d = m / 127.0;
    let inv = select(0.0, 1.0 / d, m > 0.0);
    let q = vec4<i32>(round(x * inv));
    if (live) { H[8u * blk + (t & 7u)] = pack4xI8(q); }
    part[t] = f32(q.x + q.y + q.z + q.w);  // exact: at most 4 * 127
    workgroupBarrier();
    if (live && (t & 7u) == 0u) {
        let o = s + 4u * blk;
        H[o] = bitcast<u32>(d);
        H[o + 1u] = bitcast<u32>(d * (part[g] + part[g + 1u] + part[g + 2u] + part[g + 3u]));
        H[o + 2u] = bitcast<u32>(d * (part[g + 4u] + part[g + 5u] + part[g + 6u] + part[g + 7u]));
        H[o + 3u] = 0u;
    }
    workgroupBarrier();
}
