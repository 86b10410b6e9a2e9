//! Composition of real engine states: Proposition 1 end to end (one layer, no conv: CASO is
//! the concatenation's state exactly), the gap for a multi-layer model, and bad input.

mod common;

use common::*;
use picaso_model::{compose, Composition, Mamba2Config, Mamba2Weights, Model, State};

fn tiny_model(n_layer: usize, d_conv: usize, seed: u64) -> Model {
    let config = Mamba2Config::tiny(n_layer, d_conv);
    Model::from_weights(config.clone(), Mamba2Weights::random(&config, seed), None)
}

fn segments() -> Vec<Vec<u32>> {
    vec![
        (0..17).map(|i| (i * 7 + 3) % 61).collect(),
        (0..5).map(|i| (i * 11 + 1) % 61).collect(),
        (0..29).map(|i| (i * 5 + 9) % 61).collect(),
    ]
}

#[test]
fn proposition_1_caso_is_the_state_of_the_concatenation() {
    let model = tiny_model(1, 1, 11);
    let segs = segments();
    let states: Vec<State> = segs.iter().map(|s| model.prefill(s, &model.zero_state()).unwrap()).collect();
    let refs: Vec<&State> = states.iter().collect();
    let concat: Vec<u32> = segs.concat();
    let whole = model.prefill(&concat, &model.zero_state()).unwrap();
    let caso = compose(Composition::Caso, &refs, None).unwrap();
    let (x, y) = (&caso.layers[0], &whole.layers[0]);
    assert!(rel_err(&x.ssm, &y.ssm) < 1e-5, "ssm differs by {}", rel_err(&x.ssm, &y.ssm));
    assert!(rel_err(&x.log_decay, &y.log_decay) < 1e-5);
    assert_eq!(caso.n_tokens, whole.n_tokens);
    // Another order is another concatenation.
    let order = [2, 0, 1];
    let reordered: Vec<u32> = order.iter().flat_map(|&i| segs[i].clone()).collect();
    let whole2 = model.prefill(&reordered, &model.zero_state()).unwrap();
    let caso2 = compose(Composition::Caso, &refs, Some(&order)).unwrap();
    assert!(rel_err(&caso2.layers[0].ssm, &whole2.layers[0].ssm) < 1e-5);
    // And scoring from the composed state equals scoring after the concatenation.
    let query: Vec<u32> = (0..12).map(|i| (i * 13 + 2) % 61).collect();
    let from_caso = model.score(&query, &caso).unwrap();
    let from_whole = model.score(&query, &whole).unwrap();
    assert!(max_abs_diff(&from_caso.logprobs, &from_whole.logprobs) < 1e-4);
}

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).sum::<f64>() / a.len() as f64
}

#[test]
fn caso_on_a_multi_layer_model_is_close_but_not_exact() {
    let exp = expected("g2");
    let fixture = load("g2", "hf");
    let random = tiny_model(4, 4, 21);
    let long: Vec<u32> = (0..120).map(|i| ((i * 29 + i / 7) % 61) as u32).collect();
    for (name, model, tokens) in [("g2 fixture", &fixture, &exp.tokens[..]), ("random 4-layer", &random, &long[..])] {
        let third = tokens.len() / 3;
        let (a, b, c) = (&tokens[..third], &tokens[third..2 * third], &tokens[2 * third..]);
        let sa = model.prefill(a, &model.zero_state()).unwrap();
        let sb = model.prefill(b, &model.zero_state()).unwrap();
        let composed = compose(Composition::Caso, &[&sa, &sb], None).unwrap();
        let from_composed = model.score(c, &composed).unwrap().logprobs;
        let concat = model.prefill(&tokens[..2 * third], &model.zero_state()).unwrap();
        let from_concat = model.score(c, &concat).unwrap().logprobs;
        let naive = model.score(c, &model.zero_state()).unwrap().logprobs;
        let gap = mean_abs_diff(&from_composed, &from_concat);
        let naive_gap = mean_abs_diff(&naive, &from_concat);
        eprintln!("{name}: mean |Δ logprob| vs concatenation: CASO {gap:.4}, no context {naive_gap:.4}");
        assert!(gap > 1e-5, "{name}: a multi-layer model cannot compose exactly (gap {gap})");
        assert!(gap < naive_gap, "{name}: the composed state should be closer to the concatenation than no context");
    }
}

#[test]
fn one_state_composes_to_itself_and_identical_states_soup_to_themselves() {
    let model = tiny_model(2, 4, 3);
    let s = model.prefill(&segments()[0], &model.zero_state()).unwrap();
    for m in Composition::ALL {
        let one = compose(m, &[&s], None).unwrap();
        assert_eq!(one.layers, s.layers, "{m}");
    }
    let soup = compose(Composition::Soup, &[&s, &s, &s], None).unwrap();
    for (x, y) in soup.layers.iter().zip(&s.layers) {
        assert!(rel_err(&x.ssm, &y.ssm) < 1e-6 && rel_err(&x.conv, &y.conv) < 1e-6);
    }
}

#[test]
fn composed_log_decay_is_the_sum_and_composes_again() {
    let model = tiny_model(2, 4, 5);
    let states: Vec<State> = segments().iter().map(|s| model.prefill(s, &model.zero_state()).unwrap()).collect();
    let refs: Vec<&State> = states.iter().collect();
    let ab = compose(Composition::Caso, &refs[..2], None).unwrap();
    for (l, layer) in ab.layers.iter().enumerate() {
        for h in 0..layer.log_decay.len() {
            let want = states[0].layers[l].log_decay[h] + states[1].layers[l].log_decay[h];
            assert!((layer.log_decay[h] - want).abs() < 1e-5);
        }
    }
    // CASO is associative: (a ∘ b) ∘ c = a ∘ b ∘ c on the SSM states.
    let abc = compose(Composition::Caso, &[&ab, &states[2]], None).unwrap();
    let direct = compose(Composition::Caso, &refs, None).unwrap();
    for (x, y) in abc.layers.iter().zip(&direct.layers) {
        assert!(rel_err(&x.ssm, &y.ssm) < 1e-5);
    }
}

#[test]
fn bad_composition_input_is_refused() {
    let m1 = tiny_model(2, 4, 1);
    let m2 = tiny_model(2, 4, 2);
    let s1 = m1.prefill(&[1, 2, 3], &m1.zero_state()).unwrap();
    let s2 = m2.prefill(&[1, 2, 3], &m2.zero_state()).unwrap();
    let err = compose(Composition::Soup, &[&s1, &s2], None).unwrap_err().to_string();
    assert!(err.contains("made by model"), "{err}");
    assert!(compose(Composition::Soup, &[], None).unwrap_err().to_string().contains("no contexts"));
    let err = compose(Composition::Caso, &[&s1, &s1], Some(&[0, 0])).unwrap_err().to_string();
    assert!(err.contains("not a permutation"), "{err}");
    let mut bad = s1.clone();
    bad.layers[1].ssm[3] = f32::NAN;
    let err = compose(Composition::PicasoR, &[&s1, &bad], None).unwrap_err().to_string();
    assert!(err.contains("state 1") && err.contains("non-finite"), "{err}");
    let other_shape = tiny_model(3, 4, 1);
    let s3 = other_shape.prefill(&[1], &other_shape.zero_state()).unwrap();
    let mut s3 = s3;
    s3.fingerprint = s1.fingerprint.clone();
    assert!(compose(Composition::Soup, &[&s1, &s3], None).unwrap_err().to_string().contains("shape"));
}

/// Large but finite inputs compose; a weighted sum beyond f32's range is named as such (not
/// blamed on the inputs); log-decays that sum below f32's range stay finite (a decay of 0
/// either way), so the composed state saves and loads. Both architectures.
#[test]
fn extreme_but_finite_inputs_compose_or_are_refused_for_what_they_are() {
    let m1 = picaso_model::Mamba1Config::tiny(2, 4);
    let models = [
        tiny_model(2, 4, 3),
        Model::from_mamba1_weights(m1.clone(), picaso_model::Mamba1Weights::random(&m1, 3), None),
    ];
    for model in &models {
        let s = model.prefill(&[1, 2, 3], &model.zero_state()).unwrap();
        let filled = |v: f32, ld: f32| {
            let mut t = s.clone();
            for l in &mut t.layers {
                l.ssm.fill(v);
                l.log_decay.fill(ld);
            }
            t
        };
        let big = filled(2e35, -1.0);
        let soup = compose(Composition::Soup, &[&big, &big], None).unwrap();
        assert!(soup.layers.iter().all(|l| l.ssm.iter().all(|&v| v == 2e35)));

        let huge = filled(3e38, 0.0);
        let err = compose(Composition::Caso, &[&huge, &huge], None).unwrap_err().to_string();
        assert!(err.contains("beyond f32's range") && !err.contains("state 0"), "{err}");

        let steep = filled(1.0, -2e38);
        let caso = compose(Composition::Caso, &[&steep, &steep], None).unwrap();
        assert!(caso.layers.iter().all(|l| l.log_decay.iter().all(|&v| v == f32::MIN)));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.safetensors");
        caso.save(&path, picaso_model::StateDtype::F32).unwrap();
        assert_eq!(State::load(&path).unwrap().layers[0].log_decay, caso.layers[0].log_decay);
    }
}
