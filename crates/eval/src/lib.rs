//! # picaso-eval
//!
//! The experiments that tell a user how close composed states come to processing the
//! contexts, and at what cost. [`methods`] turns retrieved contexts into the state a query
//! continues from, for every method of the paper (Naive, Concat, PIConcat-R, Soup, CASO,
//! PICASO-S, PICASO-R); [`wikitext`] runs the paper's WikiText experiment over a store of
//! (query, continuation) halves (also its scaling to 50 contexts); [`openbookqa`] answers
//! multiple-choice questions from retrieved facts; [`attribution`] finds an answer's source by
//! leaving contexts in or out (on OpenBookQA and [`msmarco`]); [`order`] measures how much the
//! order of contexts matters; [`fidelity`] compares each method's state and predictions with
//! Concat's; [`context_use`] checks that a model uses its context at all; [`recall`] asks for facts spread
//! over k contexts (exact-match recall per method, per k and per context position); [`finetuned`]
//! sets fine-tuned models against the zero-shot one. Each experiment writes its own results as
//! JSON, CSV, Markdown and PNG plots; [`report`] holds what the writers share (the run's
//! provenance, tables, charts) and names every writer in one place.
//!
//! Design decision: experiments read their database from a [`picaso_store::Store`] — the
//! same states the server composes — so what is measured is what is served.
#![deny(missing_docs)]

pub mod attribution;
pub mod context_use;
pub mod database;
pub mod fidelity;
pub mod finetuned;
pub mod journal;
pub mod methods;
pub mod msmarco;
pub mod openbookqa;
pub mod order;
pub mod plot;
pub mod recall;
pub mod report;
pub mod stats;
pub mod wikitext;

pub use methods::{start_state, Context, Started};
pub use picaso_model::{Composition, Method};

/// What can go wrong in an experiment.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The store (missing context, corrupt state, wrong model, …).
    #[error(transparent)]
    Store(#[from] picaso_store::Error),
    /// The model (bad tokens, state mismatch, …).
    #[error(transparent)]
    Model(#[from] picaso_model::Error),
    /// The sentence embedder used for retrieval.
    #[error(transparent)]
    Embed(#[from] picaso_embed::Error),
    /// A bad request: the message says what and how to fix it.
    #[error("{0}")]
    Input(String),
    /// Writing results.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, Error>;
