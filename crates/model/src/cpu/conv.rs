//! The depthwise causal convolution of Mamba mixers, over a prompt or one decode step.

use picaso_compose::simd_fn;

use super::activations::silu;
use super::{LANES, ROW_CHUNK};
use rayon::prelude::*;

simd_fn! {
    /// Depthwise causal convolution + bias + SiLU for `t` rows. `seq` holds (k-1+t) rows of
    /// `c` channels (the previous tail first); `wt` is the kernel transposed to (k, c).
    pub fn conv_silu(seq: &[f32], wt: &[f32], bias: &[f32], c: usize, k: usize, out: &mut [f32]) {
        for (t, o) in out.chunks_exact_mut(c).enumerate() {
            o.copy_from_slice(bias);
            for j in 0..k {
                let s = &seq[(t + j) * c..(t + j + 1) * c];
                let w = &wt[j * c..(j + 1) * c];
                for ((ov, &sv), &wv) in o.iter_mut().zip(s).zip(w) {
                    *ov = sv.mul_add(wv, *ov);
                }
            }
            for v in o.iter_mut() {
                *v = silu(*v);
            }
        }
    }
}

simd_fn! {
    /// [`conv_silu`] of one new row `x` (c channels) after the conv tail (c × (k-1), channel-
    /// major, oldest first), which is shifted to end with `x`. Each channel's sum runs in
    /// [`conv_silu`]'s order, so a decode step gives the bits of a prefill.
    pub fn conv_step_silu(x: &[f32], wt: &[f32], bias: &[f32], k: usize, tail: &mut [f32], out: &mut [f32]) {
        let (c, kt) = (x.len(), k - 1);
        // d_conv = 4 (every Mamba checkpoint): LANES channels at a time, their tails (48
        // contiguous values) taken apart into three registers, instead of channel by channel.
        let done = if kt == 3 { conv_step_blocks::<3>(x, wt, bias, tail, out) } else { 0 };
        for ((ch, o), (&xv, &b)) in out.iter_mut().enumerate().zip(x.iter().zip(bias)).skip(done) {
            let tl = &mut tail[ch * kt..(ch + 1) * kt];
            let mut acc = b;
            for (j, &sv) in tl.iter().enumerate() {
                acc = sv.mul_add(wt[j * c + ch], acc);
            }
            *o = xv.mul_add(wt[kt * c + ch], acc);
            if kt > 0 {
                tl.copy_within(1.., 0);
                tl[kt - 1] = xv;
            }
        }
        for v in out.iter_mut() {
            *v = silu(*v);
        }
    }
}

/// [`conv_step_silu`]'s sums (before SiLU) and tail shift for the whole blocks of [`LANES`]
/// channels, for a tail of `KT` values per channel: each channel's operations in the same
/// order, so the same bits. Returns the channels done.
#[inline(always)]
fn conv_step_blocks<const KT: usize>(x: &[f32], wt: &[f32], bias: &[f32], tail: &mut [f32], out: &mut [f32]) -> usize {
    let c = x.len();
    let blocks = c / LANES;
    for blk in 0..blocks {
        let ch0 = blk * LANES;
        let tb = &mut tail[ch0 * KT..(ch0 + LANES) * KT];
        let t: [[f32; LANES]; KT] = std::array::from_fn(|j| std::array::from_fn(|l| tb[l * KT + j]));
        let mut acc: [f32; LANES] = bias[ch0..ch0 + LANES].try_into().expect("LANES values");
        for (j, tj) in t.iter().enumerate() {
            let w = &wt[j * c + ch0..j * c + ch0 + LANES];
            for l in 0..LANES {
                acc[l] = tj[l].mul_add(w[l], acc[l]);
            }
        }
        let (xb, w) = (&x[ch0..ch0 + LANES], &wt[KT * c + ch0..KT * c + ch0 + LANES]);
        let o = &mut out[ch0..ch0 + LANES];
        for l in 0..LANES {
            o[l] = xb[l].mul_add(w[l], acc[l]);
        }
        for l in 0..LANES {
            for j in 0..KT {
                tb[l * KT + j] = if j + 1 < KT { t[j + 1][l] } else { xb[l] };
            }
        }
    }
    blocks * LANES
}

/// The causal depthwise convolution + bias + SiLU of `t` rows of `c` channels, read at column
/// `offset` of the rows of `input` (width `stride`), continuing from the conv tail `tail`
/// (C, K-1), which is updated to the last K-1 inputs. `wt` is the kernel transposed to (K, C).
#[allow(clippy::too_many_arguments)]
pub(crate) fn causal_conv_silu(
    input: &[f32],
    stride: usize,
    offset: usize,
    t: usize,
    c: usize,
    k: usize,
    wt: &[f32],
    bias: &[f32],
    tail: &mut [f32],
) -> Vec<f32> {
    let kt = k - 1;
    if t == 1 {
        // A decode step: the same sums in the same order, straight from the channel-major tail.
        let mut out = vec![0.0f32; c];
        conv_step_silu(&input[offset..offset + c], wt, bias, k, tail, &mut out);
        return out;
    }
    // [tail (K-1 rows); input (T rows)], row-major (K-1+T, C).
    let mut seq = vec![0.0f32; (kt + t) * c];
    for ch in 0..c {
        for j in 0..kt {
            seq[j * c + ch] = tail[ch * kt + j];
        }
    }
    for (dst, src) in seq[kt * c..].chunks_exact_mut(c).zip(input.chunks_exact(stride)) {
        dst.copy_from_slice(&src[offset..offset + c]);
    }
    let mut out = vec![0.0f32; t * c];
    out.par_chunks_mut(ROW_CHUNK * c).enumerate().for_each(|(i, o)| {
        let start = i * ROW_CHUNK * c;
        let rows = o.len() / c;
        conv_silu(&seq[start..start + (rows + kt) * c], wt, bias, c, k, o);
    });
    for ch in 0..c {
        for j in 0..kt {
            tail[ch * kt + j] = seq[(t + j) * c + ch];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conv_step_gives_the_bits_of_the_conv_over_tail_and_row() {
        // Channels past one AVX-512 register and an odd tail: the decode step's sums from the
        // channel-major tail equal those of the row-major [tail; x] the prefill path builds.
        for k in [2, 3, 4, 5] {
            conv_step_case(37, k);
        }
    }

    fn conv_step_case(c: usize, k: usize) {
        let kt = k - 1;
        let v = |len: usize, salt: usize| -> Vec<f32> {
            (0..len).map(|i| (((i * 31 + salt) % 23) as f32 - 11.0) / 7.0).collect()
        };
        let (x, wt, bias, mut tail) = (v(c, 1), v(k * c, 2), v(c, 3), v(c * kt, 4));
        let mut seq = vec![0.0f32; k * c];
        for ch in 0..c {
            for j in 0..kt {
                seq[j * c + ch] = tail[ch * kt + j];
            }
            seq[kt * c + ch] = x[ch];
        }
        let mut want = vec![0.0f32; c];
        conv_silu(&seq, &wt, &bias, c, k, &mut want);
        let mut got = vec![0.0f32; c];
        conv_step_silu(&x, &wt, &bias, k, &mut tail, &mut got);
        for ch in 0..c {
            assert_eq!(got[ch].to_bits(), want[ch].to_bits(), "k {k}: channel {ch}");
            for j in 0..kt {
                assert_eq!(tail[ch * kt + j], seq[(j + 1) * c + ch], "k {k}: tail of channel {ch}, slot {j}");
            }
        }
    }
}
