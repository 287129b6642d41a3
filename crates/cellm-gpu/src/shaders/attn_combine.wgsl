// The splits of `attention.wgsl` merged: for each (head, token), out = sum_s e^(m_s - M)
// acc_s / sum_s e^(m_s - M) l_s, M the largest split max.
struct Params {
    n_heads: u32,
    head_dim: u32,
    _pad0: u32, _pad1: u32, _pad2: u32, _pad3: u32, _pad4: u32, _pad5: u32,
    _pad6: u32, _pad7: u32, _pad8: u32, _pad9: u32, _pad10: u32, _pad11: u32, _pad12: u32,
    _pad13: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    let t = wg.y;
    if (t >= n_tokens()) {
        return;
    }
    let hd = p.head_dim;
    let ns = n_splits();
    let first = (t * p.n_heads + h) * ns * (hd + 2u);
    var mx = -3.4e38;
    for (var s = 0u; s < ns; s++) {
        mx = max(mx, part[first + s * (hd + 2u) + hd]);
    }
    var l = 0.0;
    for (var s = 0u; s < ns; s++) {
        let at = first + s * (hd + 2u);
        l += exp(part[at + hd] - mx) * part[at + hd + 1u];
    }
    for (var d = li; d < hd; d += 64u) {
        var v = 0.0;
        for (var s = 0u; s < ns; s++) {
            let at = first + s * (hd + 2u);
            v += exp(part[at + hd] - mx) * part[at + d];
        }
        out[(t * p.n_heads + h) * hd + d] = v / l;
    }
}
