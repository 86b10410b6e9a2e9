//! The retriever options every retrieving command shares: `--retriever dense|bm25|hybrid` and
//! `--hybrid-weight`.

use anyhow::Result;
use clap::Args;
use picaso_store::Retriever;

/// Which retriever ranks the contexts.
#[derive(Args, Debug, Clone)]
pub struct RetrieverArgs {
    /// How contexts are ranked: dense (cosine of the store's sentence embeddings), bm25 (the
    /// contexts' text; a PostgreSQL store uses its full-text rank) or hybrid (reciprocal-rank
    /// fusion of both).
    #[arg(long, default_value = "dense", value_parser = ["dense", "bm25", "hybrid"])]
    pub retriever: String,
    /// Weight of the dense ranking in hybrid retrieval, between 0 and 1 (BM25 gets the rest;
    /// default 0.5).
    #[arg(long, value_name = "W")]
    pub hybrid_weight: Option<f32>,
}

impl RetrieverArgs {
    /// The retriever the options name.
    pub fn retriever(&self) -> Result<Retriever> {
        Ok(Retriever::parse(&self.retriever, self.hybrid_weight)?)
    }
}
