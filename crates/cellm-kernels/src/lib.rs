//! CPU kernels. Each weight format has a row kernel table (dot product against f32
//! activations, row decode) with a scalar reference and SIMD variants chosen once at run time
//! from the CPU's features; `matmul` spreads rows over the installed worker pool.

pub mod acts;
pub mod cache;
pub mod dense_attention;
pub mod dot;
pub mod gating;
pub mod gelu;
pub mod gemm;
pub mod hadamard;
pub mod i8_gemm;
pub mod isa;
pub mod kv_rows;
pub mod matmul;
pub mod ops;
pub mod panel;
pub mod peak;
pub mod pool;
pub mod rows;

pub use isa::Isa;
pub use matmul::{
    decode_row, decode_row_raw, for_logit_rows, matmul, matmul_combined, matmul_combined_raw,
    matmul_many, matmul_many_new, matmul_many_raw, matmul_new, matmul_raw, with_float_order,
    FloatOrder,
};
pub use rows::WeightRows;
