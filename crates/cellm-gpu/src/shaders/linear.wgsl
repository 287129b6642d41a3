// What the matvec (matvec.wgsl) and its tiled-GEMM build for prefill (gemm.wgsl) share: the
// parameters, the flags, the bindings of x, y, the norm's gamma and the bias, and the
// epilogue applied to each output.
struct Params {
    rows: u32,        // rows of this part
    cols: u32,
    x_stride: u32,    // floats per x row
    y_stride: u32,    // floats per y row
    y_col: u32,       // column of y where row 0 of the whole matrix goes
    row0: u32,        // first row of this part in the whole matrix
    flags: u32,
    groups_x: u32,    // workgroups along x of the 2-D grid of row groups
    eps: f32,
    scale: f32,
    softcap: f32,
    // ROPE (the q|k|v matvec's one-token builds, matvec.wgsl): q rows, k (and v) rows,
    // head size, layer, and page size | f16 pool << 16 | RoPE table << 17.
    q_dim: u32,
    kv_dim: u32,
    head_dim: u32,
    layer: u32,
    kv_word: u32,
}
const NORM: u32 = 1u;
const RESIDUAL: u32 = 2u;
const BIAS: u32 = 4u;
const SOFTCAP: u32 = 8u;
const HEAD: u32 = 16u;
const GELU: u32 = 32u;
const ROPE: u32 = 64u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> gamma: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;

fn x_row(t: u32) -> u32 {
    if ((p.flags & HEAD) != 0u) {
        return logit_row(t);
    }
    return t;
}

fn act(g: f32) -> f32 {
    // x / (1 + e^a): silu a = -x; gelu-tanh a = -2 sqrt(2/pi) (x + 0.044715 x^3).
    var a = -g;
    if ((p.flags & GELU) != 0u) {
        a = -2.0 * 0.7978846 * (g + 0.044715 * g * g * g);
    }
    return g / (1.0 + exp(a));
}

fn epilogue(v: f32, ss: f32, r: u32) -> f32 {
    var o = v;
    if ((p.flags & NORM) != 0u) {
        o = o * inverseSqrt(ss / f32(p.cols) + p.eps);
    }
    if ((p.flags & BIAS) != 0u) {
        o = o + bias[p.row0 + r];
    }
    return o;
}

// An output value as stored: scaled, soft-capped where asked.
fn stored(v0: f32) -> f32 {
    var v = v0 * p.scale;
    if ((p.flags & SOFTCAP) != 0u) {
        v = p.softcap * tanh(clamp(v / p.softcap, -15.0, 15.0));
    }
    return v;
}

// Output row r of token t: as `stored`, then stored or added (RESIDUAL).
fn store(t: u32, r: u32, v0: f32) {
    let v = stored(v0);
    let at = t * p.y_stride + p.y_col + p.row0 + r;
    if ((p.flags & RESIDUAL) != 0u) {
        y[at] += v;
    } else {
        y[at] = v;
    }
}
