//! `picaso eval` and `picaso train compose` end to end on a small WikiText-style file with a
//! tiny random model: every method is scored, reports are written, fine-tuning runs with both
//! objectives, and bad input (no store, wrong model, k too large, not a halves store, bad
//! config) fails with a clear error.

mod common;

use std::path::Path;

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
        "max_k",
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

/// What a rejected or unusual run leaves behind: a refused setting writes nothing into --out
/// (so the corrected command is not blocked by a journal), a run with nothing to chart finishes
/// with a note instead of failing, and a run of one passage shows its intervals as n/a and can
/// be replotted.
#[test]
fn refused_settings_write_nothing_and_edge_runs_finish() {
    let (Some(model), Some(embedder)) = (text_model(3), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let data = wikitext(tmp.path());
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), data.to_str().unwrap());
    let db = tmp.path().join("db");
    let db_s = db.to_str().unwrap();
    ok(&["ingest", "--db", db_s, "--embedder", e, "--model", m, "--wikitext", d, "--segment", "halves", "--json"]);
    let p = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let fails = |args: &[&str], needle: &str| {
        let (success, _, stderr) = run(args);
        assert!(!success && stderr.contains(needle), "{args:?}: {stderr}");
    };
    // `eval wikitext --db DB --model M --out OUT MORE…`
    let wt = |out: &str, more: &[&str]| -> Vec<String> {
        let base = ["eval", "wikitext", "--db", db_s, "--model", m, "--out", out];
        base.iter().chain(more).map(|s| s.to_string()).collect()
    };
    let run_ok = |v: Vec<String>| ok(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let run_fails = |v: Vec<String>, needle: &str| fails(&v.iter().map(String::as_str).collect::<Vec<_>>(), needle);

    // 1. A k the store cannot supply is refused before the journal is made, so the corrected
    // command runs (it used to find a journal "of a run with other settings").
    let evk = p("evk");
    run_fails(wt(&evk, &["--ks", "1,50", "--sample", "2", "--methods", "picaso-r"]), "k = 50 contexts asked");
    assert!(!Path::new(&evk).exists(), "nothing written into --out");
    run_ok(wt(&evk, &["--ks", "1,2", "--sample", "2", "--methods", "picaso-r"]));
    let sc = p("sc");
    fails(&["eval", "scaling", "--db", db_s, "--model", m, "--out", &sc, "--ks", "1,50"], "k = 50");
    assert!(!Path::new(&sc).exists());

    // 2. Naive alone has no time to make a state and no gain over itself: the run finishes,
    // results.md says which charts are not drawn, and charts an earlier run left are removed.
    let nv = p("naive");
    run_ok(wt(&nv, &["--ks", "1", "--sample", "2", "--methods", "concat"]));
    assert!(Path::new(&nv).join("loss_vs_time.png").is_file() && Path::new(&nv).join("gain_at_max_k.png").is_file());
    run_ok(wt(&nv, &["--ks", "1", "--sample", "2", "--methods", "naive"]));
    let md = std::fs::read_to_string(Path::new(&nv).join("results.md")).unwrap();
    assert!(
        md.contains("Not drawn") && md.contains("`loss_vs_time.png`") && md.contains("`gain_at_max_k.png`"),
        "{md}"
    );
    assert!(!Path::new(&nv).join("loss_vs_time.png").exists(), "the earlier run's chart is gone");
    assert!(!Path::new(&nv).join("gain_at_max_k.png").exists() && !Path::new(&nv).join("journal.jsonl").exists());
    run_ok(wt(&nv, &["--ks", "1,2", "--sample", "2", "--methods", "naive"]));
    let md = std::fs::read_to_string(Path::new(&nv).join("results.md")).unwrap();
    assert!(md.contains("`gain_vs_k.png`") && Path::new(&nv).join("loss_vs_k.png").is_file(), "{md}");
    // Fidelity of Concat alone measures nothing: refused before anything is written.
    let fid = p("fid");
    fails(&["eval", "fidelity", "--db", db_s, "--model", m, "--out", &fid, "--methods", "concat"], "besides concat");
    assert!(!Path::new(&fid).exists());

    // 3. One passage: a mean without an interval, shown as n/a (empty in CSV, null in JSON),
    // and the folder can be replotted from its results.json.
    let one = p("one");
    run_ok(wt(&one, &["--ks", "1,2", "--sample", "1"]));
    let md = std::fs::read_to_string(Path::new(&one).join("results.md")).unwrap();
    let csv = std::fs::read_to_string(Path::new(&one).join("results.csv")).unwrap();
    assert!(!md.contains("NaN") && !csv.contains("NaN"), "{md}\n{csv}");
    assert!(md.contains("± n/a") && md.contains("No 95% confidence intervals") && !md.contains("half-width of a cell"));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(&one).join("results.json")).unwrap()).unwrap();
    assert!(r["report"]["cells"][0]["ci95"].is_null() && r["report"]["naive_ci95"].is_null(), "{r}");
    ok(&["eval", "replot", &one]);
    assert_eq!(std::fs::read_to_string(Path::new(&one).join("results.md")).unwrap(), md);
    let cu1 = p("cu1");
    ok(&["eval", "context-use", "--wikitext", d, "--model", m, "--out", &cu1, "--sample", "1"]);
    let md = std::fs::read_to_string(Path::new(&cu1).join("results.md")).unwrap();
    assert!(!md.contains("NaN") && md.contains("± n/a"), "{md}");
    let ord = p("ord1");
    ok(&[
        "eval",
        "order-sensitivity",
        "--db",
        db_s,
        "--model",
        m,
        "--out",
        &ord,
        "--ns",
        "2",
        "--orders",
        "2",
        "--sample",
        "1",
    ]);
    let md = std::fs::read_to_string(Path::new(&ord).join("results.md")).unwrap();
    assert!(!md.contains("NaN") && md.contains("± n/a"), "{md}");

    // 4. Context use samples among the eligible paragraphs (a previous one, 16 tokens or
    // more): each article has two, its short line is not one; a sample of 6 scores 6.
    let cu = p("cu6");
    ok(&["eval", "context-use", "--wikitext", d, "--model", m, "--out", &cu, "--sample", "6"]);
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(&cu).join("results.json")).unwrap()).unwrap();
    assert_eq!((r["report"]["passages"].as_u64(), r["report"]["eligible"].as_u64()), (Some(6), Some(6)), "{r}");
    fails(&["eval", "context-use", "--wikitext", d, "--model", m, "--out", &p("cu0"), "--sample", "0"], "sample of 0");

    // 5. A model's name names its results under --out: one that would leave it, or repeats,
    // is refused before anything runs.
    let abs = tmp.path().join("elsewhere");
    let cmp = p("cmp");
    for bad in [format!("{}={m}", abs.display()), format!("..={m}"), format!(".={m}"), format!("a/b={m}")] {
        fails(&["eval", "context-use", "--wikitext", d, "--model", m, "--compare", &bad, "--out", &cmp], "plain name");
        fails(&["eval", "recall", "--form", "natural", "--model", m, "--compare", &bad, "--out", &cmp], "plain name");
    }
    assert!(!abs.exists() && !Path::new(&cmp).exists());
    let twice = ["--compare", "a=x", "--compare", "a=y"];
    let mut args_cu = vec!["eval", "context-use", "--wikitext", d, "--model", m, "--out", &cmp];
    args_cu.extend(twice);
    fails(&args_cu, "already taken");
    let obqa = tmp.path().join("no-obqa");
    let finetuned = |models: &str, needle: &str| {
        let o = obqa.to_str().unwrap();
        fails(&["eval", "finetuned", "--db", db_s, "--obqa", o, "--models", models, "--out", &cmp], needle);
    };
    finetuned(&format!("..={m},.={m}"), "plain name");
    finetuned(&format!("a={m},a={m}"), "already taken");
    finetuned(&format!("{}={m}", abs.display()), "plain name");
    assert!(!abs.exists() && !Path::new(&cmp).exists());

    // 7. The eval's own flags in its messages, and an --out that is a file.
    fails(
        &[
            "eval",
            "wikitext",
            "--db",
            db_s,
            "--data",
            d,
            "--embedder",
            e,
            "--model",
            m,
            "--out",
            &p("mt"),
            "--min-tokens",
            "40",
        ],
        "pass --min-tokens 16",
    );
    let (_, _, stderr) =
        run(&["eval", "wikitext", "--db", db_s, "--data", d, "--model", m, "--out", &p("mt"), "--min-tokens", "40"]);
    assert!(!stderr.contains("--segment"), "{stderr}");
    fails(&["eval", "wikitext", "--db", db_s, "--model", m, "--out", &p("mt1"), "--min-tokens", "1"], "at least 2");
    let afile = tmp.path().join("afile");
    std::fs::write(&afile, "").unwrap();
    let af = afile.to_str().unwrap();
    fails(
        &["eval", "wikitext", "--db", db_s, "--model", m, "--out", af, "--ks", "1", "--sample", "2"],
        "a file, not a folder",
    );
    fails(&["eval", "context-use", "--wikitext", d, "--model", m, "--out", af], "a file, not a folder");
    fails(&["eval", "order-sensitivity", "--db", db_s, "--model", m, "--out", &p("o"), "--ns", "3,2"], "ascending");
    fails(&["eval", "order-sensitivity", "--db", db_s, "--model", m, "--out", &p("o"), "--ns", "2,2"], "ascending");
}
