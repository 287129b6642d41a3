// Flash attention for steps of many tokens: a workgroup takes BQ consecutive tokens of one
// query head and streams the keys, then the values, of their causal range through shared
// memory BK positions at a time, each tile loaded once for all BQ rows, with an online
// softmax per row. Thread (row r, lane c) of the BQ x LPR threads scores keys c, c + LPR,
// ... of a tile against row r and sums value dims 4 (c + LPR i) .. +3 of that row, so a
// row's m, l and rescale factor stay in its LPR threads' registers. Rows of different
// sessions in one block (a mixed step) run as separate segments, each over its own page
// table; each row masks by its own position and window. `Params` and the bindings are
// `attention.wgsl`'s, except that the normalised output goes straight to `ctx` (no split,
// no combine). Prepended: HD (head dim), LPR (lanes per row; HD a multiple of 4 LPR), BQ,
// BK (a multiple of LPR).
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> ctx: array<f32>;
@group(0) @binding(5) var<storage, read> pool: array<u32>;

const WG: u32 = BQ * LPR;
const HD4: u32 = HD / 4u;
// Shared rows padded by one vec4, so the lanes of a row read different banks.
const HP: u32 = HD4 + 1u;
const NS: u32 = BK / LPR;
const NV: u32 = HD / (4u * LPR);
var<workgroup> qs: array<vec4<f32>, BQ * HP>;
var<workgroup> kvs: array<vec4<f32>, BK * HP>;
var<workgroup> ps: array<f32, BQ * BK>;
var<workgroup> red: array<f32, WG>;

// Keys (plane 0) or values (plane 1) of positions [start, start + BK) of token `t`'s session
// into `kvs`, zeros from `hi` on (masked, but never NaN times 0).
fn load_tile(t: u32, kvh: u32, plane: u32, start: u32, hi: u32, li: u32) {
    for (var e = li; e < BK * HD4; e += WG) {
        let j = e / HD4;
        let d4 = e % HD4;
        let q = start + j;
        var v = vec4<f32>(0.0);
        if (q < hi) {
            let page = page_of(t, p.layer, q / p.kv.page_size);
            let at = kv_index(p.kv, page, plane, q % p.kv.page_size, kvh * HD + 4u * d4);
            if (p.kv.f16 != 0u) {
                let w = at >> 1u;
                v = vec4<f32>(unpack2x16float(pool[w]), unpack2x16float(pool[w + 1u]));
            } else {
                v = bitcast<vec4<f32>>(vec4<u32>(pool[at], pool[at + 1u], pool[at + 2u],
                                                 pool[at + 3u]));
            }
        }
        kvs[j * HP + d4] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    // The last blocks (the longest causal ranges) first, so the short ones fill the tail.
    let t0 = (nwg.y - 1u - wg.y) * BQ;
    let nt = n_tokens();
    if (t0 >= nt) {
        return;
    }
    let rows = min(BQ, nt - t0);
    let kvh = h / (p.n_heads / p.n_kv_heads);
    let r = li / LPR;
    let c = li % LPR;
    let t = t0 + r;
    for (var e = li; e < BQ * HD4; e += WG) {
        let rr = e / HD4;
        var v = vec4<f32>(0.0);
        if (rr < rows) {
            let at = (t0 + rr) * p.row_stride + h * HD + 4u * (e % HD4);
            v = vec4<f32>(qkv[at], qkv[at + 1u], qkv[at + 2u], qkv[at + 3u]);
        }
        qs[rr * HP + e % HD4] = v;
    }
    // Row r attends to [first, pos]; rows past the step's tokens to nothing.
    var pos = 0u;
    var first = 1u;
    if (r < rows) {
        pos = token_pos(t);
        first = window_start(pos);
    }
    var s0 = 0u;
    while (s0 < rows) {
        // The segment: rows s0 .. s1 - 1 of one session, attending within [lo, hi).
        let table = table_of(t0 + s0);
        var lo = window_start(token_pos(t0 + s0));
        var hi = token_pos(t0 + s0) + 1u;
        var s1 = s0 + 1u;
        while (s1 < rows && table_of(t0 + s1) == table) {
            lo = min(lo, window_start(token_pos(t0 + s1)));
            hi = max(hi, token_pos(t0 + s1) + 1u);
            s1++;
        }
        let mine = r >= s0 && r < s1;
        var m = -3.4e38;
        var l = 0.0;
        var acc: array<vec4<f32>, NV>;
        for (var start = lo; start < hi; start += BK) {
            workgroupBarrier();
            load_tile(t0 + s0, kvh, 0u, start, hi, li);
            workgroupBarrier();
            var s: array<f32, NS>;
            for (var d4 = 0u; d4 < HD4; d4++) {
                let qv = qs[r * HP + d4];
                for (var i = 0u; i < NS; i++) {
                    s[i] += dot(qv, kvs[(c + LPR * i) * HP + d4]);
                }
            }
            var tile_max = -3.4e38;
            for (var i = 0u; i < NS; i++) {
                let q = start + c + LPR * i;
                var x = s[i] * p.scale;
                if (p.softcap != 0.0) {
                    x = p.softcap * tanh(clamp(x / p.softcap, -15.0, 15.0));
                }
                s[i] = x;
                if (mine && q >= first && q <= pos) {
                    tile_max = max(tile_max, x);
                }
            }
            red[li] = tile_max;
            workgroupBarrier();
            var m_new = m;
            for (var k = 0u; k < LPR; k++) {
                m_new = max(m_new, red[r * LPR + k]);
            }
            workgroupBarrier();
            var tile_sum = 0.0;
            for (var i = 0u; i < NS; i++) {
                let q = start + c + LPR * i;
                var e = 0.0;
                if (mine && q >= first && q <= pos) {
                    e = exp(s[i] - m_new);
                }
                ps[r * BK + c + LPR * i] = e;
                tile_sum += e;
            }
            red[li] = tile_sum;
            // Every key read is done: the values may take the tile.
            workgroupBarrier();
            let alpha = exp(m - m_new);
            var sum = 0.0;
            for (var k = 0u; k < LPR; k++) {
                sum += red[r * LPR + k];
            }
            l = l * alpha + sum;
            m = m_new;
            load_tile(t0 + s0, kvh, 1u, start, hi, li);
            workgroupBarrier();
            for (var i = 0u; i < NV; i++) {
                acc[i] *= alpha;
            }
            for (var j = 0u; j < BK; j++) {
                let pj = ps[r * BK + j];
                for (var i = 0u; i < NV; i++) {
                    acc[i] += pj * kvs[j * HP + c + LPR * i];
                }
            }
        }
        if (mine) {
            for (var i = 0u; i < NV; i++) {
                let at = (t * p.n_heads + h) * HD + 4u * (c + LPR * i);
                let o = acc[i] / l;
                ctx[at] = o.x;
                ctx[at + 1u] = o.y;
                ctx[at + 2u] = o.z;
                ctx[at + 3u] = o.w;
            }
        }
        s0 = s1;
    }
}
