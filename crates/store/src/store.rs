//! A store: a catalog (metadata and vectors: SQLite in a folder, or PostgreSQL with pgvector)
//! and state objects (a folder, or an S3-compatible bucket), bound to one model.
//!
//! A folder store is one directory holding `store.sqlite` and `states/ab/<checksum>.safetensors`;
//! a shared store is a PostgreSQL database that records where its states are (`s3://...`).
//! State objects are content-addressed by the xxh3-128 of their bytes and written atomically.
//!
//! Crash safety comes from the order of writes: a batch's state objects are durable before the
//! one transaction that records them commits. A kill at any moment leaves either no row (the
//! object, if any, is an orphan that the next write of the same state simply replaces) or a row
//! whose object is complete. Re-running an ingest skips the (document, segment) pairs recorded.

use std::collections::BTreeMap;
use std::path::PathBuf;

use picaso_model::{MappedState, State, StateDtype};
use rayon::prelude::*;

use crate::catalog::{unfinished, Catalog, PostgresCatalog, Row, SqliteCatalog};
use crate::error::{Error, Result};
use crate::filter::Filter;
use crate::location::{CatalogUrl, Location, StatesUrl};
use crate::metadata::{self, check_metadata, Metadata};
use crate::records::{ContextRecord, DocumentSummary};
use crate::scope::Scope;
use crate::states::{checksum, is_checksum, key_of, StateObjects};

/// How often a retrieval is repeated (without the contexts found gone) when a context it ranked
/// is deleted before it is read; more than a couple means writers delete very fast.
pub const RETRIEVAL_ATTEMPTS: usize = 3;
/// Format tag of the metadata database.
pub const STORE_FORMAT: &str = "picaso-store/1";

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

/// A claim on a folder store's writes (an advisory `flock` on `DIR/writer.lock`, released
/// when the last holder drops it or when the process ends, however it ends).
#[derive(Debug, Clone)]
pub struct WriteLock {
    _file: Option<std::sync::Arc<std::fs::File>>,
}

impl WriteLock {
    fn take(dir: &std::path::Path) -> Result<std::fs::File> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        let path = dir.join("writer.lock");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|source| Error::Io { path: path.clone(), source })?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let pid = holder.trim().parse::<u32>().ok();
            if pid == Some(std::process::id()) {
                return Err(Error::Input(format!(
                    "store {} is being written by another Store object of this process: write through one \
                     (a folder store has one writer; open it once and share it)",
                    dir.display()
                )));
            }
            return Err(Error::Input(format!(
                "store {} is being written by another process{}: stop it first (a folder store has one writer; a PostgreSQL store takes several)",
                dir.display(),
                pid.map(|pid| format!(" (pid {pid})")).unwrap_or_default()
            )));
        }
        let _ = file.set_len(0).and_then(|()| file.rewind()).and_then(|()| write!(file, "{}", std::process::id()));
        Ok(file)
    }
}

/// The embedder a store's vectors were made with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EmbedderRecord {
    /// [`picaso_embed::Embedder::fingerprint`].
    pub fingerprint: String,
    /// The folder it was loaded from at ingest (absolute where it could be resolved).
    pub source: String,
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
    /// Its document's metadata (empty for none).
    pub metadata: Metadata,
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
    /// Bytes of the distinct state files (contexts with equal text share one file).
    pub state_bytes: u64,
    /// The codec the state files are in (f32, bf16, int8 or int4).
    pub state_dtype: &'static str,
    /// Fingerprint of the model.
    pub model: String,
    /// Where the metadata and vectors are (no credentials).
    pub catalog: String,
    /// Where the state objects are.
    pub states: String,
    /// The state budget, what it holds and its hits and misses (`None` without one).
    pub budget: Option<BudgetStats>,
}

/// A budget's totals and counters.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct BudgetStats {
    /// The budget, bytes.
    pub budget_bytes: u64,
    /// The policy's name.
    pub policy: &'static str,
    /// Bytes of the state objects held.
    pub held_bytes: u64,
    /// State objects held.
    pub held: u64,
    /// State objects in the ledger, held or not.
    pub tracked: u64,
    /// States a query found stored.
    pub hits: u64,
    /// States a query had to recompute.
    pub misses: u64,
}

/// An open store. Safe to share between threads.
pub struct Store {
    location: Location,
    info: StoreInfo,
    catalog: Box<dyn Catalog>,
    states_url: StatesUrl,
    states: Box<dyn StateObjects>,
    /// The write lock while anyone holds it through this store (see [`Store::lock_writes`]).
    writer: std::sync::Mutex<std::sync::Weak<std::fs::File>>,
    /// Held for reading while a query maps the states its budget's ledger says are held, for
    /// writing while states are evicted and admitted ([`crate::budget`]).
    budget_guard: std::sync::RwLock<()>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("location", &self.location.to_string()).field("info", &self.info).finish()
    }
}

fn now_unix() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Writes and removes a small object where a new store will keep its states: whether they can
/// be written, asked before the store is created.
fn probe_states(url: &StatesUrl) -> Result<()> {
    let objects = crate::states::open(url)?;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let key = format!("picaso-probe-{}-{nanos}", std::process::id());
    objects.put(&key, b"picaso: can state objects be written here?").map_err(|e| {
        Error::Input(format!(
            "cannot write state objects to {url} ({e}); nothing was created. Check the location and, for s3://, \
             the AWS_* settings (credentials, region, endpoint)"
        ))
    })?;
    let _ = objects.delete(&key);
    Ok(())
}

/// A state object already in the states location of a store being created: another store's
/// (or an earlier, removed one's). Sharing one location is refused because a delete in one
/// store removes objects the other still refers to.
fn foreign_state(objects: &dyn StateObjects) -> Result<Option<String>> {
    Ok(objects.keys()?.into_iter().next())
}

/// The object in a states location given at creation (`--states`) that names the store it
/// belongs to: a second store is refused the location even before the first has written a
/// state there. JSON, `{"store": CATALOG}`.
pub const OWNER_KEY: &str = "picaso-store.json";

/// How a store names itself in [`OWNER_KEY`]: its folder (absolute) or its URL without the
/// password.
fn owner_name(url: &CatalogUrl) -> String {
    match url {
        CatalogUrl::Sqlite(dir) => std::path::absolute(dir).unwrap_or_else(|_| dir.clone()).display().to_string(),
        postgres => postgres.to_string(),
    }
}

/// The store [`OWNER_KEY`] in `objects` names, if any. A marker that is not picaso's JSON
/// names nobody known: it is reported as it is.
fn owner_of(objects: &dyn StateObjects) -> Result<Option<String>> {
    let Some(bytes) = objects.read(OWNER_KEY)? else { return Ok(None) };
    let parsed: Option<String> = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("store").and_then(|s| s.as_str()).map(str::to_string));
    Ok(Some(parsed.unwrap_or_else(|| format!("(unreadable: {:?})", String::from_utf8_lossy(&bytes)))))
}

/// Up to this many state objects are looked up one by one when ingest checks that the
/// unchanged segments still have theirs; beyond it, the location is listed instead when that
/// takes fewer requests.
const LOOKUPS_BEFORE_LISTING: usize = 256;
/// Contexts per lookup a listing is worth: an S3 listing request returns 1,000 keys and is
/// taken to cost 4 lookups, so listing a store of n contexts costs n / 250 lookups.
const LISTING_COST: usize = 250;

/// What [`Store::checked`] finds wrong with a catalog row, if anything: a checksum that is not
/// one (it could point outside the store), a state file that does not match it, a token count
/// that does not match the tokens.
pub(crate) fn row_problem(rec: &ContextRecord) -> Option<String> {
    if !is_checksum(&rec.checksum) {
        Some(format!("its checksum {:?} is not 32 hex digits", rec.checksum))
    } else if rec.state_file != format!("states/{}", key_of(&rec.checksum)) {
        Some(format!("its state file {:?} does not match its checksum {}", rec.state_file, rec.checksum))
    } else if rec.n_tokens != rec.tokens.len() {
        Some(format!("it records {} tokens but holds {}", rec.n_tokens as i64, rec.tokens.len()))
    } else {
        None
    }
}

/// The catalog at `url` if a store exists there.
fn existing_catalog(url: &CatalogUrl) -> Result<Option<Box<dyn Catalog>>> {
    Ok(match url {
        CatalogUrl::Sqlite(dir) if SqliteCatalog::exists_at(dir) => Some(Box::new(SqliteCatalog::open(dir)?)),
        CatalogUrl::Sqlite(_) => None,
        CatalogUrl::Postgres(u) => {
            let c = PostgresCatalog::connect(u)?;
            if c.exists()? {
                c.upgrade()?;
                Some(Box::new(c))
            } else {
                None
            }
        }
    })
}

/// Removes what killed writes left in a folder store: temporary state files (`states/ab/.*.tmp-*`,
/// written before their rename) and databases of creations killed before they were linked into
/// place. Called by the store's writer, under its lock: no other writer can be making one. A
/// creation needs no lock, so a database being built is left alone for a minute.
fn sweep_temp_files(dir: &std::path::Path) {
    let stale = |name: &str| name.starts_with('.') && name.contains(".tmp-");
    if let Ok(shards) = std::fs::read_dir(dir.join("states")) {
        for shard in shards.flatten().filter(|s| s.file_type().is_ok_and(|t| t.is_dir())) {
            let Ok(files) = std::fs::read_dir(shard.path()) else { continue };
            for f in files.flatten().filter(|f| stale(&f.file_name().to_string_lossy())) {
                let _ = std::fs::remove_file(f.path()); // left for the next writer if it fails
            }
        }
    }
    let old = |f: &std::fs::DirEntry| {
        f.metadata().and_then(|m| m.modified()).is_ok_and(|t| t.elapsed().is_ok_and(|a| a.as_secs() > 60))
    };
    if let Ok(files) = std::fs::read_dir(dir) {
        for f in files.flatten() {
            if f.file_name().to_string_lossy().starts_with(crate::catalog::CREATING_PREFIX) && old(&f) {
                let _ = std::fs::remove_file(f.path());
            }
        }
    }
}

/// A local states folder as recorded: absolute, so other processes find it from anywhere.
fn absolute(url: StatesUrl) -> StatesUrl {
    match url {
        StatesUrl::Local(dir) => StatesUrl::Local(std::path::absolute(&dir).unwrap_or(dir)),
        s3 => s3,
    }
}

impl Store {
    /// Opens an existing store: a folder, or a catalog URL (see [`Location`]).
    pub fn open(location: impl Into<Location>) -> Result<Self> {
        let location = location.into();
        let catalog = existing_catalog(&location.catalog)?.ok_or_else(|| Error::Store {
            location: location.catalog.to_string(),
            message: match &location.catalog {
                CatalogUrl::Sqlite(_) => {
                    "not a picaso store (no store.sqlite); create one with `picaso ingest --db DIR ...` or Python `picaso.Store.create(DIR, model)`".into()
                }
                CatalogUrl::Postgres(_) => "this database holds no picaso store; create one with \
                     `picaso ingest --db postgres://... --states s3://bucket/prefix ...`"
                    .into(),
            },
        })?;
        Self::bind(location, catalog)
    }

    /// Opens the store at `location`, creating it for `info` if it does not exist. An existing
    /// store made for another model or embedder width is refused.
    pub fn open_or_create(location: impl Into<Location>, info: &StoreInfo) -> Result<Self> {
        let location = location.into();
        let shown = location.catalog.to_string();
        let store = match existing_catalog(&location.catalog)? {
            Some(catalog) => Self::bind(location, catalog)?,
            None => {
                if location.states.is_none() && matches!(location.catalog, CatalogUrl::Postgres(_)) {
                    return Err(Error::Input(format!(
                        "a PostgreSQL store needs a states location (--states, Python states=): where to keep state objects \
                         (s3://bucket/prefix, or a folder every server can read); creating {shown}"
                    )));
                }
                if let Some(given) = location.states.clone() {
                    // Before the catalog exists: a store bound to states it cannot write (no
                    // credentials, no bucket) would fail every later ingest the same way.
                    let states = absolute(given);
                    probe_states(&states)?;
                    let me = owner_name(&location.catalog);
                    let objects = crate::states::open(&states)?;
                    let owned_by = |o: String| {
                        (
                            format!("belongs to the store {o} (its {states}/{OWNER_KEY} says so)"),
                            format!(
                                " If that store no longer exists, remove {states}/{OWNER_KEY} (and any state objects \
                                 left there) and try again."
                            ),
                        )
                    };
                    let mut refusal = match (owner_of(&*objects)?.filter(|o| *o != me), foreign_state(&*objects)?) {
                        (Some(o), _) => Some(owned_by(o)),
                        (None, Some(key)) => {
                            Some((format!("already holds state objects ({key}, ...) of another store"), String::new()))
                        }
                        (None, None) => None,
                    };
                    // Claimed before the catalog exists: a creation that fails after this leaves a
                    // marker naming this store, which the next try accepts. Written only where no
                    // marker is, so of two stores created at once on one location, one gets it.
                    let marker = serde_json::json!({ "store": me }).to_string();
                    if refusal.is_none() && !objects.put_new(OWNER_KEY, marker.as_bytes())? {
                        refusal = owner_of(&*objects)?.filter(|o| *o != me).map(owned_by);
                    }
                    if let Some((whose, remedy)) = refusal {
                        // Unless a process creating this same store at once got there first.
                        if let Some(catalog) = existing_catalog(&location.catalog)? {
                            return Self::bind(location.clone(), catalog)?.checked_for(info);
                        }
                        return Err(Error::Input(format!(
                            "{states} {whose}; stores cannot share a states location (a delete in one would remove \
                             objects the other uses): give this store its own (a new s3:// prefix or folder); nothing \
                             was created.{remedy}"
                        )));
                    }
                }
                let states = location.states.clone().map(absolute);
                let mut pairs = vec![
                    ("format", STORE_FORMAT.to_string()),
                    ("model", info.fingerprint.clone()),
                    ("state_dtype", info.state_dtype.name().to_string()),
                ];
                if let Some(states) = &states {
                    pairs.push(("states", states.to_string()));
                }
                let pairs: Vec<(&str, &str)> = pairs.iter().map(|(k, v)| (*k, v.as_str())).collect();
                // All metadata is written with the tables, in one step: a killed creation leaves no
                // store or a whole one. When two processes create at once, the first one's values
                // stay; bind() then checks them against `info` like any existing store's.
                let catalog: Box<dyn Catalog> = match &location.catalog {
                    CatalogUrl::Sqlite(dir) => Box::new(SqliteCatalog::create(dir, info.dim, &pairs)?),
                    CatalogUrl::Postgres(u) => {
                        let c = PostgresCatalog::connect(u)?;
                        c.create(info.dim, &pairs)?;
                        Box::new(c)
                    }
                };
                Self::bind(Location { catalog: location.catalog.clone(), states: location.states.clone() }, catalog)?
            }
        };
        store.checked_for(info)
    }

    /// This store, if it was made for `info`'s model and embedder width.
    fn checked_for(self, info: &StoreInfo) -> Result<Self> {
        let shown = self.location.catalog.to_string();
        if self.info.fingerprint != info.fingerprint {
            return Err(Error::WrongModel {
                location: shown,
                stored: self.info.fingerprint.clone(),
                given: info.fingerprint.clone(),
            });
        }
        if self.info.dim != info.dim {
            return Err(Error::Store {
                location: shown,
                message: format!("embeddings have {} dimensions, the embedder gives {}", self.info.dim, info.dim),
            });
        }
        Ok(self)
    }

    /// Reads the binding of an existing catalog and opens its states.
    fn bind(location: Location, catalog: Box<dyn Catalog>) -> Result<Self> {
        let shown = location.catalog.to_string();
        let bad = |message: String| Error::Store { location: shown.clone(), message };
        // All written at creation: one missing from a store without contexts is a creation that
        // never finished (by an older picaso, which wrote them one at a time).
        let missing = |k: &str| -> Result<Error> {
            Ok(if catalog.count()? == 0 { unfinished(&location.catalog) } else { bad(format!("metadata lacks `{k}`")) })
        };
        let meta = |k: &str| -> Result<String> {
            match catalog.meta(k)? {
                Some(v) => Ok(v),
                None => Err(missing(k)?),
            }
        };
        let format = meta("format")?;
        if format != STORE_FORMAT {
            return Err(bad(format!("format {format:?}, this picaso reads {STORE_FORMAT:?}")));
        }
        let dim: usize = meta("dim")?.parse().map_err(|_| bad("metadata `dim` is not a number".into()))?;
        let state_dtype = meta("state_dtype")?.parse().map_err(bad)?;
        let info = StoreInfo { fingerprint: meta("model")?, dim, state_dtype };
        let recorded = match catalog.meta("states")? {
            Some(s) => StatesUrl::parse(&s)?,
            None => match &location.catalog {
                CatalogUrl::Sqlite(dir) => StatesUrl::Local(dir.join("states")),
                CatalogUrl::Postgres(_) => return Err(missing("states (where state objects are)")?),
            },
        };
        if let Some(given) = &location.states {
            if absolute(given.clone()) != absolute(recorded.clone()) {
                return Err(Error::Input(format!(
                    "store {shown} keeps its states in {recorded}, not {given}; leave the states location (--states, Python states=) out or give that one"
                )));
            }
        }
        let states = crate::states::open(&recorded)?;
        Ok(Self {
            location,
            info,
            catalog,
            states_url: recorded,
            states,
            writer: Default::default(),
            budget_guard: Default::default(),
        })
    }

    /// The guard of the budget's reads and evictions.
    pub(crate) fn budget_guard(&self) -> &std::sync::RwLock<()> {
        &self.budget_guard
    }

    /// The catalog (for [`crate::check`]).
    pub(crate) fn catalog(&self) -> &dyn Catalog {
        &*self.catalog
    }

    /// The state objects (for [`crate::check`]).
    pub(crate) fn objects(&self) -> &dyn StateObjects {
        &*self.states
    }

    /// Fails with [`Error::WrongModel`] unless `model` made this store's states (a state only
    /// continues on its own model).
    pub fn require_model(&self, model: &picaso_model::Model) -> Result<()> {
        if self.info.fingerprint != model.fingerprint() {
            return Err(Error::WrongModel {
                location: self.location.to_string(),
                stored: self.info.fingerprint.clone(),
                given: model.fingerprint().to_string(),
            });
        }
        Ok(())
    }

    /// Where the store is (displays without credentials).
    pub fn location(&self) -> &Location {
        &self.location
    }

    /// Where its state objects are.
    pub fn states_url(&self) -> &StatesUrl {
        &self.states_url
    }

    /// What the store is bound to.
    pub fn info(&self) -> &StoreInfo {
        &self.info
    }

    /// Refuses `want` unless it is the codec this store records: one store keeps one codec, and
    /// `picaso migrate --state-dtype` converts a store to another.
    pub fn require_state_dtype(&self, want: StateDtype) -> Result<()> {
        let kept = self.info.state_dtype;
        if want == kept {
            return Ok(());
        }
        Err(Error::Input(format!(
            "store {} keeps its states in {kept}, not {want}: leave out the state dtype to use the store's, \
             or convert it first (`picaso migrate --from {loc} --to NEW --state-dtype {want}`)",
            self.location(),
            loc = self.location(),
        )))
    }

    /// Segments of `doc` stored, each with its context's id.
    pub fn segments_of(&self, doc: &str) -> Result<BTreeMap<u32, i64>> {
        self.catalog.segments_of(doc)
    }

    /// The contexts stored for document `doc`, in segment order (none for a document the store
    /// does not hold). A context deleted by another writer while they are read is left out.
    pub fn document(&self, doc: &str) -> Result<Vec<ContextRecord>> {
        let ids: Vec<i64> = self.segments_of(doc)?.into_values().collect();
        Ok(self.records(&ids)?.into_iter().flatten().collect())
    }

    /// Adds contexts: their state objects first (durable), then their rows in one transaction.
    /// A (doc, seg) already present is skipped. Returns the ids, `None` for skipped ones. A
    /// store with a state budget needs the model ([`Store::insert_with`]).
    pub fn insert(&self, items: &[NewContext]) -> Result<Vec<Option<i64>>> {
        self.insert_with(items, None)
    }

    /// [`Store::insert`]; in a store with a state budget, the states enter its ledger (their
    /// prefill work reckoned by `model`) and only those the policy admits are written.
    pub fn insert_with(&self, items: &[NewContext], model: Option<&picaso_model::Model>) -> Result<Vec<Option<i64>>> {
        let mut objects = Vec::with_capacity(items.len());
        for it in items {
            self.check_new(&it.embedding, &it.state.fingerprint)?;
            check_metadata(&it.metadata, &format!("document {:?}", it.doc))?;
            let bytes = it.state.to_bytes(self.info.state_dtype)?;
            let sum = checksum(&bytes);
            objects.push((sum, bytes));
        }
        let files: Vec<String> = objects.iter().map(|(sum, _)| format!("states/{}", key_of(sum))).collect();
        let metadata: Vec<String> = items.iter().map(|it| metadata::to_json(&it.metadata)).collect();
        let created = now_unix();
        let rows: Vec<Row<'_>> = items
            .iter()
            .zip(&objects)
            .zip(&files)
            .zip(&metadata)
            .map(|(((it, (sum, bytes)), file), metadata)| Row {
                id: None,
                doc: &it.doc,
                seg: it.seg,
                text: &it.text,
                tokens: &it.tokens,
                embedding: &it.embedding,
                fingerprint: &it.state.fingerprint,
                state_file: file,
                checksum: sum,
                state_bytes: bytes.len() as u64,
                created,
                metadata,
            })
            .collect();
        if let Some(budget) = self.budget()? {
            let model = model.ok_or_else(|| {
                Error::Input(format!(
                    "store {} has a state budget: contexts are added with the model that recomputes their states                      (picaso ingest, the server, Python's Store.add)",
                    self.location
                ))
            })?;
            return self.insert_within_budget(budget, model, &rows, &objects);
        }
        self.catalog.insert(&rows, &mut || self.put_objects(&objects))
    }

    fn check_new(&self, embedding: &[f32], fingerprint: &str) -> Result<()> {
        if embedding.len() != self.info.dim {
            return Err(Error::Input(format!(
                "embedding of {} values, the store holds {}-dimensional embeddings",
                embedding.len(),
                self.info.dim
            )));
        }
        if fingerprint != self.info.fingerprint {
            return Err(Error::WrongModel {
                location: self.location.catalog.to_string(),
                stored: self.info.fingerprint.clone(),
                given: fingerprint.to_string(),
            });
        }
        Ok(())
    }

    /// Writes state objects (in parallel: remote stores are latency-bound).
    fn put_objects(&self, objects: &[(String, Vec<u8>)]) -> Result<()> {
        objects.par_iter().try_for_each(|(sum, bytes)| self.states.put(&key_of(sum), bytes))
    }

    /// Copies contexts from another store as they are: same ids, metadata, embeddings and
    /// state bytes (each verified against its record's checksum), in one transaction. A
    /// (doc, seg) already present is skipped (`None`).
    pub fn insert_copies(&self, items: &[(&ContextRecord, &[f32], &[u8])]) -> Result<Vec<Option<i64>>> {
        let mut objects = Vec::with_capacity(items.len());
        for (record, embedding, bytes) in items {
            self.check_new(embedding, &self.info.fingerprint)?;
            let found = checksum(bytes);
            if found != record.checksum {
                return Err(Error::Corrupt {
                    path: PathBuf::from(&record.state_file),
                    found,
                    recorded: record.checksum.clone(),
                });
            }
            objects.push((record.checksum.clone(), bytes.to_vec()));
        }
        let metadata: Vec<String> = items.iter().map(|(r, _, _)| metadata::to_json(&r.metadata)).collect();
        let rows: Vec<Row<'_>> = items
            .iter()
            .zip(&metadata)
            .map(|((r, embedding, bytes), metadata)| Row {
                id: Some(r.id),
                doc: &r.doc,
                seg: r.seg,
                text: &r.text,
                tokens: &r.tokens,
                embedding,
                fingerprint: &self.info.fingerprint,
                state_file: &r.state_file,
                checksum: &r.checksum,
                state_bytes: bytes.len() as u64,
                created: r.created,
                metadata,
            })
            .collect();
        self.catalog.insert(&rows, &mut || self.put_objects(&objects))
    }

    /// The id of the context stored for (`doc`, `seg`), if any.
    pub fn id_of(&self, doc: &str, seg: u32) -> Result<Option<i64>> {
        self.catalog.id_of(doc, seg)
    }

    /// The metadata of context `id`.
    pub fn get(&self, id: i64) -> Result<ContextRecord> {
        self.checked(self.catalog.get_many(&[id])?.remove(0))
    }

    /// The records of `ids`, in order; `None` for a context gone (deleted by another writer).
    /// One catalog query when all are there.
    pub fn records(&self, ids: &[i64]) -> Result<Vec<Option<ContextRecord>>> {
        match self.catalog.get_many(ids) {
            Ok(records) => records.into_iter().map(|r| self.checked(r).map(Some)).collect(),
            Err(Error::NotFound(_)) => ids
                .iter()
                .map(|&id| match self.get(id) {
                    Ok(r) => Ok(Some(r)),
                    Err(Error::NotFound(_)) => Ok(None),
                    Err(e) => Err(e),
                })
                .collect(),
            Err(e) => Err(e),
        }
    }

    /// A catalog row as read, checked for what a damaged or hand-edited row could break: the
    /// checksum names the state object (32 hex digits, so it cannot point outside the store),
    /// and the token count matches the tokens.
    fn checked(&self, rec: ContextRecord) -> Result<ContextRecord> {
        match row_problem(&rec) {
            None => Ok(rec),
            Some(p) => Err(Error::Store {
                location: self.location.to_string(),
                message: format!(
                    "the catalog row of context {} is damaged: {p}; delete the context and ingest its text again",
                    rec.id
                ),
            }),
        }
    }

    /// How the store's documents were cut into contexts (`paragraph`, `tokens:N`, `halves:N`),
    /// recorded by the first ingest; `None` for a store that predates the record.
    pub fn segmentation(&self) -> Result<Option<String>> {
        self.catalog.meta("segmentation")
    }

    /// Records `segmentation` on first use; refuses another one later, because a (document,
    /// segment) pair means a different text under another segmentation and ingest would skip
    /// it as already stored.
    pub fn bind_segmentation(&self, segmentation: &str) -> Result<()> {
        let stored = self.catalog.init_meta("segmentation", segmentation)?;
        if stored != segmentation {
            return Err(Error::Input(format!(
                "store {} was ingested with segmentation {stored} (--segment, Python segment=); ingest with the same one or into a new store",
                self.location.catalog
            )));
        }
        Ok(())
    }

    /// The embedder the store's vectors were made with, recorded by the first ingest: its
    /// fingerprint and the folder it was loaded from. `None` for a store that predates the record.
    pub fn embedder(&self) -> Result<Option<EmbedderRecord>> {
        let (Some(fingerprint), source) = (self.catalog.meta("embedder")?, self.catalog.meta("embedder_source")?)
        else {
            return Ok(None);
        };
        Ok(Some(EmbedderRecord { fingerprint, source: source.unwrap_or_default() }))
    }

    /// Records the embedder (`fingerprint`, loaded from `source`) on first use; refuses another
    /// later: vectors of two embedders are not comparable, and retrieval would silently return
    /// noise.
    pub fn bind_embedder(&self, fingerprint: &str, source: &str) -> Result<()> {
        let stored = self.catalog.init_meta("embedder", fingerprint)?;
        let stored_source = self.catalog.init_meta("embedder_source", source)?;
        if stored != fingerprint {
            return Err(Error::Input(format!(
                "the embedder {source} (fingerprint {fingerprint}) is not the one store {} was built with ({stored_source}, fingerprint {stored}); give that embedder ({stored_source}: --embedder, Python embedder=) or leave it out to use it",
                self.location.catalog
            )));
        }
        Ok(())
    }

    /// Claims a folder store's writes for this `Store` until the lock is dropped: a second
    /// writer (an `ingest` while a server holds the store, two servers) fails at once, since
    /// two writers could each remove a state file the other is about to share. Readers need
    /// no claim: their index follows every writer's commits. Holders of the same `Store` share
    /// the claim (a server that holds it can still ingest through it).
    /// PostgreSQL stores take several writers and need no claim.
    pub fn lock_writes(&self) -> Result<WriteLock> {
        let CatalogUrl::Sqlite(dir) = &self.location.catalog else { return Ok(WriteLock { _file: None }) };
        let mut held = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(file) = held.upgrade() {
            return Ok(WriteLock { _file: Some(file) });
        }
        let file = std::sync::Arc::new(WriteLock::take(dir)?);
        *held = std::sync::Arc::downgrade(&file);
        drop(held);
        // Only the store's own states folder: one shared with other stores has other writers.
        if absolute(self.states_url.clone()) == absolute(StatesUrl::Local(dir.join("states"))) {
            sweep_temp_files(dir);
        }
        // What a killed writer's admission or eviction left, before this one counts free room.
        self.sweep_unheld()?;
        Ok(WriteLock { _file: Some(file) })
    }

    /// Fails with [`Error::NotFound`] for the first of `ids` not stored (e.g. deleted through
    /// another server while its state sat in this one's cache).
    pub fn require(&self, ids: &[i64]) -> Result<()> {
        match ids.iter().zip(self.catalog.exist(ids)?).find(|(_, there)| !there) {
            Some((&id, _)) => Err(Error::NotFound(id)),
            None => Ok(()),
        }
    }

    /// The (document, segment) of context `id` (without reading its text and tokens).
    pub fn doc_seg(&self, id: i64) -> Result<(String, u32)> {
        self.catalog.doc_seg(id)
    }

    /// Maps context `id`'s state and verifies its checksum; f32 tensors are then read in place
    /// (see [`MappedState`]).
    pub fn map_state(&self, id: i64) -> Result<MappedState> {
        self.map_states(&[id]).map(|mut v| v.remove(0))
    }

    /// [`Store::map_state`] for several contexts: all objects are requested up front (the disk
    /// or the network works on all of them at once), then verified in parallel.
    pub fn map_states(&self, ids: &[i64]) -> Result<Vec<MappedState>> {
        let records = self.catalog.get_many(ids)?.into_iter().map(|r| self.checked(r)).collect::<Result<Vec<_>>>()?;
        let keys: Vec<String> = records.iter().map(|r| key_of(&r.checksum)).collect();
        let verify = |i: usize, bytes: &[u8]| -> Result<()> {
            let found = checksum(bytes);
            let rec = &records[i];
            if found != rec.checksum {
                let path = match &self.states_url {
                    StatesUrl::Local(dir) => dir.join(&keys[i]),
                    remote => PathBuf::from(format!("{remote}/{}", keys[i])),
                };
                return Err(Error::Corrupt { path, found, recorded: rec.checksum.clone() });
            }
            Ok(())
        };
        self.states.get_many(&keys, &verify).or_else(|e| {
            // A state object removed with its row after the row was read (a concurrent delete)
            // is a context that is gone, not a broken store.
            let sums: Vec<String> = records.iter().map(|r| r.checksum.clone()).collect();
            match ids.iter().zip(self.catalog.exist_settled(ids, &sums)?).find(|(_, there)| !there) {
                Some((&id, _)) => Err(Error::NotFound(id)),
                None => Err(self.damaged_state(&records, &keys, e)),
            }
        })
    }

    /// A missing or damaged state object as the error of the context that needs it, with the
    /// repair: `picaso check --repair` recomputes it from the tokens in its row (for a missing
    /// one, ingesting the document again also does). Other failures (a backend down) pass
    /// through.
    fn damaged_state(&self, records: &[ContextRecord], keys: &[String], e: Error) -> Error {
        let damaged = match &e {
            Error::Corrupt { .. } | Error::Model(_) | Error::Store { .. } => true,
            Error::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            _ => false,
        };
        let text = e.to_string();
        let Some(rec) = records.iter().zip(keys).find(|(_, k)| text.contains(k.as_str())).map(|(r, _)| r) else {
            return e;
        };
        if !damaged {
            return e;
        }
        let check = format!(
            "`picaso check --db {} --repair` (Python: `store.check(repair=True)`) recomputes it from the tokens in its row",
            self.location.catalog
        );
        let (what, repair) = match &e {
            // Ingest processes an unchanged segment without its object again.
            Error::Io { .. } => (
                format!("its state file {}/{} is missing", self.states_url, key_of(&rec.checksum)),
                format!("{check}, as does ingesting that document again"),
            ),
            _ => (text, check),
        };
        Error::Store {
            location: self.location.to_string(),
            message: format!(
                "context {} (document {:?}, segment {}) cannot be read: {what}. Repair: {repair}",
                rec.id, rec.doc, rec.seg
            ),
        }
    }

    /// Reads context `id`'s state into memory (checksum and values verified).
    pub fn load_state(&self, id: i64) -> Result<State> {
        let state = self.map_state(id)?.view().to_state();
        state.check_values()?;
        Ok(state)
    }

    /// Removes context `id` (and its state object unless another context shares it).
    pub fn delete(&self, id: i64) -> Result<()> {
        // Under the budget's guard: no query's bookkeeping admits a state between the row's
        // removal (its ledger row with it) and its object's.
        let _guard = self.budget_guard.write().unwrap_or_else(|p| p.into_inner());
        self.catalog.delete(id, &mut |sums| self.remove_states(sums))
    }

    /// Removes the contexts `ids` that are here (each with its state object unless another
    /// context shares it), all at once: returns those removed, ascending. One gone already
    /// (another writer removed it) is skipped.
    pub fn delete_many(&self, ids: &[i64]) -> Result<Vec<i64>> {
        let _guard = self.budget_guard.write().unwrap_or_else(|p| p.into_inner());
        self.catalog.delete_many(ids, &mut |sums| self.remove_states(sums))
    }

    fn remove_states(&self, checksums: &[String]) -> Result<()> {
        // A damaged checksum names no object of this store: nothing to remove.
        let keys: Vec<String> = checksums.iter().filter(|sum| is_checksum(sum)).map(|sum| key_of(sum)).collect();
        self.states.delete_many(&keys)
    }

    /// [`Store::delete`], where a context already gone (another writer removed it) is no
    /// error: whether this call removed it.
    pub fn delete_if_present(&self, id: i64) -> Result<bool> {
        match self.delete(id) {
            Ok(()) => Ok(true),
            Err(Error::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Removes every context of document `doc` (see [`Store::delete`]); returns the ids removed
    /// (none for a document the store does not hold).
    pub fn delete_document(&self, doc: &str) -> Result<Vec<i64>> {
        let ids: Vec<i64> = self.segments_of(doc)?.into_values().collect();
        self.delete_many(&ids)
    }

    /// The `k` contexts most similar to `query` (a normalised embedding): (id, cosine), best
    /// first. Uses the catalog's approximate index if it has one.
    pub fn search(&self, query: &[f32], k: usize) -> Result<Vec<(i64, f32)>> {
        self.search_in(query, k, Scope::all())
    }

    /// [`Store::search`] among the contexts `scope` allows, exactly when it names documents or
    /// a metadata filter. Naming no document, or one the store does not hold, is refused: a
    /// misspelt name would otherwise retrieve nothing, and the answer would silently go
    /// without its context. A filter no context matches retrieves nothing (metadata values are
    /// open-ended, so no value is "unknown").
    pub fn search_in(&self, query: &[f32], k: usize, scope: Scope<'_>) -> Result<Vec<(i64, f32)>> {
        self.check_query(query)?;
        if let Some(docs) = scope.documents {
            self.check_documents(docs)?;
        }
        self.catalog.search(query, k, false, scope)
    }

    fn check_documents(&self, docs: &[String]) -> Result<()> {
        if docs.is_empty() {
            return Err(Error::Input(
                "no documents to retrieve from: name at least one, or none at all to search every document".into(),
            ));
        }
        for doc in docs {
            if self.catalog.segments_of(doc)?.is_empty() {
                return Err(Error::Input(format!(
                    "document {doc:?} is not in the store (`picaso documents`, GET /v1/documents and \
                     Python's Store.documents() list the ones it holds)"
                )));
            }
        }
        Ok(())
    }

    /// The `k` contexts whose text best matches `text` (BM25 on a folder store, PostgreSQL's
    /// full-text rank on a shared one), best first, among those `scope` allows (checked as in
    /// [`Store::search_in`]). Only contexts sharing a term with the query are returned.
    pub fn search_text_in(&self, text: &str, k: usize, scope: Scope<'_>) -> Result<Vec<(i64, f32)>> {
        if let Some(docs) = scope.documents {
            self.check_documents(docs)?;
        }
        self.catalog.search_text(text, k, scope)
    }

    /// Refuses a query embedded by an encoder other than the one this store's vectors were
    /// made with (their vectors are not comparable, and retrieval would silently return noise).
    pub fn check_encoder(&self, fingerprint: &str) -> Result<()> {
        match self.embedder()? {
            Some(r) if r.fingerprint != fingerprint => Err(Error::Input(format!(
                "the query was embedded by the encoder with fingerprint {fingerprint}, but store {} holds vectors of                  {} (fingerprint {}); embed the query with that encoder (--embedder {}, Python embedder=), or ingest                  the documents into a new store with the new encoder",
                self.location.catalog, r.source, r.fingerprint, r.source
            ))),
            _ => Ok(()),
        }
    }

    /// The `k` contexts `retriever` ranks highest for `query`, best first, among those `scope`
    /// allows. Dense scores are cosines, BM25 scores BM25's, hybrid scores the fused reciprocal
    /// ranks. A query lacking what the retriever needs (text, embedding) is refused.
    pub fn retrieve_in(
        &self,
        query: &crate::retriever::Query<'_>,
        retriever: crate::retriever::Retriever,
        k: usize,
        scope: Scope<'_>,
    ) -> Result<Vec<(i64, f32)>> {
        use crate::retriever::{Retriever, FUSION_DEPTH};
        if let Some(fp) = query.encoder {
            self.check_encoder(fp)?;
        }
        let embedding = || {
            query.embedding.ok_or_else(|| {
                Error::Input(format!("the {} retriever needs the query's embedding; none was given", retriever.name()))
            })
        };
        let text = || {
            query.text.ok_or_else(|| {
                Error::Input(format!("the {} retriever needs the query's text; none was given", retriever.name()))
            })
        };
        match retriever {
            Retriever::Dense => self.search_in(embedding()?, k, scope),
            Retriever::Bm25 => self.search_text_in(text()?, k, scope),
            Retriever::Hybrid { dense_weight } => {
                let depth = k.max(FUSION_DEPTH);
                let dense = self.search_in(embedding()?, depth, scope)?;
                let lexical = self.search_text_in(text()?, depth, scope)?;
                Ok(picaso_embed::reciprocal_rank_fusion(&[(&dense, dense_weight), (&lexical, 1.0 - dense_weight)], k))
            }
        }
    }

    /// [`Store::retrieve_in`] leaving out `gone` (contexts found deleted since an earlier search).
    pub fn retrieve_without(
        &self,
        query: &crate::retriever::Query<'_>,
        retriever: crate::retriever::Retriever,
        k: usize,
        scope: Scope<'_>,
        gone: &[i64],
    ) -> Result<Vec<(i64, f32)>> {
        let mut hits = self.retrieve_in(query, retriever, k + gone.len(), scope)?;
        hits.retain(|(id, _)| !gone.contains(id));
        hits.truncate(k);
        Ok(hits)
    }

    /// [`Store::search_in`] leaving out `gone` (contexts found deleted since an earlier search).
    pub fn search_without(&self, query: &[f32], k: usize, scope: Scope<'_>, gone: &[i64]) -> Result<Vec<(i64, f32)>> {
        let mut hits = self.search_in(query, k + gone.len(), scope)?;
        hits.retain(|(id, _)| !gone.contains(id));
        hits.truncate(k);
        Ok(hits)
    }

    /// [`Store::search_in`] with each hit's record. A context deleted (by another writer)
    /// between the ranking and the read is left out and the search runs again without it, so a
    /// concurrent delete never becomes a "not found" for a caller who named no id.
    pub fn search_records(&self, query: &[f32], k: usize, scope: Scope<'_>) -> Result<Vec<(ContextRecord, f32)>> {
        let query = crate::retriever::Query { embedding: Some(query), ..Default::default() };
        self.retrieve_records(&query, crate::retriever::Retriever::Dense, k, scope)
    }

    /// [`Store::retrieve_in`] with each hit's record, as [`Store::search_records`].
    pub fn retrieve_records(
        &self,
        query: &crate::retriever::Query<'_>,
        retriever: crate::retriever::Retriever,
        k: usize,
        scope: Scope<'_>,
    ) -> Result<Vec<(ContextRecord, f32)>> {
        let mut gone = Vec::new();
        loop {
            let hits = self.retrieve_without(query, retriever, k, scope, &gone)?;
            let mut found = Vec::with_capacity(hits.len());
            let before = gone.len();
            for (id, score) in hits {
                match self.get(id) {
                    Ok(record) => found.push((record, score)),
                    Err(Error::NotFound(id)) => gone.push(id),
                    Err(e) => return Err(e),
                }
            }
            if gone.len() == before || gone.len() >= RETRIEVAL_ATTEMPTS * k.max(1) {
                return Ok(found);
            }
        }
    }

    /// Gives contexts `ids` the metadata `metadata`, keeping their ids, text and states (ingest
    /// does this when a document's metadata changed and its text did not). Returns how many
    /// changed; a context gone meanwhile is skipped.
    pub fn set_metadata(&self, ids: &[i64], metadata: &Metadata) -> Result<u64> {
        check_metadata(metadata, &format!("contexts {ids:?}"))?;
        self.catalog.set_metadata(ids, &metadata::to_json(metadata))
    }

    /// [`Store::search`] by exhaustive scan, whatever indexes exist (ground truth for recall).
    pub fn search_exact(&self, query: &[f32], k: usize) -> Result<Vec<(i64, f32)>> {
        self.check_query(query)?;
        self.catalog.search(query, k, true, Scope::all())
    }

    fn check_query(&self, query: &[f32]) -> Result<()> {
        if query.len() != self.info.dim {
            return Err(Error::Input(format!(
                "query embedding of {} values, the store holds {}-dimensional embeddings",
                query.len(),
                self.info.dim
            )));
        }
        Ok(())
    }

    /// Builds an HNSW index (`Some((m, ef_construction))`) or drops it (`None`). PostgreSQL only.
    pub fn set_ann_index(&self, hnsw: Option<(usize, usize)>) -> Result<()> {
        self.catalog.set_ann_index(hnsw)
    }

    /// The stored (normalised) embedding of context `id`.
    pub fn embedding(&self, id: i64) -> Result<Vec<f32>> {
        self.catalog.embedding(id)
    }

    /// Up to `limit` contexts with ids above `after`, ascending, with embeddings.
    pub fn export(&self, after: i64, limit: usize) -> Result<Vec<(ContextRecord, Vec<f32>)>> {
        self.catalog.export(after, limit)?.into_iter().map(|(r, e)| Ok((self.checked(r)?, e))).collect()
    }

    /// Keys of every state object in the store's states location (for verification).
    pub fn state_keys(&self) -> Result<Vec<String>> {
        self.states.keys()
    }

    /// The ids of `records` whose state object is gone from the states location (a file
    /// deleted by hand, a disk restored without it): ingest processes their text again. A
    /// lookup per record, or one listing of the whole location when that takes fewer requests
    /// (see `LOOKUPS_BEFORE_LISTING`). Only presence is checked; a damaged object is found
    /// when it is read.
    pub fn missing_states(&self, records: &[ContextRecord]) -> Result<std::collections::HashSet<i64>> {
        if records.is_empty() {
            return Ok(Default::default());
        }
        if self.budget()?.is_some() {
            // A state the budget does not hold is absent by design (recomputed when needed):
            // only a held one whose object is gone is missing.
            let sums: Vec<String> = records.iter().map(|r| r.checksum.clone()).collect();
            let held: Vec<&ContextRecord> = records
                .iter()
                .zip(self.catalog.ledger(&sums)?)
                .filter(|(_, row)| row.as_ref().is_some_and(|r| r.held))
                .map(|(r, _)| r)
                .collect();
            let keys: Vec<String> = held.iter().map(|r| key_of(&r.checksum)).collect();
            let there = self.states.exist_many(&keys)?;
            return Ok(held.iter().zip(there).filter(|(_, there)| !there).map(|(r, _)| r.id).collect());
        }
        let keys: Vec<String> = records.iter().map(|r| key_of(&r.checksum)).collect();
        let there: Vec<bool> = if records.len() > LOOKUPS_BEFORE_LISTING.max(self.len()? / LISTING_COST) {
            let listed: std::collections::HashSet<String> = self.states.keys()?.into_iter().collect();
            keys.iter().map(|k| listed.contains(k)).collect()
        } else {
            self.states.exist_many(&keys)?
        };
        Ok(records.iter().zip(there).filter(|(_, there)| !there).map(|(r, _)| r.id).collect())
    }

    /// Number of contexts.
    pub fn len(&self) -> Result<usize> {
        self.catalog.count()
    }

    /// Whether the store holds no context.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Ids of all contexts, ascending.
    pub fn ids(&self) -> Result<Vec<i64>> {
        self.catalog.ids()
    }

    /// The ids of the contexts whose metadata passes `filter`, ascending.
    pub fn matching(&self, filter: &Filter) -> Result<Vec<i64>> {
        self.catalog.matching(filter)
    }

    /// Why no context passes `filter`, as far as counting tells, one line each (none when it
    /// tells nothing): how many contexts each of its keys passes alone, when it has several;
    /// and each key tested within objects that holds lists (a path does not enter lists), with
    /// the `$elemMatch` that tests their elements. Meant for when [`Self::matching`] is empty.
    pub fn why_none_match(&self, filter: &Filter) -> Result<Vec<String>> {
        use serde_json::Value;
        let one = |key: &String, value: Value| Metadata::from_iter([(key.clone(), value)]);
        let count = |json: &Metadata| -> Result<usize> { Ok(self.matching(&Filter::new(json)?)?.len()) };
        let mut why = Vec::new();
        let json = filter.json();
        if json.len() > 1 {
            let alone = (json.iter())
                .map(|(key, value)| {
                    let part = one(key, value.clone());
                    Ok(format!("{} {}", metadata::to_json(&part), count(&part)?))
                })
                .collect::<Result<Vec<_>>>()?;
            why.push(format!("contexts each key passes alone: {}", alone.join(", ")));
        }
        for (key, value) in json {
            let Value::Object(tests) = value else { continue };
            let within: Metadata =
                tests.iter().filter(|(k, _)| !k.starts_with('$')).map(|(k, v)| (k.clone(), v.clone())).collect();
            if within.is_empty() {
                continue;
            }
            let any_element = serde_json::json!({"$elemMatch": {"$exists": true}});
            let lists = count(&one(key, any_element))?;
            if lists > 0 {
                let instead = one(key, serde_json::json!({ "$elemMatch": Value::Object(within) }));
                why.push(format!(
                    "{key:?} holds a list in {lists} context{}, and keys within objects do not enter lists: to test \
                     its elements, give {}",
                    if lists == 1 { "" } else { "s" },
                    metadata::to_json(&instead)
                ));
            }
        }
        Ok(why)
    }

    /// Up to `limit` documents named after `after` (from the first when `None`), in name order.
    pub fn documents(&self, after: Option<&str>, limit: usize) -> Result<Vec<DocumentSummary>> {
        self.catalog.documents(after, limit)
    }

    /// Every document, in name order (read a page at a time).
    pub fn all_documents(&self) -> Result<Vec<DocumentSummary>> {
        const PAGE: usize = 1000;
        let mut all: Vec<DocumentSummary> = Vec::new();
        loop {
            let page = self.documents(all.last().map(|d| d.id.as_str()), PAGE)?;
            let done = page.len() < PAGE;
            all.extend(page);
            if done {
                return Ok(all);
            }
        }
    }

    /// Totals.
    pub fn stats(&self) -> Result<Stats> {
        let (contexts, documents, tokens, state_bytes) = self.catalog.totals()?;
        Ok(Stats {
            contexts,
            documents,
            tokens,
            state_bytes,
            state_dtype: self.info.state_dtype.name(),
            model: self.info.fingerprint.clone(),
            catalog: self.location.catalog.to_string(),
            states: self.states_url.to_string(),
            budget: self.budget_stats()?,
        })
    }
}
