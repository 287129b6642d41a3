// y = epilogue(W x) for RPW output rows and up to TT tokens a workgroup (TT is 1 for a
// single token, 4 otherwise: the kernel is built twice); the matrix is one row range (a part)
// of a weight (parts keep bindings under the device's limit). Every thread reads the same
// columns of the RPW rows (x read once for them), then the partial sums are reduced per
// subgroup (where the device has subgroups) and across subgroups in shared memory, or by a
// shared-memory tree. With NORM, x is RMS-normalised on the fly: (x * g) . w / rms(x). GLU
// computes two matrices' rows (gate `w4`, up `w4b`) and writes act(gate) * up. HEAD reads
// the rows whose logits the step wants instead of the first tokens. The parameters, flags,
// bindings and epilogue are in linear.wgsl, shared with the tiled-GEMM build (gemm.wgsl).
// The q|k|v matvec's rope build (ROPE) also does what rope_kv.wgsl does for models without
// per-head norms: a workgroup takes rows i, i + half, i + 1, i + 1 + half of a q or k head
// (two rotated pairs), rotates them, and stores the k and v rows into the KV pool too. Its
// two-format build reads q|k rows through one format's accessor and v rows through another's
// (`w8b`; rows a multiple of 8 columns only).
// The one-token build (TT = 1) takes each 8 columns' dot product from the format's `d8`
// (scales applied once to the sums of quants times x) and is built in the shape of
// `OneShape` in kernels.rs (by default 2 rows and 128 threads a workgroup, reduced as scalars;
// the rope builds 4 rows and 64 threads) and as a wider workgroup of 4 rows (more threads
// along a row, for launches of long rows and few of them: `Wide` in kernels.rs). Formats
// without a `d8` of their own take the plain loop. Formats with a `d16` take 16 columns a
// step where `OneShape::d16` (D16 below). The grid counts groups of 4 rows; a
// one-token build of RPW = 1 or 2 rows a workgroup takes the group's 4 / RPW slices along
// the grid's z (which counts token groups otherwise, and is 1 for one token).
// With I8 (`OneShape::i8`, the default on Vulkan) the `d16` loop rounds each thread's 16
// values of x to int8 with one scale (`i8x`) and takes the formats' `d16i` (packed 4 x 8-bit
// integer dots) instead of their float `d16`.
const WG: u32 = $WGu;
const RPW: u32 = $RPWu;
// Sums a thread carries per token lane: RPW of W x, RPW of the GLU's second matrix, and
// sum(x^2).
const Q: u32 = 2u * RPW + 1u;
//# sg
// One slot per subgroup (subgroups of at least 4 invocations).
var<workgroup> red: array<vec4<f32>, Q * WG / 4u>;
//# end
//# nosg
var<workgroup> red: array<vec4<f32>, Q * WG>;
//# end
//# rope
@group(0) @binding(10) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(11) var<storage, read_write> pool: array<u32>;

// Local row of slot j of the workgroup whose first slot is local row r0: in the q and k
// rows, the two rotated pairs (i, i + half) and (i + 1, i + 1 + half) of a head, i = (r0 mod
// head_dim) / 2; in the v rows r0 + j.
fn rope_row(r0: u32, j: u32) -> u32 {
    let g = p.row0 + r0;
    if (g >= p.q_dim + p.kv_dim) {
        return r0 + j;
    }
    let hd = p.head_dim;
    let i = (g % hd) / 2u;
    return r0 - g % hd + i + (j >> 1u) + (j & 1u) * (hd / 2u);
}
//# end

//# i8
// 8 values of y times `inv` (127 / the unit's max |y|) rounded to int8, packed 4 to a word:
// adding 1.5 * 2^23 rounds (to nearest even) and leaves the integer in the low bits of the
// sum's bits, whose low byte `pack4xI8` keeps (no float-to-int conversion). In column order
// (y0 then y1), or where I8EO (q6_k) the even columns then the odd ones.
fn i8x(y0: vec4<f32>, y1: vec4<f32>, inv: f32) -> vec2<u32> {
    var a = y0;
    var b = y1;
    if (I8EO) {
        a = vec4<f32>(y0.x, y0.z, y1.x, y1.z);
        b = vec4<f32>(y0.y, y0.w, y1.y, y1.w);
    }
    let m = vec4<f32>(12582912.0);
    return vec2<u32>(pack4xI8(bitcast<vec4<i32>>(a * inv + m)),
                     pack4xI8(bitcast<vec4<i32>>(b * inv + m)));
}
//# end


@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32,
//# sg
        @builtin(subgroup_invocation_id) sl: u32, @builtin(subgroup_id) sid: u32,
        @builtin(num_subgroups) nsg: u32,
//# end
) {
    let one = TT == 1u;
    let r0 = (wg.x + wg.y * p.groups_x) * 4u + select(0u, wg.z * RPW, one);
    var n = n_tokens();
    if ((p.flags & HEAD) != 0u) {
        n = n_logit_rows();
    }
    let t0 = select(wg.z * TT, 0u, one);
    if (r0 >= p.rows || t0 >= n) {
        return;
    }
    let nt = min(TT, n - t0);
    // Tokens past the last read the first again, rows past the last the last (in bounds,
    // never stored).
    var xr: array<u32, TT>;
    for (var k = 0u; k < TT; k++) {
        xr[k] = x_row(t0 + select(0u, k, k < nt)) * (p.x_stride / 4u);
    }
    var rr: array<u32, RPW>;
    for (var j = 0u; j < RPW; j++) {
        rr[j] = min(r0 + j, p.rows - 1u);
        //# rope
        rr[j] = rope_row(r0, j);
        //# end
    }
    var s: array<vec4<f32>, Q>;
    for (var j = 0u; j < Q; j++) {
        s[j] = vec4<f32>(0.0);
    }
    let norm = (p.flags & NORM) != 0u;
    //# two
    let in_b = p.row0 + r0 >= p.q_dim + p.kv_dim;
    //# end
    //# d16
    // Formats with a `d16` (D16): 16 columns a thread per row and step, the 8 at column c and
    // the 8 at c + H16, which such a format keeps in the low and high nibbles of the same
    // pair of words (one `d16`): unit u of a row starts at c below, so that neighbouring
    // threads read neighbouring pairs of words.
    for (var u = li; u < p.cols / 16u; u += WG) {
        let c = (u / (H16 / 8u)) * (2u * H16) + (u % (H16 / 8u)) * 8u;
        let a = c / 4u;
        let b = (c + H16) / 4u;
        var ga0 = vec4<f32>(1.0);
        var ga1 = vec4<f32>(1.0);
        var gb0 = vec4<f32>(1.0);
        var gb1 = vec4<f32>(1.0);
        if (norm) {
            ga0 = gamma[a];
            ga1 = gamma[a + 1u];
            gb0 = gamma[b];
            gb1 = gamma[b + 1u];
        }
        let xa0 = x[xr[0] + a];
        let xa1 = x[xr[0] + a + 1u];
        let xb0 = x[xr[0] + b];
        let xb1 = x[xr[0] + b + 1u];
        s[Q - 1u].x += dot(xa0, xa0) + dot(xa1, xa1) + dot(xb0, xb0) + dot(xb1, xb1);
        let ya0 = xa0 * ga0;
        let ya1 = xa1 * ga1;
        let yb0 = xb0 * gb0;
        let yb1 = xb1 * gb1;
        let sa = dot(ya0 + ya1, vec4<f32>(1.0));
        let sb = dot(yb0 + yb1, vec4<f32>(1.0));
        //# i8
        // x as int8 (`OneShape::i8`): the unit's 16 values with one scale, dx = max |y| / 127
        // (`i8x`), shared by every row; the formats' `d16i` take integer dots with them.
        let am = max(max(abs(ya0), abs(ya1)), max(abs(yb0), abs(yb1)));
        let mx = max(max(am.x, am.y), max(am.z, am.w));
        let dx = mx * (1.0 / 127.0);
        let inv = select(0.0, 127.0 / mx, mx > 1e-30);
        let qa = i8x(ya0, ya1, inv);
        let qb = i8x(yb0, yb1, inv);
        //# end
        for (var j = 0u; j < RPW; j++) {
            //# f32x
            //# one
            s[j].x += d16(rr[j], u, ya0, ya1, yb0, yb1, sa, sb);
            //# end
            //# two
            if (in_b) {
                s[j].x += d16b(rr[j] - p.q_dim - p.kv_dim, u, ya0, ya1, yb0, yb1, sa, sb);
            } else {
                s[j].x += d16(rr[j], u, ya0, ya1, yb0, yb1, sa, sb);
            }
            //# end
            //# glu
            s[RPW + j].x += d16b(rr[j], u, ya0, ya1, yb0, yb1, sa, sb);
            //# end
            //# end
            //# i8
            //# one
            s[j].x += d16i(rr[j], u, qa, qb, dx, sa, sb);
            //# end
            //# two
            if (in_b) {
                s[j].x += d16ib(rr[j] - p.q_dim - p.kv_dim, u, qa, qb, dx, sa, sb);
            } else {
                s[j].x += d16i(rr[j], u, qa, qb, dx, sa, sb);
            }
            //# end
            //# glu
            s[RPW + j].x += d16ib(rr[j], u, qa, qb, dx, sa, sb);
            //# end
            //# end
        }
    }
    //# end
    // Rows of a multiple of 8 columns: 8 columns (one `w8`) a thread per row and step, UN
    // steps (i, i + WG, ...) a pass, so that each thread has UN * RPW weight loads in flight
    // (past the end: the last step's columns again, times zero).
    let n8 = select(0u, p.cols / 8u, p.cols % 8u == 0u && !D16);
    for (var i0 = li; i0 < n8; i0 += UN * WG) {
        for (var u = 0u; u < UN; u++) {
            let ok = i0 + u * WG < n8;
            let i = select(i0, i0 + u * WG, ok);
            var g0 = vec4<f32>(1.0);
            var g1 = vec4<f32>(1.0);
            if (norm) {
                g0 = gamma[2u * i];
                g1 = gamma[2u * i + 1u];
            }
            g0 = select(vec4<f32>(0.0), g0, ok);
            g1 = select(vec4<f32>(0.0), g1, ok);
            var x0: array<vec4<f32>, TT>;
            var x1: array<vec4<f32>, TT>;
            for (var k = 0u; k < TT; k++) {
                let a = x[xr[k] + 2u * i];
                let b = x[xr[k] + 2u * i + 1u];
                x0[k] = a * g0;
                x1[k] = b * g1;
                s[Q - 1u][k] += select(0.0, dot(a, a) + dot(b, b), ok);
            }
            //# dot
            let xs = dot(x0[0] + x1[0], vec4<f32>(1.0));
            for (var j = 0u; j < RPW; j++) {
                //# one
                s[j].x += d8(rr[j], i, x0[0], x1[0], xs);
                //# end
                //# two
                if (in_b) {
                    s[j].x += d8b(rr[j] - p.q_dim - p.kv_dim, i, x0[0], x1[0], xs);
                } else {
                    s[j].x += d8(rr[j], i, x0[0], x1[0], xs);
                }
                //# end
                //# glu
                s[RPW + j].x += d8b(rr[j], i, x0[0], x1[0], xs);
                //# end
            }
            //# end
            //# nodot
            for (var j = 0u; j < RPW; j++) {
                //# one
                let wa = w8(rr[j], i);
                //# end
                //# two
                // q|k rows in the first format, v rows (from q_dim + kv_dim) in the second.
                var wa: array<vec4<f32>, 2>;
                if (in_b) {
                    wa = w8b(rr[j] - p.q_dim - p.kv_dim, i);
                } else {
                    wa = w8(rr[j], i);
                }
                //# end
                //# glu
                let wb = w8b(rr[j], i);
                //# end
                for (var k = 0u; k < TT; k++) {
                    s[j][k] += dot(x0[k], wa[0]) + dot(x1[k], wa[1]);
                    //# glu
                    s[RPW + j][k] += dot(x0[k], wb[0]) + dot(x1[k], wb[1]);
                    //# end
                }
            }
            //# end
        }
    }
    // Otherwise two columns of vec4 a thread per pass (i and i + WG), so that each thread
    // has 2 * RPW weight loads in flight.
    let n4 = select(p.cols / 4u, 0u, n8 > 0u || D16);
    for (var i0 = li; i0 < n4; i0 += 2u * WG) {
        for (var u = 0u; u < 2u; u++) {
            // Past the end: the last vec4 again, times zero (no branch around the loads).
            let ok = i0 + u * WG < n4;
            let i = select(n4 - 1u, i0 + u * WG, ok);
            var g = vec4<f32>(1.0);
            if (norm) {
                g = gamma[i];
            }
            g = select(vec4<f32>(0.0), g, ok);
            var xs: array<vec4<f32>, TT>;
            for (var k = 0u; k < TT; k++) {
                let xv = x[xr[k] + i];
                xs[k] = xv * g;
                s[Q - 1u][k] += select(0.0, dot(xv, xv), ok);
            }
            for (var j = 0u; j < RPW; j++) {
                let wa = w4(rr[j], i);
                //# glu
                let wb = w4b(rr[j], i);
                //# end
                for (var k = 0u; k < TT; k++) {
                    s[j][k] += dot(xs[k], wa);
                    //# glu
                    s[RPW + j][k] += dot(xs[k], wb);
                    //# end
                }
            }
        }
    }
    //# sg
    // Every slot as one vec4 reduction: on the H200 this ran 6-12% faster on the Llama F16
    // files than a scalar reduction of the used slots and token lanes only.
    //# vred
    for (var j = 0u; j < Q; j++) {
        s[j] = subgroupAdd(s[j]);
    }
    //# end
    //# sred
    // One token (`OneShape::scalar`): only the first lane of the slots in use (W x, the
    // GLU's second matrix, the sum of squares), one scalar reduction each.
    for (var j = 0u; j < RPW; j++) {
        s[j].x = subgroupAdd(s[j].x);
        //# glu
        s[RPW + j].x = subgroupAdd(s[RPW + j].x);
        //# end
    }
    s[Q - 1u].x = subgroupAdd(s[Q - 1u].x);
    //# end
    if (sl == 0u) {
        for (var j = 0u; j < Q; j++) {
            red[sid * Q + j] = s[j];
        }
    }
    workgroupBarrier();
    let parts = nsg;
    let stride = Q;
    //# end
    //# nosg
    for (var j = 0u; j < Q; j++) {
        red[li * Q + j] = s[j];
    }
    workgroupBarrier();
    for (var h = WG / 2u; h > 1u; h >>= 1u) {
        if (li < h) {
            for (var j = 0u; j < Q; j++) {
                red[li * Q + j] += red[(li + h) * Q + j];
            }
        }
        workgroupBarrier();
    }
    let parts = 2u;
    let stride = Q;
    //# end
    //# plain
    if (li < RPW * TT) {
        let j = li / TT;
        let k = li % TT;
        let r = r0 + j;
        let t = t0 + k;
        if (r < p.rows && k < nt) {
            var a = 0.0;
            var b = 0.0;
            var ss = 0.0;
            for (var u = 0u; u < parts; u++) {
                a += red[u * stride + j][k];
                //# glu
                b += red[u * stride + RPW + j][k];
                //# end
                if (norm) {
                    ss += red[u * stride + Q - 1u][k];
                }
            }
            var v = epilogue(a, ss, r);
            //# glu
            v = act(v) * epilogue(b, ss, r);
            //# end
            store(t, r, v);
        }
    }
    //# end
    //# rope
    // Whole heads (q, k) and whole groups of 4 rows (v): every slot is a row.
    if (li < RPW * TT) {
        let j = li / TT;
        let k = li % TT;
        let t = t0 + k;
        if (k < nt) {
            var o: array<f32, RPW>;
            for (var jj = 0u; jj < RPW; jj++) {
                var a = 0.0;
                var ss = 0.0;
                for (var u = 0u; u < parts; u++) {
                    a += red[u * stride + jj][k];
                    if (norm) {
                        ss += red[u * stride + Q - 1u][k];
                    }
                }
                o[jj] = epilogue(a, ss, rr[jj]);
            }
            let g0 = p.row0 + r0;
            let hd = p.head_dim;
            let half = hd / 2u;
            let qk = p.q_dim + p.kv_dim;
            let in_qk = g0 < qk;
            if (in_qk) {
                // Slots (0, 1) and (2, 3) are pairs (i, i + half) and (i + 1, i + 1 + half).
                let i = (g0 % hd) / 2u;
                let table = (p.kv_word >> 17u) * st[5] + t * half + i;
                let c0 = rope[table];
                let c1 = rope[table + 1u];
                let u0 = o[0];
                let u2 = o[2];
                o[0] = u0 * c0.x - o[1] * c0.y;
                o[1] = o[1] * c0.x + u0 * c0.y;
                o[2] = u2 * c1.x - o[3] * c1.y;
                o[3] = o[3] * c1.x + u2 * c1.y;
            }
            store(t, rr[j], o[j]);
            if (g0 >= p.q_dim) {
                let kv = Kv(p.kv_word & 0xffffu, p.kv_dim, (p.kv_word >> 16u) & 1u, 0u);
                let pos = token_pos(t);
                let page = page_of(t, p.layer, pos / kv.page_size);
                let slot = pos % kv.page_size;
                let is_v = g0 >= qk;
                let g = p.row0 + rr[j];
                let d = g - select(p.q_dim, qk, is_v);
                let at = kv_index(kv, page, select(0u, 1u, is_v), slot, d);
                if (kv.f16 != 0u) {
                    // Words hold rows (d, d + 1): slots (0, 2), (1, 3) in a head, (0, 1),
                    // (2, 3) in v.
                    let lo = select(j < 2u, (j & 1u) == 0u, is_v);
                    if (lo) {
                        let next = select(j + 2u, j + 1u, is_v);
                        pool[at / 2u] = pack2x16float(vec2<f32>(o[j], o[next]) * p.scale);
                    }
                } else {
                    pool[at] = bitcast<u32>(o[j] * p.scale);
                }
            }
        }
    }
    //# end
}
