//! Tiny random sentence-transformers folders (`testdata/encoders`, made by
//! `scripts/make_encoder_fixtures.py` with sentence-transformers) against their reference
//! embeddings: MPNet with mean pooling and Normalize (relative position buckets, positions after
//! the padding id, truncation at 300 tokens), BERT with CLS pooling and no Normalize, and the
//! same BERT under max + mean/√len pooling. Every value agrees to 1e-5.

use std::path::{Path, PathBuf};

use candle_core::Device;
use picaso_embed::{Embedder, Error, PoolingMode};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/encoders").join(name)
}

fn expected(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Checks token ids and embeddings of every case; `embeddings` overrides the cases' own.
fn agree(e: &Embedder, json: &serde_json::Value, embeddings: Option<Vec<Vec<f32>>>) -> f32 {
    let cases = json["cases"].as_array().unwrap();
    let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
    let ids = e.tokenize(&texts).unwrap();
    let want = embeddings.unwrap_or_else(|| cases.iter().map(|c| floats(&c["embedding"])).collect::<Vec<_>>());
    let got = e.embed(&texts).unwrap();
    let mut worst = 0f32;
    for (i, c) in cases.iter().enumerate() {
        let want_ids: Vec<u32> =
            c["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(ids[i], want_ids, "{:?}", texts[i]);
        assert_eq!(got[i].len(), want[i].len());
        let diff = got[i].iter().zip(&want[i]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-5, "{:?}: max |diff| {diff}", texts[i]);
        worst = worst.max(diff);
    }
    worst
}

#[test]
fn mpnet_matches_sentence_transformers() {
    let dir = fixture("mpnet-mean");
    let json = expected(&dir);
    let e = Embedder::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(e.model().family(), "mpnet");
    assert_eq!(e.max_tokens(), 300);
    assert_eq!(e.dim(), 32);
    assert!(e.normalizes());
    let worst = agree(&e, &json, None);
    eprintln!("mpnet: max |diff| {worst:.1e}");
    // Batching does not change a text's vector (padding is masked, positions restart per row).
    let texts = ["The Eiffel Tower is in Paris.", "Hi", ""];
    let alone: Vec<Vec<f32>> = texts.iter().map(|t| e.embed_one(t).unwrap()).collect();
    let together = e.clone().with_batch_size(3).embed(&texts).unwrap();
    for (a, b) in alone.iter().zip(&together) {
        assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6));
    }
}

#[test]
fn mpnet_relative_buckets_match_hf() {
    let json = expected(&fixture("mpnet-mean"));
    let from = json["buckets_from"].as_i64().unwrap();
    for (i, b) in json["buckets"].as_array().unwrap().iter().enumerate() {
        let relative = from + i as i64;
        assert_eq!(picaso_embed::mpnet::relative_bucket(relative), b.as_u64().unwrap() as usize, "{relative}");
    }
}

#[test]
fn bert_cls_pooling_without_normalize_matches() {
    let dir = fixture("bert-cls");
    let json = expected(&dir);
    let e = Embedder::load(&dir, &Device::Cpu).unwrap();
    assert_eq!(e.model().family(), "bert");
    assert_eq!(e.pooling().modes(), [PoolingMode::Cls]);
    assert!(!e.normalizes());
    assert_eq!(e.max_tokens(), 40, "sentence-transformers 6 keeps the limit in tokenizer_config.json");
    let worst = agree(&e, &json, None);
    eprintln!("bert-cls: max |diff| {worst:.1e}");
}

#[test]
fn max_and_mean_sqrt_len_pooling_match() {
    let src = fixture("bert-cls");
    let json = expected(&src);
    let dir = tempfile::tempdir().unwrap();
    for f in
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json"]
    {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::copy(src.join("modules.json"), dir.path().join("modules.json")).unwrap();
    std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
    std::fs::write(
        dir.path().join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension": 32, "pooling_mode_cls_token": false, "pooling_mode_max_tokens": true,
            "pooling_mode_mean_tokens": false, "pooling_mode_mean_sqrt_len_tokens": true}"#,
    )
    .unwrap();
    let e = Embedder::load(dir.path(), &Device::Cpu).unwrap();
    assert_eq!(e.dim(), 64);
    let want: Vec<Vec<f32>> = json["max_mean_sqrt_len_embeddings"].as_array().unwrap().iter().map(floats).collect();
    agree(&e, &json, Some(want));
    let cls = Embedder::load(&src, &Device::Cpu).unwrap();
    assert_ne!(e.fingerprint(), cls.fingerprint(), "the pooling is part of the fingerprint");
}

/// A copy of the BERT fixture with `file` replaced by `text`.
fn with_file(file: &str, text: &str) -> tempfile::TempDir {
    let src = fixture("bert-cls");
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "modules.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
    std::fs::copy(src.join("1_Pooling/config.json"), dir.path().join("1_Pooling/config.json")).unwrap();
    std::fs::write(dir.path().join(file), text).unwrap();
    dir
}

fn load_err(dir: &Path) -> (Error, String) {
    let e = Embedder::load(dir, &Device::Cpu).expect_err("load should fail");
    let s = e.to_string();
    (e, s)
}

#[test]
fn bad_pipelines_are_refused_by_name() {
    let cases = [
        ("1_Pooling/config.json", r#"{"pooling_mode": "median"}"#, "unknown pooling mode \"median\""),
        ("1_Pooling/config.json", r#"{"pooling_mode_median_tokens": true}"#, "pooling_mode_median_tokens"),
        ("1_Pooling/config.json", r#"{"pooling_mode_mean_tokens": false}"#, "no pooling mode"),
        ("1_Pooling/config.json", r#"{"pooling_mode_mean_tokens": "yes"}"#, "true or false"),
        ("1_Pooling/config.json", "[", "not JSON"),
        (
            "modules.json",
            r#"[{"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}]"#,
            "Dense",
        ),
        ("modules.json", r#"[{"path": "", "type": "sentence_transformers.models.Transformer"}]"#, "no Pooling"),
        ("modules.json", r#"[{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]"#, "out of place"),
        ("modules.json", r#"{"a": 1}"#, "not a list"),
        ("config.json", r#"{"model_type": "roberta"}"#, "model_type"),
    ];
    for (file, text, needle) in cases {
        let dir = with_file(file, text);
        let (e, s) = load_err(dir.path());
        assert!(matches!(e, Error::Config { .. }), "{file} {text}: {s}");
        assert!(s.contains(needle) && s.contains(file.rsplit('/').next().unwrap()), "{file} {text}: {s}");
    }
    // A pooling folder modules.json names but that is missing.
    let dir = with_file("modules.json", &std::fs::read_to_string(fixture("bert-cls/modules.json")).unwrap());
    std::fs::remove_dir_all(dir.path().join("1_Pooling")).unwrap();
    let (e, s) = load_err(dir.path());
    assert!(matches!(e, Error::Io { .. }) && s.contains("1_Pooling/config.json"), "{s}");
}

#[test]
fn bad_mpnet_configs_are_named() {
    let src = fixture("mpnet-mean");
    for (field, value, needle) in [
        ("relative_attention_num_buckets", serde_json::json!(16), "relative_attention_num_buckets"),
        ("max_position_embeddings", serde_json::json!(2), "max_position_embeddings"),
        ("hidden_act", serde_json::json!("swish"), "hidden_act"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "sentence_bert_config.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        let mut c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        c[field] = value;
        std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
        let (e, s) = load_err(dir.path());
        assert!(matches!(e, Error::Config { .. }) && s.contains(needle), "{field}: {s}");
    }
    // Missing tensor of the relative bias.
    let dir = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let kept: std::collections::HashMap<_, _> =
        tensors.into_iter().filter(|(k, _)| !k.contains("relative_attention_bias")).collect();
    candle_core::safetensors::save(&kept, dir.path().join("model.safetensors")).unwrap();
    let (e, s) = load_err(dir.path());
    assert!(matches!(e, Error::Weights { .. }) && s.contains("relative_attention_bias"), "{s}");
}
