//! The embedded catalog: SQLite (WAL, synchronous=FULL) in `DIR/store.sqlite`, and an
//! in-memory exact index over the embeddings, loaded at open and brought up to date before it
//! is read whenever another connection (another process, or another `Store` of this one) has
//! committed since. One writer at a time per folder store; several servers share a PostgreSQL
//! catalog instead. A BM25 index over the contexts' text is built the same way, from the
//! table, at the first text search.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock};

use picaso_embed::{Bm25Index, FlatIndex, VectorIndex};
use rusqlite::{params, Connection, OptionalExtension};

use super::columns::MetadataColumns;
use super::{blob_to_f32s, blob_to_u32s, f32s_to_blob, u32s_to_blob, Catalog, LedgerRow, RemoveStates, Row, Totals};
use crate::error::{Error, Result};
use crate::filter::Filter;
use crate::location::CatalogUrl;
use crate::metadata;
use crate::records::{ContextRecord, DocumentSummary};
use crate::scope::Scope;

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
    metadata    BLOB    NOT NULL DEFAULT '{}',
    UNIQUE (doc, seg)
);
CREATE INDEX IF NOT EXISTS contexts_metadata ON contexts (metadata);
";

/// A budgeted store's ledger (see [`crate::budget`]): one row per state object the budget has
/// seen, held or not. Made with every store (empty without a budget) and by `upgrade`.
const LEDGER: &str = "
CREATE TABLE IF NOT EXISTS state_ledger (
    checksum   TEXT    PRIMARY KEY,
    bytes      INTEGER NOT NULL,
    work       REAL    NOT NULL,
    retrievals INTEGER NOT NULL,
    last_tick  INTEGER NOT NULL,
    priority   REAL    NOT NULL,
    held       INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS state_ledger_held ON state_ledger (held, priority, last_tick);
";

/// An index of the metadata alone: reading every context's metadata for the filter columns
/// scans it (it covers the query) instead of the table, whose rows hold embeddings and tokens.
/// The metadata is stored as SQLite's binary JSON (`jsonb`). A plain column, not an index of
/// `jsonb(...)`: a SQLite older than 3.45 (Debian 12's `sqlite3`) could not write a table
/// indexed by a function it lacks.
const METADATA_INDEX: &str = "CREATE INDEX IF NOT EXISTS contexts_metadata ON contexts (metadata)";

/// A record's columns, the metadata as JSON text: read as `{}` from a store made before the
/// column existed and opened read-only (a writable one gets the column when opened).
fn record_columns(has_metadata: bool) -> &'static str {
    if has_metadata {
        "id, doc, seg, text, tokens, n_tokens, state_file, checksum, state_bytes, created, json(metadata)"
    } else {
        "id, doc, seg, text, tokens, n_tokens, state_file, checksum, state_bytes, created, '{}'"
    }
}

/// Whether the contexts table has the metadata column.
fn has_metadata_column(conn: &Connection) -> Result<bool> {
    Ok(conn.query_row("SELECT COUNT(*) FROM pragma_table_info('contexts') WHERE name = 'metadata'", [], |r| {
        r.get::<_, i64>(0)
    })? == 1)
}

/// Brings a writable store made by an earlier picaso up to this one's schema, once, whoever
/// opens it first: the metadata column, and the index that lets a filter scan the metadata
/// without reading every row's embedding and tokens.
fn upgrade(conn: &mut Connection) -> Result<()> {
    conn.execute_batch(LEDGER)?;
    let has_index = |c: &Connection| -> Result<bool> {
        Ok(c.query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = 'contexts_metadata'",
            [],
            |r| r.get::<_, i64>(0),
        )? == 1)
    };
    if has_metadata_column(conn)? && has_index(conn)? {
        return Ok(());
    }
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    if !has_metadata_column(&tx)? {
        tx.execute_batch("ALTER TABLE contexts ADD COLUMN metadata BLOB NOT NULL DEFAULT '{}'")?;
    }
    if !has_index(&tx)? {
        tx.execute_batch(METADATA_INDEX)?;
    }
    tx.commit()?;
    Ok(())
}

/// The ledger's columns, in [`LedgerRow`]'s order.
const LEDGER_COLUMNS: &str = "checksum, bytes, work, retrievals, last_tick, priority, held";

fn ledger_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<LedgerRow> {
    Ok(LedgerRow {
        checksum: r.get(0)?,
        bytes: r.get::<_, i64>(1)? as u64,
        work: r.get(2)?,
        retrievals: r.get::<_, i64>(3)? as u64,
        last_tick: r.get::<_, i64>(4)? as u64,
        priority: r.get(5)?,
        held: r.get(6)?,
    })
}

/// The retrieval index and the context id of each of its rows (ascending).
struct Index {
    flat: FlatIndex,
    ids: Vec<i64>,
    /// SQLite's `data_version` when the index last matched the table: it changes when another
    /// connection commits (this connection's own writes update the index as they commit).
    version: i64,
    /// The contexts' metadata by key, read at the first filter and kept up to date by this
    /// connection's inserts and deletes; dropped (read again at the next filter) when another
    /// connection commits or metadata is set.
    metadata: Option<MetadataColumns>,
    /// BM25 over the contexts' text, read at the first text search and kept up to date like
    /// `metadata` (dropped when another connection commits).
    text: Option<Bm25Index>,
}

/// The number SQLite changes whenever another connection commits to the database.
fn data_version(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row("PRAGMA data_version", [], |r| r.get(0))?)
}

/// The embedding of context `id` from its row, refused if damaged (wrong width, not finite).
fn checked_embedding(dir: &Path, id: i64, blob: &[u8], dim: usize) -> Result<Vec<f32>> {
    let embedding = blob_to_f32s(blob);
    if embedding.len() == dim && embedding.iter().all(|v| v.is_finite()) {
        return Ok(embedding);
    }
    Err(Error::Store {
        location: dir.display().to_string(),
        message: format!(
            "the catalog row of context {id} is damaged: its embedding has {} values{}, the store's \
             dimension is {dim}; remove it (`sqlite3 {}/store.sqlite \"DELETE FROM contexts WHERE \
             id = {id}\"`) and ingest its text again",
            embedding.len(),
            if embedding.iter().any(|v| !v.is_finite()) { " (some not finite)" } else { "" },
            dir.display(),
        ),
    })
}

impl Index {
    /// Every context's embedding, in id order.
    fn load(dir: &Path, conn: &Connection, dim: usize) -> Result<Self> {
        let version = data_version(conn)?;
        let mut index = Index { flat: FlatIndex::new(dim)?, ids: Vec::new(), version, metadata: None, text: None };
        let mut stmt = conn.prepare("SELECT id, embedding FROM contexts ORDER BY id")?;
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            let id: i64 = row.get(0)?;
            index.flat.add(&checked_embedding(dir, id, &row.get::<_, Vec<u8>>(1)?, dim)?)?;
            index.ids.push(id);
        }
        Ok(index)
    }

    /// Brings the index up to the table after other connections' commits: reads the ids (not
    /// the embeddings), drops the rows that are gone and reads only the new ones' embeddings.
    /// `version` is `data_version` read before the ids: a commit after that read changes it
    /// again, and is caught then.
    fn sync(&mut self, dir: &Path, conn: &Connection, version: i64) -> Result<()> {
        if version == self.version {
            return Ok(());
        }
        // Which rows' metadata changed is not known: read it all again when a filter needs it.
        self.metadata = None;
        self.text = None;
        let current: Vec<i64> = {
            let mut stmt = conn.prepare_cached("SELECT id FROM contexts ORDER BY id")?;
            let rows = stmt.query_map([], |r| r.get(0))?;
            rows.collect::<std::result::Result<_, _>>()?
        };
        let dim = self.flat.dim();
        let mut embedding = conn.prepare_cached("SELECT embedding FROM contexts WHERE id = ?1")?;
        let mut read = |id: i64| -> Result<Option<Vec<f32>>> {
            match embedding.query_row([id], |r| r.get::<_, Vec<u8>>(0)).optional()? {
                Some(blob) => checked_embedding(dir, id, &blob, dim).map(Some),
                // Deleted since the ids were read: the next sync sees the commit that did it.
                None => Ok(None),
            }
        };
        let appended_only = self.ids.len() <= current.len()
            && current[..self.ids.len()] == self.ids[..]
            && current.get(self.ids.len()).is_none_or(|&first| self.ids.last().is_none_or(|&last| first > last));
        if appended_only {
            for &id in &current[self.ids.len()..] {
                if let Some(v) = read(id)? {
                    self.flat.add(&v)?;
                    self.ids.push(id);
                }
            }
        } else {
            // Rows removed (or ids written below others): one pass in id order, keeping the
            // vectors the index has.
            let (mut flat, mut ids) = (Vec::with_capacity(current.len() * dim), Vec::with_capacity(current.len()));
            for id in current {
                match self.ids.binary_search(&id) {
                    Ok(row) => flat.extend_from_slice(self.flat.vector(row).expect("index rows match ids")),
                    Err(_) => match read(id)? {
                        Some(v) => flat.extend_from_slice(&v),
                        None => continue,
                    },
                }
                ids.push(id);
            }
            self.flat = FlatIndex::from_flat(dim, flat)?;
            self.ids = ids;
        }
        self.version = version;
        Ok(())
    }

    /// The metadata columns, read from the table if they are not held (`conn` must be the
    /// connection the index was last synced on, held since).
    fn metadata(&mut self, conn: &Connection, has_metadata: bool) -> Result<&MetadataColumns> {
        if self.metadata.is_none() {
            self.metadata = Some(read_columns(conn, has_metadata, &self.ids)?);
        }
        Ok(self.metadata.get_or_insert_default())
    }
}

impl Index {
    /// The BM25 index, built from the table's text if it is not held (`conn` as for
    /// [`Index::metadata`]).
    fn text(&mut self, conn: &Connection) -> Result<&Bm25Index> {
        if self.text.is_none() {
            let mut text = Bm25Index::new();
            let mut stmt = conn.prepare_cached("SELECT id, text FROM contexts")?;
            let mut rows = stmt.query([])?;
            while let Some(row) = rows.next()? {
                let id: i64 = row.get(0)?;
                // Only the rows the index holds (a row committed since the last sync waits for
                // the next one, as its vector does).
                if self.ids.binary_search(&id).is_ok() {
                    text.add(id, &row.get::<_, String>(1)?);
                }
            }
            self.text = Some(text);
        }
        Ok(self.text.get_or_insert_default())
    }
}

/// Every context's metadata as columns (`ids`, every context, when the table has no metadata
/// column: none has any).
fn read_columns(conn: &Connection, has_metadata: bool, ids: &[i64]) -> Result<MetadataColumns> {
    let mut columns = MetadataColumns::default();
    if !has_metadata {
        for &id in ids {
            columns.push(id, "{}")?;
        }
        return Ok(columns);
    }
    // The metadata index covers this query: it scans that, not the table's embeddings and
    // tokens, in the index's order (sorted by id here).
    let mut stmt = conn.prepare_cached("SELECT id, json(metadata) FROM contexts")?;
    let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
    let mut rows: Vec<(i64, String)> = rows.collect::<std::result::Result<_, _>>()?;
    rows.sort_unstable_by_key(|&(id, _)| id);
    for (id, json) in rows {
        columns.push(id, &json)?;
    }
    Ok(columns)
}

/// The rows of the ascending `index_ids` that hold the ascending `ids` (ids not there are
/// left out): a binary search each for a few ids, one walk along both for many.
fn rows_of(index_ids: &[i64], ids: &[i64]) -> Vec<usize> {
    if ids.len().saturating_mul(16) < index_ids.len() {
        return ids.iter().filter_map(|id| index_ids.binary_search(id).ok()).collect();
    }
    let mut rows = Vec::with_capacity(ids.len());
    let mut row = 0;
    for &id in ids {
        while row < index_ids.len() && index_ids[row] < id {
            row += 1;
        }
        if index_ids.get(row) == Some(&id) {
            rows.push(row);
        }
    }
    rows
}

/// Name prefix of a database being built by [`SqliteCatalog::create`], in the store folder.
pub(crate) const CREATING_PREFIX: &str = ".store.sqlite.creating-";

/// Whether this process can create files in `dir`: a read-only mount or a directory without
/// write permission cannot hold SQLite's WAL files. (`access` answers for root too on a
/// read-only mount.)
fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return true };
    // SAFETY: a NUL-terminated path that outlives the call.
    let denied = unsafe { libc::access(c.as_ptr(), libc::W_OK) } != 0;
    // Another failure (the folder is gone) is not a read-only folder: the normal open reports it.
    !(denied
        && matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EACCES) | Some(libc::EROFS) | Some(libc::EPERM)
        ))
}

/// `path` for a SQLite `file:` URI (`?`, `#`, `%` and others escaped).
fn percent_encode(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"/-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// SQLite metadata in a store folder.
pub struct SqliteCatalog {
    dir: PathBuf,
    conn: Mutex<Connection>,
    index: RwLock<Index>,
    /// Held by an insert from before it writes its state objects until its rows commit, and by
    /// a delete: a delete cannot remove an object an insert is about to share. Taken before
    /// `conn`, which is held only for SQL, so searches never wait for state files.
    writes: Mutex<()>,
    /// Whether the contexts table has the metadata column (false only for a store made before
    /// it and opened read-only: every context reads as having no metadata).
    has_metadata: bool,
}

impl std::fmt::Debug for SqliteCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteCatalog").field("dir", &self.dir).finish()
    }
}

fn record(r: &rusqlite::Row<'_>) -> rusqlite::Result<ContextRecord> {
    let metadata = metadata::from_json(&r.get::<_, String>(10)?)
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(10, rusqlite::types::Type::Text, Box::new(e)))?;
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
        metadata,
    })
}

impl SqliteCatalog {
    /// Whether `dir` holds a store.
    pub fn exists_at(dir: &Path) -> bool {
        dir.join("store.sqlite").is_file()
    }

    /// Opens the store in `dir` (which must exist).
    pub fn open(dir: &Path) -> Result<Self> {
        if !Self::exists_at(dir) {
            return Err(Error::Store {
                location: dir.display().to_string(),
                message: "not a picaso store (no store.sqlite); create one with `picaso ingest --db DIR ...` or Python `picaso.Store.create(DIR, model)`".into(),
            });
        }
        let mut conn = Self::connect(dir)?;
        let has_meta: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta')",
            [],
            |r| r.get(0),
        )?;
        let dim: Option<String> = if has_meta {
            conn.query_row("SELECT value FROM meta WHERE key = 'dim'", [], |r| r.get(0)).optional()?
        } else {
            None
        };
        let dim: usize = match dim {
            Some(d) => d.parse().map_err(|_| Error::Store {
                location: dir.display().to_string(),
                message: format!("metadata `dim` is {d:?}, not a number"),
            })?,
            None => return Err(super::unfinished(&CatalogUrl::Sqlite(dir.to_path_buf()))),
        };
        if writable(dir) {
            upgrade(&mut conn)?;
        }
        let has_metadata = has_metadata_column(&conn)?;
        let index = Index::load(dir, &conn, dim)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            conn: Mutex::new(conn),
            index: RwLock::new(index),
            writes: Mutex::new(()),
            has_metadata,
        })
    }

    /// Creates the store in `dir` for `dim`-dimensional embeddings with metadata `meta` (or
    /// opens it if present). The database is built in a temporary file and linked into place
    /// whole, so a creation killed at any point leaves no store or a complete one (never one
    /// that every later command refuses); of two processes creating at once, one wins and the
    /// other opens its store.
    pub fn create(dir: &Path, dim: usize, meta: &[(&str, &str)]) -> Result<Self> {
        if Self::exists_at(dir) {
            return Self::open(dir);
        }
        if dir.exists() && !dir.is_dir() {
            return Err(Error::Store {
                location: dir.display().to_string(),
                message: "is a file; a folder store is a folder (give a new or existing folder's path)".into(),
            });
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::Io { path: dir.to_path_buf(), source: e })?;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let tmp = dir.join(format!("{CREATING_PREFIX}{}-{nanos}", std::process::id()));
        let built = (|| -> Result<()> {
            let mut conn = Connection::open(&tmp)?;
            conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;")?;
            let tx = conn.transaction()?;
            tx.execute_batch(SCHEMA)?;
            tx.execute_batch(LEDGER)?;
            tx.execute("INSERT INTO meta (key, value) VALUES ('dim', ?1)", [dim.to_string()])?;
            for (k, v) in meta {
                tx.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?1, ?2)", params![k, v])?;
            }
            tx.commit()?;
            // Closing the last connection checkpoints the WAL into the file and removes it.
            conn.close().map_err(|(_, e)| e)?;
            // A hard link fails if the name is taken: a concurrent creator's store is never
            // replaced under it (a rename would).
            match std::fs::hard_link(&tmp, dir.join("store.sqlite")) {
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(Error::Io { path: dir.join("store.sqlite"), source: e }),
                Ok(()) => {
                    if let Ok(d) = std::fs::File::open(dir) {
                        let _ = d.sync_all(); // persist the link
                    }
                }
            }
            Ok(())
        })();
        let _ = std::fs::remove_file(&tmp);
        built?;
        Self::open(dir)
    }

    fn connect(dir: &Path) -> Result<Connection> {
        if !writable(dir) {
            return Self::connect_read_only(dir);
        }
        let conn = Connection::open(dir.join("store.sqlite"))?;
        conn.execute_batch("PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        Ok(conn)
    }

    /// A store in a folder this process cannot write (a read-only mount or directory): WAL
    /// needs its shared-memory file beside the database, which cannot be made there, so the
    /// database is opened as immutable (nobody can write it either) when its WAL holds nothing;
    /// commands that only read work, writes fail at their writer lock.
    fn connect_read_only(dir: &Path) -> Result<Connection> {
        use rusqlite::OpenFlags;
        let db = dir.join("store.sqlite");
        let wal = std::fs::metadata(dir.join("store.sqlite-wal")).map(|m| m.len()).unwrap_or(0);
        let mode = if wal == 0 { "immutable=1" } else { "mode=ro" };
        let uri = format!("file:{}?{mode}", percent_encode(&db));
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let opened = Connection::open_with_flags(&uri, flags).and_then(|c| {
            c.query_row("SELECT COUNT(*) FROM sqlite_master", [], |r| r.get::<_, i64>(0))?;
            Ok(c)
        });
        opened.map_err(|e| Error::Store {
            location: dir.display().to_string(),
            message: format!(
                "the folder is read-only and the store cannot be read from it ({e}){}",
                if wal > 0 {
                    "; its last writer left commits in store.sqlite-wal: open it once where the folder is \
                     writable (e.g. `picaso stats --db DIR`), then it can be read read-only"
                } else {
                    "; make the folder writable or copy the store"
                }
            ),
        })
    }

    /// The ids `scope` allows, ascending (`None`: every context).
    fn ids_in(&self, scope: Scope<'_>) -> Result<Option<Vec<i64>>> {
        let mut ids = match scope.documents {
            None => None,
            Some(docs) => {
                let mut ids = Vec::new();
                for doc in docs {
                    ids.extend(self.segments_of(doc)?.into_values());
                }
                ids.sort_unstable();
                ids.dedup();
                Some(ids)
            }
        };
        if let Some(filter) = scope.filter {
            let matching = self.matching(filter)?;
            ids = Some(match ids {
                None => matching,
                Some(of_docs) => of_docs.into_iter().filter(|id| matching.binary_search(id).is_ok()).collect(),
            });
        }
        Ok(ids)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The index, first brought up to date if another connection has committed since it was
    /// (one `PRAGMA data_version` per read when nothing changed).
    fn index(&self) -> Result<std::sync::RwLockReadGuard<'_, Index>> {
        let conn = self.conn();
        let version = data_version(&conn)?;
        let stale = self.index.read().unwrap_or_else(|p| p.into_inner()).version != version;
        if stale {
            self.index.write().unwrap_or_else(|p| p.into_inner()).sync(&self.dir, &conn, version)?;
        }
        // Taken before the connection is let go, so no write of this process comes between.
        let index = self.index.read().unwrap_or_else(|p| p.into_inner());
        drop(conn);
        Ok(index)
    }
}

impl Catalog for SqliteCatalog {
    fn url(&self) -> String {
        self.dir.display().to_string()
    }

    fn meta(&self, key: &str) -> Result<Option<String>> {
        let conn = self.conn();
        Ok(conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0)).optional()?)
    }

    fn init_meta(&self, key: &str, value: &str) -> Result<String> {
        let conn = self.conn();
        conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?1, ?2)", params![key, value])?;
        Ok(conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))?)
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<()> {
        self.conn().execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)", params![key, value])?;
        Ok(())
    }

    fn ledger(&self, checksums: &[String]) -> Result<Vec<Option<LedgerRow>>> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare_cached(&format!("SELECT {LEDGER_COLUMNS} FROM state_ledger WHERE checksum = ?1"))?;
        checksums.iter().map(|sum| Ok(stmt.query_row([sum], ledger_row).optional()?)).collect()
    }

    fn put_ledger(&self, rows: &[LedgerRow], meta: &[(&str, String)]) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        {
            let mut put = tx.prepare_cached(&format!(
                "INSERT OR REPLACE INTO state_ledger ({LEDGER_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"
            ))?;
            for r in rows {
                put.execute(params![
                    r.checksum,
                    r.bytes as i64,
                    r.work,
                    r.retrievals as i64,
                    r.last_tick as i64,
                    r.priority,
                    r.held
                ])?;
            }
            let mut set = tx.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)")?;
            for (k, v) in meta {
                set.execute(params![k, v])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn forget_ledger(&self, checksums: Option<&[String]>) -> Result<()> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        match checksums {
            None => {
                tx.execute("DELETE FROM state_ledger", [])?;
            }
            Some(sums) => {
                let mut forget = tx.prepare_cached("DELETE FROM state_ledger WHERE checksum = ?1")?;
                for sum in sums {
                    forget.execute([sum])?;
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    fn lowest_held(&self, limit: usize) -> Result<Vec<LedgerRow>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT {LEDGER_COLUMNS} FROM state_ledger WHERE held = 1 ORDER BY priority, last_tick LIMIT ?1"
        ))?;
        let rows = stmt.query_map([limit as i64], ledger_row)?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    fn ledger_totals(&self) -> Result<(u64, u64, u64)> {
        let conn = self.conn();
        Ok(conn.query_row(
            "SELECT COALESCE(SUM(CASE WHEN held = 1 THEN bytes END), 0), COALESCE(SUM(held), 0), COUNT(*) FROM state_ledger",
            [],
            |r| Ok((r.get::<_, i64>(0)? as u64, r.get::<_, i64>(1)? as u64, r.get::<_, i64>(2)? as u64)),
        )?)
    }

    fn segments_of(&self, doc: &str) -> Result<BTreeMap<u32, i64>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT seg, id FROM contexts WHERE doc = ?1")?;
        let rows = stmt.query_map([doc], |r| Ok((r.get::<_, u32>(0)?, r.get::<_, i64>(1)?)))?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    fn insert(&self, rows: &[Row<'_>], write_states: &mut dyn FnMut() -> Result<()>) -> Result<Vec<Option<i64>>> {
        let _writes = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        write_states()?;
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let mut ids = Vec::with_capacity(rows.len());
        {
            let mut stmt = tx.prepare_cached(
                "INSERT OR IGNORE INTO contexts
                 (id, doc, seg, text, tokens, n_tokens, embedding, fingerprint, state_file, checksum, state_bytes, created,
                  metadata)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, jsonb(?13))",
            )?;
            for r in rows {
                let n = stmt.execute(params![
                    r.id,
                    r.doc,
                    r.seg,
                    r.text,
                    u32s_to_blob(r.tokens),
                    r.tokens.len() as i64,
                    f32s_to_blob(r.embedding),
                    r.fingerprint,
                    r.state_file,
                    r.checksum,
                    r.state_bytes as i64,
                    r.created,
                    r.metadata
                ])?;
                ids.push((n == 1).then(|| tx.last_insert_rowid()));
            }
        }
        tx.commit()?;
        let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
        drop(conn);
        for (r, id) in rows.iter().zip(&ids) {
            if let Some(id) = id {
                index.flat.add(r.embedding)?;
                // Ids ascend except when migrating ids in; keep the list sorted either way.
                let at = index.ids.partition_point(|&x| x < *id);
                if at == index.ids.len() {
                    index.ids.push(*id);
                } else {
                    // Rare (explicit ids below existing ones): rebuild in id order.
                    index.ids.push(*id);
                    let dim = index.flat.dim();
                    let mut order: Vec<usize> = (0..index.ids.len()).collect();
                    order.sort_by_key(|&i| index.ids[i]);
                    let flat: Vec<f32> =
                        order.iter().flat_map(|&i| index.flat.vector(i).expect("row exists").to_vec()).collect();
                    index.ids = order.iter().map(|&i| index.ids[i]).collect();
                    index.flat = FlatIndex::from_flat(dim, flat)?;
                }
                let appended = match &mut index.metadata {
                    Some(columns) => columns.push(*id, r.metadata).unwrap_or(false),
                    None => true,
                };
                if !appended {
                    // Out of order (or not an object): read the columns again when needed.
                    index.metadata = None;
                }
                if let Some(text) = &mut index.text {
                    text.add(*id, r.text);
                }
            }
        }
        Ok(ids)
    }

    fn id_of(&self, doc: &str, seg: u32) -> Result<Option<i64>> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT id FROM contexts WHERE doc = ?1 AND seg = ?2")?;
        Ok(stmt.query_row(params![doc, seg], |r| r.get(0)).optional()?)
    }

    fn get_many(&self, ids: &[i64]) -> Result<Vec<ContextRecord>> {
        let conn = self.conn();
        let columns = record_columns(self.has_metadata);
        let mut stmt = conn.prepare_cached(&format!("SELECT {columns} FROM contexts WHERE id = ?1"))?;
        ids.iter().map(|&id| stmt.query_row([id], record).optional()?.ok_or(Error::NotFound(id))).collect()
    }

    fn exist(&self, ids: &[i64]) -> Result<Vec<bool>> {
        let index = self.index()?;
        Ok(ids.iter().map(|id| index.ids.binary_search(id).is_ok()).collect())
    }

    fn doc_seg(&self, id: i64) -> Result<(String, u32)> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT doc, seg FROM contexts WHERE id = ?1")?;
        stmt.query_row([id], |r| Ok((r.get(0)?, r.get(1)?))).optional()?.ok_or(Error::NotFound(id))
    }

    fn delete(&self, id: i64, remove_states: &mut RemoveStates<'_>) -> Result<()> {
        match self.delete_many(&[id], remove_states)?.is_empty() {
            true => Err(Error::NotFound(id)),
            false => Ok(()),
        }
    }

    /// One transaction for the rows and one pass over the index, whatever the count (a
    /// delete at a time would rewrite the index's whole matrix per context).
    fn delete_many(&self, ids: &[i64], remove_states: &mut RemoveStates<'_>) -> Result<Vec<i64>> {
        let _writes = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let (mut removed, mut checksums) = (Vec::new(), std::collections::BTreeSet::new());
        {
            let mut delete = tx.prepare_cached("DELETE FROM contexts WHERE id = ?1 RETURNING checksum")?;
            for &id in ids {
                if let Some(checksum) = delete.query_row([id], |r| r.get::<_, String>(0)).optional()? {
                    removed.push(id);
                    checksums.insert(checksum);
                }
            }
        }
        tx.commit()?;
        removed.sort_unstable();
        {
            // Before searches can run again: a search never ranks a context whose row is gone.
            let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
            let rows = rows_of(&index.ids, &removed);
            index.flat.remove_rows(&rows)?;
            let mut row = 0;
            index.ids.retain(|_| {
                row += 1;
                rows.binary_search(&(row - 1)).is_err()
            });
            if let Some(columns) = &mut index.metadata {
                columns.remove(&removed);
            }
            if let Some(text) = &mut index.text {
                for id in &removed {
                    text.remove(*id);
                }
            }
        }
        let mut shared = conn.prepare_cached("SELECT EXISTS (SELECT 1 FROM contexts WHERE checksum = ?1)")?;
        let unshared: Vec<String> = checksums
            .into_iter()
            .map(|sum| Ok((!shared.query_row([&sum], |r| r.get::<_, bool>(0))?).then_some(sum)))
            .filter_map(Result::transpose)
            .collect::<Result<_>>()?;
        drop(shared);
        if !unshared.is_empty() {
            // An object no context names leaves the budget's ledger with it.
            let tx = conn.transaction()?;
            {
                let mut forget = tx.prepare_cached("DELETE FROM state_ledger WHERE checksum = ?1")?;
                for sum in &unshared {
                    forget.execute([sum])?;
                }
            }
            tx.commit()?;
        }
        drop(conn);
        if !unshared.is_empty() {
            // The rows are gone for good: an object that cannot be removed stays as an orphan
            // (the next write of that state replaces it) and the delete still succeeded.
            let _ = remove_states(&unshared);
        }
        Ok(removed)
    }

    fn restate(
        &self,
        id: i64,
        checksum: &str,
        state_file: &str,
        state_bytes: u64,
        write_states: &mut dyn FnMut() -> Result<()>,
    ) -> Result<bool> {
        let _writes = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        write_states()?;
        let n = self.conn().execute(
            "UPDATE contexts SET checksum = ?1, state_file = ?2, state_bytes = ?3 WHERE id = ?4",
            params![checksum, state_file, state_bytes as i64, id],
        )?;
        Ok(n == 1)
    }

    fn remove_if_unreferenced(&self, checksum: &str, remove_state: &mut dyn FnMut(&str) -> Result<()>) -> Result<bool> {
        let _writes = self.writes.lock().unwrap_or_else(|p| p.into_inner());
        let used: bool =
            self.conn()
                .query_row("SELECT EXISTS (SELECT 1 FROM contexts WHERE checksum = ?1)", [checksum], |r| r.get(0))?;
        if used {
            return Ok(false);
        }
        remove_state(checksum)?;
        Ok(true)
    }

    fn search(&self, query: &[f32], k: usize, _exact: bool, scope: Scope<'_>) -> Result<Vec<(i64, f32)>> {
        // The scope's ids, read before the index is: `index()` may wait for the connection
        // while it rebuilds the index, so reading with its guard held could deadlock.
        let ids = self.ids_in(scope)?;
        let index = self.index()?;
        let hits = match ids {
            None => index.flat.search(query, k)?,
            Some(ids) => {
                // Rows of the index (a context deleted between the two reads is left out).
                index.flat.search_among(query, k, &rows_of(&index.ids, &ids))?
            }
        };
        Ok(hits.into_iter().map(|(row, score)| (index.ids[row], score)).collect())
    }

    fn search_text(&self, query: &str, k: usize, scope: Scope<'_>) -> Result<Vec<(i64, f32)>> {
        // As in `search`: the scope first, then the index.
        let ids = self.ids_in(scope)?;
        {
            let index = self.index()?;
            if let Some(text) = &index.text {
                return Ok(text.search(query, k, ids.as_deref()));
            }
        }
        // The first text search since the store opened or another connection committed: the
        // text is read under the index's write lock, taken after the connection as everywhere.
        let conn = self.conn();
        let version = data_version(&conn)?;
        let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
        index.sync(&self.dir, &conn, version)?;
        Ok(index.text(&conn)?.search(query, k, ids.as_deref()))
    }

    fn set_metadata(&self, ids: &[i64], metadata: &str) -> Result<u64> {
        if !self.has_metadata {
            return Err(Error::Store {
                location: self.dir.display().to_string(),
                message: "the store is read-only here; set metadata where its folder is writable".into(),
            });
        }
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let mut changed = 0;
        {
            let mut stmt = tx.prepare_cached(
                "UPDATE contexts SET metadata = jsonb(?1) WHERE id = ?2 AND metadata IS NOT jsonb(?1)",
            )?;
            for id in ids {
                changed += stmt.execute(params![metadata, id])? as u64;
            }
        }
        tx.commit()?;
        if changed > 0 {
            // Many contexts may have changed: the next filter reads the columns again.
            self.index.write().unwrap_or_else(|p| p.into_inner()).metadata = None;
        }
        Ok(changed)
    }

    fn matching(&self, filter: &Filter) -> Result<Vec<i64>> {
        {
            let index = self.index()?;
            if let Some(columns) = &index.metadata {
                return Ok(columns.matching(filter));
            }
        }
        // The first filter since the store opened, metadata was set or another connection
        // committed: the columns are read under the index's write lock, taken after the
        // connection as everywhere, with the index brought up to date first.
        let conn = self.conn();
        let version = data_version(&conn)?;
        let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
        index.sync(&self.dir, &conn, version)?;
        let columns = index.metadata(&conn, self.has_metadata)?;
        Ok(columns.matching(filter))
    }

    fn embedding(&self, id: i64) -> Result<Vec<f32>> {
        let index = self.index()?;
        let row = index.ids.binary_search(&id).map_err(|_| Error::NotFound(id))?;
        Ok(index.flat.vector(row).expect("index rows match ids").to_vec())
    }

    fn count(&self) -> Result<usize> {
        Ok(self.index()?.ids.len())
    }

    fn ids(&self) -> Result<Vec<i64>> {
        Ok(self.index()?.ids.clone())
    }

    fn totals(&self) -> Result<Totals> {
        let conn = self.conn();
        let t = conn.query_row(
            "SELECT COUNT(*), COUNT(DISTINCT doc), COALESCE(SUM(n_tokens), 0),
                    (SELECT COALESCE(SUM(b), 0) FROM (SELECT MAX(state_bytes) AS b FROM contexts GROUP BY state_file))
             FROM contexts",
            [],
            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, i64>(3)?)),
        )?;
        Ok((t.0 as u64, t.1 as u64, t.2 as u64, t.3 as u64))
    }

    fn documents(&self, after: Option<&str>, limit: usize) -> Result<Vec<DocumentSummary>> {
        let conn = self.conn();
        // With one min() among the aggregates, SQLite takes the bare metadata column from the
        // row holding it: the first segment's.
        let metadata = if self.has_metadata { "json(metadata)" } else { "'{}'" };
        let mut stmt = conn.prepare_cached(&format!(
            "SELECT doc, COUNT(*), COALESCE(SUM(n_tokens), 0), MIN(seg), {metadata} FROM contexts
             WHERE ?1 IS NULL OR doc > ?1 GROUP BY doc ORDER BY doc LIMIT ?2"
        ))?;
        let rows = stmt.query_map(params![after, limit as i64], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, String>(4)?))
        })?;
        rows.map(|row| {
            let (id, contexts, tokens, metadata) = row?;
            Ok(DocumentSummary {
                id,
                contexts: contexts as u64,
                tokens: tokens as u64,
                metadata: metadata::from_json(&metadata)?,
            })
        })
        .collect()
    }

    fn export(&self, after: i64, limit: usize) -> Result<Vec<(ContextRecord, Vec<f32>)>> {
        let conn = self.conn();
        let columns = record_columns(self.has_metadata);
        let mut stmt = conn
            .prepare_cached(&format!("SELECT {columns}, embedding FROM contexts WHERE id > ?1 ORDER BY id LIMIT ?2"))?;
        let rows = stmt
            .query_map(params![after, limit as i64], |r| Ok((record(r)?, blob_to_f32s(&r.get::<_, Vec<u8>>(11)?))))?;
        Ok(rows.collect::<std::result::Result<_, _>>()?)
    }

    fn set_ann_index(&self, hnsw: Option<(usize, usize)>) -> Result<()> {
        match hnsw {
            None => Ok(()),
            Some(_) => Err(Error::Input(format!(
                "store {}: approximate (HNSW) indexes need a PostgreSQL catalog; a folder store searches exactly",
                self.dir.display()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delete_many_removes_rows_and_then_unshared_objects() {
        let tmp = tempfile::tempdir().unwrap();
        crate::catalog::checks::delete_many_removes_rows_and_then_unshared_objects(
            &SqliteCatalog::create(tmp.path(), 2, &[]).unwrap(),
        );
    }

    #[test]
    fn metadata_round_trips_and_filters_follow_the_rules() {
        let tmp = tempfile::tempdir().unwrap();
        let catalog = SqliteCatalog::create(tmp.path(), 2, &[]).unwrap();
        crate::catalog::checks::metadata_and_filters(&catalog);
        // Another connection (another process) reads the same metadata and filters alike.
        let other = SqliteCatalog::open(tmp.path()).unwrap();
        let de = crate::filter::Filter::new(&crate::metadata::from_json(r#"{"lang": "de"}"#).unwrap()).unwrap();
        assert_eq!(other.search(&[1.0, 0.0], 10, false, Scope::matching(&de)).unwrap().len(), 2);
        // The first connection's filters see the other's commits: a context added, then relabelled.
        let fr = crate::filter::Filter::new(&crate::metadata::from_json(r#"{"lang": "fr"}"#).unwrap()).unwrap();
        let before = catalog.matching(&fr).unwrap();
        let row = crate::catalog::checks::row("h", &[0.6, 0.8], r#"{"lang": "fr"}"#);
        let h = other.insert(&[row], &mut || Ok(())).unwrap()[0].unwrap();
        assert_eq!(catalog.matching(&fr).unwrap(), [before.clone(), vec![h]].concat());
        assert_eq!(catalog.search(&[0.6, 0.8], 1, false, Scope::matching(&fr)).unwrap()[0].0, h);
        other.set_metadata(&[h], r#"{"lang": "es"}"#).unwrap();
        assert_eq!(catalog.matching(&fr).unwrap(), before);
    }

    #[test]
    fn random_filters_agree_with_the_rules() {
        let tmp = tempfile::tempdir().unwrap();
        crate::catalog::checks::random_filters_agree_with_the_rules(
            &SqliteCatalog::create(tmp.path(), 2, &[]).unwrap(),
        );
    }

    #[test]
    fn rows_of_finds_the_ids_rows_by_search_or_walk() {
        let index_ids: Vec<i64> = (0..100).map(|i| 3 * i + 1).collect();
        for ids in [vec![], vec![4, 5, 298], (0..300).collect::<Vec<i64>>(), (0..300).step_by(2).collect()] {
            let want: Vec<usize> = ids.iter().filter_map(|id| index_ids.binary_search(id).ok()).collect();
            assert_eq!(rows_of(&index_ids, &ids), want, "{} ids", ids.len());
        }
    }

    /// A store made before the metadata column gets it when opened, with `{}` for every
    /// context, and stays usable.
    #[test]
    fn a_store_without_the_metadata_column_gets_it() {
        let tmp = tempfile::tempdir().unwrap();
        let row = crate::catalog::checks::row("d", &[1.0, 0.0], r#"{"lang":"en"}"#);
        let id = {
            let catalog = SqliteCatalog::create(tmp.path(), 2, &[]).unwrap();
            catalog.insert(&[row], &mut || Ok(())).unwrap()[0].unwrap()
        };
        let conn = Connection::open(tmp.path().join("store.sqlite")).unwrap();
        conn.execute_batch("DROP INDEX contexts_metadata; ALTER TABLE contexts DROP COLUMN metadata").unwrap();
        drop(conn);
        let catalog = SqliteCatalog::open(tmp.path()).unwrap();
        let conn = Connection::open(tmp.path().join("store.sqlite")).unwrap();
        let plan: String =
            conn.query_row("EXPLAIN QUERY PLAN SELECT id, json(metadata) FROM contexts", [], |r| r.get(3)).unwrap();
        assert!(plan.contains("COVERING INDEX contexts_metadata"), "the index came with the column: {plan}");
        assert!(catalog.get_many(&[id]).unwrap()[0].metadata.is_empty());
        let en = crate::metadata::from_json(r#"{"lang":"en"}"#).unwrap();
        let en_filter = crate::filter::Filter::new(&en).unwrap();
        assert!(catalog.search(&[1.0, 0.0], 5, false, Scope::matching(&en_filter)).unwrap().is_empty());
        assert_eq!(catalog.set_metadata(&[id], r#"{"lang":"en"}"#).unwrap(), 1);
        assert_eq!(catalog.search(&[1.0, 0.0], 5, false, Scope::matching(&en_filter)).unwrap()[0].0, id);
        assert_eq!(SqliteCatalog::open(tmp.path()).unwrap().get_many(&[id]).unwrap()[0].metadata, en);
    }
}
