//! The differentiable forward against the inference engine (which matches HF transformers):
//! equal logits and final states from any starting state, for every chunk length; and its
//! gradients against central finite differences in f64 (weights, A_log, the initial state).

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};
use picaso_model::{Mamba2Config, Mamba2Weights, Model, State};
use picaso_train::cpu::ops::Matmul;
use picaso_train::{Net, TrainMamba2, TrainState};
use rand::{Rng, SeedableRng};

mod common;
use common::GradCheck;

fn case(name: &str) -> (Mamba2Config, Mamba2Weights) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/mamba2").join(name).join("hf");
    let config = Mamba2Config::from_file(&dir.join("config.json")).unwrap();
    let weights = Mamba2Weights::load(&dir, &config).unwrap();
    (config, weights)
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

#[test]
fn matches_the_inference_engine_from_any_state() {
    for name in ["g1", "g2", "g2-untied-bias"] {
        let (config, weights) = case(name);
        let model = Model::from_weights(config.clone(), weights.clone(), None);
        let v = config.vocab_size;
        // Two batch rows continuing from two different states.
        let prefixes = [random_tokens(11, v, 1), random_tokens(5, v, 2)];
        let states: Vec<State> = prefixes.iter().map(|p| model.prefill(p, &model.zero_state()).unwrap()).collect();
        let suffixes = [random_tokens(26, v, 3), random_tokens(26, v, 4)];
        for chunk in [1, 7, 64] {
            let net = TrainMamba2::from_weights(&config, &weights, DType::F32, &Device::Cpu).unwrap().with_chunk(chunk);
            let init = TrainState::from_states(&states.iter().collect::<Vec<_>>(), DType::F32, &Device::Cpu).unwrap();
            let flat: Vec<u32> = suffixes.concat();
            let tokens = Tensor::from_vec(flat, (2, 26), &Device::Cpu).unwrap();
            let (logits, next) = net.forward(&tokens, Some(&init)).unwrap();
            for row in 0..2 {
                let (want_logits, want_state) = model.forward_all_logits(&suffixes[row], &states[row]).unwrap();
                let got: Vec<f32> = logits.get(row).unwrap().flatten_all().unwrap().to_vec1().unwrap();
                let e = max_rel(&got, &want_logits);
                assert!(e < 1e-4, "{name} chunk {chunk} row {row}: logits differ by {e:e} (relative to the max)");
                let got_state = next.to_state(row, &want_state).unwrap();
                for (l, (g, w)) in got_state.layers.iter().zip(&want_state.layers).enumerate() {
                    for (what, a, b) in
                        [("ssm", &g.ssm, &w.ssm), ("conv", &g.conv, &w.conv), ("log_decay", &g.log_decay, &w.log_decay)]
                    {
                        let e = max_rel(a, b);
                        assert!(e < 1e-4, "{name} chunk {chunk} row {row} layer {l} {what}: {e:e}");
                    }
                }
            }
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    // n_groups 2, chunk 3 over 8 tokens: the group expansion and several partial chunks.
    let config = Mamba2Config { n_groups: 2, ..Mamba2Config::tiny(2, 4) };
    let weights = Mamba2Weights::random(&config, 7);
    let net = TrainMamba2::from_weights(&config, &weights, DType::F64, &Device::Cpu).unwrap().with_chunk(3);
    let model = Model::from_weights(config.clone(), weights.clone(), None);
    let v = config.vocab_size;
    let start = model.prefill(&random_tokens(6, v, 8), &model.zero_state()).unwrap();
    let init = TrainState::from_states(&[&start, &start], DType::F64, &Device::Cpu).unwrap();
    // The initial state as variables, so the loss can be differentiated with respect to it.
    let init_vars: Vec<(Var, Var, Var)> = (0..config.n_layer)
        .map(|l| {
            (
                Var::from_tensor(&init.ssm[l]).unwrap(),
                Var::from_tensor(&init.conv[l]).unwrap(),
                Var::from_tensor(&init.log_decay[l]).unwrap(),
            )
        })
        .collect();
    let state = || TrainState {
        ssm: init_vars.iter().map(|v| v.0.as_tensor().clone()).collect(),
        conv: init_vars.iter().map(|v| v.1.as_tensor().clone()).collect(),
        log_decay: init_vars.iter().map(|v| v.2.as_tensor().clone()).collect(),
        ..TrainState::default()
    };
    let tokens = Tensor::from_vec(random_tokens(16, v, 9), (2, 8), &Device::Cpu).unwrap();
    let targets = random_tokens(16, v, 10);
    // Also weight the final SSM state, so gradients flow through the state output too.
    let probe = Tensor::randn(0f64, 1.0, init.ssm[1].shape(), &Device::Cpu).unwrap();
    let loss_of = || -> Tensor {
        let (ce, next) = net.loss(&tokens, &targets, Some(&state())).unwrap();
        (ce + (next.ssm[1].mul(&probe).unwrap().sum_all().unwrap() * 0.1).unwrap()).unwrap()
    };
    let loss = || loss_of().to_scalar::<f64>().unwrap();
    let grads = loss_of().backward().unwrap();

    let vars = net.vars();
    let mut checker = GradCheck::new(11);
    let mut check = |name: &str, var: &Var, picks: usize| checker.check(name, var, &grads, picks, &loss);
    // vars(): embedding, then per layer norm, in_proj, conv_w, dt_bias, a_log, d, gated_norm, out_proj.
    let names = ["norm", "in_proj", "conv_w", "dt_bias", "A_log", "D", "gated_norm", "out_proj"];
    check("embedding", &vars[0], 4);
    for l in 0..config.n_layer {
        for (j, name) in names.iter().enumerate() {
            check(&format!("layers.{l}.{name}"), &vars[1 + l * names.len() + j], 3);
        }
        check(&format!("init.layers.{l}.ssm"), &init_vars[l].0, 3);
        check(&format!("init.layers.{l}.conv"), &init_vars[l].1, 3);
    }
    check("norm_f", &vars[1 + config.n_layer * names.len()], 3);
    assert!(checker.checked > 50, "{} checks", checker.checked);
}

/// Six steps of a two-layer model on 2 × 16 random tokens (the pretraining tests' base).
fn tiny_pretrain_config() -> picaso_train::pretrain::PretrainConfig {
    picaso_train::pretrain::PretrainConfig {
        model: Mamba2Config { vocab_size: 64, ..Mamba2Config::tiny(2, 4) },
        seq_len: 16,
        batch: 2,
        steps: 6,
        warmup: 2,
        lr: 3e-3,
        min_lr: 3e-4,
        clip: 1.0,
        adamw: Default::default(),
        seed: 5,
        val_every: 2,
        val_sequences: 2,
        checkpoint_every: 3,
        chunk: 8,
        sampler: picaso_train::pretrain::Sampler::Epochs,
        init: Default::default(),
        loss_from: 0,
        train_stream: None,
        matmul: Default::default(),
    }
}

/// Random training and validation streams for [`tiny_pretrain_config`], no paragraph pairs.
fn tiny_token_data() -> picaso_train::pretrain::TokenData {
    picaso_train::pretrain::TokenData {
        train: random_tokens(2000, 64, 1),
        val: random_tokens(200, 64, 2),
        ..Default::default()
    }
}

/// A run killed after some steps and resumed from its checkpoint ends bit-identical to an
/// uninterrupted run (weights and loss history), with f32 and with bf16 matrix products; a
/// resume with another config is refused.
#[test]
fn a_resumed_run_equals_an_uninterrupted_one() {
    for matmul in [Matmul::F32, Matmul::Bf16] {
        resumed_run_equals_uninterrupted(matmul);
    }
}

fn resumed_run_equals_uninterrupted(matmul: Matmul) {
    use picaso_train::pretrain::{pretrain, InitOptions, PretrainConfig, Start};
    let config = PretrainConfig {
        matmul,
        val_every: 2,
        val_sequences: 3,
        checkpoint_every: 4,
        init: InitOptions { long_memory: 0.5, mimetic: true },
        loss_from: 3,
        ..tiny_pretrain_config()
    };
    let data = tiny_token_data();
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let full = pretrain(&config, &data, &a, None, Start::Fresh, |_| {}).unwrap();
    assert_eq!(full.len(), 6);
    assert!(full.iter().filter(|r| r.val_loss.is_some()).count() == 3);
    // "Killed" after 3 steps (the checkpoint at the kill point), then after 2 more, then finished.
    pretrain(&config, &data, &b, Some(3), Start::Fresh, |_| {}).unwrap();
    pretrain(&config, &data, &b, Some(2), Start::Fresh, |_| {}).unwrap();
    let resumed = pretrain(&config, &data, &b, None, Start::Fresh, |_| {}).unwrap();
    // Equal up to float rounding: the CPU sums' association can depend on buffer alignment, so
    // the last bits of a gradient norm may differ between two identical runs.
    assert_eq!(full.len(), resumed.len());
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
    for (x, y) in full.iter().zip(&resumed) {
        assert!(x.step == y.step && close(x.loss, y.loss) && close(x.grad_norm, y.grad_norm), "{x:?} vs {y:?}");
        assert_eq!(x.val_loss.is_some(), y.val_loss.is_some());
        if let (Some(a), Some(b)) = (x.val_loss, y.val_loss) {
            assert!(close(a, b), "step {}: {a} vs {b}", x.step);
        }
    }
    let wa = Mamba2Weights::load(&a.join("checkpoint"), &config.model).unwrap();
    let wb = Mamba2Weights::load(&b.join("checkpoint"), &config.model).unwrap();
    let diff = |p: &[f32], q: &[f32]| p.iter().zip(q).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(diff(&wa.embedding, &wb.embedding) < 1e-6);
    for (x, y) in wa.layers.iter().zip(&wb.layers) {
        assert!(diff(&x.in_proj, &y.in_proj) < 1e-6 && diff(&x.a_log, &y.a_log) < 1e-6);
    }
    assert!(full.last().unwrap().loss < full[0].loss, "it learns");
    for other in [
        PretrainConfig { lr: 1e-3, ..config.clone() },
        PretrainConfig { matmul: if matmul == Matmul::F32 { Matmul::Bf16 } else { Matmul::F32 }, ..config.clone() },
    ] {
        let e = pretrain(&other, &data, &b, None, Start::Fresh, |_| {}).unwrap_err().to_string();
        assert!(e.contains("another configuration"), "{e}");
    }
}

/// A save killed between its two renames (`checkpoint` → `checkpoint.old`, then
/// `checkpoint.tmp` → `checkpoint`) leaves no `checkpoint`: the next run resumes from the
/// newest complete folder beside it — a `checkpoint.tmp` whose `trainer.json` was written, else
/// `checkpoint.old` — and ends as the uninterrupted run does, instead of starting over.
#[test]
fn a_run_killed_between_the_checkpoint_renames_resumes() {
    use picaso_train::pretrain::{pretrain, LogRow, PretrainConfig, Start};
    let config = PretrainConfig { checkpoint_every: 3, ..tiny_pretrain_config() };
    let data = tiny_token_data();
    let tmp = tempfile::tempdir().unwrap();
    let full = pretrain(&config, &data, &tmp.path().join("full"), None, Start::Fresh, |_| {}).unwrap();
    // The first step this call runs, and the whole history.
    let resume = |out: &std::path::Path| -> (Option<u64>, Vec<LogRow>) {
        let mut first = None;
        let history = pretrain(&config, &data, out, None, Start::Fresh, |p| {
            first.get_or_insert(p.row.step);
        })
        .unwrap();
        (first, history)
    };
    let same = |history: &[LogRow]| {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(1.0);
        assert_eq!(history.len(), full.len());
        for (x, y) in full.iter().zip(history) {
            assert!(x.step == y.step && close(x.loss, y.loss), "{x:?} vs {y:?}");
        }
    };
    let copy = |from: &std::path::Path, to: &std::path::Path| {
        std::fs::create_dir(to).unwrap();
        for f in std::fs::read_dir(from).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
        }
    };

    // Killed after the first rename: only checkpoint.old (step 3), and a checkpoint.tmp of a
    // later save killed before its trainer.json.
    let a = tmp.path().join("a");
    pretrain(&config, &data, &a, Some(3), Start::Fresh, |_| {}).unwrap();
    std::fs::rename(a.join("checkpoint"), a.join("checkpoint.old")).unwrap();
    std::fs::create_dir(a.join("checkpoint.tmp")).unwrap();
    std::fs::write(a.join("checkpoint.tmp/model.safetensors"), b"cut short").unwrap();
    let (first, history) = resume(&a);
    assert_eq!(first, Some(4), "resumed from the step-3 checkpoint.old");
    same(&history);
    assert!(a.join("checkpoint/trainer.json").is_file());
    assert!(!a.join("checkpoint.old").exists() && !a.join("checkpoint.tmp").exists());

    // The same with the new save complete in checkpoint.tmp (step 5): the newer one wins.
    let b = tmp.path().join("b");
    pretrain(&config, &data, &b, Some(3), Start::Fresh, |_| {}).unwrap();
    copy(&b.join("checkpoint"), &tmp.path().join("step3"));
    pretrain(&config, &data, &b, Some(2), Start::Fresh, |_| {}).unwrap();
    std::fs::rename(b.join("checkpoint"), b.join("checkpoint.tmp")).unwrap();
    std::fs::rename(tmp.path().join("step3"), b.join("checkpoint.old")).unwrap();
    let (first, history) = resume(&b);
    assert_eq!(first, Some(6), "resumed from the step-5 checkpoint.tmp");
    same(&history);
}

/// A run on a machine without its checkpoint warm-starts from a model folder with
/// `progress.json`: it continues at the recorded step with the recorded history, starts the
/// optimiser's moments afresh, and says so in its log; a folder of another config is refused.
#[test]
fn a_run_warm_starts_from_a_committed_snapshot() {
    use picaso_train::pretrain::{pretrain, write_progress, PretrainConfig, Start};
    let config = PretrainConfig { val_every: 3, val_sequences: 2, checkpoint_every: 3, ..tiny_pretrain_config() };
    let data = tiny_token_data();
    let tmp = tempfile::tempdir().unwrap();
    let (a, snap, b) = (tmp.path().join("a"), tmp.path().join("snap"), tmp.path().join("b"));
    pretrain(&config, &data, &a, Some(3), Start::Fresh, |_| {}).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    let w = Mamba2Weights::load(&a.join("checkpoint"), &config.model).unwrap();
    w.save_pretrained(&snap, &config.model).unwrap();
    write_progress(&a, &snap).unwrap();
    let history = pretrain(&config, &data, &b, None, Start::Warm(&snap), |_| {}).unwrap();
    assert_eq!(history.iter().map(|r| r.step).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 6]);
    let log = std::fs::read_to_string(b.join("checkpoint/trainer.json")).unwrap();
    assert!(log.contains("warm start at step 3"), "{log}");
    let other = PretrainConfig { lr: 1e-3, ..config.clone() };
    let e = pretrain(&other, &data, &tmp.path().join("c"), None, Start::Warm(&snap), |_| {}).unwrap_err();
    assert!(e.to_string().contains("another configuration"), "{e}");
}

/// The fused f32 CPU kernels (conv, RMSNorm, cross-entropy) give the same gradients as the
/// composite f64 graph, which the finite-difference test checks.
#[test]
fn fused_f32_gradients_equal_composite_f64() {
    for name in ["g2", "g2-untied-bias"] {
        let (config, weights) = case(name);
        let v = config.vocab_size;
        let tokens: Vec<u32> = random_tokens(2 * 19, v, 21);
        let mut targets = random_tokens(2 * 19, v, 22);
        targets[5] = picaso_train::xent::IGNORE;
        let grads = |dtype: DType| -> Vec<Vec<f64>> {
            let net = TrainMamba2::from_weights(&config, &weights, dtype, &Device::Cpu).unwrap().with_chunk(8);
            let x = Tensor::from_vec(tokens.clone(), (2, 19), &Device::Cpu).unwrap();
            let (loss, _) = net.loss(&x, &targets, None).unwrap();
            let g = loss.backward().unwrap();
            net.vars()
                .iter()
                .map(|var| g.get(var).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap())
                .collect()
        };
        let (fused, composite) = (grads(DType::F32), grads(DType::F64));
        for (i, (a, b)) in fused.iter().zip(&composite).enumerate() {
            let scale = b.iter().fold(1e-6f64, |m, x| m.max(x.abs()));
            let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
            assert!(worst < 1e-4 * scale, "{name} parameter {i}: gradients differ by {worst:e} (scale {scale:e})");
        }
    }
}
