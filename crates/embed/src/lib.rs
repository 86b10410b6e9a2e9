//! # picaso-embed
//!
//! The retriever of picaso's database of states: it turns texts into sentence embeddings and
//! finds the stored contexts nearest to a query, whose states picaso then composes.
//!
//! - [`Embedder`] computes the embeddings of a sentence-transformers folder of the BERT or MPNet
//!   family (all-MiniLM-L6-v2, all-mpnet-base-v2, …) in pure Rust: tokenization with
//!   `tokenizers`, a BERT ([`bert::BertModel`]) or MPNet ([`mpnet::MpnetModel`], with its
//!   relative position buckets) encoder written with candle, the folder's [`Pooling`] (mean,
//!   CLS, max, …) over the real tokens and its `Normalize`, inputs truncated to
//!   `max_seq_length`. It matches sentence-transformers (tested against committed fixtures:
//!   all-MiniLM-L6-v2 to a cosine above 0.9999, tiny random MPNet and CLS-pooled BERT to 1e-5).
//! - [`Bm25Index`] ranks texts by BM25 (lexical retrieval), and [`reciprocal_rank_fusion`]
//!   fuses its ranking with the dense one (hybrid retrieval).
//! - [`VectorIndex`] is the search interface; [`FlatIndex`] implements it with an exact,
//!   multi-threaded scan over one contiguous `Vec<f32>` (scores are inner products, i.e. cosines
//!   of the normalised embeddings), returning the best `k` in order, ties by lower id.
//!
//! Design decision: exact search first. At the scale of a database of states (10⁴–10⁶
//! contexts) a vectorised scan reads memory at full speed — a few milliseconds for 100k × 384 —
//! with perfect recall and no build step; an approximate index can replace it later behind
//! [`VectorIndex`] without touching callers. Likewise the embedder batches texts sorted by
//! length, so padding costs little, and masks padded keys, so a text's embedding does not
//! depend (beyond float rounding, < 1e-5) on the batch it was computed in.
//!
//! Speed on 2 CPU cores (Sapphire Rapids): about 250 sentences/s for short sentences, ~1.45x
//! more with the `avx512` feature (AVX-512 kernels in candle's matmul); top-k over 100k × 384
//! in about 3.5 ms per query (`cargo bench -p picaso-embed --bench topk`).
//!
//! ```no_run
//! use picaso_embed::{Embedder, FlatIndex, VectorIndex};
//! let embedder = Embedder::load("models/all-MiniLM-L6-v2".as_ref(), &candle_core::Device::Cpu)?;
//! let contexts = ["The Eiffel Tower is in Paris.", "Mamba is a state-space model."];
//! let mut index = FlatIndex::new(embedder.dim())?;
//! for v in embedder.embed(&contexts)? {
//!     index.add(&v)?;
//! }
//! let query = embedder.embed_one("Where is the Eiffel Tower?")?;
//! let hits = index.search(&query, 1)?; // [(id, cosine)], best first: here id 0
//! # Ok::<(), picaso_embed::Error>(())
//! ```
#![deny(missing_docs)]

pub mod bert;
pub mod bm25;
pub mod embedder;
pub mod encoder;
pub mod error;
pub mod fusion;
mod hf_config;
pub mod index;
mod layers;
pub mod modules;
pub mod mpnet;
pub mod pooling;

pub use bm25::Bm25Index;
pub use embedder::{l2_normalize, Embedder};
pub use encoder::{Encoder, EncoderConfig};
pub use error::{Error, Result};
pub use fusion::reciprocal_rank_fusion;
pub use index::{dot, FlatIndex, VectorIndex};
pub use pooling::{Pooling, PoolingMode};
