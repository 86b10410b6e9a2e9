//! The state a query continues from, given retrieved contexts, for each method of the paper.
//!
//! Contexts arrive most relevant first and are laid out so that the most relevant one is
//! nearest the query (Concat's best order, and the order CASO composes in).

use std::time::Instant;

use picaso_model::{compose, Composition, Method, Model, State};

use crate::{Error, Result};

/// The comparisons the paper's claims rest on: every method against Naive and against
/// Concat; PICASO-R against Soup, CASO and PICASO-S; CASO against Soup; and a hybrid's two
/// ablations (the key/value union alone, PICASO-R without keys and values) against Naive and
/// against PICASO-R with both. Each experiment reports them as paired intervals over its
/// items, where both methods were scored.
pub fn claim_pairs() -> Vec<(Method, Method)> {
    use picaso_model::Composition::{Caso, PicasoR, PicasoS, Soup};
    let mut pairs = Vec::new();
    for m in Method::PAPER.into_iter().filter(|&m| m != Method::Naive) {
        pairs.push((m, Method::Naive));
        if m != Method::Concat {
            pairs.push((m, Method::Concat));
        }
    }
    let c = Method::Compose;
    pairs.extend([(c(PicasoR), c(Soup)), (c(PicasoR), c(Caso)), (c(PicasoR), c(PicasoS)), (c(Caso), c(Soup))]);
    // A hybrid's two halves: each alone against Naive, and what the other half adds to it.
    for half in [Method::KvUnion, Method::PicasoRNoKv] {
        pairs.extend([(half, Method::Naive), (c(PicasoR), half)]);
    }
    pairs
}

/// A retrieved context: its tokens and its stored state.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// Token ids.
    pub tokens: &'a [u32],
    /// The state after its tokens, from the zero state.
    pub state: &'a State,
}

/// A state to continue from and what it cost to make.
#[derive(Debug, Clone)]
pub struct Started {
    /// The state.
    pub state: State,
    /// Seconds spent composing or processing (state loading excluded).
    pub seconds: f64,
    /// Tokens the model processed to make it.
    pub tokens_processed: usize,
}

/// The state `method` makes from `contexts` (most relevant first).
pub fn start_state(model: &Model, method: Method, contexts: &[Context<'_>]) -> Result<Started> {
    let n = contexts.len();
    // Sequence order: least relevant first, the most relevant next to the query.
    let order: Vec<usize> = (0..n).rev().collect();
    if n == 0 || method == Method::Naive {
        return Ok(Started { state: model.zero_state(), seconds: 0.0, tokens_processed: 0 });
    }
    let t0 = Instant::now();
    let (state, tokens_processed) = match method {
        Method::Naive => unreachable!("handled above"),
        Method::Concat => {
            let tokens: Vec<u32> = order.iter().flat_map(|&i| contexts[i].tokens.iter().copied()).collect();
            (model.prefill(&tokens, &model.zero_state())?, tokens.len())
        }
        Method::PiConcatR => {
            let mut states = Vec::with_capacity(n);
            let mut rotations = Vec::with_capacity(n);
            let mut processed = 0;
            for r in 0..n {
                let rotation: Vec<usize> = (0..n).map(|j| order[(r + j) % n]).collect();
                let tokens: Vec<u32> = rotation.iter().flat_map(|&i| contexts[i].tokens.iter().copied()).collect();
                processed += tokens.len();
                states.push(model.prefill(&tokens, &model.zero_state())?);
                rotations.push(rotation);
            }
            let lens: Vec<usize> = contexts.iter().map(|c| c.tokens.len()).collect();
            (average(&states, &rotations, &lens)?, processed)
        }
        Method::Compose(m) => {
            let states: Vec<&State> = contexts.iter().map(|c| c.state).collect();
            (compose(m, &states, Some(&order))?, 0)
        }
        Method::KvUnion | Method::PicasoRNoKv => {
            if model.state_shape().attention.is_none() {
                return Err(Error::Input(format!(
                    "{} is an ablation of a hybrid model's state (keys and values vs Mamba states); this model has no attention layers",
                    method.name()
                )));
            }
            let states: Vec<&State> = contexts.iter().map(|c| c.state).collect();
            let mut s = compose(Composition::PicasoR, &states, Some(&order))?;
            if method == Method::KvUnion {
                picaso_model::composition::keep_only_keys_and_values(&mut s);
            } else {
                picaso_model::composition::drop_keys_and_values(&mut s);
            }
            (s, 0)
        }
    };
    Ok(Started { state, seconds: t0.elapsed().as_secs_f64(), tokens_processed })
}

/// The mean of states that cover the same tokens (SSM states and conv tails averaged; the
/// log-decay, equal in all of them up to rounding, taken from the first). `rotations[r]` is the
/// order of the contexts (of `lens` tokens) in state r: a hybrid's keys and values are averaged
/// token by token (each token's rows across the orders), laid out in the first state's order.
fn average(states: &[State], rotations: &[Vec<usize>], lens: &[usize]) -> Result<State> {
    let first = states.first().ok_or_else(|| Error::Input("nothing to average".into()))?;
    let mut out = first.clone();
    if let Some(a) = &first.shape.attention {
        let row = a.token_len();
        // Where context i's first token sits in state r.
        let starts: Vec<Vec<usize>> = rotations
            .iter()
            .map(|rot| {
                let mut start = vec![0usize; lens.len()];
                let mut at = 0;
                for &i in rot {
                    start[i] = at;
                    at += lens[i];
                }
                start
            })
            .collect();
        let inv = 1.0 / states.len() as f32;
        for (l, kv) in out.attention.iter_mut().enumerate() {
            let mut at = 0;
            for &i in &rotations[0] {
                for t in 0..lens[i] {
                    for (dst, pick) in [(&mut kv.keys, 0), (&mut kv.values, 1)] {
                        for c in 0..row {
                            let sum: f32 = states
                                .iter()
                                .zip(&starts)
                                .map(|(s, st)| {
                                    let src = if pick == 0 { &s.attention[l].keys } else { &s.attention[l].values };
                                    src[(st[i] + t) * row + c]
                                })
                                .sum();
                            dst[(at + t) * row + c] = sum * inv;
                        }
                    }
                }
                at += lens[i];
            }
        }
    }
    let inv = 1.0 / states.len() as f32;
    for (l, layer) in out.layers.iter_mut().enumerate() {
        for (i, v) in layer.ssm.iter_mut().enumerate() {
            *v = states.iter().map(|s| s.layers[l].ssm[i]).sum::<f32>() * inv;
        }
        for (i, v) in layer.conv.iter_mut().enumerate() {
            *v = states.iter().map(|s| s.layers[l].conv[i]).sum::<f32>() * inv;
        }
    }
    Ok(out)
}

/// Mean negative log-likelihood (nats/token) of `continuation` after `query` from `state`.
pub fn continuation_nll(model: &Model, state: &State, query: &[u32], continuation: &[u32]) -> Result<f64> {
    if continuation.is_empty() {
        return Err(Error::Input("an empty continuation has no loss".into()));
    }
    let scored = model.score_continuation(query, continuation, state)?;
    Ok(-scored.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>() / scored.logprobs.len() as f64)
}

/// Log-likelihood (nats, summed over tokens) of each of `choices` after `prompt` from `state`.
/// The prompt is processed once; each choice continues from the state after it (the Markov
/// property makes this equal to scoring `prompt + choice` whole).
pub fn choice_logliks(model: &Model, state: &State, prompt: &[u32], choices: &[Vec<u32>]) -> Result<Vec<f64>> {
    let (logits, after) = model.prefill_last_logits(prompt, state)?;
    choice_logliks_after(model, &logits, &after, choices)
}

/// [`choice_logliks`] from what the prompt left: its next-token `logits` and the state `after`
/// it (for callers that need the logits too).
pub fn choice_logliks_after(model: &Model, logits: &[f32], after: &State, choices: &[Vec<u32>]) -> Result<Vec<f64>> {
    let lp = log_softmax(logits);
    choices
        .iter()
        .map(|c| {
            let (&first, _) =
                c.split_first().ok_or_else(|| Error::Input("an empty choice has no likelihood".into()))?;
            let rest = if c.len() > 1 { model.score(c, after)?.logprobs } else { Vec::new() };
            Ok(lp[first as usize] + rest.iter().map(|&l| f64::from(l)).sum::<f64>())
        })
        .collect()
}

/// Log-probabilities (f64) of next-token `logits`.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = f64::from(max) + logits.iter().map(|&l| f64::from(l - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&l| f64::from(l) - lse).collect()
}

#[cfg(test)]
mod tests {
    use picaso_model::{Mamba2Config, Mamba2Weights};

    use super::*;

    fn model() -> Model {
        let c = Mamba2Config::tiny(2, 4);
        Model::from_weights(c.clone(), Mamba2Weights::random(&c, 3), None)
    }

    fn states(m: &Model, segs: &[Vec<u32>]) -> Vec<State> {
        segs.iter().map(|s| m.prefill(s, &m.zero_state()).unwrap()).collect()
    }

    /// Concat puts the most relevant context last; one context makes every method but
    /// naive the context's own state; PIConcat-R of one rotation is Concat.
    #[test]
    fn methods_follow_their_definitions() {
        let m = model();
        let segs = vec![vec![1, 2, 3], vec![4, 5], vec![6, 7, 8, 9]];
        let st = states(&m, &segs);
        let ctx: Vec<Context<'_>> = segs.iter().zip(&st).map(|(t, s)| Context { tokens: t, state: s }).collect();

        let concat = start_state(&m, Method::Concat, &ctx).unwrap();
        let want = m.prefill(&[6, 7, 8, 9, 4, 5, 1, 2, 3], &m.zero_state()).unwrap();
        assert_eq!(concat.state.layers[1].ssm, want.layers[1].ssm);
        assert_eq!(concat.tokens_processed, 9);

        for method in Method::PAPER.into_iter().skip(1) {
            let one = start_state(&m, method, &ctx[..1]).unwrap();
            let d = one.state.layers[0]
                .ssm
                .iter()
                .zip(&st[0].layers[0].ssm)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d < 1e-5, "{method} of one context differs from its state by {d}");
        }
        let naive = start_state(&m, Method::Naive, &ctx).unwrap();
        assert!(naive.state.layers[0].ssm.iter().all(|&v| v == 0.0));

        // PIConcat-R of three = the mean of the three rotations' concat states.
        let pi = start_state(&m, Method::PiConcatR, &ctx).unwrap();
        let rots = [vec![6, 7, 8, 9, 4, 5, 1, 2, 3], vec![4, 5, 1, 2, 3, 6, 7, 8, 9], vec![1, 2, 3, 6, 7, 8, 9, 4, 5]];
        let rs: Vec<State> = rots.iter().map(|t| m.prefill(t, &m.zero_state()).unwrap()).collect();
        for (i, v) in pi.state.layers[1].ssm.iter().enumerate() {
            let mean = rs.iter().map(|s| s.layers[1].ssm[i]).sum::<f32>() / 3.0;
            assert!((v - mean).abs() < 1e-5);
        }
        assert_eq!(pi.tokens_processed, 27);
    }

    #[test]
    fn names_round_trip() {
        for m in Method::PAPER {
            assert_eq!(m.name().parse::<Method>(), Ok(m));
        }
        assert!("concatenate".parse::<Method>().is_err());
    }

    /// Scoring choices from the prompt's state equals scoring prompt + choice whole.
    #[test]
    fn choice_logliks_equal_whole_scoring() {
        let m = model();
        let start = m.prefill(&[9, 8, 7], &m.zero_state()).unwrap();
        let prompt = [1u32, 2, 3];
        let choices = vec![vec![4u32], vec![5, 6, 7], vec![2, 2]];
        let got = choice_logliks(&m, &start, &prompt, &choices).unwrap();
        for (c, g) in choices.iter().zip(&got) {
            let want: f64 =
                m.score_continuation(&prompt, c, &start).unwrap().logprobs.iter().map(|&l| f64::from(l)).sum();
            assert!((g - want).abs() < 1e-4, "{g} vs {want}");
        }
        assert!(choice_logliks(&m, &start, &prompt, &[vec![]]).is_err());
    }
}
