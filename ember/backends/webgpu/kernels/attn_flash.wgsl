// Prompt attention on GPUs (attn_flash; ops.wgsl's bindings and helpers): a workgroup takes a tile
// of query rows, up to FL_ROWS of them (the tokens tok0 .. tok0 + tp - 1 times the g query heads of
// kv head wid.x; row r: token r / g, head r % g), against its sequence's keys in tiles of FL_KEYS:
// the tile's scores (a thread 2 rows by 4 keys, q and k staged FL_KD dimensions at a time), each
// row's online softmax, then the weighted values (a thread the same 2 rows by FL_VC vec4s of value
// dimensions, v staged 64 dimensions at a time). A thread's rows are r and r + 16 (r = t / 16) in
// both halves, so the 16 threads of a row are a half warp and each keeps its rows' running max and
// sum. 26 KiB of workgroup memory. Tokens of several sequences in one tile take turns (segments, as in
// attn_tile), the rows of the others masked. FL_VC, a constant of the module: hd_v / 64 rounded up.
// Where the grid of tiles is small, each row's keys are split into chunks (wid.z: chunk c holds keys
// first + c * chunk ..) and a chunk's unnormalised sums, max and sum go to Z as attn_part's do, for
// attn_merge to combine.
// A tile's tokens (tok0 and its count; none: an idle workgroup) come from the host's tile list in I
// (param 16; Backend._attn_flash): a sequence's tokens cut into tiles of tp, so that a tile holds one
// sequence's rows (a step of prompts and decode rows: a decode row a tile, not tp of them taking
// turns over each one's keys).
// params: attention's (0-11), 12 tokens a tile, 13 the step's tokens, 14 keys a chunk (0: no
// chunks, the rows' outputs into Y), 15 chunks, 16 the tile list's offset in I
const FL_ROWS: u32 = 32u;
const FL_KEYS: u32 = 64u;
const FL_KD: u32 = 32u;  // q and k dimensions staged at a time
const FL_KS: u32 = 9u;  // vec4s a staged q or k row (8, and one more to spread the banks)
const FL_PS: u32 = 68u;  // floats a row of fl_p
const FL_MASK: f32 = -1e30;
// the scores' stage: q rows at 0, k rows at FL_ROWS * FL_KS; the sums' stage: v rows of 16 vec4s
var<workgroup> fl_st: array<vec4<f32>, 1024>;
var<workgroup> fl_p: array<f32, 2176>;  // FL_ROWS rows of FL_PS: the tile's scores, then their weights
var<workgroup> fl_red: array<f32, 256>;  // each row's maxima over 8 of its keys (every 8th)
var<workgroup> fl_pos: array<u32, 32>;  // each row's position and first key (rows past the tile: first > pos)
var<workgroup> fl_first: array<u32, 32>;

// Scores s of rows r (component b: key base + tk + 16 b) scaled, soft-capped and masked (rows
// outside the segment's r0 .. r1 - 1, keys outside a row's window); written to fl_p
fn fl_scores(s: vec4<f32>, r: u32, base: u32, tk: u32, r0: u32, r1: u32) -> vec4<f32> {
    var v = s * pf(7u);
    let cap = pf(8u);
    if (cap > 0.0) {
        v = cap * vec4<f32>(tanh_safe(v.x / cap), tanh_safe(v.y / cap), tanh_safe(v.z / cap), tanh_safe(v.w / cap));
    }
    let live = r >= r0 && r < r1;
    for (var b = 0u; b < 4u; b++) {
        let p = base + tk + 16u * b;
        if (!live || p > fl_pos[r] || p < fl_first[r]) { v[b] = FL_MASK; }
        fl_p[r * FL_PS + tk + 16u * b] = v[b];
    }
    return v;
}

// Row r's 4 weights from its masked scores v and max top, written over the scores
fn fl_weights(v: vec4<f32>, top: f32, r: u32, tk: u32) -> vec4<f32> {
    var w = vec4<f32>(0.0);
    for (var b = 0u; b < 4u; b++) {
        if (v[b] > FL_MASK) { w[b] = exp(v[b] - top); }
        fl_p[r * FL_PS + tk + 16u * b] = w[b];
    }
    return w;
}

// The max of row r's scores in fl_red and m (its running max)
fn fl_top(r: u32, m: f32) -> f32 {
    var top = m;
    for (var i = 8u * r; i < 8u * r + 8u; i++) { top = max(top, fl_red[i]); }
    return top;
}

// 4 values of a head of hd values at dimension d from its f16 pairs at word w of KC or VC (0 past
// the head's end)
fn fl_k4(w: u32, d: u32, hd: u32) -> vec4<f32> {
    var a = vec2<f32>(0.0);
    var b = vec2<f32>(0.0);
    if (d + 1u < hd) { a = unpack2x16float(KC[w]); }
    if (d + 3u < hd) { b = unpack2x16float(KC[w + 1u]); }
    return vec4<f32>(a, b);
}

fn fl_v4(w: u32, d: u32, hd: u32) -> vec4<f32> {
    var a = vec2<f32>(0.0);
    var b = vec2<f32>(0.0);
    if (d + 1u < hd) { a = unpack2x16float(VC[w]); }
    if (d + 3u < hd) { b = unpack2x16float(VC[w + 1u]); }
    return vec4<f32>(a, b);
}

// A row's keys in chunk c (first + c * chunk .. first + (c + 1) * chunk - 1, up to its position; none:
// first > pos), or all of them (chunk 0)
fn fl_chunk(row: AttRow, chunk: u32, c: u32) -> AttRow {
    if (chunk == 0u) { return row; }
    let first = row.first + c * chunk;
    return AttRow(min(row.pos, first + chunk - 1u), row.table, first);
}

@compute @workgroup_size(256)
fn attn_flash(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let n_head = pu(0u);
    let n_kv = pu(1u);
    let hd_k = pu(2u);
    let hd_v = pu(3u);
    let g = n_head / n_kv;
    let kvh = wid.x;
    let tile = pu(16u) + 2u * wid.y;  // the tile's first token and its tokens, of one sequence where it can
    let tok0 = u32(I[tile]);
    let nt = u32(I[tile + 1u]);
    let rows = nt * g;
    let chunk = pu(14u);
    if (t < FL_ROWS) {
        var pos = 0u;
        var first = 1u;
        if (t < rows) {
            let row = fl_chunk(att_row(tok0 + t / g), chunk, wid.z);
            pos = row.pos;
            first = row.first;
        }
        fl_pos[t] = pos;
        fl_first[t] = first;
    }
    workgroupBarrier();
    let tr = t / 16u;  // rows tr + 16 a (component a of m, l; o[a * FL_VC + c])
    let tk = t % 16u;  // keys tk + 16 b in the scores, value vec4 tk of each 64 dimensions in the sums
    var m = vec2<f32>(FL_MASK);
    var l = vec2<f32>(0.0);
    var o: array<vec4<f32>, 2 * FL_VC>;
    for (var i = 0u; i < 2u * FL_VC; i++) { o[i] = vec4<f32>(0.0); }
    let kslot = n_kv * hd_k / 2u;  // words a cache slot
    let vslot = n_kv * hd_v / 2u;
    var s0 = 0u;
    loop {
        if (s0 >= nt) { break; }
        // the segment: tokens s0 .. s1 - 1 of one sequence (rows r0 .. r1 - 1), its keys lo ..= hi
        let seq = I[pu(10u) + tok0 + s0];
        var s1 = s0 + 1u;
        // (from the step's ints, not fl_pos: uniform for the barriers; a chunk's rows with no keys in it: lo > hi)
        var lo = 0xffffffffu;
        var hi = 0u;
        for (var s = s0; s < nt; s++) {
            if (I[pu(10u) + tok0 + s] != seq) { break; }
            s1 = s + 1u;
            let row = fl_chunk(att_row(tok0 + s), chunk, wid.z);
            if (row.first <= row.pos) {
                lo = min(lo, row.first);
                hi = max(hi, row.pos);
            }
        }
        let table = pu(11u) + u32(seq) * pu(4u);
        let r0 = s0 * g;
        let r1 = s1 * g;
        for (var base = lo; base <= hi && lo <= hi; base += FL_KEYS) {
            var sc0 = vec4<f32>(0.0);  // row tr + 16 a's scores in sc_a
            var sc1 = vec4<f32>(0.0);
            for (var d0 = 0u; d0 < hd_k; d0 += FL_KD) {
                for (var i = t; i < (FL_ROWS + FL_KEYS) * 8u; i += 256u) {  // 8 vec4s of each q row, then of each key
                    let v = i % 8u;
                    let d = d0 + 4u * v;
                    if (i < FL_ROWS * 8u) {
                        let r = i / 8u;
                        var q = vec4<f32>(0.0);
                        if (r < rows) {
                            let src = ((tok0 + r / g) * n_head + kvh * g + r % g) * hd_k + d;
                            if (d + 1u < hd_k) { q.x = A[src]; q.y = A[src + 1u]; }
                            if (d + 3u < hd_k) { q.z = A[src + 2u]; q.w = A[src + 3u]; }
                        }
                        fl_st[r * FL_KS + v] = q;
                    } else {
                        let j = i / 8u - FL_ROWS;
                        let slot = key_slot(table, min(base + j, hi));
                        fl_st[(FL_ROWS + j) * FL_KS + v] = fl_k4(slot * kslot + kvh * hd_k / 2u + d / 2u, d, hd_k);
                    }
                }
                workgroupBarrier();
                for (var v = 0u; v < 8u; v++) {
                    let k0 = fl_st[(FL_ROWS + tk) * FL_KS + v];
                    let k1 = fl_st[(FL_ROWS + tk + 16u) * FL_KS + v];
                    let k2 = fl_st[(FL_ROWS + tk + 32u) * FL_KS + v];
                    let k3 = fl_st[(FL_ROWS + tk + 48u) * FL_KS + v];
                    let q0 = fl_st[tr * FL_KS + v];
                    let q1 = fl_st[(tr + 16u) * FL_KS + v];
                    sc0 += vec4<f32>(dot(q0, k0), dot(q0, k1), dot(q0, k2), dot(q0, k3));
                    sc1 += vec4<f32>(dot(q1, k0), dot(q1, k1), dot(q1, k2), dot(q1, k3));
                }
                workgroupBarrier();
            }
            sc0 = fl_scores(sc0, tr, base, tk, r0, r1);
            sc1 = fl_scores(sc1, tr + 16u, base, tk, r0, r1);
            workgroupBarrier();
            {  // each row's max over 8 of its keys (every 8th)
                let r = t / 8u;
                var top = FL_MASK;
                for (var j = t % 8u; j < FL_KEYS; j += 8u) { top = max(top, fl_p[r * FL_PS + j]); }
                fl_red[t] = top;
            }
            workgroupBarrier();
            let top = vec2<f32>(fl_top(tr, m.x), fl_top(tr + 16u, m.y));
            fl_weights(sc0, top.x, tr, tk);
            fl_weights(sc1, top.y, tr + 16u, tk);
            let keep = exp(m - top);  // 1 while a row has seen no key (both the mask)
            m = top;
            l *= keep;
            for (var c = 0u; c < FL_VC; c++) {
                o[c] *= keep.x;
                o[FL_VC + c] *= keep.y;
            }
            let n_keys = min(FL_KEYS, hi + 1u - base);
            for (var c = 0u; c < FL_VC; c++) {
                workgroupBarrier();  // the weights written; the last stage read
                for (var i = t; i < FL_KEYS * 16u; i += 256u) {  // 16 vec4s of each key's values
                    let j = i / 16u;
                    let d = 64u * c + 4u * (i % 16u);
                    let slot = key_slot(table, min(base + j, hi));
                    fl_st[i] = fl_v4(slot * vslot + kvh * hd_v / 2u + d / 2u, d, hd_v);
                }
                workgroupBarrier();
                var a0 = o[c];
                var a1 = o[FL_VC + c];
                var sum = vec2<f32>(0.0);
                for (var j = 0u; j < n_keys; j++) {
                    let w = vec2<f32>(fl_p[tr * FL_PS + j], fl_p[(tr + 16u) * FL_PS + j]);
                    let v = fl_st[j * 16u + tk];
                    sum += w;
                    a0 += w.x * v;
                    a1 += w.y * v;
                }
                o[c] = a0;
                o[FL_VC + c] = a1;
                if (c == 0u) { l += sum; }
            }
            workgroupBarrier();  // the values read before the next tile stages its scores
        }
        s0 = s1;
    }
    for (var a = 0u; a < 2u; a++) {
        let r = tr + 16u * a;
        let at = (tok0 + r / g) * n_head + kvh * g + r % g;  // the row's (token, head)
        if (chunk > 0u) {  // a chunk's partial softmax (attn_part's layout), where the row has keys in it
            if (r < rows && fl_first[r] <= fl_pos[r]) {
                let out = (at * pu(15u) + wid.z) * (hd_v + 2u);
                if (tk == 0u) {
                    Z[out] = m[a];
                    Z[out + 1u] = l[a];
                }
                for (var c = 0u; c < FL_VC; c++) {
                    let d = 64u * c + 4u * tk;
                    let v = o[a * FL_VC + c];
                    for (var e = 0u; e < 4u; e++) {
                        if (d + e < hd_v) { Z[out + 2u + d + e] = v[e]; }
                    }
                }
            }
            continue;
        }
        if (r < rows) {
            let dst = at * hd_v;
            for (var c = 0u; c < FL_VC; c++) {
                let d = 64u * c + 4u * tk;
                let v = o[a * FL_VC + c] / l[a];
                for (var e = 0u; e < 4u; e++) {
                    if (d + e < hd_v) { Y[dst + d + e] = v[e]; }
                }
            }
        }
    }
}
