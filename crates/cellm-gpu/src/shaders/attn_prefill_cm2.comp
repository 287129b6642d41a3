#version 450
// Prefill attention on NVIDIA's workgroup-scope cooperative matrices
// (VK_NV_cooperative_matrix2), one pass with an online softmax (flash attention), compiled
// ahead of time like gemm_cm2.comp (tools/compile_spirv.sh, -DHD=64 or 128) and passed
// through wgpu. A workgroup takes BR consecutive tokens of one query head; the keys and
// values come straight from the f16 KV pages (16 positions a page: the engine's page size),
// PAGES pages an iteration. Rows of different sessions in one block run as segments, each
// over its own session's pages, the other rows masked. The per-row masks (causal, sliding
// window, segment) read each row's position and first visible position from shared memory.
// Params are attention.wgsl's (immediates); bindings as attn_prefill_coop.wgsl's 1 (q|k|v),
// 2 (ctx), 5 (the pool) and 7 (the step), numbered densely as wgpu-hal's Vulkan backend
// numbers them (gemm_cm2.comp says why).
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_EXT_control_flow_attributes : require

const uint BR = 64;
const uint PS = 16;
const uint PAGES = 4;
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
layout(binding = 1) writeonly buffer Ctx { float ctx[]; };
layout(binding = 2) readonly buffer Pool { float16_t pool[]; };
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
// The segment: rows up to s1, positions [lo, hi) of one session.
shared uint seg_s1, seg_lo, seg_hi;

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

    // A page's keys or values of this kv head: PS rows of HD, kv_dim apart.
    tensorLayoutNV<2> lkv = createTensorLayoutNV(2);
    lkv = setTensorLayoutDimensionNV(lkv, PS, p.kv_dim);
    lkv = setTensorLayoutStrideNV(lkv, p.kv_dim & ~7u, 1);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);
    const uint plane = PS * p.kv_dim;
    coopmat<float16_t, gl_ScopeWorkgroup, PS, PS, gl_MatrixUseB> ones =
        coopmat<float16_t, gl_ScopeWorkgroup, PS, PS, gl_MatrixUseB>(1.0);

    ACC(HD) o = ACC(HD)(0.0);
    ACC(PS) l = ACC(PS)(0.0);
    ACC(PS) m = ACC(PS)(NEG_HALF_MAX);
    uint s0 = 0;
    while (s0 < rows) {
        barrier();
        if (li == 0) {
            const uint table = table_of(t0 + s0);
            uint lo = window_start(token_pos(t0 + s0));
            uint hi = token_pos(t0 + s0) + 1;
            uint s1 = s0 + 1;
            while (s1 < rows && table_of(t0 + s1) == table) {
                lo = min(lo, window_start(token_pos(t0 + s1)));
                hi = max(hi, token_pos(t0 + s1) + 1);
                s1++;
            }
            seg_s1 = s1;
            seg_lo = lo;
            seg_hi = hi;
        }
        barrier();
        const uint s1 = seg_s1;
        const uint hi = seg_hi;
        if (li < BR) {
            const bool mine = li >= s0 && li < s1;
            const uint pos = mine ? token_pos(t0 + li) : 0;
            row_last[li] = pos;
            row_first[li] = mine ? window_start(pos) : 0xFFFFFFFFu;
        }
        barrier();
        const uint ts = t0 + s0;
        const uint last_page = (hi - 1) / PS;
        for (uint pg = seg_lo / PS; pg <= last_page; pg += PAGES) {
            ACC(PS) s[PAGES];
            coopmat<float16_t, gl_ScopeWorkgroup, PS, HD, gl_MatrixUseB> v[PAGES];
            [[unroll]] for (uint j = 0; j < PAGES; j++) {
                // Pages past the last are read again from the last and masked whole.
                const uint base = page_of(ts, min(pg + j, last_page)) * 2 * plane;
                coopmat<float16_t, gl_ScopeWorkgroup, HD, PS, gl_MatrixUseB> kt;
                coopMatLoadTensorNV(kt, pool, base, sliceTensorLayoutNV(lkv, 0, PS, kvh * HD, HD),
                                    transposed);
                coopMatLoadTensorNV(v[j], pool, base + plane,
                                    sliceTensorLayoutNV(lkv, 0, PS, kvh * HD, HD));
                s[j] = coopMatMulAdd(q, kt, ACC(PS)(0.0));
                if (p.softcap != 0.0) {
                    coopMatPerElementNV(s[j], s[j], capped, p.softcap);
                }
                coopMatPerElementNV(s[j], s[j], masked, (pg + j) * PS);
            }
            // m = max(m, the tile's row max); p = exp(s - m); l = l e^(m_old - m) + rowsum(p).
            ACC(PS) row_max;
            coopMatReduceNV(row_max, s[0], gl_CooperativeMatrixReduceRowNV, max_of);
            [[unroll]] for (uint j = 1; j < PAGES; j++) {
                ACC(PS) mj;
                coopMatReduceNV(mj, s[j], gl_CooperativeMatrixReduceRowNV, max_of);
                coopMatPerElementNV(row_max, row_max, max2, mj);
            }
            ACC(PS) m_old = m;
            coopMatPerElementNV(m, row_max, max2, m_old);
            ACC(PS) rescale;
            coopMatPerElementNV(rescale, m_old - m, exp_of);
            ACC(PS) row_sum = ACC(PS)(0.0);
            coopmat<float16_t, gl_ScopeWorkgroup, BR, PS, gl_MatrixUseA> pa[PAGES];
            [[unroll]] for (uint j = 0; j < PAGES; j++) {
                ACC(PS) pj;
                coopMatPerElementNV(pj, s[j] - m, exp_of);
                pa[j] = coopmat<float16_t, gl_ScopeWorkgroup, BR, PS, gl_MatrixUseA>(pj);
                row_sum = coopMatMulAdd(pa[j], ones, row_sum);
            }
            l = rescale * l + row_sum;
            ACC(HD) rescale_o;
            coopMatReduceNV(rescale_o, rescale, gl_CooperativeMatrixReduceRowNV, first_of);
            o *= rescale_o;
            [[unroll]] for (uint j = 0; j < PAGES; j++) {
                o = coopMatMulAdd(pa[j], v[j], o);
            }
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
    coopMatStoreTensorNV(o, ctx, 0, sliceTensorLayoutNV(lo, t0, BR, h * HD, HD));
}
