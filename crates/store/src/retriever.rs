//! Which retriever ranks a store's contexts: dense (cosine of sentence embeddings), BM25 (the
//! contexts' text), or hybrid (reciprocal-rank fusion of the two, weighted).

use crate::error::{Error, Result};

/// The weight of the dense ranking in a hybrid retrieval when none is given (BM25 gets the rest).
pub const DEFAULT_HYBRID_WEIGHT: f32 = 0.5;
/// How deep each ranking is read before a hybrid retrieval fuses them (at least `k`).
pub const FUSION_DEPTH: usize = 50;

/// A retriever.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Retriever {
    /// Cosine of the query's embedding with the stored ones (the store's encoder).
    #[default]
    Dense,
    /// BM25 over the contexts' text (PostgreSQL: its full-text rank).
    Bm25,
    /// Reciprocal-rank fusion: `dense_weight / (60 + dense rank) + (1 − dense_weight) / (60 +
    /// BM25 rank)`.
    Hybrid {
        /// Weight of the dense ranking, in [0, 1].
        dense_weight: f32,
    },
}

impl Retriever {
    /// The retriever `name` names (`dense`, `bm25`, `hybrid`), with `hybrid_weight` for hybrid
    /// ([`DEFAULT_HYBRID_WEIGHT`] when `None`). A weight given to another retriever, or outside
    /// [0, 1], is refused.
    pub fn parse(name: &str, hybrid_weight: Option<f32>) -> Result<Self> {
        let retriever = match name {
            "dense" => Self::Dense,
            "bm25" => Self::Bm25,
            "hybrid" => {
                let w = hybrid_weight.unwrap_or(DEFAULT_HYBRID_WEIGHT);
                if !(0.0..=1.0).contains(&w) {
                    return Err(Error::Input(format!(
                        "hybrid weight {w}: give the dense ranking's weight between 0 and 1 (BM25 gets the rest)"
                    )));
                }
                Self::Hybrid { dense_weight: w }
            }
            other => {
                return Err(Error::Input(format!("unknown retriever {other:?}: use dense, bm25 or hybrid")));
            }
        };
        if hybrid_weight.is_some() && !matches!(retriever, Self::Hybrid { .. }) {
            return Err(Error::Input(format!(
                "a hybrid weight was given, but the retriever is {name}; it weighs the two rankings of hybrid retrieval only"
            )));
        }
        Ok(retriever)
    }

    /// `dense`, `bm25` or `hybrid`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Bm25 => "bm25",
            Self::Hybrid { .. } => "hybrid",
        }
    }

    /// Whether it needs the query's embedding.
    pub fn needs_embedding(self) -> bool {
        !matches!(self, Self::Bm25)
    }

    /// Whether it needs the query's text.
    pub fn needs_text(self) -> bool {
        !matches!(self, Self::Dense)
    }
}

impl std::fmt::Display for Retriever {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Hybrid { dense_weight } => write!(f, "hybrid (dense weight {dense_weight})"),
            other => f.write_str(other.name()),
        }
    }
}

/// A query as retrievers see it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<'a> {
    /// Its text (BM25, hybrid).
    pub text: Option<&'a str>,
    /// Its embedding (dense, hybrid).
    pub embedding: Option<&'a [f32]>,
    /// The fingerprint of the encoder that embedded it: checked against the store's.
    pub encoder: Option<&'a str>,
}
