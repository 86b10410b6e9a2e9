//! Mamba-1 (Gu & Dao, 2023): the selective SSM whose decay exp(dt·A) is diagonal per
//! (channel, state) element. Its state per layer is the SSM state (d_inner, N), the conv tail
//! (d_inner, K-1) and the log-decay (d_inner, N) — as large as the state, so composition
//! weights are per element.

pub mod candle;
pub mod config;
pub mod cpu;
pub mod weights;

pub use candle::CandleMamba1;
pub use config::Mamba1Config;
pub use cpu::CpuMamba1;
pub use weights::{Mamba1LayerWeights, Mamba1Weights};
