// Attention of one query head of one token over its session's cached positions (the
// token's own already stored), a chunk of CH positions at a time with an online softmax:
// each thread scores whole positions; then the WG threads split into WG / head_dim slices
// of head_dim threads, thread (slice, d) summing dim d of the values over every slices-th
// position, and the slices' sums are added at the end.
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
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> pool: array<u32>;

const WG: u32 = 256u;
const CH: u32 = 256u;
const MAX_HD: u32 = 256u;
var<workgroup> qs: array<f32, MAX_HD>;
var<workgroup> sc: array<f32, CH>;
var<workgroup> red: array<f32, WG>;

fn kv_at(i: u32) -> vec2<f32> {
    // Values i, i + 1 (i even).
    if (p.kv.f16 != 0u) {
        return unpack2x16float(pool[i / 2u]);
    }
    return vec2<f32>(bitcast<f32>(pool[i]), bitcast<f32>(pool[i + 1u]));
}

fn reduce(v: f32, li: u32, is_max: bool) -> f32 {
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
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    let t = wg.y;
    if (t >= n_tokens()) {
        return;
    }
    let hd = p.head_dim;
    let kvh = h / (p.n_heads / p.n_kv_heads);
    for (var d = li; d < hd; d += WG) {
        qs[d] = qkv[t * p.row_stride + h * hd + d];
    }
    let pos = token_pos(t);
    var first = 0u;
    if (p.window != 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    var m = -3.4e38;
    var l = 0.0;
    // head_dim <= MAX_HD == WG, so every dim has a thread in slice 0.
    let slices = WG / hd;
    let dv = li % hd;
    let slice = li / hd;
    var acc = 0.0;
    workgroupBarrier();
    for (var start = first; start <= pos; start += CH) {
        let n = min(CH, pos + 1u - start);
        var local_max = -3.4e38;
        for (var j = li; j < n; j += WG) {
            let q = start + j;
            let page = page_of(t, p.layer, q / p.kv.page_size);
            let at = kv_index(p.kv, page, 0u, q % p.kv.page_size, kvh * hd);
            var s = 0.0;
            for (var d = 0u; d < hd; d += 2u) {
                let k = kv_at(at + d);
                s += qs[d] * k.x + qs[d + 1u] * k.y;
            }
            s *= p.scale;
            if (p.softcap != 0.0) {
                s = p.softcap * tanh(clamp(s / p.softcap, -15.0, 15.0));
            }
            sc[j] = s;
            local_max = max(local_max, s);
        }
        let m_new = max(m, reduce(local_max, li, true));
        var local_sum = 0.0;
        for (var j = li; j < n; j += WG) {
            let e = exp(sc[j] - m_new);
            sc[j] = e;
            local_sum += e;
        }
        let alpha = exp(m - m_new);
        l = l * alpha + reduce(local_sum, li, false);
        m = m_new;
        if (slice < slices) {
            var a = acc * alpha;
            for (var j = slice; j < n; j += slices) {
                let q = start + j;
                let page = page_of(t, p.layer, q / p.kv.page_size);
                let at = kv_index(p.kv, page, 1u, q % p.kv.page_size, kvh * hd + dv);
                var v = 0.0;
                if (p.kv.f16 != 0u) {
                    v = unpack2x16float(pool[at / 2u])[at % 2u];
                } else {
                    v = bitcast<f32>(pool[at]);
                }
                a += sc[j] * v;
            }
            acc = a;
        }
        workgroupBarrier();
    }
    red[li] = select(0.0, acc, slice < slices);
    workgroupBarrier();
    if (slice == 0u) {
        var total = 0.0;
        for (var k = 0u; k < slices; k++) {
            total += red[k * hd + dv];
        }
        out[t * p.n_heads * hd + h * hd + dv] = total / l;
    }
}
