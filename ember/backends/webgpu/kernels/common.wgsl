// Shared by every module: the op's parameters (32 words, one 256-byte slot of the step's uniform
// buffer) read as u32, f32 or i32 by index.
struct Params { v: array<vec4<u32>, 8> }
@group(0) @binding(0) var<uniform> P: Params;

fn pu(i: u32) -> u32 { return P.v[i >> 2u][i & 3u]; }
fn pf(i: u32) -> f32 { return bitcast<f32>(pu(i)); }
fn pi(i: u32) -> i32 { return bitcast<i32>(pu(i)); }

// A flat workgroup index of a dispatch folded into two dimensions (at most 65535 per dimension).
fn flat_group(wid: vec3<u32>, nwg: vec3<u32>) -> u32 { return wid.y * nwg.x + wid.x; }

// Rope's rotation of pair i (of n_rot / 2) at position pos: (cos, sin) times the magnitude mscale,
// ggml's parametrisation with YaRN (ext the extrapolation mix, low and high its ramp's bounds from
// the host) and the pair's frequency factor (1 where the model has none). Shared by ops.wgsl's
// rope kernels and the decode products that rotate their outputs (matvec_kv.wgsl).
fn rope_rotation(i: u32, pos: f32, n_rot: u32, base: f32, scale: f32, ext: f32, mscale: f32, low: f32,
                 high: f32, factor: f32) -> vec2<f32> {
    let extrap = pos * pow(base, -2.0 * f32(i) / f32(n_rot)) / factor;
    let interp = scale * extrap;
    var theta = interp;
    if (ext != 0.0) {
        let ramp = 1.0 - clamp((f32(i) - low) / max(0.001, high - low), 0.0, 1.0);
        let mix = ramp * ext;
        theta = interp * (1.0 - mix) + extrap * mix;
    }
    return vec2<f32>(cos(theta), sin(theta)) * mscale;
}
