//! One error type for the model crate. Every variant names the file or field at fault and, where
//! it helps, how to fix it: these messages reach users verbatim through the CLI and the server.

use std::path::PathBuf;

/// Errors from loading models, running them and reading or writing states.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// `config.json` is missing a field, has a wrong type or an inconsistent value.
    #[error("{path}: {message}")]
    Config {
        /// The config file.
        path: PathBuf,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A weight file is unreadable, lacks a tensor, or has a tensor of the wrong shape or values.
    #[error("{path}: {message}")]
    Weights {
        /// The weight file (or folder for sharded checkpoints).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A state file or in-memory state does not fit this model.
    #[error("state{}: {message}", .path.as_ref().map(|p| format!(" {}", p.display())).unwrap_or_default())]
    State {
        /// The state file, if the state came from one.
        path: Option<PathBuf>,
        /// What is wrong.
        message: String,
    },
    /// Bad input to an operation (token ids, sampling options, ...).
    #[error("{0}")]
    Input(String),
    /// The tokenizer could not be loaded or failed.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The tokenizer file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// Bad composition input (empty list, unknown method, bad order, ...).
    #[error(transparent)]
    Compose(#[from] picaso_compose::Error),
    /// An error from the tensor library.
    #[error("tensor error: {0}")]
    Candle(#[from] candle_core::Error),
    /// A GPU that cannot be reached or used (no driver, no device, a failed launch), with what to do.
    #[error("GPU: {0}")]
    Gpu(String),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
    pub(crate) fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config { path: path.into(), message: message.into() }
    }
    pub(crate) fn weights(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Weights { path: path.into(), message: message.into() }
    }
    pub(crate) fn state(message: impl Into<String>) -> Self {
        Error::State { path: None, message: message.into() }
    }
    /// Attaches the file a state came from to a state error.
    pub fn at_state_file(self, file: &std::path::Path) -> Self {
        match self {
            Error::State { path: None, message } => Error::State { path: Some(file.to_path_buf()), message },
            other => other,
        }
    }
}
