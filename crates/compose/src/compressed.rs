//! Weighted sums of states held in any codec ([`crate::codec`]): the SSM states and conv tails
//! of compressed state files are composed where they lie.

use rayon::prelude::*;

use crate::codec::{self, Values};
use crate::{all_finite, weighted_sum_blocks, Error};

/// [`weighted_sum_blocks`] over inputs in any codec ([`Values`]): each group of
/// [`codec::GROUP`] values is dequantized in registers as it is added (one multiply per group
/// folds the weight into the group's scale), so compressed states are summed without an f32
/// copy, reading only their own bytes. Inputs that are all f32 take [`weighted_sum_blocks`].
pub fn weighted_sum_values(inputs: &[Values<'_>], w: &[f32], block: usize, out: &mut [f32]) -> Result<(), Error> {
    let n = inputs.len();
    if n == 0 {
        return Err(Error::Empty);
    }
    if let Some(f32s) =
        inputs.iter().map(|v| if let Values::F32(x) = v { Some(*x) } else { None }).collect::<Option<Vec<_>>>()
    {
        return weighted_sum_blocks(&f32s, w, block, out);
    }
    if block == 0 || !out.len().is_multiple_of(block) {
        return Err(Error::Shape(format!("output of {} values is not a whole number of blocks of {block}", out.len())));
    }
    if let Some(i) = inputs.iter().position(|x| x.len() != out.len()) {
        return Err(Error::Shape(format!("input {i} has {} values, expected {}", inputs[i].len(), out.len())));
    }
    if w.len() != (out.len() / block) * n {
        return Err(Error::Shape(format!("{} weights for {} blocks of {n} inputs", w.len(), out.len() / block)));
    }
    // Tasks of 64 KiB of output, in whole groups.
    const TASK: usize = 16 * 1024;
    let finite = out.par_chunks_mut(TASK).enumerate().map(|(t, o)| sum_values_range(inputs, w, block, t * TASK, o));
    if finite.all(|f| f) {
        Ok(())
    } else {
        Err(Error::NonFinite)
    }
}

crate::simd_fn! {
    /// Output values `[from, from + out.len())` of [`weighted_sum_values`] (`from` a multiple of
    /// the group), a piece of 1,024 values at a time: the piece's sums stay in L1 while each
    /// input streams through it, a run of groups that share one weight per call
    /// ([`Values::accumulate_groups`]: one match on the codec per run, not per group). Returns
    /// whether every output is finite.
    pub fn sum_values_range(inputs: &[Values<'_>], w: &[f32], block: usize, from: usize, out: &mut [f32]) -> bool {
        const PIECE: usize = 32 * codec::GROUP;
        const G: usize = codec::GROUP;
        let n = inputs.len();
        let mut finite = true;
        let mut acc = [[0.0f32; G]; PIECE / G];
        for (p, op) in out.chunks_mut(PIECE).enumerate() {
            let start = from + p * PIECE;
            let groups = op.len().div_ceil(G);
            let end = start + op.len();
            acc[..groups].iter_mut().for_each(|a| *a = [0.0; G]);
            for (i, x) in inputs.iter().enumerate() {
                let mut k = 0;
                while k < groups {
                    let v0 = start + k * G;
                    let e = v0 / block;
                    let block_end = ((e + 1) * block).min(end);
                    if block_end >= (v0 + G).min(end) {
                        // Groups wholly within block e: one weight for the run.
                        // (The piece's last group may be short: it counts whole.)
                        let whole = if block_end == end { (block_end - v0).div_ceil(G) } else { (block_end - v0) / G };
                        let run = whole.min(groups - k);
                        x.accumulate_groups(v0 / G, w[e * n + i], &mut acc[k..k + run]);
                        k += run;
                    } else {
                        // A group across blocks (a block that is not a multiple of the group):
                        // each value its own weight.
                        let mut one = [[0.0f32; G]];
                        x.accumulate_groups(v0 / G, 1.0, &mut one);
                        for (j, (a, v)) in acc[k].iter_mut().zip(one[0]).enumerate() {
                            let e = ((v0 + j).min(end - 1)) / block;
                            *a = w[e * n + i].mul_add(v, *a);
                        }
                        k += 1;
                    }
                }
            }
            for (o, a) in op.chunks_mut(G).zip(&acc) {
                o.copy_from_slice(&a[..o.len()]);
            }
            finite &= all_finite(op);
        }
        finite
    }
}

/// The mean of `inputs` in any codec (a model's conv tails), dequantized as read.
pub fn mean_values(inputs: &[Values<'_>], out: &mut [f32]) -> Result<(), Error> {
    if inputs.is_empty() {
        return Err(Error::Empty);
    }
    if out.is_empty() {
        return match inputs.iter().position(|x| !x.is_empty()) {
            Some(i) => Err(Error::Shape(format!("input {i} has {} values, expected 0", inputs[i].len()))),
            None => Ok(()),
        };
    }
    let w = vec![1.0 / inputs.len() as f32; inputs.len()];
    weighted_sum_values(inputs, &w, out.len(), out)
}
