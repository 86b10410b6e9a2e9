//! How a batch of sequences runs through a stack of layers: embedding, each layer over every
//! sequence's rows from its own state, the final norm; single tokens (decode steps) and longer
//! sequences as separate passes so a sequence's bits never depend on its batch.

use super::on_pool;
use super::rows::Rows;
use super::token_io::TokenIo;
use crate::state::{LayerState, State};

/// Embeds the tokens of a batch of sequences (`lens[i]` tokens of sequence i, one after
/// another), runs `layer(weights, states of that layer, lens, rows kind, hidden)` for each
/// layer and returns the final-normed hidden states. Shared by the Mamba-1 and Mamba-2 engines.
///
/// Sequences of one token and longer ones run as two passes, so that a sequence's bits never
/// depend on the others: a lone token is a decode step ([`Rows::Independent`]), while rows of
/// longer sequences may share a faster product ([`Rows::Tokens`], e.g. gemm) whose bits
/// differ from a decode step's.
pub(crate) fn run_layers<L, S>(
    io: &TokenIo,
    layers: &[L],
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State<S>],
    layer: impl Fn(&L, &mut [&mut LayerState<S>], &[usize], Rows, &mut [f32]) + Sync,
) -> Vec<f32>
where
    L: Sync,
    S: Send,
{
    by_kind(io.d_model, tokens, lens, states, |tokens, lens, states| {
        run_layers_of_one_kind(io, layers, tokens, lens, states, &layer)
    })
}

/// Runs a batch as at most two passes, its single tokens and its longer sequences apart, with
/// `run(tokens, lens, states)` (each pass's rows of width `d`), and puts the rows back in the
/// sequences' order: a lone token keeps its decode-step bits whatever else is in the batch.
/// Every CPU engine's batched forward goes through it.
pub(crate) fn by_kind<S: Send>(
    d: usize,
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State<S>],
    run: impl Fn(&[u32], &[usize], &mut [&mut State<S>]) -> Vec<f32>,
) -> Vec<f32> {
    assert_eq!(lens.iter().sum::<usize>(), tokens.len(), "lens must add up to the tokens");
    assert_eq!(lens.len(), states.len(), "one state per sequence");
    if tokens.is_empty() {
        return Vec::new();
    }
    let singles = lens.iter().filter(|&&t| t == 1).count();
    if singles == 0 || singles == lens.len() {
        return run(tokens, lens, states);
    }
    // Split by kind, run each part, and put the rows back in the sequences' order.
    let (mut one, mut many) = ((Vec::new(), Vec::new(), Vec::new()), (Vec::new(), Vec::new(), Vec::new()));
    let mut rest = tokens;
    for (s, &t) in states.iter_mut().zip(lens) {
        let (seq, tail) = rest.split_at(t);
        rest = tail;
        let part = if t == 1 { &mut one } else { &mut many };
        part.0.extend_from_slice(seq);
        part.1.push(t);
        part.2.push(&mut **s);
    }
    let h_one = run(&one.0, &one.1, &mut one.2);
    let h_many = run(&many.0, &many.1, &mut many.2);
    let (mut from_one, mut from_many) = (h_one.chunks_exact(d), h_many.chunks(d));
    let mut h = Vec::with_capacity(tokens.len() * d);
    for &t in lens {
        if t == 1 {
            h.extend_from_slice(from_one.next().expect("one row per single token"));
        } else {
            (0..t).for_each(|_| h.extend_from_slice(from_many.next().expect("t rows per sequence")));
        }
    }
    h
}

/// [`run_layers`] of sequences that are all single tokens or all longer.
fn run_layers_of_one_kind<L: Sync, S: Send>(
    io: &TokenIo,
    layers: &[L],
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State<S>],
    layer: &(impl Fn(&L, &mut [&mut LayerState<S>], &[usize], Rows, &mut [f32]) + Sync),
) -> Vec<f32> {
    on_pool(|| {
        let mut h = io.embed(tokens);
        let kind = Rows::of(lens);
        for (l, lw) in layers.iter().enumerate() {
            let mut ls: Vec<&mut LayerState<S>> = states.iter_mut().map(|s| &mut s.layers[l]).collect();
            layer(lw, &mut ls, lens, kind, &mut h);
        }
        for (s, &t) in states.iter_mut().zip(lens) {
            s.advance(t);
        }
        io.final_norm(&h)
    })
}
