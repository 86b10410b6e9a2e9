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

/// A tiny random Mamba-1 (2 layers, width 16) with the GPT-NeoX tokenizer, in a temporary folder.
pub fn text_model_mamba1(seed: u64) -> Option<tempfile::TempDir> {
    let tok = shared("gpt-neox-20b-tokenizer/tokenizer.json")?;
    let dir = tempfile::tempdir().unwrap();
    let config =
        picaso_model::Mamba1Config { vocab_size: 50280, d_model: 16, ..picaso_model::Mamba1Config::tiny(2, 4) };
    picaso_model::Mamba1Weights::random(&config, seed).save_pretrained(dir.path(), &config).unwrap();
    std::fs::copy(tok, dir.path().join("tokenizer.json")).unwrap();
    Some(dir)
}

/// The tiny text model of `arch` ("mamba1" or "mamba2").
pub fn text_model_of(arch: &str, seed: u64) -> Option<tempfile::TempDir> {
    match arch {
        "mamba1" => text_model_mamba1(seed),
        "mamba2" => text_model(seed),
        other => panic!("unknown architecture {other}"),
    }
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

/// The articles of [`wikitext`].
pub const ARTICLES: [(&str, [&str; 3]); 3] = [
    (
        "Tower",
        [
            "The tower was built in the city over two years by a team of engineers and many workers from the region .",
            "It is made of iron and stands three hundred metres tall , which made it the tallest structure of its time .",
            "Visitors climb its stairs or take the lifts to the top , where they can see the river and the old bridges .",
        ],
    ),
    (
        "River",
        [
            "The river rises in the mountains and flows north through forests , farms and several small towns to the sea .",
            "Its water feeds the canals of the valley , and boats carried grain and timber along it for many centuries .",
            "Floods in the spring often covered the low fields , so the farmers built walls of earth along both banks .",
        ],
    ),
    (
        "Bird",
        [
            "The bird lives in wet meadows and eats insects , seeds and small snails that it finds among the tall grass .",
            "It builds a nest of reeds on the ground and lays three or four eggs , which both parents keep warm for weeks .",
            "In the autumn the birds gather in large flocks and fly south to spend the winter on the warm coasts .",
        ],
    ),
];

/// A small WikiText-style file (three articles of three paragraphs, headings, a short line).
pub fn wikitext(dir: &std::path::Path) -> std::path::PathBuf {
    let mut text = String::new();
    for (title, paras) in ARTICLES {
        text.push_str(&format!(" \n = {title} = \n \n"));
        for p in paras {
            text.push_str(&format!(" {p} \n"));
        }
        text.push_str(" \n = = Notes = = \n \n short line \n");
    }
    let path = dir.join("wiki.tokens");
    std::fs::write(&path, text).unwrap();
    path
}
