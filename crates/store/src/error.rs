//! Errors of the store. Messages name the store, the context or the file at fault.

use std::path::PathBuf;

/// Errors from opening, reading or writing a store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The folder is not a store, or is unreadable.
    #[error("store {location}: {message}")]
    Store {
        /// The store (folder or URL).
        location: String,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// The store was made with another model (or embedder) than the one given.
    #[error(
        "store {location} holds states of model {stored}, not of {given}; use the model it was made with or a new store"
    )]
    WrongModel {
        /// The store (folder or URL).
        location: String,
        /// Fingerprint recorded in the store.
        stored: String,
        /// Fingerprint of the model given.
        given: String,
    },
    /// No context with this id.
    #[error("no context with id {0}")]
    NotFound(i64),
    /// A state file does not match its recorded checksum.
    #[error("state file {path} is corrupt (checksum {found}, recorded {recorded})")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Checksum of the bytes on disk.
        found: String,
        /// Checksum in the metadata.
        recorded: String,
    },
    /// A backend (PostgreSQL, an object store) could not be reached or did not answer in time,
    /// after retries. Transient: the same call succeeds once the backend is back.
    #[error("{backend} is unavailable: {message}; retry once it is back")]
    Unavailable {
        /// The backend, as a URL without credentials.
        backend: String,
        /// What failed.
        message: String,
    },
    /// A backend refused an operation (permissions, configuration, a missing extension).
    #[error("{backend}: {message}")]
    Backend {
        /// The backend, as a URL without credentials.
        backend: String,
        /// What failed and how to fix it.
        message: String,
    },
    /// Bad input (empty text, wrong embedding size, ...).
    #[error("{0}")]
    Input(String),
    /// SQLite failed.
    #[error("metadata database: {0}")]
    Sql(#[from] rusqlite::Error),
    /// A file operation failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The model crate failed (state (de)serialisation).
    #[error(transparent)]
    Model(#[from] picaso_model::Error),
    /// The retriever failed.
    #[error(transparent)]
    Embed(#[from] picaso_embed::Error),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, Error>;
