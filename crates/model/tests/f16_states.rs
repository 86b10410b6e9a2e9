//! Decoding with the SSM state held as f16 (half the bytes a batched step reads and writes):
//! every step is the f32 step of the widened values, rounded; a batch gives each sequence its
//! lone bits; log-probs stay close to decoding with f32 states; engines that cannot hold f16
//! states say so instead of running.

use half::f16;
use picaso_model::{Backend, Mamba1Config, Mamba1Weights, Mamba2Config, Mamba2Weights, Model, State, WeightDtype};

fn mamba2(dtype: WeightDtype) -> Model {
    let c = Mamba2Config { d_model: 128, headdim: 32, ..Mamba2Config::tiny(2, 4) };
    Model::from_weights_on(c.clone(), Mamba2Weights::random(&c, 3), None, &Backend::Cpu, dtype).unwrap()
}

/// Token ids from a seed, all in the vocabulary.
fn tokens(model: &Model, seed: u32, n: usize) -> Vec<u32> {
    let v = model.config().vocab_size() as u32;
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % v).collect()
}

fn log_softmax_at(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits[token as usize] as f64 - max - sum.ln()
}

#[test]
fn an_f16_step_is_the_f32_step_of_the_widened_state_rounded() {
    for dtype in [WeightDtype::F32, WeightDtype::Bf16] {
        let model = mamba2(dtype);
        assert!(model.runs_f16_states());
        let start = model.prefill(&tokens(&model, 1, 9), &model.zero_state()).unwrap();
        let mut half = start.to_f16();
        assert_eq!(half.to_f32().to_f16(), half, "f16 → f32 → f16 is the identity");
        for step in 0..6 {
            let token = tokens(&model, 50 + step, 1)[0];
            let mut wide = half.to_f32();
            let want = model.step_batch(&[token], &mut [&mut wide]).unwrap();
            let got = model.step_batch(&[token], &mut [&mut half]).unwrap();
            assert_eq!(got, want, "{dtype:?} step {step}: logits");
            assert_eq!(half, wide.to_f16(), "{dtype:?} step {step}: the new state is the f32 one rounded");
        }
        assert_eq!(half.n_tokens, start.n_tokens + 6);
    }
}

#[test]
fn a_batch_of_f16_steps_gives_each_sequence_its_lone_bits() {
    let model = mamba2(WeightDtype::F32);
    let starts: Vec<State<f16>> = (0..5)
        .map(|i| model.prefill(&tokens(&model, i, 2 + 3 * i as usize), &model.zero_state()).unwrap().to_f16())
        .collect();
    let (mut alone, mut batched) = (starts.clone(), starts);
    for step in 0..4 {
        let next: Vec<u32> = (0..5).map(|i| tokens(&model, 100 + step * 5 + i, 1)[0]).collect();
        let want: Vec<f32> =
            alone.iter_mut().zip(&next).flat_map(|(s, &t)| model.step_batch(&[t], &mut [s]).unwrap()).collect();
        let mut refs: Vec<&mut State<f16>> = batched.iter_mut().collect();
        assert_eq!(model.step_batch(&next, &mut refs).unwrap(), want, "step {step}");
        assert_eq!(alone, batched, "step {step}: states");
    }
}

#[test]
fn f16_states_keep_log_probs_close_to_f32_states() {
    let model = mamba2(WeightDtype::F32);
    let prompt = model.prefill(&tokens(&model, 7, 8), &model.zero_state()).unwrap();
    let text = tokens(&model, 11, 97);
    let (mut exact, mut half) = (prompt.clone(), prompt.to_f16());
    let (mut worst, mut total) = (0.0f64, 0.0f64);
    for w in text.windows(2) {
        let a = model.step_batch(&[w[0]], &mut [&mut exact]).unwrap();
        let b = model.step_batch(&[w[0]], &mut [&mut half]).unwrap();
        let d = (log_softmax_at(&a, w[1]) - log_softmax_at(&b, w[1])).abs();
        worst = worst.max(d);
        total += d;
    }
    let mean = total / (text.len() - 1) as f64;
    println!("96 steps: |Δ log p| mean {mean:.2e}, max {worst:.2e}");
    assert!(worst > 0.0, "rounding the state to f16 changes something");
    assert!(worst < 1e-2 && mean < 2e-3, "f16 states moved log-probs by {worst} at most, {mean} on average");
}

#[test]
fn engines_without_f16_states_refuse_them() {
    let c = Mamba2Config::tiny(2, 4);
    let candle = Backend::Candle { device: candle_core::Device::Cpu, dtype: candle_core::DType::F32 };
    let on_candle =
        Model::from_weights_on(c.clone(), Mamba2Weights::random(&c, 3), None, &candle, WeightDtype::F32).unwrap();
    let c1 = Mamba1Config::tiny(2, 4);
    let mamba1 = Model::from_mamba1_weights(c1.clone(), Mamba1Weights::random(&c1, 5), None);
    for (name, model) in [("candle", on_candle), ("mamba1", mamba1)] {
        assert!(!model.runs_f16_states(), "{name}");
        let mut state = model.zero_state().to_f16();
        let err = model.step_batch(&[1], &mut [&mut state]).unwrap_err().to_string();
        assert!(err.contains("f16") && err.contains("f32"), "{name}: {err}");
    }
}
