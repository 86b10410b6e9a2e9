//! # picaso-train
//!
//! Training for picaso's Mamba-2: [`mamba::TrainMamba2`], a differentiable forward on candle
//! autograd that starts from any state (SSM state and conv tail) and returns the final state —
//! the building block of pretraining and of the paper's composition objectives (BPTC
//! backpropagates through composed states; BP2C stops the gradient at them).
#![deny(missing_docs)]

pub mod bpe;
mod checkpoint;
pub mod compose;
pub mod corpus;
pub mod cpu;
pub mod kernels;
pub mod mamba;
pub mod optim;
pub mod pretrain;
pub mod run_file;
pub mod token_data;
pub mod xent;

pub use mamba::{TrainMamba2, TrainState};

/// Errors of training.
pub type Error = candle_core::Error;
/// Results of training.
pub type Result<T> = candle_core::Result<T>;

/// A file error, naming the file.
pub(crate) fn io(e: impl std::fmt::Display, path: &std::path::Path) -> Error {
    Error::Msg(format!("{}: {e}", path.display()))
}
