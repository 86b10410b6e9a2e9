//! Helpers shared by the end-to-end tests: the shared data folder, a tiny random model that
//! speaks the GPT-NeoX tokenizer, and a small document corpus.
#![allow(dead_code)] // each test binary uses a subset

use std::path::{Path, PathBuf};
use std::process::Command;

use picaso_model::{Mamba2Config, Mamba2Weights};
use serde_json::Value;

/// A path under `../shared/data`, or `None` (with a note) where the folder is absent.
pub fn shared(rel: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data").join(rel);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipping: {} not found (the shared data folder is beside the checkout in CI)", p.display());
        None
    }
}

/// A tiny random Mamba-2 (2 layers, width 16) with the GPT-NeoX tokenizer, in a temporary folder.
pub fn text_model(seed: u64) -> Option<tempfile::TempDir> {
    let tok = shared("gpt-neox-20b-tokenizer/tokenizer.json")?;
    let dir = tempfile::tempdir().unwrap();
    let config = Mamba2Config { vocab_size: 50280, d_model: 16, headdim: 8, nheads: 4, ..Mamba2Config::tiny(2, 4) };
    Mamba2Weights::random(&config, seed).save_pretrained(dir.path(), &config).unwrap();
    std::fs::copy(tok, dir.path().join("tokenizer.json")).unwrap();
    Some(dir)
}

/// Three documents, four paragraphs: cats.txt (id 1), eiffel.txt (ids 2, 3), mamba.txt (id 4).
pub fn write_docs(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("eiffel.txt"), "The Eiffel Tower is in Paris.\n\nIt was finished in 1889.\n").unwrap();
    std::fs::write(dir.join("mamba.txt"), "Mamba is a state space model.\n").unwrap();
    std::fs::write(dir.join("cats.txt"), "Cats are small carnivorous mammals.\n").unwrap();
}

/// Runs `picaso` with `args`: (success, stdout as JSON or null, stderr). Never a panic.
pub fn run(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_picaso")).args(args).output().expect("picaso runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "picaso {args:?} panicked: {stderr}");
    (out.status.success(), serde_json::from_slice(&out.stdout).unwrap_or(Value::Null), stderr)
}

/// Runs `picaso` with `args`, which must succeed; its JSON output.
pub fn ok(args: &[&str]) -> Value {
    let (success, v, stderr) = run(args);
    assert!(success, "picaso {args:?} failed: {stderr}");
    v
}
