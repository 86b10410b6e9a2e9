//! Mamba-2 (Dao & Gu, 2024): the state-space duality form, a scalar decay per head. Its state per
//! layer is the SSM state (nheads, headdim, d_state), the conv tail (conv_dim, d_conv − 1) and the
//! log of the accumulated decay per head. The Mamba layers of hybrids run this mixer too.

pub mod candle;
pub mod config;
pub mod cpu;
pub mod gpu;
pub mod weights;

pub use candle::CandleMamba2;
pub use config::{GateNorm, Mamba2Config};
pub use cpu::CpuMamba2;
pub use gpu::GpuMamba2;
pub use weights::{LayerWeights, Mamba2Weights};
