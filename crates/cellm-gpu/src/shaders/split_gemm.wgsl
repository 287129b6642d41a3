// Prefill's GEMM in passes (split_gemm.rs), around a plain f16 GEMM that runs where the
// adapter has a fast one (gemm_cm2.comp on NVIDIA's cooperative matrices): `prep` rounds the
// tokens' inputs to f16 (times the norm's gamma) and sums their squares, `dequant` writes a
// block-format matrix as f16 rows, `gemm` is the f16 GEMM in WGSL (the same sums, for
// adapters without the fast one: tests run the passes on lavapipe through it), and
// `epilogue` applies linear.wgsl's epilogue and store (the GLU's gate and product too) to
// the f32 sums. Each pass takes linear.wgsl's Params; the f16 tensors are packed two to a
// word. Sections are kept by kernels.rs.

//# prep
// xh[t] = f16(x[t]) or, with NORM, the normed row f16(x[t] / rms(x[t]) * gamma) (clamped to
// f16's range, as gemm_coop.wgsl does), so that the epilogue need not scale the sums (and
// where nothing else is left for it, the GEMM writes y itself); one workgroup of 256 a
// token. (With 64, the passes' preps took 1.7 ms of the 3B's 512-token step on the H200
// over 112 launches; with 256, 0.87 ms over the 84 left once the GLU's epilogue writes the
// down projection's inputs.)
@group(0) @binding(12) var<storage, read_write> xh: array<vec2<u32>>;
var<workgroup> partial: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.y;
    if (t >= n_tokens()) {
        return;
    }
    let c4 = p.cols / 4u;
    let row = t * (p.x_stride / 4u);
    let normed = (p.flags & NORM) != 0u;
    var inv = 1.0;
    if (normed) {
        var sum = 0.0;
        for (var i = li; i < c4; i += 256u) {
            let v = x[row + i];
            sum += dot(v, v);
        }
        partial[li] = sum;
        workgroupBarrier();
        for (var s = 128u; s > 0u; s >>= 1u) {
            if (li < s) {
                partial[li] += partial[li + s];
            }
            workgroupBarrier();
        }
        inv = inverseSqrt(partial[0] / f32(p.cols) + p.eps);
    }
    for (var i = li; i < c4; i += 256u) {
        var v = x[row + i] * inv;
        if (normed) {
            v = v * gamma[i];
        }
        v = clamp(v, vec4<f32>(-65504.0), vec4<f32>(65504.0));
        xh[t * c4 + i] = vec2<u32>(pack2x16float(v.xy), pack2x16float(v.zw));
    }
}
//# end

//# dequant
// wh[y_col + r cols + c] = w[r][c] as f16, 8 columns an invocation: workgroups of 64 along
// a row (x), one row per y.
@group(0) @binding(12) var<storage, read_write> wh: array<vec4<u32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let r = id.y;
    let i = id.x;
    if (i >= p.cols / 8u) {
        return;
    }
    let v = w8(r, i);
    wh[(p.y_col + r * p.cols) / 8u + i] = vec4<u32>(
        pack2x16float(v[0].xy), pack2x16float(v[0].zw),
        pack2x16float(v[1].xy), pack2x16float(v[1].zw));
}
//# end

//# gemm
// acc[t][y_col + r] = sum_k w[r][k] xh[t][k] in f32 (+= with RESIDUAL: the output is then the
// residual stream), w f16 rows of p.cols (gemm_cm2.comp's contract, plainly: a 16 x 16 tile
// of tokens (x) by rows (y) a workgroup).
@group(0) @binding(5) var<storage, read> wf: array<u32>;
@group(0) @binding(12) var<storage, read> xf: array<u32>;
@group(0) @binding(14) var<storage, read_write> acc: array<f32>;

@compute @workgroup_size(16, 16)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let t = id.x;
    let r = id.y;
    if (r >= p.rows || t >= n_tokens()) {
        return;
    }
    let half = p.cols / 2u;
    var sum = 0.0;
    for (var k = 0u; k < half; k++) {
        let a = unpack2x16float(wf[r * half + k]);
        let b = unpack2x16float(xf[t * half + k]);
        sum += a.x * b.x + a.y * b.y;
    }
    let at = t * p.y_stride + p.y_col + r;
    if ((p.flags & RESIDUAL) != 0u) {
        acc[at] += sum;
    } else {
        acc[at] = sum;
    }
}
//# end

//# epilogue
// y[t][rows r .. r + 3] from acc[t * stride + r ..] (acc_stride(); the GLU's up sums
// up_col() further on): 64 invocations a workgroup, 4 rows each, one token per y.
@group(0) @binding(14) var<storage, read> acc: array<vec4<f32>>;
//# glu
// With HALF_OUT, the GLU's output goes straight to the next GEMM's f16 inputs (the down
// projection's: rows of p.rows), as prep would write it, and not to y.
@group(0) @binding(12) var<storage, read_write> xh: array<vec2<u32>>;
const HALF_OUT: u32 = 64u;
//# end

// Floats of an acc row, and where the GLU's up sums start in it (Params' RoPE words, which
// the split passes do not use).
fn acc_stride() -> u32 {
    return p.q_dim;
}
fn up_col() -> u32 {
    return p.kv_dim;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
    let r = 4u * id.x;
    let t = id.y;
    if (r >= p.rows || t >= n_tokens()) {
        return;
    }
    // (The norm was applied by prep: NORM is not among the epilogue's flags.)
    let s = 0.0;
    let base = t * acc_stride() + r;
    let v = acc[base / 4u];
    //# glu
    let u = acc[(base + up_col()) / 4u];
    if ((p.flags & HALF_OUT) != 0u) {
        var h: vec4<f32>;
        for (var e = 0u; e < 4u; e++) {
            h[e] = stored(act(epilogue(v[e], s, r + e)) * epilogue(u[e], s, r + e));
        }
        h = clamp(h, vec4<f32>(-65504.0), vec4<f32>(65504.0));
        xh[(t * p.rows + r) / 4u] = vec2<u32>(pack2x16float(h.xy), pack2x16float(h.zw));
        return;
    }
    //# end
    for (var e = 0u; e < 4u; e++) {
        var o = epilogue(v[e], s, r + e);
        //# glu
        o = act(o) * epilogue(u[e], s, r + e);
        //# end
        store(t, r + e, o);
    }
}
//# end
