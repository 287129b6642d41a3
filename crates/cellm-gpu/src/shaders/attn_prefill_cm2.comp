#version 450
// Prefill attention on NVIDIA's workgroup-scope cooperative matrices
// (VK_NV_cooperative_matrix2), one pass with an online softmax (flash attention), compiled
// ahead of time like gemm_cm2.comp (tools/compile_spirv.sh, -DHD=64 or 128) and passed
// through wgpu. A workgroup takes BR consecutive tokens of one query head; an iteration
// copies PAGES f16 KV pages (16 positions a page: the engine's page size) of keys and of
// values side by side into shared memory, then takes them as one product of KB keys (one row
// max, one conversion and one rescale an iteration; on an H200, of an 8-layer 3B-shaped
// pp512 step, 2 pages an iteration took 0.55 ms, 4 pages 0.61, and 4 pages the 3B's 28
// layers 2.55 ms where a product per page took 2.8; docs/benchmarks.md). Rows of different
// sessions in one block run as segments, each over its own session's pages, the other rows
// masked. The per-row masks (causal, sliding window, segment) read each row's position and
// first visible position from shared memory, on the tiles that some row does not see whole.
// Params are attention.wgsl's (immediates); bindings as attn_prefill_coop.wgsl's 1 (q|k|v),
// 2 (ctx), 5 (the pool) and 7 (the step), numbered densely as wgpu-hal's Vulkan backend
// numbers them (gemm_cm2.comp says why). -DHALF_OUT writes ctx in f16 (clamped to its
// range), as the o projection's prep would round it: where that projection runs in passes,
// ctx is its GEMM's input and the prep is skipped.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_EXT_control_flow_attributes : require

const uint BR = 64;
const uint PS = 16;
const uint PAGES = 2;
const uint WG = 128;

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;
layout(push_constant) uniform Params {
    uint page_size;
    uint kv_dim;
    uint kv_f16;
    uint kv_pad;
    uint n_heads;
    uint n_kv_heads;
    uint head_dim;
    uint row_stride;
    uint layer;
    uint window;
    float scale;
    float softcap;
    uint rest[4];
} p;
layout(binding = 0) readonly buffer Qkv { float qkv[]; };
#ifdef HALF_OUT
layout(binding = 1) writeonly buffer Ctx { float16_t ctx[]; };
#else
layout(binding = 1) writeonly buffer Ctx { float ctx[]; };
#endif
// The f16 pool, 8 halves a load.
layout(binding = 2) readonly buffer Pool { uvec4 pool8[]; };
// An iteration's keys and values: KB rows of HD each, a row RS loads apart. (The 16 bytes
// of padding a row put the rows that one matrix load reads in different banks: with rows
// 256 bytes apart they all fell in the same ones, and on an H200 the 3B's attention took
// 0.78 ms a step per 8 layers against 0.61 with the padding; docs/benchmarks.md.)
const uint KB = PAGES * PS;
const uint RS = HD / 8 + 1;
shared uvec4 k_sh[KB * RS];
shared uvec4 v_sh[KB * RS];
// Where each of the iteration's pages starts (its keys, this kv head's columns).
shared uint page_base[PAGES];
layout(binding = 3) readonly buffer Step { uint st[]; };

// step.wgsl's accessors.
uint token_pos(uint t) { return st[8 + 4 * t + 1]; }
uint table_of(uint t) { return st[8 + 4 * t + 2]; }
uint page_of(uint t, uint index) {
    return st[8 + 4 * st[3] + st[4] + p.layer * st[2] + table_of(t) + index];
}
uint window_start(uint pos) { return p.window != 0 && pos + 1 > p.window ? pos + 1 - p.window : 0; }

// Each row's last and first visible position in the current segment (first past last: none).
shared uint row_last[BR];
shared uint row_first[BR];
// Each row's page table and position, read once by its own invocation (one invocation
// reading them in turn waited on 2 BR dependent loads).
shared uint row_table[BR];
shared uint row_pos[BR];
// The segment: rows up to s1, positions [lo, hi) of one session; every row of it sees the
// positions [all_lo, all_hi].
shared uint seg_s1, seg_lo, seg_hi, seg_all_lo, seg_all_hi;

const float NEG_INF = uintBitsToFloat(0xFF800000u);
// The running max starts here, not at -inf: a fully masked tile's exp(-inf - m) is then 0.
const float NEG_HALF_MAX = uintBitsToFloat(0xFEFFFFFFu);

float max_of(const in float a, const in float b) { return max(a, b); }
float first_of(const in float a, const in float b) { return a; }
float exp_of(const in uint r, const in uint c, const in float e) { return exp(e); }
float max2(const in uint r, const in uint c, const in float a, const in float b) { return max(a, b); }
float to_f16_range(const in uint r, const in uint c, const in float e) { return clamp(e, -65504.0, 65504.0); }
float capped(const in uint r, const in uint c, const in float e, const in float cap) {
    return cap * tanh(clamp(e / cap, -15.0, 15.0));
}
float masked(const in uint r, const in uint c, const in float e, const in uint key0) {
    uint q = key0 + c;
    return q >= row_first[r] && q <= row_last[r] ? e : NEG_INF;
}

#define ACC(C) coopmat<float, gl_ScopeWorkgroup, BR, C, gl_MatrixUseAccumulator>

void main() {
    const uint h = gl_WorkGroupID.x;
    // The last blocks (the longest causal ranges) first, so the short ones fill the tail.
    const uint t0 = (gl_NumWorkGroups.y - 1 - gl_WorkGroupID.y) * BR;
    const uint n = st[0];
    if (t0 >= n) {
        return;
    }
    const uint rows = min(BR, n - t0);
    const uint kvh = h / (p.n_heads / p.n_kv_heads);
    const uint li = gl_LocalInvocationIndex;

    // The query tile, times the scale, in f16 (as the other prefill kernels round it).
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lq =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    lq = setTensorLayoutDimensionNV(lq, n, p.row_stride);
    lq = setTensorLayoutStrideNV(lq, p.row_stride, 1);
    ACC(HD) qf;
    coopMatLoadTensorNV(qf, qkv, 0, sliceTensorLayoutNV(lq, t0, BR, h * HD, HD));
    qf *= p.scale;
    coopMatPerElementNV(qf, qf, to_f16_range);
    coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseA> q =
        coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseA>(qf);

    // A page: PS rows of keys, then PS of values, kv_dim apart.
    const uint plane = PS * p.kv_dim;
    coopmat<float16_t, gl_ScopeWorkgroup, KB, PS, gl_MatrixUseB> ones =
        coopmat<float16_t, gl_ScopeWorkgroup, KB, PS, gl_MatrixUseB>(1.0);

    ACC(HD) o = ACC(HD)(0.0);
    ACC(PS) l = ACC(PS)(0.0);
    ACC(PS) m = ACC(PS)(NEG_HALF_MAX);
    if (li < rows) {
        row_table[li] = table_of(t0 + li);
        row_pos[li] = token_pos(t0 + li);
    }
    uint s0 = 0;
    while (s0 < rows) {
        barrier();
        if (li == 0) {
            const uint table = row_table[s0];
            uint lo = window_start(row_pos[s0]);
            uint hi = row_pos[s0] + 1;
            uint all_lo = lo, all_hi = hi - 1;
            uint s1 = s0 + 1;
            while (s1 < rows && row_table[s1] == table) {
                const uint pos = row_pos[s1];
                lo = min(lo, window_start(pos));
                hi = max(hi, pos + 1);
                all_lo = max(all_lo, window_start(pos));
                all_hi = min(all_hi, pos);
                s1++;
            }
            seg_s1 = s1;
            seg_lo = lo;
            seg_hi = hi;
            seg_all_lo = all_lo;
            seg_all_hi = all_hi;
        }
        barrier();
        const uint s1 = seg_s1;
        const uint hi = seg_hi;
        if (li < BR) {
            const bool mine = li >= s0 && li < s1;
            const uint pos = mine ? row_pos[li] : 0;
            row_last[li] = pos;
            row_first[li] = mine ? window_start(pos) : 0xFFFFFFFFu;
        }
        barrier();
        const uint ts = t0 + s0;
        const uint last_page = (hi - 1) / PS;
        // Where one segment holds every row (rows past n are dropped on the store), tiles
        // that all rows see whole need no mask: all but the diagonal's in a causal prefill.
        const bool one_segment = s0 == 0 && s1 == rows;
        const uint all_lo = seg_all_lo, all_hi = seg_all_hi;
        for (uint pg = seg_lo / PS; pg <= last_page; pg += PAGES) {
            // Row i of the tile is page pg + i / PS's row i % PS (pages past the last: the
            // last again, masked whole), HD / 8 loads a row.
            barrier();
            if (li < PAGES) {
                page_base[li] = page_of(ts, min(pg + li, last_page)) * 2 * plane + kvh * HD;
            }
            barrier();
            [[unroll]] for (uint k = 0; k < KB * HD / 8 / WG; k++) {
                const uint e = li + k * WG;
                const uint i = e / (HD / 8), c = e % (HD / 8);
                const uint at = (page_base[i / PS] + (i % PS) * p.kv_dim) / 8 + c;
                k_sh[i * RS + c] = pool8[at];
                v_sh[i * RS + c] = pool8[at + plane / 8];
            }
            barrier();
            coopmat<float16_t, gl_ScopeWorkgroup, HD, KB, gl_MatrixUseB> kt;
            coopMatLoad(kt, k_sh, 0, RS, gl_CooperativeMatrixLayoutColumnMajor);
            ACC(KB) sk = coopMatMulAdd(q, kt, ACC(KB)(0.0));
            if (p.softcap != 0.0) {
                coopMatPerElementNV(sk, sk, capped, p.softcap);
            }
            if (!one_segment || pg * PS < all_lo || (pg + PAGES) * PS - 1 > all_hi) {
                coopMatPerElementNV(sk, sk, masked, pg * PS);
            }
            // m = max(m, the tile's row max); p = exp(s - m); l = l e^(m_old - m) + rowsum(p)
            // (m and l: PS columns, each the row's value; m widened to KB for the exp.)
            ACC(PS) row_max;
            coopMatReduceNV(row_max, sk, gl_CooperativeMatrixReduceRowNV, max_of);
            ACC(PS) m_old = m;
            coopMatPerElementNV(m, row_max, max2, m_old);
            ACC(PS) rescale;
            coopMatPerElementNV(rescale, m_old - m, exp_of);
            ACC(KB) m_kb;
            coopMatReduceNV(m_kb, m, gl_CooperativeMatrixReduceRowNV, first_of);
            coopMatPerElementNV(sk, sk - m_kb, exp_of);
            coopmat<float16_t, gl_ScopeWorkgroup, BR, KB, gl_MatrixUseA> pa =
                coopmat<float16_t, gl_ScopeWorkgroup, BR, KB, gl_MatrixUseA>(sk);
            l = rescale * l + coopMatMulAdd(pa, ones, ACC(PS)(0.0));
            ACC(HD) rescale_o;
            coopMatReduceNV(rescale_o, rescale, gl_CooperativeMatrixReduceRowNV, first_of);
            o *= rescale_o;
            coopmat<float16_t, gl_ScopeWorkgroup, KB, HD, gl_MatrixUseB> v;
            coopMatLoad(v, v_sh, 0, RS, gl_CooperativeMatrixLayoutRowMajor);
            o = coopMatMulAdd(pa, v, o);
        }
        s0 = s1;
    }
    // Each row divided by its sum (rows that saw nothing stay 0), to ctx.
    ACC(HD) inv;
    coopMatReduceNV(inv, l, gl_CooperativeMatrixReduceRowNV, first_of);
    [[unroll]] for (uint k = 0; k < inv.length(); k++) {
        inv[k] = inv[k] == 0.0 ? 0.0 : 1.0 / inv[k];
    }
    o *= inv;
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> lo =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    lo = setTensorLayoutDimensionNV(lo, n, p.n_heads * HD);
    lo = setTensorLayoutStrideNV(lo, p.n_heads * HD, 1);
#ifdef HALF_OUT
    coopMatPerElementNV(o, o, to_f16_range);
    coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator> oh =
        coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator>(o);
    coopMatStoreTensorNV(oh, ctx, 0, sliceTensorLayoutNV(lo, t0, BR, h * HD, HD));
#else
    coopMatStoreTensorNV(o, ctx, 0, sliceTensorLayoutNV(lo, t0, BR, h * HD, HD));
#endif
}
