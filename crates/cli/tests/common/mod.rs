//! Helpers shared by the end-to-end tests: the shared data folder, a tiny random model that
//! speaks the GPT-NeoX tokenizer, and a small document corpus.
#![allow(dead_code)] // each test binary uses a subset

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

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

/// A tiny random Granite 4.0 H hybrid (`mamba, attention, mamba, attention`, width 16) with
/// the GPT-NeoX tokenizer, in a temporary folder.
pub fn text_model_hybrid(seed: u64) -> Option<tempfile::TempDir> {
    let tok = shared("gpt-neox-20b-tokenizer/tokenizer.json")?;
    let dir = tempfile::tempdir().unwrap();
    let config = picaso_model::GraniteHybridConfig::tiny(50280);
    picaso_model::GraniteHybridWeights::random(&config, seed).save_pretrained(dir.path(), &config).unwrap();
    std::fs::copy(tok, dir.path().join("tokenizer.json")).unwrap();
    Some(dir)
}

/// The tiny text model of `arch` ("mamba1", "mamba2" or "hybrid").
pub fn text_model_of(arch: &str, seed: u64) -> Option<tempfile::TempDir> {
    match arch {
        "mamba1" => text_model_mamba1(seed),
        "mamba2" => text_model(seed),
        "hybrid" => text_model_hybrid(seed),
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

/// Where a test's store lives: a fresh folder, or a fresh PostgreSQL schema plus a fresh S3
/// prefix.
#[derive(Debug, Clone)]
pub struct TestDb {
    /// `--db`.
    pub db: String,
    /// `--states`, for a shared store.
    pub states: Option<String>,
}

impl TestDb {
    /// The `--db` (and `--states`) arguments.
    pub fn args(&self) -> Vec<String> {
        let mut v = vec!["--db".to_string(), self.db.clone()];
        if let Some(s) = &self.states {
            v.extend(["--states".to_string(), s.clone()]);
        }
        v
    }

    /// The location, for opening the store in-process.
    pub fn location(&self) -> picaso_store::Location {
        picaso_store::Location::parse(&self.db, self.states.as_deref()).unwrap()
    }

    /// A short name for messages.
    pub fn kind(&self) -> &'static str {
        if self.states.is_some() {
            "s3+postgres"
        } else {
            "folder+sqlite"
        }
    }
}

/// The backends every store test runs against: a folder under `tmp`, and S3 + PostgreSQL
/// when `PICASO_TEST_POSTGRES` (a database URL) and `PICASO_TEST_S3` (`s3://bucket`, with
/// the `AWS_*` variables) are set. CI sets them and `PICASO_TEST_REQUIRE_BACKENDS=1`, which
/// turns their absence into a failure instead of a skip.
pub fn backends(tmp: &Path, name: &str) -> Vec<TestDb> {
    let mut v = vec![TestDb { db: tmp.join(format!("{name}-db")).to_str().unwrap().to_string(), states: None }];
    if let Some(shared) = shared_backend(name) {
        v.push(shared);
    }
    v
}

/// A fresh S3 + PostgreSQL store location for test `name`, if the services are configured.
pub fn shared_backend(name: &str) -> Option<TestDb> {
    let (pg, s3) = (std::env::var("PICASO_TEST_POSTGRES").ok(), std::env::var("PICASO_TEST_S3").ok());
    let (Some(pg), Some(s3)) = (pg, s3) else {
        assert!(
            std::env::var("PICASO_TEST_REQUIRE_BACKENDS").is_err(),
            "PICASO_TEST_REQUIRE_BACKENDS is set but PICASO_TEST_POSTGRES / PICASO_TEST_S3 are not"
        );
        eprintln!("note: S3 + PostgreSQL not configured (PICASO_TEST_POSTGRES, PICASO_TEST_S3); folder store only");
        return None;
    };
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    let unique = format!("{name}_{}_{n}_{nanos}", std::process::id()).replace('-', "_");
    let sep = if pg.contains('?') { '&' } else { '?' };
    Some(TestDb {
        db: format!("{pg}{sep}options=-csearch_path%3D{unique}%2Cpublic"),
        states: Some(format!("{}/{unique}", s3.trim_end_matches('/'))),
    })
}

/// Runs `picaso` with `args`: (success, stdout as JSON or null, stderr). Never a panic.
pub fn run(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(picaso_bin()).args(args).output().expect("picaso runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "picaso {args:?} panicked: {stderr}");
    (out.status.success(), serde_json::from_slice(&out.stdout).unwrap_or(Value::Null), stderr)
}

/// [`run`] with owned arguments.
pub fn run_s(args: &[String]) -> (bool, Value, String) {
    run(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// [`ok`] with owned arguments.
pub fn ok_s(args: &[String]) -> Value {
    ok(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// Builds an argument list: `picaso <words...> <db args...> <more...>`.
pub fn args(words: &[&str], db: &TestDb, more: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = words.iter().map(|s| s.to_string()).collect();
    v.extend(db.args());
    v.extend(more.iter().map(|s| s.to_string()));
    v
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

/// The `picaso` binary under test: this build's, or `$PICASO_BIN` (scripts/fuzz.sh runs a copy,
/// so that rebuilding during a long run changes nothing under it).
pub fn picaso_bin() -> PathBuf {
    std::env::var_os("PICASO_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_picaso")))
}

/// A running `picaso serve`, killed on drop.
pub struct Server {
    pub child: Child,
    pub url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        Self::start_with(args, &[])
    }

    /// Starts a server with extra environment variables.
    pub fn start_with(args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(picaso_bin())
            .args(["serve", "--addr", "127.0.0.1:0"])
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .spawn()
            .expect("picaso serve starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let url =
            line.trim().strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected: {line:?}")).to_string();
        Server { child, url }
    }

    /// (status, JSON body) of a request; 4xx and 5xx are answers too.
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let req = ureq::request(method, &format!("{}{path}", self.url))
            .set("content-type", "application/json")
            .timeout(Duration::from_secs(60));
        let resp = match body {
            Some(b) => req.send_string(b),
            None => req.call(),
        };
        let resp = match resp {
            Ok(r) => r,
            Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("{method} {path}: {e}"),
        };
        let status = resp.status();
        let text = resp.into_string().unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: not JSON ({e}): {text}")))
    }

    /// As [`Server::call`], with a JSON value for the body.
    pub fn call_json(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        self.call(method, path, body.map(|b| b.to_string()).as_deref())
    }

    pub fn metric(&self, name: &str) -> f64 {
        let text = ureq::get(&format!("{}/metrics", self.url)).call().unwrap().into_string().unwrap();
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}
