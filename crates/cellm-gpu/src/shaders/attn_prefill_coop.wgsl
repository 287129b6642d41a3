// Prefill attention on cooperative matrices (tensor cores), where the GEMM has them
// (16x16x16, f16 in, f32 sums, subgroups of 32): a workgroup of NSG subgroups takes BQ = 16
// NSG consecutive tokens of one query head, subgroup s rows 16 s .. 16 s + 15. The query
// tile (times the scale, in f16) is held in registers as HD / 16 A-matrices. Two passes over
// the causal range, BK = 32 positions a tile through shared memory (f16): the first
// computes S = Q K^T and each row's max and sum of exp (two lanes a row, 16 positions each,
// merged at the end); the second computes S again, P = exp(S - max) in f16, and adds P V
// into HD / 16 f32 accumulators, so no accumulator is ever rescaled (cooperative matrices
// have no per-row scaling); the epilogue divides by the row's sum. Recomputing Q K^T costs
// a third more multiplies and saves a rescale per tile. Rows of different sessions in one
// block run as segments, as in `attn_prefill.wgsl`; the loop bounds come through
// `workgroupUniformLoad` (cooperative operations need uniform control flow). `Params` and
// bindings 1, 2 and 5 are `attn_prefill.wgsl`'s. Where the step splits the positions (the
// step buffer's `n_splits`, z the split), a workgroup takes the positions of its split
// only and writes its rows' unnormalized sums, max and sum of exp to `part` in the decode
// attention's layout, for `attn_combine.wgsl`: a long causal range then runs in parallel
// rather than one tile after another. Prepended: HD (a multiple of 16), NSG (2 or more).
// `//@` lines are filled in by attn_prefill.rs.
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> ctx: array<f32>;
@group(0) @binding(3) var<storage, read_write> part: array<f32>;
@group(0) @binding(5) var<storage, read> pool: array<u32>;

const BQ: u32 = 16u * NSG;
const WG: u32 = 32u * NSG;
const BK: u32 = 32u;
const HD4: u32 = HD / 4u;
// vec4<f16> per shared row: the row and 16 bytes of padding. Cooperative loads take the
// stride in these units (as gemm_coop.wgsl).
const LDK: u32 = HD4 + 2u;
const LDP: u32 = BK / 4u + 2u;
// Keys (the query tile first: BQ >= BK rows), values, each subgroup's 16 x 32 scores
// (two 16 x 16 tiles, column-major) and its P in f16 (row-major), each row's sum.
var<workgroup> kt: array<vec4<f16>, BQ * LDK>;
var<workgroup> vt: array<vec4<f16>, BK * LDK>;
var<workgroup> ss: array<f32, NSG * 512u>;
var<workgroup> pt: array<vec4<f16>, NSG * 16u * LDP>;
var<workgroup> lrow: array<f32, BQ>;
var<workgroup> mrow: array<f32, BQ>;
struct Seg {
    rows: u32,
    s1: u32,
    lo: u32,
    hi: u32,
}
var<workgroup> seg: Seg;

// Keys (plane 0) or values (plane 1) of positions [start, start + BK) of token `t`'s session
// into `kt` or `vt` as f16, zeros from `hi` on.
fn kv4(t: u32, kvh: u32, plane: u32, q: u32, d4: u32) -> vec4<f16> {
    let page = page_of(t, p.layer, q / p.kv.page_size);
    let at = kv_index(p.kv, page, plane, q % p.kv.page_size, kvh * HD + 4u * d4);
    if (p.kv.f16 != 0u) {
        let w = at >> 1u;
        // (Exact: f16 -> f32 -> f16.)
        return vec4<f16>(vec4<f32>(unpack2x16float(pool[w]), unpack2x16float(pool[w + 1u])));
    }
    let v = bitcast<vec4<f32>>(vec4<u32>(pool[at], pool[at + 1u], pool[at + 2u], pool[at + 3u]));
    return vec4<f16>(clamp(v, vec4<f32>(-65504.0), vec4<f32>(65504.0)));
}

fn load_keys(t: u32, kvh: u32, start: u32, hi: u32, li: u32) {
    for (var e = li; e < BK * HD4; e += WG) {
        let j = e / HD4;
        let d4 = e % HD4;
        var v = vec4<f16>(0.0h);
        if (start + j < hi) {
            v = kv4(t, kvh, 0u, start + j, d4);
        }
        kt[j * LDK + d4] = v;
    }
}

fn load_values(t: u32, kvh: u32, start: u32, hi: u32, li: u32) {
    for (var e = li; e < BK * HD4; e += WG) {
        let j = e / HD4;
        let d4 = e % HD4;
        var v = vec4<f16>(0.0h);
        if (start + j < hi) {
            v = kv4(t, kvh, 1u, start + j, d4);
        }
        vt[j * LDK + d4] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) li: u32, @builtin(subgroup_id) sg: u32,
        @builtin(subgroup_invocation_id) lane: u32) {
    let h = wg.x;
    // The last blocks (the longest causal ranges) first, so the short ones fill the tail.
    let t0 = (nwg.y - 1u - wg.y) * BQ;
    let kvh = h / (p.n_heads / p.n_kv_heads);
    // This split's positions.
    let split_lo = wg.z * split_len();
    let split_hi = split_lo + split_len();
    if (li == 0u) {
        let nt = n_tokens();
        seg.rows = select(0u, min(BQ, nt - t0), t0 < nt);
    }
    let rows = workgroupUniformLoad(&seg).rows;
    // A zeroed tile for the accumulators to start from; the query tile (scaled) into kt.
    for (var e = li; e < NSG * 512u; e += WG) {
        ss[e] = 0.0;
    }
    for (var e = li; e < BQ * HD4; e += WG) {
        let rr = e / HD4;
        var v = vec4<f32>(0.0);
        if (rr < rows) {
            let at = (t0 + rr) * p.row_stride + h * HD + 4u * (e % HD4);
            v = vec4<f32>(qkv[at], qkv[at + 1u], qkv[at + 2u], qkv[at + 3u]) * p.scale;
        }
        kt[rr * LDK + e % HD4] = vec4<f16>(clamp(v, vec4<f32>(-65504.0), vec4<f32>(65504.0)));
    }
    workgroupBarrier();
    let zero = coopLoad<coop_mat16x16<f32, C>>(&ss[0], 16u);
//@QLOAD
//@OZERO
    // This lane's row (two lanes a row) and its half of a tile's 32 positions.
    let lr = lane / 2u;
    let half = lane % 2u;
    let r = sg * 16u + lr;
    let t = t0 + r;
    var pos = 0u;
    var first = 1u;
    if (r < rows) {
        pos = token_pos(t);
        first = window_start(pos);
    }
    let sbase = sg * 512u + half * 256u + lr;
    let pbase = (sg * 16u + lr) * LDP + half * 4u;
    var s0 = 0u;
    while (s0 < rows) {
        workgroupBarrier();
        if (li == 0u) {
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
            seg.s1 = s1;
            seg.lo = max(lo, split_lo);
            seg.hi = min(hi, split_hi);
        }
        let sgm = workgroupUniformLoad(&seg);
        let mine = r >= s0 && r < sgm.s1;
        let ts = t0 + s0;
        // Pass 1: each row's max and sum of exp over its positions.
        var m = -3.4e38;
        var l = 0.0;
        for (var start = sgm.lo; start < sgm.hi; start += BK) {
            workgroupBarrier();
            load_keys(ts, kvh, start, sgm.hi, li);
            workgroupBarrier();
//@SCORES
            workgroupBarrier();
            var x: array<f32, 16>;
            var mt = -3.4e38;
            for (var k = 0u; k < 16u; k++) {
                let q = start + 16u * half + k;
                x[k] = score(ss[sbase + 16u * k]);
                if (mine && q >= first && q <= pos && q < sgm.hi) {
                    mt = max(mt, x[k]);
                }
            }
            let m_new = max(m, mt);
            var sum = 0.0;
            for (var k = 0u; k < 16u; k++) {
                let q = start + 16u * half + k;
                if (mine && q >= first && q <= pos && q < sgm.hi) {
                    sum += exp(x[k] - m_new);
                }
            }
            l = l * exp(m - m_new) + sum;
            m = m_new;
        }
        let m_o = subgroupShuffleXor(m, 1u);
        let l_o = subgroupShuffleXor(l, 1u);
        let mx = max(m, m_o);
        let lsum = l * exp(m - mx) + l_o * exp(m_o - mx);
        if (mine && half == 0u) {
            lrow[r] = lsum;
            mrow[r] = mx;
        }
        // Pass 2: P = exp(S - max) times the values.
        for (var start = sgm.lo; start < sgm.hi; start += BK) {
            workgroupBarrier();
            load_keys(ts, kvh, start, sgm.hi, li);
            load_values(ts, kvh, start, sgm.hi, li);
            workgroupBarrier();
//@SCORES
            workgroupBarrier();
            var pv: array<f32, 16>;
            for (var k = 0u; k < 16u; k++) {
                let q = start + 16u * half + k;
                let x = score(ss[sbase + 16u * k]);
                if (mine && q >= first && q <= pos && q < sgm.hi) {
                    pv[k] = exp(x - mx);
                }
            }
            for (var i = 0u; i < 4u; i++) {
                pt[pbase + i] = vec4<f16>(vec4<f32>(pv[4u * i], pv[4u * i + 1u], pv[4u * i + 2u],
                                                    pv[4u * i + 3u]));
            }
            workgroupBarrier();
//@PV
        }
        s0 = sgm.s1;
    }
    workgroupBarrier();
//@STORE
}

// A raw score (q already scaled) after the soft-cap, where the model has one.
fn score(s: f32) -> f32 {
    if (p.softcap != 0.0) {
        return p.softcap * tanh(clamp(s / p.softcap, -15.0, 15.0));
    }
    return s;
}

// This lane's 8 values of the 16 x 16 output tile staged at `base` (rows of the subgroup's,
// dims d0 ..): divided by their rows' sums, to ctx; or, where the step splits the
// positions, as they are to split `s` of `part`, each row's max and sum after its HD sums.
fn emit(base: u32, lane: u32, sg: u32, t0: u32, rows: u32, h: u32, d0: u32, s: u32) {
    let ns = n_splits();
    for (var e = 0u; e < 8u; e++) {
        let i = lane + 32u * e;
        let r = sg * 16u + i % 16u;
        if (r >= rows) {
            continue;
        }
        let l = lrow[r];
        let d = d0 + i / 16u;
        if (ns > 1u) {
            let at = (((t0 + r) * p.n_heads + h) * ns + s) * (HD + 2u);
            part[at + d] = ss[base + i];
            if (d == 0u) {
                part[at + HD] = mrow[r];
                part[at + HD + 1u] = l;
            }
            continue;
        }
        var o = 0.0;
        if (l > 0.0) {
            o = ss[base + i] / l;
        }
        ctx[((t0 + r) * p.n_heads + h) * HD + d] = o;
    }
}
