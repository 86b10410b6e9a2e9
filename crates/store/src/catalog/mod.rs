//! Where a store's metadata and vectors live: SQLite in the store folder, or PostgreSQL with
//! pgvector shared by several servers. Both hold the same rows and answer the same queries;
//! the [`crate::Store`] above them adds state objects, checks and the model binding.

mod columns;
mod postgres;
mod sqlite;

pub use postgres::PostgresCatalog;
pub use sqlite::SqliteCatalog;
pub(crate) use sqlite::CREATING_PREFIX;

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::filter::Filter;
use crate::location::CatalogUrl;
use crate::records::{ContextRecord, DocumentSummary};
use crate::scope::Scope;

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
    /// Metadata, as JSON text (an object).
    pub metadata: &'a str,
}

/// Totals over a catalog: (contexts, documents, tokens, state bytes). State bytes count each
/// state file once: contexts with the same state (the same text) share one content-addressed file.
pub type Totals = (u64, u64, u64, u64);

/// One state object's entry in a budgeted store's ledger ([`crate::budget`]): whether the
/// object is held, and what the policy weighs.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerRow {
    /// The object's checksum (its key).
    pub checksum: String,
    /// Its size in the store's codec.
    pub bytes: u64,
    /// The prefill work (floating-point operations) its state saves when held.
    pub work: f64,
    /// How often contexts with this state were retrieved.
    pub retrievals: u64,
    /// The store's access tick at its last retrieval (or admission).
    pub last_tick: u64,
    /// The policy's priority: the lowest held is evicted first.
    pub priority: f64,
    /// Whether its object is stored (and counted against the budget).
    pub held: bool,
}

/// The error of a budget operation on a catalog that keeps no ledger.
pub(crate) fn no_ledger(url: &str) -> Error {
    Error::Input(format!(
        "{url}: a state budget (--state-budget-mb) needs a folder store for now; PostgreSQL stores keep every state"
    ))
}

/// Removes the state objects of these checksums (called by a delete once their rows are gone).
pub type RemoveStates<'a> = dyn FnMut(&[String]) -> Result<()> + 'a;

/// The error for a store whose creation never finished: a catalog without its metadata, made by
/// an older picaso that wrote the tables and each metadata value in separate steps and was
/// killed in between. It holds no context (ingest writes only to a finished store).
pub(crate) fn unfinished(url: &CatalogUrl) -> Error {
    let remedy = match url {
        CatalogUrl::Sqlite(dir) => {
            format!("remove its database (`rm {}/store.sqlite*`) and run the ingest again", dir.display())
        }
        CatalogUrl::Postgres(_) => {
            "drop its tables (`DROP TABLE picaso_contexts, picaso_meta` in the schema the URL's \
             search_path names, or `DROP SCHEMA name CASCADE` for a schema of its own) and run the ingest again"
                .to_string()
        }
    };
    Error::Store {
        location: url.to_string(),
        message: format!(
            "this store was never finished: its creation was interrupted (a picaso creating it was killed) and its \
             metadata is missing; {remedy}"
        ),
    }
}

/// A metadata and vector backend.
pub trait Catalog: Send + Sync + std::fmt::Debug {
    /// Where it is (no credentials).
    fn url(&self) -> String;
    /// A metadata value.
    fn meta(&self, key: &str) -> Result<Option<String>>;
    /// Sets `key` unless it is set, atomically; returns the value stored afterwards (another
    /// writer's, if it was first).
    fn init_meta(&self, key: &str, value: &str) -> Result<String>;
    /// Sets metadata `key` to `value`, replacing any value.
    fn set_meta(&self, key: &str, value: &str) -> Result<()>;
    /// The ledger rows of `checksums`, in order (`None`: no row).
    fn ledger(&self, _checksums: &[String]) -> Result<Vec<Option<LedgerRow>>> {
        Err(no_ledger(&self.url()))
    }
    /// Writes ledger rows (each replacing its checksum's) and metadata values, in one
    /// transaction.
    fn put_ledger(&self, _rows: &[LedgerRow], _meta: &[(&str, String)]) -> Result<()> {
        Err(no_ledger(&self.url()))
    }
    /// Removes the ledger rows of `checksums`, or every row with `None`.
    fn forget_ledger(&self, _checksums: Option<&[String]>) -> Result<()> {
        Err(no_ledger(&self.url()))
    }
    /// Up to `limit` held rows, lowest priority first (equal priorities: the earlier tick).
    fn lowest_held(&self, _limit: usize) -> Result<Vec<LedgerRow>> {
        Err(no_ledger(&self.url()))
    }
    /// (bytes held, objects held, rows) over the ledger.
    fn ledger_totals(&self) -> Result<(u64, u64, u64)> {
        Err(no_ledger(&self.url()))
    }
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
    /// Deletes a context, then calls `remove_states(&[checksum])` if no other context shares
    /// its state, inside the lock that keeps a concurrent insert from reusing it meanwhile. The
    /// row goes first (committed): a crash or a failed removal leaves an orphan object, never a
    /// row without its object.
    fn delete(&self, id: i64, remove_states: &mut RemoveStates<'_>) -> Result<()>;
    /// Deletes the contexts `ids` that are here (one gone already was another writer's
    /// delete) with [`delete`](Self::delete)'s guarantees, many per transaction; returns those
    /// removed, ascending. `remove_states` gets the objects of a whole transaction at once (an
    /// object store removes up to a thousand per request).
    fn delete_many(&self, ids: &[i64], remove_states: &mut RemoveStates<'_>) -> Result<Vec<i64>>;
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
    /// best first (equal scores by lower id), among the contexts `scope` allows. `exact`
    /// forbids approximate indexes; a scoped search is always exact.
    fn search(&self, query: &[f32], k: usize, exact: bool, scope: Scope<'_>) -> Result<Vec<(i64, f32)>>;
    /// The `k` contexts whose text best matches `query` (lexical retrieval), best first, equal
    /// scores by lower id, among the contexts `scope` allows; only contexts sharing a term with
    /// the query. SQLite: BM25 ([`picaso_embed::Bm25Index`]); PostgreSQL: its full-text search
    /// (`ts_rank` over an `english` text-search index).
    fn search_text(&self, query: &str, k: usize, scope: Scope<'_>) -> Result<Vec<(i64, f32)>>;
    /// Sets the metadata (JSON text of an object) of those of `ids` whose metadata is not
    /// equal to it, in one transaction; returns how many changed (a context gone is skipped).
    fn set_metadata(&self, ids: &[i64], metadata: &str) -> Result<u64>;
    /// The ids of the contexts whose metadata passes `filter`, ascending.
    fn matching(&self, filter: &Filter) -> Result<Vec<i64>>;
    /// A context's embedding.
    fn embedding(&self, id: i64) -> Result<Vec<f32>>;
    /// Number of contexts.
    fn count(&self) -> Result<usize>;
    /// All ids, ascending.
    fn ids(&self) -> Result<Vec<i64>>;
    /// Totals.
    fn totals(&self) -> Result<Totals>;
    /// Up to `limit` documents named after `after` (from the first when `None`), in name
    /// order.
    fn documents(&self, after: Option<&str>, limit: usize) -> Result<Vec<DocumentSummary>>;
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

/// Checks both catalogs run against: metadata round trip, filters and updates.
#[cfg(test)]
pub(crate) mod checks {
    use super::*;
    use crate::filter::Filter;
    use crate::metadata::{to_json, Metadata};
    use serde_json::json;

    /// Segment 0 of `doc`, a one-token context with this embedding and metadata (JSON text).
    pub(crate) fn row<'a>(doc: &'a str, embedding: &'a [f32], metadata: &'a str) -> Row<'a> {
        Row {
            id: None,
            doc,
            seg: 0,
            text: "t",
            tokens: &[1],
            embedding,
            fingerprint: "f",
            state_file: "states/01/0123456789abcdef0123456789abcdef.safetensors",
            checksum: "0123456789abcdef0123456789abcdef",
            state_bytes: 10,
            created: 0,
            metadata,
        }
    }

    fn obj(v: serde_json::Value) -> Metadata {
        v.as_object().unwrap().clone()
    }

    /// Deletes many contexts at once from an empty 2-dimensional `catalog` (more than one
    /// chunk of PostgreSQL's, contexts sharing state objects across chunks, ids missing or
    /// repeated): the rows go, and each object is removed once, when its last context goes.
    pub(crate) fn delete_many_removes_rows_and_then_unshared_objects(catalog: &dyn Catalog) {
        const N: usize = 600;
        // Contexts 2k and 2k + 1 share object k.
        let sums: Vec<String> = (0..N).map(|i| format!("{:032x}", i / 2)).collect();
        let files: Vec<String> = sums.iter().map(|sum| format!("states/{}/{sum}.safetensors", &sum[..2])).collect();
        let docs: Vec<String> = (0..N).map(|i| format!("d{i}")).collect();
        let rows: Vec<Row<'_>> = (0..N)
            .map(|i| Row { checksum: &sums[i], state_file: &files[i], ..row(&docs[i], &[0.6, 0.8], "{}") })
            .collect();
        let ids: Vec<i64> = catalog.insert(&rows, &mut || Ok(())).unwrap().into_iter().map(Option::unwrap).collect();
        // The contexts removed, and the objects removed (sorted).
        let delete = |wanted: &[i64]| {
            let mut objects = Vec::new();
            let removed = catalog
                .delete_many(wanted, &mut |sums| {
                    objects.extend_from_slice(sums);
                    Ok(())
                })
                .unwrap();
            objects.sort();
            (removed, objects)
        };
        // Every even context, a missing id and a repeated one: no object loses its last context.
        let mut even: Vec<i64> = ids.iter().step_by(2).copied().collect();
        let mut wanted = even.clone();
        wanted.extend([i64::MAX, even[7]]);
        wanted.reverse();
        assert_eq!(delete(&wanted), (even.clone(), vec![]), "no object lost its last context");
        // The odd contexts of the first half, in reverse: their objects go, once each.
        let odd: Vec<i64> = ids[..N / 2].iter().skip(1).step_by(2).copied().collect();
        let gone: Vec<String> = (0..N / 4).map(|k| format!("{k:032x}")).collect();
        assert_eq!(delete(&odd.iter().rev().copied().collect::<Vec<_>>()), (odd.clone(), gone));
        assert_eq!(delete(&[]), (vec![], vec![]));
        assert_eq!(delete(&odd), (vec![], vec![]), "deleted already");
        even.extend(&odd);
        let here = catalog.exist(&ids).unwrap();
        for (id, here) in ids.iter().zip(here) {
            assert_eq!(here, !even.contains(id), "context {id}");
        }
        assert_eq!(catalog.totals().unwrap().0, (N / 4) as u64);
    }

    /// Fills an empty 2-dimensional `catalog` with contexts of random metadata (nested objects
    /// and lists of a few keys and values, which filters hit often) and checks random filters
    /// (every operator, keys within objects, `$elemMatch`, `$not`, `$or`/`$and`/`$nor`, nested)
    /// against [`Filter::matches`]: the ids that match, and a filtered search's ranking. Cases:
    /// `PROPTEST_CASES` (500 unless set); a failure shows the smallest filter found.
    pub(crate) fn random_filters_agree_with_the_rules(catalog: &dyn Catalog) {
        use proptest::strategy::{Strategy, ValueTree};
        use proptest::test_runner::{Config, TestCaseError, TestRunner};
        let mut fill = TestRunner::deterministic();
        let metadata: Vec<Metadata> =
            (0..120).map(|_| random::metadata().new_tree(&mut fill).unwrap().current()).collect();
        let json: Vec<String> = metadata.iter().map(to_json).collect();
        let docs: Vec<String> = (0..metadata.len()).map(|i| format!("d{i}")).collect();
        let embeddings: Vec<[f32; 2]> =
            (0..metadata.len()).map(|i| [(i as f32 * 0.4).cos(), (i as f32 * 0.4).sin()]).collect();
        let rows: Vec<Row<'_>> = (0..metadata.len()).map(|i| row(&docs[i], &embeddings[i], &json[i])).collect();
        let ids: Vec<i64> = catalog.insert(&rows, &mut || Ok(())).unwrap().into_iter().map(Option::unwrap).collect();
        let metadata_of = |id: i64| &metadata[ids.iter().position(|&i| i == id).unwrap()];
        let q = [1.0f32, 0.0];
        let everything = catalog.search(&q, ids.len(), true, Scope::all()).unwrap();
        assert_eq!(everything.len(), ids.len());

        let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
        let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
        let (checked, matched) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
        runner
            .run(&random::filter(2), |json| {
                let f = match Filter::new(json.as_object().unwrap()) {
                    Ok(f) => f,
                    // Nesting can pass the cap on conditions: not a case.
                    Err(e) if e.to_string().contains("conditions") => return Ok(()),
                    Err(e) => return Err(TestCaseError::fail(format!("{json}: not a valid filter: {e}"))),
                };
                let want: Vec<i64> = everything.iter().map(|h| h.0).filter(|&id| f.matches(metadata_of(id))).collect();
                let mut want_ids = want.clone();
                want_ids.sort_unstable();
                let got = catalog.matching(&f).map_err(|e| TestCaseError::fail(format!("{json}: {e}")))?;
                proptest::prop_assert_eq!(&got, &want_ids, "matching ids of {}", json);
                let top: Vec<i64> = (catalog.search(&q, 5, false, Scope::matching(&f)))
                    .map_err(|e| TestCaseError::fail(format!("{json}: {e}")))?
                    .iter()
                    .map(|h| h.0)
                    .collect();
                proptest::prop_assert_eq!(&top[..], &want[..want.len().min(5)], "filtered search of {}", json);
                checked.set(checked.get() + 1);
                matched.set(matched.get() + usize::from(!want.is_empty() && want.len() < ids.len()));
                Ok(())
            })
            .unwrap();
        // The cases must say something: most filters valid, and many passing some contexts, not all.
        let (checked, matched) = (checked.get(), matched.get());
        assert!(checked * 10 >= cases as usize * 9, "{checked} of {cases} random filters were valid");
        assert!(matched * 3 >= checked, "{matched} of {checked} random filters told contexts apart");
        eprintln!("{checked} random filters; {matched} passed some contexts, not all");
    }

    /// Strategies for random metadata and filters over a few keys and values.
    mod random {
        use proptest::prelude::*;
        use proptest::sample::select;
        use proptest::strategy::{BoxedStrategy, Union};
        use serde_json::{json, Value};

        use crate::metadata::Metadata;

        fn key() -> BoxedStrategy<String> {
            select(&["a", "b", "0"][..]).prop_map(String::from).boxed()
        }

        /// Numbers equal by value in different forms, and integers beyond f64's exact range.
        fn number() -> BoxedStrategy<Value> {
            select(vec![
                json!(0),
                json!(1),
                json!(1.0),
                json!(-2),
                json!(2.5),
                json!(9_007_199_254_740_993u64),
                json!(9_007_199_254_740_992.0),
                json!(1e300),
            ])
            .boxed()
        }

        /// Strings whose code point order differs from a language's, and LIKE's wildcards.
        fn string() -> BoxedStrategy<Value> {
            select(&["", "x", "xy", "X", "é", "1", "x y", "%", "_"][..]).prop_map(|s| json!(s)).boxed()
        }

        fn scalar() -> BoxedStrategy<Value> {
            // Common values, so that filters and metadata meet.
            let common = select(vec![json!(1), json!("x")]);
            prop_oneof![1 => Just(Value::Null), 1 => any::<bool>().prop_map(Value::Bool), 4 => common, 2 => number(), 2 => string()]
                .boxed()
        }

        /// One entry usually, two at times (conjunctions that pass nothing say little).
        fn few<T: std::fmt::Debug + 'static>(entry: BoxedStrategy<T>) -> BoxedStrategy<Vec<T>> {
            select(&[1, 1, 1, 2][..]).prop_flat_map(move |n| prop::collection::vec(entry.clone(), n)).boxed()
        }

        fn object(entries: Vec<(String, Value)>) -> Value {
            Value::Object(entries.into_iter().collect())
        }

        /// A metadata value: a scalar, or a list or object `depth` levels deep at most.
        fn value(depth: u32) -> BoxedStrategy<Value> {
            if depth == 0 {
                return scalar();
            }
            prop_oneof![
                3 => scalar(),
                1 => prop::collection::vec(value(depth - 1), 0..4).prop_map(Value::Array),
                1 => prop::collection::vec((key(), value(depth - 1)), 0..3).prop_map(object),
            ]
            .boxed()
        }

        pub(super) fn metadata() -> BoxedStrategy<Metadata> {
            prop::collection::vec((key(), value(3)), 0..4).prop_map(|e| e.into_iter().collect()).boxed()
        }

        /// A filter: keys with what they must pass and, `depth` levels deep, `$or`, `$and` and
        /// `$nor` of filters.
        pub(super) fn filter(depth: u32) -> BoxedStrategy<Value> {
            let key_entry = (key(), given(2, false)).boxed();
            let entry = if depth == 0 {
                key_entry
            } else {
                let logical = select(&["$or", "$and", "$nor"][..]).prop_map(String::from);
                let filters = prop::collection::vec(filter(depth - 1), 1..3).prop_map(Value::Array);
                prop_oneof![3 => key_entry, 1 => (logical, filters)].boxed()
            };
            few(entry).prop_map(object).boxed()
        }

        /// What a filter gives for a value: a scalar to equal, or operators and keys within,
        /// nesting `levels` deeper at most (`within_not`: in a `$not`, which holds no other).
        fn given(levels: u32, within_not: bool) -> BoxedStrategy<Value> {
            prop_oneof![1 => scalar(), 3 => operators(levels, within_not)].boxed()
        }

        fn operators(levels: u32, within_not: bool) -> BoxedStrategy<Value> {
            let op = |names: &'static [&'static str]| select(names).prop_map(String::from);
            let named = |name: &'static str| Just(name.to_string());
            let mut choices: Vec<(u32, BoxedStrategy<(String, Value)>)> = vec![
                (2, (op(&["$eq", "$ne"]), scalar()).boxed()),
                (2, (op(&["$gt", "$gte", "$lt", "$lte"]), prop_oneof![number(), string()]).boxed()),
                (1, (op(&["$in", "$nin"]), prop::collection::vec(scalar(), 0..4).prop_map(Value::Array)).boxed()),
                (1, (named("$exists"), any::<bool>().prop_map(Value::Bool)).boxed()),
                (1, (named("$contains"), scalar()).boxed()),
                (1, (named("$prefix"), select(&["", "x", "X", "é", "1"][..]).prop_map(|s| json!(s))).boxed()),
                (
                    1,
                    (
                        named("$regex"),
                        select(&["^x", "y$", "(?i)^x", "^$", "[0-9]", "é", "^.$", "x|^_"][..]).prop_map(|s| json!(s)),
                    )
                        .boxed(),
                ),
            ];
            if levels > 0 {
                choices.push((1, (named("$elemMatch"), operators(levels - 1, false)).boxed()));
                choices.push((2, (key(), given(levels - 1, within_not)).boxed()));
                if !within_not {
                    choices.push((1, (named("$not"), operators(levels - 1, true)).boxed()));
                }
            }
            few(Union::new_weighted(choices).boxed()).prop_map(object).boxed()
        }
    }

    /// Fills an empty 2-dimensional `catalog` with contexts of varied metadata and checks that
    /// every filter (alone and with documents) returns the exhaustive ranking of the contexts
    /// [`Filter::matches`] accepts, that records carry their metadata, and that `set_metadata` changes
    /// only what differs.
    pub(crate) fn metadata_and_filters(catalog: &dyn Catalog) {
        let metadata = [
            json!({"lang": "en", "year": 2024, "draft": false, "url": "https://a.example", "date": "2024-03-01",
                   "title": "Zeta", "author": {"name": "Ann", "born": 1890, "home": {"city": "Oslo"}},
                   "refs": [{"id": 1, "by": {"name": "Ann"}}, {"id": 2.0, "by": "Bo"}]}),
            json!({"lang": "fr", "year": 2023.5, "date": "2023-12-31", "tags": ["x", 2024, ["y"]], "title": "Éire",
                   "author": {"name": "Bo", "born": 1950.5, "tags": ["x", 2]}, "refs": [{"id": 2, "0": "z"}, [{"id": 1}], 7]}),
            json!({"lang": "en", "year": "2024", "tags": ["x"], "note": null, "author": [{"name": "Ann"}, "x"]}),
            json!({}),
            json!({"lang": "en", "year": 2024.0, "n": -7, "nested": {"lang": "fr"}, "a.b": 1, "tags": "x"}),
            json!({"lang": "en ", "big": 9_007_199_254_740_993u64, "draft": true, "say \"hi\"": "x", "$": "y",
                   "quoted \"tags\"": ["a", "b"], "author": "Ann", "nested": {"0": "x", "k\"q": {"deep": true}},
                   "refs": [["q"]]}),
        ]
        .map(obj);
        let json: Vec<String> = metadata.iter().map(to_json).collect();
        let embeddings: Vec<[f32; 2]> =
            (0..metadata.len()).map(|i| [(i as f32 * 0.4).cos(), (i as f32 * 0.4).sin()]).collect();
        let docs = ["a", "b", "c", "d", "e", "f"];
        let rows: Vec<Row<'_>> = (0..metadata.len()).map(|i| row(docs[i], &embeddings[i], &json[i])).collect();
        let ids: Vec<i64> = catalog.insert(&rows, &mut || Ok(())).unwrap().into_iter().map(Option::unwrap).collect();
        let records = catalog.get_many(&ids).unwrap();
        for (r, m) in records.iter().zip(&metadata) {
            assert_eq!(&r.metadata, m, "context {} reads back its metadata", r.id);
        }
        let metadata_of = |id: i64| &metadata[ids.iter().position(|&i| i == id).unwrap()];
        let q = [1.0f32, 0.0];
        let everything = catalog.search(&q, 100, true, Scope::all()).unwrap();
        let filters = [
            (json!({"lang": "en"}), 3),
            (json!({"year": 2024}), 2),
            (json!({"year": 2024.0}), 2),
            (json!({"year": "2024"}), 1),
            (json!({"year": 2023.5}), 1),
            (json!({"draft": false}), 1),
            (json!({"draft": true}), 1),
            (json!({"note": null}), 1),
            (json!({"lang": "en", "year": 2024}), 2),
            (json!({"n": -7.0}), 1),
            (json!({"big": 9_007_199_254_740_993u64}), 1),
            (json!({"a.b": 1}), 1),
            (json!({"say \"hi\"": "x"}), 1),
            (json!({"$": "y", "draft": true}), 1),
            (json!({"lang": "fr"}), 1),
            (json!({"missing": null}), 0),
            (json!({"lang": "EN"}), 0),
            (json!({"tags": "x"}), 1),
            (json!({"url": "https://a.example", "lang": "fr"}), 0),
            // Operators.
            (json!({"year": {"$gte": 2024}}), 2),
            (json!({"year": {"$gt": 2023}}), 3),
            (json!({"year": {"$lt": 2024}}), 1),
            (json!({"year": {"$gte": 2023.5, "$lte": 2023.5}}), 1),
            (json!({"year": {"$gte": "2000"}}), 1),
            (json!({"date": {"$gte": "2024-01-01"}}), 1),
            (json!({"date": {"$lt": "2024"}}), 1),
            (json!({"big": {"$gt": 9_007_199_254_740_992u64}}), 1),
            (json!({"big": {"$gt": 9_007_199_254_740_992.0}}), 1),
            (json!({"big": {"$lte": 9_007_199_254_740_992.0}}), 0),
            (json!({"n": {"$lt": -6.5}}), 1),
            (json!({"lang": {"$in": ["fr", "en "]}}), 2),
            (json!({"lang": {"$in": []}}), 0),
            (json!({"lang": {"$nin": ["en"]}}), 3),
            (json!({"lang": {"$ne": "en"}}), 3),
            (json!({"year": {"$ne": 2024}}), 4),
            (json!({"year": {"$nin": []}}), 6),
            (json!({"note": {"$exists": true}}), 1),
            (json!({"draft": {"$exists": false}}), 4),
            (json!({"tags": {"$contains": "x"}}), 2),
            (json!({"tags": {"$contains": 2024.0}}), 1),
            (json!({"tags": {"$contains": "y"}}), 0),
            (json!({"quoted \"tags\"": {"$contains": "b"}}), 1),
            (json!({"quoted \"tags\"": {"$ne": "a"}}), 6),
            (json!({"say \"hi\"": {"$in": ["x", "z"]}}), 1),
            (json!({"say \"hi\"": {"$gte": "x", "$exists": true}}), 1),
            // By code point: "en " < "en!", "Éire" > "Z" and "Zeta" < "a" (unlike a locale's order).
            (json!({"lang": {"$gte": "en", "$lt": "en!"}}), 4),
            (json!({"title": {"$gt": "Z"}}), 2),
            (json!({"title": {"$lt": "a"}}), 1),
            (json!({"lang": "en", "year": {"$in": [2024, "2024"]}, "tags": {"$nin": ["x"]}}), 2),
            // Prefixes of strings only, by code point: "en " starts with "en", "2024" (a number) does not.
            (json!({"lang": {"$prefix": "en"}}), 4),
            (json!({"lang": {"$prefix": "en "}}), 1),
            (json!({"year": {"$prefix": "20"}}), 1),
            (json!({"url": {"$prefix": "https://"}, "lang": "en"}), 1),
            (json!({"title": {"$prefix": "É"}}), 1),
            (json!({"title": {"$prefix": "E"}}), 0),
            (json!({"tags": {"$prefix": "x"}}), 1),
            (json!({"date": {"$prefix": ""}}), 2),
            (json!({"say \"hi\"": {"$prefix": "x"}}), 1),
            (json!({"$or": [{"url": {"$prefix": "https://a."}}, {"title": {"$prefix": "Éi"}}]}), 2),
            (json!({"lang": {"$prefix": "%"}}), 0),
            (json!({"$": {"$prefix": "_"}}), 0),
            // $or and $and, nested.
            (json!({"$or": [{"lang": "fr"}, {"draft": true}]}), 2),
            (json!({"$or": [{"year": {"$gte": 2024}}, {"tags": {"$contains": "x"}}]}), 4),
            (json!({"lang": "en", "$or": [{"note": {"$exists": true}}, {"n": {"$lt": 0}}]}), 2),
            (
                json!({"$and": [{"$or": [{"lang": "en"}, {"lang": "fr"}]}, {"$or": [{"year": 2024}, {"year": {"$lt": 2024}}]}]}),
                3,
            ),
            (json!({"$or": [{"missing": 1}, {"$and": [{"lang": {"$ne": "en"}}, {"big": {"$exists": true}}]}]}), 1),
            (json!({"$or": [{"say \"hi\"": "x"}, {"a.b": 1}]}), 2),
            // $not (a missing key passes) and $nor.
            (json!({"year": {"$not": {"$gte": 2024}}}), 4),
            (json!({"year": {"$not": {"$gte": 2023, "$lt": 2024}}}), 5),
            (json!({"lang": {"$not": {"$prefix": "en"}}}), 2),
            (json!({"tags": {"$not": {"$contains": "x"}}, "lang": {"$exists": true}}), 3),
            (json!({"$nor": [{"lang": "en"}, {"draft": true}]}), 2),
            (json!({"$nor": [{"$nor": [{"lang": "fr"}]}]}), 1),
            (json!({"$or": [{"lang": {"$not": {"$in": ["en", "en "]}}}, {"big": {"$exists": true}}]}), 3),
            (json!({"$nor": [{"year": {"$gte": 0}}], "tags": {"$not": {"$exists": false}}}), 1),
            // Keys within objects: through objects only (not the list at context 2's "author").
            (json!({"author": {"name": "Ann"}}), 1),
            (json!({"author": {"name": "Ann", "born": 1890.0, "home": {"city": "Oslo"}}}), 1),
            (json!({"author": {"born": {"$gte": 1900}}}), 1),
            (json!({"author": {"born": {"$lt": 2000}}}), 2),
            (json!({"author": {"name": {"$ne": "Ann"}}}), 5),
            (json!({"author": {"name": {"$exists": true}}}), 2),
            (json!({"author": {"home": {"$exists": false}}}), 5),
            (json!({"author": {"0": {"$exists": true}}}), 0),
            (json!({"author": {"0": {"name": {"$prefix": "A"}}}}), 0),
            (json!({"author": {"0": {"name": {"$gte": "A"}}}}), 0),
            (json!({"author": {"0": {"name": "Ann"}}}), 0),
            (json!({"author": {"home": {"city": {"$prefix": "Os"}}}}), 1),
            (json!({"author": {"tags": {"$contains": 2.0}}}), 1),
            (json!({"author": {"name": {"$in": ["Bo", "Ann"]}}}), 2),
            (json!({"author": {"name": {"$nin": ["Bo"]}}}), 5),
            (json!({"author": {"$not": {"name": "Ann"}}}), 5),
            (json!({"$or": [{"author": {"name": "Bo"}}, {"nested": {"lang": "fr"}}]}), 2),
            (json!({"nested": {"k\"q": {"deep": true}}}), 1),
            (json!({"nested": {"0": "x"}}), 1),
            (json!({"nested": {"0": {"$exists": true}, "k\"q": {"deep": {"$ne": false}}}}), 1),
            // $elemMatch: one element passes every test; an element is entered by keys only if
            // an object, and is equal only if a scalar.
            (json!({"author": {"$elemMatch": {"name": "Ann"}}}), 1),
            (json!({"author": {"$elemMatch": {"$eq": "x"}}}), 1),
            (json!({"author": {"$elemMatch": {"$prefix": "A"}}}), 0),
            (json!({"author": {"$elemMatch": {"$not": {"name": "Ann"}}}}), 1),
            (json!({"tags": {"$elemMatch": {"$gte": 2000}}}), 1),
            (json!({"tags": {"$elemMatch": {"$contains": "y"}}}), 1),
            (json!({"tags": {"$elemMatch": {"$eq": "y"}}}), 0),
            (json!({"tags": {"$elemMatch": {"$in": ["x", 1]}}}), 2),
            (json!({"tags": {"$elemMatch": {"$ne": "x"}}}), 1),
            (json!({"tags": {"$elemMatch": {"$nin": ["x"]}}}), 1),
            (json!({"tags": {"$not": {"$elemMatch": {"$eq": "x"}}}}), 4),
            (json!({"refs": {"$elemMatch": {"id": 2, "by": "Bo"}}}), 1),
            (json!({"refs": {"$elemMatch": {"id": 1, "by": "Bo"}}}), 0),
            (json!({"refs": {"$elemMatch": {"by": {"name": "Ann"}}}}), 1),
            (json!({"refs": {"$elemMatch": {"by": {"name": {"$ne": "Ann"}}}}}), 3),
            (json!({"refs": {"$elemMatch": {"0": {"$exists": true}}}}), 1),
            (json!({"refs": {"$elemMatch": {"0": {"$gte": "a"}}}}), 1),
            (json!({"refs": {"$elemMatch": {"0": "q"}}}), 0),
            (json!({"refs": {"$elemMatch": {"id": {"$exists": false}}}}), 2),
            (json!({"refs": {"$elemMatch": {"id": {"$gt": 1.5}}}}), 2),
            (json!({"refs": {"$elemMatch": {"id": {"$nin": [1, 2]}}}}), 2),
            (json!({"refs": {"$elemMatch": {"$gt": 5}}}), 1),
            (json!({"refs": {"$elemMatch": {"$elemMatch": {"id": 1}}}}), 1),
            (json!({"refs": {"$elemMatch": {"$elemMatch": {"$contains": "q"}}}}), 0),
            (json!({"refs": {"$elemMatch": {"$contains": "q"}}}), 1),
            (
                json!({"$or": [{"refs": {"$elemMatch": {"by": {"$prefix": "B"}}}}, {"author": {"$elemMatch": {"name": "Ann"}}}]}),
                2,
            ),
            (json!({"refs": {"$elemMatch": {"by": {"name": "Ann"}, "id": 1.0}}}), 1),
            (json!({"refs": {"$elemMatch": {"$eq": 7}}}), 1),
            (json!({"refs": {"$elemMatch": {"id": 2, "$not": {"by": "Bo"}}}}), 1),
            (json!({"refs": {"$elemMatch": {"by": {"$eq": "Bo", "name": "Ann"}}}}), 0),
            // $regex: strings only, Rust's syntax on both backends.
            (json!({"title": {"$regex": "(?i)^é"}}), 1),
            (json!({"lang": {"$regex": "^en$"}}), 3),
            (json!({"lang": {"$regex": "\\s$"}}), 1),
            (json!({"year": {"$regex": "^20"}}), 1),
            (json!({"url": {"$regex": "^https://[a-z]+\\.example$"}}), 1),
            (json!({"author": {"name": {"$regex": "^[AB]"}}}), 2),
            (json!({"refs": {"$elemMatch": {"by": {"$regex": "o$"}}}}), 1),
            (json!({"tags": {"$elemMatch": {"$regex": "^x"}}}), 2),
            (json!({"say \"hi\"": {"$not": {"$regex": "x"}}}), 5),
            (json!({"$or": [{"title": {"$regex": "^Z"}}, {"lang": {"$regex": "^f"}}]}), 2),
        ];
        for (f, n) in filters {
            let f = Filter::new(&obj(f)).unwrap();
            let want: Vec<(i64, f32)> =
                everything.iter().filter(|(id, _)| f.matches(metadata_of(*id))).copied().collect();
            assert_eq!(want.len(), n, "{f:?}: the rules' own count");
            let mut ids_of_want: Vec<i64> = want.iter().map(|h| h.0).collect();
            ids_of_want.sort_unstable();
            assert_eq!(catalog.matching(&f).unwrap(), ids_of_want, "{f:?}: the matching ids");
            for k in [1, 3, 10] {
                let got = catalog.search(&q, k, false, Scope::matching(&f)).unwrap();
                let ids_of = |h: &[(i64, f32)]| h.iter().map(|x| x.0).collect::<Vec<_>>();
                assert_eq!(ids_of(&got), ids_of(&want[..k.min(want.len())]), "{f:?}, k {k}");
            }
        }
        let within = vec!["a".to_string(), "c".to_string(), "b".to_string()];
        let en = Filter::new(&obj(json!({"lang": "en"}))).unwrap();
        let both = catalog.search(&q, 10, false, Scope { documents: Some(&within), filter: Some(&en) }).unwrap();
        assert_eq!(both.iter().map(|h| h.0).collect::<Vec<_>>(), [ids[0], ids[2]], "documents and filter both hold");

        // Updates change what differs, keep ids, and filters follow.
        let new = to_json(&obj(json!({"lang": "de"})));
        assert_eq!(catalog.set_metadata(&[ids[0], ids[1], 999_999], &new).unwrap(), 2);
        assert_eq!(catalog.set_metadata(&[ids[0], ids[1]], &new).unwrap(), 0, "nothing left to change");
        let de = obj(json!({"lang": "de"}));
        let got: Vec<i64> =
            (catalog.search(&q, 10, false, Scope::matching(&Filter::new(&de).unwrap())).unwrap().iter())
                .map(|h| h.0)
                .collect();
        assert_eq!(got, [ids[0], ids[1]]);
        assert_eq!(catalog.get_many(&[ids[1]]).unwrap()[0].metadata, de);

        // Contexts added and removed after filters ran are seen by the next filter.
        let de = Filter::new(&de).unwrap();
        let (g, g_json) = ([0.0f32, 1.0], to_json(&obj(json!({"lang": "de", "year": 1999}))));
        let added = catalog.insert(&[row("g", &g, &g_json)], &mut || Ok(())).unwrap()[0].unwrap();
        assert_eq!(catalog.matching(&de).unwrap(), [ids[0], ids[1], added]);
        let old = Filter::new(&obj(json!({"year": {"$lt": 2000}}))).unwrap();
        assert_eq!(catalog.matching(&old).unwrap(), [added]);
        catalog.delete(ids[1], &mut |_| Ok(())).unwrap();
        assert_eq!(catalog.matching(&de).unwrap(), [ids[0], added]);
        let not_de = Filter::new(&obj(json!({"lang": {"$ne": "de"}}))).unwrap();
        assert_eq!(catalog.matching(&not_de).unwrap(), ids[2..]);
        let top: Vec<i64> =
            catalog.search(&[0.0, 1.0], 1, false, Scope::matching(&de)).unwrap().iter().map(|h| h.0).collect();
        assert_eq!(top, [added]);

        // A document is listed with its first segment's metadata, whatever the order added.
        let listed = catalog.documents(None, 100).unwrap();
        let of = |doc: &str| listed.iter().find(|d| d.id == doc).map(|d| d.metadata.clone());
        assert_eq!(of("a"), Some(obj(json!({"lang": "de"}))));
        assert_eq!(of("f"), Some(metadata[5].clone()));
        let (second, first) = (to_json(&obj(json!({"part": 2}))), to_json(&obj(json!({"part": 1}))));
        catalog.insert(&[Row { seg: 1, ..row("z", &g, &second) }], &mut || Ok(())).unwrap();
        catalog.insert(&[row("z", &g, &first)], &mut || Ok(())).unwrap();
        let z = catalog.documents(Some("y"), 10).unwrap();
        assert_eq!((z[0].id.as_str(), z[0].contexts, &z[0].metadata), ("z", 2, &obj(json!({"part": 1}))));
    }
}
