//! One error type for the embed crate. Every variant names the file, field or argument at fault.

use std::path::PathBuf;

/// Errors from loading the embedder, embedding text and searching an index.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file is missing or could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// `config.json` (or `sentence_bert_config.json`) is malformed, lacks a field or has an
    /// unsupported value.
    #[error("{path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// `model.safetensors` is unreadable, lacks a tensor, or has a tensor of the wrong shape.
    #[error("{path}: {message}")]
    Weights {
        /// The weight file.
        path: PathBuf,
        /// What is wrong, naming the tensor.
        message: String,
    },
    /// `tokenizer.json` could not be loaded, or tokenization failed.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A vector or query does not fit the index (wrong dimension, non-finite values, ...).
    #[error("{0}")]
    Input(String),
    /// An error from the tensor library while running the encoder.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, Error>;
