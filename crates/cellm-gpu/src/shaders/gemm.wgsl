// The matvec of several tokens as a tiled GEMM (prefill): a workgroup computes BM = 64 rows
// by BN = 64 tokens, BK = 16 columns at a time through shared memory: each thread loads one
// vec4 of W (dequantized; and of the GLU's second matrix) and one of x (times the norm's
// gamma, its square summed for the token's rms), then computes 4 rows by 4 tokens. The
// params, flags, bindings and epilogue are linear.wgsl's, shared with the matvec.
const BM: u32 = 64u;
const BN: u32 = 64u;
const BK4: u32 = 4u;  // BK / 4
var<workgroup> tw: array<vec4<f32>, 256>;  // [BK4][BM]
//# glu
var<workgroup> twb: array<vec4<f32>, 256>;
//# end
var<workgroup> tx4: array<vec4<f32>, 256>;  // [BK4][BN]
var<workgroup> sq: array<f32, 256>;        // [BK4][BN] partial sums of x^2

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    var n = n_tokens();
    if ((p.flags & HEAD) != 0u) {
        n = n_logit_rows();
    }
    let r0 = wg.x * BM;
    let t0 = wg.y * BN;
    if (r0 >= p.rows || t0 >= n) {
        return;
    }
    // Loading: thread li fetches vec4 (li / 64) of the step's BK columns, for row and
    // token li % 64 of the tile (clamped into range; never stored).
    let lk = li / 64u;
    let lr = li % 64u;
    let wrow = min(r0 + lr, p.rows - 1u);
    let xrow = x_row(min(t0 + lr, n - 1u)) * (p.x_stride / 4u);
    let norm = (p.flags & NORM) != 0u;
    // Computing: rows ty + 16 i, tokens tx + 16 j.
    let tx = li % 16u;
    let ty = li / 16u;
    var acc: array<vec4<f32>, 4>;   // [i][j]
    var accb: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i++) {
        acc[i] = vec4<f32>(0.0);
        accb[i] = vec4<f32>(0.0);
    }
    var ssq = 0.0;
    for (var k0 = 0u; k0 < p.cols / 4u; k0 += BK4) {
        let c = k0 + lk;
        var wv = vec4<f32>(0.0);
        var xv = vec4<f32>(0.0);
        //# glu
        var wbv = vec4<f32>(0.0);
        //# end
        if (c < p.cols / 4u) {
            wv = w4(wrow, c);
            //# glu
            wbv = w4b(wrow, c);
            //# end
            xv = x[xrow + c];
            ssq += dot(xv, xv);
            if (norm) {
                xv = xv * gamma[c];
            }
        }
        tw[lk * BM + lr] = wv;
        //# glu
        twb[lk * BM + lr] = wbv;
        //# end
        tx4[lk * BN + lr] = xv;
        workgroupBarrier();
        for (var kk = 0u; kk < BK4; kk++) {
            var xt: array<vec4<f32>, 4>;
            for (var j = 0u; j < 4u; j++) {
                xt[j] = tx4[kk * BN + tx + 16u * j];
            }
            for (var i = 0u; i < 4u; i++) {
                let w = tw[kk * BM + ty + 16u * i];
                acc[i] += vec4<f32>(dot(w, xt[0]), dot(w, xt[1]), dot(w, xt[2]), dot(w, xt[3]));
                //# glu
                let wb = twb[kk * BM + ty + 16u * i];
                accb[i] += vec4<f32>(dot(wb, xt[0]), dot(wb, xt[1]), dot(wb, xt[2]),
                                     dot(wb, xt[3]));
                //# end
            }
        }
        workgroupBarrier();
    }
    sq[lk * BN + lr] = ssq;
    workgroupBarrier();
    for (var j = 0u; j < 4u; j++) {
        let tl = tx + 16u * j;
        let t = t0 + tl;
        if (t >= n) {
            continue;
        }
        let ss = sq[tl] + sq[BN + tl] + sq[2u * BN + tl] + sq[3u * BN + tl];
        for (var i = 0u; i < 4u; i++) {
            let r = r0 + ty + 16u * i;
            if (r >= p.rows) {
                continue;
            }
            var v = epilogue(acc[i][j], ss, r);
            //# glu
            v = act(v) * epilogue(accb[i][j], ss, r);
            //# end
            store(t, r, v);
        }
    }
}
