//! The embedded store: one folder holding
//!
//! * `store.sqlite` — metadata and embeddings of every context (SQLite, WAL, synchronous=FULL);
//! * `states/xx/<checksum>.safetensors` — one state file per distinct state, content-addressed
//!   by the xxh3-128 of its bytes, written once (temporary file, fsync, rename).
//!
//! Crash safety comes from the order of writes: a batch's state files are durable before the
//! one transaction that records them commits. A kill at any moment leaves either no row (the
//! file, if any, is an orphan that the next write of the same state simply replaces) or a row
//! whose file is complete. Re-running an ingest skips the (document, segment) pairs recorded.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use picaso_embed::{FlatIndex, VectorIndex};
use picaso_model::{MappedState, State, StateDtype};
use rayon::prelude::*;
use rusqlite::{params, Connection, OptionalExtension};

use crate::error::{Error, Result};

/// Format tag of the metadata database.
pub const STORE_FORMAT: &str = "picaso-store/1";

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS contexts (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    doc         TEXT    NOT NULL,
    seg         INTEGER NOT NULL,
    text        TEXT    NOT NULL,
    tokens      BLOB    NOT NULL,
    n_tokens    INTEGER NOT NULL,
    embedding   BLOB    NOT NULL,
    fingerprint TEXT    NOT NULL,
    state_file  TEXT    NOT NULL,
    checksum    TEXT    NOT NULL,
    state_bytes INTEGER NOT NULL,
    created     INTEGER NOT NULL,
    UNIQUE (doc, seg)
);
";

/// What a store is bound to: the model whose states it holds and the embedder's width.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreInfo {
    /// Fingerprint of the model that made the states.
    pub fingerprint: String,
    /// Embedding width of the retriever.
    pub dim: usize,
    /// Precision of the state files.
    pub state_dtype: StateDtype,
}

/// A context to add.
#[derive(Debug, Clone)]
pub struct NewContext {
    /// Source document.
    pub doc: String,
    /// Position of the segment in the document.
    pub seg: u32,
    /// Segment text.
    pub text: String,
    /// Its token ids.
    pub tokens: Vec<u32>,
    /// Its (normalised) embedding.
    pub embedding: Vec<f32>,
    /// The model state after its tokens.
    pub state: State,
}

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
    /// State file, relative to the store folder.
    pub state_file: String,
    /// xxh3-128 of the state file, hex.
    pub checksum: String,
    /// Size of the state file.
    pub state_bytes: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created: i64,
}

/// Totals over a store (the keys of `picaso stats --json`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Stats {
    /// Number of contexts.
    pub contexts: u64,
    /// Number of distinct source documents.
    pub documents: u64,
    /// Tokens over all contexts.
    pub tokens: u64,
    /// Bytes of state files recorded.
    pub state_bytes: u64,
    /// Fingerprint of the model.
    pub model: String,
}

/// The retrieval index and the context id of each of its rows.
struct Index {
    flat: FlatIndex,
    ids: Vec<i64>,
}

/// An open store. Safe to share between threads: SQLite access is serialised, reads of state
/// files and searches run in parallel.
pub struct Store {
    dir: PathBuf,
    info: StoreInfo,
    conn: Mutex<Connection>,
    index: RwLock<Index>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("dir", &self.dir).field("info", &self.info).finish()
    }
}

fn now_unix() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

fn u32s_to_blob(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn blob_to_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}
fn f32s_to_blob(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
fn blob_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// xxh3-128 of bytes, as 32 hex digits: the name and checksum of a state file.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

impl Store {
    /// Opens the store in `dir`, creating it for `info` if it does not exist. An existing store
    /// made for another model or embedder width is refused.
    pub fn open_or_create(dir: &Path, info: &StoreInfo) -> Result<Self> {
        if dir.join("store.sqlite").is_file() {
            let store = Self::open(dir)?;
            if store.info.fingerprint != info.fingerprint {
                return Err(Error::WrongModel {
                    path: dir.to_path_buf(),
                    stored: store.info.fingerprint.clone(),
                    given: info.fingerprint.clone(),
                });
            }
            if store.info.dim != info.dim {
                return Err(Error::Store {
                    path: dir.to_path_buf(),
                    message: format!("embeddings have {} dimensions, the embedder gives {}", store.info.dim, info.dim),
                });
            }
            return Ok(store);
        }
        std::fs::create_dir_all(dir.join("states")).map_err(|e| Error::Io { path: dir.to_path_buf(), source: e })?;
        let conn = Self::connect(dir)?;
        conn.execute_batch(SCHEMA)?;
        let dtype = match info.state_dtype {
            StateDtype::F32 => "f32",
            StateDtype::Bf16 => "bf16",
        };
        let tx_meta = [
            ("format", STORE_FORMAT.to_string()),
            ("model", info.fingerprint.clone()),
            ("dim", info.dim.to_string()),
            ("state_dtype", dtype.to_string()),
        ];
        for (k, v) in tx_meta {
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)", params![k, v])?;
        }
        let index = Index { flat: FlatIndex::new(info.dim)?, ids: Vec::new() };
        Ok(Self { dir: dir.to_path_buf(), info: info.clone(), conn: Mutex::new(conn), index: RwLock::new(index) })
    }

    /// Opens an existing store.
    pub fn open(dir: &Path) -> Result<Self> {
        let bad = |message: String| Error::Store { path: dir.to_path_buf(), message };
        if !dir.join("store.sqlite").is_file() {
            return Err(bad(
                "not a picaso store (no store.sqlite); create one with `picaso ingest --db DIR ...`".into()
            ));
        }
        let conn = Self::connect(dir)?;
        let meta = |k: &str| -> Result<String> {
            conn.query_row("SELECT value FROM meta WHERE key = ?1", [k], |r| r.get::<_, String>(0))
                .optional()?
                .ok_or_else(|| bad(format!("metadata lacks `{k}`")))
        };
        let format = meta("format")?;
        if format != STORE_FORMAT {
            return Err(bad(format!("format {format:?}, this picaso reads {STORE_FORMAT:?}")));
        }
        let dim: usize = meta("dim")?.parse().map_err(|_| bad("metadata `dim` is not a number".into()))?;
        let state_dtype = meta("state_dtype")?.parse().map_err(bad)?;
        let info = StoreInfo { fingerprint: meta("model")?, dim, state_dtype };
        let mut index = Index { flat: FlatIndex::new(dim)?, ids: Vec::new() };
        {
            let mut stmt = conn.prepare("SELECT id, embedding FROM contexts ORDER BY id")?;
            let mut rows = stmt.query([])?;
            while let Some(row) = rows.next()? {
                let id: i64 = row.get(0)?;
                let emb = blob_to_f32s(&row.get::<_, Vec<u8>>(1)?);
                index.flat.add(&emb)?;
                index.ids.push(id);
            }
        }
        Ok(Self { dir: dir.to_path_buf(), info, conn: Mutex::new(conn), index: RwLock::new(index) })
    }

    fn connect(dir: &Path) -> Result<Connection> {
        let conn = Connection::open(dir.join("store.sqlite"))?;
        conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        Ok(conn)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The store folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the store is bound to.
    pub fn info(&self) -> &StoreInfo {
        &self.info
    }

    /// Segments of `doc` already stored (ingest skips them).
    pub fn segments_of(&self, doc: &str) -> Result<HashSet<u32>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT seg FROM contexts WHERE doc = ?1")?;
        let rows = stmt.query_map([doc], |r| r.get::<_, u32>(0))?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    /// Adds contexts: their state files first (durable), then their rows in one transaction.
    /// A (doc, seg) already present is skipped. Returns the ids, `None` for skipped ones.
    pub fn insert(&self, items: &[NewContext]) -> Result<Vec<Option<i64>>> {
        let mut files = Vec::with_capacity(items.len());
        for it in items {
            if it.embedding.len() != self.info.dim {
                return Err(Error::Input(format!(
                    "embedding of {} values, the store holds {}-dimensional embeddings",
                    it.embedding.len(),
                    self.info.dim
                )));
            }
            if it.state.fingerprint != self.info.fingerprint {
                return Err(Error::WrongModel {
                    path: self.dir.clone(),
                    stored: self.info.fingerprint.clone(),
                    given: it.state.fingerprint.clone(),
                });
            }
            let bytes = it.state.to_bytes(self.info.state_dtype)?;
            let sum = checksum(&bytes);
            let rel = format!("states/{}/{sum}.safetensors", &sum[..2]);
            let path = self.dir.join(&rel);
            if !path.is_file() {
                let parent = path.parent().expect("state paths have a parent");
                std::fs::create_dir_all(parent).map_err(|e| Error::Io { path: parent.to_path_buf(), source: e })?;
                picaso_model::state::write_atomic(&path, &bytes)?;
            }
            files.push((rel, sum, bytes.len() as u64));
        }
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let mut ids = Vec::with_capacity(items.len());
        {
            let mut stmt = tx.prepare_cached(
                "INSERT OR IGNORE INTO contexts
                 (doc, seg, text, tokens, n_tokens, embedding, fingerprint, state_file, checksum, state_bytes, created)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
            )?;
            let created = now_unix();
            for (it, (rel, sum, size)) in items.iter().zip(&files) {
                let n = stmt.execute(params![
                    it.doc,
                    it.seg,
                    it.text,
                    u32s_to_blob(&it.tokens),
                    it.tokens.len() as i64,
                    f32s_to_blob(&it.embedding),
                    it.state.fingerprint,
                    rel,
                    sum,
                    *size as i64,
                    created
                ])?;
                ids.push((n == 1).then(|| tx.last_insert_rowid()));
            }
        }
        tx.commit()?;
        drop(conn);
        let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
        for (it, id) in items.iter().zip(&ids) {
            if let Some(id) = id {
                index.flat.add(&it.embedding)?;
                index.ids.push(*id);
            }
        }
        Ok(ids)
    }

    /// The id of the context stored for (`doc`, `seg`), if any.
    pub fn id_of(&self, doc: &str, seg: u32) -> Result<Option<i64>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT id FROM contexts WHERE doc = ?1 AND seg = ?2")?;
        Ok(stmt.query_row(params![doc, seg], |r| r.get(0)).optional()?)
    }

    /// The metadata of context `id`.
    pub fn get(&self, id: i64) -> Result<ContextRecord> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(
            "SELECT id, doc, seg, text, tokens, n_tokens, state_file, checksum, state_bytes, created
             FROM contexts WHERE id = ?1",
        )?;
        stmt.query_row([id], |r| {
            Ok(ContextRecord {
                id: r.get(0)?,
                doc: r.get(1)?,
                seg: r.get(2)?,
                text: r.get(3)?,
                tokens: blob_to_u32s(&r.get::<_, Vec<u8>>(4)?),
                n_tokens: r.get::<_, i64>(5)? as usize,
                state_file: r.get(6)?,
                checksum: r.get(7)?,
                state_bytes: r.get::<_, i64>(8)? as u64,
                created: r.get(9)?,
            })
        })
        .optional()?
        .ok_or(Error::NotFound(id))
    }

    /// How the store's documents were cut into contexts (`paragraph`, `tokens:N`, `halves:N`),
    /// recorded by the first ingest; `None` for a store that predates the record.
    pub fn segmentation(&self) -> Result<Option<String>> {
        let conn = self.conn();
        Ok(conn
            .query_row("SELECT value FROM meta WHERE key = 'segmentation'", [], |r| r.get::<_, String>(0))
            .optional()?)
    }

    /// Records `segmentation` on first use; refuses another one later, because a (document,
    /// segment) pair means a different text under another segmentation and ingest would skip
    /// it as already stored.
    pub fn bind_segmentation(&self, segmentation: &str) -> Result<()> {
        match self.segmentation()? {
            Some(s) if s == segmentation => Ok(()),
            Some(s) => Err(Error::Input(format!(
                "store {} was ingested with --segment {s}; ingest with the same segmentation or into a new store",
                self.dir.display()
            ))),
            None => {
                let conn = self.conn();
                conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('segmentation', ?1)", [segmentation])?;
                Ok(())
            }
        }
    }

    /// The (document, segment) of context `id` (without reading its text and tokens).
    pub fn doc_seg(&self, id: i64) -> Result<(String, u32)> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT doc, seg FROM contexts WHERE id = ?1")?;
        stmt.query_row([id], |r| Ok((r.get(0)?, r.get(1)?))).optional()?.ok_or(Error::NotFound(id))
    }

    /// Maps context `id`'s state file and verifies its checksum; f32 tensors are then read in
    /// place (see [`MappedState`]).
    pub fn map_state(&self, id: i64) -> Result<MappedState> {
        self.map_states(&[id]).map(|mut v| v.remove(0))
    }

    /// [`Store::map_state`] for several contexts: all files are mapped and their reads
    /// requested up front (the disk works on all of them at once), then verified in parallel.
    pub fn map_states(&self, ids: &[i64]) -> Result<Vec<MappedState>> {
        let mut maps = Vec::with_capacity(ids.len());
        for &id in ids {
            let rec = self.get(id)?;
            let path = self.dir.join(&rec.state_file);
            let file = std::fs::File::open(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
            // SAFETY: state files are written once and never modified in place (atomic rename).
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io { path: path.clone(), source: e })?;
            #[cfg(unix)]
            let _ = mmap.advise(memmap2::Advice::WillNeed); // only a hint
            maps.push((mmap, path, rec.checksum));
        }
        maps.into_par_iter()
            .map(|(mmap, path, recorded)| {
                let found = checksum(&mmap);
                if found != recorded {
                    return Err(Error::Corrupt { path, found, recorded });
                }
                MappedState::new(mmap).map_err(|e| Error::Model(e.at_state_file(&path)))
            })
            .collect()
    }

    /// Reads context `id`'s state into memory (checksum and values verified).
    pub fn load_state(&self, id: i64) -> Result<State> {
        let state = self.map_state(id)?.view().to_state();
        state.check_values()?;
        Ok(state)
    }

    /// Removes context `id` (and its state file unless another context shares it).
    pub fn delete(&self, id: i64) -> Result<()> {
        let rec = self.get(id)?;
        {
            let conn = self.conn();
            conn.execute("DELETE FROM contexts WHERE id = ?1", [id])?;
            let shared: i64 =
                conn.query_row("SELECT COUNT(*) FROM contexts WHERE checksum = ?1", [&rec.checksum], |r| r.get(0))?;
            if shared == 0 {
                let _ = std::fs::remove_file(self.dir.join(&rec.state_file));
            }
        }
        let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
        if let Some(pos) = index.ids.iter().position(|&x| x == id) {
            let dim = self.info.dim;
            let mut flat = index.flat.as_flat().to_vec();
            flat.drain(pos * dim..(pos + 1) * dim);
            index.flat = FlatIndex::from_flat(dim, flat)?;
            index.ids.remove(pos);
        }
        Ok(())
    }

    /// The `k` contexts most similar to `query` (a normalised embedding): (id, cosine), best first.
    pub fn search(&self, query: &[f32], k: usize) -> Result<Vec<(i64, f32)>> {
        let index = self.index.read().unwrap_or_else(|p| p.into_inner());
        let hits = index.flat.search(query, k)?;
        Ok(hits.into_iter().map(|(row, score)| (index.ids[row], score)).collect())
    }

    /// The stored (normalised) embedding of context `id`.
    pub fn embedding(&self, id: i64) -> Result<Vec<f32>> {
        let index = self.index.read().unwrap_or_else(|p| p.into_inner());
        let row = index.ids.binary_search(&id).map_err(|_| Error::NotFound(id))?;
        Ok(index.flat.vector(row).expect("index rows match ids").to_vec())
    }

    /// Number of contexts (without copying the id list).
    pub fn len(&self) -> usize {
        self.index.read().unwrap_or_else(|p| p.into_inner()).ids.len()
    }

    /// Whether the store holds no context.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ids of all contexts, ascending.
    pub fn ids(&self) -> Vec<i64> {
        self.index.read().unwrap_or_else(|p| p.into_inner()).ids.clone()
    }

    /// Totals.
    pub fn stats(&self) -> Result<Stats> {
        let conn = self.conn();
        let (contexts, documents, tokens, state_bytes) = conn.query_row(
            "SELECT COUNT(*), COUNT(DISTINCT doc), COALESCE(SUM(n_tokens), 0), COALESCE(SUM(state_bytes), 0) FROM contexts",
            [],
            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, i64>(3)?)),
        )?;
        Ok(Stats {
            contexts: contexts as u64,
            documents: documents as u64,
            tokens: tokens as u64,
            state_bytes: state_bytes as u64,
            model: self.info.fingerprint.clone(),
        })
    }
}
