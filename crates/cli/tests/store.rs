//! The store through the real binary: ingest (idempotent), stats, query by ids and by text with
//! every method, composition through the store equal to in-memory composition, wrong model refused.

use std::process::Command;

use picaso_model::{compose, LoadOptions, Method, Model, State};
use serde_json::Value;

mod common;
use common::{shared, text_model, write_docs};

fn run(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_picaso")).args(args).output().expect("picaso runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "picaso {args:?} panicked: {stderr}");
    (out.status.success(), serde_json::from_slice(&out.stdout).unwrap_or(Value::Null), stderr)
}

fn ok(args: &[&str]) -> Value {
    let (success, v, stderr) = run(args);
    assert!(success, "picaso {args:?} failed: {stderr}");
    v
}

#[test]
fn ingest_stats_query_and_compose_through_the_store() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let db = tmp.path().join("db");
    let (m, e, d, db_s) =
        (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap(), db.to_str().unwrap());
    let first = ok(&["ingest", "--db", db_s, "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
    assert_eq!(first["added"], 4);
    let again = ok(&["ingest", "--db", db_s, "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
    assert_eq!(
        (again["added"].as_u64(), again["skipped"].as_u64()),
        (Some(0), Some(4)),
        "re-running skips what is stored"
    );
    let stats = ok(&["stats", "--db", db_s, "--json"]);
    assert_eq!((stats["contexts"].as_u64(), stats["documents"].as_u64()), (Some(4), Some(3)));
    assert!(stats["tokens"].as_u64().unwrap() > 10 && stats["state_bytes"].as_u64().unwrap() > 0);

    // Retrieval finds the Eiffel paragraphs for an Eiffel question.
    let q = ok(&[
        "query",
        "--db",
        db_s,
        "--model",
        m,
        "--embedder",
        e,
        "--k",
        "2",
        "--max-tokens",
        "4",
        "--json",
        "Where is the Eiffel Tower?",
    ]);
    let docs_hit: Vec<&str> = q["contexts"].as_array().unwrap().iter().map(|c| c["doc"].as_str().unwrap()).collect();
    assert!(docs_hit.contains(&"eiffel.txt"), "{docs_hit:?}");
    for method in ["naive", "concat", "soup", "caso", "picaso-s", "picaso-r"] {
        let v = ok(&[
            "query",
            "--db",
            db_s,
            "--model",
            m,
            "--ids",
            "1,2",
            "--method",
            method,
            "--max-tokens",
            "4",
            "--json",
            "Hello",
        ]);
        assert_eq!(v["method"], method);
        assert!(v["time_to_first_token_ms"].as_f64().unwrap() > 0.0);
    }

    // Composition of the stored states is bit-exact with composing the states in memory.
    let model_obj = Model::load(model.path(), &LoadOptions::default()).unwrap();
    let store = picaso_store::Store::open(&db).unwrap();
    let tok = model_obj.tokenizer().unwrap();
    let texts: Vec<String> = [1, 2].iter().map(|&id| store.get(id).unwrap().text).collect();
    assert_eq!(texts[0], "Cats are small carnivorous mammals.", "files are ingested in sorted order");
    let mem: Vec<State> =
        texts.iter().map(|t| model_obj.prefill(&tok.encode(t).unwrap(), &model_obj.zero_state()).unwrap()).collect();
    let stored: Vec<State> = [1, 2].iter().map(|&id| store.load_state(id).unwrap()).collect();
    let cache = picaso_store::StateCache::new(1 << 30);
    for m in Method::ALL {
        let a = compose(m, &mem.iter().collect::<Vec<_>>(), None).unwrap();
        let method = picaso_store::ContextMethod::Compose(m);
        let b = picaso_store::prepare(&store, &model_obj, &[1, 2], method, None).unwrap().state;
        assert!(a.layers == b.layers, "{m}: composition through the store differs");
        let c = picaso_store::prepare(&store, &model_obj, &[1, 2], method, Some(&cache)).unwrap();
        assert!(a.layers == c.state.layers, "{m}: composition through the state cache differs");
        assert!(compose(m, &stored.iter().collect::<Vec<_>>(), None).unwrap().layers == a.layers, "{m}");
    }
    assert_eq!(cache.stats().misses, 2, "each state is read from disk once, then served from memory");

    // Bad input: another model, unknown ids, unknown method, a folder that is not a store.
    let other = text_model(2).unwrap();
    let (success, _, stderr) =
        run(&["ingest", "--db", db_s, "--model", other.path().to_str().unwrap(), "--embedder", e, "--text-dir", d]);
    assert!(!success && stderr.contains("holds states of model"), "{stderr}");
    let (success, _, stderr) = run(&["query", "--db", db_s, "--model", m, "--ids", "99", "Hi"]);
    assert!(!success && stderr.contains("no context with id 99"), "{stderr}");
    let (success, _, stderr) = run(&["query", "--db", db_s, "--model", m, "--ids", "1", "--method", "blend", "Hi"]);
    assert!(!success && stderr.contains("picaso-r"), "{stderr}");
    let (success, _, stderr) = run(&["stats", "--db", d]);
    assert!(!success && stderr.contains("not a picaso store"), "{stderr}");
}
