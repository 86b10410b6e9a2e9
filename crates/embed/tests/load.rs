//! Loading and running a tiny random BERT (made here, no shared data needed): shapes, padding,
//! truncation, and every load error naming its file or field.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use picaso_embed::{Embedder, Error};
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::bert::BertProcessing;
use tokenizers::Tokenizer;

const WORDS: &[&str] = &["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", "##s", "a", "."];
const HIDDEN: usize = 8;
const INTER: usize = 16;
const MAX_POS: usize = 16;

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["BertModel"],
        "vocab_size": WORDS.len(),
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": INTER,
        "hidden_act": "gelu",
        "max_position_embeddings": MAX_POS,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "position_embedding_type": "absolute"
    })
}

fn weights(prefix: &str) -> HashMap<String, Tensor> {
    let dev = Device::Cpu;
    let mut seed = 0u64;
    let mut rand = |shape: &[usize], scale: f32| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale
            })
            .collect();
        Tensor::from_vec(v, shape, &dev).unwrap()
    };
    let mut w = HashMap::new();
    let mut put = |name: String, shape: &[usize], scale: f32| {
        w.insert(format!("{prefix}{name}"), rand(shape, scale));
    };
    put("embeddings.word_embeddings.weight".into(), &[WORDS.len(), HIDDEN], 2.0);
    put("embeddings.position_embeddings.weight".into(), &[MAX_POS, HIDDEN], 1.0);
    put("embeddings.token_type_embeddings.weight".into(), &[2, HIDDEN], 1.0);
    put("embeddings.LayerNorm.weight".into(), &[HIDDEN], 1.0);
    put("embeddings.LayerNorm.bias".into(), &[HIDDEN], 0.2);
    for i in 0..2 {
        let p = format!("encoder.layer.{i}");
        for n in ["query", "key", "value"] {
            put(format!("{p}.attention.self.{n}.weight"), &[HIDDEN, HIDDEN], 1.0);
            put(format!("{p}.attention.self.{n}.bias"), &[HIDDEN], 0.2);
        }
        put(format!("{p}.attention.output.dense.weight"), &[HIDDEN, HIDDEN], 1.0);
        put(format!("{p}.attention.output.dense.bias"), &[HIDDEN], 0.2);
        put(format!("{p}.attention.output.LayerNorm.weight"), &[HIDDEN], 1.0);
        put(format!("{p}.attention.output.LayerNorm.bias"), &[HIDDEN], 0.2);
        put(format!("{p}.intermediate.dense.weight"), &[INTER, HIDDEN], 1.0);
        put(format!("{p}.intermediate.dense.bias"), &[INTER], 0.2);
        put(format!("{p}.output.dense.weight"), &[HIDDEN, INTER], 1.0);
        put(format!("{p}.output.dense.bias"), &[HIDDEN], 0.2);
        put(format!("{p}.output.LayerNorm.weight"), &[HIDDEN], 1.0);
        put(format!("{p}.output.LayerNorm.bias"), &[HIDDEN], 0.2);
    }
    w
}

fn write_tokenizer(path: &Path, words: &[&str]) {
    let vocab_txt = path.with_extension("vocab.txt");
    std::fs::write(&vocab_txt, words.join("\n")).unwrap();
    let wp = WordPiece::from_file(vocab_txt.to_str().unwrap()).unk_token("[UNK]".into()).build().unwrap();
    let mut tok = Tokenizer::new(wp);
    tok.with_normalizer(Some(BertNormalizer::default()));
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_post_processor(Some(BertProcessing::new(("[SEP]".into(), 3), ("[CLS]".into(), 2))));
    tok.save(path, false).unwrap();
}

fn tiny_model(prefix: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config().to_string()).unwrap();
    candle_core::safetensors::save(&weights(prefix), dir.path().join("model.safetensors")).unwrap();
    write_tokenizer(&dir.path().join("tokenizer.json"), WORDS);
    dir
}

fn load(dir: &Path) -> picaso_embed::Result<Embedder> {
    Embedder::load(dir, &Device::Cpu)
}

fn err_text(r: picaso_embed::Result<Embedder>) -> (Error, String) {
    let e = r.expect_err("load should fail");
    let s = e.to_string();
    (e, s)
}

#[test]
fn tiny_model_embeds() {
    let dir = tiny_model("");
    let e = load(dir.path()).unwrap();
    assert_eq!(e.dim(), HIDDEN);
    assert_eq!(e.max_tokens(), MAX_POS, "256 is capped by max_position_embeddings");
    let texts = ["the cat sat on the mat.", "cats", "", "dog", "a cat. a cat. a cat. a cat. a cat. a cat. a cat."];
    let ids = e.tokenize(&texts).unwrap();
    assert_eq!(ids[0], vec![2, 4, 5, 6, 7, 4, 8, 11, 3]);
    assert_eq!(ids[1], vec![2, 5, 9, 3]);
    assert_eq!(ids[2], vec![2, 3]);
    assert_eq!(ids[3], vec![2, 1, 3]);
    assert_eq!(ids[4].len(), MAX_POS, "truncated");
    assert_eq!(ids[4].last(), Some(&3), "[SEP] kept after truncation");
    let batched = e.embed(&texts).unwrap();
    for (t, v) in texts.iter().zip(&batched) {
        let single = e.embed_one(t).unwrap();
        assert_eq!(v.len(), HIDDEN);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{t:?}");
        let diff = v.iter().zip(&single).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(diff < 1e-5, "{t:?}: {diff}");
    }
    assert_ne!(batched[0], batched[1]);
}

#[test]
fn bert_prefix_and_half_precision_load() {
    let plain = load(tiny_model("").path()).unwrap().embed(&["the cat"]).unwrap();
    let prefixed = load(tiny_model("bert.").path()).unwrap().embed(&["the cat"]).unwrap();
    assert_eq!(plain, prefixed);

    let dir = tiny_model("");
    let half: HashMap<String, Tensor> =
        weights("").into_iter().map(|(k, v)| (k, v.to_dtype(DType::BF16).unwrap())).collect();
    candle_core::safetensors::save(&half, dir.path().join("model.safetensors")).unwrap();
    let v = load(dir.path()).unwrap().embed(&["the cat"]).unwrap();
    let cos: f32 = v[0].iter().zip(&plain[0]).map(|(a, b)| a * b).sum();
    assert!(cos > 0.99, "{cos}");
}

#[test]
fn sentence_bert_config_sets_the_limit() {
    let dir = tiny_model("");
    std::fs::write(dir.path().join("sentence_bert_config.json"), r#"{"max_seq_length": 5}"#).unwrap();
    let e = load(dir.path()).unwrap();
    assert_eq!(e.max_tokens(), 5);
    assert_eq!(e.tokenize(&["the cat sat on the mat"]).unwrap()[0], vec![2, 4, 5, 6, 3]);
    std::fs::write(dir.path().join("sentence_bert_config.json"), r#"{"max_seq_length": "long"}"#).unwrap();
    let (e, s) = err_text(load(dir.path()));
    assert!(
        matches!(e, Error::Config { .. }) && s.contains("sentence_bert_config.json") && s.contains("max_seq_length"),
        "{s}"
    );
}

#[test]
fn missing_files_are_named() {
    let (e, s) = err_text(load(Path::new("/nonexistent/model")));
    assert!(matches!(e, Error::Io { .. }) && s.contains("config.json"), "{s}");
    for file in ["model.safetensors", "tokenizer.json"] {
        let dir = tiny_model("");
        std::fs::remove_file(dir.path().join(file)).unwrap();
        let (e, s) = err_text(load(dir.path()));
        assert!(matches!(e, Error::Io { .. }) && s.contains(file), "{s}");
    }
}

#[test]
fn bad_config_fields_are_named() {
    let cases: [(&str, serde_json::Value, &str); 6] = [
        ("num_attention_heads", serde_json::json!(3), "not divisible"),
        ("hidden_act", serde_json::json!("swish"), "hidden_act"),
        ("position_embedding_type", serde_json::json!("relative_key"), "position_embedding_type"),
        ("hidden_size", serde_json::json!(0), "hidden_size"),
        ("vocab_size", serde_json::json!("many"), "vocab_size"),
        ("layer_norm_eps", serde_json::json!(-1.0), "layer_norm_eps"),
    ];
    for (field, value, needle) in cases {
        let dir = tiny_model("");
        let mut c = config();
        c[field] = value;
        std::fs::write(dir.path().join("config.json"), c.to_string()).unwrap();
        let (e, s) = err_text(load(dir.path()));
        assert!(matches!(e, Error::Config { .. }) && s.contains("config.json") && s.contains(needle), "{field}: {s}");
    }
    let dir = tiny_model("");
    std::fs::write(dir.path().join("config.json"), "{not json").unwrap();
    let (e, s) = err_text(load(dir.path()));
    assert!(matches!(e, Error::Config { .. }) && s.contains("config.json"), "{s}");
}

#[test]
fn bad_weights_are_named() {
    let dir = tiny_model("");
    let path = dir.path().join("model.safetensors");
    let mut w = weights("");
    w.remove("encoder.layer.1.attention.self.key.bias");
    candle_core::safetensors::save(&w, &path).unwrap();
    let (e, s) = err_text(load(dir.path()));
    assert!(matches!(e, Error::Weights { .. }) && s.contains("encoder.layer.1.attention.self.key.bias"), "{s}");

    let mut w = weights("");
    w.insert(
        "encoder.layer.0.intermediate.dense.weight".into(),
        Tensor::zeros((INTER, HIDDEN + 1), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&w, &path).unwrap();
    let (e, s) = err_text(load(dir.path()));
    assert!(
        matches!(e, Error::Weights { .. }) && s.contains("intermediate.dense.weight") && s.contains("[16, 9]"),
        "{s}"
    );

    std::fs::write(&path, b"definitely not safetensors").unwrap();
    let (e, s) = err_text(load(dir.path()));
    assert!(matches!(e, Error::Weights { .. }) && s.contains("model.safetensors"), "{s}");
}

#[test]
fn bad_tokenizer_is_named() {
    let dir = tiny_model("");
    std::fs::write(dir.path().join("tokenizer.json"), "[]").unwrap();
    let (e, s) = err_text(load(dir.path()));
    assert!(matches!(e, Error::Tokenizer { .. }) && s.contains("tokenizer.json"), "{s}");

    let mut more = WORDS.to_vec();
    more.push("dog");
    write_tokenizer(&dir.path().join("tokenizer.json"), &more);
    let (e, s) = err_text(load(dir.path()));
    assert!(matches!(e, Error::Tokenizer { .. }) && s.contains("vocab_size"), "{s}");
}

#[test]
fn embedder_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Embedder>();
    let dir = tiny_model("");
    let e = load(dir.path()).unwrap();
    let alone = e.embed(&["the cat sat"]).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|_| s.spawn(|| e.embed(&["the cat sat"]).unwrap())).collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), alone);
        }
    });
}
