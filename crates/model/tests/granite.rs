//! Granite 4.0 H, Bamba, Nemotron-H, Falcon-H1 and Jamba hybrids against HF transformers (fixtures from scripts/make_granite_fixtures.py,
//! computed in float64): log-probs within 1e-4, every layer's state (SSM state, conv tail,
//! log-decay; keys and values) within 1e-5 of its scale, the Markov property at every split,
//! and a composed state (PICASO-R on the Mamba layers, the union of keys and values) continued
//! as transformers continues a cache holding the same tensors.

mod common;

use common::*;
use picaso_model::{compose, Composition, Model, State, StateDtype};

const CASES: [&str; 10] = [
    "dense-nope-g1",
    "moe-rope-g2",
    "bamba-rope-g2",
    "nemotron-h-g2",
    "nemotron-h-moe-g2",
    "nemotron-h-latent-g2",
    "falcon-h1-g2",
    "falcon-h1-norm-g2",
    "jamba-moe",
    "jamba-dense",
];

fn model(case: &str) -> Model {
    load_from(&fixture_dir("granite", case).join("hf"))
}

fn exp(case: &str) -> Expected {
    expected_in(&fixture_dir("granite", case))
}

/// Each layer's state tensors beside the fixture's `{prefix}.layers.{i}.*`.
fn check_state(case: &str, state: &State, e: &Expected, prefix: &str) {
    let shape = &state.shape;
    for (j, &i) in shape.ssm_layers().iter().enumerate() {
        let l = &state.layers[j];
        for (name, got) in [("ssm", &l.ssm), ("conv", &l.conv), ("log_decay", &l.log_decay)] {
            let key = format!("{prefix}.layers.{i}.{name}");
            let err = rel_err(got, e.get(&key));
            assert!(err < 1e-5, "{case}: {key} differs by {err} (relative)");
        }
    }
    let a = shape.attention.as_ref().expect("a hybrid's state has attention layers");
    for (kv, &i) in state.attention.iter().zip(&a.layers) {
        let t = kv.tokens(a.token_len());
        for (name, rows) in [("k", &kv.keys), ("v", &kv.values)] {
            // (T, H, D) here, (H, T, D) in the fixture.
            let mut head_major = vec![0.0f32; rows.len()];
            for ti in 0..t {
                for h in 0..a.kv_heads {
                    let d = a.head_dim;
                    head_major[(h * t + ti) * d..][..d].copy_from_slice(&rows[(ti * a.kv_heads + h) * d..][..d]);
                }
            }
            let key = format!("{prefix}.layers.{i}.{name}");
            let err = rel_err(&head_major, e.get(&key));
            assert!(err < 1e-5, "{case}: {key} differs by {err} (relative)");
        }
    }
}

#[test]
fn logprobs_match_transformers() {
    for case in CASES {
        let (m, e) = (model(case), exp(case));
        let scored = m.score(&e.tokens, &m.zero_state()).unwrap();
        let err = max_abs_diff(&scored.logprobs, e.get("logprobs"));
        eprintln!("{case}: max logprob error {err:.2e}");
        assert!(err < 1e-4, "{case}: logprobs differ by {err}");
    }
}

#[test]
fn states_match_transformers() {
    for case in CASES {
        let (m, e) = (model(case), exp(case));
        for (prefix, len) in [("short", 2usize), ("prefix", 13), ("full", e.tokens.len())] {
            let state = m.prefill(&e.tokens[..len], &m.zero_state()).unwrap();
            assert_eq!((state.n_tokens, state.position), (len as u64, len as u64));
            check_state(case, &state, &e, prefix);
        }
    }
}

/// Scoring `a + b` equals scoring `b` from the state of `a`, at every split point, multi-token.
#[test]
fn the_markov_property_holds_at_every_split() {
    for case in CASES {
        let (m, e) = (model(case), exp(case));
        let whole = m.score(&e.tokens, &m.zero_state()).unwrap();
        // f32 rounding: up to 1.14e-5 measured on jamba-dense (split 33), under 1e-5 elsewhere.
        let tol = if case.starts_with("jamba") { 2e-5 } else { 1e-5 };
        for split in 1..e.tokens.len() - 1 {
            let a = m.prefill(&e.tokens[..split], &m.zero_state()).unwrap();
            // Tokens from `split` on, from a's state: the first is context, each later one scored.
            let b = m.score(&e.tokens[split..], &a).unwrap();
            let err = max_abs_diff(&b.logprobs, &whole.logprobs[split..]);
            assert!(err < tol, "{case}: split at {split}: continuation differs by {err} (tolerance {tol})");
            assert!(rel_err(&b.state.layers[0].ssm, &whole.state.layers[0].ssm) < 1e-5);
            assert!(rel_err(&b.state.attention[0].keys, &whole.state.attention[0].keys) < 1e-5);
            // Token by token from a's state: decode steps give the same log-probs.
            let mut s = a.clone();
            let steps = 3.min(e.tokens.len() - split - 1);
            for i in 0..steps {
                let logits = m.step(e.tokens[split + i], &mut s).unwrap();
                let max = logits.iter().fold(f32::NEG_INFINITY, |x, &y| x.max(y));
                let lse = max + logits.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
                let lp = logits[e.tokens[split + i + 1] as usize] - lse;
                let want = whole.logprobs[split + i];
                assert!((lp - want).abs() < 1e-4, "{case}: decode after {split}+{i}: {lp} vs {want}");
            }
            assert_eq!(s.n_tokens, (split + steps) as u64);
        }
    }
}

/// A composed state (PICASO-R on the Mamba layers, the mean of the conv tails, the union of
/// the keys and values, the query after the longest context) continues as transformers
/// continues a cache holding the same tensors.
#[test]
fn a_composed_state_continues_as_transformers() {
    for case in CASES {
        let (m, e) = (model(case), exp(case));
        let lens = [9usize, 6, 11];
        let mut at = 0;
        let mut states = Vec::new();
        for n in lens {
            states.push(m.prefill(&e.tokens[at..at + n], &m.zero_state()).unwrap());
            at += n;
        }
        let refs: Vec<&State> = states.iter().collect();
        let composed = compose(Composition::PicasoR, &refs, None).unwrap();
        assert_eq!(composed.position, 11, "{case}: the query starts after the longest context");
        check_state(case, &composed, &e, "composed");
        let query = &e.tokens[at..at + 8];
        let scored = m.score(query, &composed).unwrap();
        let err = max_abs_diff(&scored.logprobs, e.get("composed.query_logprobs"));
        eprintln!("{case}: composed continuation max logprob error {err:.2e}");
        assert!(err < 1e-4, "{case}: composed continuation differs by {err}");
    }
}

/// On a NoPE hybrid, PICASO-S composition gives the same log-probs in all 24 orders of 4
/// contexts: the SSM part is order-free by construction, and attention over a union of keys
/// does not depend on their order.
#[test]
fn picaso_s_of_a_nope_hybrid_is_invariant_to_every_order() {
    let m = model("dense-nope-g1");
    let e = exp("dense-nope-g1");
    let parts: Vec<State> = [(0usize, 7usize), (7, 5), (12, 9), (21, 6)]
        .iter()
        .map(|&(a, n)| m.prefill(&e.tokens[a..a + n], &m.zero_state()).unwrap())
        .collect();
    let query = &e.tokens[27..35];
    let refs: Vec<&State> = parts.iter().collect();
    let base = m.score(query, &compose(Composition::PicasoS, &refs, None).unwrap()).unwrap().logprobs;
    let mut orders = 0;
    for a in 0..4 {
        for b in 0..4 {
            for c in 0..4 {
                for d in 0..4 {
                    let o = [a, b, c, d];
                    if (0..4).any(|i| !o.contains(&i)) {
                        continue;
                    }
                    orders += 1;
                    let s = compose(Composition::PicasoS, &refs, Some(&o)).unwrap();
                    let lp = m.score(query, &s).unwrap().logprobs;
                    let err = max_abs_diff(&lp, &base);
                    assert!(err < 1e-5, "order {o:?}: log-probs move by {err}");
                }
            }
        }
    }
    assert_eq!(orders, 24);
    // CASO is not order-free: the check above could fail.
    let caso = |o: &[usize]| m.score(query, &compose(Composition::Caso, &refs, Some(o)).unwrap()).unwrap().logprobs;
    assert!(max_abs_diff(&caso(&[0, 1, 2, 3]), &caso(&[3, 2, 1, 0])) > 1e-4);
}

/// A hybrid state survives a save and load exactly (f32), composes again after loading, and
/// names its tensors by the model's own layer index.
#[test]
fn hybrid_states_save_load_and_compose_again() {
    for case in CASES {
        let (m, e) = (model(case), exp(case));
        let a = m.prefill(&e.tokens[..10], &m.zero_state()).unwrap();
        let b = m.prefill(&e.tokens[10..17], &m.zero_state()).unwrap();
        let ab = compose(Composition::PicasoR, &[&a, &b], None).unwrap();
        for s in [&a, &ab, &m.zero_state()] {
            let bytes = s.to_bytes(StateDtype::F32).unwrap();
            let back = State::from_bytes(&bytes).unwrap();
            assert_eq!(&back, s, "{case}: f32 round trip");
            let mapped = picaso_model::MappedState::from_buffer(bytes).unwrap();
            assert_eq!(&mapped.view().to_state(), s, "{case}: mapped round trip");
            let half = State::from_bytes(&s.to_bytes(StateDtype::Bf16).unwrap()).unwrap();
            assert!(half.attention.iter().zip(&s.attention).all(|(x, y)| rel_err(&x.keys, &y.keys) < 1e-2));
        }
        let names = picaso_model::MappedState::from_buffer(a.to_bytes(StateDtype::F32).unwrap()).unwrap();
        let header = String::from_utf8_lossy(&names.bytes()[..2000.min(names.bytes().len())]).to_string();
        for &i in a.shape.attention_layers() {
            assert!(header.contains(&format!("\"layers.{i}.k\"")), "{case}: keys named by layer {i}");
        }
        // The union is associative: ((a ∪ b) ∪ c) keeps every token's keys.
        let c = m.prefill(&e.tokens[17..20], &m.zero_state()).unwrap();
        let abc = compose(Composition::Soup, &[&ab, &c], None).unwrap();
        let tl = a.shape.attention.as_ref().unwrap().token_len();
        assert_eq!(abc.attention[0].tokens(tl), 10 + 7 + 3);
        assert_eq!(abc.n_tokens, 20);
    }
}

/// Every codec holds a hybrid's SSM states and its keys and values (bf16 within its rounding,
/// int8 / int4 within half a step of each group of 32), reads them in place, and composes them
/// as their dequantized copies compose (1e-6), the union of keys and values included; the
/// scores from the composed state stay near f32's.
#[test]
fn hybrid_states_in_every_codec_compose_as_their_dequantized_copies() {
    for case in CASES {
        let (m, e) = (model(case), exp(case));
        let a = m.prefill(&e.tokens[..10], &m.zero_state()).unwrap();
        let b = m.prefill(&e.tokens[10..17], &m.zero_state()).unwrap();
        let exact = compose(Composition::PicasoR, &[&a, &b], None).unwrap();
        let query = &e.tokens[17..];
        let want = m.score(query, &exact).unwrap().logprobs;
        for codec in [StateDtype::Bf16, StateDtype::Int8, StateDtype::Int4] {
            let mapped: Vec<picaso_model::MappedState> = [&a, &b]
                .iter()
                .map(|s| picaso_model::MappedState::from_buffer(s.to_bytes(codec).unwrap()).unwrap())
                .collect();
            let views: Vec<_> = mapped.iter().map(|s| s.view()).collect();
            assert!(views.iter().all(|v| v.codec() == codec), "{case}: read in place as {codec}");
            let dequantized: Vec<State> = views.iter().map(|v| v.to_state()).collect();
            for (d, s) in dequantized.iter().zip([&a, &b]) {
                assert!(rel_err(&d.attention[0].keys, &s.attention[0].keys) < 0.2, "{case} {codec}: keys");
                assert_eq!(d.layers[0].log_decay, s.layers[0].log_decay, "{case} {codec}: log-decays stay f32");
            }
            let direct = picaso_model::compose_views(Composition::PicasoR, &views, None).unwrap();
            let refs: Vec<&State> = dequantized.iter().collect();
            let copied = compose(Composition::PicasoR, &refs, None).unwrap();
            for (x, y) in direct.layers.iter().zip(&copied.layers) {
                assert!(
                    max_abs_diff(&x.ssm, &y.ssm) <= 1e-6 * y.ssm.iter().fold(1e-30f32, |m, v| m.max(v.abs())) as f64
                );
                assert!(
                    max_abs_diff(&x.conv, &y.conv) <= 1e-6 * y.conv.iter().fold(1e-30f32, |m, v| m.max(v.abs())) as f64
                );
            }
            assert_eq!(direct.attention, copied.attention, "{case} {codec}: the union dequantized as copied");
            let got = m.score(query, &direct).unwrap().logprobs;
            let drift = max_abs_diff(&got, &want);
            // Random tiny models magnify state errors; this only bounds them (the fidelity
            // measured on trained models is in docs/states.md).
            // (Measured here: bf16 0.002–0.06, int8 0.02–0.20, int4 0.30–2.46 nats at most.)
            let allowed = match codec {
                StateDtype::Bf16 | StateDtype::Int8 => 0.5,
                _ => 5.0,
            };
            assert!(got.iter().all(|v| v.is_finite()), "{case} {codec}");
            assert!(drift < allowed, "{case} {codec}: log-probs move by {drift} from f32's");
        }
    }
}

/// A hybrid state on a pure Mamba-2 model, and a pure Mamba-2 state on a hybrid, are refused.
#[test]
fn states_of_other_architectures_are_refused() {
    let hybrid = model("dense-nope-g1");
    let mamba = load_from(&fixture_dir("mamba2", "g1").join("hf"));
    let hs = hybrid.prefill(&[1, 2, 3], &hybrid.zero_state()).unwrap();
    let ms = mamba.prefill(&[1, 2, 3], &mamba.zero_state()).unwrap();
    let e1 = mamba.score(&[1, 2], &hs).unwrap_err().to_string();
    let e2 = hybrid.score(&[1, 2], &ms).unwrap_err().to_string();
    assert!(e1.contains("another model"), "{e1}");
    assert!(e2.contains("another model"), "{e2}");
    // Keys of the wrong size: refused before any arithmetic.
    let mut bad = hs.clone();
    bad.attention[0].keys.pop();
    let e3 = hybrid.score(&[1, 2], &bad).unwrap_err().to_string();
    assert!(e3.contains("sizes"), "{e3}");
}

/// A config with a layer kind or option picaso does not run is refused by name, never run
/// wrongly: Nemotron-H's `moe` layers, a scaled RoPE, a bias picaso does not apply; for Bamba
/// an MLP bias, an attention layer past the last, a rotated width that is odd.
#[test]
fn unsupported_hybrid_options_are_refused_by_name() {
    let cases: [(&str, &str, serde_json::Value, &str); 11] = [
        ("moe-rope-g2", "layer_types", serde_json::json!(["attention", "mamba", "moe"]), "layer_types[2]"),
        (
            "moe-rope-g2",
            "rope_parameters",
            serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4}),
            "rope_type \"yarn\"",
        ),
        ("moe-rope-g2", "attention_bias", serde_json::json!(true), "attention_bias"),
        ("moe-rope-g2", "num_key_value_heads", serde_json::json!(4), "multiple of num_key_value_heads"),
        (
            "moe-rope-g2",
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
            "partial_rotary_factor",
        ),
        ("moe-rope-g2", "layers_block_type", serde_json::json!("mamba"), "layers_block_type"),
        ("moe-rope-g2", "num_hidden_layers", serde_json::json!(1u64 << 40), "num_hidden_layers"),
        ("bamba-rope-g2", "mlp_bias", serde_json::json!(true), "mlp_bias"),
        ("bamba-rope-g2", "attn_layer_indices", serde_json::json!([0, 4]), "attn_layer_indices"),
        ("bamba-rope-g2", "hidden_act", serde_json::json!("gelu"), "hidden_act"),
        (
            "bamba-rope-g2",
            "rope_parameters",
            serde_json::json!({"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}),
            "even, positive number of rotated channels",
        ),
    ];
    for (case, key, value, want) in cases {
        let src = fixture_dir("granite", case).join("hf");
        let base: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = base.clone();
        cfg[key] = value;
        if key == "layers_block_type" {
            cfg.as_object_mut().unwrap().remove("layer_types");
        }
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        std::fs::copy(src.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
        let opts = picaso_model::LoadOptions { skip_tokenizer: true, ..Default::default() };
        let err = Model::load(dir.path(), &opts).unwrap_err().to_string();
        assert!(err.contains(want) && err.contains("config.json"), "{key}: {err}");
    }
}

/// bf16 weights (half the memory) stay as close to transformers as rounding its matrices allows.
#[test]
fn bf16_weights_stay_close() {
    for case in CASES {
        let e = exp(case);
        let dir = fixture_dir("granite", case).join("hf");
        let opts = picaso_model::LoadOptions {
            skip_tokenizer: true,
            weight_dtype: picaso_model::WeightDtype::Bf16,
            ..Default::default()
        };
        let m = Model::load(&dir, &opts).unwrap();
        let lp = m.score(&e.tokens, &m.zero_state()).unwrap().logprobs;
        let err = max_abs_diff(&lp, e.get("logprobs"));
        // The fixture records how far rounding the matrices to bf16 alone moves transformers'
        // log-probs (0.03–0.19 across these random models): picaso's bf16 kernels also round
        // activations, so they may move them up to twice as far.
        let rounding = e.get("bf16_rounding_logprob_error")[0];
        let bound = 2.0 * rounding as f64 + 0.02;
        assert!(err < bound, "{case}: bf16 log-probs differ by {err}; rounding alone moves them {rounding}");
    }
}

/// A decode step batched beside a prompt being prefilled leaves exactly the state it leaves
/// alone (single tokens and longer sequences run as separate passes), as on Mamba-2. With bf16
/// weights a prefill's products and a decode step's give different bits where the CPU's bf16
/// kernel widens weights (AVX2 without AVX512-BF16, e.g. Zen 1-3); with the pair layout (AVX512-BF16,
/// AMX) or f32 weights they agree anyway and this check cannot tell the passes apart.
#[test]
fn a_decode_step_beside_a_prefill_keeps_its_lone_bits() {
    for case in CASES {
        let e = exp(case);
        let opts = picaso_model::LoadOptions {
            skip_tokenizer: true,
            weight_dtype: picaso_model::WeightDtype::Bf16,
            ..Default::default()
        };
        let m = Model::load(&fixture_dir("granite", case).join("hf"), &opts).unwrap();
        let start = m.prefill(&e.tokens[..6], &m.zero_state()).unwrap();
        let mut alone = start.clone();
        m.step(e.tokens[6], &mut alone).unwrap();
        let batched = m.prefill_batch(&[&e.tokens[10..20], &e.tokens[6..7]], &[&m.zero_state(), &start]).unwrap();
        assert!(batched[1].1 == alone, "{case}: the decode step's state depends on its batch");
    }
}

/// A Bamba model written back by picaso (Bamba's config keys and tensor names) loads with the
/// same fingerprint and scores the same: a Bamba checkpoint is never renamed to Granite's.
#[test]
fn a_bamba_model_is_written_back_as_bamba() {
    let src = fixture_dir("granite", "bamba-rope-g2").join("hf");
    let path = src.join("config.json");
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let c = picaso_model::GraniteHybridConfig::from_bamba(&path, &map).unwrap();
    assert_eq!((c.rotary_dim(), c.head_dim), (6, 12));
    // Settings a Bamba checkpoint cannot hold are refused, never written out as Bamba.
    for bad in [
        picaso_model::GraniteHybridConfig { residual_multiplier: 0.7, ..c.clone() },
        picaso_model::GraniteHybridConfig { rope_theta: None, ..c.clone() },
        picaso_model::GraniteHybridConfig { attention_multiplier: 0.3, ..c.clone() },
    ] {
        let err = bad.validate(&path).unwrap_err().to_string();
        assert!(err.contains("a Bamba model has RoPE"), "{err}");
    }
    let w = picaso_model::GraniteHybridWeights::load(&src, &c).unwrap();
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let written = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    assert!(written.contains("\"model_type\":\"bamba\"") || written.contains("\"model_type\": \"bamba\""), "{written}");
    let (a, b) = (load_from(&src), load_from(dir.path()));
    assert_eq!(a.fingerprint(), b.fingerprint());
    let e = exp("bamba-rope-g2");
    let (la, lb) = (a.score(&e.tokens, &a.zero_state()).unwrap(), b.score(&e.tokens, &b.zero_state()).unwrap());
    assert_eq!(la.logprobs, lb.logprobs);
}

/// A Bamba config as the hub's older checkpoints spell it (`rope_theta` at the top level, no
/// `rope_parameters`; a top-level `partial_rotary_factor`, which transformers ignores) reads as
/// the same model: same fingerprint, same log-probs.
#[test]
fn a_hub_style_bamba_config_reads_the_same() {
    let src = fixture_dir("granite", "bamba-rope-g2").join("hf");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let map = cfg.as_object_mut().unwrap();
    map.remove("rope_parameters");
    map.insert("rope_theta".into(), serde_json::json!(500.0));
    map.insert("partial_rotary_factor".into(), serde_json::json!(1.0));
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.path().join("model.safetensors")).unwrap();
    let (a, b) = (load_from(&src), load_from(dir.path()));
    assert_eq!(a.fingerprint(), b.fingerprint());
    let e = exp("bamba-rope-g2");
    assert_eq!(
        a.score(&e.tokens, &a.zero_state()).unwrap().logprobs,
        b.score(&e.tokens, &b.zero_state()).unwrap().logprobs
    );
}

/// Copies a fixture's model into a temporary folder with `config.json` edited by `edit` and
/// each tensor renamed by `rename` (`None` drops it), plus `extra` f32 tensors (name, shape, data).
fn edited_copy(
    case: &str,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
    rename: impl Fn(&str) -> Option<String>,
    extra: &[(String, Vec<usize>, Vec<f32>)],
) -> tempfile::TempDir {
    use safetensors::tensor::{Dtype, TensorView};
    let src = fixture_dir("granite", case).join("hf");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(cfg.as_object_mut().unwrap());
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let extra_bytes: Vec<(String, Vec<u8>, Vec<usize>)> = extra
        .iter()
        .map(|(n, shape, v)| (n.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect(), shape.clone()))
        .collect();
    let mut views: Vec<(String, TensorView<'_>)> = file
        .tensors()
        .into_iter()
        .filter_map(|(name, view)| {
            rename(&name).map(|n| (n, TensorView::new(view.dtype(), view.shape().to_vec(), view.data()).unwrap()))
        })
        .collect();
    for (name, data, shape) in &extra_bytes {
        views.push((name.clone(), TensorView::new(Dtype::F32, shape.clone(), data).unwrap()));
    }
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

/// The error loading a fixture's model with `key` set to `value` in its config.
fn refused_with(case: &str, key: &str, value: serde_json::Value) -> String {
    let dir = edited_copy(
        case,
        |c| {
            c.insert(key.into(), value);
        },
        |n| Some(n.to_string()),
        &[],
    );
    let opts = picaso_model::LoadOptions { skip_tokenizer: true, ..Default::default() };
    Model::load(dir.path(), &opts).unwrap_err().to_string()
}

/// A Nemotron-H checkpoint as transformers 5 writes it (the blocks as a `layers_block_type`
/// list, the tensors under `model.` instead of the hub's `backbone.`, a multi-token-prediction
/// head beside them, which a forward pass does not use) is the same model as the hub's
/// spelling: same fingerprint, same log-probs. Written back, picaso keeps the hub's spelling,
/// and the copy reloads the same.
#[test]
fn nemotron_h_spellings_read_the_same_and_write_back() {
    let case = "nemotron-h-g2";
    let e = exp(case);
    let hub = model(case);
    let logprobs = |m: &Model| m.score(&e.tokens, &m.zero_state()).unwrap().logprobs;
    let v5 = edited_copy(
        case,
        |c| {
            c.remove("hybrid_override_pattern");
            let blocks = ["mamba", "attention", "mlp", "mamba", "mlp", "mamba"];
            c.insert("layers_block_type".into(), serde_json::json!(blocks));
        },
        |name| Some(name.replacen("backbone.", "model.", 1)),
        &[("mtp.layers.0.norm.weight".into(), vec![48], vec![1.0; 48])],
    );
    let v5 = load_from(v5.path());
    assert_eq!(hub.fingerprint(), v5.fingerprint());
    assert_eq!(logprobs(&hub), logprobs(&v5));
    let described = hub.config().describe();
    assert!(described.contains("nemotron-h") && described.contains("relu² MLP 40 after 2 mixers"), "{described}");

    let src = fixture_dir("granite", case).join("hf");
    let path = src.join("config.json");
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let c = picaso_model::GraniteHybridConfig::from_nemotron_h(&path, &map).unwrap();
    assert_eq!(c.without_mlp, [0, 3]);
    assert_eq!(c.hf_blocks(), [(0, None), (1, Some(2)), (3, Some(4)), (5, None)]);
    let w = picaso_model::GraniteHybridWeights::load(&src, &c).unwrap();
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(written["model_type"], "nemotron_h");
    assert_eq!(written["hybrid_override_pattern"], "M*-M-M");
    assert!(written.get("mamba_n_heads").is_none(), "Granite's keys leaked into a Nemotron-H config: {written}");
    let copy = load_from(dir.path());
    assert_eq!(hub.fingerprint(), copy.fingerprint());
    assert_eq!(logprobs(&hub), logprobs(&copy));
}

/// What picaso does not run of a Nemotron-H config is refused by name: routed experts
/// (Nemotron 3's `moe` blocks), an `mlp` block with no mixer before it, another activation,
/// attention or MLP biases, a letter the pattern does not have.
#[test]
fn unsupported_nemotron_h_options_are_refused_by_name() {
    let cases: [(&str, serde_json::Value, &str); 12] = [
        ("hybrid_override_pattern", serde_json::json!("ME-M"), "block 2 is an `mlp` block with another MLP block"),
        ("hybrid_override_pattern", serde_json::json!("EM"), "block 0 is an `moe` block with no block before it"),
        ("tie_word_embeddings", serde_json::json!(true), "tie_word_embeddings"),
        ("sliding_window", serde_json::json!(4096), "sliding_window"),
        ("hybrid_override_pattern", serde_json::json!("M*-E-M"), "block 3 is an `moe` block with another MLP block"),
        ("hybrid_override_pattern", serde_json::json!("-M*M"), "with no block before it"),
        ("hybrid_override_pattern", serde_json::json!("M*--M"), "block 3 is an `mlp` block with another"),
        ("hybrid_override_pattern", serde_json::json!("M*-X"), "hybrid_override_pattern[3]"),
        ("hybrid_override_pattern", serde_json::json!("*-*-"), "no mamba layer"),
        ("mlp_hidden_act", serde_json::json!("silu"), "mlp_hidden_act"),
        ("attention_bias", serde_json::json!(true), "attention_bias"),
        ("mlp_bias", serde_json::json!(true), "mlp_bias"),
    ];
    for (key, value, want) in cases {
        let err = refused_with("nemotron-h-g2", key, value);
        assert!(err.contains(want) && err.contains("config.json"), "{key}: {err}");
    }
}

/// Nemotron-H configs shaped as the hub ships them: Nemotron Nano 2's mixers are wider than
/// `expand` × the model (128 heads × 80 against 2 × 4,480; transformers takes the width from the
/// heads alone), and Nemotron-H 8B spells the attention's head width `attention_head_dim`. Both
/// read with transformers' meaning; a small model of Nano 2's kind (heads × width ≠ expand ×
/// d_model) runs, continues its own states exactly, and writes back its own `expand`.
#[test]
fn nemotron_h_configs_read_as_transformers_reads_them() {
    let read = |cfg: serde_json::Value| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        match picaso_model::ModelConfig::from_file(&path).unwrap() {
            picaso_model::ModelConfig::GraniteHybrid(c) => c,
            other => panic!("read as {other:?}"),
        }
    };
    let nano2 = read(serde_json::json!({
        "model_type": "nemotron_h", "hidden_size": 4480, "vocab_size": 131072, "num_hidden_layers": 8,
        "hybrid_override_pattern": "M-M*-M-M", "num_attention_heads": 40, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 15680, "mamba_num_heads": 128, "mamba_head_dim": 80,
        "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "expand": 2, "use_bias": false,
        "use_conv_bias": true, "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, {"__float__": "Infinity"}], "tie_word_embeddings": false
    }));
    assert_eq!((nano2.mamba.d_inner(), nano2.mamba.expand, nano2.head_dim), (10240, 2, 128));
    assert_eq!(nano2.hf_blocks(), [(0, Some(1)), (2, None), (3, Some(4)), (5, Some(6)), (7, None)]);
    let h8b = read(serde_json::json!({
        "model_type": "nemotron_h", "hidden_size": 4096, "vocab_size": 131072, "num_hidden_layers": 4,
        "hybrid_override_pattern": "M-*-", "num_attention_heads": 32, "num_key_value_heads": 8,
        "attention_head_dim": 128, "intermediate_size": 21504, "mamba_num_heads": 128, "mamba_head_dim": 64,
        "mamba_n_groups": 8, "ssm_state_size": 128, "mamba_d_conv": 4, "expand": 2, "tie_word_embeddings": false
    }));
    assert_eq!((h8b.head_dim, h8b.n_kv_heads, h8b.mamba.n_groups), (128, 8, 8));

    // A small model of Nano 2's kind: 8 heads × 12 = 96 channels where expand × d_model is 80.
    let src = fixture_dir("granite", "nemotron-h-g2").join("hf");
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let base = picaso_model::GraniteHybridConfig::from_nemotron_h(&src.join("config.json"), &map).unwrap();
    let mut c = base.clone();
    c.d_model = 40;
    c.mamba.d_model = 40;
    let w = picaso_model::GraniteHybridWeights::random(&c, 3);
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!((written["expand"].as_u64(), written["mamba_num_heads"].as_u64()), (Some(2), Some(8)));
    let m = load_from(dir.path());
    let tokens: Vec<u32> = (0..24).map(|i| (i * 7 + 3) % 83).collect();
    let whole = m.score(&tokens, &m.zero_state()).unwrap().logprobs;
    assert!(whole.iter().all(|x| x.is_finite() && *x < 0.0));
    let head = m.prefill(&tokens[..10], &m.zero_state()).unwrap();
    let tail = m.score(&tokens[10..], &head).unwrap().logprobs;
    let err = max_abs_diff(&tail, &whole[10..]);
    assert!(err < 1e-5, "the Markov property: {err}");
}

/// Nemotron 3's experts as transformers 5 holds them (each `moe` block's experts stacked in
/// one `experts.up_proj` and one `experts.down_proj`) read as the hub's one tensor per expert
/// do; written back, picaso keeps the hub's spelling, and the copy reloads the same.
#[test]
fn nemotron_3_experts_read_in_either_spelling_and_write_back() {
    let case = "nemotron-h-moe-g2";
    let e = exp(case);
    let hub = model(case);
    let logprobs = |m: &Model| m.score(&e.tokens, &m.zero_state()).unwrap().logprobs;
    let src = fixture_dir("granite", case).join("hf");
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let f32s = |name: &str| -> Vec<f32> {
        file.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let mut stacked = Vec::new();
    for block in [1, 5] {
        for (proj, shape) in [("up_proj", [16, 48]), ("down_proj", [48, 16])] {
            let all: Vec<f32> = (0..6)
                .flat_map(|j| f32s(&format!("backbone.layers.{block}.mixer.experts.{j}.{proj}.weight")))
                .collect();
            stacked.push((format!("model.layers.{block}.mixer.experts.{proj}"), vec![6, shape[0], shape[1]], all));
        }
    }
    let v5 = edited_copy(
        case,
        |_| {},
        |name| (!name.contains(".experts.")).then(|| name.replacen("backbone.", "model.", 1)),
        &stacked,
    );
    let v5 = load_from(v5.path());
    assert_eq!(hub.fingerprint(), v5.fingerprint());
    assert_eq!(logprobs(&hub), logprobs(&v5));
    let described = hub.config().describe();
    assert!(
        described.contains(
            "relu² MLP 40 after 1 mixers; after 2 mixers sigmoid-routed MoE 2 of 6 experts (16) + shared expert 20"
        ),
        "{described}"
    );

    let path = src.join("config.json");
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let c = picaso_model::GraniteHybridConfig::from_nemotron_h(&path, &map).unwrap();
    assert_eq!((c.moe_layers.clone(), c.without_mlp.clone()), (vec![0, 2], vec![]));
    let w = picaso_model::GraniteHybridWeights::load(&src, &c).unwrap();
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(written["hybrid_override_pattern"], "ME*-ME");
    assert_eq!((written["n_group"].as_u64(), written["topk_group"].as_u64()), (Some(2), Some(1)));
    let copy = load_from(dir.path());
    assert_eq!(hub.fingerprint(), copy.fingerprint());
    assert_eq!(logprobs(&hub), logprobs(&copy));
}

/// Nemotron 3's latent experts (`moe_latent_size`: the experts work in a narrower width between
/// projections down and back up) are described, written back with their projections, and the
/// copy is the same model; a latent width the tensors do not have is refused by the tensor.
#[test]
fn nemotron_3_latent_experts_write_back_and_check_their_width() {
    let case = "nemotron-h-latent-g2";
    let e = exp(case);
    let m = model(case);
    let described = m.config().describe();
    assert!(described.contains("3 of 8 experts (16 in a latent width of 24)"), "{described}");
    let src = fixture_dir("granite", case).join("hf");
    let path = src.join("config.json");
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let c = picaso_model::GraniteHybridConfig::from_nemotron_h(&path, &map).unwrap();
    assert_eq!((c.moe_latent, c.expert_width()), (24, 24));
    let w = picaso_model::GraniteHybridWeights::load(&src, &c).unwrap();
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(written["moe_latent_size"], 24);
    let copy = load_from(dir.path());
    assert_eq!(m.fingerprint(), copy.fingerprint());
    let logprobs = |m: &Model| m.score(&e.tokens, &m.zero_state()).unwrap().logprobs;
    assert_eq!(logprobs(&m), logprobs(&copy));
    for (case, latent) in [("nemotron-h-latent-g2", 16), ("nemotron-h-moe-g2", 24)] {
        let err = refused_with(case, "moe_latent_size", serde_json::json!(latent));
        assert!(err.contains("experts.0.up_proj.weight") && err.contains("shape"), "{case}: {err}");
    }
}

/// What picaso does not run of Nemotron 3's experts is refused by name: groups that do not split
/// the experts, sizes out of range (before anything is allocated for them).
#[test]
fn unsupported_nemotron_3_options_are_refused_by_name() {
    for (key, value, want) in [
        ("moe_latent_size", serde_json::json!(1u64 << 40), "moe_latent_size"),
        ("n_group", serde_json::json!(4), "n_group (4) must split n_routed_experts (6)"),
        ("topk_group", serde_json::json!(3), "topk_group"),
        ("n_routed_experts", serde_json::json!(1u64 << 40), "n_routed_experts"),
        ("n_routed_experts", serde_json::json!(0), "n_routed_experts` is 0"),
        ("moe_shared_expert_intermediate_size", serde_json::json!(0), "moe_shared_expert_intermediate_size"),
    ] {
        let err = refused_with("nemotron-h-moe-g2", key, value);
        assert!(err.contains(want) && err.contains("config.json"), "{key}: {err}");
    }
}

/// A Falcon-H1 model is written back as it was read: its µP multipliers in its config, its
/// weights the checkpoint's (the engine folds the multipliers into its own copy); the copy is the
/// same model (same fingerprint, same log-probs), also when read with the config in memory. Each
/// layer's state holds both an SSM state and keys and values, and is named `hybrid` in a state
/// file.
#[test]
fn a_falcon_h1_model_is_written_back_as_read() {
    for case in ["falcon-h1-g2", "falcon-h1-norm-g2"] {
        let e = exp(case);
        let src = fixture_dir("granite", case).join("hf");
        let path = src.join("config.json");
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let c = picaso_model::GraniteHybridConfig::from_falcon_h1(&path, &map).unwrap();
        assert_eq!(c.n_layer(), c.n_mamba());
        assert_eq!(c.attention_layers(), (0..c.n_layer()).collect::<Vec<_>>());
        let w = picaso_model::GraniteHybridWeights::load(&src, &c).unwrap();
        let dir = tempfile::tempdir().unwrap();
        w.save_pretrained(dir.path(), &c).unwrap();
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
        assert_eq!(written["model_type"], "falcon_h1");
        for key in [
            "key_multiplier",
            "ssm_in_multiplier",
            "ssm_out_multiplier",
            "attention_in_multiplier",
            "attention_out_multiplier",
            "ssm_multipliers",
            "mlp_multipliers",
            "embedding_multiplier",
        ] {
            assert_eq!(written[key], map[key], "{case}: {key}");
        }
        assert!(written.get("layer_types").is_none() && written.get("mamba_n_heads").is_some(), "{written}");
        let again = picaso_model::GraniteHybridWeights::load(dir.path(), &c).unwrap();
        assert_eq!(again.fingerprint(&c), w.fingerprint(&c), "{case}: read back with the config in memory");
        let (a, b) = (model(case), load_from(dir.path()));
        assert_eq!(a.fingerprint(), b.fingerprint(), "{case}");
        let (la, lb) = (a.score(&e.tokens, &a.zero_state()).unwrap(), b.score(&e.tokens, &b.zero_state()).unwrap());
        assert_eq!(la.logprobs, lb.logprobs, "{case}");
        let state = la.state;
        assert_eq!((state.layers.len(), state.attention.len()), (c.n_layer(), c.n_layer()));
        let bytes = state.to_bytes(StateDtype::F32).unwrap();
        let header = String::from_utf8_lossy(&bytes[..4000.min(bytes.len())]).to_string();
        assert!(header.contains(&vec!["hybrid"; c.n_layer()].join(",")), "{case}: {header}");
        assert!(header.contains("\"layers.0.ssm\"") && header.contains("\"layers.0.k\""), "{case}");
        let described = a.config().describe();
        assert!(described.starts_with("falcon-h1") && described.contains("side by side"), "{described}");
    }
}

/// A Falcon-H1 config as the hub ships it (`rope_theta` at the top level, `rope_scaling: null`,
/// `mamba_d_head: "auto"`, keys transformers ignores) reads as the same model, and so do tensors
/// transformers leaves unused (a µP vector saved as a buffer; the mixer norm's weight of a model
/// that runs without it).
#[test]
fn a_hub_style_falcon_h1_config_reads_the_same() {
    let case = "falcon-h1-g2";
    let hub = edited_copy(
        case,
        |c| {
            c.remove("rope_parameters");
            c.insert("rope_theta".into(), serde_json::json!(1000.0));
            c.insert("rope_scaling".into(), serde_json::Value::Null);
            c.insert("mamba_d_head".into(), serde_json::json!("auto"));
            c.insert("mamba_use_mlp".into(), serde_json::json!(true));
        },
        |n| Some(n.to_string()),
        &[
            ("model.layers.0.mamba.norm.weight".into(), vec![72], vec![1.0; 72]),
            ("model.layers.1.mamba.mup_vector".into(), vec![1, 1, 190], vec![1.0; 190]),
        ],
    );
    let (a, b) = (model(case), load_from(hub.path()));
    assert_eq!(a.fingerprint(), b.fingerprint());
    let e = exp(case);
    assert_eq!(
        a.score(&e.tokens, &a.zero_state()).unwrap().logprobs,
        b.score(&e.tokens, &b.zero_state()).unwrap().logprobs
    );
}

/// What picaso does not run of a Falcon-H1 config is refused by name.
#[test]
fn unsupported_falcon_h1_options_are_refused_by_name() {
    let rope = |extra: serde_json::Value| {
        let mut r = serde_json::json!({"rope_type": "default", "rope_theta": 1000.0});
        r.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        r
    };
    for (key, value, want) in [
        ("attention_bias", serde_json::json!(true), "attention_bias"),
        ("mlp_bias", serde_json::json!(true), "mlp_bias"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("projectors_bias", serde_json::json!(false), "projectors_bias"),
        ("rope_parameters", serde_json::json!({"rope_type": "linear", "factor": 2.0}), "rope_type \"linear\""),
        ("rope_parameters", rope(serde_json::json!({"partial_rotary_factor": 0.5})), "RoPE on whole heads"),
        ("ssm_multipliers", serde_json::json!([1.0, 1.0, 1.0, 1.0]), "ssm_multipliers"),
        ("mlp_multipliers", serde_json::json!("1.0"), "mlp_multipliers"),
        ("key_multiplier", serde_json::json!("big"), "key_multiplier"),
        ("mamba_d_head", serde_json::json!(10), "mamba_d_head"),
        ("num_hidden_layers", serde_json::json!(0), "num_hidden_layers"),
        ("lm_head_multiplier", serde_json::json!(0.0), "lm_head_multiplier"),
        ("ssm_out_multiplier", serde_json::json!(1e9), "µP multiplier"),
    ] {
        let err = refused_with("falcon-h1-g2", key, value);
        assert!(err.contains(want) && err.contains("config.json"), "{key}: {err}");
    }
}

/// A Jamba model is written back as the hub spells it (per-expert tensors, `attn_layer_period`
/// and kin) and read as the same model; transformers 5's fused experts (`experts.gate_up_proj`,
/// `experts.down_proj`) read as the same model too. Its states are Mamba-1 states plus keys and
/// values.
#[test]
fn a_jamba_model_is_written_back_as_read_and_reads_fused_experts() {
    let case = "jamba-moe";
    let e = exp(case);
    let src = fixture_dir("granite", case).join("hf");
    let path = src.join("config.json");
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let c = picaso_model::JambaConfig::from_hf(&path, &map).unwrap();
    assert_eq!((c.attention_layers(), c.mamba_layers()), (vec![1, 4], vec![0, 2, 3]));
    assert!(c.has_experts(1) && c.has_experts(3) && !c.has_experts(0) && !c.has_experts(4));
    let w = picaso_model::JambaWeights::load(&src, &c).unwrap();
    let dir = tempfile::tempdir().unwrap();
    w.save_pretrained(dir.path(), &c).unwrap();
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    for key in
        ["model_type", "attn_layer_period", "attn_layer_offset", "expert_layer_period", "num_experts", "mamba_dt_rank"]
    {
        assert_eq!(written[key], map[key], "{key}");
    }
    let (a, b) = (model(case), load_from(dir.path()));
    assert_eq!(a.fingerprint(), b.fingerprint());
    let la = a.score(&e.tokens, &a.zero_state()).unwrap();
    assert_eq!(la.logprobs, b.score(&e.tokens, &b.zero_state()).unwrap().logprobs);
    assert_eq!(la.state.shape.arch, picaso_model::Arch::Mamba1);
    assert_eq!((la.state.layers.len(), la.state.attention.len()), (3, 2));
    assert!(a.config().describe().starts_with("jamba"), "{}", a.config().describe());

    // transformers 5's in-memory layout: each layer's experts fused into two tensors.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut fused = Vec::new();
    for layer in [1, 3] {
        let p = format!("model.layers.{layer}.feed_forward.experts");
        let get = |n: String| -> Vec<f32> {
            file.tensor(&n).unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
        };
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for x in 0..c.n_experts {
            gate_up.extend(get(format!("{p}.{x}.gate_proj.weight")));
            gate_up.extend(get(format!("{p}.{x}.up_proj.weight")));
            down.extend(get(format!("{p}.{x}.down_proj.weight")));
        }
        fused.push((format!("{p}.gate_up_proj"), vec![c.n_experts, 2 * c.intermediate, c.d_model], gate_up));
        fused.push((format!("{p}.down_proj"), vec![c.n_experts, c.d_model, c.intermediate], down));
    }
    let dir = edited_copy(case, |_| {}, |n| (!n.contains(".experts.")).then(|| n.to_string()), &fused);
    let f = load_from(dir.path());
    assert_eq!(f.fingerprint(), a.fingerprint(), "fused experts are the same model");
}

/// Jamba options picaso does not run are refused by name, and so are the engines that do not
/// run Jamba.
#[test]
fn unsupported_jamba_options_and_engines_are_refused_by_name() {
    use serde_json::json;
    for (key, value, says) in [
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("sliding_window", json!(4096), "sliding_window"),
        ("attn_layer_offset", json!(3), "attn_layer_offset"),
        ("num_experts_per_tok", json!(5), "num_experts_per_tok"),
        ("num_key_value_heads", json!(3), "num_key_value_heads"),
    ] {
        let err = refused_with("jamba-moe", key, value);
        assert!(err.contains(says), "{key}: {err}");
    }
    for (case, key, value, says) in [
        ("jamba-moe", "attn_layer_period", json!(0), "attn_layer_period"),
        ("jamba-dense", "attn_layer_period", json!(1), "without a Mamba layer"),
        ("jamba-moe", "num_hidden_layers", json!(1u64 << 30), "num_hidden_layers"),
        ("jamba-moe", "num_local_experts", json!(8), "disagree"),
        ("jamba-moe", "mamba_d_state", json!(0), "mamba_d_state"),
    ] {
        let err = refused_with(case, key, value.clone());
        assert!(err.contains(says), "{key} = {value}: {err}");
    }
    // The hub's spellings: `mamba_dt_rank: "auto"` (ceil(hidden / 16) = 2 here), `swish`, and
    // `num_local_experts` for `num_experts` read as the same model.
    let same = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let dir = edited_copy("jamba-dense", |c| edit(c), |n| Some(n.to_string()), &[]);
        load_from(dir.path()).fingerprint().to_string()
    };
    let want = model("jamba-dense").fingerprint().to_string();
    assert_eq!(same(&|c| drop(c.insert("mamba_dt_rank".into(), json!("auto")))), want);
    assert_eq!(same(&|c| drop(c.insert("hidden_act".into(), json!("swish")))), want);
    let moe = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let dir = edited_copy("jamba-moe", |c| edit(c), |n| Some(n.to_string()), &[]);
        load_from(dir.path()).fingerprint().to_string()
    };
    assert_eq!(
        moe(&|c| {
            let e = c.remove("num_experts").unwrap();
            c.insert("num_local_experts".into(), e);
        }),
        model("jamba-moe").fingerprint().to_string()
    );
    let dir = fixture_dir("granite", "jamba-dense").join("hf");
    // (The GPU engine's refusal is a unit test in `jamba::cpu`: the emulator is the crate's own.)
    let opts = picaso_model::LoadOptions {
        skip_tokenizer: true,
        backend: "candle-cpu".parse().unwrap(),
        ..Default::default()
    };
    let err = Model::load(&dir, &opts).unwrap_err().to_string();
    assert!(err.contains("Jamba") && err.contains("cpu"), "{err}");
}
