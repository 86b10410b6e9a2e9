//! Where a store's metadata and vectors live: SQLite in the store folder, or PostgreSQL with
//! pgvector shared by several servers. Both hold the same rows and answer the same queries;
//! the [`crate::Store`] above them adds state objects, checks and the model binding.

mod postgres;
mod sqlite;

pub use postgres::PostgresCatalog;
pub use sqlite::SqliteCatalog;
pub(crate) use sqlite::CREATING_PREFIX;

use std::collections::BTreeMap;

use crate::error::Result;
use crate::store::ContextRecord;

/// One context's row, as written.
#[derive(Debug, Clone)]
pub struct Row<'a> {
    /// Keep this id (when migrating); `None` assigns the next one.
    pub id: Option<i64>,
    /// Source document.
    pub doc: &'a str,
    /// Position in the document.
    pub seg: u32,
    /// Segment text.
    pub text: &'a str,
    /// Token ids.
    pub tokens: &'a [u32],
    /// Normalised embedding.
    pub embedding: &'a [f32],
    /// Fingerprint of the model that made the state.
    pub fingerprint: &'a str,
    /// State file, relative to the store (`states/ab/<checksum>.safetensors`).
    pub state_file: &'a str,
    /// xxh3-128 of the state file, hex.
    pub checksum: &'a str,
    /// Size of the state file.
    pub state_bytes: u64,
    /// Creation time (seconds since the Unix epoch).
    pub created: i64,
}

/// Totals over a catalog: (contexts, documents, tokens, state bytes). State bytes count each
/// state file once: contexts with the same state (the same text) share one content-addressed file.
pub type Totals = (u64, u64, u64, u64);

/// A metadata and vector backend.
pub trait Catalog: Send + Sync + std::fmt::Debug {
    /// Where it is (no credentials).
    fn url(&self) -> String;
    /// A metadata value.
    fn meta(&self, key: &str) -> Result<Option<String>>;
    /// Sets `key` unless it is set, atomically; returns the value stored afterwards (another
    /// writer's, if it was first).
    fn init_meta(&self, key: &str, value: &str) -> Result<String>;
    /// Segments of `doc` stored, each with its context's id.
    fn segments_of(&self, doc: &str) -> Result<BTreeMap<u32, i64>>;
    /// Inserts rows in one transaction, skipping (doc, seg) pairs present; returns the new ids
    /// (`None` for skipped rows). `write_states` runs before the commit, inside whatever lock
    /// keeps a concurrent delete from removing a state object the rows will refer to.
    fn insert(&self, rows: &[Row<'_>], write_states: &mut dyn FnMut() -> Result<()>) -> Result<Vec<Option<i64>>>;
    /// The id stored for (doc, seg).
    fn id_of(&self, doc: &str, seg: u32) -> Result<Option<i64>>;
    /// Metadata of several contexts, in the order asked ([`crate::Error::NotFound`] for a
    /// missing one).
    fn get_many(&self, ids: &[i64]) -> Result<Vec<ContextRecord>>;
    /// Whether each of `ids` is stored (cheaper than fetching the rows).
    fn exist(&self, ids: &[i64]) -> Result<Vec<bool>>;
    /// [`Catalog::exist`] once every delete in flight of the state objects `checksums` has
    /// committed: a reader that found such an object gone asks this to tell a concurrent
    /// delete from a broken store.
    fn exist_settled(&self, ids: &[i64], _checksums: &[String]) -> Result<Vec<bool>> {
        self.exist(ids)
    }
    /// (document, segment) of a context.
    fn doc_seg(&self, id: i64) -> Result<(String, u32)>;
    /// Deletes a context, then calls `remove_state(checksum)` if no other context shares its
    /// state, inside the lock that keeps a concurrent insert from reusing it meanwhile. The row
    /// goes first (committed): a crash or a failed removal leaves an orphan object, never a row
    /// without its object.
    fn delete(&self, id: i64, remove_state: &mut dyn FnMut(&str) -> Result<()>) -> Result<()>;
    /// Points context `id` at another state object (`checksum`, `state_file`, `state_bytes`),
    /// keeping everything else; `write_states` writes that object first, under the lock an
    /// insert takes. For a context whose object was lost and whose state, recomputed from its
    /// tokens, came out with other bits. Returns false when the context is gone.
    fn restate(
        &self,
        id: i64,
        checksum: &str,
        state_file: &str,
        state_bytes: u64,
        write_states: &mut dyn FnMut() -> Result<()>,
    ) -> Result<bool>;
    /// Calls `remove_state(checksum)` unless a context refers to that state, under the lock
    /// [`Catalog::delete`] takes, so no insert that would refer to it runs meanwhile. For
    /// objects left behind by killed writes. Returns whether it was removed.
    fn remove_if_unreferenced(&self, checksum: &str, remove_state: &mut dyn FnMut(&str) -> Result<()>) -> Result<bool>;
    /// The `k` nearest contexts to `query` by inner product (cosine for normalised vectors),
    /// best first (equal scores by lower id), among every context or only those of `documents`.
    /// `exact` forbids approximate indexes; a search within documents is always exact.
    fn search(&self, query: &[f32], k: usize, exact: bool, documents: Option<&[String]>) -> Result<Vec<(i64, f32)>>;
    /// A context's embedding.
    fn embedding(&self, id: i64) -> Result<Vec<f32>>;
    /// Number of contexts.
    fn count(&self) -> Result<usize>;
    /// All ids, ascending.
    fn ids(&self) -> Result<Vec<i64>>;
    /// Totals.
    fn totals(&self) -> Result<Totals>;
    /// Up to `limit` documents named after `after` (from the first when `None`), in name
    /// order: (name, contexts, tokens).
    fn documents(&self, after: Option<&str>, limit: usize) -> Result<Vec<(String, u64, u64)>>;
    /// Up to `limit` contexts with ids above `after`, ascending, with their embeddings (for
    /// copying a store).
    fn export(&self, after: i64, limit: usize) -> Result<Vec<(ContextRecord, Vec<f32>)>>;
    /// Builds (or drops, with `None`) an approximate nearest-neighbour index:
    /// `Some((m, ef_construction))` for HNSW.
    fn set_ann_index(&self, hnsw: Option<(usize, usize)>) -> Result<()>;
}

pub(crate) fn u32s_to_blob(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub(crate) fn blob_to_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
pub(crate) fn f32s_to_blob(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub(crate) fn blob_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
