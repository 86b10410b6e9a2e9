//! The Markov property: a state is everything the model needs. Scoring `a+b` equals scoring `b`
//! from the (saved and reloaded) state of `a`, for multi-token `b` and any split point; the
//! single-token step path equals the chunked prefill.

mod common;

use common::*;
use picaso_model::{Mamba2Config, Mamba2Weights, Model, State, StateDtype};

fn roundtrip(state: &State, dtype: StateDtype) -> State {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    state.save(&path, dtype).unwrap();
    State::load(&path).unwrap()
}

#[test]
fn scoring_continues_exactly_from_a_saved_state_at_any_split() {
    for case in CASES {
        let exp = expected(case);
        let model = load(case, "hf");
        let tokens = &exp.tokens;
        let full = model.score(tokens, &model.zero_state()).unwrap();
        for split in 1..tokens.len() - 1 {
            let a = roundtrip(&model.prefill(&tokens[..split], &model.zero_state()).unwrap(), StateDtype::F32);
            // b = tokens[split..]: its first token is context, the rest are scored from the state.
            let b = model.score(&tokens[split..], &a).unwrap();
            let err = max_abs_diff(&b.logprobs, &full.logprobs[split..]);
            assert!(err < 1e-5, "{case} split {split}: continuation differs by {err}");
            // With the last token of a as context, every token of b is scored.
            let a1 = roundtrip(&model.prefill(&tokens[..split - 1], &model.zero_state()).unwrap(), StateDtype::F32);
            let bb = model.score_continuation(&tokens[split - 1..split], &tokens[split..], &a1).unwrap();
            let err = max_abs_diff(&bb.logprobs, &full.logprobs[split - 1..]);
            assert!(err < 1e-5, "{case} split {split}: score_continuation differs by {err}");
        }
        let a = model.prefill(&tokens[..13], &model.zero_state()).unwrap();
        let b = model.prefill(&tokens[13..], &a).unwrap();
        for (x, y) in b.layers.iter().zip(&full.state.layers) {
            assert!(rel_err(&x.ssm, &y.ssm) < 1e-5 && rel_err(&x.conv, &y.conv) < 1e-6);
            assert!(rel_err(&x.log_decay, &y.log_decay) < 1e-6);
        }
    }
}

#[test]
fn bf16_states_continue_within_tolerance() {
    // bf16 keeps ~3 significant digits of the SSM state and conv tail (log-decays stay f32).
    for case in CASES {
        let exp = expected(case);
        let model = load(case, "hf");
        let full = model.score(&exp.tokens, &model.zero_state()).unwrap();
        let a = model.prefill(&exp.tokens[..13], &model.zero_state()).unwrap();
        let a16 = roundtrip(&a, StateDtype::Bf16);
        assert_eq!(a16.layers[0].log_decay, a.layers[0].log_decay, "log-decays are stored exactly");
        let cont = model.score(&exp.tokens[13..], &a16).unwrap();
        let err = max_abs_diff(&cont.logprobs, &full.logprobs[13..]);
        assert!(err < 0.05, "{case}: bf16 continuation differs by {err}");
    }
}

#[test]
fn step_path_equals_chunked_prefill() {
    for case in CASES {
        let exp = expected(case);
        let model = load(case, "hf");
        let v = model.config().vocab_size();
        let (chunked, end) = model.forward_all_logits(&exp.tokens, &model.zero_state()).unwrap();
        let mut state = model.zero_state();
        for (i, &t) in exp.tokens.iter().enumerate() {
            let logits = model.step(t, &mut state).unwrap();
            let err = max_abs_diff(&logits, &chunked[i * v..(i + 1) * v]);
            assert!(err < 1e-4, "{case} token {i}: step logits differ by {err}");
        }
        assert_eq!(state.n_tokens, end.n_tokens);
        for (x, y) in state.layers.iter().zip(&end.layers) {
            assert!(rel_err(&x.ssm, &y.ssm) < 1e-5);
        }
    }
}

#[test]
fn prefill_in_chunks_equals_one_prefill() {
    let config = Mamba2Config::tiny(3, 4);
    let model = Model::from_weights(config.clone(), Mamba2Weights::random(&config, 7), None);
    let tokens: Vec<u32> = (0..200).map(|i| (i * 37 % 61) as u32).collect();
    let whole = model.prefill(&tokens, &model.zero_state()).unwrap();
    let mut s = model.zero_state();
    for chunk in tokens.chunks(23) {
        s = model.prefill(chunk, &s).unwrap();
    }
    for (x, y) in s.layers.iter().zip(&whole.layers) {
        assert!(rel_err(&x.ssm, &y.ssm) < 1e-5, "{}", rel_err(&x.ssm, &y.ssm));
        assert!(rel_err(&x.conv, &y.conv) < 1e-6);
        assert!(rel_err(&x.log_decay, &y.log_decay) < 1e-5);
    }
}

#[test]
fn bf16_weights_stay_close_to_f32_and_keep_the_markov_property() {
    use picaso_model::{Backend, WeightDtype};
    let config = Mamba2Config::tiny(3, 4);
    let weights = Mamba2Weights::random(&config, 17);
    let f32m = Model::from_weights(config.clone(), weights.clone(), None);
    let bf16 = Model::from_weights_on(config, weights, None, &Backend::Cpu, WeightDtype::Bf16).unwrap();
    let tokens: Vec<u32> = (0..96).map(|i| (i * 23 % 61) as u32).collect();
    let a = f32m.score(&tokens, &f32m.zero_state()).unwrap();
    let b = bf16.score(&tokens, &bf16.zero_state()).unwrap();
    let err = max_abs_diff(&a.logprobs, &b.logprobs);
    let mean =
        a.logprobs.iter().zip(&b.logprobs).map(|(x, y)| (x - y).abs() as f64).sum::<f64>() / a.logprobs.len() as f64;
    let kernel = picaso_model::cpu::matmul::Bf16Kernel::detect().name();
    eprintln!("bf16 weights ({kernel}): max |Δ logprob| {err:.4}, mean {mean:.4}");
    assert!(err > 0.0 && err < 0.2 && mean < 0.03, "bf16 weights change log-probs by {err} (mean {mean})");
    // Prefill and decode agree with each other, on whichever bf16 kernel this CPU runs. Widened
    // weights (gemm vs a matrix-vector kernel) and the dot-product chains (the same chains) agree
    // to float rounding. AMX tiles (prefill) and `vdpbf16ps` (decode) sum in different orders,
    // and a last-bit difference in an activation can flip its rounding to bf16 (a step of 2⁻⁸
    // relative) in the next product: they agree to that rounding, far inside bf16's own change.
    let v = bf16.config().vocab_size();
    let (all, _) = bf16.forward_all_logits(&tokens, &bf16.zero_state()).unwrap();
    let mut s = bf16.zero_state();
    let mut diffs = Vec::new();
    for &t in &tokens {
        let l = bf16.step(t, &mut s).unwrap();
        diffs.push(max_abs_diff(&l, &all[diffs.len() * v..(diffs.len() + 1) * v]));
    }
    let (worst, typical) = (diffs.iter().cloned().fold(0.0, f64::max), median(&diffs));
    eprintln!("prefill vs decode logits ({kernel}): max |Δ| {worst:.2e}, median {typical:.2e}");
    if kernel == "amx-tiles" {
        assert!(worst < 0.05 && typical < 1e-5, "prefill and decode differ by {worst} (median {typical})");
    } else {
        assert!(worst < 1e-4, "prefill and decode differ by {worst}");
    }
    let half = bf16.prefill(&tokens[..40], &bf16.zero_state()).unwrap();
    let cont = bf16.score(&tokens[40..], &half).unwrap();
    assert!(max_abs_diff(&cont.logprobs, &b.logprobs[40..]) < 1e-5);
}

/// The median of `v` (not empty).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}
