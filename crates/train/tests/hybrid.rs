//! The differentiable Granite 4.0 H and Nemotron-H hybrids against the inference engine (itself checked against
//! HF transformers): equal logits and final states (Mamba states, keys and values) from any
//! state, padded context states, the PICASO-R + key/value union composition and what the model
//! reads after it; its gradients against central finite differences in f64 (attention, MLP,
//! Mamba weights and the starting keys and values); composition fine-tuning of a hybrid.

use candle_core::{DType, Device, Tensor, Var};
use picaso_model::granite_hybrid::{HybridFamily, MlpKind};
use picaso_model::{
    compose, Composition, GraniteHybridConfig, GraniteHybridWeights, LoadOptions, Mamba2Config, Model, State,
};
use picaso_train::compose::{finetune, picaso_r, ComposeConfig, Objective};
use picaso_train::{Net, TrainGraniteHybrid, TrainState};

mod common;
use common::{dataset, tokens, GradCheck};

/// The tiny hybrid (`mamba, attention, mamba, attention`; 2 query heads per key head), with
/// multipliers away from 1 so each scalar is exercised, and the inference model of the same
/// weights (loaded from a saved folder, as users load one).
fn setup() -> (GraniteHybridConfig, GraniteHybridWeights, Model, tempfile::TempDir) {
    setup_of(GraniteHybridConfig {
        embedding_multiplier: 1.5,
        residual_multiplier: 0.7,
        logits_scaling: 2.0,
        ..GraniteHybridConfig::tiny(48)
    })
}

/// The same blocks as a Nemotron-H model: relu² MLPs after the attention layers only, Mamba
/// projection biases, an untied head.
fn nemotron_h() -> (GraniteHybridConfig, GraniteHybridWeights, Model, tempfile::TempDir) {
    let tiny = GraniteHybridConfig::tiny(48);
    setup_of(GraniteHybridConfig {
        family: HybridFamily::NemotronH,
        mlp_kind: MlpKind::Relu2,
        without_mlp: vec![0, 2],
        tie_embeddings: false,
        mamba: Mamba2Config { use_bias: true, tie_embeddings: false, ..tiny.mamba.clone() },
        ..tiny
    })
}

/// Both hybrids.
fn setups() -> [(GraniteHybridConfig, GraniteHybridWeights, Model, tempfile::TempDir); 2] {
    [setup(), nemotron_h()]
}

fn setup_of(c: GraniteHybridConfig) -> (GraniteHybridConfig, GraniteHybridWeights, Model, tempfile::TempDir) {
    c.validate(std::path::Path::new("test")).unwrap();
    let w = GraniteHybridWeights::random(&c, 7);
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let m = Model::load(dir.path(), &LoadOptions::default()).unwrap();
    (c, w, m, dir)
}

fn max_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6) as f64;
    a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max) / scale
}

/// Every tensor of two states of the hybrid agree to `tol` relative to each one's largest value.
fn assert_states_close(got: &State, want: &State, tol: f64, what: &str) {
    for (l, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
        for (part, a, b) in
            [("ssm", &g.ssm, &w.ssm), ("conv", &g.conv, &w.conv), ("log_decay", &g.log_decay, &w.log_decay)]
        {
            let e = max_rel(a, b);
            assert!(e < tol, "{what}: Mamba layer {l} {part} differs by {e:e}");
        }
    }
    assert_eq!(got.attention.len(), want.attention.len());
    for (l, (g, w)) in got.attention.iter().zip(&want.attention).enumerate() {
        for (part, a, b) in [("keys", &g.keys, &w.keys), ("values", &g.values, &w.values)] {
            let e = max_rel(a, b);
            assert!(e < tol, "{what}: attention layer {l} {part} differ by {e:e}");
        }
    }
}

#[test]
fn matches_the_inference_engine_from_any_state() {
    for (c, w, m, _dir) in setups() {
        matches_from_any_state(&c, &w, &m);
    }
}

fn matches_from_any_state(c: &GraniteHybridConfig, w: &GraniteHybridWeights, m: &Model) {
    let v = c.vocab_size;
    // Rows continuing from states of different lengths: the shorter one's keys are padded.
    let prefixes = [tokens(11, v, 1), tokens(5, v, 2)];
    let states: Vec<State> = prefixes.iter().map(|p| m.prefill(p, &m.zero_state()).unwrap()).collect();
    let suffixes = [tokens(26, v, 3), tokens(26, v, 4)];
    for chunk in [1, 7, 64] {
        let net = TrainGraniteHybrid::from_weights(c, w, DType::F32, &Device::Cpu).unwrap().with_chunk(chunk);
        let init = net.stack_states(&states.iter().collect::<Vec<_>>()).unwrap();
        assert!(init.kv_mask.is_some(), "keys of different lengths are masked");
        let x = Tensor::from_vec(suffixes.concat(), (2, 26), &Device::Cpu).unwrap();
        let (logits, next) = net.forward(&x, Some(&init)).unwrap();
        for row in 0..2 {
            let (want_logits, want_state) = m.forward_all_logits(&suffixes[row], &states[row]).unwrap();
            let got: Vec<f32> = logits.get(row).unwrap().flatten_all().unwrap().to_vec1().unwrap();
            let e = max_rel(&got, &want_logits);
            assert!(e < 1e-4, "chunk {chunk} row {row}: logits differ by {e:e}");
            let got_state = next.to_state(row, &want_state).unwrap();
            assert_states_close(&got_state, &want_state, 1e-4, &format!("chunk {chunk} row {row}"));
        }
    }
}

#[test]
fn padded_batched_context_states_equal_the_inference_engine() {
    let (c, w, m, _dir) = setup();
    let lists: Vec<Vec<u32>> =
        [1usize, 2, 9, 4, 17, 3, 12].iter().enumerate().map(|(i, &n)| tokens(n, 48, 10 + i as u64)).collect();
    let refs: Vec<&[u32]> = lists.iter().map(Vec::as_slice).collect();
    let net = TrainGraniteHybrid::from_weights(&c, &w, DType::F32, &Device::Cpu).unwrap().with_chunk(4);
    for group in [1, 3, 16] {
        let batch = net.context_states(&refs, group).unwrap();
        for (i, t) in lists.iter().enumerate() {
            let want = m.prefill(t, &m.zero_state()).unwrap();
            let got = batch.to_state(i, &want).unwrap();
            assert_states_close(&got, &want, 1e-4, &format!("group {group} list {i}"));
        }
    }
}

/// PICASO-R on the Mamba layers and the union of keys and values, from padded batched context
/// states, equals the inference composition, and the model reads the same continuation from it.
#[test]
fn composition_with_the_key_value_union_equals_the_inference_one() {
    for (c, w, m, _dir) in setups() {
        composition_equals_the_inference_one(&c, &w, &m);
    }
}

fn composition_equals_the_inference_one(c: &GraniteHybridConfig, w: &GraniteHybridWeights, m: &Model) {
    let (b, k) = (2, 3);
    let lists: Vec<Vec<u32>> = (0..b * k).map(|i| tokens(3 + 5 * i, 48, 40 + i as u64)).collect();
    let refs: Vec<&[u32]> = lists.iter().map(Vec::as_slice).collect();
    let net = TrainGraniteHybrid::from_weights(c, w, DType::F32, &Device::Cpu).unwrap();
    let composed = picaso_r(&net.context_states(&refs, 4).unwrap(), b, k).unwrap();
    let query = [tokens(9, 48, 50), tokens(9, 48, 51)];
    let (logits, _) =
        net.forward(&Tensor::from_vec(query.concat(), (b, 9), &Device::Cpu).unwrap(), Some(&composed)).unwrap();
    for e in 0..b {
        let parts: Vec<State> =
            lists[e * k..(e + 1) * k].iter().map(|t| m.prefill(t, &m.zero_state()).unwrap()).collect();
        let want = compose(Composition::PicasoR, &parts.iter().collect::<Vec<_>>(), None).unwrap();
        assert_states_close(&composed.to_state(e, &want).unwrap(), &want, 1e-4, &format!("example {e}"));
        let (want_logits, _) = m.forward_all_logits(&query[e], &want).unwrap();
        let got: Vec<f32> = logits.get(e).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let err = max_rel(&got, &want_logits);
        assert!(err < 1e-4, "example {e}: logits after the composed state differ by {err:e}");
    }
}

#[test]
fn gradients_match_finite_differences() {
    for (c, w, m, _dir) in setups() {
        gradients_match(&c, &w, &m);
    }
}

fn gradients_match(c: &GraniteHybridConfig, w: &GraniteHybridWeights, m: &Model) {
    let net = TrainGraniteHybrid::from_weights(c, w, DType::F64, &Device::Cpu).unwrap().with_chunk(3);
    // Two starting states of different lengths: padded, masked keys.
    let starts = [
        m.prefill(&tokens(6, 48, 8), &m.zero_state()).unwrap(),
        m.prefill(&tokens(3, 48, 9), &m.zero_state()).unwrap(),
    ];
    let init = net.stack_states(&[&starts[0], &starts[1]]).unwrap();
    let keys: Vec<Var> = init.keys.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let values: Vec<Var> = init.values.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let state = || TrainState {
        keys: keys.iter().map(|v| v.as_tensor().clone()).collect(),
        values: values.iter().map(|v| v.as_tensor().clone()).collect(),
        ..init.clone()
    };
    let x = Tensor::from_vec(tokens(16, 48, 10), (2, 8), &Device::Cpu).unwrap();
    let targets = tokens(16, 48, 11);
    // Also weight the final keys, so gradients flow through the state output too.
    let probe = Tensor::randn(0f64, 1.0, (2, 6 + 8, 1, 8), &Device::Cpu).unwrap();
    let loss_of = || -> Tensor {
        let (ce, next) = net.loss(&x, &targets, Some(&state())).unwrap();
        (ce + (next.keys[1].mul(&probe).unwrap().sum_all().unwrap() * 0.1).unwrap()).unwrap()
    };
    let loss = || loss_of().to_scalar::<f64>().unwrap();
    let grads = loss_of().backward().unwrap();
    let mut checker = GradCheck::new(12);
    let mut check = |name: &str, var: &Var, picks: usize| checker.check(name, var, &grads, picks, &loss);
    // Every parameter (the Mamba ones, attention's norm and q, k, v, o, the MLP's, the norms).
    for (i, var) in net.vars().iter().enumerate() {
        check(&format!("parameter {i}"), var, 2);
    }
    for (l, (k, v)) in keys.iter().zip(&values).enumerate() {
        check(&format!("init keys {l}"), k, 3);
        check(&format!("init values {l}"), v, 3);
    }
    assert!(checker.checked > 50, "{} checks", checker.checked);
}

/// BPTC and BP2C fine-tune a hybrid: the loss falls on the training examples, a resumed run
/// equals an uninterrupted one, and the saved model loads in the inference engine with the
/// fine-tuned weights.
#[test]
fn a_hybrid_fine_tunes_through_the_composition_and_resumes() {
    let [granite, nemotron] = setups();
    for ((c, w, m, _dir), objectives) in
        [(granite, &[Objective::Bptc, Objective::Bp2c][..]), (nemotron, &[Objective::Bptc])]
    {
        fine_tunes_and_resumes(&c, &w, &m, objectives);
    }
}

fn fine_tunes_and_resumes(c: &GraniteHybridConfig, w: &GraniteHybridWeights, m: &Model, objectives: &[Objective]) {
    let data = dataset(m);
    for &objective in objectives {
        let config = ComposeConfig {
            model: c.clone(),
            objective,
            batch: 4,
            steps: 6,
            warmup: 1,
            lr: 3e-3,
            min_lr: 3e-4,
            clip: 1.0,
            adamw: Default::default(),
            max_k: 3,
            min_k: 1,
            seed: 3,
            val_every: 3,
            val_k: 3,
            checkpoint_every: 2,
            chunk: 4,
        };
        let whole = tempfile::tempdir().unwrap();
        let log = finetune::<TrainGraniteHybrid>(&config, w, "tiny", &data, whole.path(), None, 2, |_| {}).unwrap();
        assert_eq!(log.len(), 6);
        let (first, last) = (log[0].val_loss.or(log[2].val_loss).unwrap(), log[5].val_loss.unwrap());
        assert!(last < first, "{objective:?}: validation loss {first} → {last}");
        let parts = tempfile::tempdir().unwrap();
        finetune::<TrainGraniteHybrid>(&config, w, "tiny", &data, parts.path(), Some(3), 4, |_| {}).unwrap();
        let resumed = finetune::<TrainGraniteHybrid>(&config, w, "tiny", &data, parts.path(), None, 4, |_| {}).unwrap();
        for (a, b) in log.iter().zip(&resumed) {
            assert!((a.loss - b.loss).abs() < 1e-5, "{objective:?} step {}: {} vs {}", a.step, a.loss, b.loss);
        }
        let tuned = GraniteHybridWeights::load(&whole.path().join("checkpoint"), c).unwrap();
        let saved = tempfile::tempdir().unwrap();
        tuned.save_pretrained(saved.path(), c).unwrap();
        let tuned = Model::load(saved.path(), &LoadOptions::default()).unwrap();
        assert_ne!(tuned.fingerprint(), m.fingerprint(), "{objective:?}: the weights changed");
    }
}

/// A hybrid pretrains from fresh weights on candle autograd: it learns, a run killed and
/// resumed from its checkpoint equals an uninterrupted one, context use is measured at each
/// validation, and the exported folder loads in the inference engine, which scores the
/// validation text as the trainer did.
#[test]
fn a_hybrid_pretrains_and_resumes() {
    use picaso_train::pretrain::{
        init_hybrid_weights, pretrain, ContextPair, InitOptions, PretrainArch, PretrainConfig, Sampler, Start,
        TokenData,
    };
    let mut model = GraniteHybridConfig::tiny(0);
    model.set_vocab(64);
    let config = PretrainConfig {
        model,
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
        checkpoint_every: 4,
        chunk: 8,
        sampler: Sampler::Epochs,
        init: InitOptions { long_memory: 0.5, mimetic: true },
        loss_from: 0,
        train_stream: None,
        matmul: Default::default(),
    };
    let pair = |s: u64| ContextPair {
        previous: tokens(9, 64, s),
        random: tokens(7, 64, s + 1),
        query: tokens(5, 64, s + 2),
        continuation: tokens(6, 64, s + 3),
    };
    // A stream whose next token follows from the last one, so a few steps visibly learn.
    let pattern = |n: usize, from: usize| (from..from + n).map(|i| ((i % 13) * 4 + i % 2) as u32).collect::<Vec<u32>>();
    let data = TokenData {
        train: pattern(2000, 0),
        val: pattern(200, 5),
        pairs: vec![pair(10), pair(20)],
        ..Default::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let full = pretrain(&config, &data, &a, None, Start::Fresh, |_| {}).unwrap();
    assert_eq!(full.len(), 6);
    assert!(full.last().unwrap().loss < full[0].loss, "it learns: {} → {}", full[0].loss, full[5].loss);
    assert!(full[1].context.as_ref().is_some_and(|c| c.pairs == 2 && c.none.is_finite()));
    pretrain(&config, &data, &b, Some(3), Start::Fresh, |_| {}).unwrap();
    let resumed = pretrain(&config, &data, &b, None, Start::Fresh, |_| {}).unwrap();
    for (x, y) in full.iter().zip(&resumed) {
        assert!((x.loss - y.loss).abs() < 1e-6 * x.loss, "step {}: {} vs {}", x.step, x.loss, y.loss);
    }
    let other = PretrainConfig { lr: 1e-3, ..config.clone() };
    let e = pretrain(&other, &data, &b, None, Start::Fresh, |_| {}).unwrap_err().to_string();
    assert!(e.contains("another configuration"), "{e}");

    // The exported model scores the first validation window as the trainer's validation did.
    let dir = tmp.path().join("model");
    config.model.export(&a.join("checkpoint"), &dir).unwrap();
    let m = Model::load(&dir, &LoadOptions::default()).unwrap();
    let scored = m.score(&data.val[..17], &m.zero_state()).unwrap();
    let w = GraniteHybridWeights::load(&dir, &config.model).unwrap();
    let net = TrainGraniteHybrid::from_weights(&config.model, &w, DType::F32, &Device::Cpu).unwrap();
    let x = Tensor::from_vec(data.val[..16].to_vec(), (1, 16), &Device::Cpu).unwrap();
    let (loss, _) = net.loss(&x, &data.val[1..17], None).unwrap();
    let trained = loss.to_scalar::<f32>().unwrap() as f64;
    let engine = -scored.logprobs.iter().map(|&l| l as f64).sum::<f64>() / scored.logprobs.len() as f64;
    assert!((trained - engine).abs() < 1e-4, "trainer {trained} vs engine {engine}");
    // Fresh weights follow the reference scheme: unit norms, small projections.
    let init = init_hybrid_weights(&config.model, 5, &InitOptions::default());
    assert!(init.layers.iter().all(|l| l.mlp.as_ref().unwrap().norm.iter().all(|&x| x == 1.0)));
}

/// Training covers the dense NoPE Granite 4.0 H and Nemotron-H hybrids: a Falcon-H1 model
/// (attention beside each Mamba mixer, RoPE) and a Nemotron 3 one (routed experts) are refused by
/// name, never trained as the blocks they are not.
#[test]
fn other_hybrids_are_refused_for_training() {
    let fixture = |case: &str| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/granite").join(case).join("hf");
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let c = match map["model_type"].as_str() {
            Some("falcon_h1") => GraniteHybridConfig::from_falcon_h1(&dir.join("config.json"), &map),
            _ => GraniteHybridConfig::from_nemotron_h(&dir.join("config.json"), &map),
        }
        .unwrap();
        let w = GraniteHybridWeights::load(&dir, &c).unwrap();
        TrainGraniteHybrid::from_weights(&c, &w, DType::F32, &Device::Cpu).err().expect("refused").to_string()
    };
    let err = fixture("falcon-h1-g2");
    assert!(err.contains("falcon-h1"), "{err}");
    let err = fixture("nemotron-h-moe-g2");
    assert!(err.contains("experts"), "{err}");
}
