// x[t] += scale * rmsnorm(y[t]) * g, one workgroup a token (Gemma's norms after attention
// and after the MLP).
struct Params {
    cols: u32,
    eps: f32,
    scale: f32,
    _pad0: u32,
    _pad: array<vec4<u32>, 3>,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read> gamma: array<f32>;

const WG: u32 = 64u;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.y;
    if (t >= n_tokens()) {
        return;
    }
    let base = t * p.cols;
    var ss = 0.0;
    for (var c = li; c < p.cols; c += WG) {
        ss += src[base + c] * src[base + c];
    }
    red[li] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let inv = inverseSqrt(red[0] / f32(p.cols) + p.eps);
    for (var c = li; c < p.cols; c += WG) {
        x[base + c] += p.scale * (src[base + c] * inv * gamma[c]);
    }
}
