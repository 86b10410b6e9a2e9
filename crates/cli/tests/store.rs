//! The store through the real binary: ingest (idempotent), stats, query by ids and by text with
//! every method, composition through the store equal to in-memory composition, wrong model
//! refused, crash safety. Each test runs against every backend: a folder (SQLite + files) and,
//! where configured, S3 + PostgreSQL (see `common::backends`).

use std::process::Command;

use picaso_model::{compose, Composition, LoadOptions, Method, Model, State};

mod common;
use common::{args, backends, ok, ok_s, picaso_bin, run, run_s, shared, text_model, text_model_of, write_docs, TestDb};

#[test]
fn ingest_stats_query_and_compose_through_the_store_mamba2() {
    ingest_stats_query_and_compose_through_the_store("mamba2");
}

/// The same commands, unchanged, over a Mamba-1 model (detected from its config.json).
#[test]
fn ingest_stats_query_and_compose_through_the_store_mamba1() {
    ingest_stats_query_and_compose_through_the_store("mamba1");
}

/// The same commands over a Granite 4.0 H hybrid: its stored states carry the attention layers'
/// keys and values, and composing through the store unions them as in memory.
#[test]
fn ingest_stats_query_and_compose_through_the_store_hybrid() {
    ingest_stats_query_and_compose_through_the_store("hybrid");
}

fn ingest_stats_query_and_compose_through_the_store(arch: &str) {
    let (Some(model), Some(embedder)) = (text_model_of(arch, 1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    for db in backends(tmp.path(), &format!("compose_{arch}")) {
        eprintln!("backend {}", db.kind());
        ingest_stats_query_and_compose(&model, &embedder, &docs, &db, arch);
    }
}

fn ingest_stats_query_and_compose(
    model: &tempfile::TempDir,
    embedder: &std::path::Path,
    docs: &std::path::Path,
    db: &TestDb,
    arch: &str,
) {
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let ingest = args(&["ingest"], db, &["--model", m, "--embedder", e, "--text-dir", d, "--json"]);
    let first = ok_s(&ingest);
    assert_eq!(first["added"], 4);
    let again = ok_s(&ingest);
    assert_eq!(
        (again["added"].as_u64(), again["skipped"].as_u64()),
        (Some(0), Some(4)),
        "re-running skips what is stored"
    );
    let stats = ok_s(&args(&["stats"], db, &["--json"]));
    assert_eq!((stats["contexts"].as_u64(), stats["documents"].as_u64()), (Some(4), Some(3)));
    assert!(stats["tokens"].as_u64().unwrap() > 10 && stats["state_bytes"].as_u64().unwrap() > 0);
    // Later commands need only --db: the store records where its states are.
    let by_db_only = ok(&["stats", "--db", &db.db, "--json"]);
    assert_eq!(by_db_only["states"], stats["states"]);
    // A second document with the same text shares its state file: the stats count bytes stored,
    // each file once.
    let copies = docs.parent().unwrap().join(format!("copies-{}", db.kind()));
    std::fs::create_dir_all(&copies).unwrap();
    std::fs::write(copies.join("cats again.txt"), "Cats are small carnivorous mammals.\n").unwrap();
    let copy =
        args(&["ingest"], db, &["--model", m, "--embedder", e, "--text-dir", copies.to_str().unwrap(), "--json"]);
    assert_eq!(ok_s(&copy)["added"], 1);
    let after = ok_s(&args(&["stats"], db, &["--json"]));
    assert_eq!(after["contexts"].as_u64(), Some(5));
    assert_eq!(after["state_bytes"], stats["state_bytes"], "a shared state file is counted once");
    let removed = ok_s(&args(&["delete"], db, &["--doc", "cats again.txt", "--json"]));
    assert_eq!(removed["store"]["contexts"], 4);
    assert_eq!(removed["store"]["state_bytes"], stats["state_bytes"], "the shared state file stays");

    // Retrieval finds the Eiffel paragraphs for an Eiffel question.
    let q = ok_s(&args(
        &["query"],
        db,
        &["--model", m, "--embedder", e, "--k", "2", "--max-tokens", "4", "--json", "Where is the Eiffel Tower?"],
    ));
    let docs_hit: Vec<&str> = q["contexts"].as_array().unwrap().iter().map(|c| c["doc"].as_str().unwrap()).collect();
    assert!(docs_hit.contains(&"eiffel.txt"), "{docs_hit:?}");
    for method in ["naive", "concat", "soup", "caso", "picaso-s", "picaso-r"] {
        // Naive uses no context: with --ids it is refused, without them it answers.
        let ids: &[&str] = if method == "naive" { &[] } else { &["--ids", "1,2"] };
        let v = ok_s(&args(
            &["query"],
            db,
            &[&["--model", m, "--method", method, "--max-tokens", "4", "--json", "Hello"], ids].concat(),
        ));
        assert_eq!(v["method"], method);
        assert!(v["time_to_first_token_ms"].as_f64().unwrap() > 0.0);
    }
    let (success, _, stderr) =
        run_s(&args(&["query"], db, &["--model", m, "--ids", "1", "--method", "naive", "--max-tokens", "1", "Hi"]));
    assert!(!success && stderr.contains("naive uses no context"), "{stderr}");

    // Composition of the stored states is bit-exact with composing the states in memory.
    let model_obj = Model::load(model.path(), &LoadOptions::default()).unwrap();
    let store = picaso_store::Store::open(db.location()).unwrap();
    let tok = model_obj.tokenizer().unwrap();
    let texts: Vec<String> = [1, 2].iter().map(|&id| store.get(id).unwrap().text).collect();
    assert_eq!(texts[0], "Cats are small carnivorous mammals.", "files are ingested in sorted order");
    let mem: Vec<State> =
        texts.iter().map(|t| model_obj.prefill(&tok.encode(t).unwrap(), &model_obj.zero_state()).unwrap()).collect();
    let stored: Vec<State> = [1, 2].iter().map(|&id| store.load_state(id).unwrap()).collect();
    let cache = picaso_store::StateCache::new(1 << 30);
    for m in Composition::ALL {
        let a = compose(m, &mem.iter().collect::<Vec<_>>(), None).unwrap();
        let method = Method::Compose(m);
        let b = picaso_store::prepare(&store, &model_obj, &[1, 2], method, None).unwrap().state;
        assert!(a.layers == b.layers, "{m}: composition through the store differs");
        let c = picaso_store::prepare(&store, &model_obj, &[1, 2], method, Some(&cache)).unwrap();
        assert!(a.layers == c.state.layers, "{m}: composition through the state cache differs");
        assert!(compose(m, &stored.iter().collect::<Vec<_>>(), None).unwrap().layers == a.layers, "{m}");
    }
    assert_eq!(cache.stats().misses, 2, "each state is read from the backend once, then served from memory");

    // Attribution leaves each context out in turn: the same numbers as combining the rest by
    // hand and scoring the answer from that state.
    let (prompt, answer) = (tok.encode("Tell me about").unwrap(), tok.encode(" cats and the tower.").unwrap());
    let ll = |s: &State| -> f64 {
        let scored = model_obj.score_continuation(&prompt, &answer, s).unwrap();
        scored.logprobs.iter().map(|&l| f64::from(l)).sum()
    };
    let ids = [1i64, 2, 3];
    let stored3: Vec<State> = ids.iter().map(|&id| store.load_state(id).unwrap()).collect();
    let tokens3: Vec<Vec<u32>> = ids.iter().map(|&id| store.get(id).unwrap().tokens).collect();
    for method in ["picaso-r", "soup", "caso", "concat"] {
        let method: Method = method.parse().unwrap();
        let by_hand = |keep: &[usize]| -> State {
            match method {
                Method::Compose(m) => compose(m, &keep.iter().map(|&i| &stored3[i]).collect::<Vec<_>>(), None).unwrap(),
                _ => {
                    let joined: Vec<u32> = keep.iter().flat_map(|&i| tokens3[i].clone()).collect();
                    model_obj.prefill(&joined, &model_obj.zero_state()).unwrap()
                }
            }
        };
        let at = picaso_store::attribute(&store, &model_obj, &ids, method, &prompt, &answer, Some(&cache)).unwrap();
        // The answer is scored from several states in one pass: equal to float rounding.
        assert_eq!(at.answer_tokens, answer.len());
        let all = ll(&by_hand(&[0, 1, 2]));
        assert!(close_to(at.loglik, all), "{method:?}: {} vs {all}", at.loglik);
        for (out, keep) in [[1, 2], [0, 2], [0, 1]].iter().enumerate() {
            let want = ll(&by_hand(keep));
            assert!(
                close_to(at.without[out], want),
                "{method:?} without context {}: {} vs {want}",
                ids[out],
                at.without[out]
            );
        }
        let drops: Vec<f64> = at.ranking().iter().map(|&i| at.drop(i)).collect();
        assert!(drops.windows(2).all(|w| w[0] >= w[1]), "{method:?}: ranking by drop {drops:?}");
    }
    // Leaving out the only context leaves no context at all.
    let one = picaso_store::attribute(&store, &model_obj, &[2], method_r(), &prompt, &answer, None).unwrap();
    assert!(close_to(one.without[0], ll(&model_obj.zero_state())), "{:?}", one.without);
    for (ids, method, answer, says) in [
        (&[1i64][..], Method::Naive, &answer[..], "naive uses no context"),
        (&[][..], method_r(), &answer[..], "no contexts"),
        (&[1][..], method_r(), &[][..], "the answer is empty"),
    ] {
        let e = picaso_store::attribute(&store, &model_obj, ids, method, &prompt, answer, None).unwrap_err();
        assert!(e.to_string().contains(says), "{e}");
    }
    // Through the CLI: the answer given, or the one generated.
    let v =
        ok_s(&args(&["query"], db, &["--model", m, "--ids", "1,2", "--answer", " cats", "--json", "Tell me about"]));
    let at = &v["attribution"];
    assert!(v.get("text").is_none(), "--answer attributes instead of generating: {v}");
    assert_eq!(at["answer"], " cats");
    for c in v["contexts"].as_array().unwrap() {
        let drop = at["loglik"].as_f64().unwrap() - c["loglik_without"].as_f64().unwrap();
        assert!((c["drop"].as_f64().unwrap() - drop).abs() < 1e-9, "{c}");
    }
    let v = ok_s(&args(
        &["query"],
        db,
        &["--model", m, "--ids", "1,2", "--max-tokens", "3", "--attribute", "--json", "Tell me about"],
    ));
    assert_eq!(v["attribution"]["answer_tokens"].as_u64(), Some(v["token_ids"].as_array().unwrap().len() as u64));
    assert_eq!(v["attribution"]["ranking"].as_array().unwrap().len(), 2);
    let (success, _, stderr) = run_s(&args(&["query"], db, &["--model", m, "--method", "naive", "--attribute", "Hi"]));
    assert!(!success && stderr.contains("naive uses none"), "{stderr}");

    // Search agrees between the index in use and an exhaustive scan.
    let q = store.embedding(2).unwrap();
    assert_eq!(store.search(&q, 4).unwrap(), store.search_exact(&q, 4).unwrap());
    assert_eq!(store.search(&q, 1).unwrap()[0].0, 2);

    // Retrieval within documents: the exhaustive ranking restricted to their contexts, scores
    // and order alike; a name the store does not hold, or no name, is refused.
    let everything = store.search_exact(&q, 100).unwrap();
    let doc = |id: i64| store.get(id).unwrap().doc;
    for names in [&["cats.txt"][..], &["mamba.txt", "cats.txt"], &["eiffel.txt"], &["eiffel.txt", "eiffel.txt"]] {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        for k in [1, 2, 5] {
            let want: Vec<(i64, f32)> =
                everything.iter().filter(|(id, _)| names.contains(&doc(*id))).take(k).copied().collect();
            assert_eq!(store.search_in(&q, k, picaso_store::Scope::within(&names)).unwrap(), want, "{names:?}, k {k}");
        }
    }
    for (names, says) in [
        (vec!["cats.txt".to_string(), "dogs.txt".into()], "\"dogs.txt\" is not in the store"),
        (vec![], "no documents"),
    ] {
        let e = store.search_in(&q, 3, picaso_store::Scope::within(&names)).unwrap_err();
        assert!(matches!(e, picaso_store::Error::Input(_)) && e.to_string().contains(says), "{e}");
    }
    let v = ok_s(&args(
        &["query"],
        db,
        &[
            "--model",
            m,
            "--embedder",
            e,
            "--k",
            "3",
            "--doc",
            "cats.txt",
            "--doc",
            "mamba.txt",
            "--max-tokens",
            "2",
            "--json",
            "Tell me about Paris",
        ],
    ));
    let used: Vec<&str> = v["contexts"].as_array().unwrap().iter().map(|c| c["doc"].as_str().unwrap()).collect();
    assert_eq!(used.len(), 2, "{v}");
    assert!(used.iter().all(|d| *d == "cats.txt" || *d == "mamba.txt"), "{used:?}");
    let (success, _, stderr) =
        run_s(&args(&["query"], db, &["--model", m, "--embedder", e, "--doc", "dogs.txt", "Tell me about Paris"]));
    assert!(!success && stderr.contains("\"dogs.txt\" is not in the store"), "{stderr}");

    // Delete removes the row and (unshared) state object; the id is gone everywhere.
    let before = store.state_keys().unwrap().len();
    store.delete(4).unwrap();
    assert_eq!(store.state_keys().unwrap().len(), before - 1, "the unshared state object is removed");
    assert!(matches!(store.get(4), Err(picaso_store::Error::NotFound(4))));
    assert!(store.search(&q, 10).unwrap().iter().all(|h| h.0 != 4));

    // Bad input: another model, unknown ids, unknown method, a folder that is not a store.
    let other = text_model_of(arch, 2).unwrap();
    let (success, _, stderr) =
        run_s(&args(&["ingest"], db, &["--model", other.path().to_str().unwrap(), "--embedder", e, "--text-dir", d]));
    assert!(!success && stderr.contains("holds states of model"), "{stderr}");
    let (success, _, stderr) = run_s(&args(&["query"], db, &["--model", m, "--ids", "99", "Hi"]));
    assert!(!success && stderr.contains("no context with id 99"), "{stderr}");
    let (success, _, stderr) = run_s(&args(&["query"], db, &["--model", m, "--ids", "1", "--method", "blend", "Hi"]));
    assert!(!success && stderr.contains("picaso-r"), "{stderr}");
    let (success, _, stderr) = run(&["stats", "--db", d]);
    assert!(!success && stderr.contains("not a picaso store"), "{stderr}");
    if let Some(states) = &db.states {
        let wrong = format!("{states}-elsewhere");
        let (success, _, stderr) = run(&["stats", "--db", &db.db, "--states", &wrong]);
        assert!(!success && stderr.contains("keeps its states in"), "{stderr}");
        // A new store is refused this store's states location, named by its marker.
        let other = docs.parent().unwrap().join(format!("other-{}", db.kind()));
        let (success, _, stderr) = run(&[
            "ingest",
            "--db",
            other.to_str().unwrap(),
            "--states",
            states,
            "--model",
            m,
            "--embedder",
            e,
            "--text-dir",
            d,
        ]);
        let refused = stderr.contains("belongs to the store") && stderr.contains("picaso-store.json");
        assert!(!success && refused && stderr.contains("nothing was created"), "{stderr}");
        assert!(!other.join("store.sqlite").exists());
    }
}

/// A document ingested again with other text is brought up to date: its changed segment gets a
/// new context whose state is its new text's, the segment it lost is removed, unchanged ones
/// keep their ids. `picaso contexts` lists what is stored and `picaso delete` removes contexts
/// and documents (every backend).
#[test]
fn changed_documents_are_replaced_and_contexts_listed_and_deleted() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    for db in backends(tmp.path(), "changed") {
        eprintln!("backend {}", db.kind());
        std::fs::write(docs.join("eiffel.txt"), "The Eiffel Tower is in Paris.\n\nIt was finished in 1889.\n").unwrap();
        let ingest = args(&["ingest"], &db, &["--model", m, "--embedder", e, "--text-dir", d, "--json"]);
        assert_eq!(ok_s(&ingest)["added"], 4);
        let lines = |more: &[&str]| -> Vec<String> {
            let out = Command::new(common::picaso_bin()).args(args(&["contexts"], &db, more)).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap().lines().map(str::to_string).collect()
        };
        let listed = |more: &[&str]| -> Vec<serde_json::Value> {
            lines(more).iter().map(|l| serde_json::from_str(l).unwrap()).collect()
        };
        if db.states.is_none() {
            // A folder store's writes are claimed per `Store`: its holders share the claim (a
            // server ingests through the store it holds), another `Store` is refused.
            let one = picaso_store::Store::open(db.location()).unwrap();
            let held = one.lock_writes().unwrap();
            assert!(one.lock_writes().is_ok(), "the same store shares its claim");
            let other = picaso_store::Store::open(db.location()).unwrap();
            let e = other.lock_writes().unwrap_err().to_string();
            assert!(e.contains("being written by another Store object of this process"), "{e}");
            drop(held);
            assert!(other.lock_writes().is_ok(), "released with its last holder");
        }
        let all = listed(&["--json"]);
        let ids: Vec<i64> = all.iter().map(|r| r["id"].as_i64().unwrap()).collect();
        assert_eq!(ids, [1, 2, 3, 4], "every context, by id");
        // A reader kept open (a notebook, a second `Store`) while another process edits.
        let reader = picaso_store::Store::open(db.location()).unwrap();
        let eiffel_query = reader.embedding(2).unwrap();
        assert_eq!(reader.search(&eiffel_query, 1).unwrap()[0].0, 2);
        let eiffel = listed(&["--doc", "eiffel.txt", "--json"]);
        assert_eq!(eiffel.iter().map(|r| r["seg"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1]);

        // The first paragraph changes, the second goes.
        std::fs::write(docs.join("eiffel.txt"), "The Eiffel Tower stands in Paris, France.\n").unwrap();
        let v = ok_s(&ingest);
        let counts = ["added", "replaced", "removed", "skipped"].map(|k| v[k].as_u64().unwrap());
        assert_eq!(counts, [0, 1, 1, 2], "{v}");
        assert_eq!(v["store"]["contexts"], 3);
        let now = listed(&["--doc", "eiffel.txt", "--json"]);
        assert_eq!(now.len(), 1);
        assert_eq!(now[0]["text"], "The Eiffel Tower stands in Paris, France.");
        let new_id = now[0]["id"].as_i64().unwrap();
        assert!(!ids.contains(&new_id), "a replaced context gets a new id");
        let store = picaso_store::Store::open(db.location()).unwrap();
        for gone in [2, 3] {
            assert!(matches!(store.get(gone), Err(picaso_store::Error::NotFound(_))), "context {gone}");
        }
        let model_obj = Model::load(model.path(), &LoadOptions::default()).unwrap();
        let tokens = model_obj.tokenizer().unwrap().encode("The Eiffel Tower stands in Paris, France.").unwrap();
        let fresh = model_obj.prefill(&tokens, &model_obj.zero_state()).unwrap();
        assert!(store.load_state(new_id).unwrap().layers == fresh.layers, "the new text's state");
        let q = store.embedding(new_id).unwrap();
        assert!(store.search(&q, 10).unwrap().iter().all(|(id, _)| *id != 2 && *id != 3), "gone from retrieval");
        // The reader opened before the edit follows it: retrieval, ids and counts are the
        // store's now, not what it loaded at open.
        assert_eq!(reader.ids().unwrap(), [1, 4, new_id], "the reader sees the other process's commits");
        assert_eq!(reader.search(&eiffel_query, 1).unwrap()[0].0, new_id);
        assert!(reader.search(&eiffel_query, 10).unwrap().iter().all(|(id, _)| *id != 2 && *id != 3));
        assert_eq!(reader.embedding(new_id).unwrap(), store.embedding(new_id).unwrap());
        assert!(matches!(reader.embedding(2), Err(picaso_store::Error::NotFound(2))));
        let again = ok_s(&ingest);
        assert_eq!((again["added"].as_u64(), again["skipped"].as_u64()), (Some(0), Some(3)), "then nothing to do");

        // A state object lost (deleted by hand, a disk restored without it): the error says to
        // ingest the document again, and that run processes the segment anew.
        let lost = store.get(4).unwrap();
        assert_eq!(lost.doc, "mamba.txt");
        let objects = picaso_store::states::open(store.states_url()).unwrap();
        objects.delete(&picaso_store::states::key_of(&lost.checksum)).unwrap();
        let (success, _, stderr) = run_s(&args(&["query"], &db, &["--model", m, "--ids", "4", "Hi"]));
        assert!(
            !success && stderr.contains("is missing") && stderr.contains("ingesting that document again"),
            "{stderr}"
        );
        let v = ok_s(&ingest);
        let counts = ["added", "replaced", "repaired", "skipped"].map(|k| v[k].as_u64().unwrap());
        assert_eq!(counts, [0, 0, 1, 2], "{v}");
        let repaired = listed(&["--doc", "mamba.txt", "--json"]);
        let repaired_id = repaired[0]["id"].as_i64().unwrap();
        assert!(repaired_id > new_id, "the repaired segment is a new context");
        assert!(matches!(store.get(4), Err(picaso_store::Error::NotFound(4))));
        let fresh = model_obj.prefill(&lost.tokens, &model_obj.zero_state()).unwrap();
        assert!(store.load_state(repaired_id).unwrap().layers == fresh.layers, "its text's state again");
        // Once more, as people read it.
        objects.delete(&picaso_store::states::key_of(&store.get(repaired_id).unwrap().checksum)).unwrap();
        let out = Command::new(common::picaso_bin())
            .args(args(&["ingest"], &db, &["--model", m, "--embedder", e, "--text-dir", d]))
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && said.contains("repaired 1 whose state file was missing"), "{said}");

        // Deleting: an id and a document; unknown ones are refused before anything is removed.
        let (success, _, stderr) = run_s(&args(&["delete"], &db, &["1", "99"]));
        assert!(!success && stderr.contains("no context with id 99"), "{stderr}");
        let (success, _, stderr) = run_s(&args(&["delete"], &db, &["--doc", "nope.txt"]));
        assert!(!success && stderr.contains("holds no document \"nope.txt\""), "{stderr}");
        let (success, _, stderr) = run_s(&args(&["contexts"], &db, &["--doc", "nope.txt"]));
        assert!(!success && stderr.contains("holds no document"), "{stderr}");
        assert_eq!(listed(&["--json"]).len(), 3, "refused deletes remove nothing");
        let v = ok_s(&args(&["delete"], &db, &["1", "--doc", "eiffel.txt", "--json"]));
        assert_eq!(v["deleted"], serde_json::json!([1, new_id]));
        assert_eq!(v["store"]["contexts"], 1);
        // Documents: listed in name order; --prune removes those the source no longer has.
        let mirror = tmp.path().join(format!("mirror-{}", db.kind()));
        std::fs::create_dir_all(&mirror).unwrap();
        std::fs::copy(docs.join("mamba.txt"), mirror.join("mamba.txt")).unwrap();
        std::fs::write(mirror.join("gone.txt"), "A paragraph that will go.\n").unwrap();
        let mirror_s = mirror.to_str().unwrap();
        let sync =
            args(&["ingest"], &db, &["--model", m, "--embedder", e, "--text-dir", mirror_s, "--json", "--prune"]);
        assert_eq!(ok_s(&sync)["added"], 1, "mamba.txt is there already");
        let documents = |db: &TestDb| -> Vec<serde_json::Value> {
            let out = Command::new(common::picaso_bin()).args(args(&["documents"], db, &["--json"])).output().unwrap();
            String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
        };
        let names: Vec<String> = documents(&db).iter().map(|d| d["id"].as_str().unwrap().to_string()).collect();
        assert_eq!(names, ["gone.txt", "mamba.txt"], "in name order");
        std::fs::remove_file(mirror.join("gone.txt")).unwrap();
        let v = ok_s(&sync);
        assert_eq!((v["pruned_documents"].as_u64(), v["pruned_contexts"].as_u64()), (Some(1), Some(1)), "{v}");
        let left = documents(&db);
        assert_eq!(
            (left.len(), &left[0]["id"], &left[0]["contexts"]),
            (1, &serde_json::json!("mamba.txt"), &serde_json::json!(1))
        );
        assert_eq!(left[0]["tokens"], v["store"]["tokens"]);
        // Without --prune the documents the source lacks stay.
        let only_cats = tmp.path().join(format!("only-cats-{}", db.kind()));
        std::fs::create_dir_all(&only_cats).unwrap();
        std::fs::write(only_cats.join("cats.txt"), "Cats are small carnivorous mammals.\n").unwrap();
        let c = only_cats.to_str().unwrap();
        ok_s(&args(&["ingest"], &db, &["--model", m, "--embedder", e, "--text-dir", c, "--json"]));
        assert_eq!(documents(&db).len(), 2);
        let table = lines(&[]);
        assert!(table.len() == 2 && table[0].contains("mamba.txt #0"), "a line per context: {table:?}");
        let mamba = listed(&["--doc", "mamba.txt", "--json"])[0]["id"].to_string();
        assert_eq!(listed(&["--ids", &mamba, "--json"])[0]["doc"], "mamba.txt");
        let (success, _, stderr) = run_s(&args(&["delete"], &db, &[]));
        assert!(!success && stderr.contains("required"), "{stderr}");
    }
}

/// `picaso check` reads every state object back (`--quick`: looks only for missing ones):
/// sound stores pass; a lost object, a damaged one and an object no context names are reported
/// (exit 1 while a context cannot be used), and `--repair` recomputes the broken states from
/// their rows' tokens (same ids, same bits) and removes the unnamed object (every backend). A
/// damaged row is left, with the command that removes it.
#[test]
fn check_finds_lost_and_damaged_states_and_repair_recomputes_them() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    for db in backends(tmp.path(), "check") {
        eprintln!("backend {}", db.kind());
        ok_s(&args(&["ingest"], &db, &["--model", m, "--embedder", e, "--text-dir", d, "--json"]));
        let v = ok_s(&args(&["check"], &db, &["--json"]));
        assert_eq!((v["contexts"].as_u64(), v["sound"].as_u64()), (Some(4), Some(4)), "{v}");
        assert!(v["state_bytes"].as_u64().unwrap() > 0 && v["repair"].is_null(), "{v}");

        let store = picaso_store::Store::open(db.location()).unwrap();
        let objects = picaso_store::states::open(store.states_url()).unwrap();
        let key = |id: i64| picaso_store::states::key_of(&store.get(id).unwrap().checksum);
        let before: Vec<State> = [1, 4].iter().map(|&id| store.load_state(id).unwrap()).collect();
        objects.delete(&key(1)).unwrap();
        let mut damaged = objects.read(&key(4)).unwrap().unwrap();
        let at = damaged.len() - 8;
        damaged[at] ^= 1;
        objects.put(&key(4), &damaged).unwrap();
        let orphan = b"left by a killed delete".to_vec();
        let orphan_key = picaso_store::states::key_of(&picaso_store::checksum(&orphan));
        objects.put(&orphan_key, &orphan).unwrap();

        let (success, v, stderr) = run_s(&args(&["check"], &db, &["--json"]));
        assert!(
            !success && stderr.contains("2 contexts of the store cannot be used") && stderr.contains("--repair"),
            "{stderr}"
        );
        let kinds: Vec<(i64, &str)> = v["problems"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["id"].as_i64().unwrap(), p["kind"].as_str().unwrap()))
            .collect();
        assert_eq!(kinds, [(1, "missing_state"), (4, "damaged_state")], "{v}");
        assert_eq!(v["unreferenced"][0]["key"], orphan_key.as_str(), "{v}");
        // Without reading an object: the lost one (and the unnamed one), not the damaged one.
        let (success, v, _) = run_s(&args(&["check"], &db, &["--quick", "--json"]));
        assert!(!success && v["read"] == false && v["problems"].as_array().unwrap().len() == 1, "{v}");
        assert!(v["problems"][0]["id"] == 1 && v["unreferenced"][0]["key"] == orphan_key.as_str(), "{v}");
        let out = Command::new(common::picaso_bin()).args(args(&["check"], &db, &[])).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(said.contains("checked 4 contexts") && said.contains("2 sound, 1 without their state object, 1 with a damaged state object; 1 state object that no context names"), "{said}");
        assert!(said.contains("context 4 (\"mamba.txt\" #0): damaged state: its bytes hash to"), "{said}");

        let v = ok_s(&args(&["check"], &db, &["--repair", "--model", m, "--json"]));
        assert_eq!(v["repair"]["rewritten"], serde_json::json!([1, 4]), "{v}");
        assert_eq!(
            (v["repair"]["restated"].as_array().map(Vec::len), v["repair"]["removed_objects"].as_u64()),
            (Some(0), Some(1)),
            "{v}"
        );
        assert!(!objects.exists(&orphan_key).unwrap(), "the unnamed object is gone");
        let after: Vec<State> = [1, 4].iter().map(|&id| store.load_state(id).unwrap()).collect();
        assert!(after == before, "the same states, bit for bit, under the same ids");
        let v = ok_s(&args(&["check"], &db, &["--json"]));
        assert_eq!((v["sound"].as_u64(), v["unreferenced"].as_array().map(Vec::len)), (Some(4), Some(0)), "{v}");

        if db.states.is_none() {
            // A damaged row: its tokens cannot be trusted, so the repair leaves it and says how
            // to remove it.
            let conn = rusqlite::Connection::open(std::path::Path::new(&db.db).join("store.sqlite")).unwrap();
            conn.execute("UPDATE contexts SET n_tokens = 99 WHERE id = 2", []).unwrap();
            let (success, v, stderr) = run_s(&args(&["check"], &db, &["--repair", "--model", m, "--json"]));
            assert!(!success && v["repair"]["left"][0]["id"] == 2, "{v}");
            assert!(stderr.contains(&format!("`picaso delete --db {} 2`", db.db)), "{stderr}");
        }
        let (success, _, stderr) = run_s(&args(&["check"], &db, &["--model", m]));
        assert!(!success && stderr.contains("add --repair"), "{stderr}");
        // A repair needs the store's model.
        let other = text_model(2).unwrap();
        let (success, _, stderr) =
            run_s(&args(&["check"], &db, &["--repair", "--model", other.path().to_str().unwrap()]));
        assert!(!success && stderr.contains("model"), "{stderr}");
    }
}

/// Ingest killed with SIGKILL at several points leaves a consistent store each time (every
/// recorded context's state file is complete and matches its checksum), and re-running it
/// completes the store without redoing committed work — ending equal to an uninterrupted ingest.
#[test]
fn ingest_survives_sigkill_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    for db in backends(tmp.path(), "sigkill") {
        eprintln!("backend {}", db.kind());
        ingest_survives_sigkill(tmp.path(), &db);
    }
}

fn ingest_survives_sigkill(tmp: &std::path::Path, db: &TestDb) {
    let (Some(model), Some(embedder)) = (text_model(4), shared("all-MiniLM-L6-v2")) else { return };
    let docs = tmp.join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    let words = ["river", "mountain", "city", "engine", "forest", "music", "harbour", "winter", "garden", "signal"];
    let total = 400;
    for d in 0..total / 4 {
        let paras: Vec<String> = (0..4)
            .map(|p| {
                let n = d * 4 + p;
                format!(
                    "Paragraph {n} is about the {} and the {}, seen in year {}.",
                    words[n % 10],
                    words[(n / 10) % 10],
                    1800 + n
                )
            })
            .collect();
        std::fs::write(docs.join(format!("doc{d:03}.txt")), paras.join("\n\n")).unwrap();
    }
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let ingest_args = |db: &TestDb| {
        args(&["ingest"], db, &["--model", m, "--embedder", e, "--text-dir", d, "--batch", "2", "--json"])
    };
    // Contexts stored so far (0 while the store does not exist yet).
    let stored = |db: &TestDb| -> u64 {
        let (ok, v, _) = run(&["stats", "--db", &db.db, "--json"]);
        if ok {
            v["contexts"].as_u64().unwrap_or(0)
        } else {
            0
        }
    };

    let mut killed_at = Vec::new();
    for target in [10, 150, 300] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_picaso"))
            .args(ingest_args(db))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        while stored(db) < target {
            assert!(child.try_wait().unwrap().is_none(), "ingest finished before the kill; make the corpus larger");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        // Consistent: stats work, every recorded state loads and matches its checksum.
        let n = stored(db);
        assert!(n >= target && n < total as u64, "killed mid-way ({n} of {total})");
        let store = picaso_store::Store::open(db.location()).unwrap();
        for id in store.ids().unwrap() {
            store.load_state(id).unwrap_or_else(|e| panic!("after SIGKILL at {n}: context {id}: {e}"));
        }
        killed_at.push(n);
    }
    let resumed = ok_s(&ingest_args(db));
    let before = *killed_at.last().unwrap();
    assert_eq!(resumed["skipped"].as_u64(), Some(before), "committed contexts are not redone");
    assert_eq!(resumed["added"].as_u64(), Some(total as u64 - before));

    // The resumed store equals an uninterrupted one: same contexts, same state checksums.
    let clean = TestDb { db: tmp.join(format!("clean-{}", db.kind())).to_str().unwrap().to_string(), states: None };
    ok_s(&ingest_args(&clean));
    let (a, b) =
        (picaso_store::Store::open(db.location()).unwrap(), picaso_store::Store::open(clean.location()).unwrap());
    let key = |s: &picaso_store::Store| -> Vec<(String, u32, String)> {
        let mut v: Vec<_> =
            s.ids().unwrap().iter().map(|&id| s.get(id).unwrap()).map(|r| (r.doc, r.seg, r.checksum)).collect();
        v.sort();
        v
    };
    let (ka, kb) = (key(&a), key(&b));
    assert_eq!(ka.len(), total);
    let diff: Vec<_> = ka.iter().zip(&kb).filter(|(x, y)| x != y).take(3).collect();
    assert!(diff.is_empty(), "the resumed store differs from an uninterrupted ingest: {diff:?}");
}

/// A store in int8 or int4: ingested, checked, queried with composition read from the
/// compressed files, converted by `migrate --state-dtype` (each converted state verified) and
/// refused in another codec with the way to convert it; an unknown codec names the four.
#[test]
fn compressed_stores_ingest_compose_migrate_and_refuse_another_codec() {
    let (Some(model), Some(embedder)) = (text_model(5), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let (success, _, stderr) = run(&[
        "ingest",
        "--db",
        tmp.path().join("x").to_str().unwrap(),
        "--model",
        m,
        "--text-dir",
        d,
        "--state-dtype",
        "int2",
    ]);
    assert!(!success && stderr.contains("unknown state codec \"int2\"") && stderr.contains("int4"), "{stderr}");
    let bytes = |db: &str| -> u64 { ok(&["stats", "--db", db, "--json"])["state_bytes"].as_u64().unwrap() };
    let f32_db = tmp.path().join("f32");
    let f32_db = f32_db.to_str().unwrap();
    ok(&["ingest", "--db", f32_db, "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
    for codec in ["int8", "int4"] {
        let db = tmp.path().join(codec);
        let db = db.to_str().unwrap();
        ok(&["ingest", "--db", db, "--model", m, "--embedder", e, "--text-dir", d, "--state-dtype", codec, "--json"]);
        // (A tiny model: headers and f32 log-decays weigh more than at real sizes.)
        assert!(bytes(db) * 2 < bytes(f32_db), "{codec}: {} bytes against f32's {}", bytes(db), bytes(f32_db));
        assert_eq!(ok(&["stats", "--db", db, "--json"])["state_dtype"], codec, "stats names the codec");
        ok(&["check", "--db", db, "--json"]);
        let out = ok(&[
            "query",
            "--db",
            db,
            "--model",
            m,
            "--k",
            "3",
            "--method",
            "picaso-r",
            "--max-tokens",
            "3",
            "--json",
            "Tell me about Paris",
        ]);
        assert!(!out.is_null(), "{codec}: a composed answer");
        let (success, _, stderr) = run(&["ingest", "--db", db, "--model", m, "--text-dir", d, "--state-dtype", "f32"]);
        assert!(!success && stderr.contains(&format!("keeps its states in {codec}, not f32")), "{stderr}");
        assert!(stderr.contains("--state-dtype f32"), "the refusal says how to convert: {stderr}");
        // Converted from f32 to this codec, every state verified, and the same size as ingested.
        let migrated = tmp.path().join(format!("{codec}-migrated"));
        let v =
            ok(&["migrate", "--from", f32_db, "--to", migrated.to_str().unwrap(), "--state-dtype", codec, "--json"]);
        assert_eq!(v["report"]["verified"], v["report"]["copied"], "{v}");
        assert_eq!(bytes(migrated.to_str().unwrap()), bytes(db), "{codec}: converted states are the ingested ones");
        ok(&["check", "--db", migrated.to_str().unwrap(), "--json"]);
    }
}

/// `--state-dtype` that differs from what the store keeps is refused, not silently ignored.
#[test]
fn a_store_keeps_one_state_precision() {
    let (Some(model), Some(embedder)) = (text_model(5), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let db = tmp.path().join("db");
    let (m, e, d, db) =
        (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap(), db.to_str().unwrap());
    ok(&["ingest", "--db", db, "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
    let (success, _, stderr) = run(&["ingest", "--db", db, "--model", m, "--text-dir", d, "--state-dtype", "bf16"]);
    assert!(!success && stderr.contains("keeps its states in f32"), "{stderr}");
    ok(&["ingest", "--db", db, "--model", m, "--text-dir", d, "--state-dtype", "f32", "--json"]);

    // A new store whose states cannot be written is not created (it would stay bound to them).
    let fresh = tmp.path().join("fresh");
    let mut stores = vec![("folder", fresh.to_str().unwrap().to_string(), "/proc/picaso-cannot-write".to_string())];
    if let (Ok(pg), Ok(s3)) = (std::env::var("PICASO_TEST_POSTGRES"), std::env::var("PICASO_TEST_S3")) {
        let unique = format!("probe_{}", std::process::id());
        let sep = if pg.contains('?') { '&' } else { '?' };
        let bucket = s3.trim_start_matches("s3://").split('/').next().unwrap().to_string();
        stores.push((
            "s3",
            format!("{pg}{sep}options=-csearch_path%3D{unique}%2Cpublic"),
            format!("s3://{bucket}-missing/{unique}"),
        ));
    }
    for (kind, db, states) in stores {
        let (success, _, stderr) =
            run(&["ingest", "--db", &db, "--states", &states, "--model", m, "--embedder", e, "--text-dir", d]);
        assert!(
            !success && stderr.contains("cannot write state objects") && stderr.contains("nothing was created"),
            "{kind}: {stderr}"
        );
        let (success, _, stderr) = run(&["stats", "--db", &db]);
        let absent = stderr.contains("not a picaso store") || stderr.contains("holds no picaso store");
        assert!(!success && absent, "{kind}: {stderr}");
    }
}

fn method_r() -> Method {
    Method::Compose(Composition::PicasoR)
}

/// Equal to float rounding (sums of log-probabilities scored in different batches).
fn close_to(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * (1.0 + b.abs())
}

/// `tokens:N` and `halves` cut between tokens, and byte-level tokens can split a character: a
/// cut there would leave each side's text with a U+FFFD for its piece. They move the cut to the
/// nearest token that starts a character, and every token stays in exactly one segment.
#[test]
fn segments_never_split_a_character() {
    let Some(model) = text_model(1) else { return };
    let model = Model::load(model.path(), &LoadOptions::default()).unwrap();
    let tok = model.tokenizer().unwrap();
    let text = "Zoë’s café served crème brûlée — 東京タワー and 🎉🎉 emoji — at 5 °C, naïvely.".repeat(3);
    let all = tok.encode(&text).unwrap();
    let split_somewhere = (1..all.len()).filter(|&k| tok.decode(&all[..k]).unwrap().ends_with('\u{FFFD}')).count();
    assert!(split_somewhere > 10, "the text has characters that span tokens ({split_somewhere} cuts split one)");
    let doc = picaso_store::Document::new("d", vec![text.clone()]);
    let check = |segmentation: picaso_store::Segmentation, max_len: usize| {
        let segs = picaso_store::ingest::segments(&model, &doc, segmentation).unwrap();
        for (seg, text, tokens) in &segs {
            assert!(!text.contains('\u{FFFD}'), "{segmentation} segment {seg}: {text:?}");
            assert!(
                !tokens.is_empty() && tokens.len() <= max_len,
                "{segmentation} segment {seg}: {} tokens",
                tokens.len()
            );
            assert_eq!(&tok.decode(tokens).unwrap(), text);
        }
        let joined: Vec<u32> = segs.iter().flat_map(|s| s.2.clone()).collect();
        assert_eq!(joined, all, "{segmentation}: every token once, in order");
        segs.len()
    };
    for n in 4..=12 {
        let count = check(picaso_store::Segmentation::Tokens(n), n);
        assert!(count >= all.len().div_ceil(n), "tokens:{n}: {count} segments");
    }
    assert_eq!(check(picaso_store::Segmentation::Halves(2), all.len()), 2);
}

/// An ingest reports only the contexts it inserted: segments another writer stored between its
/// plan and its commit (concurrent ingests of the same documents into a PostgreSQL store) are
/// counted as skipped, not added twice.
#[test]
fn an_ingest_counts_only_what_it_inserted() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let model = Model::load(model.path(), &LoadOptions::default()).unwrap();
    let embedder = picaso_embed::Embedder::load(&embedder, &candle_core::Device::Cpu).unwrap();
    let docs = picaso_store::read_text_dir(&docs).unwrap();
    let info = picaso_store::StoreInfo {
        fingerprint: model.fingerprint().to_string(),
        dim: embedder.dim(),
        state_dtype: Default::default(),
    };
    for db in backends(tmp.path(), "counts") {
        let store = picaso_store::Store::open_or_create(db.location(), &info).unwrap();
        let paragraph = picaso_store::Segmentation::Paragraph;
        let mut raced = None;
        let progress = picaso_store::ingest_while(&store, &model, &embedder, &docs, paragraph, 8, |p| {
            if raced.is_none() {
                // Planned, not yet stored: another writer stores the same segments first.
                raced = Some(picaso_store::ingest(&store, &model, &embedder, &docs, paragraph, 8, |_| {}).unwrap());
                assert_eq!(p.total, 4);
            }
            true
        })
        .unwrap();
        assert_eq!(raced.unwrap().added(), 4, "{}", db.kind());
        assert_eq!((progress.added(), progress.skipped), (0, 4), "{}: {}", db.kind(), progress.summary());
        assert_eq!(store.len().unwrap(), 4);
    }
}

/// A store whose creation is killed at any of its writes is afterwards either absent or whole
/// (never one that every command refuses), and ingesting again completes it. The kill comes at
/// the n-th fsync, where a write becomes durable (strace's fault injection; skipped without it).
#[test]
fn a_killed_creation_leaves_no_store_or_a_whole_one() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let strace_works = Command::new("strace").args(["-o", "/dev/null", "true"]).status().is_ok_and(|s| s.success());
    if !strace_works {
        eprintln!("skipping: strace is missing or cannot trace here");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    for n in 1..=6 {
        let db = tmp.path().join(format!("kill{n}"));
        let inject = format!("fdatasync,fsync:signal=SIGKILL:when={n}");
        let status = Command::new("strace")
            .args(["-f", "-qq", "-e", "trace=fdatasync,fsync", "-e", &format!("inject={inject}"), "-o", "/dev/null"])
            .arg(env!("CARGO_BIN_EXE_picaso"))
            .args(["ingest", "--db", db.to_str().unwrap(), "--model", m, "--embedder", e, "--text-dir", d])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        let (success, _, stderr) = run(&["stats", "--db", db.to_str().unwrap(), "--json"]);
        assert!(success || stderr.contains("not a picaso store"), "killed at fsync {n} ({status}): {stderr}");
        let v = ok(&["ingest", "--db", db.to_str().unwrap(), "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
        assert_eq!(v["store"]["contexts"].as_u64(), Some(4), "killed at fsync {n}: {v}");
    }
}

/// A folder store in a folder this user cannot write (a read-only mount, a directory without
/// write permission) can still be read: stats, listing and queries that read states. A write
/// fails naming the store. As root (who may write anywhere) the commands run as `nobody`.
#[test]
fn a_read_only_folder_store_can_be_read() {
    use std::os::unix::fs::PermissionsExt;
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if root && !std::path::Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipping: running as root without setpriv to drop privileges");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let db = tmp.path().join("db");
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let dbs = db.to_str().unwrap();
    ok(&["ingest", "--db", dbs, "--model", m, "--embedder", e, "--text-dir", d]);
    for p in [tmp.path(), model.path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let read_only = |mode| {
        for dir in [db.clone(), db.join("states")] {
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        }
    };
    read_only(0o555);
    let picaso = |words: &[&str]| {
        let mut c = if root {
            let mut c = Command::new("/usr/bin/setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups"]).arg(env!("CARGO_BIN_EXE_picaso"));
            c
        } else {
            Command::new(env!("CARGO_BIN_EXE_picaso"))
        };
        let out = c.args(words).output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (success, stdout, stderr) = picaso(&["stats", "--db", dbs, "--json"]);
    assert!(success && stdout.contains("\"contexts\":4"), "{stdout} {stderr}");
    let (success, stdout, stderr) =
        picaso(&["query", "--db", dbs, "--model", m, "--ids", "1,2", "--max-tokens", "2", "--json", "The"]);
    assert!(success, "{stdout} {stderr}");
    let (success, _, stderr) = picaso(&["delete", "--db", dbs, "1"]);
    assert!(!success && stderr.contains(dbs), "{stderr}");
    read_only(0o755);
    assert_eq!(picaso_store::Store::open(db.as_path()).unwrap().len().unwrap(), 4);

    // Commits still in the WAL (its writer was not the last connection, or was killed): read
    // through the writer's shared-memory file where it is there, refused with the way out where not.
    let keep = rusqlite::Connection::open(db.join("store.sqlite")).unwrap();
    keep.query_row("SELECT COUNT(*) FROM sqlite_master", [], |r| r.get::<_, i64>(0)).unwrap();
    ok(&["delete", "--db", dbs, "1", "--json"]);
    let wal = std::fs::metadata(db.join("store.sqlite-wal")).map(|m| m.len()).unwrap_or(0);
    assert!(wal > 0 && db.join("store.sqlite-shm").exists(), "the delete's commit is in the WAL");
    let bare = tmp.path().join("bare");
    std::fs::create_dir_all(bare.join("states")).unwrap();
    for f in ["store.sqlite", "store.sqlite-wal"] {
        std::fs::copy(db.join(f), bare.join(f)).unwrap();
    }
    read_only(0o555);
    std::fs::set_permissions(&bare, std::fs::Permissions::from_mode(0o555)).unwrap();
    let (success, stdout, stderr) = picaso(&["stats", "--db", dbs, "--json"]);
    assert!(success && stdout.contains("\"contexts\":3"), "the WAL's commit is read: {stdout} {stderr}");
    let (success, _, stderr) = picaso(&["stats", "--db", bare.to_str().unwrap()]);
    let way_out =
        stderr.contains("left commits in store.sqlite-wal") && stderr.contains("where the folder is writable");
    assert!(!success && way_out, "{stderr}");
    read_only(0o755);
    std::fs::set_permissions(&bare, std::fs::Permissions::from_mode(0o755)).unwrap();
    drop(keep);
}

/// Metadata: a JSON line's other fields travel with each of its document's contexts (records,
/// `contexts --json`, `query --json`); `query --filter` retrieves only matching contexts, and
/// refuses a filter nothing matches or that is malformed; a document whose metadata changes
/// and text does not keeps its contexts (ids and states) and takes the new metadata.
#[test]
fn metadata_travels_with_contexts_and_filters_retrieval() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let (m, e) = (model.path().to_str().unwrap(), embedder.to_str().unwrap());
    let jsonl = tmp.path().join("docs.jsonl");
    let lines = |url_a: &str| {
        [
            serde_json::json!({"id": "a", "text": "Cats are small carnivorous mammals.\n\nThey purr when content.",
                               "lang": "en", "year": 2024, "url": url_a}),
            serde_json::json!({"id": "b", "text": "Les chats sont de petits mammifères carnivores.", "lang": "fr", "year": 2023}),
            serde_json::json!({"id": "c", "text": "The Eiffel Tower is in Paris.", "lang": "en", "year": "2024",
                               "by": [{"name": "Ann"}]}),
            serde_json::json!({"id": "d", "text": "Mamba is a state space model."}),
        ]
        .iter()
        .map(|v| v.to_string() + "\n")
        .collect::<String>()
    };
    std::fs::write(&jsonl, lines("https://a.example/1")).unwrap();
    let j = jsonl.to_str().unwrap();
    for db in backends(tmp.path(), "metadata") {
        eprintln!("backend {}", db.kind());
        let ingest = args(&["ingest"], &db, &["--model", m, "--embedder", e, "--jsonl", j, "--json"]);
        assert_eq!(ok_s(&ingest)["added"], 5);
        let store = picaso_store::Store::open(db.location()).unwrap();
        let a = store.document("a").unwrap();
        assert_eq!(a.len(), 2);
        for r in &a {
            assert_eq!(
                serde_json::Value::Object(r.metadata.clone()),
                serde_json::json!({"lang": "en", "year": 2024, "url": "https://a.example/1"})
            );
        }
        assert!(store.document("d").unwrap()[0].metadata.is_empty());
        let out = Command::new(common::picaso_bin()).args(args(&["contexts"], &db, &["--doc", "b", "--json"])).output();
        let listed = String::from_utf8(out.unwrap().stdout).unwrap();
        assert!(listed.contains(r#""metadata":{"lang":"fr","year":2023}"#), "{listed}");

        // The filtered ranking is the exhaustive one restricted to the matching contexts.
        let q = store.embedding(a[0].id).unwrap();
        let everything = store.search_exact(&q, 100).unwrap();
        let meta = |id: i64| store.get(id).unwrap().metadata;
        for (pairs, n) in [
            (&["lang=en"][..], 3),
            (&["year=2024"], 2),
            (&["year=\"2024\""], 1),
            (&["lang=en", "year=2024"], 2),
            (&["year<2024"], 1),
            (&["lang!=en"], 2),
            (&["year>=2023", "year<=2024.5"], 3),
            (&[r#"{"lang": {"$in": ["fr", "xx"]}}"#], 1),
            (&[r#"{"$or": [{"lang": "fr"}, {"year": "2024"}]}"#], 2),
            (&["url^=https://a.example/"], 2),
            (&["lang^=e", "url^=https://b."], 0),
        ] {
            let f = picaso_store::Filter::from_args(pairs).unwrap();
            let want: Vec<(i64, f32)> = everything.iter().filter(|(id, _)| f.matches(&meta(*id))).copied().collect();
            assert_eq!(want.len(), n, "{pairs:?}");
            assert_eq!(store.search_in(&q, 10, picaso_store::Scope::matching(&f)).unwrap(), want, "{pairs:?}");
        }
        let v = ok_s(&args(
            &["query"],
            &db,
            &["--model", m, "--embedder", e, "--k", "3", "--filter", "lang=fr", "--max-tokens", "2", "--json", "Cats"],
        ));
        let used = v["contexts"].as_array().unwrap();
        assert_eq!(used.len(), 1, "{v}");
        assert_eq!((used[0]["doc"].as_str(), used[0]["metadata"]["lang"].as_str()), (Some("b"), Some("fr")));
        let v = ok_s(&args(
            &["query"],
            &db,
            &[
                "--model",
                m,
                "--embedder",
                e,
                "--k",
                "3",
                "--filter",
                "year<2024",
                "--max-tokens",
                "2",
                "--json",
                "Cats",
            ],
        ));
        let used: Vec<&str> = v["contexts"].as_array().unwrap().iter().map(|c| c["doc"].as_str().unwrap()).collect();
        assert_eq!(used, ["b"], "{v}");
        for (filter, says) in [
            ("lang=de", "has metadata matching --filter lang=de"),
            ("lang", "expected KEY=VALUE"),
            ("=en", "the key is empty"),
            ("year>true", "compares with a number or a string"),
            (r#"{"lang": {"$like": "e"}}"#, "unknown operator \"$like\""),
            (r"lang~=\bx", "word boundaries"),
        ] {
            let (success, _, stderr) =
                run_s(&args(&["query"], &db, &["--model", m, "--embedder", e, "--filter", filter, "Cats"]));
            assert!(!success && stderr.contains(says), "{filter}: {stderr}");
        }
        let (success, _, stderr) =
            run_s(&args(&["query"], &db, &["--model", m, "--method", "naive", "--filter", "a=1", "Hi"]));
        assert!(!success && stderr.contains("--filter would be ignored"), "{stderr}");

        // New metadata, same text: the same contexts (ids, states) carry it.
        std::fs::write(&jsonl, lines("https://a.example/2")).unwrap();
        let v = ok_s(&ingest);
        assert_eq!(
            (v["added"].as_u64(), v["relabelled"].as_u64(), v["skipped"].as_u64()),
            (Some(0), Some(2), Some(5)),
            "{v}"
        );
        let after = store.document("a").unwrap();
        assert_eq!(after.iter().map(|r| r.id).collect::<Vec<_>>(), a.iter().map(|r| r.id).collect::<Vec<_>>());
        assert_eq!(
            after.iter().map(|r| &r.checksum).collect::<Vec<_>>(),
            a.iter().map(|r| &r.checksum).collect::<Vec<_>>()
        );
        assert!(after.iter().all(|r| r.metadata["url"] == "https://a.example/2"));
        assert_eq!(ok_s(&ingest)["relabelled"], 0, "nothing left to change");

        // Listing and removing by metadata.
        let listed = |filter: &str| -> Vec<String> {
            let out = Command::new(common::picaso_bin())
                .args(args(&["contexts"], &db, &["--filter", filter, "--json"]))
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let lines = String::from_utf8(out.stdout).unwrap();
            lines.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["doc"].to_string()).collect()
        };
        assert_eq!(listed("lang=en"), [r#""a""#, r#""a""#, r#""c""#]);
        assert_eq!(listed(r#"{"$or": [{"lang": "fr"}, {"year": "2024"}]}"#), [r#""b""#, r#""c""#]);
        assert_eq!(listed("url^=https://a."), [r#""a""#, r#""a""#]);
        let (success, stdout, stderr) = run_s(&args(&["contexts"], &db, &["--filter", "lang=de"]));
        assert!(success && stdout.is_null(), "an empty listing is no error: {stdout}");
        assert!(stderr.contains("no context of store") && stderr.contains("--filter lang=de"), "{stderr}");
        let (success, _, stderr) = run_s(&args(&["delete"], &db, &["--filter", "lang=de"]));
        assert!(!success && stderr.contains("nothing was removed"), "{stderr}");
        // What matched nothing says why, as far as counting tells.
        let (success, _, stderr) = run_s(&args(&["contexts"], &db, &["--filter", "lang=en", "--filter", "year>3000"]));
        let alone = r#"contexts each key passes alone: {"lang":"en"} 3, {"year":{"$gt":3000}} 0"#;
        assert!(success && stderr.contains(alone), "{stderr}");
        let within = r#"{"by": {"name": "Ann"}}"#;
        let instead = r#""by" holds a list in 1 context, and keys within objects do not enter lists: to test its elements, give {"by":{"$elemMatch":{"name":"Ann"}}}"#;
        let (success, _, stderr) =
            run_s(&args(&["query"], &db, &["--model", m, "--embedder", e, "--filter", within, "Hi"]));
        assert!(!success && stderr.contains(instead), "{stderr}");
        let (success, _, stderr) = run_s(&args(&["delete"], &db, &["--filter", within]));
        assert!(!success && stderr.contains(instead), "{stderr}");
        assert_eq!(listed(r#"{"by": {"$elemMatch": {"name": "Ann"}}}"#), [r#""c""#]);
        let v = ok_s(&args(&["delete"], &db, &["--filter", "year<2024", "--json"]));
        assert_eq!(v["deleted"].as_array().map(Vec::len), Some(1), "{v}");
        assert!(store.document("b").unwrap().is_empty(), "the one context of 2023 is gone");
        assert_eq!(store.ids().unwrap().len(), 4);
        std::fs::write(&jsonl, lines("https://a.example/1")).unwrap();
    }
}

/// A store with a state budget, cut short as a kill would cut it (an abort at the point where
/// an admission has written its objects but not yet marked them held, and where an eviction
/// has committed but not removed its objects): nothing is over the budget, no context lacks a
/// state it is said to hold, `check` reports the leftovers and `--repair` removes them, and
/// the store then answers as one that keeps every state.
#[test]
fn a_budgeted_store_cut_mid_admission_loses_nothing() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    std::fs::create_dir_all(&docs).unwrap();
    for i in 0..12 {
        std::fs::write(
            docs.join(format!("d{i:02}.txt")),
            format!("Document {i} talks about topic {i} at some length.\n"),
        )
        .unwrap();
    }
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let full = tmp.path().join("full");
    let cut = tmp.path().join("cut");
    ok(&["ingest", "--db", full.to_str().unwrap(), "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
    // The tiny model's state file is a few KiB: a budget of three of them.
    let one = {
        let (_, v, _) =
            run(&["ingest", "--db", cut.to_str().unwrap(), "--model", m, "--embedder", e, "--text-dir", d, "--json"]);
        v["store"]["state_bytes"].as_u64().unwrap() / 12
    };
    std::fs::remove_dir_all(&cut).unwrap();
    let budget_mb = format!("{}", (3 * one) as f64 / 1048576.0 + 1e-6);
    let ingest = |failpoint: &str| {
        Command::new(picaso_bin())
            .args(["ingest", "--db", cut.to_str().unwrap(), "--model", m, "--embedder", e, "--text-dir", d])
            .args(["--state-budget-mb", &budget_mb, "--json"])
            .env("PICASO_FAILPOINT", failpoint)
            .output()
            .unwrap()
    };
    let query = |db: &std::path::Path, failpoint: &str, prompt: &str| {
        let out = Command::new(picaso_bin())
            .args(["query", "--db", db.to_str().unwrap(), "--model", m, "--embedder", e, prompt])
            .args(["--k", "4", "--max-tokens", "4", "--json"])
            .env("PICASO_FAILPOINT", failpoint)
            .output()
            .unwrap();
        (out.status.success(), serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default())
    };
    let check = |repair: bool| {
        let mut a = vec!["check", "--db", cut.to_str().unwrap(), "--json"];
        if repair {
            a.extend(["--repair", "--model", m]);
        }
        let (_, v, stderr) = run(&a);
        assert!(v.is_object(), "check: {stderr}");
        v
    };
    let within_budget = |v: &serde_json::Value| {
        let b = &v["budget"];
        assert!(v["problems"].as_array().unwrap().is_empty(), "a held state without its object: {v}");
        assert!(b["stored_bytes"].as_u64().unwrap() <= b["budget_bytes"].as_u64().unwrap(), "over the budget: {v}");
    };
    // Cut after the first batch's admitted objects are written, before they are marked held.
    assert!(!ingest("budget-written").status.success(), "the failpoint ends the ingest");
    let found = check(false);
    within_budget(&found);
    assert!(!found["budget"]["unheld_objects"].as_array().unwrap().is_empty(), "the cut left objects: {found}");
    let repaired = check(true);
    assert!(repaired["repair"]["removed_objects"].as_u64().unwrap() > 0, "{repaired}");
    within_budget(&check(false));
    assert!(check(false)["budget"]["unheld_objects"].as_array().unwrap().is_empty());
    // The ingest runs again to the end; then queries, one of them cut mid-eviction.
    assert!(ingest("").status.success());
    let prompts = ["Document 3 talks", "topic 7 at length", "Document 11", "about topic 5", "Document 3 talks"];
    for (i, prompt) in prompts.iter().enumerate() {
        let failpoint = if i == 2 { "budget-evicted" } else { "" };
        let (done, answer) = query(&cut, failpoint, prompt);
        if failpoint.is_empty() {
            assert!(done);
            assert_eq!(answer["text"], query(&full, "", prompt).1["text"], "{prompt}");
        } else {
            assert!(!done, "the query should have evicted (and been cut there)");
        }
        within_budget(&check(false));
    }
    check(true);
    let last = check(false);
    within_budget(&last);
    assert_eq!(last["sound"].as_u64().unwrap() as usize + last["budget"]["not_held"].as_u64().unwrap() as usize, 12);
    // Ingesting the same documents again finds nothing to do: a state not held is not missing.
    let again = ingest("");
    assert!(again.status.success());
    let again: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!((again["skipped"].as_u64(), again["repaired"].as_u64()), (Some(12), Some(0)), "{again}");
    let (_, stats, _) = run(&["stats", "--db", cut.to_str().unwrap(), "--json"]);
    assert!(stats["budget"]["hits"].as_u64().unwrap() + stats["budget"]["misses"].as_u64().unwrap() >= 16, "{stats}");
    // A server over the budgeted store answers as one over the full store, and says what it
    // recomputed; /metrics carries the budget.
    let serve =
        |db: &std::path::Path| common::Server::start(&["--db", db.to_str().unwrap(), "--model", m, "--embedder", e]);
    let (a, b) = (serve(&cut), serve(&full));
    for prompt in ["topic 9 at length", "Document 2 talks", "topic 9 at length"] {
        let body = serde_json::json!({"prompt": prompt, "retrieve": 4, "max_tokens": 4, "temperature": 0});
        let (sa, va) = a.call_json("POST", "/v1/completions", Some(body.clone()));
        let (sb, vb) = b.call_json("POST", "/v1/completions", Some(body));
        assert_eq!((sa, sb), (200, 200), "{va} {vb}");
        assert_eq!(va["choices"][0]["text"], vb["choices"][0]["text"], "{prompt}");
        assert_eq!(vb["picaso"]["states_recomputed"], 0);
    }
    // Contexts added through the server enter the budget too.
    let (status, added) = a.call_json(
        "POST",
        "/v1/contexts",
        Some(serde_json::json!({"text": "A new context about topic 42.", "doc": "new"})),
    );
    assert_eq!(status, 201, "{added}");
    assert!(a.metric("picaso_state_budget_bytes") > 0.0);
    assert!(a.metric("picaso_state_budget_held_bytes") <= a.metric("picaso_state_budget_bytes"));
    assert_eq!(b.metric("picaso_state_budget_bytes"), 0.0);
}
