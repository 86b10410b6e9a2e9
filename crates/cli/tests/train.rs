//! `picaso train pretrain` end to end on a small generated corpus: trains a tokenizer and a
//! model, stops and resumes, writes a loadable model folder and a loss curve; bad input fails
//! with a clear error.

use std::process::{Command, Output};

fn picaso(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picaso")).args(args).output().unwrap()
}

#[test]
fn pretrain_stops_resumes_and_writes_a_usable_model() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    let animals = ["cat", "dog", "horse", "bird", "fish"];
    let text: Vec<String> = (0..400)
        .map(|i| {
            format!("The {} sat near the {} on day {}. It was happy.", animals[i % 5], animals[(i / 5) % 5], i % 31)
        })
        .collect();
    std::fs::write(corpus.join("a.txt"), text.join("\n\n")).unwrap();
    let cfg = tmp.path().join("cfg.json");
    std::fs::write(
        &cfg,
        r#"{"d_model": 32, "n_layer": 2, "d_state": 8, "headdim": 8, "vocab": 320, "val_fraction": 0.1,
            "seq_len": 32, "batch": 2, "steps": 12, "warmup": 2, "lr": 3e-3, "min_lr": 3e-4,
            "val_every": 4, "val_sequences": 2, "checkpoint_every": 4}"#,
    )
    .unwrap();
    let out = tmp.path().join("run");
    let (c, cfg_s, out_s) = (format!("text:{}", corpus.display()), cfg.to_str().unwrap(), out.to_str().unwrap());
    // --stop-after 0: the tokenizer and the token cache only (what scripts/train_gpu.py reads).
    let zero = picaso(&["train", "pretrain", "--corpus", &c, "--config", cfg_s, "--out", out_s, "--stop-after", "0"]);
    assert!(zero.status.success(), "{}", String::from_utf8_lossy(&zero.stderr));
    assert!(out.join("tokens.bin").is_file() && out.join("tokenizer.json").is_file());
    assert!(!out.join("checkpoint").exists() && !out.join("model").exists());
    let first = picaso(&["train", "pretrain", "--corpus", &c, "--config", cfg_s, "--out", out_s, "--stop-after", "5"]);
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let v: serde_json::Value = serde_json::from_slice(&first.stdout).unwrap();
    assert_eq!(v["step"], 5);
    let done = picaso(&["train", "pretrain", "--corpus", &c, "--config", cfg_s, "--out", out_s]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let v: serde_json::Value = serde_json::from_slice(&done.stdout).unwrap();
    assert_eq!(v["step"], 12);
    let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
    assert_eq!(csv.lines().count(), 13, "a header and one row per step");
    assert_eq!(&std::fs::read(out.join("loss.png")).unwrap()[1..4], b"PNG");
    let model = out.join("model");
    let g =
        picaso(&["generate", "--model", model.to_str().unwrap(), "--prompt", "The cat", "--max-tokens", "4", "--json"]);
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));

    // Bad input: no corpus, an empty corpus, another config over the same checkpoint.
    let fails = |args: &[&str], needle: &str| {
        let o = picaso(args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(needle) && !e.contains("panicked"), "{args:?}: {e}");
    };
    fails(
        &["train", "pretrain", "--corpus", "text:/no/such/corpus", "--config", cfg_s, "--out", out_s],
        "/no/such/corpus",
    );
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    std::fs::write(empty.join("e.txt"), "\n \n").unwrap();
    fails(
        &["train", "pretrain", "--corpus", &format!("text:{}", empty.display()), "--config", cfg_s, "--out", out_s],
        "holds no text",
    );
    let cfg2 = tmp.path().join("cfg2.json");
    std::fs::write(&cfg2, std::fs::read_to_string(&cfg).unwrap().replace("\"steps\": 12", "\"steps\": 20")).unwrap();
    fails(
        &["train", "pretrain", "--corpus", &c, "--config", cfg2.to_str().unwrap(), "--out", out_s],
        "another configuration",
    );
    fails(&["train", "pretrain", "--corpus", "blob:x", "--config", cfg_s, "--out", out_s], "unknown corpus kind");
    // A config that cannot fit in memory is refused before any work.
    let huge = tmp.path().join("huge.json");
    std::fs::write(&huge, std::fs::read_to_string(&cfg).unwrap().replace("\"batch\": 2", "\"batch\": 2000000"))
        .unwrap();
    let huge_out = tmp.path().join("huge");
    fails(
        &["train", "pretrain", "--corpus", &c, "--config", huge.to_str().unwrap(), "--out", huge_out.to_str().unwrap()],
        "GiB of memory",
    );
}

/// Fails with a message holding `needle`, without a panic.
fn fails(args: &[&str], needle: &str) {
    let o = picaso(args);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains(needle) && !e.contains("panicked"), "{args:?}: {e}");
}

/// Settings that would make training go backwards or stand still are refused before any
/// work, naming the field, its value and the allowed range; a validation split too short for
/// a window says what would lengthen it.
#[test]
fn bad_run_settings_are_refused_naming_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("a.txt");
    let text: Vec<String> = (0..40).map(|i| format!("Paragraph {i} is about the number {}.", i % 7)).collect();
    std::fs::write(&corpus, text.join("\n\n")).unwrap();
    let c = format!("text:{}", corpus.display());
    let base = r#"{"d_model": 32, "n_layer": 1, "d_state": 8, "headdim": 8, "vocab": 300, "val_fraction": 0.1,
        "seq_len": 16, "batch": 2, "steps": 2, "warmup": 1, "lr": 3e-3, "min_lr": 3e-4, "clip": 1.0,
        "val_every": 1, "val_sequences": 1, "checkpoint_every": 1}"#;
    let out = tmp.path().join("run");
    let run_with = |from: &str, to: &str, needle: &str| {
        let cfg = tmp.path().join("cfg.json");
        assert!(base.contains(from), "{from}");
        std::fs::write(&cfg, base.replace(from, to)).unwrap();
        fails(
            &["train", "pretrain", "--corpus", &c, "--config", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()],
            needle,
        );
    };
    run_with("\"lr\": 3e-3", "\"lr\": -0.003", "lr = -0.003: the peak learning rate must be a number above 0");
    run_with(
        "\"min_lr\": 3e-4",
        "\"min_lr\": 0.01",
        "min_lr = 0.01: the final learning rate must be from 0 to lr (0.003)",
    );
    run_with("\"clip\": 1.0", "\"clip\": -1", "clip = -1: the gradient-norm limit must be a number above 0");
    run_with("\"clip\": 1.0", "\"clip\": 0", "clip = 0: the gradient-norm limit must be a number above 0");
    run_with("\"val_fraction\": 0.1", "\"val_fraction\": 1.5", "val_fraction = 1.5: the share of documents held out");
    run_with("\"val_fraction\": 0.1", "\"val_fraction\": 0", "val_fraction = 0:");
    run_with("\"batch\": 2", "\"batch\": 0", "batch = 0: must be at least 1");
    run_with("\"warmup\": 1", "\"warmup\": 3", "warmup = 3: must be at most steps (2)");
    run_with("\"clip\": 1.0", "\"clip\": 1.0, \"weight_decay\": -0.1", "weight_decay = -0.1");
    run_with("\"clip\": 1.0", "\"clip\": 1.0, \"init\": {\"long_memory\": 2}", "init.long_memory = 2");
    assert!(!out.join("checkpoint").exists(), "nothing was trained");

    // A recall sequence needs room for its facts and a query.
    let recall = tmp.path().join("recall.json");
    std::fs::write(
        &recall,
        base.replace("\"seq_len\": 16", "\"seq_len\": 1").replace(
            "\"clip\": 1.0",
            "\"clip\": 1.0, \"sampler\": \"epochs\", \"recall\": {\"keys\": 8, \"values\": 8, \"facts\": 2, \"max_k\": 2, \"sequences\": 10}",
        ),
    )
    .unwrap();
    fails(
        &["train", "pretrain", "--config", recall.to_str().unwrap(), "--out", out.to_str().unwrap()],
        "seq_len = 1: a recall sequence of up to 2 contexts (max_k) of 2 facts, a query and an end-of-text needs a seq_len of at least 12",
    );

    // Validation holds out whole documents: one document cannot be split, and five at one in
    // ten hold none out.
    let cfg = tmp.path().join("cfg.json");
    std::fs::write(&cfg, base).unwrap();
    let one = tmp.path().join("one.txt");
    std::fs::write(&one, text.join(" ")).unwrap();
    let (cfg_s, out_s) = (cfg.to_str().unwrap(), out.to_str().unwrap());
    fails(
        &["train", "pretrain", "--corpus", &format!("text:{}", one.display()), "--config", cfg_s, "--out", out_s],
        "there are 1; give at least two documents",
    );
    let five = tmp.path().join("five.txt");
    std::fs::write(&five, text[..5].join("\n\n")).unwrap();
    let out5 = tmp.path().join("run5");
    fails(
        &[
            "train",
            "pretrain",
            "--corpus",
            &format!("text:{}", five.display()),
            "--config",
            cfg_s,
            "--out",
            out5.to_str().unwrap(),
        ],
        "raise val_fraction to at least 1/5",
    );
}

/// `--train-stream` trains on given token ids in place of the corpora's training text (the
/// corpora still give validation), a resume refuses a different stream, and a bad file is named.
#[test]
fn a_train_stream_replaces_the_training_text() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = tmp.path().join("a.txt");
    let text: Vec<String> = (0..300).map(|i| format!("Paragraph {i} names the river {} twice.", i % 17)).collect();
    std::fs::write(&corpus, text.join("\n\n")).unwrap();
    let cfg = tmp.path().join("cfg.json");
    std::fs::write(
        &cfg,
        r#"{"d_model": 32, "n_layer": 1, "d_state": 8, "headdim": 8, "vocab": 300, "val_fraction": 0.1,
            "seq_len": 16, "batch": 2, "steps": 6, "warmup": 1, "lr": 3e-3, "min_lr": 3e-4,
            "val_every": 3, "val_sequences": 2, "checkpoint_every": 3}"#,
    )
    .unwrap();
    let (c, cfg_s) = (format!("text:{}", corpus.display()), cfg.to_str().unwrap());
    let tok_run = tmp.path().join("tok");
    let o = picaso(&[
        "train",
        "pretrain",
        "--corpus",
        &c,
        "--config",
        cfg_s,
        "--out",
        tok_run.to_str().unwrap(),
        "--stop-after",
        "0",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tok = tok_run.join("tokenizer.json");
    let write = |name: &str, ids: &[u16]| {
        let p = tmp.path().join(name);
        std::fs::write(&p, ids.iter().flat_map(|i| i.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        p
    };
    let stream = write("s.u16", &(0..400).map(|i| (i * 7 % 250) as u16).collect::<Vec<_>>());
    let other = write("t.u16", &(0..400).map(|i| (i * 11 % 250) as u16).collect::<Vec<_>>());
    let out = tmp.path().join("run");
    let args = |s: &std::path::Path, stop: &'static str| -> Vec<String> {
        let mut v: Vec<String> = ["train", "pretrain", "--corpus", &c, "--config", cfg_s, "--tokenizer"]
            .iter()
            .map(|x| x.to_string())
            .collect();
        v.extend([tok.display().to_string(), "--out".into(), out.display().to_string()]);
        v.extend(["--train-stream".into(), s.display().to_string(), "--stop-after".into(), stop.into()]);
        v
    };
    let run = |v: Vec<String>| picaso(&v.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(args(&stream, "3"));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{e}");
    assert!(e.contains("400 training tokens in place of the corpora's"), "{e}");
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("checkpoint").join("trainer.json")).unwrap()).unwrap();
    assert!(state["config"]["train_stream"].is_string(), "the checkpoint records the stream's fingerprint");
    let fails = |v: Vec<String>, needle: &str| {
        let o = run(v);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(needle) && !e.contains("panicked"), "{e}");
    };
    fails(args(&other, "3"), "another configuration");
    let o = run(args(&stream, "3"));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["step"], 6);
    let bin = write("s.bin", &[1, 2, 3]);
    fails(args(&bin, "1"), ".u16 or .u32");
    let big = write("big.u16", &[1, 2, 60000]);
    fails(args(&big, "1"), "token 2 is id 60000, outside the tokenizer's");
    let odd = tmp.path().join("odd.u32");
    std::fs::write(&odd, [1u8, 0, 0, 0, 2, 0]).unwrap();
    fails(args(&odd, "1"), "not a whole number of 4-byte ids");
}

#[test]
fn plot_draws_a_training_log_and_names_a_bad_line() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("log.jsonl");
    std::fs::write(
        &log,
        "{\"step\": 50, \"tokens\": 1000, \"loss\": 7.0}\n{\"step\": 100, \"tokens\": 2000, \"loss\": 6.0, \"val_loss\": 6.2}\n",
    )
    .unwrap();
    let png = tmp.path().join("loss.png");
    let out = picaso(&["train", "plot", "--log", log.to_str().unwrap(), "--out", png.to_str().unwrap()]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");

    std::fs::write(&log, "{\"step\": 50, \"tokens\": 1000, \"loss\": 7.0}\n{\"step\": 100}\n").unwrap();
    let out = picaso(&["train", "plot", "--log", log.to_str().unwrap(), "--out", png.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2") && err.contains("tokens"), "{err}");
}

/// `train plot-context` reads both trainers' logs (JSON lines; a model folder's progress.json),
/// prints the drop in nats and percent per check, draws the chart, and names a log without any
/// check.
#[test]
fn plot_context_compares_logs_and_names_a_log_without_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let gpu = tmp.path().join("gpu.jsonl");
    std::fs::write(
        &gpu,
        "{\"step\": 50, \"tokens\": 1000, \"loss\": 7.0}\n\
         {\"step\": 100, \"tokens\": 2000000, \"loss\": 6.0, \"context_use\": {\"none\": 4.0, \"previous\": 3.9, \"random\": 4.1}}\n",
    )
    .unwrap();
    // A model folder of `picaso train pretrain`: its progress.json.
    let cpu = tmp.path().join("cpu-model");
    std::fs::create_dir(&cpu).unwrap();
    std::fs::write(
        cpu.join("progress.json"),
        "{\"config\": {}, \"step\": 10, \"history\": [{\"step\": 5, \"tokens\": 250000, \"loss\": 6.0}, \
         {\"step\": 10, \"tokens\": 500000, \"loss\": 5.0, \"context\": {\"pairs\": 3, \"none\": 5.0, \
         \"previous\": 4.5, \"random\": 5.25, \"gain\": 0.1, \"random_gain\": -0.05}}], \"notes\": []}",
    )
    .unwrap();
    let png = tmp.path().join("gain.png");
    let arg = |name: &str, p: &std::path::Path| format!("{name}={}", p.display());
    let out = picaso(&[
        "train",
        "plot-context",
        "--log",
        &arg("gpu", &gpu),
        "--log",
        &arg("cpu", &cpu),
        "--out",
        png.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(&std::fs::read(&png).unwrap()[1..4], b"PNG");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("| gpu | 2.0 | 4.0000 | -0.1000 | 2.50% | +0.1000 |"), "{table}");
    assert!(table.contains("| cpu | 0.5 | 5.0000 | -0.5000 | 10.00% | +0.2500 |"), "{table}");

    let plain = tmp.path().join("plain.jsonl");
    std::fs::write(&plain, "{\"step\": 50, \"tokens\": 1000, \"loss\": 7.0}\n").unwrap();
    // A bad log after a good one: the error, and no half-printed table.
    let out = picaso(&[
        "train",
        "plot-context",
        "--log",
        &arg("gpu", &gpu),
        "--log",
        &arg("p", &plain),
        "--out",
        png.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no row has a context-use check"));
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    let out = picaso(&["train", "plot-context", "--log", plain.to_str().unwrap(), "--out", png.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("give NAME=PATH"));
}

/// The recall pipeline end to end at toy size: a config with a `recall` section trains on
/// generated MQAR sequences; `eval recall` scores the model; `train compose` fine-tunes it on
/// recall episodes; `eval recall --compare` pairs the two models on the same queries. Bad
/// arguments get clear errors.
#[test]
fn recall_trains_evaluates_and_finetunes() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    std::fs::write(
        p("cfg.json"),
        r#"{"d_model": 32, "n_layer": 1, "d_state": 8, "headdim": 8, "seq_len": 40, "batch": 4, "steps": 6,
            "warmup": 1, "lr": 3e-3, "min_lr": 3e-4, "val_every": 3, "val_sequences": 2, "checkpoint_every": 3,
            "val_fraction": 0.1, "sampler": "epochs",
            "recall": {"keys": 16, "values": 16, "facts": 2, "max_k": 4, "sequences": 60}}"#,
    )
    .unwrap();
    let out = p("run");
    let o = picaso(&["train", "pretrain", "--config", &p("cfg.json"), "--out", &out]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["step"], 6);
    assert!(v["val_loss"].as_f64().unwrap().is_finite());
    let model = format!("{out}/model");
    let tok = std::fs::read_to_string(format!("{model}/tokenizer.json")).unwrap();
    assert!(tok.contains("\"k15\"") && tok.contains("\"v15\""), "the recall vocabulary travels with the model");

    let eval = |extra: &[&str]| {
        let mut args = vec![
            "eval",
            "recall",
            "--model",
            &model,
            "--ks",
            "1,2",
            "--facts",
            "2",
            "--episodes",
            "3",
            "--queries",
            "2",
        ];
        args.extend_from_slice(extra);
        picaso(&args)
    };
    let o = eval(&["--out", &p("eval")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = String::from_utf8_lossy(&o.stdout);
    assert!(md.contains("Exact match") && md.contains("picaso-r"), "{md}");
    for f in ["results.json", "results.csv", "results.md", "accuracy_vs_k-model.png", "accuracy_vs_position-model.png"]
    {
        assert!(tmp.path().join("eval").join(f).is_file(), "{f}");
    }
    // Names that are one file name apart each keep their charts.
    let other = format!("a b={model}");
    let o = eval(&["--name", "a_b", "--compare", &other, "--out", &p("eval2")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for f in ["accuracy_vs_k-a_b.png", "accuracy_vs_k-a_b-2.png", "accuracy_vs_position-a_b-2.png"] {
        assert!(tmp.path().join("eval2").join(f).is_file(), "{f}");
    }

    std::fs::write(
        p("ft.json"),
        r#"{"batch": 2, "steps": 3, "warmup": 1, "lr": 1e-3, "min_lr": 1e-4, "max_k": 3, "min_k": 1,
            "val_every": 3, "val_k": 2, "val_passages": 2, "checkpoint_every": 3,
            "recall": {"facts": 2, "episodes": 8}}"#,
    )
    .unwrap();
    let ft = p("ft");
    let o = picaso(&[
        "train",
        "compose",
        "--objective",
        "bptc",
        "--model",
        &model,
        "--config",
        &p("ft.json"),
        "--out",
        &ft,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = eval(&["--out", &p("pair"), "--compare", &format!("bptc={ft}/model")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = String::from_utf8_lossy(&o.stdout);
    assert!(md.contains("Models compared on the same queries") && md.contains("bptc:picaso-r"), "{md}");

    let fails = |args: &[&str], needle: &str| {
        let o = picaso(args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(needle) && !e.contains("panicked"), "{args:?}: {e}");
    };
    // A resume of the fine-tuning with another --model or other examples is refused, naming
    // the original; a config that would learn nothing is refused before any work.
    let compose = |model: &str, cfg: &str, out: &str| {
        vec!["train", "compose", "--objective", "bptc", "--model", model, "--config", cfg, "--out", out]
            .into_iter()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let args = compose(&format!("{ft}/model"), &p("ft.json"), &ft);
    fails(&args.iter().map(String::as_str).collect::<Vec<_>>(), "resume with the original model (--model)");
    std::fs::write(
        p("ft2.json"),
        std::fs::read_to_string(p("ft.json")).unwrap().replace("\"episodes\": 8", "\"episodes\": 9"),
    )
    .unwrap();
    let args = compose(&model, &p("ft2.json"), &ft);
    fails(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "trained on the examples of 8 recall episodes of 2 facts",
    );
    std::fs::write(
        p("ft0.json"),
        std::fs::read_to_string(p("ft.json")).unwrap().replace("\"min_k\": 1", "\"min_k\": 1, \"clip\": 0"),
    )
    .unwrap();
    let args = compose(&model, &p("ft0.json"), &p("ft0"));
    fails(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "clip = 0: the gradient-norm limit must be a number above 0",
    );
    // k larger than the keys allow, zero facts, an unknown method, a text model for the synthetic form.
    fails(&["eval", "recall", "--model", &model, "--ks", "9", "--facts", "2", "--out", &p("x")], "distinct keys");
    fails(&["eval", "recall", "--model", &model, "--facts", "0", "--ks", "1", "--out", &p("x")], "0 facts");
    fails(&["eval", "recall", "--model", &model, "--methods", "concatenate", "--out", &p("x")], "unknown method");
    fails(&["eval", "recall", "--out", &p("x")], "--form natural");
    fails(&["eval", "recall", "--model", &model, "--compare", "nodir", "--out", &p("x")], "NAME=DIR");
    fails(&["train", "pretrain", "--config", &p("cfg.json"), "--corpus", "text:/x", "--out", &p("y")], "drop --corpus");
    fails(
        &[
            "train",
            "compose",
            "--objective",
            "bp2c",
            "--model",
            &model,
            "--config",
            &p("ft.json"),
            "--db",
            &p("db"),
            "--out",
            &p("z"),
        ],
        "drop --db",
    );
}

/// A Granite-4.0-H-shaped hybrid trains from a run file (`"arch": "granite_hybrid"`) on
/// generated recall sequences, its folder loads for `eval recall`, and it fine-tunes through
/// the composition (PICASO-R + the key/value union); a hybrid's fields are checked.
#[test]
fn a_hybrid_recall_model_trains_evaluates_and_finetunes() {
    let tmp = tempfile::tempdir().unwrap();
    let p = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let cfg = r#"{"arch": "granite_hybrid", "d_model": 32, "n_layer": 2, "attention": [1], "attn_heads": 2,
        "kv_heads": 1, "mlp": 48, "d_state": 8, "headdim": 8, "seq_len": 40, "batch": 4, "steps": 4,
        "warmup": 1, "lr": 3e-3, "min_lr": 3e-4, "val_every": 2, "val_sequences": 2, "checkpoint_every": 2,
        "val_fraction": 0.1, "sampler": "epochs",
        "recall": {"keys": 16, "values": 16, "facts": 2, "max_k": 4, "sequences": 60}}"#;
    std::fs::write(p("cfg.json"), cfg).unwrap();
    let out = p("run");
    let o = picaso(&["train", "pretrain", "--config", &p("cfg.json"), "--out", &out]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["step"], 4);
    let model = format!("{out}/model");
    let config = std::fs::read_to_string(format!("{model}/config.json")).unwrap();
    assert!(config.contains("granitemoehybrid") && config.contains("\"attention\""), "{config}");
    let o = picaso(&[
        "eval",
        "recall",
        "--model",
        &model,
        "--ks",
        "1,2",
        "--facts",
        "2",
        "--episodes",
        "2",
        "--queries",
        "2",
        "--out",
        &p("eval"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::write(
        p("ft.json"),
        r#"{"batch": 2, "steps": 2, "warmup": 1, "lr": 1e-3, "min_lr": 1e-4, "max_k": 3, "min_k": 1,
            "val_every": 2, "val_k": 2, "val_passages": 2, "checkpoint_every": 2,
            "recall": {"facts": 2, "episodes": 6}}"#,
    )
    .unwrap();
    let o = picaso(&[
        "train",
        "compose",
        "--objective",
        "bptc",
        "--model",
        &model,
        "--config",
        &p("ft.json"),
        "--out",
        &p("ft"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(tmp.path().join("ft/model/model.safetensors").is_file());

    for (from, to, needle) in [
        ("\"attention\": [1]", "\"attention\": [2]", "attention lists layer 2"),
        ("\"attention\": [1]", "\"attention\": [0, 1]", "at least one Mamba-2 layer"),
        ("\"kv_heads\": 1", "\"kv_heads\": 3", "attn_heads a multiple of kv_heads"),
        ("\"arch\": \"granite_hybrid\", ", "", "add \"arch\": \"granite_hybrid\""),
        ("\"arch\": \"granite_hybrid\"", "\"arch\": \"granite\"", "unknown variant"),
    ] {
        std::fs::write(p("bad.json"), cfg.replace(from, to)).unwrap();
        fails(&["train", "pretrain", "--config", &p("bad.json"), "--out", &p("bad")], needle);
    }
}
