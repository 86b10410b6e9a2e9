//! The rows of a forward pass: whether they are prompt tokens or independent decode steps (which
//! decides how their products run), and helpers that split rows among sequences and threads.

use rayon::prelude::*;

use super::matmul::{self, Matrix};
use super::ROW_CHUNK;
use crate::state::LayerState;

/// What the rows of a forward pass are, which decides how its matrix products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Tokens of sequences being prefilled: one matrix product (gemm) for all rows.
    Tokens,
    /// One decode step of each of several sequences: each row is multiplied exactly as it
    /// would be alone, so batching never changes a sequence's results (each weight is still
    /// read once for all rows).
    Independent,
}

impl Rows {
    /// `Independent` when every sequence brings one token (decode steps), else `Tokens`.
    pub fn of(lens: &[usize]) -> Self {
        if lens.iter().all(|&t| t == 1) {
            Rows::Independent
        } else {
            Rows::Tokens
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_t(self, x: &[f32], m: usize, k: usize, w: &Matrix, n: usize, out: &mut [f32], acc: bool) {
        match self {
            Rows::Tokens => matmul::matmul_t(x, m, k, w, n, out, acc),
            Rows::Independent => matmul::matmul_rows_t(x, m, k, w, n, out, acc),
        }
    }
}

/// Runs `f(state, input rows, t, output rows)` for each sequence of a batch, in parallel:
/// sequence i owns `lens[i]` consecutive rows of `input` (width `in_width`) and of `output`.
pub(crate) fn per_sequence<S: Send>(
    states: &mut [&mut LayerState<S>],
    lens: &[usize],
    input: &[f32],
    in_width: usize,
    output: &mut [f32],
    out_width: usize,
    f: impl Fn(&mut LayerState<S>, &[f32], usize, &mut [f32]) + Sync,
) {
    let (mut input, mut output) = (input, output);
    let mut seqs = Vec::with_capacity(lens.len());
    for (ls, &t) in states.iter_mut().zip(lens) {
        let (i, rest_in) = input.split_at(t * in_width);
        let (o, rest_out) = std::mem::take(&mut output).split_at_mut(t * out_width);
        (input, output) = (rest_in, rest_out);
        seqs.push((&mut **ls, i, t, o));
    }
    seqs.into_par_iter().for_each(|(ls, i, t, o)| f(ls, i, t, o));
}

/// Applies `f(input_row_block, output_row_block)` over row blocks in parallel.
pub(crate) fn rows_par(x: &[f32], out: &mut [f32], din: usize, dout: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    out.par_chunks_mut(ROW_CHUNK * dout).enumerate().for_each(|(i, o)| {
        let rows = o.len() / dout;
        f(&x[i * ROW_CHUNK * din..(i * ROW_CHUNK + rows) * din], o);
    });
}

pub(crate) fn add_bias_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}
