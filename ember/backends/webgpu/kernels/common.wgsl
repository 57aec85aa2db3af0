// Shared by every module: the op's parameters (32 words, one 256-byte slot of the step's uniform
// buffer) read as u32, f32 or i32 by index.
struct Params { v: array<vec4<u32>, 8> }
@group(0) @binding(0) var<uniform> P: Params;

fn pu(i: u32) -> u32 { return P.v[i >> 2u][i & 3u]; }
fn pf(i: u32) -> f32 { return bitcast<f32>(pu(i)); }
fn pi(i: u32) -> i32 { return bitcast<i32>(pu(i)); }

// A flat workgroup index of a dispatch folded into two dimensions (at most 65535 per dimension).
fn flat_group(wid: vec3<u32>, nwg: vec3<u32>) -> u32 { return wid.y * nwg.x + wid.x; }
