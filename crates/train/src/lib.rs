//! # picaso-train
//!
//! Training for picaso's models: [`mamba::TrainMamba2`] and [`hybrid::TrainGraniteHybrid`],
//! differentiable forwards on candle autograd that start from any state (SSM state and conv
//! tail; a hybrid's keys and values) and return the final state — the building block of
//! pretraining and of the paper's composition objectives (BPTC backpropagates through composed
//! states; BP2C stops the gradient at them). [`Net`] is what fine-tuning needs of either.
#![deny(missing_docs)]

pub mod bpe;
mod checkpoint;
pub mod compose;
pub mod corpus;
pub mod cpu;
pub mod hybrid;
pub mod kernels;
pub mod mamba;
pub mod net;
pub mod optim;
pub mod pretrain;
pub mod run_file;
pub mod token_data;
pub mod xent;

pub use hybrid::TrainGraniteHybrid;
pub use mamba::{TrainMamba2, TrainState};
pub use net::Net;

/// Errors of training.
pub type Error = candle_core::Error;
/// Results of training.
pub type Result<T> = candle_core::Result<T>;

/// A file error, naming the file.
pub(crate) fn io(e: impl std::fmt::Display, path: &std::path::Path) -> Error {
    Error::Msg(format!("{}: {e}", path.display()))
}
