//! Exact agreement with HF transformers (fixtures from scripts/make_mamba2_fixtures.py,
//! computed in float64): log-probs within 1e-4, states within 1e-5 of their scale, for both
//! checkpoint layouts.

mod common;

use common::*;

const FORMATS: [&str; 2] = ["hf", "state-spaces"];

#[test]
fn logprobs_match_transformers() {
    for case in CASES {
        let exp = expected(case);
        for format in FORMATS {
            let model = load(case, format);
            let scored = model.score(&exp.tokens, &model.zero_state()).unwrap();
            let err = max_abs_diff(&scored.logprobs, exp.get("logprobs"));
            eprintln!("{case}/{format}: max logprob error {err:.2e}");
            assert!(err < 1e-4, "{case}/{format}: logprobs differ by {err}");
        }
    }
}

#[test]
fn states_match_transformers() {
    for case in CASES {
        let exp = expected(case);
        for format in FORMATS {
            let model = load(case, format);
            for (prefix, len) in [("short", 2usize), ("prefix", 13), ("full", exp.tokens.len())] {
                let state = model.prefill(&exp.tokens[..len], &model.zero_state()).unwrap();
                assert_eq!(state.n_tokens, len as u64);
                for (i, layer) in state.layers.iter().enumerate() {
                    for (name, got) in [("ssm", &layer.ssm), ("conv", &layer.conv), ("log_decay", &layer.log_decay)] {
                        let key = format!("{prefix}.layers.{i}.{name}");
                        let err = rel_err(got, exp.get(&key));
                        assert!(err < 1e-5, "{case}/{format}: {key} differs by {err} (relative)");
                    }
                }
            }
        }
    }
}

#[test]
fn both_layouts_give_the_same_fingerprint() {
    for case in CASES {
        let a = load(case, "hf");
        let b = load(case, "state-spaces");
        assert_eq!(a.fingerprint(), b.fingerprint(), "{case}");
        assert_eq!(a.config().vocab_size(), b.config().vocab_size());
    }
    assert_ne!(load("g1", "hf").fingerprint(), load("g2", "hf").fingerprint());
}

/// The device-generic candle engine (on the CPU, or the device `candle_backend` names) is held
/// to the same reference.
#[test]
fn candle_engine_matches_transformers() {
    use picaso_model::{LoadOptions, Model};
    for case in CASES {
        let exp = expected(case);
        let opts = LoadOptions { backend: candle_backend(), skip_tokenizer: true, ..Default::default() };
        let model = Model::load(&case_dir(case).join("hf"), &opts).unwrap();
        let scored = model.score(&exp.tokens, &model.zero_state()).unwrap();
        let err = max_abs_diff(&scored.logprobs, exp.get("logprobs"));
        assert!(err < 1e-4, "{case}: candle logprobs differ by {err}");
        // From a state, continuing: states and log-probs as the reference.
        let prefix = model.prefill(&exp.tokens[..13], &model.zero_state()).unwrap();
        for (i, layer) in prefix.layers.iter().enumerate() {
            for (name, got) in [("ssm", &layer.ssm), ("conv", &layer.conv), ("log_decay", &layer.log_decay)] {
                let key = format!("prefix.layers.{i}.{name}");
                assert!(rel_err(got, exp.get(&key)) < 1e-5, "{case}: candle {key}");
            }
        }
        let cont = model.score(&exp.tokens[13..], &prefix).unwrap();
        assert!(max_abs_diff(&cont.logprobs, &exp.get("logprobs")[13..]) < 1e-4);
    }
}

#[test]
fn candle_and_cpu_engines_agree_on_a_longer_sequence() {
    use picaso_model::{Mamba2Config, Mamba2Weights, Model};
    let config = Mamba2Config::tiny(3, 4);
    let weights = Mamba2Weights::random(&config, 9);
    let cpu = Model::from_weights(config.clone(), weights.clone(), None);
    let gen = Model::from_weights_on(config, weights, None, &candle_backend(), Default::default()).unwrap();
    assert_eq!(cpu.fingerprint(), gen.fingerprint());
    let tokens: Vec<u32> = (0..150).map(|i| (i * 17 % 61) as u32).collect();
    let a = cpu.score(&tokens, &cpu.zero_state()).unwrap();
    let b = gen.score(&tokens, &gen.zero_state()).unwrap();
    assert!(max_abs_diff(&a.logprobs, &b.logprobs) < 1e-4);
    for (x, y) in a.state.layers.iter().zip(&b.state.layers) {
        assert!(rel_err(&x.ssm, &y.ssm) < 1e-5 && rel_err(&x.conv, &y.conv) < 1e-6);
        assert!(rel_err(&x.log_decay, &y.log_decay) < 1e-5);
    }
}

/// A checkpoint split into shards with `model.safetensors.index.json` loads to the same model.
#[test]
fn sharded_checkpoints_load() {
    use picaso_model::weights::read_tensors;
    let src = case_dir("g2").join("hf");
    let tensors = read_tensors(&src).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (shard, chunk) in names.chunks(names.len().div_ceil(3)).enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", shard + 1);
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = chunk
            .iter()
            .map(|n| {
                let t = &tensors[*n];
                ((*n).clone(), t.shape.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView)> = bytes
            .iter()
            .map(|(n, s, b)| {
                (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
            })
            .collect();
        std::fs::write(dir.path().join(&file), safetensors::tensor::serialize(views, None).unwrap()).unwrap();
        for n in chunk {
            weight_map.insert((*n).clone(), serde_json::Value::String(file.clone()));
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.path().join("model.safetensors.index.json"), index.to_string()).unwrap();
    let opts = picaso_model::LoadOptions { skip_tokenizer: true, ..Default::default() };
    let sharded = picaso_model::Model::load(dir.path(), &opts).unwrap();
    assert_eq!(sharded.fingerprint(), load("g2", "hf").fingerprint());
}
