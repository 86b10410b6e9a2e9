//! Batching several sequences into one forward pass changes nothing a sequence sees: a batch
//! of decode steps gives each sequence, to the bit, its logits and state alone; a batched
//! prefill gives each its state to float rounding; greedy generation driven by batched steps
//! picks the same tokens as [`generate`] alone.

use picaso_model::{
    Backend, Decoder, GenerateOptions, Mamba1Config, Mamba1Weights, Mamba2Config, Mamba2Weights, Model, Next, State,
    WeightDtype,
};

/// A Mamba-2 wide enough (d_model 128) that the matrix products use their vector loops,
/// not only their tails.
fn mamba2(dtype: WeightDtype) -> Model {
    let c = Mamba2Config { d_model: 128, headdim: 32, ..Mamba2Config::tiny(2, 4) };
    Model::from_weights_on(c.clone(), Mamba2Weights::random(&c, 3), None, &Backend::Cpu, dtype).unwrap()
}

fn mamba1() -> Model {
    let c = Mamba1Config { d_model: 96, ..Mamba1Config::tiny(2, 4) };
    Model::from_mamba1_weights(c.clone(), Mamba1Weights::random(&c, 5), None)
}

fn models() -> Vec<(&'static str, Model)> {
    vec![("mamba2 f32", mamba2(WeightDtype::F32)), ("mamba2 bf16", mamba2(WeightDtype::Bf16)), ("mamba1", mamba1())]
}

/// Token ids from a seed, all in the vocabulary.
fn tokens(model: &Model, seed: u32, n: usize) -> Vec<u32> {
    let v = model.config().vocab_size() as u32;
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97)) % v).collect()
}

fn assert_same_state(a: &State, b: &State, tol: f32, what: &str) {
    assert_eq!(a.n_tokens, b.n_tokens, "{what}: n_tokens");
    for (l, (x, y)) in a.layers.iter().zip(&b.layers).enumerate() {
        for (name, u, v) in
            [("ssm", &x.ssm, &y.ssm), ("conv", &x.conv, &y.conv), ("log_decay", &x.log_decay, &y.log_decay)]
        {
            for (i, (p, q)) in u.iter().zip(v.iter()).enumerate() {
                assert!((p - q).abs() <= tol * (1.0 + q.abs()), "{what}: layers.{l}.{name}[{i}]: {p} vs {q}");
            }
        }
    }
}

#[test]
fn a_batch_of_decode_steps_gives_each_sequence_its_result_alone_to_the_bit() {
    for (name, model) in models() {
        // Sequences at different positions: each state has its own history.
        let starts: Vec<State> = (0..5)
            .map(|i| model.prefill(&tokens(&model, i, 3 + 4 * i as usize), &model.zero_state()).unwrap())
            .collect();
        let mut alone = starts.clone();
        let mut batched = starts.clone();
        let v = model.config().vocab_size();
        for step in 0..4 {
            let next: Vec<u32> = (0..5).map(|i| tokens(&model, 100 + step * 5 + i, 1)[0]).collect();
            let want: Vec<Vec<f32>> = alone.iter_mut().zip(&next).map(|(s, &t)| model.step(t, s).unwrap()).collect();
            let mut refs: Vec<&mut State> = batched.iter_mut().collect();
            let got = model.step_batch(&next, &mut refs).unwrap();
            assert_eq!(got.len(), 5 * v, "{name}");
            for (i, w) in want.iter().enumerate() {
                assert!(got[i * v..(i + 1) * v] == w[..], "{name}: step {step}, sequence {i}: logits differ");
            }
            for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
                assert_same_state(a, b, 0.0, &format!("{name}: step {step}, sequence {i}"));
            }
        }
    }
}

#[test]
fn a_batched_prefill_gives_each_sequence_its_state_alone() {
    for (name, model) in models() {
        let seqs: Vec<Vec<u32>> =
            [1usize, 7, 40, 2, 65].iter().enumerate().map(|(i, &n)| tokens(&model, i as u32, n)).collect();
        // From the zero state and from states with a history.
        let zero = model.zero_state();
        let warm = model.prefill(&tokens(&model, 9, 11), &zero).unwrap();
        let from: Vec<&State> = (0..seqs.len()).map(|i| if i % 2 == 0 { &zero } else { &warm }).collect();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let batched = model.prefill_batch(&refs, &from).unwrap();
        let states_only = model.prefill_states(&refs, &from).unwrap();
        // In place (a server's joining requests): the same bits as from copies.
        let mut own: Vec<State> = from.iter().map(|&s| s.clone()).collect();
        let in_place = model.prefill_batch_in_place(&refs, &mut own.iter_mut().collect::<Vec<_>>()).unwrap();
        for (i, ((logits, state), (l, s))) in batched.iter().zip(in_place.iter().zip(&own)).enumerate() {
            assert!(logits == l, "{name}: in place, sequence {i}: logits differ");
            assert_same_state(s, state, 0.0, &format!("{name}: in place, sequence {i}"));
        }
        for (i, (seq, start)) in seqs.iter().zip(&from).enumerate() {
            let (logits, alone) = model.prefill_last_logits(seq, start).unwrap();
            assert_same_state(&batched[i].1, &alone, 1e-5, &format!("{name}: sequence {i}"));
            assert_same_state(&states_only[i], &batched[i].1, 0.0, &format!("{name}: states only, sequence {i}"));
            for (a, b) in batched[i].0.iter().zip(&logits) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{name}: sequence {i}: logit {a} vs {b}");
            }
        }
        // Markov property across the boundary: continuing a batched state scores like one pass.
        let more = tokens(&model, 77, 9);
        let cont = model.score(&more, &batched[2].1).unwrap();
        let mut all = seqs[2].clone();
        all.extend(&more);
        let one = model.score(&all, &zero).unwrap();
        let tail = &one.logprobs[seqs[2].len()..];
        for (a, b) in cont.logprobs.iter().zip(tail) {
            assert!((a - b).abs() < 1e-4, "{name}: {a} vs {b}");
        }
    }
}

#[test]
fn prefill_each_gives_each_sequence_its_lone_state_to_the_bit() {
    use picaso_model::cpu::matmul::Bf16Kernel;
    for (name, model) in models() {
        // Batched only where the products are batch-invariant: the bf16 pair layout (chosen on
        // CPUs with AVX512-BF16, on AMX tiles where present); f32 and widened bf16 run each
        // sequence alone.
        let want = name == "mamba2 bf16" && Bf16Kernel::detect() != Bf16Kernel::Widen;
        assert_eq!(model.batch_invariant(), want, "{name}");
        let seqs: Vec<Vec<u32>> =
            [1usize, 7, 40, 2, 65, 3].iter().enumerate().map(|(i, &n)| tokens(&model, i as u32, n)).collect();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        // 50 tokens per pass: groups of several sequences, and one sequence longer than that.
        for max_tokens in [1, 50, 10_000] {
            let each = model.prefill_each(&refs, max_tokens).unwrap();
            assert_eq!(each.len(), seqs.len(), "{name}");
            for (i, (seq, got)) in seqs.iter().zip(&each).enumerate() {
                let alone = model.prefill(seq, &model.zero_state()).unwrap();
                assert_same_state(got, &alone, 0.0, &format!("{name}: max_tokens {max_tokens}, sequence {i}"));
            }
        }
        let err = model.prefill_each(&[&[1], &[]], 100).unwrap_err().to_string();
        assert!(err.contains("sequence 1 is empty"), "{name}: {err}");
    }
}

#[test]
fn batch_arguments_are_checked() {
    let model = mamba2(WeightDtype::F32);
    let mut s = model.zero_state();
    let err = model.step_batch(&[1, 2], &mut [&mut s]).unwrap_err().to_string();
    assert!(err.contains("2 tokens for 1 states"), "{err}");
    let err = model.step_batch(&[1000], &mut [&mut s]).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    let err = model.prefill_batch(&[&[1, 2]], &[]).unwrap_err().to_string();
    assert!(err.contains("1 sequences for 0 states"), "{err}");
    let z = model.zero_state();
    let err = model.prefill_batch(&[&[1, 2], &[]], &[&z, &z]).unwrap_err().to_string();
    assert!(err.contains("sequence 1 is empty"), "{err}");
    // Refused before any state is touched.
    let (mut a, mut b) = (model.zero_state(), model.zero_state());
    let err = model.prefill_batch_in_place(&[&[1, 2], &[3, 1000]], &mut [&mut a, &mut b]).unwrap_err().to_string();
    assert!(err.contains("outside the vocabulary"), "{err}");
    assert!(a.n_tokens == 0 && b.n_tokens == 0, "a refused prefill must leave the states as they were");
    let err = model.prefill_states(&[&[1, 2]], &[&z, &z]).unwrap_err().to_string();
    assert!(err.contains("1 sequences for 2 states"), "{err}");
    // Scoring nothing is a mistake upstream; one token scores nothing and moves the state.
    let err = model.score(&[], &z).unwrap_err().to_string();
    assert!(err.contains("nothing to score"), "{err}");
    let one = model.score(&[1], &z).unwrap();
    assert!(one.logprobs.is_empty() && one.state.n_tokens == 1);
    let other = mamba1();
    let err = model.step_batch(&[1], &mut [&mut other.zero_state()]).unwrap_err().to_string();
    assert!(err.contains("model"), "{err}");
}

/// The decoder's sampling side needs a tokenizer: the bundled model's (its first ids are the
/// tiny model's vocabulary).
fn with_tokenizer(model_fn: impl Fn(Option<picaso_model::TextTokenizer>) -> Model) -> Model {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/picaso-mamba2/tokenizer.json");
    model_fn(Some(picaso_model::TextTokenizer::from_file(&path).unwrap()))
}

#[test]
fn greedy_generation_in_a_batch_picks_the_tokens_it_picks_alone() {
    let c = Mamba2Config { d_model: 128, headdim: 32, ..Mamba2Config::tiny(2, 4) };
    let model = with_tokenizer(|t| Model::from_weights(c.clone(), Mamba2Weights::random(&c, 11), t));
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(&model, i, 2 + 3 * i as usize)).collect();
    let opts = |i: usize| GenerateOptions { max_tokens: 6 + 3 * i, ..Default::default() };
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| picaso_model::generate(&model, p, &model.zero_state(), &opts(i), |_| true).unwrap().tokens)
        .collect();
    // The server's loop in miniature: prefill each, then one batched step for all that go on.
    let mut decoders: Vec<Decoder> = (0..4).map(|i| Decoder::new(&model, &opts(i)).unwrap()).collect();
    let mut states = Vec::new();
    let mut logits = Vec::new();
    for p in &prompts {
        let (l, s) = model.prefill_last_logits(p, &model.zero_state()).unwrap();
        logits.push(l);
        states.push(s);
    }
    let mut active: Vec<usize> = (0..4).collect();
    while !active.is_empty() {
        let mut feed = Vec::new();
        active.retain(|&i| match decoders[i].push(&logits[i]).unwrap() {
            Next::Feed { token, .. } => {
                feed.push(token);
                true
            }
            Next::Done { .. } => false,
        });
        if active.is_empty() {
            break;
        }
        let v = model.config().vocab_size();
        let mut refs: Vec<&mut State> =
            states.iter_mut().enumerate().filter(|(i, _)| active.contains(i)).map(|(_, s)| s).collect();
        let out = model.step_batch(&feed, &mut refs).unwrap();
        for (j, &i) in active.iter().enumerate() {
            logits[i] = out[j * v..(j + 1) * v].to_vec();
        }
    }
    for (i, d) in decoders.iter().enumerate() {
        assert_eq!(d.tokens(), &alone[i][..], "sequence {i}");
        assert_eq!(d.tokens().len(), opts(i).max_tokens, "sequence {i} ran to its budget");
    }
}

#[test]
fn the_decoder_stops_at_end_of_text_unless_told_to_ignore_it() {
    let c = Mamba2Config { d_model: 128, headdim: 32, ..Mamba2Config::tiny(2, 4) };
    let model = with_tokenizer(|t| Model::from_weights(c.clone(), Mamba2Weights::random(&c, 11), t));
    let eos = model.tokenizer().unwrap().eos().expect("the bundled tokenizer has an end-of-text token");
    let mut logits = vec![0.0f32; model.config().vocab_size()];
    logits[eos as usize] = 10.0;
    let stop = GenerateOptions { max_tokens: 3, ..Default::default() };
    let mut d = Decoder::new(&model, &stop).unwrap();
    assert!(matches!(d.push(&logits).unwrap(), Next::Done { reason: picaso_model::StopReason::Eos, .. }));
    let go_on = GenerateOptions { ignore_eos: true, ..stop };
    let mut d = Decoder::new(&model, &go_on).unwrap();
    assert_eq!(d.push(&logits).unwrap(), Next::Feed { token: eos, text: String::new() });
    assert!(matches!(d.push(&logits).unwrap(), Next::Feed { .. }));
    assert!(matches!(d.push(&logits).unwrap(), Next::Done { reason: picaso_model::StopReason::Length, .. }));
    assert_eq!(d.tokens(), &[eos; 3]);
}

/// Scoring one continuation from several states in one pass gives each state's scores and
/// final state alone, to float rounding (to the bit where the engine is batch-invariant).
#[test]
fn scoring_a_continuation_from_several_states_at_once_matches_each_alone() {
    for (name, model) in models() {
        let starts: Vec<State> = (0..4)
            .map(|i| model.prefill(&tokens(&model, 40 + i, 2 + 3 * i as usize), &model.zero_state()).unwrap())
            .collect();
        let (context, continuation) = (tokens(&model, 7, 5), tokens(&model, 8, 6));
        let mut batched = starts.clone();
        let got = model
            .score_continuation_batch(&context, &continuation, &mut batched.iter_mut().collect::<Vec<_>>())
            .unwrap();
        let tol = if model.batch_invariant() { 0.0 } else { 1e-4 };
        for (i, start) in starts.iter().enumerate() {
            let alone = model.score_continuation(&context, &continuation, start).unwrap();
            assert_eq!(got[i].len(), continuation.len(), "{name}");
            for (p, q) in got[i].iter().zip(&alone.logprobs) {
                assert!((p - q).abs() <= tol * (1.0 + q.abs()), "{name} state {i}: {p} vs {q}");
            }
            assert_same_state(&batched[i], &alone.state, if tol == 0.0 { 0.0 } else { 1e-4 }, name);
        }
        // No continuation: the states still advance past the context.
        let mut refs: Vec<State> = starts.clone();
        let none = model.score_continuation_batch(&context, &[], &mut refs.iter_mut().collect::<Vec<_>>()).unwrap();
        assert_eq!(none, vec![Vec::<f32>::new(); 4]);
        assert_eq!(refs[0].n_tokens, starts[0].n_tokens + context.len() as u64);
        assert!(model.score_continuation_batch(&[], &continuation, &mut [&mut starts[0].clone()]).is_err());
    }
}
