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

const WG: u32 = 256u;
// Groups of threads that take every G-th split of each output.
const G: u32 = 4u;
const MAX_HD: u32 = 256u;
var<workgroup> red: array<f32, WG>;
var<workgroup> sums: array<f32, 1024>;  // G * MAX_HD

fn tree(li: u32, is_max: bool) -> f32 {
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
    let ns = n_splits();
    let row = hd + 2u;
    let first = (t * p.n_heads + h) * ns * row;
    // The splits' max and denominator, every thread taking every WG-th split.
    var mx = -3.4e38;
    for (var s = li; s < ns; s += WG) {
        mx = max(mx, part[first + s * row + hd]);
    }
    red[li] = mx;
    mx = tree(li, true);
    var l = 0.0;
    for (var s = li; s < ns; s += WG) {
        let at = first + s * row;
        l += exp(part[at + hd] - mx) * part[at + hd + 1u];
    }
    red[li] = l;
    l = tree(li, false);
    // Group g sums splits g, g + G, ... of each output, four splits a pass.
    let g = li / (WG / G);
    let lane = li % (WG / G);
    for (var d = lane; d < hd; d += WG / G) {
        var v = vec4<f32>(0.0);
        var s = g;
        for (; s + 3u * G < ns; s += 4u * G) {
            let a = first + s * row;
            let b = a + G * row;
            let c = b + G * row;
            let e = c + G * row;
            let m = exp(vec4<f32>(part[a + hd], part[b + hd], part[c + hd], part[e + hd]) - mx);
            v += m * vec4<f32>(part[a + d], part[b + d], part[c + d], part[e + d]);
        }
        for (; s < ns; s += G) {
            let a = first + s * row;
            v.x += exp(part[a + hd] - mx) * part[a + d];
        }
        sums[g * MAX_HD + d] = v.x + v.y + v.z + v.w;
    }
    workgroupBarrier();
    if (g == 0u) {
        for (var d = lane; d < hd; d += WG / G) {
            let v = sums[d] + sums[MAX_HD + d] + sums[2u * MAX_HD + d] + sums[3u * MAX_HD + d];
            out[(t * p.n_heads + h) * hd + d] = v / l;
        }
    }
}
