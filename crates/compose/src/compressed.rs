//! Weighted sums of states held in any codec ([`crate::codec`]): the SSM states and conv tails
//! of compressed state files are composed where they lie.

use rayon::prelude::*;

use crate::codec::{self, Values};
use crate::{all_finite, check_weighted_sum, weighted_sum_blocks, Error};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm256_loadu_ps, _mm256_stream_ps, _mm_sfence};

/// [`weighted_sum_blocks`] over inputs in any codec ([`Values`]): each group of
/// [`codec::GROUP`] values is dequantized in registers as it is added (one multiply per group
/// folds the weight into the group's scale), so compressed states are summed without an f32
/// copy, reading only their own bytes. Inputs that are all f32 take [`weighted_sum_blocks`].
pub fn weighted_sum_values(inputs: &[Values<'_>], w: &[f32], block: usize, out: &mut [f32]) -> Result<(), Error> {
    if let Some(f32s) =
        inputs.iter().map(|v| if let Values::F32(x) = v { Some(*x) } else { None }).collect::<Option<Vec<_>>>()
    {
        return weighted_sum_blocks(&f32s, w, block, out);
    }
    check_weighted_sum(inputs.iter().map(Values::len), w.len(), block, out.len())?;
    // Tasks of 64 KiB of output, in whole groups.
    const TASK: usize = 16 * 1024;
    #[cfg(target_arch = "x86_64")]
    if let Some(parts) = same_codec_parts(inputs, block) {
        let codec = inputs[0].codec();
        let finite = out.par_chunks_mut(TASK).enumerate().map(|(t, o)| {
            // SAFETY: same_codec_parts checked for AVX2 and FMA.
            unsafe { sum_groups_range(codec, &parts, w, block, t * TASK, o) }
        });
        return if finite.all(|f| f) { Ok(()) } else { Err(Error::NonFinite) };
    }
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

/// Each input's (values, scales) bytes, when the group-major kernel
/// ([`codec::x86::sum_groups`]) can take them all: AVX2 and FMA, one codec among bf16, int8
/// and int4, every group within one weight's block, whole groups stored (quantized codecs pad
/// the last group; bf16 needs a length that is a multiple of the group).
#[cfg(target_arch = "x86_64")]
fn same_codec_parts<'a>(inputs: &[Values<'a>], block: usize) -> Option<Vec<(&'a [u8], &'a [u8])>> {
    let codec = inputs[0].codec();
    let len = inputs[0].len();
    if !codec::x86::available()
        || !block.is_multiple_of(codec::GROUP)
        || (codec == codec::Codec::Bf16 && !len.is_multiple_of(codec::GROUP))
    {
        return None;
    }
    inputs
        .iter()
        .map(|v| match *v {
            Values::Bf16(b) if codec == codec::Codec::Bf16 => Some((b, &[][..])),
            Values::Int8 { q, scales, .. } if codec == codec::Codec::Int8 => Some((q, scales)),
            Values::Int4 { q, scales, .. } if codec == codec::Codec::Int4 => Some((q, scales)),
            _ => None,
        })
        .collect()
}

/// Output values `[from, from + out.len())` of [`weighted_sum_values`] by the group-major
/// kernel, a piece at a time (the last group of the tensor may be short: it is summed whole
/// from the padded storage, then cut). Returns whether every output is finite.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_groups_range(
    codec: codec::Codec,
    parts: &[(&[u8], &[u8])],
    w: &[f32],
    block: usize,
    from: usize,
    out: &mut [f32],
) -> bool {
    const G: usize = codec::GROUP;
    const PIECE: usize = 32 * G;
    let n = parts.len();
    let mut acc = [[0.0f32; G]; PIECE / G];
    let mut finite = true;
    for (p, op) in out.chunks_mut(PIECE).enumerate() {
        let start = from + p * PIECE;
        let groups = op.len().div_ceil(G);
        let mut k = 0;
        while k < groups {
            let v0 = start + k * G;
            let e = v0 / block;
            let run = (((e + 1) * block - v0) / G).min(groups - k);
            let (we, dst) = (&w[e * n..(e + 1) * n], &mut acc[k..k + run]);
            if codec == codec::Codec::Int4 && codec::x86::avx512_available() {
                // SAFETY: the CPU has AVX-512F; the parts hold these groups.
                unsafe { codec::x86::sum_groups_int4_avx512(parts, we, v0 / G, dst) };
            } else {
                // SAFETY: the caller's CPU has AVX2 and FMA; the parts hold these groups.
                unsafe { codec::x86::sum_groups(codec, parts, we, v0 / G, dst) };
            }
            k += run;
        }
        let sums = acc.as_flattened();
        finite &= all_finite(&sums[..op.len()]);
        if op.len() == PIECE && (op.as_ptr() as usize).is_multiple_of(32) {
            // Streamed past the caches: the output is written once and not read here, and a
            // plain store would first read each line (a third more traffic for int4 inputs).
            for (j, o) in op.chunks_exact_mut(8).enumerate() {
                // SAFETY: 8 floats in bounds of both, the output 32-byte aligned.
                unsafe { _mm256_stream_ps(o.as_mut_ptr(), _mm256_loadu_ps(sums.as_ptr().add(8 * j))) };
            }
        } else {
            op.copy_from_slice(&sums[..op.len()]);
        }
    }
    // The streamed stores are ordered before whatever reads the output next.
    _mm_sfence();
    finite
}

/// The mean of `inputs` in any codec (a model's conv tails), dequantized as read.
pub fn mean_values(inputs: &[Values<'_>], out: &mut [f32]) -> Result<(), Error> {
    if inputs.is_empty() {
        return Err(Error::Empty);
    }
    if out.is_empty() {
        // A model without conv tails (d_conv = 1): nothing to average, only sizes to agree.
        return match inputs.iter().position(|x| !x.is_empty()) {
            Some(i) => Err(Error::Shape(format!("input {i} has {} values, expected 0", inputs[i].len()))),
            None => Ok(()),
        };
    }
    let w = vec![1.0 / inputs.len() as f32; inputs.len()];
    weighted_sum_values(inputs, &w, out.len(), out)
}
