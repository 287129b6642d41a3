// Flash-decoding by kv head (`KernelId::AttentionGqa`, CELLM_GPU_ATTN_GQA): one workgroup
// per (kv head, token, split) attends with all G query heads of that kv head's group, so
// each cached key and value row is read once per group instead of once per query head.
// Built per (G, HD, CH, TEAM): kernels.rs prepends `const G` (query heads a group), `HD`
// (head dim), `CH` (positions a chunk), `TEAM` (threads a head in the softmax's
// reductions: WG / G rounded up to a power of two). No subgroup operations: reductions run
// in shared memory, so the build is the same with and without subgroups.
//
// A chunk of CH positions: tp threads a position (tp 4 for splits of up to 32 positions,
// 2 up to 64, else 1) each load a slice of the key once and dot it with the G queries;
// each head's team of TEAM threads takes the chunk's max and sum for its online softmax;
// then thread (slice, lane) loads 8 f16 (or 4 f32) values of a position once and adds them
// to the G heads' sums. The split's unnormalised sums, max and denominator go to `part` in
// `attention.wgsl`'s layout (per (token, query head, split)), so `attn_combine.wgsl`
// merges them; in the fused build the last split of each (token, kv head) merges its G
// heads itself. With one split the outputs go to `ctx` directly.
struct Params {
    kv: Kv,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    row_stride: u32,  // floats per q|k|v row
    layer: u32,
    window: u32,      // 0: none
    scale: f32,
    softcap: f32,     // 0: none
    _pad0: u32, _pad1: u32, _pad2: u32, _pad3: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> part: array<f32>;
@group(0) @binding(3) var<storage, read_write> ctx: array<f32>;
// The pool, 4 words a load (8 f16 or 4 f32 values).
@group(0) @binding(6) var<storage, read> pool4: array<vec4<u32>>;
//# fuse
// Per (token, kv head): how many of its splits have written their sums.
@group(0) @binding(4) var<storage, read_write> done: array<atomic<u32>>;
var<workgroup> last: u32;
//# end

const WG: u32 = 128u;
const QUADS: u32 = HD / 4u;
var<workgroup> qs: array<vec4<f32>, G * QUADS>;
var<workgroup> sc: array<f32, G * CH>;
var<workgroup> base: array<u32, CH>;
var<workgroup> dots: array<f32, G * WG>;
var<workgroup> red: array<f32, WG>;
var<workgroup> alphas: array<f32, G>;
var<workgroup> ms: array<f32, G>;
var<workgroup> ls: array<f32, G>;
var<workgroup> sva: array<vec4<f32>, WG>;
var<workgroup> svb: array<vec4<f32>, WG>;

// Values 4 i .. 4 i + 7 of the pool as f16 (8 of them), or 4 i .. 4 i + 3 as f32 (in a).
fn load8(i: u32, f16: bool) -> array<vec4<f32>, 2> {
    if (f16) {
        let w = pool4[i];
        return array<vec4<f32>, 2>(vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)),
                                   vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)));
    }
    return array<vec4<f32>, 2>(bitcast<vec4<f32>>(pool4[i]), vec4<f32>(0.0));
}

// Sums (or maxes) of `v` over each run of TEAM threads; every thread of a run gets its
// run's result.
fn team_reduce(v: f32, li: u32, is_max: bool) -> f32 {
    red[li] = v;
    workgroupBarrier();
    let r = li % TEAM;
    for (var s = TEAM / 2u; s > 0u; s >>= 1u) {
        if (r < s) {
            red[li] = select(red[li] + red[li + s], max(red[li], red[li + s]), is_max);
        }
        workgroupBarrier();
    }
    let out = red[li - r];
    workgroupBarrier();
    return out;
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let kvh = wg.x;
    let t = wg.y;
    let split = wg.z;
    if (t >= n_tokens()) {
        return;
    }
    let f16 = p.kv.f16 != 0u;
    // Values a load, loads a row.
    let per = select(4u, 8u, f16);
    let lanes = HD / per;
    let h0 = kvh * G;
    for (var i = li; i < G * QUADS; i += WG) {
        let hh = i / QUADS;
        let at = t * p.row_stride + (h0 + hh) * HD + 4u * (i % QUADS);
        qs[i] = vec4<f32>(qkv[at], qkv[at + 1u], qkv[at + 2u], qkv[at + 3u]);
    }
    let pos = token_pos(t);
    var first = 0u;
    if (p.window != 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    let lo = first + split * split_len();
    let hi = min(pos + 1u, lo + split_len());
    // Scoring: tp threads a position, thread k of them loads [k dl, (k + 1) dl) of its loads.
    var tp = select(select(1u, 2u, split_len() <= 64u), 4u, split_len() <= 32u);
    if (lanes % tp != 0u) {
        tp = 1u;
    }
    let pstep = WG / tp;
    let k = li % tp;
    let dl = lanes / tp;
    // The softmax: thread li works for head `mh` (none where mh >= G).
    let mh = li / TEAM;
    let mr = li % TEAM;
    var m = -3.4e38;
    var l = 0.0;
    // Values: thread (vs, o) sums the o-th load of the rows of every vslices-th position.
    let vslices = WG / lanes;
    let o = li % lanes;
    let vs = li / lanes;
    var acc_a: array<vec4<f32>, G>;
    var acc_b: array<vec4<f32>, G>;
    for (var hh = 0u; hh < G; hh++) {
        acc_a[hh] = vec4<f32>(0.0);
        acc_b[hh] = vec4<f32>(0.0);
    }
    let plane = p.kv.page_size * p.kv.kv_dim;
    workgroupBarrier();
    for (var start = lo; start < hi; start += CH) {
        let n = min(CH, hi - start);
        for (var j0 = 0u; j0 < n; j0 += pstep) {
            let j = j0 + li / tp;
            var s: array<f32, G>;
            for (var hh = 0u; hh < G; hh++) {
                s[hh] = 0.0;
            }
            if (j < n) {
                let q = start + j;
                let page = page_of(t, p.layer, q / p.kv.page_size);
                let at = kv_index(p.kv, page, 0u, q % p.kv.page_size, kvh * HD);
                if (k == 0u) {
                    base[j] = at;
                }
                let w0 = at / per;
                for (var e = k * dl; e < (k + 1u) * dl; e++) {
                    let kk = load8(w0 + e, f16);
                    if (f16) {
                        for (var hh = 0u; hh < G; hh++) {
                            s[hh] += dot(qs[hh * QUADS + 2u * e], kk[0])
                                + dot(qs[hh * QUADS + 2u * e + 1u], kk[1]);
                        }
                    } else {
                        for (var hh = 0u; hh < G; hh++) {
                            s[hh] += dot(qs[hh * QUADS + e], kk[0]);
                        }
                    }
                }
            }
            for (var hh = 0u; hh < G; hh++) {
                dots[hh * WG + li] = s[hh];
            }
            workgroupBarrier();
            if (k == 0u && j < n) {
                for (var hh = 0u; hh < G; hh++) {
                    var tot = 0.0;
                    for (var kk = 0u; kk < tp; kk++) {
                        tot += dots[hh * WG + li + kk];
                    }
                    tot *= p.scale;
                    if (p.softcap != 0.0) {
                        tot = p.softcap * tanh(clamp(tot / p.softcap, -15.0, 15.0));
                    }
                    sc[hh * CH + j] = tot;
                }
            }
            workgroupBarrier();
        }
        // Each head's team: the chunk's max, its weights e^(s - m) in place, their sum.
        var local_max = -3.4e38;
        if (mh < G) {
            for (var j = mr; j < n; j += TEAM) {
                local_max = max(local_max, sc[mh * CH + j]);
            }
        }
        let m_new = max(m, team_reduce(local_max, li, true));
        var local_sum = 0.0;
        if (mh < G) {
            for (var j = mr; j < n; j += TEAM) {
                let e = exp(sc[mh * CH + j] - m_new);
                sc[mh * CH + j] = e;
                local_sum += e;
            }
        }
        let alpha = exp(m - m_new);
        l = l * alpha + team_reduce(local_sum, li, false);
        m = m_new;
        if (mh < G && mr == 0u) {
            alphas[mh] = alpha;
        }
        workgroupBarrier();
        if (vs < vslices) {
            for (var hh = 0u; hh < G; hh++) {
                acc_a[hh] *= alphas[hh];
                acc_b[hh] *= alphas[hh];
            }
            for (var j = vs; j < n; j += vslices) {
                let v = load8((base[j] + plane) / per + o, f16);
                for (var hh = 0u; hh < G; hh++) {
                    let w = sc[hh * CH + j];
                    acc_a[hh] += w * v[0];
                    acc_b[hh] += w * v[1];
                }
            }
        }
        workgroupBarrier();
    }
    if (mh < G && mr == 0u) {
        ms[mh] = m;
        ls[mh] = l;
    }
    let ns = n_splits();
    // Per head: slice 0 adds up the others' sums and writes them.
    for (var hh = 0u; hh < G; hh++) {
        sva[li] = acc_a[hh];
        svb[li] = acc_b[hh];
        workgroupBarrier();
        if (li < lanes) {
            var a = acc_a[hh];
            var b = acc_b[hh];
            for (var x = 1u; x < vslices; x++) {
                a += sva[x * lanes + li];
                b += svb[x * lanes + li];
            }
            let h = h0 + hh;
            var at = ((t * p.n_heads + h) * ns + split) * (HD + 2u) + per * li;
            var scale = 1.0;
            if (ns == 1u) {
                at = (t * p.n_heads + h) * HD + per * li;
                scale = 1.0 / ls[hh];
            }
            a *= scale;
            b *= scale;
            if (ns == 1u) {
                ctx[at] = a.x;
                ctx[at + 1u] = a.y;
                ctx[at + 2u] = a.z;
                ctx[at + 3u] = a.w;
                if (f16) {
                    ctx[at + 4u] = b.x;
                    ctx[at + 5u] = b.y;
                    ctx[at + 6u] = b.z;
                    ctx[at + 7u] = b.w;
                }
            } else {
                part[at] = a.x;
                part[at + 1u] = a.y;
                part[at + 2u] = a.z;
                part[at + 3u] = a.w;
                if (f16) {
                    part[at + 4u] = b.x;
                    part[at + 5u] = b.y;
                    part[at + 6u] = b.z;
                    part[at + 7u] = b.w;
                }
            }
        }
        workgroupBarrier();
    }
    if (ns == 1u) {
        return;
    }
    if (li < G) {
        let at = ((t * p.n_heads + h0 + li) * ns + split) * (HD + 2u);
        part[at + HD] = ms[li];
        part[at + HD + 1u] = ls[li];
    }
    //# fuse
    // The last split of its (token, kv head) to finish merges each of its G heads (what
    // attn_combine.wgsl does in its own launch): out = sum_s e^(m_s - M) acc_s /
    // sum_s e^(m_s - M) l_s. Each head's team takes its M and denominator over the splits
    // (the weights kept in `sc` where they fit), then the G heads' quads of dims are spread
    // over the threads, (slice, unit) summing unit's 4 dims over every slices-th split. The
    // device-scope barriers make every split's sums visible before its count is taken, and
    // the others' sums visible to the last one after.
    storageBarrier();
    let slot = t * p.n_kv_heads + kvh;
    if (li == 0u) {
        last = select(0u, 1u, atomicAdd(&done[slot], 1u) + 1u == ns);
    }
    if (workgroupUniformLoad(&last) == 0u) {
        return;
    }
    storageBarrier();
    if (li == 0u) {
        atomicStore(&done[slot], 0u);
    }
    let row = HD + 2u;
    let head0 = (t * p.n_heads + h0) * ns * row;
    var mx = -3.4e38;
    if (mh < G) {
        for (var s = mr; s < ns; s += TEAM) {
            mx = max(mx, part[head0 + (mh * ns + s) * row + HD]);
        }
    }
    mx = team_reduce(mx, li, true);
    var den = 0.0;
    if (mh < G) {
        for (var s = mr; s < ns; s += TEAM) {
            let a = head0 + (mh * ns + s) * row;
            let e = exp(part[a + HD] - mx);
            if (s < CH) {
                sc[mh * CH + s] = e;
            }
            den += e * part[a + HD + 1u];
        }
    }
    den = team_reduce(den, li, false);
    if (mh < G && mr == 0u) {
        ms[mh] = mx;
        ls[mh] = den;
    }
    workgroupBarrier();
    let units = G * QUADS;
    if (units < WG) {
        let slices = WG / units;
        let u = li % units;
        let sl = li / units;
        var v = vec4<f32>(0.0);
        if (sl < slices) {
            v = merge_unit(head0, ns, u, sl, slices);
        }
        sva[li] = v;
        workgroupBarrier();
        if (sl == 0u) {
            for (var x = 1u; x < slices; x++) {
                v += sva[x * units + u];
            }
            write_unit(t, h0, u, v);
        }
    } else {
        for (var u = li; u < units; u += WG) {
            write_unit(t, h0, u, merge_unit(head0, ns, u, 0u, 1u));
        }
    }
    //# end
}

//# fuse
// The sum over splits s0, s0 + step, .. of unit u's 4 dims (head u / QUADS), weighted.
fn merge_unit(head0: u32, ns: u32, u: u32, s0: u32, step: u32) -> vec4<f32> {
    let hh = u / QUADS;
    let row = HD + 2u;
    let at0 = head0 + hh * ns * row + 4u * (u % QUADS);
    var v = vec4<f32>(0.0);
    for (var s = s0; s < ns; s += step) {
        var w = 0.0;
        if (ns <= CH) {
            w = sc[hh * CH + s];
        } else {
            w = exp(part[head0 + (hh * ns + s) * row + HD] - ms[hh]);
        }
        let a = at0 + s * row;
        v += w * vec4<f32>(part[a], part[a + 1u], part[a + 2u], part[a + 3u]);
    }
    return v;
}

// Unit u's 4 dims of the output, normalised.
fn write_unit(t: u32, h0: u32, u: u32, v: vec4<f32>) {
    let hh = u / QUADS;
    let at = (t * p.n_heads + h0 + hh) * HD + 4u * (u % QUADS);
    let r = v / ls[hh];
    ctx[at] = r.x;
    ctx[at + 1u] = r.y;
    ctx[at + 2u] = r.z;
    ctx[at + 3u] = r.w;
}
//# end
