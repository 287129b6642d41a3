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
// linear.wgsl's Params, of which this kernel reads four.
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
// KernelId::Coopmat2Gemm's bindings 5 (w), 7 (step), 12 (xh) and 14 (acc), as wgpu-hal's
// Vulkan backend numbers them: a layout's entries densely, 0 up, in binding order.
layout(binding = 0) readonly buffer W { float16_t w[]; };
layout(binding = 1) readonly buffer Step { uint st[]; };
layout(binding = 2) readonly buffer XH { float16_t xh[]; };
layout(binding = 3) buffer Acc { float acc[]; };

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
    la = setTensorLayoutDimensionNV(la, n, p.y_col + p.rows);
    la = setTensorLayoutStrideNV(la, p.y_stride, 1);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);
    coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> sum =
        coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(0.0);
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
}
