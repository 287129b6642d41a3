// The prefill GEMM on cooperative matrices (tensor cores), where the adapter has 16x16x16
// f16 x f16 -> f32 (device.rs): a workgroup of WG invocations (WG / 32 subgroups of 32, 8 or
// 4) computes BM rows by BN tokens, BK (32 or 64) columns a step. Each step the workgroup
// dequantizes its BM x BK weights (w8, 8 columns a load; and the GLU's second matrix) and
// loads its BN x BK x
// (times the norm's gamma, its square summed for the token's rms), rounds both to f16 into
// shared memory (for the block formats the next step's loads are issued before this step's
// multiplies, into registers; float weights load at the step's start), and each subgroup
// multiplies its WR x WC tiles of 16 x 16 into f32 accumulators. The epilogue stages each accumulator through shared memory (one tile of
// 16 x 16 a subgroup at a time) and applies linear.wgsl's epilogue and store.
// `$BM`, `$BN`, `$BK`, `$WG`, `$SGC` (subgroups along the tokens), `$WR`, `$WC` and the `//@`
// lines are filled in by kernels.rs.
const BM: u32 = $BMu;
const BN: u32 = $BNu;
const BK: u32 = $BKu;
const WG: u32 = $WGu;
// vec4<f16> per row of a shared tile: BK / 4 and 2 of padding (rows 80 or 144 bytes apart,
// 16-byte aligned). Cooperative loads take the stride in these units, and a row's elements as the
// vectors' components in order (as llama.cpp's Vulkan GEMM loads from f16vec2 arrays).
const LD: u32 = BK / 4u + 2u;
const SGC: u32 = $SGCu;
const WR: u32 = $WRu;
const WC: u32 = $WCu;
const C8: u32 = BK / 8u;  // 8-column chunks of a weight row a step
const C4: u32 = BK / 4u;  // vec4s of an x row a step
const WU: u32 = BM * C8 / WG;  // 8-column chunks of weights each invocation loads a step
const XU: u32 = BN * C4 / WG;  // vec4s of x each invocation loads a step
var<workgroup> ta: array<vec4<f16>, $TA>;  // [BM][LD]
//# glu
var<workgroup> tb: array<vec4<f16>, $TA>;
//# end
var<workgroup> tx: array<vec4<f16>, $TX>;  // [BN][LD]
var<workgroup> stage: array<f32, $ST>;  // a 16 x 16 tile per subgroup, column-major
var<workgroup> sqp: array<f32, BN>;     // each token's sum of x^2

@compute @workgroup_size($WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(subgroup_id) sg: u32,
        @builtin(subgroup_invocation_id) lane: u32) {
    // The invocation's index, from its subgroup and lane (so that the C4 invocations that
    // load one x row are C4 neighbouring lanes of one subgroup: the sums of x^2 reduce by
    // shuffles).
    let li = sg * 32u + lane;
    var n = n_tokens();
    if ((p.flags & HEAD) != 0u) {
        n = n_logit_rows();
    }
    // The grid covers the rows and tokens exactly (no workgroup returns early: cooperative
    // operations need uniform control flow, and n comes from a storage buffer). The token
    // tiles run along x, so the workgroups that read the same weights run together (L2).
    let r0 = wg.y * BM;
    let t0 = wg.x * BN;
    let norm = (p.flags & NORM) != 0u;
    // This subgroup's tiles: rows m0 + 16 i, tokens n0 + 16 j of the workgroup's.
    let m0 = (sg / SGC) * WR * 16u;
    let n0 = (sg % SGC) * WC * 16u;
    // The accumulators start from a zeroed tile.
    for (var e = 0u; e < 8u; e++) {
        stage[li * 8u + e] = 0.0;
    }
    workgroupBarrier();
//@ZERO
    // What this invocation loads each step: the 8-column chunk c8 of WU weight rows and the
    // vec4 c4 of XU x rows (WG is a multiple of C8 and of C4, so each load of an invocation
    // has the same column). The rows come from `wrow` / `xrow` at each use rather than from
    // arrays held across the steps: registers bound how many workgroups an SM holds.
    let c8 = li % C8;
    let c4 = li % C4;
    var ssq: array<f32, XU>;
    for (var j = 0u; j < XU; j++) {
        ssq[j] = 0.0;
    }
    // Each step's loads go to registers during the previous step's multiplies (`pf`), or
    // straight to shared memory at the step's start (`nopf`: fewer registers; kernels.rs's
    // `CoopPipe`).
    var wv: array<array<vec4<f32>, 2>, WU>;
    //# glu
    var wbv: array<array<vec4<f32>, 2>, WU>;
    //# end
    var xv: array<vec4<f32>, XU>;
    //# pf
    for (var j = 0u; j < WU; j++) {
        wv[j] = w8(wrow(r0, li, j), c8);
        //# glu
        wbv[j] = w8b(wrow(r0, li, j), c8);
        //# end
    }
    for (var j = 0u; j < XU; j++) {
        xv[j] = x[xrow(t0, n, li, j) + c4];
    }
    //# end
    for (var k0 = 0u; k0 < p.cols; k0 += BK) {
        //# nopf
        for (var j = 0u; j < WU; j++) {
            wv[j] = w8(wrow(r0, li, j), k0 / 8u + c8);
            //# glu
            wbv[j] = w8b(wrow(r0, li, j), k0 / 8u + c8);
            //# end
        }
        for (var j = 0u; j < XU; j++) {
            xv[j] = x[xrow(t0, n, li, j) + k0 / 4u + c4];
        }
        //# end
        for (var j = 0u; j < WU; j++) {
            let u = li + WG * j;
            let at = (u / C8) * LD + c8 * 2u;
            ta[at] = vec4<f16>(wv[j][0]);
            ta[at + 1u] = vec4<f16>(wv[j][1]);
            //# glu
            tb[at] = vec4<f16>(wbv[j][0]);
            tb[at + 1u] = vec4<f16>(wbv[j][1]);
            //# end
        }
        for (var j = 0u; j < XU; j++) {
            let u = li + WG * j;
            var v = xv[j];
            ssq[j] += dot(v, v);
            if (norm) {
                v = v * gamma[k0 / 4u + c4];
            }
            // f16's range: a larger input saturates instead of turning into inf.
            v = clamp(v, vec4<f32>(-65504.0), vec4<f32>(65504.0));
            tx[(u / C4) * LD + c4] = vec4<f16>(v);
        }
        workgroupBarrier();
        //# pf
        let kn = k0 + BK;
        if (kn < p.cols) {
            for (var j = 0u; j < WU; j++) {
                wv[j] = w8(wrow(r0, li, j), kn / 8u + c8);
                //# glu
                wbv[j] = w8b(wrow(r0, li, j), kn / 8u + c8);
                //# end
            }
            for (var j = 0u; j < XU; j++) {
                xv[j] = x[xrow(t0, n, li, j) + kn / 4u + c4];
            }
        }
        //# end
        for (var kk = 0u; kk < BK; kk += 16u) {
//@MMA
        }
        workgroupBarrier();
    }
    // Each token's sum over its row's C4 lanes (neighbours, C4 a power of two).
    for (var j = 0u; j < XU; j++) {
        var s = ssq[j];
        for (var o = 1u; o < C4; o <<= 1u) {
            s += subgroupShuffleXor(s, o);
        }
        if (c4 == 0u) {
            sqp[(li + WG * j) / C4] = s;
        }
    }
    workgroupBarrier();
//@STORE
}

// The weight row of invocation `li`'s load j (rows past the last read the last).
fn wrow(r0: u32, li: u32, j: u32) -> u32 {
    return min(r0 + (li + WG * j) / C8, p.rows - 1u);
}

// The first x element of invocation `li`'s load j (tokens past the last read the last).
fn xrow(t0: u32, n: u32, li: u32, j: u32) -> u32 {
    return x_row(min(t0 + (li + WG * j) / C4, n - 1u)) * (p.x_stride / 4u);
}

// The rms sum of token `tl` of the workgroup's tile.
fn token_ss(tl: u32) -> f32 {
    return sqp[tl];
}

//# glu
// The gate half of the tile staged at `base`: act(epilogue) of this lane's 8 values (element
// e is row rb + (lane + 32 e) % 16, token tb + (lane + 32 e) / 16 of the workgroup's).
fn gate(base: u32, lane: u32, rb: u32, tb: u32) -> array<f32, 8> {
    var g: array<f32, 8>;
    for (var e = 0u; e < 8u; e++) {
        let i = lane + 32u * e;
        g[e] = act(epilogue(stage[base + i], token_ss(tb + i / 16u), rb + i % 16u));
    }
    return g;
}
//# end

// Stores this lane's 8 values of the tile staged at `base` (rows rb.., tokens t0 + tb..),
// times the gate's where the GLU has one.
fn emit(base: u32, lane: u32, rb: u32, t0: u32, tb: u32, n: u32, g: array<f32, 8>) {
    for (var e = 0u; e < 8u; e++) {
        let i = lane + 32u * e;
        let tl = tb + i / 16u;
        let r = rb + i % 16u;
        if (t0 + tl >= n || r >= p.rows) {
            continue;
        }
        var v = epilogue(stage[base + i], token_ss(tl), r);
        //# glu
        v = g[e] * v;
        //# end
        store(t0 + tl, r, v);
    }
}
