//! The experiments beyond the WikiText table, end to end with a tiny random model: OpenBookQA
//! accuracy and attribution on a hand-made open book, MS MARCO attribution on the fixture,
//! order sensitivity, fidelity and scaling on a small WikiText store, the fine-tuned
//! comparison — and their bad input.

mod common;

use std::path::Path;

use common::{ok, run, shared, text_model, wikitext};
use serde_json::Value;

const FACTS: [&str; 8] = [
    "the sun is a source of light and heat",
    "plants need sunlight to grow",
    "water boils at one hundred degrees celsius",
    "a magnet attracts iron",
    "ice melts when it is heated",
    "an animal needs food to survive",
    "rain is a form of water falling from clouds",
    "copper conducts electricity",
];

fn question(id: &str, stem: &str, choices: [&str; 4], key: &str, fact: &str) -> String {
    let cs: Vec<String> = choices
        .iter()
        .zip(["A", "B", "C", "D"])
        .map(|(t, l)| format!(r#"{{"text": "{t}", "label": "{l}"}}"#))
        .collect();
    format!(
        r#"{{"id": "{id}", "question": {{"stem": "{stem}", "choices": [{}]}}, "fact1": "{fact}", "answerKey": "{key}"}}"#,
        cs.join(", ")
    )
}

/// An OpenBookQA-layout folder: Main/{openbook.txt,test.jsonl} and Additional/test_complete.jsonl.
fn openbookqa(dir: &Path) -> std::path::PathBuf {
    let main = dir.join("Main");
    std::fs::create_dir_all(&main).unwrap();
    std::fs::create_dir_all(dir.join("Additional")).unwrap();
    let book: Vec<String> = FACTS.iter().map(|f| format!("\"{f}\"")).collect();
    std::fs::write(main.join("openbook.txt"), book.join("\n") + "\n").unwrap();
    let qs = [
        question("q1", "What makes ice melt?", ["heat", "cold", "wind", "dark"], "A", FACTS[4]),
        question("q2", "Plants grow toward", ["rocks", "sunlight", "salt", "iron"], "B", FACTS[1]),
        question("q3", "A magnet will pick up", ["wood", "glass", "an iron nail", "paper"], "C", FACTS[3]),
    ];
    let plain: Vec<String> = qs.iter().map(|q| q.replace(r#""fact1": "#, r#""x": "#)).collect();
    std::fs::write(main.join("test.jsonl"), plain.join("\n") + "\n").unwrap();
    std::fs::write(dir.join("Additional/test_complete.jsonl"), qs.join("\n") + "\n").unwrap();
    main
}

fn results(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap()
}

fn fails(args: &[&str], needle: &str) {
    let (success, _, stderr) = run(args);
    assert!(!success && stderr.contains(needle), "{args:?}: {stderr}");
}

#[test]
fn openbookqa_attribution_and_msmarco() {
    let (Some(model), Some(embedder)) = (text_model(3), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let data = openbookqa(tmp.path());
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), data.to_str().unwrap());
    let out = tmp.path().join("obqa");

    ok(&[
        "eval",
        "openbookqa",
        "--data",
        d,
        "--embedder",
        e,
        "--model",
        m,
        "--out",
        out.to_str().unwrap(),
        "--ks",
        "1,2",
    ]);
    let r = results(&out);
    let cells = r["report"]["cells"].as_array().unwrap();
    assert_eq!(r["report"]["questions"], 3);
    assert_eq!(cells.len(), 1 + 6 * 2, "naive, then 6 methods × 2 values of k");
    for c in cells {
        let acc = c["acc"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc) && (acc * 3.0).fract().abs() < 1e-9, "{c}");
    }
    // One fact: every method starts from that fact's state, so all agree with concat.
    let at = |method: &str| cells.iter().find(|c| c["method"] == method && c["k"] == 1).unwrap()["acc_norm"].clone();
    for method in ["piconcat-r", "soup", "caso", "picaso-s", "picaso-r"] {
        assert_eq!(at(method), at("concat"), "{method}");
    }
    assert!(out.join("acc_norm_vs_k.png").is_file() && out.join("results.md").is_file());

    let attr = tmp.path().join("attr");
    ok(&[
        "eval",
        "attribution",
        "--data",
        d,
        "--embedder",
        e,
        "--model",
        m,
        "--out",
        attr.to_str().unwrap(),
        "--distractors",
        "2-3",
    ]);
    let r = results(&attr);
    assert_eq!(r["report"]["items"], 3, "every gold fact is found in the open book");
    assert_eq!(r["report"]["rows"].as_array().unwrap().len(), 6, "leave-one-in and 5 leave-one-out rules");
    let chance = r["report"]["chance"].as_f64().unwrap();
    assert!(chance > 0.25 && chance < 0.34, "1 gold among 3 or 4 candidates: {chance}");
    assert!(attr.join("precision.png").is_file(), "the attribution chart");

    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../eval/tests/fixtures/msmarco_v2.1_tiny.json");
    let ms = tmp.path().join("ms");
    ok(&["eval", "msmarco", "--data", fixture.to_str().unwrap(), "--model", m, "--out", ms.to_str().unwrap()]);
    let r = results(&ms);
    assert_eq!((r["report"]["items"].as_u64(), r["report"]["skipped"].as_u64()), (Some(3), Some(2)));

    // Bad input.
    let o = out.to_str().unwrap();
    fails(
        &["eval", "openbookqa", "--data", tmp.path().to_str().unwrap(), "--embedder", e, "--model", m, "--out", o],
        "openbook.txt",
    );
    fails(
        &["eval", "openbookqa", "--data", d, "--embedder", e, "--model", m, "--out", o, "--ks", "20"],
        "open book holds 8",
    );
    fails(&["eval", "openbookqa", "--data", d, "--embedder", e, "--model", m, "--out", o, "--ks", "3,2"], "ascending");
    fails(
        &["eval", "attribution", "--data", d, "--embedder", e, "--model", m, "--out", o, "--distractors", "x"],
        "MIN-MAX",
    );
    fails(
        &["eval", "attribution", "--data", d, "--embedder", e, "--model", m, "--out", o, "--distractors", "4-20"],
        "1 ≤ min ≤ max",
    );
    // Settings are checked before the open book is processed and embedded: with an embedder
    // that is not there, the setting is what is refused.
    let no_embedder = tmp.path().join("no-embedder");
    let ne = no_embedder.to_str().unwrap();
    for (more, needle) in [
        (["--ks", "0"], "at least 1"),
        (["--ks", "20"], "open book holds 8"),
        (["--sample", "0"], "sample of 0"),
        (["--split", "train"], "possible values: test, dev"),
    ] {
        let mut args = vec!["eval", "openbookqa", "--data", d, "--embedder", ne, "--model", m, "--out", o];
        args.extend(more);
        fails(&args, needle);
    }
    // (The book's 8 facts allow up to 7 distractors.)
    for (more, needle) in
        [(&["--distractors", "5-4"][..], "1 ≤ min ≤ max"), (&["--distractors", "2-3", "--sample", "0"], "sample of 0")]
    {
        let mut args = vec!["eval", "attribution", "--data", d, "--embedder", ne, "--model", m, "--out", o];
        args.extend(more);
        fails(&args, needle);
    }
    // One question and Naive alone: no interval (n/a), no gain over Naive to chart (noted), and
    // the run finishes.
    let one = tmp.path().join("obqa-one");
    let one_s = one.to_str().unwrap();
    let args = ["--data", d, "--embedder", e, "--model", m, "--out", one_s, "--sample", "1"];
    ok(&[&["eval", "openbookqa"][..], &args, &["--ks", "1,2", "--methods", "naive"]].concat());
    let md = std::fs::read_to_string(one.join("results.md")).unwrap();
    assert!(md.contains("1 test question,") && md.contains("about n/a points"), "{md}");
    assert!(md.contains("Not drawn") && md.contains("`gain_vs_k.png`") && !md.contains("NaN"), "{md}");
    assert!(one.join("acc_norm_vs_k.png").is_file() && !one.join("gain_vs_k.png").exists());
    ok(&[&["eval", "attribution"][..], &args, &["--distractors", "2"]].concat());
    let md = std::fs::read_to_string(one.join("results.md")).unwrap();
    assert!(md.contains("± n/a") && !md.contains("NaN"), "{md}");
    std::fs::write(data.join("test.jsonl"), "{\"id\": 1}\n").unwrap();
    fails(
        &["eval", "openbookqa", "--data", d, "--embedder", e, "--model", m, "--out", o],
        "test.jsonl:1: not an OpenBookQA question",
    );
    fails(&["eval", "msmarco", "--data", d, "--model", m, "--out", o], "MS MARCO v2.1");
}

#[test]
fn order_fidelity_scaling_and_finetuned() {
    let (Some(model), Some(embedder)) = (text_model(3), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let wt = wikitext(tmp.path());
    let obqa = openbookqa(tmp.path());
    let (m, e) = (model.path().to_str().unwrap(), embedder.to_str().unwrap());
    let db = tmp.path().join("db");
    let db_s = db.to_str().unwrap();
    ok(&[
        "ingest",
        "--db",
        db_s,
        "--embedder",
        e,
        "--model",
        m,
        "--wikitext",
        wt.to_str().unwrap(),
        "--segment",
        "halves",
        "--json",
    ]);

    let ord = tmp.path().join("order");
    ok(&[
        "eval",
        "order-sensitivity",
        "--db",
        db_s,
        "--model",
        m,
        "--out",
        ord.to_str().unwrap(),
        "--ns",
        "2,3",
        "--orders",
        "4",
    ]);
    let r = results(&ord);
    let rows = r["report"]["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 8, "4 methods × 2 values of n");
    for row in rows.iter().filter(|r| r["method"] == "picaso-s") {
        assert!(row["range"].as_f64().unwrap() < 1e-4, "PICASO-S does not depend on the order: {row}");
    }
    assert!(r["report"]["picaso_s_order_gap"].as_f64().unwrap() < 1e-4);
    assert!(ord.join("range_vs_n.png").is_file());

    let fid = tmp.path().join("fidelity");
    ok(&["eval", "fidelity", "--db", db_s, "--model", m, "--out", fid.to_str().unwrap(), "--ks", "1,2"]);
    let r = results(&fid);
    for row in r["report"]["rows"].as_array().unwrap() {
        let d: Vec<f64> = row["relative_distance"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        match (row["method"].as_str().unwrap(), row["k"].as_u64().unwrap()) {
            ("naive", _) => assert!(d.iter().all(|x| (x - 1.0).abs() < 1e-9), "the zero state is 100% away: {row}"),
            (_, 1) => assert!(d.iter().all(|x| *x < 1e-4) && row["kl"].as_f64().unwrap() < 1e-6, "{row}"),
            _ => assert!(row["kl"].as_f64().unwrap() >= -1e-9),
        }
    }

    let sc = tmp.path().join("scaling");
    ok(&["eval", "scaling", "--db", db_s, "--model", m, "--out", sc.to_str().unwrap(), "--ks", "1,4"]);
    let md = std::fs::read_to_string(sc.join("results.md")).unwrap();
    assert!(md.contains("| k=4 |") && md.contains("speed-up"), "{md}");
    assert!(!sc.join("journal.jsonl").exists(), "a finished run's journal is closed");
    let kept = std::fs::read_to_string(sc.join("passages.jsonl")).expect("and kept as passages.jsonl");
    assert!(kept.lines().count() >= 2, "a header and the passages: {kept}");

    // A stopped run resumes from its journal. Here the report cannot be written (results.md is
    // a folder), so the journal of every scored passage stays; a run with the same settings
    // then takes its passages from it instead of scoring them again.
    let wk = tmp.path().join("wikitext-resume");
    std::fs::create_dir_all(wk.join("results.md")).unwrap();
    let args = ["eval", "wikitext", "--db", db_s, "--model", m, "--out", wk.to_str().unwrap(), "--ks", "1,2"];
    assert!(!run(&args).0, "the report cannot be written");
    let journal = wk.join("journal.jsonl");
    let text = std::fs::read_to_string(&journal).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let passages = lines.len() - 1;
    assert!(passages >= 2, "{text}");
    // Mark the first passage's Naive loss, and tear a last line as a kill mid-write would.
    let mut first: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
    first["naive"] = serde_json::json!(1000.0);
    lines[1] = first.to_string();
    std::fs::write(&journal, lines.join("\n") + "\n" + "{\"query_tok").unwrap();
    std::fs::remove_dir(wk.join("results.md")).unwrap();
    ok(&args);
    let naive = results(&wk)["report"]["naive_loss"].as_f64().unwrap();
    assert!(naive > 1000.0 / passages as f64, "the journaled passage was not scored again: naive {naive}");
    assert!(!journal.exists());
    // A journal of other settings is refused, with what to do.
    std::fs::remove_file(wk.join("results.md")).unwrap();
    std::fs::create_dir_all(wk.join("results.md")).unwrap();
    assert!(!run(&args).0);
    std::fs::remove_dir(wk.join("results.md")).unwrap();
    let other = ["eval", "wikitext", "--db", db_s, "--model", m, "--out", wk.to_str().unwrap(), "--ks", "1,3"];
    fails(&other, "delete it to start over");

    let other = text_model(4).unwrap();
    let ft = tmp.path().join("ft");
    let finetuned = |models: &str| {
        run(&[
            "eval",
            "finetuned",
            "--db",
            db_s,
            "--embedder",
            e,
            "--obqa",
            obqa.to_str().unwrap(),
            "--models",
            models,
            "--out",
            ft.to_str().unwrap(),
            "--ks",
            "2",
            "--obqa-ks",
            "1,2",
        ])
    };
    // Stopped at its second model (here: a folder that is not there), the run keeps the first
    // model's journal, and the next run takes that model's passages from it.
    let missing = tmp.path().join("no-such-model");
    assert!(!finetuned(&format!("zero-shot={m},other={}", missing.display())).0, "the second model is missing");
    let zs_journal = ft.join("zero-shot/wikitext/journal.jsonl");
    let text = std::fs::read_to_string(&zs_journal).expect("the finished model's journal stays");
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let mut first: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
    first["naive"] = serde_json::json!(1000.0);
    lines[1] = first.to_string();
    std::fs::write(&zs_journal, lines.join("\n") + "\n").unwrap();
    // A third model pairs with both earlier ones (fine-tuned models against each other).
    let models = format!("zero-shot={m},other={},third={m}", other.path().to_str().unwrap());
    let (done, _, out) = finetuned(&models);
    assert!(done, "{out}");
    let naive = results(&ft.join("zero-shot/wikitext"))["report"]["naive_loss"].as_f64().unwrap();
    assert!(naive > 1000.0 / (lines.len() - 1) as f64, "the journaled model was scored again: naive {naive}");
    for name in ["zero-shot", "other", "third"] {
        assert!(!ft.join(name).join("wikitext/journal.jsonl").exists(), "{name}: a finished run's journals close");
        assert!(ft.join(name).join("wikitext/passages.jsonl").is_file(), "{name}: and stay as passages.jsonl");
    }
    let md = std::fs::read_to_string(ft.join("results.md")).unwrap();
    assert!(md.contains("| other | picaso-r |") && md.contains("| zero-shot | naive |"), "{md}");
    // Each model against every earlier one, paired: every method, and its PICASO-R against
    // the earlier model's Concat; OpenBookQA's acc_norm likewise.
    assert!(
        md.contains("| other | naive | zero-shot naive | ") && md.contains("| other | picaso-r | zero-shot concat | "),
        "{md}"
    );
    assert!(md.contains("| third | picaso-r | other picaso-r | ") && md.contains("| third | soup | other "), "{md}");
    // The third model is the first one again: every pair with it is exactly zero.
    assert!(md.contains("| third | picaso-r | zero-shot picaso-r | +0.0000 ± 0.0000 |"), "{md}");
    assert!(md.contains("| third | picaso-r | zero-shot | +0.0 ± 0.0 |"), "{md}");
    assert!(md.contains("acc_norm of each model minus an earlier model's"), "{md}");
    assert!(ft.join("other/wikitext/results.json").is_file() && ft.join("zero-shot/openbookqa/results.json").is_file());
    assert!(ft.join("gain_vs_first_naive.png").is_file() && md.contains("](gain_vs_first_naive.png)"), "{md}");

    // Bad input.
    let o = ft.to_str().unwrap();
    fails(&["eval", "order-sensitivity", "--db", db_s, "--model", m, "--out", o, "--ns", "1,2"], "at least 2");
    fails(&["eval", "fidelity", "--db", db_s, "--model", m, "--out", o, "--ks", "1,50"], "k = 50 contexts asked");
    fails(
        &["eval", "scaling", "--db", db_s, "--model", other.path().to_str().unwrap(), "--out", o],
        "not of the given model",
    );
    let (done, _, err) = finetuned(m);
    assert!(!done && err.contains("NAME=DIR"), "{err}");
}
