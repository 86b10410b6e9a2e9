//! Composition fine-tuning: the differentiable PICASO-R equals the inference composition; the
//! batched, padded context states equal the inference engine's; gradients reach the weights
//! through the composition under BPTC and not under BP2C; a resumed run equals an
//! uninterrupted one.

use candle_core::{DType, Device, Tensor, Var};
use picaso_model::{compose, Composition, Mamba2Config, Mamba2Weights, Model, State};
use picaso_train::compose::{finetune, picaso_r, ComposeConfig, Dataset, Example, Objective};
use picaso_train::{Net, TrainMamba2, TrainState};

mod common;
use common::{dataset, tokens};

fn setup() -> (Mamba2Config, Mamba2Weights, Model) {
    let c = Mamba2Config { vocab_size: 48, ..Mamba2Config::tiny(2, 4) };
    let w = Mamba2Weights::random(&c, 7);
    let m = Model::from_weights(c.clone(), w.clone(), None);
    (c, w, m)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn picaso_r_equals_the_inference_composition() {
    let (c, _, m) = setup();
    // Two examples of three contexts each, lengths varied so decays differ.
    let lists: Vec<Vec<u32>> = (0..6).map(|i| tokens(3 + 5 * i, c.vocab_size, i as u64)).collect();
    let states: Vec<State> = lists.iter().map(|t| m.prefill(t, &m.zero_state()).unwrap()).collect();
    let refs: Vec<&State> = states.iter().collect();
    let batch = TrainState::from_states(&refs, DType::F32, &Device::Cpu).unwrap();
    let got = picaso_r(&batch, 2, 3).unwrap();
    for e in 0..2 {
        let want = compose(Composition::PicasoR, &refs[3 * e..3 * e + 3], None).unwrap();
        let row = got.to_state(e, &want).unwrap();
        for (l, (g, w)) in row.layers.iter().zip(&want.layers).enumerate() {
            let scale = w.ssm.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
            assert!(max_diff(&g.ssm, &w.ssm) < 1e-5 * scale, "example {e} layer {l} ssm");
            assert!(max_diff(&g.conv, &w.conv) < 1e-5, "example {e} layer {l} conv");
            assert!(max_diff(&g.log_decay, &w.log_decay) < 1e-4, "example {e} layer {l} log-decay");
        }
    }
}

#[test]
fn padded_batched_context_states_equal_the_inference_engine() {
    let (c, w, m) = setup();
    let lists: Vec<Vec<u32>> =
        [1usize, 2, 9, 4, 17, 3, 12].iter().enumerate().map(|(i, &n)| tokens(n, 48, 10 + i as u64)).collect();
    let refs: Vec<&[u32]> = lists.iter().map(Vec::as_slice).collect();
    let net = TrainMamba2::from_weights(&c, &w, DType::F32, &Device::Cpu).unwrap().with_chunk(4);
    for group in [1, 3, 16] {
        let batch = net.context_states(&refs, group).unwrap();
        for (i, t) in lists.iter().enumerate() {
            let want = m.prefill(t, &m.zero_state()).unwrap();
            let got = batch.to_state(i, &want).unwrap();
            for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
                let scale = w.ssm.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
                assert!(max_diff(&g.ssm, &w.ssm) < 1e-4 * scale, "group {group} list {i} layer {l} ssm");
                assert!(max_diff(&g.conv, &w.conv) < 1e-5, "group {group} list {i} layer {l} conv");
                assert!(max_diff(&g.log_decay, &w.log_decay) < 1e-4, "group {group} list {i} layer {l} log-decay");
            }
        }
    }
}

/// d/dℓ of the composed state by autograd equals central differences (f64): the gradient
/// BPTC sends back through the composition weights is right.
#[test]
fn composition_gradients_match_finite_differences() {
    let (b, k, h, p, n) = (2, 3, 2, 2, 3);
    let dev = Device::Cpu;
    let ssm = Tensor::randn(0f64, 1.0, (b * k, h, p, n), &dev).unwrap();
    let conv = Tensor::randn(0f64, 1.0, (b * k, 4, 3), &dev).unwrap();
    let ld = Var::from_tensor(&(Tensor::rand(0f64, 1.0, (b * k, h), &dev).unwrap() * -3.0).unwrap()).unwrap();
    let probe = Tensor::randn(0f64, 1.0, (b, h, p, n), &dev).unwrap();
    let loss = |ld: &Tensor| -> Tensor {
        let s = TrainState {
            ssm: vec![ssm.clone()],
            conv: vec![conv.clone()],
            log_decay: vec![ld.clone()],
            ..TrainState::default()
        };
        picaso_r(&s, b, k).unwrap().ssm[0].mul(&probe).unwrap().sum_all().unwrap()
    };
    let g = loss(ld.as_tensor()).backward().unwrap().get(&ld).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let base = ld.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for i in 0..base.len() {
        let at = |d: f64| {
            let mut v = base.clone();
            v[i] += d;
            loss(&Tensor::from_vec(v, (b * k, h), &dev).unwrap()).to_scalar::<f64>().unwrap()
        };
        let num = (at(1e-6) - at(-1e-6)) / 2e-6;
        assert!((g[i] - num).abs() < 1e-6 * num.abs().max(1.0), "ℓ[{i}]: autograd {} vs {num}", g[i]);
    }
}

fn config(c: &Mamba2Config, objective: Objective) -> ComposeConfig {
    ComposeConfig {
        model: c.clone(),
        objective,
        batch: 3,
        steps: 5,
        warmup: 1,
        lr: 3e-3,
        min_lr: 3e-4,
        clip: 1.0,
        adamw: Default::default(),
        max_k: 3,
        min_k: 0,
        seed: 9,
        val_every: 2,
        val_k: 2,
        checkpoint_every: 2,
        chunk: 4,
    }
}

#[test]
fn a_resumed_finetune_equals_an_uninterrupted_one() {
    let (c, w, m) = setup();
    let data = dataset(&m);
    for objective in [Objective::Bptc, Objective::Bp2c] {
        let cfg = config(&c, objective);
        let tmp = tempfile::tempdir().unwrap();
        let full =
            finetune::<TrainMamba2>(&cfg, &w, "the test model", &data, &tmp.path().join("a"), None, usize::MAX, |_| {})
                .unwrap();
        finetune::<TrainMamba2>(&cfg, &w, "the test model", &data, &tmp.path().join("b"), Some(3), usize::MAX, |_| {})
            .unwrap();
        let resumed =
            finetune::<TrainMamba2>(&cfg, &w, "the test model", &data, &tmp.path().join("b"), None, usize::MAX, |_| {})
                .unwrap();
        // Equal up to float rounding: the CPU sums' association can depend on buffer alignment,
        // so the last bits of a gradient norm may differ between two identical runs.
        assert_eq!(full.len(), resumed.len());
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
        for (x, y) in full.iter().zip(&resumed) {
            assert_eq!((x.step, x.k), (y.step, y.k), "{objective:?}: the same batches");
            assert!(
                close(x.loss, y.loss) && close(x.grad_norm, y.grad_norm),
                "{objective:?} step {}: {x:?} vs {y:?}",
                x.step
            );
            assert_eq!(x.val_loss.is_some(), y.val_loss.is_some());
            if let (Some(a), Some(b)) = (x.val_loss, y.val_loss) {
                assert!(close(a, b), "{objective:?} step {}: {a} vs {b}", x.step);
            }
        }
        let wa = Mamba2Weights::load(&tmp.path().join("a/checkpoint"), &c).unwrap();
        let wb = Mamba2Weights::load(&tmp.path().join("b/checkpoint"), &c).unwrap();
        for (x, y) in wa.layers.iter().zip(&wb.layers) {
            assert!(
                max_diff(&x.in_proj, &y.in_proj) < 1e-6 && max_diff(&x.a_log, &y.a_log) < 1e-6,
                "{objective:?}: the same weights"
            );
        }
        assert!(max_diff(&wa.embedding, &wb.embedding) < 1e-6);
        let other = ComposeConfig { lr: 1e-3, ..cfg.clone() };
        assert!(finetune::<TrainMamba2>(
            &other,
            &w,
            "the test model",
            &data,
            &tmp.path().join("b"),
            None,
            usize::MAX,
            |_| {}
        )
        .is_err());
    }
}

/// A checkpoint records its starting model and examples: a resume with another `--model` or
/// other examples is refused, naming the original; the same examples read from elsewhere
/// resume; a checkpoint from before the record resumes and gets one.
#[test]
fn a_finetune_resumes_only_with_its_own_model_and_examples() {
    let (c, w, m) = setup();
    let data = dataset(&m);
    let cfg = config(&c, Objective::Bp2c);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let run = |w: &Mamba2Weights, data: &Dataset, stop: u64| {
        finetune::<TrainMamba2>(&cfg, w, "the test model", data, &out, Some(stop), 3, |_| {})
    };
    run(&w, &data, 2).unwrap();
    let trainer = out.join("checkpoint/trainer.json");
    let state = || -> serde_json::Value { serde_json::from_slice(&std::fs::read(&trainer).unwrap()).unwrap() };
    assert_eq!(state()["origin"]["model"], m.fingerprint(), "the model's own fingerprint");

    let e = run(&Mamba2Weights::random(&c, 8), &data, 1).unwrap_err().to_string();
    assert!(e.contains(m.fingerprint()) && e.contains("original model (--model)"), "{e}");
    assert!(e.contains("fine-tunes the test model (fingerprint"), "the starting model named: {e}");
    let mut other = Dataset { source: "other examples".into(), ..data.clone() };
    other.train[0].query[0] ^= 1;
    let e = run(&w, &other, 1).unwrap_err().to_string();
    assert!(e.contains("generated examples") && e.contains("other examples") && e.contains("new --out"), "{e}");
    let moved = Dataset { source: "the same examples, moved".into(), ..data.clone() };
    assert_eq!(run(&w, &moved, 1).unwrap().last().unwrap().step, 3);

    let mut legacy = state();
    legacy.as_object_mut().unwrap().remove("origin");
    std::fs::write(&trainer, serde_json::to_vec(&legacy).unwrap()).unwrap();
    assert_eq!(run(&Mamba2Weights::random(&c, 8), &data, 1).unwrap().last().unwrap().step, 4, "unknown: resumed");
    assert!(state()["origin"]["model"].is_string(), "and recorded");
}

/// Micro-batches change the memory a step holds, not the step: the losses, gradient norms
/// and weights of a run one example per pass equal those of whole-batch passes.
#[test]
fn micro_batches_take_the_same_steps_as_whole_batches() {
    let (c, w, m) = setup();
    let data = dataset(&m);
    for objective in [Objective::Bptc, Objective::Bp2c] {
        let cfg = config(&c, objective);
        assert!(cfg.batch > 1, "the test needs several examples per batch");
        let tmp = tempfile::tempdir().unwrap();
        let whole = finetune::<TrainMamba2>(
            &cfg,
            &w,
            "the test model",
            &data,
            &tmp.path().join("whole"),
            None,
            cfg.batch,
            |_| {},
        )
        .unwrap();
        let micro =
            finetune::<TrainMamba2>(&cfg, &w, "the test model", &data, &tmp.path().join("micro"), None, 1, |_| {})
                .unwrap();
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * a.abs().max(1.0);
        for (x, y) in whole.iter().zip(&micro) {
            assert_eq!((x.step, x.k), (y.step, y.k));
            assert!(close(x.loss, y.loss) && close(x.grad_norm, y.grad_norm), "{objective:?}: {x:?} vs {y:?}");
            if let (Some(a), Some(b)) = (x.val_loss, y.val_loss) {
                assert!(close(a, b), "{objective:?} step {}: {a} vs {b}", x.step);
            }
        }
        let wa = Mamba2Weights::load(&tmp.path().join("whole/checkpoint"), &c).unwrap();
        let wb = Mamba2Weights::load(&tmp.path().join("micro/checkpoint"), &c).unwrap();
        for (x, y) in wa.layers.iter().zip(&wb.layers) {
            assert!(max_diff(&x.in_proj, &y.in_proj) < 1e-5, "{objective:?}: the same weights");
        }
    }
}

/// Under BPTC the loss depends on the weights through the context states; under BP2C it does
/// not, so the two give different gradients for the same batch (and BP2C's equal those of
/// a run whose contexts are the stored states as constants).
#[test]
fn bptc_differentiates_the_context_states_and_bp2c_does_not() {
    let (c, w, m) = setup();
    let data = dataset(&m);
    let net = TrainMamba2::from_weights(&c, &w, DType::F32, &Device::Cpu).unwrap().with_chunk(4);
    let ex: Vec<&Example> = data.train.iter().take(2).collect();
    let grad_of = |objective: Objective| -> Vec<f32> {
        let ids: Vec<usize> = ex.iter().flat_map(|e| e.contexts[..3].iter().rev().copied()).collect();
        let states = match objective {
            Objective::Bptc => {
                let lists: Vec<&[u32]> = ids.iter().map(|&i| data.contexts[i].tokens.as_slice()).collect();
                net.context_states(&lists, 4).unwrap()
            }
            Objective::Bp2c => {
                let held: Vec<_> = ids.iter().map(|&i| data.contexts[i].state.get().unwrap()).collect();
                let refs: Vec<&State> = held.iter().map(|s| s.as_ref()).collect();
                TrainState::from_states(&refs, DType::F32, &Device::Cpu).unwrap()
            }
        };
        let init = picaso_r(&states, 2, 3).unwrap();
        let x = Tensor::from_vec([ex[0].query.clone(), ex[1].query.clone()].concat(), (2, 5), &Device::Cpu).unwrap();
        let y: Vec<u32> = [ex[0].query.clone(), ex[1].query.clone()].concat();
        let (loss, _) = net.loss(&x, &y, Some(&init)).unwrap();
        let g = loss.backward().unwrap();
        // in_proj of layer 0: reached by the query directly and, under BPTC, through the contexts.
        g.get(&net.vars()[2]).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    };
    let (a, b) = (grad_of(Objective::Bptc), grad_of(Objective::Bp2c));
    assert!(max_diff(&a, &b) > 1e-6, "the context path adds gradient under BPTC");
}
