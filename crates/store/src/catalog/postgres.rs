//! The shared catalog: PostgreSQL with the pgvector extension. Several `picaso serve`
//! processes over one database see each other's contexts at once, because every search and
//! lookup is a query (nothing is cached in a process).
//!
//! Tables `picaso_meta` and `picaso_contexts` live in the connection's schema (set
//! `options=-csearch_path=NAME` in the URL to keep several stores in one database).
//! Search is exact (a scan ordered by inner product) unless an HNSW index has been built
//! ([`Catalog::set_ann_index`]); exact search stays available for measuring recall.
//!
//! Failures: each attempt is bounded by a timeout; connection failures are retried with
//! backoff within the retry budget, then reported as [`Error::Unavailable`]. Broken
//! connections are dropped from the pool, so the catalog recovers by itself when the server
//! returns.
//!
//! State objects and rows: an insert takes a shared advisory lock per state checksum for its
//! transaction and writes the objects before committing; a delete takes the exclusive lock
//! before checking whether others still use its state. So a delete never removes an object a
//! concurrent insert (on any server) is about to refer to.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use pgvector::Vector;
use tokio_postgres::{Client, NoTls};

use super::{blob_to_u32s, u32s_to_blob, Catalog, RemoveStates, Row, Totals};
use crate::error::{Error, Result};
use crate::filter::{Clause, Condition, Filter, Test};
use crate::location::redact;
use crate::metadata::{self, Metadata};
use crate::records::{ContextRecord, DocumentSummary};
use crate::runtime::{block_on, Resilience};
use crate::scope::Scope;

const RECORD_COLUMNS: &str =
    "id, doc, seg, text, tokens, n_tokens, state_file, checksum, state_bytes, created, metadata::text";

/// The metadata column (added to stores made before it when they are opened).
const METADATA_COLUMN: &str = "metadata JSONB NOT NULL DEFAULT '{}'::jsonb CHECK (jsonb_typeof(metadata) = 'object')";

/// The index a metadata filter (`metadata @> filter`) is answered from: a GIN index of the
/// metadata's key-value paths, so a filter that few contexts match reads only theirs.
const METADATA_INDEX: &str =
    "CREATE INDEX IF NOT EXISTS picaso_contexts_metadata ON picaso_contexts USING gin (metadata jsonb_path_ops)";

/// The index lexical retrieval is answered from: PostgreSQL's full-text search over the
/// contexts' text (`english` configuration: stemmed, stop words dropped), as an expression
/// index, so nothing is stored twice and every writer keeps it current.
const TEXT_INDEX: &str =
    "CREATE INDEX IF NOT EXISTS picaso_contexts_text ON picaso_contexts USING gin (to_tsvector('english', text))";

/// A failed attempt.
#[derive(Debug)]
enum Fail {
    Pg(tokio_postgres::Error),
    Timeout,
}

impl From<tokio_postgres::Error> for Fail {
    fn from(e: tokio_postgres::Error) -> Self {
        Self::Pg(e)
    }
}

impl Fail {
    /// Connection trouble, worth retrying (the server is down, restarting or overloaded).
    fn transient(&self) -> bool {
        match self {
            Self::Timeout => true,
            Self::Pg(e) => match e.as_db_error() {
                None => true, // I/O, closed connection, refused connect
                Some(db) => {
                    let code = db.code().code();
                    code.starts_with("08") || code == "57P01" || code == "57P02" || code == "57P03" || code == "53300"
                }
            },
        }
    }

    fn into_error(self, url: &str) -> Error {
        let transient = self.transient();
        let message = match &self {
            Self::Timeout => "no answer within the timeout".to_string(),
            Self::Pg(e) => match e.as_db_error() {
                Some(db) => format!("{} ({})", db.message(), db.code().code()),
                None => {
                    let source = std::error::Error::source(e).map(|s| format!(": {s}")).unwrap_or_default();
                    format!("{e}{source}")
                }
            },
        };
        if transient {
            Error::Unavailable { backend: url.to_string(), message }
        } else {
            Error::Backend { backend: url.to_string(), message }
        }
    }
}

/// `fut`, failing with [`Fail::Timeout`] if it takes longer than `limit`.
async fn bounded<T>(
    limit: std::time::Duration,
    fut: impl std::future::Future<Output = std::result::Result<T, Fail>>,
) -> std::result::Result<T, Fail> {
    tokio::time::timeout(limit, fut).await.unwrap_or(Err(Fail::Timeout))
}

/// Pacing of retries: exponential backoff (capped at 2 s) within the retry budget.
struct Backoff {
    start: tokio::time::Instant,
    next: std::time::Duration,
    budget: std::time::Duration,
}

impl Backoff {
    fn new(r: Resilience) -> Self {
        Self { start: tokio::time::Instant::now(), next: r.backoff, budget: r.budget }
    }

    /// Waits before the next attempt; `false` (at once) if it would not fit the budget.
    async fn wait(&mut self) -> bool {
        if self.start.elapsed() + self.next >= self.budget {
            return false;
        }
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(std::time::Duration::from_secs(2));
        true
    }
}

type Op<T> = Box<dyn for<'c> FnMut(&'c mut Client) -> BoxFuture<'c, std::result::Result<T, Fail>> + Send>;

/// Connections to one database, reused; broken ones are dropped.
struct Pool {
    config: tokio_postgres::Config,
    url: String,
    idle: Mutex<Vec<Client>>,
    permits: tokio::sync::Semaphore,
    resilience: Resilience,
}

impl Pool {
    async fn checkout(&self) -> std::result::Result<Client, Fail> {
        loop {
            let client = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
            match client {
                Some(c) if !c.is_closed() => return Ok(c),
                Some(_) => continue,
                None => break,
            }
        }
        let (client, connection) = self.config.connect(NoTls).await?;
        tokio::spawn(async move {
            let _ = connection.await; // ends when the client is dropped or the link breaks
        });
        Ok(client)
    }

    fn checkin(&self, client: Client) {
        if !client.is_closed() {
            self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(client);
        }
    }

    /// Runs `op` on a pooled connection, retrying transient failures within the budget.
    async fn run<T: Send + 'static>(self: Arc<Self>, mut op: Op<T>) -> Result<T> {
        let _permit = self.permits.acquire().await.expect("the semaphore is never closed");
        let mut backoff = Backoff::new(self.resilience);
        loop {
            let attempt = async {
                let mut client = self.checkout().await?;
                let out = op(&mut client).await;
                if out.is_ok() {
                    self.checkin(client);
                }
                out
            };
            match bounded(self.resilience.attempt, attempt).await {
                Ok(v) => return Ok(v),
                Err(e) if e.transient() && backoff.wait().await => {}
                Err(e) => return Err(e.into_error(&self.url)),
            }
        }
    }
}

/// A catalog in PostgreSQL.
pub struct PostgresCatalog {
    pool: Arc<Pool>,
}

impl std::fmt::Debug for PostgresCatalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresCatalog").field("url", &self.pool.url).finish()
    }
}

/// Contexts removed per transaction by [`Catalog::delete_many`]: a chunk holds a lock per state
/// object, and PostgreSQL's lock table, shared by all sessions, has room for
/// `max_locks_per_transaction × max_connections` (6,400 by default).
const DELETE_CHUNK: usize = 256;

/// Advisory-lock keys once each, ascending: the order every holder of several takes them in, so
/// that no two wait on each other in a cycle.
fn lock_order(keys: &[i64]) -> Vec<i64> {
    let mut sorted = keys.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    sorted
}

/// The advisory-lock key of a state checksum (its first 64 bits).
fn lock_key(checksum: &str) -> i64 {
    u64::from_str_radix(&checksum[..16.min(checksum.len())], 16).unwrap_or(0) as i64
}

fn record(r: &tokio_postgres::Row) -> ContextRecord {
    ContextRecord {
        id: r.get(0),
        doc: r.get(1),
        seg: r.get::<_, i64>(2) as u32,
        text: r.get(3),
        tokens: blob_to_u32s(r.get::<_, &[u8]>(4)),
        n_tokens: r.get::<_, i64>(5) as usize,
        state_file: r.get(6),
        checksum: r.get(7),
        state_bytes: r.get::<_, i64>(8) as u64,
        created: r.get(9),
        // An object: the column's CHECK holds it to one.
        metadata: metadata::from_json(r.get::<_, &str>(10)).unwrap_or_default(),
    }
}

/// An owned copy of a [`Row`], to move into a query.
#[derive(Clone)]
struct OwnedRow {
    id: Option<i64>,
    doc: String,
    seg: i64,
    text: String,
    tokens: Vec<u8>,
    n_tokens: i64,
    embedding: Vector,
    fingerprint: String,
    state_file: String,
    checksum: String,
    state_bytes: i64,
    created: i64,
    metadata: String,
}

impl PostgresCatalog {
    /// Connects to the database at `url` (a libpq-style URL or key=value string). No query is
    /// made yet; an unreachable server shows on first use.
    pub fn connect(url: &str) -> Result<Self> {
        let shown = redact(url);
        let mut config: tokio_postgres::Config = url.parse().map_err(|e| Error::Input(format!(
            "store location {shown}: not a PostgreSQL connection string ({e}); use postgres://user[:password]@host[:port]/database"
        )))?;
        let resilience = Resilience::from_env();
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(resilience.attempt.min(std::time::Duration::from_secs(3)));
        }
        if config.get_application_name().is_none() {
            config.application_name("picaso");
        }
        let pool = Pool {
            config,
            url: shown,
            idle: Mutex::new(Vec::new()),
            permits: tokio::sync::Semaphore::new(16),
            resilience,
        };
        Ok(Self { pool: Arc::new(pool) })
    }

    fn run<T: Send + 'static>(&self, op: Op<T>) -> Result<T> {
        block_on(self.pool.clone().run(op))
    }

    /// Whether the tables exist in the schema this connection creates them in. Unqualified,
    /// `picaso_meta` would resolve through the whole search path: a new store named
    /// `search_path=store_a,public` would find (and write into) a store that sits in `public`.
    pub fn exists(&self) -> Result<bool> {
        self.run(Box::new(|c| {
            Box::pin(async move {
                let path: String = c.query_one("SHOW search_path", &[]).await?.get(0);
                let row = match own_schema(&path) {
                    Some(schema) => {
                        c.query_one("SELECT to_regclass(format('%I.picaso_meta', $1::text)) IS NOT NULL", &[&schema])
                            .await?
                    }
                    None => {
                        c.query_one(
                            "SELECT coalesce(to_regclass(format('%I.picaso_meta', current_schema())) IS NOT NULL, false)",
                            &[],
                        )
                        .await?
                    }
                };
                Ok(row.get::<_, bool>(0))
            })
        }))
    }

    /// Brings an existing store's tables up to this picaso's: adds the metadata column and its
    /// index to a store made before them (once, under picaso's DDL lock; a look-up when they
    /// are there).
    pub fn upgrade(&self) -> Result<()> {
        self.run(Box::new(|c| {
            Box::pin(async move {
                let current =
                    "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass('picaso_contexts')
                                 AND attname = 'metadata' AND NOT attisdropped)
                               AND to_regclass('picaso_contexts_metadata') IS NOT NULL
                               AND to_regclass('picaso_contexts_text') IS NOT NULL";
                if c.query_one(current, &[]).await?.get::<_, bool>(0) {
                    return Ok(());
                }
                let tx = c.transaction().await?;
                tx.execute("SELECT pg_advisory_xact_lock(7362531)", &[]).await?;
                tx.batch_execute(&format!(
                    "ALTER TABLE picaso_contexts ADD COLUMN IF NOT EXISTS {METADATA_COLUMN}; {METADATA_INDEX}; {TEXT_INDEX};"
                ))
                .await?;
                tx.commit().await?;
                Ok(())
            })
        }))
    }

    /// Creates the extension and tables for `dim`-dimensional embeddings with metadata `meta`,
    /// in one transaction: a creation killed at any point leaves no store or a whole one.
    /// Idempotent, and safe when several processes do it at once (the first one's metadata
    /// stays).
    pub fn create(&self, dim: usize, meta: &[(&str, &str)]) -> Result<()> {
        let url = self.pool.url.clone();
        let meta: Vec<(String, String)> = meta.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let result = self.run(Box::new(move |c| {
            let meta = meta.clone();
            Box::pin(async move {
                let tx = c.transaction().await?;
                // picaso's DDL lock.
                tx.execute("SELECT pg_advisory_xact_lock(7362531)", &[]).await?;
                // A store in its own schema (`options=-csearch_path=NAME,public`): create it.
                let path: String = tx.query_one("SHOW search_path", &[]).await?.get(0);
                if let Some(schema) = own_schema(&path).filter(|s| s != "public") {
                    tx.batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"")).await?;
                }
                tx.batch_execute(&format!(
                    "CREATE EXTENSION IF NOT EXISTS vector;
                     CREATE TABLE IF NOT EXISTS picaso_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                     CREATE TABLE IF NOT EXISTS picaso_contexts (
                         id          BIGSERIAL PRIMARY KEY,
                         doc         TEXT    NOT NULL,
                         seg         BIGINT  NOT NULL,
                         text        TEXT    NOT NULL,
                         tokens      BYTEA   NOT NULL,
                         n_tokens    BIGINT  NOT NULL,
                         embedding   vector({dim}) NOT NULL,
                         fingerprint TEXT    NOT NULL,
                         state_file  TEXT    NOT NULL,
                         checksum    TEXT    NOT NULL,
                         state_bytes BIGINT  NOT NULL,
                         created     BIGINT  NOT NULL,
                         {METADATA_COLUMN},
                         UNIQUE (doc, seg)
                     );
                     CREATE INDEX IF NOT EXISTS picaso_contexts_checksum ON picaso_contexts (checksum);
                     {METADATA_INDEX};
                     {TEXT_INDEX};
                     INSERT INTO picaso_meta (key, value) VALUES ('dim', '{dim}') ON CONFLICT DO NOTHING;"
                ))
                .await?;
                for (k, v) in &meta {
                    tx.execute("INSERT INTO picaso_meta (key, value) VALUES ($1, $2) ON CONFLICT DO NOTHING", &[k, v])
                        .await?;
                }
                tx.commit().await?;
                Ok(())
            })
        }));
        result.map_err(|e| match e {
            Error::Backend { message, .. } if message.contains("vector") => Error::Backend {
                backend: url.clone(),
                message: format!(
                    "{message}; the pgvector extension must be installed on the server \
                     (https://github.com/pgvector/pgvector) and created once by a superuser: CREATE EXTENSION vector"
                ),
            },
            other => other,
        })
    }

    /// Starts a transaction holding shared (insert) or exclusive (delete) advisory locks on
    /// `keys`, and hands back its connection, so the caller can write or delete state objects
    /// before [`Self::finish`] commits.
    fn begin_locked(&self, keys: Vec<i64>, exclusive: bool) -> Result<Client> {
        let pool = self.pool.clone();
        let sorted = lock_order(&keys);
        block_on(async move {
            let mut backoff = Backoff::new(pool.resilience);
            loop {
                let attempt = async {
                    let client = pool.checkout().await?;
                    client.batch_execute("BEGIN").await?;
                    let f = if exclusive { "pg_advisory_xact_lock" } else { "pg_advisory_xact_lock_shared" };
                    client
                        .execute(&format!("SELECT {f}(k) FROM unnest($1::BIGINT[]) AS k ORDER BY k"), &[&sorted])
                        .await?;
                    Ok::<_, Fail>(client)
                };
                match bounded(pool.resilience.attempt, attempt).await {
                    Ok(c) => return Ok(c),
                    Err(e) if e.transient() && backoff.wait().await => {}
                    Err(e) => return Err(e.into_error(&pool.url)),
                }
            }
        })
    }

    /// Runs `op` inside the transaction opened by [`Self::begin_locked`] and commits (or rolls
    /// back on failure, by dropping the connection). Not retried: the transaction is gone if
    /// the link broke.
    fn finish<T: Send + 'static>(&self, client: Client, op: Op<T>) -> Result<T> {
        let pool = self.pool.clone();
        block_on(async move {
            let mut client = client;
            let mut op = op;
            let work = async {
                let out = op(&mut client).await?;
                client.batch_execute("COMMIT").await?;
                Ok::<_, Fail>(out)
            };
            match bounded(pool.resilience.attempt, work).await {
                Ok(v) => {
                    pool.checkin(client);
                    Ok(v)
                }
                Err(e) => Err(e.into_error(&pool.url)), // the dropped connection rolls back
            }
        })
    }

    fn abort(&self, client: Client) {
        drop(client); // closing the connection rolls the transaction back
    }

    /// A connection holding the session-level locks `keys` exclusively, taken in ascending
    /// order as [`Self::begin_locked`] takes its own (so the two never wait on each other in a
    /// cycle), retried like it; release them with [`Self::unlock_objects`].
    fn lock_objects(&self, keys: &[i64]) -> Result<Client> {
        let pool = self.pool.clone();
        let sorted = lock_order(keys);
        block_on(async move {
            let mut backoff = Backoff::new(pool.resilience);
            loop {
                let attempt = async {
                    let client = pool.checkout().await?;
                    client
                        .execute("SELECT pg_advisory_lock(k) FROM unnest($1::BIGINT[]) AS k ORDER BY k", &[&sorted])
                        .await?;
                    Ok::<_, Fail>(client)
                };
                match bounded(pool.resilience.attempt, attempt).await {
                    Ok(c) => return Ok(c),
                    Err(e) if e.transient() && backoff.wait().await => {}
                    Err(e) => return Err(e.into_error(&pool.url)),
                }
            }
        })
    }

    /// Releases [`Self::lock_objects`]'s locks; a connection that cannot is closed, which
    /// releases them too (a pooled connection must never keep a lock).
    fn unlock_objects(&self, client: Client, keys: &[i64]) {
        let pool = self.pool.clone();
        let sorted = lock_order(keys);
        block_on(async move {
            let unlocked = bounded(pool.resilience.attempt, async {
                client.execute("SELECT pg_advisory_unlock(k) FROM unnest($1::BIGINT[]) AS k", &[&sorted]).await?;
                Ok::<_, Fail>(())
            })
            .await;
            if unlocked.is_ok() {
                pool.checkin(client);
            }
        });
    }

    /// Deletes those of `ids` (at most [`DELETE_CHUNK`]) that are here, in one transaction
    /// holding their state objects' locks, and returns them. The rows' removal commits before
    /// the objects': a server killed in between leaves orphan objects (harmless; the next
    /// write of such a state replaces it), never a row whose object is gone. The locks span
    /// both, so an insert that would share an object (it takes the lock shared) waits until the
    /// object is gone and writes it again.
    fn delete_chunk(&self, ids: &[i64], remove_states: &mut RemoveStates<'_>) -> Result<Vec<i64>> {
        let wanted = ids.to_vec();
        let checksums: Vec<String> = self.run(Box::new(move |c| {
            let wanted = wanted.clone();
            Box::pin(async move {
                let rows =
                    c.query("SELECT DISTINCT checksum FROM picaso_contexts WHERE id = ANY($1)", &[&wanted]).await?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            })
        }))?;
        if checksums.is_empty() {
            return Ok(Vec::new()); // none of them is here
        }
        let keys: Vec<i64> = checksums.iter().map(|sum| lock_key(sum)).collect();
        let client = self.lock_objects(&keys)?;
        let (wanted, locked) = (ids.to_vec(), keys.clone());
        let limit = self.pool.resilience.attempt;
        let (client, outcome) = block_on(async move {
            let work = async {
                client.batch_execute("BEGIN").await?;
                let rows = client
                    .query("DELETE FROM picaso_contexts WHERE id = ANY($1) RETURNING id, checksum", &[&wanted])
                    .await?;
                let removed: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                // An object whose lock is not held (its context was restated in between) stays,
                // an orphan, like one whose removal fails.
                let mut sums: Vec<String> =
                    rows.iter().map(|r| r.get::<_, String>(1)).filter(|sum| locked.contains(&lock_key(sum))).collect();
                sums.sort_unstable();
                sums.dedup();
                // EXISTS per object: reading all contexts of a widely shared one would be slow.
                let shared: HashSet<String> = client
                    .query(
                        "SELECT s FROM unnest($1::TEXT[]) AS s \
                         WHERE EXISTS (SELECT 1 FROM picaso_contexts WHERE checksum = s)",
                        &[&sums],
                    )
                    .await?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                client.batch_execute("COMMIT").await?;
                sums.retain(|sum| !shared.contains(sum));
                Ok::<_, Fail>((removed, sums))
            };
            let outcome = bounded(limit, work).await;
            (client, outcome)
        });
        let (removed, unshared) = match outcome {
            Ok(v) => v,
            Err(e) => return Err(e.into_error(&self.pool.url)), // dropping the connection rolls back and unlocks
        };
        if !unshared.is_empty() {
            // After the commit, as for one context: a failed removal leaves orphans.
            let _ = remove_states(&unshared);
        }
        self.unlock_objects(client, &keys);
        Ok(removed)
    }
}

/// The SQL condition for contexts whose metadata matches `filter` (the rules of
/// [`crate::filter`]), over `jsonb`, and its parameters (all text, cast in the SQL). Equality and
/// list membership are containment (`metadata @> ...`), which the GIN index answers; order
/// comparisons test the JSON type first, and compare strings by code point. The placeholders are
/// numbered after the query's first `before` parameters.
fn filter_sql(filter: &Filter, before: usize) -> (String, Vec<String>) {
    let mut sql = FilterSql { params: Vec::new(), before, element: None, elements: 0 };
    let condition = sql.clause(filter.root());
    (condition, sql.params)
}

/// A filter's SQL being written: its parameters, numbered after `before` others.
struct FilterSql {
    params: Vec<String>,
    before: usize,
    /// Within an `$elemMatch`, the SQL of the list element its conditions test; `None` for
    /// the metadata's conditions.
    element: Option<String>,
    /// The `$elemMatch`es written so far, to name each one's element.
    elements: usize,
}

impl FilterSql {
    /// Adds a parameter; its placeholder's number.
    fn push(&mut self, value: String) -> usize {
        self.params.push(value);
        self.before + self.params.len()
    }

    fn clause(&mut self, clause: &Clause) -> String {
        match clause {
            Clause::Key(condition) => self.condition(condition),
            Clause::Any(clauses) => {
                let parts: Vec<String> = clauses.iter().map(|c| self.clause(c)).collect();
                format!("({})", parts.join(" OR "))
            }
            // Every condition is TRUE or FALSE, never NULL (the column is NOT NULL, the CASEs
            // end in FALSE, equalities in elements are COALESCEd), so NOT is the complement.
            Clause::Not(clause) => format!("NOT ({})", self.clause(clause)),
            Clause::All(clauses) => {
                // The keys' equalities in one containment, which the GIN index answers.
                let mut equal = Metadata::new();
                let mut parts = Vec::new();
                for c in clauses {
                    match c {
                        Clause::Key(Condition { path, test: Test::Eq(want) })
                            if self.element.is_none() && path.len() == 1 && !equal.contains_key(&path[0]) =>
                        {
                            equal.insert(path[0].clone(), want.clone());
                        }
                        other => parts.push(self.clause(other)),
                    }
                }
                if !equal.is_empty() {
                    parts.insert(0, format!("metadata @> ${}::text::jsonb", self.push(metadata::to_json(&equal))));
                }
                format!("({})", parts.join(" AND "))
            }
        }
    }

    /// Where a condition looks: the SQL of the value at `path` (`#>` of the keys), and the SQL
    /// that holds when each key on the way holds an object. `#>` also reads a list's element
    /// for a key like `0`; [`crate::filter::below`] descends through objects only, and so must
    /// this. The metadata is an object; a list's element may not be.
    fn path(&mut self, path: &[String]) -> (String, String) {
        let root = self.element.clone().unwrap_or_else(|| "metadata".into());
        let keys: Vec<String> = path.iter().map(|k| format!("${}::text", self.push(k.clone()))).collect();
        let at = |n: usize| match n {
            0 => root.clone(),
            n => format!("({root} #> ARRAY[{}])", keys[..n].join(", ")),
        };
        let first = if self.element.is_some() { 0 } else { 1 };
        let objects: Vec<String> = (first..keys.len())
            .map(|n| format!("jsonb_typeof({}) = 'object'", at(n)))
            .chain(std::iter::once("TRUE".to_string()))
            .collect();
        (at(keys.len()), objects.join(" AND "))
    }

    /// SQL for a test of the value at a path.
    fn condition(&mut self, Condition { path, test }: &Condition) -> String {
        let top = self.element.is_none();
        // Metadata holding `value` where the condition looks (containment, which the GIN index
        // answers, descends through objects as `below` does, and into no list but a tested one).
        let holds = |value: serde_json::Value| {
            let inner =
                path.iter().rev().fold(value, |v, k| serde_json::Value::Object(Metadata::from_iter([(k.clone(), v)])));
            inner.to_string()
        };
        // Equal to `want` where the condition looks: by containment in the metadata, by reading
        // in an element (containment of a scalar would also hold for a list holding it).
        let equal = |sql: &mut Self, want: &serde_json::Value| {
            if top {
                return format!("metadata @> ${}::text::jsonb", sql.push(holds(want.clone())));
            }
            let (at, objects) = sql.path(path);
            let w = sql.push(want.to_string());
            // jsonb `=` compares numbers by value, strings and booleans exactly.
            format!("CASE WHEN {objects} THEN COALESCE({at} = ${w}::text::jsonb, FALSE) ELSE FALSE END")
        };
        match test {
            Test::Eq(want) => equal(self, want),
            Test::Ne(want) => format!("NOT ({})", equal(self, want)),
            Test::In(wants) | Test::NotIn(wants) => {
                let any = match wants.is_empty() {
                    true => "FALSE".to_string(),
                    false => {
                        let parts: Vec<String> = wants.iter().map(|w| equal(self, w)).collect();
                        format!("({})", parts.join(" OR "))
                    }
                };
                negated_if(matches!(test, Test::NotIn(_)), any)
            }
            Test::Exists(present) if top && path.len() == 1 => {
                negated_if(!present, format!("metadata ? ${}::text", self.push(path[0].clone())))
            }
            Test::Exists(present) => {
                let (at, objects) = self.path(path);
                negated_if(!present, format!("CASE WHEN {objects} THEN {at} IS NOT NULL ELSE FALSE END"))
            }
            Test::Contains(want) if top => {
                format!("metadata @> ${}::text::jsonb", self.push(holds(serde_json::Value::Array(vec![want.clone()]))))
            }
            Test::Contains(want) => {
                let (at, objects) = self.path(path);
                let w = self.push(serde_json::Value::Array(vec![want.clone()]).to_string());
                format!(
                    "CASE WHEN {objects} AND jsonb_typeof({at}) = 'array' THEN {at} @> ${w}::text::jsonb ELSE FALSE END"
                )
            }
            Test::Compare(op, bound) => {
                let (at, objects) = self.path(path);
                let (json_type, cast, text) = match bound {
                    serde_json::Value::String(s) => ("string", "text COLLATE \"C\"", s.clone()),
                    other => ("number", "numeric", other.to_string()),
                };
                let b = self.push(text);
                // CASE, not AND: PostgreSQL may evaluate AND's sides in either order, and the
                // cast fails on a value of the other type.
                format!(
                    "CASE WHEN {objects} AND jsonb_typeof({at}) = '{json_type}' \
                     THEN ({at} #>> '{{}}')::{cast} {} ${b}::text::{cast} ELSE FALSE END",
                    op.sql()
                )
            }
            Test::Prefix(prefix) => {
                let (at, objects) = self.path(path);
                let p = self.push(prefix.clone());
                // starts_with, not LIKE: `%` and `_` in the prefix are themselves; "C" compares
                // code points whatever the database's collation.
                format!(
                    "CASE WHEN {objects} AND jsonb_typeof({at}) = 'string' \
                     THEN starts_with(({at} #>> '{{}}') COLLATE \"C\", ${p}::text) ELSE FALSE END"
                )
            }
            Test::Regex(pattern) => {
                let (at, objects) = self.path(path);
                // The pattern rewritten in PostgreSQL's dialect, with the same meaning.
                let p = self.push(pattern.sql().to_string());
                format!(
                    "CASE WHEN {objects} AND jsonb_typeof({at}) = 'string' \
                     THEN ({at} #>> '{{}}') COLLATE \"C\" ~ ${p}::text ELSE FALSE END"
                )
            }
            Test::Elements(element) => {
                // First what the list must contain for an element to pass, if anything: the
                // GIN index answers it, and keeps the elements' scan to the rows it finds.
                let contains = match contained(element) {
                    Some(within) if top => {
                        format!(
                            "metadata @> ${}::text::jsonb AND ",
                            self.push(holds(serde_json::Value::Array(vec![within])))
                        )
                    }
                    _ => String::new(),
                };
                let (at, objects) = self.path(path);
                self.elements += 1;
                let name = format!("e{}", self.elements);
                let outer = self.element.replace(format!("{name}.v"));
                let inner = self.clause(element);
                self.element = outer;
                // No rows, so FALSE, where the value is no list.
                format!(
                    "({contains}EXISTS (SELECT 1 FROM jsonb_array_elements(CASE WHEN {objects} AND \
                     jsonb_typeof({at}) = 'array' THEN {at} END) AS {name}(v) WHERE {inner}))"
                )
            }
        }
    }
}

/// What a list element passing `element` (an `$elemMatch`'s clause) must contain, as jsonb
/// containment: its equalities, `$contains` and inner `$elemMatch`es among the tests all of
/// which must hold; `None` when there are none. Only a necessary condition (a test it cannot
/// state is left out), which the SQL checks before the exact one.
fn contained(element: &Clause) -> Option<serde_json::Value> {
    use serde_json::Value;
    let Clause::All(clauses) = element else { return None };
    let mut object = Metadata::new();
    for clause in clauses {
        let Clause::Key(Condition { path, test }) = clause else { continue };
        let within = match test {
            Test::Eq(want) => want.clone(),
            Test::Contains(want) => Value::Array(vec![want.clone()]),
            Test::Elements(inner) => match contained(inner) {
                Some(within) => Value::Array(vec![within]),
                None => continue,
            },
            _ => continue,
        };
        if path.is_empty() {
            // The element itself: a scalar equal to it, or a list containing it.
            return Some(within);
        }
        put(&mut object, path, within);
    }
    (!object.is_empty()).then_some(Value::Object(object))
}

/// Puts `value` at `path` (not empty) within `object`, through objects made on the way, unless
/// a value is there or on the way already (the test is then left out).
fn put(object: &mut Metadata, path: &[String], value: serde_json::Value) {
    let (key, rest) = path.split_first().expect("a path to put at");
    match (object.get_mut(key), rest) {
        (None, []) => {
            object.insert(key.clone(), value);
        }
        (None, rest) => {
            let mut inner = Metadata::new();
            put(&mut inner, rest, value);
            object.insert(key.clone(), serde_json::Value::Object(inner));
        }
        (Some(serde_json::Value::Object(inner)), [_, ..]) => put(inner, rest, value),
        (Some(_), _) => {}
    }
}

/// `sql`, or its negation when `negate`.
fn negated_if(negate: bool, sql: String) -> String {
    if negate {
        format!("NOT ({sql})")
    } else {
        sql
    }
}

impl Catalog for PostgresCatalog {
    fn url(&self) -> String {
        self.pool.url.clone()
    }

    fn meta(&self, key: &str) -> Result<Option<String>> {
        let key = key.to_string();
        self.run(Box::new(move |c| {
            let key = key.clone();
            Box::pin(async move {
                let row = c.query_opt("SELECT value FROM picaso_meta WHERE key = $1", &[&key]).await?;
                Ok(row.map(|r| r.get(0)))
            })
        }))
    }

    fn set_meta(&self, key: &str, value: &str) -> Result<()> {
        let (key, value) = (key.to_string(), value.to_string());
        self.run(Box::new(move |c| {
            let (key, value) = (key.clone(), value.clone());
            Box::pin(async move {
                c.execute(
                    "INSERT INTO picaso_meta (key, value) VALUES ($1, $2) ON CONFLICT (key) DO UPDATE SET value = $2",
                    &[&key, &value],
                )
                .await?;
                Ok(())
            })
        }))
    }

    fn init_meta(&self, key: &str, value: &str) -> Result<String> {
        let (key, value) = (key.to_string(), value.to_string());
        self.run(Box::new(move |c| {
            let (key, value) = (key.clone(), value.clone());
            Box::pin(async move {
                c.execute(
                    "INSERT INTO picaso_meta (key, value) VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    &[&key, &value],
                )
                .await?;
                Ok(c.query_one("SELECT value FROM picaso_meta WHERE key = $1", &[&key]).await?.get(0))
            })
        }))
    }

    fn segments_of(&self, doc: &str) -> Result<BTreeMap<u32, i64>> {
        let doc = doc.to_string();
        self.run(Box::new(move |c| {
            let doc = doc.clone();
            Box::pin(async move {
                let rows = c.query("SELECT seg, id FROM picaso_contexts WHERE doc = $1", &[&doc]).await?;
                Ok(rows.iter().map(|r| (r.get::<_, i64>(0) as u32, r.get::<_, i64>(1))).collect())
            })
        }))
    }

    fn insert(&self, rows: &[Row<'_>], write_states: &mut dyn FnMut() -> Result<()>) -> Result<Vec<Option<i64>>> {
        let owned: Vec<OwnedRow> = rows
            .iter()
            .map(|r| OwnedRow {
                id: r.id,
                doc: r.doc.to_string(),
                seg: i64::from(r.seg),
                text: r.text.to_string(),
                tokens: u32s_to_blob(r.tokens),
                n_tokens: r.tokens.len() as i64,
                embedding: Vector::from(r.embedding.to_vec()),
                fingerprint: r.fingerprint.to_string(),
                state_file: r.state_file.to_string(),
                checksum: r.checksum.to_string(),
                state_bytes: r.state_bytes as i64,
                created: r.created,
                metadata: r.metadata.to_string(),
            })
            .collect();
        let client = self.begin_locked(rows.iter().map(|r| lock_key(r.checksum)).collect(), false)?;
        if let Err(e) = write_states() {
            self.abort(client);
            return Err(e);
        }
        let explicit = owned.iter().any(|r| r.id.is_some());
        self.finish(
            client,
            Box::new(move |c| {
                let owned = owned.clone();
                Box::pin(async move {
                    if explicit {
                        // Holds off other inserts (and their nextval) until this commit, so the
                        // sequence read below cannot fall behind an id handed out meanwhile.
                        c.batch_execute("LOCK TABLE picaso_contexts IN SHARE ROW EXCLUSIVE MODE").await?;
                    }
                    let stmt = c
                        .prepare(
                            "INSERT INTO picaso_contexts
                             (id, doc, seg, text, tokens, n_tokens, embedding, fingerprint, state_file, checksum, state_bytes, created,
                              metadata)
                             VALUES (COALESCE($1, nextval(pg_get_serial_sequence('picaso_contexts', 'id'))),
                                     $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13::text::jsonb)
                             ON CONFLICT (doc, seg) DO NOTHING RETURNING id",
                        )
                        .await?;
                    let mut ids = Vec::with_capacity(owned.len());
                    for r in &owned {
                        let row = c
                            .query_opt(
                                &stmt,
                                &[
                                    &r.id,
                                    &r.doc,
                                    &r.seg,
                                    &r.text,
                                    &r.tokens,
                                    &r.n_tokens,
                                    &r.embedding,
                                    &r.fingerprint,
                                    &r.state_file,
                                    &r.checksum,
                                    &r.state_bytes,
                                    &r.created,
                                    &r.metadata,
                                ],
                            )
                            .await?;
                        ids.push(row.map(|r| r.get::<_, i64>(0)));
                    }
                    if explicit {
                        // Keep the sequence past ids copied in, so later inserts never collide,
                        // and never move it back: after a delete, MAX(id) is below ids already
                        // handed out, and reusing one would make caches keyed by id serve the
                        // deleted context's state.
                        c.execute(
                            "SELECT setval(pg_get_serial_sequence('picaso_contexts', 'id'),
                                           GREATEST((SELECT MAX(id) FROM picaso_contexts),
                                                    pg_sequence_last_value(pg_get_serial_sequence('picaso_contexts', 'id')::regclass),
                                                    1))",
                            &[],
                        )
                        .await?;
                    }
                    Ok(ids)
                })
            }),
        )
    }

    fn id_of(&self, doc: &str, seg: u32) -> Result<Option<i64>> {
        let doc = doc.to_string();
        self.run(Box::new(move |c| {
            let doc = doc.clone();
            Box::pin(async move {
                let row = c
                    .query_opt("SELECT id FROM picaso_contexts WHERE doc = $1 AND seg = $2", &[&doc, &i64::from(seg)])
                    .await?;
                Ok(row.map(|r| r.get(0)))
            })
        }))
    }

    fn get_many(&self, ids: &[i64]) -> Result<Vec<ContextRecord>> {
        let wanted = ids.to_vec();
        let found: Vec<ContextRecord> = self.run(Box::new(move |c| {
            let wanted = wanted.clone();
            Box::pin(async move {
                let rows = c
                    .query(&format!("SELECT {RECORD_COLUMNS} FROM picaso_contexts WHERE id = ANY($1)"), &[&wanted])
                    .await?;
                Ok(rows.iter().map(record).collect())
            })
        }))?;
        let by_id: HashMap<i64, ContextRecord> = found.into_iter().map(|r| (r.id, r)).collect();
        ids.iter().map(|id| by_id.get(id).cloned().ok_or(Error::NotFound(*id))).collect()
    }

    fn exist(&self, ids: &[i64]) -> Result<Vec<bool>> {
        let wanted = ids.to_vec();
        let found: HashSet<i64> = self.run(Box::new(move |c| {
            let wanted = wanted.clone();
            Box::pin(async move {
                let rows = c.query("SELECT id FROM picaso_contexts WHERE id = ANY($1)", &[&wanted]).await?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            })
        }))?;
        Ok(ids.iter().map(|id| found.contains(id)).collect())
    }

    fn exist_settled(&self, ids: &[i64], checksums: &[String]) -> Result<Vec<bool>> {
        // A delete holds its object's lock exclusively until it commits; waiting for the
        // shared lock orders this read after it.
        let client = self.begin_locked(checksums.iter().map(|c| lock_key(c)).collect(), false)?;
        let wanted = ids.to_vec();
        let found: HashSet<i64> = self.finish(
            client,
            Box::new(move |c| {
                let wanted = wanted.clone();
                Box::pin(async move {
                    let rows = c.query("SELECT id FROM picaso_contexts WHERE id = ANY($1)", &[&wanted]).await?;
                    Ok(rows.iter().map(|r| r.get(0)).collect())
                })
            }),
        )?;
        Ok(ids.iter().map(|id| found.contains(id)).collect())
    }

    fn doc_seg(&self, id: i64) -> Result<(String, u32)> {
        let row = self.run(Box::new(move |c| {
            Box::pin(async move {
                let row = c.query_opt("SELECT doc, seg FROM picaso_contexts WHERE id = $1", &[&id]).await?;
                Ok(row.map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u32)))
            })
        }))?;
        row.ok_or(Error::NotFound(id))
    }

    fn delete(&self, id: i64, remove_states: &mut RemoveStates<'_>) -> Result<()> {
        match self.delete_chunk(&[id], remove_states)?.is_empty() {
            true => Err(Error::NotFound(id)), // not here, or deleted meanwhile by another server
            false => Ok(()),
        }
    }

    /// 256 contexts per transaction instead of one (a delete of 10,000 contexts
    /// was 10,000 transactions and lock round trips).
    fn delete_many(&self, ids: &[i64], remove_states: &mut RemoveStates<'_>) -> Result<Vec<i64>> {
        let mut removed = Vec::new();
        for chunk in ids.chunks(DELETE_CHUNK) {
            removed.extend(self.delete_chunk(chunk, remove_states)?);
        }
        removed.sort_unstable();
        removed.dedup();
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
        // As an insert: the object is written under its shared lock, so a delete of another
        // context with this state cannot remove it before this row refers to it.
        let client = self.begin_locked(vec![lock_key(checksum)], false)?;
        if let Err(e) = write_states() {
            self.abort(client);
            return Err(e);
        }
        let (sum, file, bytes) = (checksum.to_string(), state_file.to_string(), state_bytes as i64);
        self.finish(
            client,
            Box::new(move |c| {
                let (sum, file) = (sum.clone(), file.clone());
                Box::pin(async move {
                    let n = c
                        .execute(
                            "UPDATE picaso_contexts SET checksum = $1, state_file = $2, state_bytes = $3 WHERE id = $4",
                            &[&sum, &file, &bytes, &id],
                        )
                        .await?;
                    Ok(n == 1)
                })
            }),
        )
    }

    fn remove_if_unreferenced(&self, checksum: &str, remove_state: &mut dyn FnMut(&str) -> Result<()>) -> Result<bool> {
        // The lock a delete takes: inserts that would refer to this object wait until it is gone
        // and write it again.
        let client = self.lock_objects(&[lock_key(checksum)])?;
        let sum = checksum.to_string();
        let limit = self.pool.resilience.attempt;
        let (client, used) = block_on(async move {
            let used = bounded(limit, async {
                let row = client
                    .query_one("SELECT EXISTS (SELECT 1 FROM picaso_contexts WHERE checksum = $1)", &[&sum])
                    .await?;
                Ok::<bool, Fail>(row.get(0))
            })
            .await;
            (client, used)
        });
        let used = match used {
            Ok(v) => v,
            Err(e) => return Err(e.into_error(&self.pool.url)), // dropping the connection unlocks
        };
        let removed = if used { Ok(false) } else { remove_state(checksum).map(|()| true) };
        self.unlock_objects(client, &[lock_key(checksum)]);
        removed
    }

    fn search(&self, query: &[f32], k: usize, exact: bool, scope: Scope<'_>) -> Result<Vec<(i64, f32)>> {
        let q = Vector::from(query.to_vec());
        let limit = k as i64;
        let scoped = !scope.is_all();
        let documents = scope.documents.map(<[String]>::to_vec);
        // After the query's vector, limit and documents.
        let filter = scope.filter.map(|f| filter_sql(f, 2 + usize::from(documents.is_some())));
        self.run(Box::new(move |c| {
            let (q, documents, filter) = (q.clone(), documents.clone(), filter.clone());
            Box::pin(async move {
                let tx = c.transaction().await?;
                if exact || scoped {
                    // No HNSW scan: filtered after the index, it could return fewer than k of
                    // the scope's contexts. A documents' rows are found by the (doc, seg) index.
                    tx.batch_execute("SET LOCAL enable_indexscan = off").await?;
                } else {
                    // Enough candidates for k results (pgvector's default is 40).
                    tx.batch_execute(&format!("SET LOCAL hnsw.ef_search = {}", (2 * limit).clamp(40, 1000))).await?;
                }
                let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&q, &limit];
                let mut conditions = Vec::new();
                if let Some(docs) = &documents {
                    params.push(docs);
                    conditions.push(format!("doc = ANY(${})", params.len()));
                }
                if let Some((condition, values)) = &filter {
                    params.extend(values.iter().map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync)));
                    conditions.push(condition.clone());
                }
                let condition =
                    if conditions.is_empty() { String::new() } else { format!("WHERE {}", conditions.join(" AND ")) };
                let rows = tx
                    .query(
                        &format!(
                            "SELECT id, -(embedding <#> $1) FROM picaso_contexts {condition}
                             ORDER BY embedding <#> $1, id LIMIT $2"
                        ),
                        &params,
                    )
                    .await?;
                tx.commit().await?;
                Ok(rows.iter().map(|r| (r.get::<_, i64>(0), r.get::<_, f64>(1) as f32)).collect())
            })
        }))
    }

    fn search_text(&self, query: &str, k: usize, scope: Scope<'_>) -> Result<Vec<(i64, f32)>> {
        // The query's terms as picaso's BM25 finds them (alphanumeric, so safe in a tsquery),
        // OR-ed: a context sharing any term is a candidate, as in BM25.
        let words = picaso_embed::bm25::terms(query);
        if words.is_empty() || k == 0 {
            return Ok(Vec::new());
        }
        let tsquery = words.join(" | ");
        let limit = k as i64;
        let documents = scope.documents.map(<[String]>::to_vec);
        let filter = scope.filter.map(|f| filter_sql(f, 2 + usize::from(documents.is_some())));
        self.run(Box::new(move |c| {
            let (tsquery, documents, filter) = (tsquery.clone(), documents.clone(), filter.clone());
            Box::pin(async move {
                let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&tsquery, &limit];
                let mut conditions = vec!["to_tsvector('english', text) @@ q".to_string()];
                if let Some(docs) = &documents {
                    params.push(docs);
                    conditions.push(format!("doc = ANY(${})", params.len()));
                }
                if let Some((condition, values)) = &filter {
                    params.extend(values.iter().map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync)));
                    conditions.push(condition.clone());
                }
                // Normalisation 1: the rank divided by 1 + ln(length), so long texts do not win
                // by length alone.
                let rows = c
                    .query(
                        &format!(
                            "SELECT id, ts_rank(to_tsvector('english', text), q, 1)::float8 AS score
                             FROM picaso_contexts, to_tsquery('english', $1) AS q
                             WHERE {}
                             ORDER BY score DESC, id LIMIT $2",
                            conditions.join(" AND ")
                        ),
                        &params,
                    )
                    .await?;
                Ok(rows.iter().map(|r| (r.get::<_, i64>(0), r.get::<_, f64>(1) as f32)).collect())
            })
        }))
    }

    fn set_metadata(&self, ids: &[i64], metadata: &str) -> Result<u64> {
        let (ids, metadata) = (ids.to_vec(), metadata.to_string());
        self.run(Box::new(move |c| {
            let (ids, metadata) = (ids.clone(), metadata.clone());
            Box::pin(async move {
                Ok(c.execute(
                    "UPDATE picaso_contexts SET metadata = $1::text::jsonb WHERE id = ANY($2) AND metadata <> $1::text::jsonb",
                    &[&metadata, &ids],
                )
                .await?)
            })
        }))
    }

    fn matching(&self, filter: &Filter) -> Result<Vec<i64>> {
        let (condition, params) = filter_sql(filter, 0);
        self.run(Box::new(move |c| {
            let (condition, params) = (condition.clone(), params.clone());
            Box::pin(async move {
                let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                    params.iter().map(|v| v as &(dyn tokio_postgres::types::ToSql + Sync)).collect();
                let rows =
                    c.query(&format!("SELECT id FROM picaso_contexts WHERE {condition} ORDER BY id"), &params).await?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            })
        }))
    }

    fn embedding(&self, id: i64) -> Result<Vec<f32>> {
        let v = self.run(Box::new(move |c| {
            Box::pin(async move {
                let row = c.query_opt("SELECT embedding FROM picaso_contexts WHERE id = $1", &[&id]).await?;
                Ok(row.map(|r| r.get::<_, Vector>(0).to_vec()))
            })
        }))?;
        v.ok_or(Error::NotFound(id))
    }

    fn count(&self) -> Result<usize> {
        self.run(Box::new(|c| {
            Box::pin(async move {
                Ok(c.query_one("SELECT COUNT(*) FROM picaso_contexts", &[]).await?.get::<_, i64>(0) as usize)
            })
        }))
    }

    fn ids(&self) -> Result<Vec<i64>> {
        self.run(Box::new(|c| {
            Box::pin(async move {
                let rows = c.query("SELECT id FROM picaso_contexts ORDER BY id", &[]).await?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            })
        }))
    }

    fn totals(&self) -> Result<Totals> {
        self.run(Box::new(|c| {
            Box::pin(async move {
                let r = c
                    .query_one(
                        "SELECT COUNT(*), COUNT(DISTINCT doc), COALESCE(SUM(n_tokens), 0)::BIGINT,
                                (SELECT COALESCE(SUM(b), 0)::BIGINT FROM
                                    (SELECT MAX(state_bytes) AS b FROM picaso_contexts GROUP BY state_file) AS files)
                         FROM picaso_contexts",
                        &[],
                    )
                    .await?;
                let g = |i: usize| r.get::<_, i64>(i) as u64;
                Ok((g(0), g(1), g(2), g(3)))
            })
        }))
    }

    fn documents(&self, after: Option<&str>, limit: usize) -> Result<Vec<DocumentSummary>> {
        let (after, limit) = (after.map(str::to_string), limit as i64);
        self.run(Box::new(move |c| {
            let after = after.clone();
            Box::pin(async move {
                let rows = c
                    .query(
                        "SELECT doc, COUNT(*), COALESCE(SUM(n_tokens), 0)::BIGINT,
                                ((array_agg(metadata ORDER BY seg))[1])::TEXT
                         FROM picaso_contexts
                         WHERE $1::TEXT IS NULL OR doc > $1 GROUP BY doc ORDER BY doc LIMIT $2",
                        &[&after, &limit],
                    )
                    .await?;
                Ok(rows
                    .iter()
                    .map(|r| DocumentSummary {
                        id: r.get(0),
                        contexts: r.get::<_, i64>(1) as u64,
                        tokens: r.get::<_, i64>(2) as u64,
                        // An object: the column's CHECK holds it to one.
                        metadata: metadata::from_json(r.get::<_, &str>(3)).unwrap_or_default(),
                    })
                    .collect())
            })
        }))
    }

    fn export(&self, after: i64, limit: usize) -> Result<Vec<(ContextRecord, Vec<f32>)>> {
        let limit = limit as i64;
        self.run(Box::new(move |c| {
            Box::pin(async move {
                let rows = c
                    .query(
                        &format!(
                            "SELECT {RECORD_COLUMNS}, embedding FROM picaso_contexts WHERE id > $1 ORDER BY id LIMIT $2"
                        ),
                        &[&after, &limit],
                    )
                    .await?;
                Ok(rows.iter().map(|r| (record(r), r.get::<_, Vector>(11).to_vec())).collect())
            })
        }))
    }

    fn set_ann_index(&self, hnsw: Option<(usize, usize)>) -> Result<()> {
        let sql = match hnsw {
            None => "DROP INDEX IF EXISTS picaso_contexts_hnsw".to_string(),
            Some((m, ef)) => format!(
                "DROP INDEX IF EXISTS picaso_contexts_hnsw;
                 CREATE INDEX picaso_contexts_hnsw ON picaso_contexts
                 USING hnsw (embedding vector_ip_ops) WITH (m = {m}, ef_construction = {ef})"
            ),
        };
        self.run(Box::new(move |c| {
            let sql = sql.clone();
            Box::pin(async move { Ok(c.batch_execute(&sql).await?) })
        }))
    }
}

/// The schema a store named by `search_path` lives in: its first entry when that is a plain
/// name (created if missing), else None (`$user` and the like: the first schema that exists).
fn own_schema(search_path: &str) -> Option<String> {
    let first = search_path.split(',').next().unwrap_or("").trim().trim_matches('"');
    let plain = !first.is_empty() && first.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    plain.then(|| first.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `$regex` pattern's rewrite matches in PostgreSQL exactly the strings that the
    /// `regex` crate matches with the pattern as given.
    #[test]
    fn regex_rewrites_match_in_postgres_as_in_rust() {
        use crate::pattern::Pattern;
        let Some(catalog) = catalog() else { return };
        let patterns = [
            "",
            "a",
            "^a",
            "a$",
            "^$",
            "\\A\\z",
            "é",
            "(?i)É",
            "(?i)straße",
            "(?i)k",
            "[a-c]+x",
            "[^a-z]",
            ".",
            "^.$",
            "^..$",
            "(?s)^.$",
            "a.b",
            "a\\nb",
            "(?m)^b",
            "(?m)a$",
            "(?m)^$",
            "^(ab|cd)*$",
            "^(?:a|)$",
            "x{2}",
            "x{2,}",
            "^x{1,3}y",
            "\\d",
            "^\\d{3}$",
            "(?-u:\\d)",
            "^\\w+$",
            "^(?-u:\\w)+$",
            "\\s",
            "^\\S*$",
            "[[:alpha:]]",
            "^[[:^digit:]]+$",
            "\\p{Greek}",
            "\\p{Lu}",
            "[\\p{Greek}&&\\p{Ll}]",
            "(?i)^[a-z]+$",
            "a|b|c",
            "\\.",
            "\\[",
            "\\\\",
            "[\\]\\-^]",
            "😀",
            "[😀-😂]",
            "\\x{00e9}",
            "(?x) a b # comment",
            "^-?[0-9]+(\\.[0-9]+)?$",
            "colou?r",
            "^(a+)+c$",
            "[ -~]",
            "\\t",
            "(?i)ß",
            "^.{3}$",
            "(a)(b)?\\z",
            "()*a",
            "(|a)b",
            "^(a|b)(c|d)$",
            "[^\\x00-\\x{10FFFF}]",
            "a[\\x00]?b",
            "a\\x00?b",
            "(?:a{1,255}){1,3}x",
        ];
        let texts = [
            "",
            "a",
            "ab",
            "abc",
            "cd",
            "abcd",
            "b\na",
            "a\nb",
            "a\n",
            "\n",
            "é",
            "É",
            "Straße",
            "STRASSE",
            "xx",
            "xxxy",
            "xy",
            "123",
            "١٢٣",
            "ΑΒΓ",
            "αβγ",
            "hello world",
            "-12.5",
            "12.",
            "a.b",
            "[x]",
            "back\\slash",
            "😀",
            "😁x",
            "\t",
            "\u{212A}",
            "K",
            "k",
            "color",
            "colour",
            "aaaaaaaaaaaaaaaaaaaaaac",
            "x y",
            "_",
            "]-^",
            "ẞ",
            "abcé",
        ];
        let compiled: Vec<Pattern> = patterns.iter().map(|p| Pattern::new("k", p).unwrap()).collect();
        let sql: Vec<String> = compiled.iter().map(|p| p.sql().to_string()).collect();
        let text: Vec<String> = texts.iter().map(|t| t.to_string()).collect();
        let got = regex_matches(&catalog, sql, text).unwrap();
        let mut matches = 0;
        for (i, p) in compiled.iter().enumerate() {
            for (j, t) in texts.iter().enumerate() {
                let want = p.is_match(t);
                matches += want as usize;
                assert_eq!(got[i * texts.len() + j], want, "{:?} on {t:?} (PostgreSQL: {:?})", p.source(), p.sql());
            }
        }
        assert!(matches > 200 && matches < patterns.len() * texts.len() - 200, "{matches}: a test of both outcomes");
    }

    /// Whether each text matches each of the PostgreSQL patterns `sql` (by code point), pattern
    /// by pattern.
    fn regex_matches(catalog: &PostgresCatalog, sql: Vec<String>, texts: Vec<String>) -> Result<Vec<bool>> {
        catalog.run(Box::new(move |c| {
            let (sql, texts) = (sql.clone(), texts.clone());
            Box::pin(async move {
                let rows = c
                    .query(
                        "SELECT t COLLATE \"C\" ~ p FROM unnest($1::text[]) WITH ORDINALITY AS a(p, i), \
                         unnest($2::text[]) WITH ORDINALITY AS b(t, j) ORDER BY i, j",
                        &[&sql, &texts],
                    )
                    .await?;
                Ok(rows.iter().map(|r| r.get(0)).collect())
            })
        }))
    }

    /// Random patterns (literals that fold case oddly, classes, anchors, groups with flags,
    /// repetitions greedy and lazy, alternations, nested) on random short texts: PostgreSQL
    /// answers the rewrite as the regex crate answers the pattern. Cases: `PROPTEST_CASES`
    /// (300 unless set); a failure shows the smallest pattern found.
    #[test]
    fn random_regexes_match_in_postgres_as_in_rust() {
        use crate::pattern::Pattern;
        use proptest::prelude::*;
        use proptest::sample::select;
        use proptest::test_runner::{Config, TestCaseError, TestRunner};
        let Some(catalog) = catalog() else { return };

        fn pattern(depth: u32) -> BoxedStrategy<String> {
            let pick = |items: &'static [&'static str]| select(items).prop_map(String::from).boxed();
            let atom = prop_oneof![
                4 => pick(&["a", "b", "x", "é", "É", "k", "K", "ß", "s", "σ", "😀", "\\n", "\\.", "-", "\\[", "\\\\", " "]),
                2 => pick(&[".", "[a-c]", "[^a]", "[^\\n]", "[é-ê]", "[[:alpha:]]", "[[:^digit:]]", "\\d", "\\w", "\\s",
                            "\\S", "\\W", "\\p{Lu}", "\\p{Greek}", "[a-zA-Z0-9_]", "[\\x00-\\x{7f}]", "[k-s&&[^n]]"]),
                1 => pick(&["^", "$", "\\A", "\\z"]),
            ]
            .boxed();
            let item = if depth == 0 {
                atom
            } else {
                let group = (pick(&["(", "(?:", "(?i:", "(?-i:", "(?s:", "(?m:"]), pattern(depth - 1))
                    .prop_map(|(open, inner)| format!("{open}{inner})"));
                prop_oneof![3 => atom, 1 => group].boxed()
            };
            let repeat = pick(&["", "", "", "*", "+", "?", "{2}", "{1,2}", "{0,}", "*?", "+?", "??"]);
            let concat = prop::collection::vec((item, repeat).prop_map(|(i, r)| i + &r), 1..4).prop_map(|v| v.concat());
            prop_oneof![3 => concat.clone(), 1 => (concat.clone(), concat).prop_map(|(a, b)| format!("{a}|{b}"))]
                .boxed()
        }
        let flags = select(&["", "", "(?i)", "(?s)", "(?m)", "(?is)", "(?im)", "(?ms)"][..]);
        let chars: Vec<char> = "abcxséÉKk\u{212A}ßẞSσςΣ😀\n\r.-[\\1٣ _".chars().collect();
        let texts = prop::collection::vec(
            prop::collection::vec(select(chars), 0..6).prop_map(|c| c.into_iter().collect::<String>()),
            12,
        );

        let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300);
        let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
        let outcomes = std::cell::Cell::new([0usize; 2]);
        runner
            .run(&((flags, pattern(2)).prop_map(|(f, p)| f.to_string() + &p), texts), |(source, texts)| {
                let p = Pattern::new("k", &source).map_err(|e| TestCaseError::fail(format!("{source:?}: {e}")))?;
                let got = regex_matches(&catalog, vec![p.sql().to_string()], texts.clone())
                    .map_err(|e| TestCaseError::fail(format!("{source:?} (PostgreSQL: {:?}): {e}", p.sql())))?;
                for (t, got) in texts.iter().zip(got) {
                    let want = p.is_match(t);
                    let mut o = outcomes.get();
                    o[want as usize] += 1;
                    outcomes.set(o);
                    prop_assert_eq!(got, want, "{:?} on {:?} (PostgreSQL: {:?})", source, t, p.sql());
                }
                Ok(())
            })
            .unwrap();
        let [no, yes] = outcomes.get();
        assert!(yes * 10 > no && no * 10 > yes, "{yes} texts matched, {no} did not: a test of both outcomes");
        eprintln!("{cases} random patterns: {yes} texts matched, {no} did not");
    }

    /// An `$elemMatch`'s containment states its equalities, `$contains` and inner
    /// `$elemMatch`es, and leaves out what it cannot state.
    #[test]
    fn an_elem_match_contains_what_its_element_must() {
        use serde_json::json;
        let within = |f: serde_json::Value| {
            let f = Filter::new(json!({"k": {"$elemMatch": f}}).as_object().unwrap()).unwrap();
            let Clause::All(keys) = f.root() else { panic!("{f:?}") };
            let [Clause::Key(Condition { test: Test::Elements(element), .. })] = &keys[..] else { panic!("{f:?}") };
            contained(element)
        };
        assert_eq!(
            within(json!({"a": 1, "b": {"c": "x", "d": {"$gt": 2}}, "l": {"$contains": 3}})),
            Some(json!({"a": 1, "b": {"c": "x"}, "l": [3]}))
        );
        assert_eq!(within(json!({"$eq": 7})), Some(json!(7)));
        assert_eq!(within(json!({"$elemMatch": {"id": 1, "$ne": 2}})), Some(json!([{"id": 1}])));
        assert_eq!(within(json!({"a": {"$in": [1, 2]}, "$not": {"b": 1}})), None);
        assert_eq!(within(json!({"a": {"$elemMatch": {"$gt": 1}}})), None);
        // Two tests at one place: the first is stated, the other left out.
        assert_eq!(within(json!({"b": {"$eq": 1, "c": 2}})), Some(json!({"b": 1})));
        assert_eq!(within(json!({"l": {"$contains": 1, "$elemMatch": {"$eq": 2}}})), Some(json!({"l": [1]})));
    }

    /// A catalog in a fresh schema of `PICASO_TEST_POSTGRES`, or None when it is not set.
    fn catalog() -> Option<PostgresCatalog> {
        let Ok(url) = std::env::var("PICASO_TEST_POSTGRES") else {
            assert!(std::env::var("PICASO_TEST_REQUIRE_BACKENDS").is_err(), "PICASO_TEST_POSTGRES is required");
            eprintln!("note: PICASO_TEST_POSTGRES not set; skipped");
            return None;
        };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let sep = if url.contains('?') { '&' } else { '?' };
        let url = format!("{url}{sep}options=-csearch_path%3Dunit_{}_{nanos}%2Cpublic", std::process::id());
        let catalog = PostgresCatalog::connect(&url).unwrap();
        catalog.create(2, &[]).unwrap();
        Some(catalog)
    }

    /// A store in a schema of its own is not mistaken for one the search path reaches after it
    /// (README: `search_path=store_a,public` beside a store in `public`).
    #[test]
    fn a_new_schema_does_not_find_the_store_of_a_later_one() {
        let Ok(url) = std::env::var("PICASO_TEST_POSTGRES") else { return };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let sep = if url.contains('?') { '&' } else { '?' };
        let (a, b) = (format!("unit_a_{nanos}"), format!("unit_b_{nanos}"));
        let at = |path: &str| PostgresCatalog::connect(&format!("{url}{sep}options=-csearch_path%3D{path}")).unwrap();
        let first = at(&format!("{a}%2Cpublic"));
        first.create(2, &[]).unwrap();
        first.init_meta("model", "a").unwrap();
        let second = at(&format!("{b}%2C{a}%2Cpublic"));
        assert!(!second.exists().unwrap(), "store {a} is reached through the search path, but is not {b}");
        second.create(3, &[]).unwrap();
        second.init_meta("model", "b").unwrap();
        assert!(second.exists().unwrap());
        assert_eq!(second.meta("model").unwrap().as_deref(), Some("b"));
        assert_eq!(
            (first.meta("model").unwrap().as_deref(), first.meta("dim").unwrap().as_deref()),
            (Some("a"), Some("2"))
        );
        assert_eq!(second.meta("dim").unwrap().as_deref(), Some("3"));
        assert_eq!(own_schema("\"$user\", public"), None);
        assert_eq!(own_schema("store_a, public").as_deref(), Some("store_a"));
    }

    /// Inserting explicit ids (a migration, run again) never moves the id sequence back: after
    /// a delete, MAX(id) is below an id already handed out, which must not be handed out again.
    #[test]
    fn explicit_ids_never_move_the_sequence_back() {
        let Some(catalog) = catalog() else { return };
        let row = |id: Option<i64>, doc: &'static str| Row {
            id,
            doc,
            seg: 0,
            text: "t",
            tokens: &[1],
            embedding: &[1.0, 0.0],
            fingerprint: "f",
            state_file: "states/01/0123456789abcdef0123456789abcdef.safetensors",
            checksum: "0123456789abcdef0123456789abcdef",
            state_bytes: 10,
            created: 0,
            metadata: "{}",
        };
        let copied = [row(Some(1), "a"), row(Some(2), "b")];
        catalog.insert(&copied, &mut || Ok(())).unwrap();
        let new = catalog.insert(&[row(None, "c")], &mut || Ok(())).unwrap()[0].unwrap();
        assert_eq!(new, 3);
        catalog.delete(new, &mut |_| Ok(())).unwrap();
        assert_eq!(catalog.insert(&copied, &mut || Ok(())).unwrap(), vec![None, None], "copied again: skipped");
        let next = catalog.insert(&[row(None, "d")], &mut || Ok(())).unwrap()[0].unwrap();
        assert_eq!(next, 4, "the deleted context's id was handed out again");
    }

    /// A server that dies after removing a deleted context's object must not leave the row
    /// behind without its object (found by the soak: a SIGKILL between the object's removal and
    /// the commit left "state object … is missing" for every later read of that context).
    #[test]
    fn a_delete_interrupted_after_the_object_is_removed_leaves_no_row() {
        let Some(catalog) = catalog() else { return };
        let checksum = "0123456789abcdef0123456789abcdef";
        let row = Row {
            id: None,
            doc: "d",
            seg: 0,
            text: "t",
            tokens: &[1, 2],
            embedding: &[1.0, 0.0],
            fingerprint: "f",
            state_file: "states/01/0123456789abcdef0123456789abcdef.safetensors",
            checksum,
            state_bytes: 10,
            created: 0,
            metadata: "{}",
        };
        let id = catalog.insert(std::slice::from_ref(&row), &mut || Ok(())).unwrap()[0].unwrap();
        let mut removed = false;
        // The object is removed, then the process "dies" (the removal reports a failure).
        let _ = catalog.delete(id, &mut |_| {
            removed = true;
            Err(Error::Input("the process died here".into()))
        });
        assert!(removed, "an unshared object is removed");
        assert_eq!(catalog.exist(&[id]).unwrap(), vec![false], "the row outlived its object");
        // The lock on the object was released: a new insert sharing it goes through.
        let again = Row { seg: 1, ..row };
        assert!(catalog.insert(&[again], &mut || Ok(())).unwrap()[0].is_some());
    }

    #[test]
    fn metadata_round_trips_and_filters_follow_the_rules() {
        let Some(catalog) = catalog() else { return };
        crate::catalog::checks::metadata_and_filters(&catalog);
    }

    #[test]
    fn random_filters_agree_with_the_rules() {
        let Some(catalog) = catalog() else { return };
        crate::catalog::checks::random_filters_agree_with_the_rules(&catalog);
    }

    #[test]
    fn delete_many_removes_rows_and_then_unshared_objects() {
        let Some(catalog) = catalog() else { return };
        crate::catalog::checks::delete_many_removes_rows_and_then_unshared_objects(&catalog);
    }

    /// A store made before the metadata column gets it when opened, with `{}` for every
    /// context, and stays usable.
    #[test]
    fn a_store_without_the_metadata_column_gets_it() {
        let Some(catalog) = catalog() else { return };
        let row = crate::catalog::checks::row("d", &[1.0, 0.0], r#"{"lang": "en"}"#);
        let id = catalog.insert(&[row], &mut || Ok(())).unwrap()[0].unwrap();
        catalog
            .run(Box::new(|c| {
                Box::pin(async move {
                    c.batch_execute(
                        "DROP INDEX picaso_contexts_metadata; ALTER TABLE picaso_contexts DROP COLUMN metadata",
                    )
                    .await?;
                    Ok(())
                })
            }))
            .unwrap();
        catalog.upgrade().unwrap();
        catalog.upgrade().unwrap();
        let indexed: bool = catalog
            .run(Box::new(|c| {
                Box::pin(async move {
                    Ok(c.query_one("SELECT to_regclass('picaso_contexts_metadata') IS NOT NULL", &[]).await?.get(0))
                })
            }))
            .unwrap();
        assert!(indexed, "the metadata index comes with the column");
        assert!(catalog.get_many(&[id]).unwrap()[0].metadata.is_empty());
        let en = crate::metadata::from_json(r#"{"lang": "en"}"#).unwrap();
        let en_filter = crate::filter::Filter::new(&en).unwrap();
        assert!(catalog.search(&[1.0, 0.0], 5, false, Scope::matching(&en_filter)).unwrap().is_empty());
        assert_eq!(catalog.set_metadata(&[id], r#"{"lang": "en"}"#).unwrap(), 1);
        assert_eq!(catalog.search(&[1.0, 0.0], 5, false, Scope::matching(&en_filter)).unwrap()[0].0, id);
    }

    /// Filters compare strings by code point whatever the database's collation: a database
    /// that orders by a language's rules ("Éire" < "Z" < "a") answers as a `C` one. Skipped,
    /// with a note, where the server has neither ICU nor an en_US locale.
    #[test]
    fn filters_order_strings_by_code_point_in_a_database_of_another_collation() {
        let Some(base) = catalog() else { return };
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
        let name = format!("picaso_icu_{}_{nanos}", std::process::id());
        let sql = |sql: String| {
            base.run(Box::new(move |c| {
                let sql = sql.clone();
                Box::pin(async move { Ok(c.batch_execute(&sql).await?) })
            }))
        };
        // ICU's root locale, else glibc's en_US (`localedef -i en_US -f UTF-8 en_US.UTF-8`; CI
        // makes it).
        let created = sql(format!(
            "CREATE DATABASE {name} LOCALE_PROVIDER icu ICU_LOCALE 'und' LOCALE 'C.UTF-8' TEMPLATE template0"
        ))
        .or_else(|_| sql(format!("CREATE DATABASE {name} LOCALE 'en_US.UTF-8' TEMPLATE template0")));
        if let Err(e) = created {
            eprintln!("note: no database with a language's collation ({e}); skipped");
            return;
        }
        let url = std::env::var("PICASO_TEST_POSTGRES").unwrap();
        let (head, query) = url.split_once('?').map_or((url.as_str(), ""), |(h, q)| (h, q));
        let at = head.rfind('/').expect("a database in the URL");
        let url = format!("{}/{name}{}{query}", &head[..at], if query.is_empty() { "" } else { "?" });
        let result = std::panic::catch_unwind(|| {
            let catalog = PostgresCatalog::connect(&url).unwrap();
            catalog.create(2, &[]).unwrap();
            let ordered: bool = catalog
                .run(Box::new(|c| Box::pin(async move { Ok(c.query_one("SELECT 'Éire' < 'Z'", &[]).await?.get(0)) })))
                .unwrap();
            assert!(ordered, "the database orders by a language's rules, not by code point");
            crate::catalog::checks::metadata_and_filters(&catalog);
            // Random filters too, in a store of their own in this database.
            let sep = if url.contains('?') { '&' } else { '?' };
            let random =
                PostgresCatalog::connect(&format!("{url}{sep}options=-csearch_path%3Drandom%2Cpublic")).unwrap();
            random.create(2, &[]).unwrap();
            crate::catalog::checks::random_filters_agree_with_the_rules(&random);
        });
        sql(format!("DROP DATABASE {name} WITH (FORCE)")).unwrap();
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }
}
