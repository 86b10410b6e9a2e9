//! Structured fuzzing of the store's catalog rows: a folder store whose SQLite rows were edited
//! by hand or damaged — any column of a context set to a value of any type, metadata changed or
//! removed, rows deleted behind the store's back, bytes of the database file overwritten. Every
//! store operation then answers or fails with an error; none panics. A state read through a
//! damaged row is refused, never silently wrong.
//!
//! More cases: `PROPTEST_CASES=5000 cargo test --release -p picaso-store --test fuzz_catalog`
//! (or `scripts/fuzz.sh catalog SECONDS`).

use std::path::Path;

use picaso_model::{Mamba2Config, Mamba2Weights, Model};
use picaso_store::{NewContext, Store, StoreInfo};
use proptest::prelude::*;
use rusqlite::types::Value as Sql;

const DIM: usize = 4;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

fn model() -> &'static Model {
    static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let c = Mamba2Config::tiny(2, 4);
        Model::from_weights(c.clone(), Mamba2Weights::random(&c, 3), None)
    })
}

/// A folder store with four contexts (two documents), made once and copied for each case.
fn pristine() -> &'static tempfile::TempDir {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let m = model();
        let info = StoreInfo { fingerprint: m.fingerprint().to_string(), dim: DIM, state_dtype: Default::default() };
        let store = Store::open_or_create(tmp.path().join("db").as_path(), &info).unwrap();
        let items: Vec<NewContext> = (0..4u32)
            .map(|i| {
                let tokens: Vec<u32> = (0..3 + i).map(|t| (t * 7 + i) % 50).collect();
                let mut e = [0.1f32; DIM];
                e[i as usize % DIM] = 1.0;
                let norm = e.iter().map(|v| v * v).sum::<f32>().sqrt();
                NewContext {
                    doc: format!("doc{}", i / 2),
                    seg: i % 2,
                    text: format!("text {i}"),
                    state: m.prefill(&tokens, &m.zero_state()).unwrap(),
                    tokens,
                    embedding: e.iter().map(|v| v / norm).collect(),
                    metadata: Default::default(),
                }
            })
            .collect();
        store.insert(&items).unwrap();
        tmp
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

const COLUMNS: &[&str] = &[
    "id",
    "doc",
    "seg",
    "text",
    "tokens",
    "n_tokens",
    "embedding",
    "fingerprint",
    "state_file",
    "checksum",
    "state_bytes",
    "created",
];

fn sql_value() -> impl Strategy<Value = Sql> {
    prop_oneof![
        Just(Sql::Null),
        prop::sample::select(vec![0i64, 1, -1, 2, 4, 5, i64::MAX, i64::MIN, u32::MAX as i64 + 1])
            .prop_map(Sql::Integer),
        any::<i64>().prop_map(Sql::Integer),
        prop::sample::select(vec![0.0f64, -1.5, 1e300, f64::NAN, f64::INFINITY]).prop_map(Sql::Real),
        prop::sample::select(vec![
            "",
            "a",
            "../../../etc/passwd",
            "states/../../x",
            "ffffffffffffffffffffffffffffffff",
            "0123456789abcdef0123456789abcdef",
            "ÿé",
            "doc0",
        ])
        .prop_map(|s| Sql::Text(s.to_string())),
        "[0-9a-f]{30,34}".prop_map(Sql::Text),
        prop::collection::vec(any::<u8>(), 0..40).prop_map(Sql::Blob),
    ]
}

#[derive(Debug, Clone)]
enum Edit {
    /// `UPDATE contexts SET column = value` on one row (by position).
    Column { row: usize, column: usize, value: Sql },
    /// Set a metadata key (by position among the keys present, or a new one) to text.
    Meta { key: usize, value: String },
    /// Remove a metadata key.
    DropMeta { key: usize },
    /// Delete a row without removing its state.
    DropRow { row: usize },
    /// Overwrite one byte of store.sqlite (applied after the SQL edits).
    Byte { at: usize, byte: u8 },
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        8 => (0usize..4, 0..COLUMNS.len(), sql_value()).prop_map(|(row, column, value)| Edit::Column { row, column, value }),
        2 => (0usize..8, prop_oneof![Just("0".to_string()), Just("-3".to_string()), Just("bf16".to_string()),
                "[a-z0-9:/._-]{0,12}"]).prop_map(|(key, value)| Edit::Meta { key, value }),
        1 => (0usize..8).prop_map(|key| Edit::DropMeta { key }),
        1 => (0usize..4).prop_map(|row| Edit::DropRow { row }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Byte { at, byte }),
    ]
}

fn apply(db: &Path, edits: &[Edit]) {
    let file = db.join("store.sqlite");
    {
        let conn = rusqlite::Connection::open(&file).unwrap();
        let ids: Vec<i64> = conn
            .prepare("SELECT id FROM contexts ORDER BY id")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let keys: Vec<String> = conn
            .prepare("SELECT key FROM meta ORDER BY key")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        for e in edits {
            // Edits the schema refuses (NOT NULL, UNIQUE) are simply not made.
            let _ = match e {
                Edit::Column { row, column, value } => conn.execute(
                    &format!("UPDATE contexts SET {} = ?1 WHERE id = ?2", COLUMNS[*column]),
                    rusqlite::params![value, ids.get(*row).copied().unwrap_or(-1)],
                ),
                Edit::Meta { key, value } => {
                    let key = keys.get(*key).cloned().unwrap_or_else(|| format!("extra{key}"));
                    conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)", [key, value.clone()])
                }
                Edit::DropMeta { key } => {
                    conn.execute("DELETE FROM meta WHERE key = ?1", [keys.get(*key).cloned().unwrap_or_default()])
                }
                Edit::DropRow { row } => {
                    conn.execute("DELETE FROM contexts WHERE id = ?1", [ids.get(*row).copied().unwrap_or(-1)])
                }
                Edit::Byte { .. } => Ok(0),
            };
        }
    }
    for e in edits {
        if let Edit::Byte { at, byte } = e {
            let mut bytes = std::fs::read(&file).unwrap();
            let i = at % bytes.len();
            bytes[i] = *byte;
            std::fs::write(&file, bytes).unwrap();
        }
    }
}

/// Every read and write a user can reach, on whatever the store holds now.
fn exercise(db: &Path) -> Vec<String> {
    let mut errors = Vec::new();
    let mut note = |r: Result<(), picaso_store::Error>| {
        if let Err(e) = r {
            errors.push(e.to_string());
        }
    };
    let store = match Store::open(db) {
        Ok(s) => s,
        Err(e) => return vec![e.to_string()],
    };
    note(store.stats().map(|_| ()));
    let ids = store.ids().unwrap_or_default();
    for &id in ids.iter().chain([&-1, &i64::MAX]) {
        note(store.get(id).map(|_| ()));
        note(store.doc_seg(id).map(|_| ()));
        note(store.embedding(id).map(|_| ()));
        note(store.load_state(id).map(|_| ()));
    }
    note(store.map_states(&ids).map(|_| ()));
    note(store.search(&[0.5; DIM], 3).map(|_| ()));
    note(store.search_exact(&[0.5; DIM], 10).map(|_| ()));
    note(store.export(0, 100).map(|_| ()));
    note(store.segments_of("doc0").map(|_| ()));
    if let Some(&id) = ids.first() {
        note(store.delete(id));
    }
    errors
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// Hand-edited or damaged catalog rows: every operation answers or errs, none panics, and
    /// every error says something.
    #[test]
    fn damaged_catalog_rows_never_panic(edits in prop::collection::vec(edit(), 1..4)) {
        let tmp = tempfile::tempdir().unwrap();
        let db = tmp.path().join("db");
        copy_dir(&pristine().path().join("db"), &db);
        apply(&db, &edits);
        let outcome = std::panic::catch_unwind(|| exercise(&db));
        prop_assert!(outcome.is_ok(), "panicked after {edits:?}");
        for e in outcome.unwrap() {
            prop_assert!(!e.trim().is_empty(), "an empty error after {edits:?}");
        }
    }
}

/// The pinned cases: each of these panicked or answered wrongly before the rows were checked.
#[test]
fn damaged_rows_are_errors_that_name_the_context() {
    let cases: [(&str, Sql, &str); 4] = [
        // `key_of` sliced the first two characters of the checksum: a panic.
        ("checksum", Sql::Text(String::new()), "not 32 hex digits"),
        // A checksum naming a path outside the store.
        ("checksum", Sql::Text("../../../../../../etc/passwd".into()), "not 32 hex digits"),
        // A negative token count was read as 2^64 - 1 tokens.
        ("n_tokens", Sql::Integer(-1), "records -1 tokens but holds 3"),
        // An embedding of the wrong width broke the index.
        ("embedding", Sql::Blob(vec![0; 3]), "its embedding has 0 values"),
    ];
    for (column, value, want) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let db = tmp.path().join("db");
        copy_dir(&pristine().path().join("db"), &db);
        apply(&db, &[Edit::Column { row: 0, column: COLUMNS.iter().position(|c| *c == column).unwrap(), value }]);
        let errors = exercise(&db);
        assert!(errors.iter().any(|e| e.contains(want) && e.contains("context 1")), "{column}: {errors:?}");
    }
}
