//! Structured fuzzing of the model loaders: `config.json` (both layouts, both architectures) with
//! fields removed, retyped or set to extreme values, or its text damaged; and `model.safetensors`
//! damaged anywhere (header or data). Loading must never panic and never allocate from an
//! absurd size: it returns a model or an error. A model that loads must score a few tokens
//! without panicking.
//!
//! More cases: `PROPTEST_CASES=20000 cargo test --release -p picaso-model --test fuzz_loaders`
//! (or `scripts/fuzz.sh loaders SECONDS`).

use std::path::Path;

use picaso_model::{LoadOptions, Mamba1Config, Mamba1Weights, Mamba2Config, Mamba2Weights, Model};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The valid tiny checkpoints the cases start from: (config.json text, model.safetensors bytes).
fn originals() -> &'static [(String, Vec<u8>)] {
    static ORIGINALS: std::sync::OnceLock<Vec<(String, Vec<u8>)>> = std::sync::OnceLock::new();
    ORIGINALS.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let read = |dir: &Path| {
            (
                std::fs::read_to_string(dir.join("config.json")).unwrap(),
                std::fs::read(dir.join("model.safetensors")).unwrap(),
            )
        };
        let mut out = Vec::new();
        let c = Mamba2Config::tiny(2, 4);
        let dir = tmp.path().join("mamba2");
        Mamba2Weights::random(&c, 1).save_pretrained(&dir, &c).unwrap();
        out.push(read(&dir));
        let c = Mamba1Config::tiny(2, 4);
        let dir = tmp.path().join("mamba1");
        Mamba1Weights::random(&c, 1).save_pretrained(&dir, &c).unwrap();
        out.push(read(&dir));
        // The state-spaces layout of the Mamba-2 model (same tensor names are accepted).
        let hf: Value = serde_json::from_str(&out[0].0).unwrap();
        let ss = json!({
            "d_model": hf["hidden_size"], "n_layer": hf["num_hidden_layers"], "vocab_size": hf["vocab_size"],
            "pad_vocab_size_multiple": 1, "ssm_cfg": {"layer": "Mamba2", "d_state": hf["state_size"],
            "headdim": hf["head_dim"], "expand": hf["expand"], "ngroups": hf["n_groups"], "d_conv": hf["conv_kernel"]},
        });
        out.push((ss.to_string(), out[0].1.clone()));
        out
    })
}

/// Values that break naive size arithmetic or type assumptions.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        prop::sample::select(vec![
            json!(0),
            json!(1),
            json!(-1),
            json!(3),
            json!(1 << 24),
            json!((1u64 << 24) + 1),
            json!(1u64 << 32),
            json!(i64::MAX),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(0.5),
            json!(-0.0),
            json!(1e308),
            json!(f64::MIN_POSITIVE),
            json!(null),
            json!(true),
            json!(""),
            json!("auto"),
            json!("Mamba2"),
            json!("mamba"),
            json!([]),
            json!([0.0, 1e9]),
            json!([1.0, 0.0]),
            json!({}),
        ]),
        any::<i64>().prop_map(|v| json!(v)),
        (0u64..300).prop_map(|v| json!(v)),
        any::<f64>().prop_map(|v| if v.is_finite() { json!(v) } else { json!(null) }),
        "[a-zA-Z0-9_]{0,12}".prop_map(|s| json!(s)),
    ]
}

/// Every key either layout uses, so retyping hits real fields.
const KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "state_size",
    "head_dim",
    "num_heads",
    "expand",
    "n_groups",
    "conv_kernel",
    "layer_norm_epsilon",
    "time_step_limit",
    "tie_word_embeddings",
    "use_bias",
    "use_conv_bias",
    "model_type",
    "intermediate_size",
    "time_step_rank",
    "d_model",
    "n_layer",
    "pad_vocab_size_multiple",
    "ssm_cfg",
    "d_intermediate",
    "attn_layer_idx",
    "rms_norm",
    "norm_epsilon",
    "tie_embeddings",
];

#[derive(Debug, Clone)]
enum ConfigEdit {
    /// Set a key (top level or in `ssm_cfg`) to a value.
    Set { key: usize, nested: bool, value: Value },
    /// Remove a key.
    Remove { key: usize, nested: bool },
    /// Damage the text: overwrite one byte.
    Byte { at: usize, byte: u8 },
    /// Cut the text.
    Truncate { at: usize },
}

fn config_edit() -> impl Strategy<Value = ConfigEdit> {
    let key = 0..KEYS.len();
    prop_oneof![
        4 => (key.clone(), any::<bool>(), hostile_value()).prop_map(|(key, nested, value)| ConfigEdit::Set { key, nested, value }),
        2 => (key, any::<bool>()).prop_map(|(key, nested)| ConfigEdit::Remove { key, nested }),
        1 => (0usize..1_000_000, any::<u8>()).prop_map(|(at, byte)| ConfigEdit::Byte { at, byte }),
        1 => (0usize..1_000_000).prop_map(|at| ConfigEdit::Truncate { at }),
    ]
}

fn apply_config(text: &str, edits: &[ConfigEdit]) -> Vec<u8> {
    let mut value: Value = serde_json::from_str(text).unwrap();
    let mut bytes = None::<Vec<u8>>;
    for e in edits {
        match e {
            ConfigEdit::Set { key, nested, .. } | ConfigEdit::Remove { key, nested } if bytes.is_none() => {
                let target = if *nested {
                    let obj = value.as_object_mut().unwrap();
                    let ssm = obj.entry("ssm_cfg").or_insert_with(|| json!({}));
                    if !ssm.is_object() {
                        *ssm = json!({});
                    }
                    ssm
                } else {
                    &mut value
                };
                let map = target.as_object_mut().unwrap();
                match e {
                    ConfigEdit::Set { value: v, .. } => {
                        map.insert(KEYS[*key].to_string(), v.clone());
                    }
                    _ => {
                        map.remove(KEYS[*key]);
                    }
                }
            }
            ConfigEdit::Set { .. } | ConfigEdit::Remove { .. } => {}
            ConfigEdit::Byte { at, byte } => {
                let b = bytes.get_or_insert_with(|| value.to_string().into_bytes());
                if !b.is_empty() {
                    let i = at * b.len() / 1_000_000;
                    b[i] = *byte;
                }
            }
            ConfigEdit::Truncate { at } => {
                let b = bytes.get_or_insert_with(|| value.to_string().into_bytes());
                let i = at * b.len() / 1_000_000;
                b.truncate(i);
            }
        }
    }
    bytes.unwrap_or_else(|| value.to_string().into_bytes())
}

#[derive(Debug, Clone)]
enum ByteDamage {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
}

fn byte_damage() -> impl Strategy<Value = ByteDamage> {
    // Half the damage lands in the first 512 bytes (the header), the rest anywhere.
    let at = prop_oneof![0usize..512, any::<usize>()];
    prop_oneof![
        (at.clone(), 0u8..8).prop_map(|(at, bit)| ByteDamage::Flip { at, bit }),
        (at.clone(), any::<u8>()).prop_map(|(at, byte)| ByteDamage::Set { at, byte }),
        at.clone().prop_map(|at| ByteDamage::Truncate { at }),
        (at, prop::collection::vec(any::<u8>(), 1..12)).prop_map(|(at, bytes)| ByteDamage::Insert { at, bytes }),
    ]
}

fn apply_bytes(bytes: &mut Vec<u8>, d: &ByteDamage) {
    let pos = |at: usize, n: usize| if n == 0 { 0 } else { at % n };
    match d {
        ByteDamage::Flip { at, bit } if !bytes.is_empty() => {
            let i = pos(*at, bytes.len());
            bytes[i] ^= 1 << bit;
        }
        ByteDamage::Set { at, byte } if !bytes.is_empty() => {
            let i = pos(*at, bytes.len());
            bytes[i] = *byte;
        }
        ByteDamage::Truncate { at } => bytes.truncate(pos(*at, bytes.len())),
        ByteDamage::Insert { at, bytes: b } => {
            let i = pos(*at, bytes.len() + 1);
            bytes.splice(i..i, b.iter().copied());
        }
        _ => {}
    }
}

/// Loads the checkpoint in `dir`; a loaded model must score tokens. Panics become failures.
fn load_and_use(dir: &Path) -> Result<Result<(), String>, String> {
    std::panic::catch_unwind(|| {
        let opts = LoadOptions { skip_tokenizer: true, ..Default::default() };
        match Model::load(dir, &opts) {
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.is_empty(), "an empty error message");
                Err(msg)
            }
            Ok(m) => {
                let n = m.config().vocab_size().min(7) as u32;
                let tokens: Vec<u32> = (0..5).map(|i| i % n.max(1)).collect();
                m.score(&tokens, &m.zero_state()).map(|_| ()).map_err(|e| e.to_string())
            }
        }
    })
    .map_err(|p| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// A config.json with fields removed, retyped or extreme, or damaged text: a model or an
    /// error, never a panic.
    #[test]
    fn damaged_configs_load_or_are_refused(which in 0usize..3, edits in prop::collection::vec(config_edit(), 1..5)) {
        let (config, weights) = &originals()[which];
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("config.json"), apply_config(config, &edits)).unwrap();
        std::fs::write(tmp.path().join("model.safetensors"), weights).unwrap();
        let outcome = load_and_use(tmp.path());
        prop_assert!(outcome.is_ok(), "panicked on {edits:?}: {}", outcome.unwrap_err());
    }

    /// A damaged model.safetensors (header or data): a model or an error, never a panic.
    #[test]
    fn damaged_weight_files_load_or_are_refused(which in 0usize..3, damages in prop::collection::vec(byte_damage(), 1..4)) {
        let (config, weights) = &originals()[which];
        let mut bytes = weights.clone();
        for d in &damages {
            apply_bytes(&mut bytes, d);
        }
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("config.json"), config).unwrap();
        std::fs::write(tmp.path().join("model.safetensors"), &bytes).unwrap();
        let outcome = load_and_use(tmp.path());
        prop_assert!(outcome.is_ok(), "panicked on {damages:?}: {}", outcome.unwrap_err());
    }
}

/// Sizes whose products overflow 64 bits are refused before anything is allocated.
#[test]
fn overflowing_sizes_are_refused() {
    let (config, weights) = &originals()[0];
    for (key, value) in
        [("hidden_size", json!(1u64 << 40)), ("vocab_size", json!(u64::MAX)), ("state_size", json!(1u64 << 33))]
    {
        let mut v: Value = serde_json::from_str(config).unwrap();
        v[key] = value.clone();
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("config.json"), v.to_string()).unwrap();
        std::fs::write(tmp.path().join("model.safetensors"), weights).unwrap();
        let e = load_and_use(tmp.path()).expect("no panic").unwrap_err();
        assert!(e.contains("over the largest supported size") || e.contains("values, over"), "{key} = {value}: {e}");
    }
}

/// The AFL++ corpus of the loader target (fuzz/afl: seeds and the inputs a coverage-guided run
/// kept) replayed: the first byte picks the file the rest replaces in the target's tiny
/// checkpoint (even, config.json; odd, model.safetensors); a model or an error, never a panic.
#[test]
fn afl_corpus_loads_or_is_refused() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/afl");
    let mut files: Vec<_> = ["seeds", "corpus"]
        .iter()
        .filter_map(|d| std::fs::read_dir(root.join(d).join("loader")).ok())
        .flatten()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no AFL++ inputs found under fuzz/afl");
    let (config, weights) = &originals()[0];
    for path in files {
        let input = std::fs::read(&path).unwrap();
        let Some((&pick, rest)) = input.split_first() else { continue };
        let (c, w) = if pick % 2 == 0 { (rest, weights.as_slice()) } else { (config.as_bytes(), rest) };
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("config.json"), c).unwrap();
        std::fs::write(tmp.path().join("model.safetensors"), w).unwrap();
        let outcome = load_and_use(tmp.path());
        assert!(outcome.is_ok(), "panicked on {}: {}", path.display(), outcome.unwrap_err());
    }
}
