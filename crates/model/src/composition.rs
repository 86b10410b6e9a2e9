//! Composing whole model states: the [`picaso_compose`] weights applied layer by layer.
//!
//! The SSM states are weighted sums (weights per (layer, head) from the log-decays); the conv
//! tails are averaged (as in the paper); the composed log-decay is the sum of the parts' — the
//! decay of any concatenation of them — so a composed state can itself be composed or continued.
//!
//! A hybrid model's attention layers take the union of the parts' keys and values (each context
//! encoded alone, in the order composed): the query attends to every context's tokens, and the
//! contexts never attend to each other. Without positional encoding attention over the union
//! does not depend on the order, so PICASO-S composition of a NoPE hybrid is invariant to every
//! reordering. With RoPE every context sits at positions 0..len-1 (as Parallel Context Windows)
//! and the query starts after the longest. The union is associative: a composed state composes
//! again.
//!
//! Inputs may be in any codec (a [`StateView`] of a compressed state file): their values are
//! dequantized inside the sums, never copied whole to f32. The composed state is f32.

use picaso_compose::{
    compose_per_value_values, mean_values, weighted_sum_values, weights_per_element, Composition, Values,
};
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::state::{State, StateView};

/// Composes `states` (taken in `order` if given, else as listed) with `method`.
pub fn compose(method: Composition, states: &[&State], order: Option<&[usize]>) -> Result<State> {
    let first = *states.first().ok_or(picaso_compose::Error::Empty)?;
    let mut out = State::zeros(first.shape.clone(), first.fingerprint.clone());
    compose_into(method, states, order, &mut out)?;
    Ok(out)
}

/// Like [`compose`], writing into `out` (any state of the same shape, overwritten). Reusing one
/// output buffer across requests saves the page faults of a fresh allocation, which cost about
/// as much as the arithmetic.
pub fn compose_into(method: Composition, states: &[&State], order: Option<&[usize]>, out: &mut State) -> Result<()> {
    let views: Vec<StateView<'_>> = states.iter().map(|s| s.view()).collect();
    compose_views_into(method, &views, order, out)
}

/// [`compose`] over borrowed tensors (states read in place from memory-mapped files).
pub fn compose_views(method: Composition, states: &[StateView<'_>], order: Option<&[usize]>) -> Result<State> {
    let first = states.first().ok_or(picaso_compose::Error::Empty)?;
    let mut out = State::zeros(first.shape.clone(), first.fingerprint);
    compose_views_into(method, states, order, &mut out)?;
    Ok(out)
}

/// Checks `states` and writes into `out` everything of their composition but the SSM states:
/// fingerprint, token count, position, the keys and values. Returns the states in composition
/// order and the SSM values per log-decay element (1 for Mamba-1's decay per value).
fn prepare<'a, 's>(
    states: &'a [StateView<'s>],
    order: Option<&[usize]>,
    out: &mut State,
) -> Result<(Vec<&'a StateView<'s>>, usize)> {
    let first = states.first().ok_or(picaso_compose::Error::Empty)?;
    if &out.shape != first.shape || out.layers.len() != first.layers.len() {
        return Err(Error::state(format!("output has shape {:?}, the states {:?}", out.shape, first.shape)));
    }
    for (i, s) in states.iter().enumerate() {
        if s.fingerprint != first.fingerprint {
            return Err(Error::state(format!(
                "state {i} was made by model {}, state 0 by {}; compose states of one model",
                s.fingerprint, first.fingerprint
            )));
        }
        if s.shape != first.shape || s.layers.len() != first.layers.len() || s.attention.len() != first.attention.len()
        {
            return Err(Error::state(format!("state {i} has shape {:?}, state 0 has {:?}", s.shape, first.shape)));
        }
    }
    let ordered: Vec<&StateView<'_>> = match order {
        Some(o) => {
            picaso_compose::check_order(o, states.len())?;
            o.iter().map(|&i| &states[i]).collect()
        }
        None => states.iter().collect(),
    };
    first.shape.check()?;
    let block = first.shape.ssm_len() / first.shape.log_decay_len();
    if block > 1 {
        // (With a decay per value, compose_per_value checks them as it reads them.)
        for (i, s) in states.iter().enumerate() {
            for (l, layer) in s.layers.iter().enumerate() {
                if let Some(v) = layer.log_decay.iter().find(|v| !(v.is_finite() && **v <= 0.0)) {
                    return Err(bad_decay(i, l, *v as f64));
                }
            }
        }
    }
    out.fingerprint = first.fingerprint.to_string();
    out.n_tokens = ordered.iter().fold(0u64, |n, s| n.saturating_add(s.n_tokens));
    // Each context was encoded from position 0: the query follows the longest. (A pure SSM
    // state has no positions; its position is its token count.)
    out.position = match first.shape.attention {
        Some(_) => ordered.iter().map(|s| s.position).max().unwrap_or(0),
        None => out.n_tokens,
    };
    // The union of keys and values, dequantized as they are copied, into the output's own
    // buffers: a reused output keeps their pages (fresh ones cost more than the copy).
    out.attention.resize_with(first.attention.len(), Default::default);
    // Sized once for all parts: a reused output of the same size is written over, not
    // zero-filled first and then written.
    out.attention.par_iter_mut().enumerate().for_each(|(a, kv)| {
        let total: usize = ordered.iter().map(|s| s.attention[a].keys.len()).sum();
        kv.keys.resize(total, 0.0);
        kv.values.resize(total, 0.0);
        let mut at = 0;
        for s in &ordered {
            let part = &s.attention[a];
            let n = part.keys.len();
            part.write_token_major(&part.keys, &mut kv.keys[at..at + n]);
            part.write_token_major(&part.values, &mut kv.values[at..at + n]);
            at += n;
        }
    });
    Ok((ordered, block))
}

/// The composed log-decay per element: the parts' sum (the decay of any concatenation of them).
/// Below f32's range it is held at its lowest value: e^that is 0 either way, and the composed
/// state stays one that a state file can hold.
fn sum_log_decays(decays: &[&[f32]], out: &mut [f32]) {
    for (e, v) in out.iter_mut().enumerate() {
        *v = (decays.iter().map(|d| d[e] as f64).sum::<f64>() as f32).max(f32::MIN);
    }
}

fn bad_decay(i: usize, l: usize, v: f64) -> Error {
    Error::state(format!("state {i}: layers.{l}.log_decay holds {v:?}; log-decays must be finite and <= 0"))
}

/// A composition with everything done but the weighted sum of the SSM states
/// ([`compose_all_but_ssm`]).
#[derive(Debug)]
pub struct SsmSumLeft<'a> {
    /// The composed state, its SSM values zero.
    pub composed: State,
    /// Per layer, the weights `w[e · n + i]` of log-decay element e (a head) and part i.
    pub weights: Vec<Vec<f32>>,
    /// The parts in composition order.
    pub parts: Vec<&'a State>,
}

/// Everything of a composition but the weighted sum of the SSM states, for engines that do that
/// sum themselves (the GPU engine, on the device). States with a log-decay per head only
/// (Mamba-2, hybrids).
pub fn compose_all_but_ssm<'a>(
    method: Composition,
    states: &[&'a State],
    order: Option<&[usize]>,
) -> Result<SsmSumLeft<'a>> {
    let first = *states.first().ok_or(picaso_compose::Error::Empty)?;
    let mut out = State::zeros(first.shape.clone(), first.fingerprint.clone());
    let views: Vec<StateView<'_>> = states.iter().map(|s| s.view()).collect();
    let (ordered, block) = prepare(&views, order, &mut out)?;
    if block == 1 {
        return Err(Error::Input(
            "composition outside the host runs on states with a log-decay per head (Mamba-2)".into(),
        ));
    }
    let index: Vec<usize> = match order {
        Some(o) => o.to_vec(),
        None => (0..states.len()).collect(),
    };
    let mut weights = Vec::with_capacity(out.layers.len());
    for (l, dst) in out.layers.iter_mut().enumerate() {
        let parts: Vec<_> = ordered.iter().map(|s| s.layers[l]).collect();
        let conv: Vec<Values<'_>> = parts.iter().map(|p| p.conv).collect();
        mean_values(&conv, &mut dst.conv)?;
        let decays: Vec<&[f32]> = parts.iter().map(|p| p.log_decay).collect();
        weights.push(weights_per_element(method, &decays)?);
        sum_log_decays(&decays, &mut dst.log_decay);
    }
    Ok(SsmSumLeft { composed: out, weights, parts: index.into_iter().map(|i| states[i]).collect() })
}

/// [`compose_into`] over borrowed tensors.
pub fn compose_views_into(
    method: Composition,
    states: &[StateView<'_>],
    order: Option<&[usize]>,
    out: &mut State,
) -> Result<()> {
    let (ordered, block) = prepare(states, order, out)?;
    // Layers in parallel (and blocks within a layer): one pass over the inputs, no barriers.
    let results: Vec<Result<()>> = out
        .layers
        .par_iter_mut()
        .enumerate()
        .map(|(l, dst)| {
            let parts: Vec<_> = ordered.iter().map(|s| s.layers[l]).collect();
            let decays: Vec<&[f32]> = parts.iter().map(|p| p.log_decay).collect();
            let ssm: Vec<Values<'_>> = parts.iter().map(|p| p.ssm).collect();
            let conv: Vec<Values<'_>> = parts.iter().map(|p| p.conv).collect();
            mean_values(&conv, &mut dst.conv)?;
            if block == 1 {
                // A decay per value (Mamba-1): weights applied as they are computed, never stored.
                return compose_per_value_values(method, &decays, &ssm, &mut dst.ssm, &mut dst.log_decay).map_err(
                    |e| match e {
                        picaso_compose::Error::BadLogDecay { context, value } => {
                            bad_decay(order.map_or(context, |o| o[context]), l, value)
                        }
                        other => other.into(),
                    },
                );
            }
            let w = weights_per_element(method, &decays)?;
            weighted_sum_values(&ssm, &w, block, &mut dst.ssm)?;
            sum_log_decays(&decays, &mut dst.log_decay);
            Ok(())
        })
        .collect();
    for r in results {
        if let Err(Error::Compose(picaso_compose::Error::NonFinite)) = r {
            // Rare path: name the culprit. (Checking every input up front would read them twice.)
            for (i, s) in states.iter().enumerate() {
                s.check_values().map_err(|e| match e {
                    Error::State { message, .. } => Error::state(format!("state {i}: {message}")),
                    other => other,
                })?;
            }
            return Err(Error::state(
                "the composed state is beyond f32's range (±3.4e38): the inputs are finite, but their weighted sum is not",
            ));
        }
        r?;
    }
    Ok(())
}

/// A hybrid's ablation: keeps only the attention layers' keys and values, the Mamba layers'
/// states set to the zero state (no context at all in them).
pub fn keep_only_keys_and_values(state: &mut State) {
    for l in &mut state.layers {
        l.ssm.fill(0.0);
        l.conv.fill(0.0);
        l.log_decay.fill(0.0);
    }
}

/// A hybrid's ablation: keeps only the Mamba layers' states, the attention layers emptied (the
/// query attends to itself alone) and the position back to 0.
pub fn drop_keys_and_values(state: &mut State) {
    for kv in &mut state.attention {
        kv.keys.clear();
        kv.values.clear();
    }
    state.position = 0;
}
