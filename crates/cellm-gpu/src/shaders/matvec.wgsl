// y = epilogue(W x) for up to TT tokens a workgroup, one output row a workgroup; the
// matrix is one row range (a part) of a weight (parts keep bindings under the device's
// limit). With NORM, x is RMS-normalised on the fly: (x * g) . w / rms(x). GLU computes
// two matrices' rows (gate `w4`, up `w4b`) and writes act(gate) * up. HEAD reads the rows
// whose logits the step wants instead of the first tokens.
struct Params {
    rows: u32,        // rows of this part
    cols: u32,
    x_stride: u32,    // floats per x row
    y_stride: u32,    // floats per y row
    y_col: u32,       // column of y where row 0 of the whole matrix goes
    row0: u32,        // first row of this part in the whole matrix
    flags: u32,
    groups_x: u32,    // workgroups along x of the 2-D row grid
    eps: f32,
    scale: f32,
    softcap: f32,
    _pad0: u32, _pad1: u32, _pad2: u32, _pad3: u32, _pad4: u32,
}
const NORM: u32 = 1u;
const RESIDUAL: u32 = 2u;
const BIAS: u32 = 4u;
const SOFTCAP: u32 = 8u;
const HEAD: u32 = 16u;
const GELU: u32 = 32u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<storage, read> gamma: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;

const WG: u32 = 64u;
const TT: u32 = 4u;
var<workgroup> red_a: array<vec4<f32>, 64>;
var<workgroup> red_b: array<vec4<f32>, 64>;
var<workgroup> red_s: array<vec4<f32>, 64>;

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

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let r = wg.x + wg.y * p.groups_x;
    var n = n_tokens();
    if ((p.flags & HEAD) != 0u) {
        n = n_logit_rows();
    }
    let t0 = wg.z * TT;
    if (r >= p.rows || t0 >= n) {
        return;
    }
    let nt = min(TT, n - t0);
    // Rows past the last token read the first one again (in bounds, never stored).
    var xr: array<u32, 4>;
    for (var k = 0u; k < TT; k++) {
        xr[k] = x_row(t0 + select(0u, k, k < nt)) * (p.x_stride / 4u);
    }
    var a = vec4<f32>(0.0);
    var b = vec4<f32>(0.0);
    var ss = vec4<f32>(0.0);
    let norm = (p.flags & NORM) != 0u;
    for (var i = li; i < p.cols / 4u; i += WG) {
        let wa = w4(r, i);
        //# glu
        let wb = w4b(r, i);
        //# end
        var g = vec4<f32>(1.0);
        if (norm) {
            g = gamma[i];
        }
        for (var k = 0u; k < TT; k++) {
            let xv = x[xr[k] + i];
            a[k] += dot(xv * g, wa);
            //# glu
            b[k] += dot(xv * g, wb);
            //# end
            ss[k] += dot(xv, xv);
        }
    }
    red_a[li] = a;
    red_b[li] = b;
    red_s[li] = ss;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red_a[li] += red_a[li + s];
            red_b[li] += red_b[li + s];
            red_s[li] += red_s[li + s];
        }
        workgroupBarrier();
    }
    if (li < nt) {
        let t = t0 + li;
        var v = epilogue(red_a[0][li], red_s[0][li], r);
        //# glu
        v = act(v) * epilogue(red_b[0][li], red_s[0][li], r);
        //# end
        v = v * p.scale;
        if ((p.flags & SOFTCAP) != 0u) {
            v = p.softcap * tanh(clamp(v / p.softcap, -15.0, 15.0));
        }
        let at = t * p.y_stride + p.y_col + p.row0 + r;
        if ((p.flags & RESIDUAL) != 0u) {
            y[at] += v;
        } else {
            y[at] = v;
        }
    }
}
