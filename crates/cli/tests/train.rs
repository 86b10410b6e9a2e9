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
