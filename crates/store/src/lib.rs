//! # picaso-store
//!
//! The database of states. A [`Store`] is one folder: each context's state in a safetensors
//! file written once, its metadata (document, segment, text, token ids, embedding, model
//! fingerprint, file checksum, the document's [`metadata`], matched by a [`Filter`]) in SQLite, and an in-memory retrieval
//! index over the embeddings.
//! [`ingest()`] fills it from documents ([`sources`]); [`Store::search`] retrieves;
//! [`Store::load_state`] reads a state back (memory-mapped, checksum-verified) for composition;
//! [`StateCache`] keeps hot ones in memory; [`prepare`] turns context ids into the state a prompt
//! continues from; [`attribute()`] tells which of them an answer owes most to (leave-one-out).
//!
//! Design decision: files before rows. State files are durable before the transaction that
//! records them commits, so a crash never leaves a row without its state, and ingest resumes by
//! skipping recorded (document, segment) pairs.
#![deny(missing_docs)]

pub mod attribution;
pub mod bench;
pub mod budget;
pub mod cache;
pub mod catalog;
pub mod check;
pub mod embedder;
pub mod error;
pub mod filter;
pub mod ingest;
pub mod location;
pub mod metadata;
pub mod migrate;
pub mod passages;
pub mod pattern;
pub mod query;
pub mod records;
pub mod retriever;
mod runtime;
pub mod scope;
pub mod sources;
pub mod states;
pub mod store;
pub mod workload;

pub use attribution::{attribute, Attribution};
pub use budget::{Budget, BudgetStats, Deferred, Loaded, Policy};
pub use cache::{CacheStats, StateCache};
pub use check::{check, repair, report_json, CheckReport, Problem, ProblemKind, RepairReport};
pub use embedder::{find_embedder, load_embedder, EmbedderError};
pub use error::{Error, Result};
pub use filter::Filter;
pub use ingest::{ingest, ingest_while, prune, IngestProgress};
pub use location::{CatalogUrl, Location, StatesUrl};
pub use metadata::Metadata;
pub use migrate::{migrate, migrate_to, MigrateReport};
pub use passages::{passages, retrieve, retrieve_by, Passage};
pub use query::{gather, prepare, prepare_deferring, retrieve_then, Contexts, Hits, Prepared, Retrieval};
pub use records::{ContextRecord, DocumentSummary};
pub use retriever::{Query, Retriever};
pub use runtime::Resilience;
pub use scope::Scope;
pub use sources::{detokenize_wikitext, read_jsonl, read_text_dir, read_wikitext, Document, Segmentation};
pub use states::checksum;
pub use store::{EmbedderRecord, NewContext, Stats, Store, StoreInfo, WriteLock, RETRIEVAL_ATTEMPTS};
