//! The CPU engines' shared parts: kernels by operation ([`matmul`], [`scan`], [`conv`], [`norm`],
//! [`activations`], [`softmax`]), the token embedding and LM head ([`token_io`]), and how a batch
//! of sequences runs through a stack of layers ([`layers`]). The architectures' engines
//! (`crate::mamba2::cpu`, `crate::mamba1::cpu`, `crate::granite_hybrid::cpu`) are built from them.
//!
//! One code path serves prefill (T tokens) and decode (T = 1): projections are matrix products
//! (gemm for T > 1, a bandwidth-bound matrix-vector kernel for T = 1), the causal convolution
//! reads the state's conv tail as its first K-1 rows, and the selective scan runs head by head
//! so each head's (P, N) state stays in L1 while all T tokens stream past it.

pub mod activations;
pub mod conv;
pub mod layers;
pub mod matmul;
pub mod norm;
mod pool;
pub mod rows;
pub mod scan;
pub mod softmax;
pub mod token_io;

pub use matmul::{Bf16Kernel, Matrix};
pub use pool::on_pool;
pub use rows::Rows;

/// Lanes of the hand-vectorised loops (one AVX-512 register, two AVX2 registers of f32).
pub const LANES: usize = 16;

/// Rows per rayon task for row-wise work (conv, norms); small enough to balance two cores.
pub(crate) const ROW_CHUNK: usize = 16;

/// Storage precision of the large matrices (projections, embedding, LM head). Small tensors
/// (norms, conv, dt, A, D) and all arithmetic stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// Exact.
    #[default]
    F32,
    /// Half the bytes, so decode (which streams every weight per token) runs about twice as fast.
    Bf16,
}

impl std::str::FromStr for WeightDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            other => Err(format!("unknown weight dtype {other:?}: use f32 or bf16")),
        }
    }
}
