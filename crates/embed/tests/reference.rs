//! all-MiniLM-L6-v2 in Rust against sentence-transformers: token ids and embeddings of the
//! sentences in `testdata/minilm/expected.json` (made by `scripts/make_minilm_fixtures.py`).
//!
//! The model lives in the shared data folder beside the checkout (`../shared/data/...` from the
//! workspace root). Without it the tests are skipped, except under CI (`CI` set), where that is
//! a failure.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::Device;
use picaso_embed::{Embedder, Error};

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model_dir() -> PathBuf {
    workspace().join("../shared/data/all-MiniLM-L6-v2")
}

fn embedder() -> Option<&'static Embedder> {
    static EMBEDDER: OnceLock<Option<Embedder>> = OnceLock::new();
    EMBEDDER
        .get_or_init(|| {
            let dir = model_dir();
            if !dir.join("model.safetensors").is_file() {
                assert!(std::env::var_os("CI").is_none(), "{} not found under CI", dir.display());
                eprintln!("skipping: {} not found (the shared data folder is beside the checkout)", dir.display());
                return None;
            }
            Some(Embedder::load(&dir, &Device::Cpu).unwrap())
        })
        .as_ref()
}

struct Case {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn cases() -> Vec<Case> {
    let path = workspace().join("testdata/minilm/expected.json");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["dim"], 384);
    assert_eq!(json["max_seq_length"], 256);
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: c["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect(),
            embedding: c["embedding"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect(),
        })
        .collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

#[test]
fn tokens_match_sentence_transformers() {
    let Some(e) = embedder() else { return };
    let cases = cases();
    let texts: Vec<&str> = cases.iter().map(|c| c.text.as_str()).collect();
    let ids = e.tokenize(&texts).unwrap();
    for (c, got) in cases.iter().zip(&ids) {
        assert_eq!(got, &c.ids, "{:?}", c.text);
    }
    assert!(ids.iter().any(|r| r.len() == 256), "the fixture must exercise truncation");
    assert_eq!(e.max_tokens(), 256);
}

#[test]
fn embeddings_match_sentence_transformers() {
    let Some(e) = embedder() else { return };
    let cases = cases();
    let texts: Vec<&str> = cases.iter().map(|c| c.text.as_str()).collect();
    let got = e.embed(&texts).unwrap();
    assert_eq!(got.len(), cases.len());
    let mut min = f64::INFINITY;
    for (c, v) in cases.iter().zip(&got) {
        assert_eq!(v.len(), 384);
        let norm: f64 = v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{:?}: norm {norm}", c.text);
        let cos = cosine(v, &c.embedding);
        let max_abs = v.iter().zip(&c.embedding).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!(
            "1-cos {:.1e}  max|diff| {max_abs:.1e}  {:?}",
            1.0 - cos,
            c.text.chars().take(40).collect::<String>()
        );
        assert!(cos >= 0.9999, "{:?}: cosine {cos}", c.text);
        min = min.min(cos);
    }
    eprintln!("minimum cosine vs sentence-transformers: {min:.12} (1 - min = {:.1e})", 1.0 - min);
}

#[test]
fn batched_equals_single() {
    let Some(e) = embedder() else { return };
    let cases = cases();
    let texts: Vec<&str> = cases.iter().map(|c| c.text.as_str()).collect();
    let single: Vec<Vec<f32>> = texts.iter().map(|t| e.embed_one(t).unwrap()).collect();
    for (batch_size, batch_tokens) in [(32, 8192), (3, 8192), (5, 100), (1, 1)] {
        let e = e.clone().with_batch_size(batch_size).with_batch_tokens(batch_tokens);
        let batched = e.embed(&texts).unwrap();
        for ((t, a), b) in texts.iter().zip(&single).zip(&batched) {
            let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "batch {batch_size}/{batch_tokens}, {t:?}: max diff {diff}");
            assert!(cosine(a, b) > 0.999_999, "{t:?}");
        }
    }
    // The same text twice in a batch, beside texts of other lengths, gives the same vector.
    let twice = e.embed(&["Hi", texts[12], "Hi"]).unwrap();
    assert_eq!(twice[0], twice[2]);
}

#[test]
fn empty_inputs() {
    let Some(e) = embedder() else { return };
    assert!(e.embed(&[]).unwrap().is_empty());
    assert!(e.tokenize(&[]).unwrap().is_empty());
    let v = e.embed_one("").unwrap();
    assert_eq!(v.len(), e.dim());
    assert!(v.iter().all(|x| x.is_finite()));
}

#[test]
fn token_input_is_checked() {
    let Some(e) = embedder() else { return };
    assert!(matches!(e.embed_tokens(&[vec![]]), Err(Error::Input(_))));
    assert!(matches!(e.embed_tokens(&[vec![101, 40_000, 102]]), Err(Error::Input(m)) if m.contains("40000")));
    assert!(matches!(e.embed_tokens(&[vec![101; 257]]), Err(Error::Input(_))));
}

#[test]
fn similar_sentences_are_near() {
    let Some(e) = embedder() else { return };
    let v = e
        .embed(&["A man is playing a guitar.", "Someone plays an instrument.", "The stock market fell today."])
        .unwrap();
    let (near, far) = (picaso_embed::dot(&v[0], &v[1]), picaso_embed::dot(&v[0], &v[2]));
    assert!(near > far + 0.2, "near {near}, far {far}");
}
