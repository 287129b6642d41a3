#version 450
// Prefill's GEMM on NVIDIA's workgroup-scope cooperative matrices (VK_NV_cooperative_matrix2),
// compiled to SPIR-V ahead of time (WGSL cannot say it; tools/compile_spirv.sh) and passed
// through wgpu as is (split_gemm.rs). f16 in, f32 out, no epilogue but a residual add:
//     acc[t][y_col + r] (+)= sum_k w[r][k] xh[t][k]
// for rows r < p.rows, tokens t < n (the step buffer's count), k < p.cols. w (the weights,
// f16 rows of p.cols) and xh (the tokens' inputs, f16 rows of p.cols, rows up to n rounded
// up to BN readable) come from split_gemm.wgsl's passes, or w straight from an f16 file;
// acc rows are p.y_stride floats. A workgroup of 256 takes BM rows by BN tokens, BK columns a
// load, UN loads an iteration (p.cols a multiple of UN * BK, p.rows of BM: the loads need
// no clamping). The driver stages the tiles in shared memory itself.
//
// -DGLU builds the GLU: a workgroup takes BM rows of the gate and the same rows of up over
// one token tile (two sums, one load of the tokens), and writes the down projection's f16
// inputs, out[t][r] = f16(act(gate[r] . xh[t]) * (up[r] . xh[t])), rows of p.rows halves:
// no f32 sums leave the workgroup and no epilogue pass runs. up's rows start p.y_col halves
// into its buffer (the gate's and up's f16 rows share one buffer where they were
// dequantized).
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_EXT_control_flow_attributes : require

const uint BM = 128;
const uint BN = 128;
const uint BK = 64;

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;
// linear.wgsl's Params, of which this kernel reads five.
layout(push_constant) uniform Params {
    uint rows;
    uint cols;
    uint x_stride;
    uint y_stride;
    uint y_col;
    uint row0;
    uint flags;
    uint rest[9];
} p;
// linear.wgsl's RESIDUAL: the sums start from the output tile (y += W x).
const uint RESIDUAL = 2;
// KernelId::Coopmat2Gemm's bindings 5 (w), 7 (step), 12 (xh) and 14 (acc), and
// Coopmat2Glu's 5 (the gate), 6 (up), 7, 12 and 14 (out), as wgpu-hal's Vulkan backend
// numbers them: a layout's entries densely, 0 up, in binding order.
#ifdef GLU
// linear.wgsl's GELU: act is gelu-tanh (else silu).
const uint GELU = 32;
layout(binding = 0) readonly buffer W { float16_t w[]; };
layout(binding = 1) readonly buffer WU { float16_t wu[]; };
layout(binding = 2) readonly buffer Step { uint st[]; };
layout(binding = 3) readonly buffer XH { float16_t xh[]; };
layout(binding = 4) writeonly buffer Out { float16_t out_h[]; };
#else
layout(binding = 0) readonly buffer W { float16_t w[]; };
layout(binding = 1) readonly buffer Step { uint st[]; };
layout(binding = 2) readonly buffer XH { float16_t xh[]; };
layout(binding = 3) buffer Acc { float acc[]; };
#endif

#define SUMS coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>

void main() {
    const uint n = st[0];
    const uint r0 = gl_WorkGroupID.y * BM;
    const uint t0 = gl_WorkGroupID.x * BN;
    // Row strides masked to a multiple of 8 elements: the driver may then take 16-byte
    // loads (they are multiples of 64 already).
    tensorLayoutNV<2> lw = createTensorLayoutNV(2);
    lw = setTensorLayoutDimensionNV(lw, p.rows, p.cols);
    lw = setTensorLayoutStrideNV(lw, p.cols & ~7u, 1);
    tensorLayoutNV<2> lx = createTensorLayoutNV(2);
    lx = setTensorLayoutDimensionNV(lx, (n + BN - 1) / BN * BN, p.cols);
    lx = setTensorLayoutStrideNV(lx, p.cols & ~7u, 1);
    // Tokens past n are dropped on the store.
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> la =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
#ifdef GLU
    la = setTensorLayoutDimensionNV(la, n, p.rows);
    la = setTensorLayoutStrideNV(la, p.rows, 1);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);
    SUMS gate = SUMS(0.0);
    SUMS up = SUMS(0.0);
    for (uint k = 0; k < p.cols; k += UN * BK) {
        [[unroll]] for (uint u = 0; u < UN; u++) {
            coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> a;
            coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;
            coopMatLoadTensorNV(b, xh, 0, sliceTensorLayoutNV(lx, t0, BN, k + u * BK, BK),
                                transposed);
            coopMatLoadTensorNV(a, w, 0, sliceTensorLayoutNV(lw, r0, BM, k + u * BK, BK));
            gate = coopMatMulAdd(a, b, gate);
            coopMatLoadTensorNV(a, wu, p.y_col, sliceTensorLayoutNV(lw, r0, BM, k + u * BK, BK));
            up = coopMatMulAdd(a, b, up);
        }
    }
    // split_gemm.wgsl's GLU epilogue with HALF_OUT, element by element (the two sums'
    // elements lie alike: one type): x / (1 + e^a), a = -x (silu) or -2 sqrt(2/pi) (x +
    // 0.044715 x^3) (gelu-tanh), times up, clamped to f16's range.
    const bool gelu = (p.flags & GELU) != 0;
    [[unroll]] for (uint i = 0; i < gate.length(); i++) {
        const float g = gate[i];
        const float a = gelu ? -2.0 * 0.7978846 * (g + 0.044715 * g * g * g) : -g;
        gate[i] = clamp(g / (1.0 + exp(a)) * up[i], -65504.0, 65504.0);
    }
    coopmat<float16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> h =
        coopmat<float16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(gate);
    coopMatStoreTensorNV(h, out_h, 0, sliceTensorLayoutNV(la, t0, BN, r0, BM), transposed);
#else
    la = setTensorLayoutDimensionNV(la, n, p.y_col + p.rows);
    la = setTensorLayoutStrideNV(la, p.y_stride, 1);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);
    SUMS sum = SUMS(0.0);
    if ((p.flags & RESIDUAL) != 0) {
        coopMatLoadTensorNV(sum, acc, 0, sliceTensorLayoutNV(la, t0, BN, p.y_col + r0, BM),
                            transposed);
    }
    for (uint k = 0; k < p.cols; k += UN * BK) {
        [[unroll]] for (uint u = 0; u < UN; u++) {
            coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA> a;
            coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;
            coopMatLoadTensorNV(a, w, 0, sliceTensorLayoutNV(lw, r0, BM, k + u * BK, BK));
            coopMatLoadTensorNV(b, xh, 0, sliceTensorLayoutNV(lx, t0, BN, k + u * BK, BK),
                                transposed);
            sum = coopMatMulAdd(a, b, sum);
        }
    }
    coopMatStoreTensorNV(sum, acc, 0, sliceTensorLayoutNV(la, t0, BN, p.y_col + r0, BM),
                         transposed);
#endif
}
