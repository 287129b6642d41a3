// Flash-decoding: attention of one query head of one token over one split of its session's
// cached positions (the token's own already stored). The step header says how many positions
// a split holds (st[6]) and how many splits there are (st[7]); workgroup z is the split. A
// split runs CH positions at a time with an online softmax: each thread scores whole
// positions (its page looked up once, the row's base kept in `base`), then the WG threads
// split into WG / (head_dim / 2) slices, thread (slice, pair) summing two dims of the values
// over every slices-th position. (Sections `tpn` and `vv`, on by default: short splits are
// scored by 2 or 4 threads a position, and f16 keys and values read 8 to a load, values 8
// dims a thread; kernels.rs `attn_tp`, `attn_vv`.) The split's unnormalised sums, max and denominator go to
// `part`; `attn_combine.wgsl` merges the splits (or, in the `AttentionFused` build, the
// last split of each (token, head) to finish). With one split (short contexts) the
// workgroup writes the normalised output to `ctx` itself, and the combine is not launched.
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
@group(0) @binding(5) var<storage, read> pool: array<u32>;
//# fuse
// Per (token, head): how many of its splits have written their sums (`AttentionFused`).
@group(0) @binding(4) var<storage, read_write> done: array<atomic<u32>>;
var<workgroup> last: u32;
//# end

const WG: u32 = 128u;
const CH: u32 = 128u;
const MAX_HD: u32 = 256u;
var<workgroup> qs: array<vec2<f32>, 128>;
var<workgroup> sc: array<f32, CH>;
var<workgroup> base: array<u32, CH>;
var<workgroup> red: array<f32, WG>;
var<workgroup> sums: array<vec2<f32>, WG>;
//# pool4
// The pool again, 8 f16 values a load (binding 6 is the same buffer as binding 5).
@group(0) @binding(6) var<storage, read> pool4: array<vec4<u32>>;
//# end
//# tpn
var<workgroup> dots: array<f32, WG>;
//# end
//# vv
var<workgroup> sva: array<vec4<f32>, WG>;
var<workgroup> svb: array<vec4<f32>, WG>;
//# end
//# fuse
var<workgroup> sums4: array<vec4<f32>, WG>;
//# end

// Values i, i + 1 of the pool (i even).
fn kv2(i: u32) -> vec2<f32> {
    if (p.kv.f16 != 0u) {
        return unpack2x16float(pool[i >> 1u]);
    }
    return vec2<f32>(bitcast<f32>(pool[i]), bitcast<f32>(pool[i + 1u]));
}

// The workgroup's max or sum of `v`: within subgroups and then across their slots in `red`
// where the device has subgroups (`lane`, `sg`: the invocation's lane and subgroup, `nsg`
// subgroups), else by a shared-memory tree.
fn reduce(v: f32, li: u32, is_max: bool, lane: u32, sg: u32, nsg: u32) -> f32 {
    //# sg
    var r = subgroupAdd(v);
    if (is_max) {
        r = subgroupMax(v);
    }
    if (lane == 0u) {
        red[sg] = r;
    }
    workgroupBarrier();
    r = red[0];
    for (var k = 1u; k < nsg; k++) {
        r = select(r + red[k], max(r, red[k]), is_max);
    }
    workgroupBarrier();
    return r;
    //# end
    //# nosg
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            if (is_max) {
                red[li] = max(red[li], red[li + s]);
            } else {
                red[li] += red[li + s];
            }
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
    //# end
}

@compute @workgroup_size(128)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32,
//# sg
        @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_id) sg: u32,
        @builtin(num_subgroups) nsg: u32,
//# end
) {
    //# nosg
    let lane = 0u;
    let sg = 0u;
    let nsg = 0u;
    //# end
    let h = wg.x;
    let t = wg.y;
    let split = wg.z;
    if (t >= n_tokens()) {
        return;
    }
    let hd = p.head_dim;
    let half = hd / 2u;
    let kvh = h / (p.n_heads / p.n_kv_heads);
    for (var d = li; d < half; d += WG) {
        let at = t * p.row_stride + h * hd + 2u * d;
        qs[d] = vec2<f32>(qkv[at], qkv[at + 1u]);
    }
    let pos = token_pos(t);
    var first = 0u;
    if (p.window != 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    let lo = first + split * split_len();
    let hi = min(pos + 1u, lo + split_len());
    var m = -3.4e38;
    var l = 0.0;
    // head_dim / 2 <= MAX_HD / 2 == WG, so every pair has a thread in slice 0.
    let slices = WG / half;
    let dv = li % half;
    let slice = li / half;
    let plane = p.kv.page_size * p.kv.kv_dim;
    var acc = vec2<f32>(0.0);
    //# tpn
    // Threads a position in the scoring: 4 for splits of up to 32 positions, 2 up to 64,
    // else 1 (where they divide the key's pairs), so that short splits keep every thread busy.
    var tp = select(select(1u, 2u, split_len() <= 64u), 4u, split_len() <= 32u);
    if (half % tp != 0u) {
        tp = 1u;
    }
    let per = WG / tp;
    let k = li % tp;
    let dn = half / tp;
    let v4 = p.kv.f16 != 0u && p.kv.kv_dim % 8u == 0u && dn % 4u == 0u;
    //# end
    //# vv
    // Values 8 f16 to a load where rows allow (`vv`): thread (vs, o) sums dims 8 o.. 8 o + 7
    // over every vslices-th position.
    let vv = p.kv.f16 != 0u && p.kv.kv_dim % 8u == 0u && hd % 8u == 0u;
    let octs = max(hd / 8u, 1u);
    let vslices = WG / octs;
    let o = li % octs;
    let vs = li / octs;
    var acc_a = vec4<f32>(0.0);
    var acc_b = vec4<f32>(0.0);
    //# end
    workgroupBarrier();
    for (var start = lo; start < hi; start += CH) {
        let n = min(CH, hi - start);
        var local_max = -3.4e38;
        //# tpn
        // tp threads a position (`tp` above), each scoring dims [k dn, (k + 1) dn) pairs of
        // the key, 8 f16 values a load where rows allow (`v4`); partial sums added up in
        // `dots` by the position's first thread.
        for (var j0 = 0u; j0 < n; j0 += per) {
            let j = j0 + li / tp;
            var s = 0.0;
            if (j < n) {
                let q = start + j;
                let page = page_of(t, p.layer, q / p.kv.page_size);
                let at = kv_index(p.kv, page, 0u, q % p.kv.page_size, kvh * hd);
                if (k == 0u) {
                    base[j] = at;
                }
                let d0 = k * dn;
                if (v4) {
                    let w4 = (at >> 3u) + d0 / 4u;
                    for (var d = 0u; d < dn; d += 4u) {
                        let kk = pool4[w4 + d / 4u];
                        s += dot(vec4<f32>(qs[d0 + d], qs[d0 + d + 1u]),
                                 vec4<f32>(unpack2x16float(kk.x), unpack2x16float(kk.y)))
                            + dot(vec4<f32>(qs[d0 + d + 2u], qs[d0 + d + 3u]),
                                  vec4<f32>(unpack2x16float(kk.z), unpack2x16float(kk.w)));
                    }
                } else {
                    for (var d = d0; d < d0 + dn; d++) {
                        s += dot(qs[d], kv2(at + 2u * d));
                    }
                }
            }
            dots[li] = s;
            workgroupBarrier();
            if (k == 0u && j < n) {
                var tot = 0.0;
                for (var kk = 0u; kk < tp; kk++) {
                    tot += dots[li + kk];
                }
                tot *= p.scale;
                if (p.softcap != 0.0) {
                    tot = p.softcap * tanh(clamp(tot / p.softcap, -15.0, 15.0));
                }
                sc[j] = tot;
                local_max = max(local_max, tot);
            }
            workgroupBarrier();
        }
        //# end
        //# tp1
        for (var j = li; j < n; j += WG) {
            let q = start + j;
            let page = page_of(t, p.layer, q / p.kv.page_size);
            let at = kv_index(p.kv, page, 0u, q % p.kv.page_size, kvh * hd);
            base[j] = at;
            var s = 0.0;
            if (p.kv.f16 != 0u) {
                let w = at >> 1u;
                var d = 0u;
                for (; d + 1u < half; d += 2u) {
                    let k = vec4<f32>(unpack2x16float(pool[w + d]),
                                      unpack2x16float(pool[w + d + 1u]));
                    s += dot(vec4<f32>(qs[d], qs[d + 1u]), k);
                }
                if (d < half) {
                    s += dot(qs[d], unpack2x16float(pool[w + d]));
                }
            } else {
                for (var d = 0u; d < half; d++) {
                    s += dot(qs[d], kv2(at + 2u * d));
                }
            }
            s *= p.scale;
            if (p.softcap != 0.0) {
                s = p.softcap * tanh(clamp(s / p.softcap, -15.0, 15.0));
            }
            sc[j] = s;
            local_max = max(local_max, s);
        }
        //# end
        let m_new = max(m, reduce(local_max, li, true, lane, sg, nsg));
        var local_sum = 0.0;
        for (var j = li; j < n; j += WG) {
            let e = exp(sc[j] - m_new);
            sc[j] = e;
            local_sum += e;
        }
        let alpha = exp(m - m_new);
        l = l * alpha + reduce(local_sum, li, false, lane, sg, nsg);
        m = m_new;
        //# vv
        if (vv) {
            if (vs < vslices) {
                var a = acc_a * alpha;
                var b = acc_b * alpha;
                for (var j = vs; j < n; j += vslices) {
                    let v = pool4[(base[j] + plane) / 8u + o];
                    a += sc[j] * vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
                    b += sc[j] * vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));
                }
                acc_a = a;
                acc_b = b;
            }
        } else {
        //# end
        if (slice < slices) {
            var a = acc * alpha;
            for (var j = slice; j < n; j += slices) {
                a += sc[j] * kv2(base[j] + plane + 2u * dv);
            }
            acc = a;
        }
        //# vv
        }
        //# end
        workgroupBarrier();
    }
    let out = ((t * p.n_heads + h) * n_splits() + split) * (hd + 2u);
    //# vv
    // Slice 0 adds up the others' sums (8 dims a thread).
    if (vv) {
        sva[li] = acc_a;
        svb[li] = acc_b;
        workgroupBarrier();
        if (li < octs) {
            var a = acc_a;
            var b = acc_b;
            for (var k = 1u; k < vslices; k++) {
                a += sva[k * octs + li];
                b += svb[k * octs + li];
            }
            if (n_splits() == 1u) {
                let at = (t * p.n_heads + h) * hd + 8u * li;
                a /= l;
                b /= l;
                ctx[at] = a.x;
                ctx[at + 1u] = a.y;
                ctx[at + 2u] = a.z;
                ctx[at + 3u] = a.w;
                ctx[at + 4u] = b.x;
                ctx[at + 5u] = b.y;
                ctx[at + 6u] = b.z;
                ctx[at + 7u] = b.w;
            } else {
                let at = out + 8u * li;
                part[at] = a.x;
                part[at + 1u] = a.y;
                part[at + 2u] = a.z;
                part[at + 3u] = a.w;
                part[at + 4u] = b.x;
                part[at + 5u] = b.y;
                part[at + 6u] = b.z;
                part[at + 7u] = b.w;
            }
        }
        if (n_splits() == 1u) {
            return;
        }
    } else {
    //# end
    // Slice 0 adds up the others' sums.
    sums[li] = acc;
    workgroupBarrier();
    if (slice == 0u) {
        for (var k = 1u; k < slices; k++) {
            acc += sums[k * half + dv];
        }
    }
    if (n_splits() == 1u) {
        if (slice == 0u) {
            let at = (t * p.n_heads + h) * hd + 2u * dv;
            ctx[at] = acc.x / l;
            ctx[at + 1u] = acc.y / l;
        }
        return;
    }
    if (slice == 0u) {
        part[out + 2u * dv] = acc.x;
        part[out + 2u * dv + 1u] = acc.y;
    }
    //# vv
    }
    //# end
    if (li == 0u) {
        part[out + hd] = m;
        part[out + hd + 1u] = l;
    }
    //# fuse
    // The last split of its (token, head) to finish merges them all (what attn_combine.wgsl
    // does in its own launch): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. The
    // device-scope barriers make every split's sums visible before its count is taken, and
    // the others' sums visible to the last one after.
    storageBarrier();
    let slot = t * p.n_heads + h;
    let ns = n_splits();
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
    let row = hd + 2u;
    let at0 = slot * ns * row;
    // The splits' weights e^(m_s - M) kept in `sc` where they fit.
    var mx = -3.4e38;
    for (var s = li; s < ns; s += WG) {
        mx = max(mx, part[at0 + s * row + hd]);
    }
    mx = reduce(mx, li, true, lane, sg, nsg);
    var den = 0.0;
    for (var s = li; s < ns; s += WG) {
        let at = at0 + s * row;
        let e = exp(part[at + hd] - mx);
        if (s < CH) {
            sc[s] = e;
        }
        den += e * part[at + hd + 1u];
    }
    den = reduce(den, li, false, lane, sg, nsg);
    // Thread (slice, quad) sums dims 4 quad.. 4 quad + 3 over every slices-th split, two
    // splits a pass.
    let quads = hd / 4u;
    let qslices = WG / quads;
    let qd = li % quads;
    let qs_ = li / quads;
    let shared_w = ns <= CH;
    var v = vec4<f32>(0.0);
    if (qs_ < qslices) {
        var s = qs_;
        for (; s + qslices < ns; s += 2u * qslices) {
            let a = at0 + s * row + 4u * qd;
            let b = a + qslices * row;
            var wa = 0.0;
            var wb = 0.0;
            if (shared_w) {
                wa = sc[s];
                wb = sc[s + qslices];
            } else {
                wa = exp(part[at0 + s * row + hd] - mx);
                wb = exp(part[at0 + (s + qslices) * row + hd] - mx);
            }
            v += wa * vec4<f32>(part[a], part[a + 1u], part[a + 2u], part[a + 3u])
                + wb * vec4<f32>(part[b], part[b + 1u], part[b + 2u], part[b + 3u]);
        }
        if (s < ns) {
            let a = at0 + s * row + 4u * qd;
            var wa = 0.0;
            if (shared_w) {
                wa = sc[s];
            } else {
                wa = exp(part[at0 + s * row + hd] - mx);
            }
            v += wa * vec4<f32>(part[a], part[a + 1u], part[a + 2u], part[a + 3u]);
        }
    }
    sums4[li] = v;
    workgroupBarrier();
    if (qs_ == 0u) {
        for (var k2 = 1u; k2 < qslices; k2++) {
            v += sums4[k2 * quads + qd];
        }
        let at = slot * hd + 4u * qd;
        ctx[at] = v.x / den;
        ctx[at + 1u] = v.y / den;
        ctx[at + 2u] = v.z / den;
        ctx[at + 3u] = v.w / den;
    }
    //# end
}
