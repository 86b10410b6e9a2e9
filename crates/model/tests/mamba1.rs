//! Mamba-1 end to end: exact agreement with HF transformers' `MambaForCausalLM` (fixtures from
//! scripts/make_mamba1_fixtures.py, float64) in both checkpoint layouts, the multi-token Markov
//! property through a saved state file, and composition with per-element decays: Proposition 1
//! (one layer, no conv) and the permutation averages checked against brute force.

mod common;

use common::*;
use picaso_model::{compose, Arch, Composition, Mamba1Config, Mamba1Weights, Model, State, StateDtype};

const FORMATS: [&str; 2] = ["hf", "state-spaces"];

fn dir(case: &str) -> std::path::PathBuf {
    fixture_dir("mamba1", case)
}

#[test]
fn logprobs_and_states_match_transformers() {
    for case in MAMBA1_CASES {
        let exp = expected_in(&dir(case));
        for format in FORMATS {
            let model = load_from(&dir(case).join(format));
            assert_eq!(model.config().arch(), Arch::Mamba1);
            let scored = model.score(&exp.tokens, &model.zero_state()).unwrap();
            let err = max_abs_diff(&scored.logprobs, exp.get("logprobs"));
            eprintln!("mamba1 {case}/{format}: max logprob error {err:.2e}");
            assert!(err < 1e-4, "{case}/{format}: logprobs differ by {err}");
            for (prefix, len) in [("short", 2usize), ("prefix", 13), ("full", exp.tokens.len())] {
                let state = model.prefill(&exp.tokens[..len], &model.zero_state()).unwrap();
                for (i, layer) in state.layers.iter().enumerate() {
                    for (name, got) in [("ssm", &layer.ssm), ("conv", &layer.conv), ("log_decay", &layer.log_decay)] {
                        let key = format!("{prefix}.layers.{i}.{name}");
                        let err = rel_err(got, exp.get(&key));
                        assert!(err < 1e-5, "{case}/{format}: {key} differs by {err} (relative)");
                    }
                }
            }
        }
        let (a, b) = (load_from(&dir(case).join("hf")), load_from(&dir(case).join("state-spaces")));
        assert_eq!(a.fingerprint(), b.fingerprint(), "{case}: one model in two layouts");
        assert!(a.fingerprint().starts_with("mamba1-"));
    }
}

/// Scoring a+b equals scoring b from the state of a, for multi-token b, through a state file
/// (f32 exactly; bf16 within its precision), and the continuation matches the reference.
#[test]
fn markov_property_through_a_saved_state() {
    let tmp = tempfile::tempdir().unwrap();
    for case in MAMBA1_CASES {
        let exp = expected_in(&dir(case));
        let model = load_from(&dir(case).join("hf"));
        let whole = model.score(&exp.tokens, &model.zero_state()).unwrap();
        // The state after tokens[..split - 1]; scoring tokens[split - 1..] from it predicts
        // tokens[split..], the tail of the whole sequence's log-probs.
        for split in [2usize, 3, 14, 31] {
            let prefix = model.prefill(&exp.tokens[..split - 1], &model.zero_state()).unwrap();
            let path = tmp.path().join(format!("{case}-{split}.safetensors"));
            prefix.save(&path, StateDtype::F32).unwrap();
            let loaded = State::load(&path).unwrap();
            assert_eq!(loaded, prefix, "{case}: f32 state files round-trip exactly");
            assert_eq!(loaded.shape.arch, Arch::Mamba1);
            let cont = model.score(&exp.tokens[split - 1..], &loaded).unwrap();
            let err = max_abs_diff(&cont.logprobs, &whole.logprobs[split - 1..]);
            assert!(err < 1e-5, "{case} split {split}: continuation differs by {err}");
            assert!(max_abs_diff(&cont.logprobs, &exp.get("logprobs")[split - 1..]) < 1e-4);
            assert!(rel_err(&cont.state.layers[0].ssm, &whole.state.layers[0].ssm) < 1e-5);
            prefix.save(&path, StateDtype::Bf16).unwrap();
            let half = State::load(&path).unwrap();
            assert_eq!(half.layers[0].log_decay, prefix.layers[0].log_decay, "log-decays stay f32");
            let cont = model.score(&exp.tokens[split - 1..], &half).unwrap();
            assert!(max_abs_diff(&cont.logprobs, &whole.logprobs[split - 1..]) < 5e-2);
        }
    }
}

fn tiny(n_layer: usize, d_conv: usize, seed: u64) -> Model {
    let c = Mamba1Config::tiny(n_layer, d_conv);
    Model::from_mamba1_weights(c.clone(), Mamba1Weights::random(&c, seed), None)
}

fn segments(n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|s| (0..(5 + 7 * s)).map(|i| ((i * (s + 3) + 11 * s + 1) % 61) as u32).collect()).collect()
}

/// One layer, no conv: the CASO composition of the segments' states is the state of their
/// concatenation, element by element (each (channel, state) pair has its own decay).
#[test]
fn proposition_1_with_per_element_decays() {
    let model = tiny(1, 1, 3);
    let segs = segments(3);
    let states: Vec<State> = segs.iter().map(|s| model.prefill(s, &model.zero_state()).unwrap()).collect();
    let refs: Vec<&State> = states.iter().collect();
    for order in [[0usize, 1, 2], [2, 0, 1], [1, 2, 0]] {
        let tokens: Vec<u32> = order.iter().flat_map(|&i| segs[i].clone()).collect();
        let whole = model.prefill(&tokens, &model.zero_state()).unwrap();
        let caso = compose(Composition::Caso, &refs, Some(&order)).unwrap();
        let err = rel_err(&caso.layers[0].ssm, &whole.layers[0].ssm);
        assert!(err < 1e-5, "order {order:?}: CASO differs from the concatenation by {err}");
        assert!(rel_err(&caso.layers[0].log_decay, &whole.layers[0].log_decay) < 1e-5);
        // The decays really differ per element, so a per-channel weight would not do.
        let ld = &whole.layers[0].log_decay;
        assert!(ld[0] != ld[1], "per-element decays");
    }
}

/// PICASO-S is the mean of CASO over all n! orders and PICASO-R over the n rotations, per
/// element, on real Mamba-1 states.
#[test]
fn permutation_averages_match_brute_force() {
    let model = tiny(2, 4, 5);
    let segs = segments(4);
    let states: Vec<State> = segs.iter().map(|s| model.prefill(s, &model.zero_state()).unwrap()).collect();
    let refs: Vec<&State> = states.iter().collect();
    let mean_of = |orders: &[Vec<usize>]| -> Vec<Vec<f64>> {
        let mut acc: Vec<Vec<f64>> = states[0].layers.iter().map(|l| vec![0.0; l.ssm.len()]).collect();
        for o in orders {
            let c = compose(Composition::Caso, &refs, Some(o)).unwrap();
            for (a, l) in acc.iter_mut().zip(&c.layers) {
                for (x, v) in a.iter_mut().zip(&l.ssm) {
                    *x += f64::from(*v) / orders.len() as f64;
                }
            }
        }
        acc
    };
    let mut all = Vec::new();
    permutations(&mut vec![0, 1, 2, 3], 0, &mut all);
    assert_eq!(all.len(), 24);
    let rotations: Vec<Vec<usize>> = (0..4).map(|r| (0..4).map(|j| (r + j) % 4).collect()).collect();
    for (method, orders) in [(Composition::PicasoS, &all), (Composition::PicasoR, &rotations)] {
        let want = mean_of(orders);
        let got = compose(method, &refs, None).unwrap();
        for (l, (w, g)) in want.iter().zip(&got.layers).enumerate() {
            let w32: Vec<f32> = w.iter().map(|&v| v as f32).collect();
            let err = rel_err(&g.ssm, &w32);
            assert!(err < 1e-5, "{method:?} layer {l}: differs from brute force by {err}");
        }
    }
}

fn permutations(p: &mut Vec<usize>, at: usize, out: &mut Vec<Vec<usize>>) {
    if at == p.len() {
        out.push(p.clone());
        return;
    }
    for i in at..p.len() {
        p.swap(at, i);
        permutations(p, at + 1, out);
        p.swap(at, i);
    }
}

/// The device-generic candle engine (on the CPU, or the device `candle_backend` names) is held
/// to the same reference, and agrees with the CPU engine on a longer sequence (several
/// 16-channel blocks, remainder included).
#[test]
fn candle_engine_matches_transformers_and_the_cpu_engine() {
    let opts = picaso_model::LoadOptions { backend: candle_backend(), skip_tokenizer: true, ..Default::default() };
    for case in MAMBA1_CASES {
        let exp = expected_in(&dir(case));
        let model = Model::load(&dir(case).join("hf"), &opts).unwrap();
        let scored = model.score(&exp.tokens, &model.zero_state()).unwrap();
        let err = max_abs_diff(&scored.logprobs, exp.get("logprobs"));
        assert!(err < 1e-4, "{case}: candle logprobs differ by {err}");
        let prefix = model.prefill(&exp.tokens[..13], &model.zero_state()).unwrap();
        for (i, layer) in prefix.layers.iter().enumerate() {
            for (name, got) in [("ssm", &layer.ssm), ("conv", &layer.conv), ("log_decay", &layer.log_decay)] {
                let key = format!("prefix.layers.{i}.{name}");
                assert!(rel_err(got, exp.get(&key)) < 1e-5, "{case}: candle {key}");
            }
        }
        // From the state after 13 tokens, scoring tokens[13..] predicts tokens[14..].
        let cont = model.score(&exp.tokens[13..], &prefix).unwrap();
        assert!(max_abs_diff(&cont.logprobs, &exp.get("logprobs")[13..]) < 1e-4, "{case}: candle continuation");
    }
    let c = Mamba1Config { d_model: 27, ..Mamba1Config::tiny(3, 4) };
    let w = Mamba1Weights::random(&c, 9);
    let cpu = Model::from_mamba1_weights(c.clone(), w.clone(), None);
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let gen = Model::load(dir.path(), &opts).unwrap();
    assert_eq!(cpu.fingerprint(), gen.fingerprint(), "saved and reloaded: the same model");
    let tokens: Vec<u32> = (0..150).map(|i| (i * 17 % 61) as u32).collect();
    let (a, b) = (cpu.score(&tokens, &cpu.zero_state()).unwrap(), gen.score(&tokens, &gen.zero_state()).unwrap());
    assert!(max_abs_diff(&a.logprobs, &b.logprobs) < 1e-4);
    for (x, y) in a.state.layers.iter().zip(&b.state.layers) {
        assert!(rel_err(&x.ssm, &y.ssm) < 1e-5 && rel_err(&x.conv, &y.conv) < 1e-6);
        assert!(rel_err(&x.log_decay, &y.log_decay) < 1e-5);
    }
}

/// States do not cross architectures; a Mamba-2 checkpoint under a Mamba-1 config is named.
#[test]
fn bad_input_is_refused() {
    let m1 = tiny(2, 4, 1);
    let m2 = {
        let c = picaso_model::Mamba2Config::tiny(2, 4);
        Model::from_weights(c.clone(), picaso_model::Mamba2Weights::random(&c, 1), None)
    };
    let s1 = m1.prefill(&[1, 2, 3], &m1.zero_state()).unwrap();
    let e = m2.score(&[4, 5], &s1).unwrap_err().to_string();
    assert!(e.contains("another model"), "{e}");
    // A Mamba-2 tensor in a Mamba-1 checkpoint is named.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir("a").join("hf/config.json"), tmp.path().join("config.json")).unwrap();
    std::fs::copy(case_dir("g1").join("hf/model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let opts = picaso_model::LoadOptions { skip_tokenizer: true, ..Default::default() };
    let e = Model::load(tmp.path(), &opts).unwrap_err().to_string();
    assert!(e.contains("Mamba-2 tensor") || e.contains("missing tensor") || e.contains("has shape"), "{e}");
}
