//! What the catalog hands back: a stored context's record and a document's summary.

use crate::metadata::Metadata;

/// A stored context's metadata.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ContextRecord {
    /// Context id (never reused).
    pub id: i64,
    /// Source document.
    pub doc: String,
    /// Position in the document.
    pub seg: u32,
    /// Segment text.
    pub text: String,
    /// Token ids.
    pub tokens: Vec<u32>,
    /// Number of tokens.
    pub n_tokens: usize,
    /// State object, relative to the store (`states/ab/<checksum>.safetensors`).
    pub state_file: String,
    /// xxh3-128 of the state file, hex.
    pub checksum: String,
    /// Size of the state file.
    pub state_bytes: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created: i64,
    /// Its document's metadata (`{}` for none).
    pub metadata: Metadata,
}

/// A document of a store, as listed.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DocumentSummary {
    /// Its name (file name, JSON id, article title, or the id given to the server).
    pub id: String,
    /// Its contexts.
    pub contexts: u64,
    /// Their tokens.
    pub tokens: u64,
    /// The metadata of its first context (lowest segment): a document's metadata, which
    /// ingesting it gives every one of its contexts (contexts added one at a time may differ).
    pub metadata: Metadata,
}
