// x[t] = scale * W[token t], for the tokens whose id falls in this part's rows.
struct Params {
    rows: u32,
    cols: u32,
    row0: u32,
    scale: f32,
    _pad: array<vec4<u32>, 3>,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.cols / 4u || t >= n_tokens()) {
        return;
    }
    let id = token_id(t);
    if (id < p.row0 || id >= p.row0 + p.rows) {
        return;
    }
    y[t * (p.cols / 4u) + i] = p.scale * w4(id - p.row0, i);
}
