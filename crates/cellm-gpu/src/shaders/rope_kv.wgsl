// One workgroup per (head, token) of the fused q|k|v rows: q and k heads get their per-head
// RMSNorm (when the model has one) and RoPE in place; a k head's workgroup then stores its
// key and value rows at the token's position in the KV pool.
struct Params {
    kv: Kv,
    n_heads: u32,
    n_kv_heads: u32,
    head_dim: u32,
    half: u32,        // rotated pairs per head (0: no RoPE)
    row_stride: u32,  // floats per q|k|v row
    layer: u32,
    qk_norm: u32,
    eps: f32,
    rope_table: u32,  // which RoPE (cos/sin table) this layer uses
    _pad0: u32, _pad1: u32, _pad2: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> q_norm: array<f32>;
@group(0) @binding(3) var<storage, read> k_norm: array<f32>;
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> pool: array<u32>;

const WG: u32 = 64u;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let head = wg.x;
    let t = wg.y;
    if (t >= n_tokens()) {
        return;
    }
    let is_k = head >= p.n_heads;
    let hd = p.head_dim;
    let base = t * p.row_stride + head * hd;
    var inv = 1.0;
    if (p.qk_norm != 0u) {
        var ss = 0.0;
        for (var d = li; d < hd; d += WG) {
            ss += qkv[base + d] * qkv[base + d];
        }
        red[li] = ss;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (li < s) {
                red[li] += red[li + s];
            }
            workgroupBarrier();
        }
        inv = inverseSqrt(red[0] / f32(hd) + p.eps);
    }
    let rot = 2u * p.half;
    for (var d = li; d < hd; d += WG) {
        if (d < p.half || d >= rot) {
            var u = qkv[base + d];
            if (p.qk_norm != 0u) {
                u = u * inv * select(q_norm[d], k_norm[d], is_k);
            }
            if (d < p.half) {
                var v = qkv[base + d + p.half];
                if (p.qk_norm != 0u) {
                    v = v * inv * select(q_norm[d + p.half], k_norm[d + p.half], is_k);
                }
                let cs = rope[p.rope_table * st[5] + t * p.half + d];
                qkv[base + d] = u * cs.x - v * cs.y;
                qkv[base + d + p.half] = v * cs.x + u * cs.y;
            } else {
                qkv[base + d] = u;
            }
        }
    }
    if (!is_k) {
        return;
    }
    storageBarrier();
    let kvh = head - p.n_heads;
    let pos = token_pos(t);
    let page = page_of(t, p.layer, pos / p.kv.page_size);
    let slot = pos % p.kv.page_size;
    let v_base = t * p.row_stride + (p.n_heads + p.n_kv_heads + kvh) * hd;
    let at_k = kv_index(p.kv, page, 0u, slot, kvh * hd);
    let at_v = kv_index(p.kv, page, 1u, slot, kvh * hd);
    if (p.kv.f16 != 0u) {
        for (var d = 2u * li; d < hd; d += 2u * WG) {
            pool[(at_k + d) / 2u] = pack2x16float(vec2<f32>(qkv[base + d], qkv[base + d + 1u]));
            pool[(at_v + d) / 2u] = pack2x16float(vec2<f32>(qkv[v_base + d], qkv[v_base + d + 1u]));
        }
    } else {
        for (var d = li; d < hd; d += WG) {
            pool[at_k + d] = bitcast<u32>(qkv[base + d]);
            pool[at_v + d] = bitcast<u32>(qkv[v_base + d]);
        }
    }
}
