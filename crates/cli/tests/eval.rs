//! `picaso eval` and `picaso train compose` end to end on a small WikiText-style file with a
//! tiny random model: every method is scored, reports are written, fine-tuning runs with both
//! objectives, and bad input (no store, wrong model, k too large, not a halves store, bad
//! config) fails with a clear error.

mod common;

use common::{ok, run, shared, text_model, wikitext};

#[test]
fn eval_and_compose_finetuning_end_to_end() {
    let (Some(model), Some(embedder)) = (text_model(3), shared("all-MiniLM-L6-v2")) else { return };
    let other = text_model(4).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let data = wikitext(tmp.path());
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), data.to_str().unwrap());
    let db = tmp.path().join("db");
    let db_s = db.to_str().unwrap();
    let out = tmp.path().join("wt");
    let out_s = out.to_str().unwrap();

    // The experiment ingests the halves, then scores every method for k = 1, 2.
    ok(&["eval", "wikitext", "--db", db_s, "--data", d, "--embedder", e, "--model", m, "--out", out_s, "--max-k", "2"]);
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(r["report"]["passages"], 9, "nine paragraphs, the heading and the short line skipped");
    assert_eq!(r["report"]["cells"].as_array().unwrap().len(), 14, "7 methods × 2 values of k");
    for f in ["results.csv", "results.md", "loss_vs_k.png", "gain_vs_k.png", "gain_at_max_k.png", "loss_vs_time.png"] {
        assert!(out.join(f).is_file(), "{f} written");
    }
    let md = std::fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| picaso-r |") && md.contains("Command: `"), "{md}");
    // With one context every method but naive starts from the context's own state: equal loss.
    let cells = r["report"]["cells"].as_array().unwrap();
    let at = |method: &str, k: u64| {
        cells.iter().find(|c| c["method"] == method && c["k"] == k).unwrap()["loss"].as_f64().unwrap()
    };
    for method in ["piconcat-r", "soup", "caso", "picaso-s", "picaso-r"] {
        assert!((at(method, 1) - at("concat", 1)).abs() < 1e-4, "{method} at k=1");
    }
    // `eval replot` rewrites the tables and charts from results.json alone, run info kept.
    let json = std::fs::read_to_string(out.join("results.json")).unwrap();
    for f in ["results.md", "results.csv", "gain_vs_k.png"] {
        std::fs::remove_file(out.join(f)).unwrap();
    }
    let (success, _, stderr) = run(&["eval", "replot", out_s]);
    assert!(success, "{stderr}");
    assert_eq!(std::fs::read_to_string(out.join("results.md")).unwrap(), md, "the same report");
    assert_eq!(std::fs::read_to_string(out.join("results.json")).unwrap(), json, "floats re-read exactly");
    assert!(out.join("results.csv").is_file() && out.join("gain_vs_k.png").is_file());
    let (success, _, stderr) = run(&["eval", "replot", tmp.path().to_str().unwrap()]);
    assert!(!success && stderr.contains("results.json"), "no results there: {stderr}");

    ok(&["eval", "context-use", "--wikitext", d, "--model", m, "--out", tmp.path().join("cu").to_str().unwrap()]);
    let cu = std::fs::read_to_string(tmp.path().join("cu/results.md")).unwrap();
    assert!(
        cu.contains("previous paragraph") && cu.contains("random paragraph") && cu.contains("Bits per byte"),
        "{cu}"
    );
    let cu: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("cu/results.json")).unwrap()).unwrap();
    assert!(cu["report"]["passages"].as_u64().unwrap() > 0, "{cu}");
    assert!(cu["bits_per_byte"]["bits_per_byte"].as_f64().unwrap() > 0.0, "{cu}");
    assert!(tmp.path().join("cu/change.png").is_file(), "the context-use chart");
    let rows = std::fs::read_to_string(tmp.path().join("cu/passages.csv")).unwrap();
    assert_eq!(rows.lines().count() as u64, 1 + cu["report"]["passages"].as_u64().unwrap(), "a row per passage");
    let (success, _, stderr) = run(&["eval", "replot", tmp.path().join("cu").to_str().unwrap()]);
    assert!(!success && stderr.contains("not the results of a WikiText"), "{stderr}");
    // --compare pairs another model passage by passage: the same model under another name
    // differs by exactly nothing; a name given to two models is refused.
    let cmp = tmp.path().join("cu-cmp");
    let same = format!("same={m}");
    ok(&[
        "eval",
        "context-use",
        "--wikitext",
        d,
        "--model",
        m,
        "--name",
        "first",
        "--compare",
        &same,
        "--out",
        cmp.to_str().unwrap(),
    ]);
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cmp.join("comparison.json")).unwrap()).unwrap();
    let rows = c[0]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 6, "{c}");
    assert_eq!(c[0]["passages"], cu["report"]["passages"]);
    for r in rows {
        assert_eq!(r["delta"].as_f64().unwrap(), 0.0, "{r}");
        assert_eq!(r["first"], r["other"], "{r}");
    }
    assert!(cmp.join("same/results.md").is_file() && cmp.join("comparison.csv").is_file());
    let md = std::fs::read_to_string(cmp.join("results.md")).unwrap();
    assert!(md.contains("## same against first") && md.contains("| change with the previous paragraph (%) |"), "{md}");
    let (success, _, stderr) = run(&[
        "eval",
        "context-use",
        "--wikitext",
        d,
        "--model",
        m,
        "--name",
        "x",
        "--compare",
        &format!("x={m}"),
        "--out",
        cmp.to_str().unwrap(),
    ]);
    assert!(!success && stderr.contains("already taken"), "{stderr}");

    // Fine-tuning with both objectives; a loadable model comes out.
    let cfg = tmp.path().join("ft.json");
    std::fs::write(&cfg, r#"{"batch": 2, "steps": 3, "warmup": 1, "lr": 1e-3, "min_lr": 1e-4, "max_k": 2, "val_k": 1, "val_every": 3, "val_passages": 2, "checkpoint_every": 2}"#).unwrap();
    let cfg_s = cfg.to_str().unwrap();
    for objective in ["bptc", "bp2c"] {
        let ft = tmp.path().join(objective);
        let v = ok(&[
            "train",
            "compose",
            "--objective",
            objective,
            "--db",
            db_s,
            "--model",
            m,
            "--config",
            cfg_s,
            "--out",
            ft.to_str().unwrap(),
        ]);
        assert_eq!(v["step"], 3);
        assert!(v["mean_step_seconds"].as_f64().unwrap() > 0.0);
        assert!(ft.join("model/model.safetensors").is_file() && ft.join("loss.png").is_file());
        ok(&["info", "--model", ft.join("model").to_str().unwrap(), "--json"]);
    }

    // Bad input.
    let fails = |args: &[&str], needle: &str| {
        let (success, _, stderr) = run(args);
        assert!(!success && stderr.contains(needle), "{args:?}: {stderr}");
    };
    let o = other.path().to_str().unwrap();
    fails(&["eval", "wikitext", "--db", db_s, "--model", o, "--out", out_s], "not of the given model");
    // ... unless the states are recomputed by that model: then it equals a store it ingested.
    let restated = tmp.path().join("restated");
    ok(&[
        "eval",
        "wikitext",
        "--db",
        db_s,
        "--model",
        o,
        "--out",
        restated.to_str().unwrap(),
        "--max-k",
        "2",
        "--restate",
    ]);
    let db2 = tmp.path().join("db2");
    let direct = tmp.path().join("direct");
    ok(&[
        "eval",
        "wikitext",
        "--db",
        db2.to_str().unwrap(),
        "--data",
        d,
        "--embedder",
        e,
        "--model",
        o,
        "--out",
        direct.to_str().unwrap(),
        "--max-k",
        "2",
    ]);
    let cells = |dir: &std::path::Path| {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
        v["report"]["cells"].as_array().unwrap().iter().map(|c| c["loss"].as_f64().unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(cells(&restated), cells(&direct), "restated states equal ingested ones");
    fails(&["eval", "wikitext", "--db", db_s, "--model", m, "--out", out_s, "--max-k", "50"], "k = 50 contexts asked");
    fails(
        &["eval", "wikitext", "--db", "/no/such/db", "--model", m, "--out", out_s],
        "pass --data FILE to build the store",
    );
    fails(
        &["eval", "wikitext", "--db", db_s, "--model", m, "--out", out_s, "--methods", "concatenate"],
        "unknown method",
    );
    fails(
        &["train", "compose", "--objective", "bptc", "--db", db_s, "--model", o, "--config", cfg_s, "--out", out_s],
        "ingest the passages with this model",
    );
    let restated = tmp.path().join("ft-restated");
    let v = ok(&[
        "train",
        "compose",
        "--objective",
        "bp2c",
        "--db",
        db_s,
        "--model",
        o,
        "--config",
        cfg_s,
        "--out",
        restated.to_str().unwrap(),
        "--restate",
    ]);
    assert_eq!(v["step"], 3);
    fails(
        &["train", "compose", "--objective", "sgd", "--db", db_s, "--model", m, "--config", cfg_s, "--out", out_s],
        "use bptc or bp2c",
    );
    let bad = tmp.path().join("bad.json");
    std::fs::write(&bad, std::fs::read_to_string(&cfg).unwrap().replace("\"val_k\": 1", "\"val_k\": 5")).unwrap();
    fails(
        &[
            "train",
            "compose",
            "--objective",
            "bptc",
            "--db",
            db_s,
            "--model",
            m,
            "--config",
            bad.to_str().unwrap(),
            "--out",
            out_s,
        ],
        "must not exceed max_k",
    );
    // A store cut into paragraphs, not halves.
    let docs = tmp.path().join("docs");
    common::write_docs(&docs);
    let pdb = tmp.path().join("pdb");
    ok(&[
        "ingest",
        "--db",
        pdb.to_str().unwrap(),
        "--embedder",
        e,
        "--model",
        m,
        "--text-dir",
        docs.to_str().unwrap(),
        "--json",
    ]);
    fails(&["eval", "wikitext", "--db", pdb.to_str().unwrap(), "--model", m, "--out", out_s], "--segment halves");
    // Mixing segmentations in one store is refused: (document, segment) would mean two texts.
    fails(
        &["ingest", "--db", db_s, "--embedder", e, "--model", m, "--wikitext", d, "--segment", "paragraph"],
        "ingested with segmentation halves",
    );
}
