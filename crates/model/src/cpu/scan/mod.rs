//! The selective scans: Mamba-2's per head (state (P, N) in L1 while the tokens stream past)
//! and Mamba-1's per block of channels. The x86 kernels in [`avx2`] and [`avx512`] give the bits
//! of the portable loop.

use picaso_compose::{prefetch_l2, simd_fn};

use super::activations::exp;
use super::LANES;

#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
pub mod f16;

simd_fn! {
    /// The selective scan of one head over `head.dt.len()` tokens, updating `s` (P×N) in place:
    /// s ← exp(dt·A)·s + dt·x⊗B, y = s·C + D·x. y is written (T, P).
    pub fn scan_head(s: &mut [f32], head: &ScanInputs, y: &mut [f32]) {
        let n_dim = head.n_dim;
        // d_state a whole number of up to 8 vectors (128 for mamba2-130m): B and C stay in
        // registers while every row of the state passes them.
        macro_rules! fixed {
            ($($nv:literal),*) => {
                match n_dim / LANES {
                    $($nv if n_dim % LANES == 0 => {
                        return scan_head_fixed::<$nv>(s, head, y)
                    })*
                    _ => {}
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if avx512::try_scan_head(s, head, y) || avx2::try_scan_head(s, head, y) {
            return;
        }
        fixed!(1, 2, 3, 4, 5, 6, 7, 8);
        scan_head_any(s, head, y)
    }
}

/// `$f::<NV, $h>(args)` for `NV = $nv` in 1..=8 (d_state / 16): how the x86 scan kernels
/// pick their instance for a head.
#[cfg(target_arch = "x86_64")]
macro_rules! with_vectors {
    ($nv:expr, $f:ident::<$h:ty>($($arg:expr),*)) => {
        match $nv {
            1 => $f::<1, $h>($($arg),*),
            2 => $f::<2, $h>($($arg),*),
            3 => $f::<3, $h>($($arg),*),
            4 => $f::<4, $h>($($arg),*),
            5 => $f::<5, $h>($($arg),*),
            6 => $f::<6, $h>($($arg),*),
            7 => $f::<7, $h>($($arg),*),
            _ => $f::<8, $h>($($arg),*),
        }
    };
}
#[cfg(target_arch = "x86_64")]
pub(crate) use with_vectors;

/// The sum of a row's [`LANES`] partial sums, by halving: lane l + (l + 8), then l + (l + 4),
/// l + (l + 2), l + (l + 1). Every scan kernel sums in this order (the AVX-512 one reduces 16
/// rows together with shuffles in it), so each gives the same bits.
#[inline(always)]
pub fn sum_lanes(acc: &[f32; LANES]) -> f32 {
    let w: [f32; 8] = std::array::from_fn(|l| acc[l] + acc[l + 8]);
    let u: [f32; 4] = std::array::from_fn(|l| w[l] + w[l + 4]);
    let z: [f32; 2] = std::array::from_fn(|l| u[l] + u[l + 2]);
    z[0] + z[1]
}

/// What [`scan_head`] reads, besides the state it updates and the output it writes.
#[derive(Debug, Clone, Copy)]
pub struct ScanInputs<'a> {
    /// The conv output, (T, `stride`).
    pub xbc: &'a [f32],
    /// Values per row of `xbc`.
    pub stride: usize,
    /// Where this head's x starts in each row.
    pub x_off: usize,
    /// Where its group's B starts.
    pub b_off: usize,
    /// Where its group's C starts.
    pub c_off: usize,
    /// Head dimension P.
    pub p_dim: usize,
    /// State dimension N.
    pub n_dim: usize,
    /// dt per token.
    pub dt: &'a [f32],
    /// exp(dt·A) per token.
    pub decay: &'a [f32],
    /// The skip connection D.
    pub d_skip: f32,
    /// The state comes from memory, not from cache (the engine sets it for a batch whose states
    /// outgrow the cache): the kernels prefetch it ahead. The bits are the same either way.
    pub from_memory: bool,
}

/// How far ahead (bytes) a head's scan asks for its state when it comes from memory. A batched
/// decode step reads each sequence's state once (16 mamba2-130m states are 302 MB in f32), and
/// the hardware's prefetcher stops at every 4 KiB page; asked for this far ahead, the next rows
/// (and the next head's) are on their way while these are updated. From cache, the extra
/// instructions only cost (a step's scans of one sequence 0.86× with them).
const STATE_AHEAD_BYTES: usize = 4096;

/// Prefetches into L2 the `count` state values [`STATE_AHEAD_BYTES`] past `rows` (the rows
/// the scan reaches soon; past the state's end the prefetches do nothing, as they never fault).
#[inline(always)]
pub(crate) fn prefetch_state_ahead<H>(rows: *const H, count: usize) {
    let start = rows.cast::<u8>().wrapping_add(STATE_AHEAD_BYTES);
    for line in (0..count * std::mem::size_of::<H>()).step_by(64) {
        prefetch_l2(start.wrapping_add(line));
    }
}

/// [`scan_head`] for any d_state.
#[inline(always)]
fn scan_head_any(s: &mut [f32], head: &ScanInputs, y: &mut [f32]) {
    let ScanInputs { xbc, stride, x_off, b_off, c_off, p_dim, n_dim, dt, decay, d_skip, .. } = *head;
    for (t, (&dt_t, &a_t)) in dt.iter().zip(decay).enumerate() {
        let row = &xbc[t * stride..(t + 1) * stride];
        let x = &row[x_off..x_off + p_dim];
        let b = &row[b_off..b_off + n_dim];
        let c = &row[c_off..c_off + n_dim];
        let yt = &mut y[t * p_dim..(t + 1) * p_dim];
        for p in 0..p_dim {
            let sp = &mut s[p * n_dim..(p + 1) * n_dim];
            let xdt = x[p] * dt_t;
            let mut acc = [0.0f32; LANES];
            let mut cs = sp.chunks_exact_mut(LANES);
            let mut cb = b.chunks_exact(LANES);
            let mut cc = c.chunks_exact(LANES);
            for ((sv, bv), cv) in (&mut cs).zip(&mut cb).zip(&mut cc) {
                for i in 0..LANES {
                    let v = sv[i].mul_add(a_t, xdt * bv[i]);
                    sv[i] = v;
                    acc[i] = v.mul_add(cv[i], acc[i]);
                }
            }
            let mut tail = 0.0f32;
            for ((sv, bv), cv) in cs.into_remainder().iter_mut().zip(cb.remainder()).zip(cc.remainder()) {
                let v = sv.mul_add(a_t, xdt * bv);
                *sv = v;
                tail = v.mul_add(*cv, tail);
            }
            yt[p] = sum_lanes(&acc) + tail + d_skip * x[p];
        }
    }
}

/// [`scan_head`] for d_state = NV · [`LANES`], the same operations in the same order (so the
/// same bits), with B and C held as NV vectors each. x86 CPUs run the AVX-512 or AVX2 kernel
/// instead ([`avx512`], [`avx2`]): LLVM compiles this loop for AVX2 into
/// 64- and 128-bit loads and scalar sums.
#[inline(always)]
fn scan_head_fixed<const NV: usize>(s: &mut [f32], head: &ScanInputs, y: &mut [f32]) {
    let ScanInputs { xbc, stride, x_off, b_off, c_off, p_dim, dt, decay, d_skip, .. } = *head;
    let n_dim = NV * LANES;
    let vectors = |from: &[f32]| -> [[f32; LANES]; NV] {
        std::array::from_fn(|j| from[j * LANES..(j + 1) * LANES].try_into().expect("LANES values"))
    };
    for (t, (&dt_t, &a_t)) in dt.iter().zip(decay).enumerate() {
        let row = &xbc[t * stride..(t + 1) * stride];
        let x = &row[x_off..x_off + p_dim];
        let (b, c) = (vectors(&row[b_off..b_off + n_dim]), vectors(&row[c_off..c_off + n_dim]));
        let yt = &mut y[t * p_dim..(t + 1) * p_dim];
        for (p, sp) in s.chunks_exact_mut(n_dim).take(p_dim).enumerate() {
            let xdt = x[p] * dt_t;
            let mut acc = [0.0f32; LANES];
            for j in 0..NV {
                let sv = &mut sp[j * LANES..(j + 1) * LANES];
                for i in 0..LANES {
                    let v = sv[i].mul_add(a_t, xdt * b[j][i]);
                    sv[i] = v;
                    acc[i] = v.mul_add(c[j][i], acc[i]);
                }
            }
            // `+ 0.0`: the general loop's (empty) tail, so that -0.0 sums alike.
            yt[p] = sum_lanes(&acc) + 0.0 + d_skip * x[p];
        }
    }
}

simd_fn! {
    /// The Mamba-1 selective scan of one block of up to [`LANES`] channels over `t` tokens,
    /// vectorised across the channels (each has its own decay per state element):
    /// s[c,j] ← exp(dt[c]·A[c,j])·s[c,j] + dt[c]·x[c]·B[j];  y[c] = Σ_j C[j]·s[c,j] + D[c]·x[c].
    /// `s` and `a` are the block's (w, N) rows; `dt` and `x` are (t, stride) with the block's
    /// channels at column `ch0`; `b`, `c` are (t, N); `y` gets (t, LANES), lanes past w zero.
    /// Returns Σ_t dt per channel (f64), from which the caller adds A·Σdt to the log-decay.
    pub fn scan_channels(
        s: &mut [f32],
        a: &[f32],
        d_skip: &[f32],
        dt: &[f32],
        x: &[f32],
        stride: usize,
        ch0: usize,
        b: &[f32],
        c: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> [f64; LANES] {
        let w = d_skip.len();
        let n = s.len() / w.max(1);
        // Lane-major copies: st[j][l] is channel l's state element j; missing lanes stay 0 and,
        // with dt = 0 there, stay 0.
        let mut st = vec![[0.0f32; LANES]; n];
        let mut at = vec![[0.0f32; LANES]; n];
        let mut dl = [0.0f32; LANES];
        for l in 0..w {
            for j in 0..n {
                st[j][l] = s[l * n + j];
                at[j][l] = a[l * n + j];
            }
            dl[l] = d_skip[l];
        }
        let mut dt_sum = [0.0f64; LANES];
        for ti in 0..t {
            let mut dtv = [0.0f32; LANES];
            let mut xv = [0.0f32; LANES];
            dtv[..w].copy_from_slice(&dt[ti * stride + ch0..ti * stride + ch0 + w]);
            xv[..w].copy_from_slice(&x[ti * stride + ch0..ti * stride + ch0 + w]);
            let mut dbx = [0.0f32; LANES];
            for l in 0..LANES {
                dbx[l] = dtv[l] * xv[l];
                dt_sum[l] += f64::from(dtv[l]);
            }
            let mut acc = [0.0f32; LANES];
            let (bt, ct) = (&b[ti * n..(ti + 1) * n], &c[ti * n..(ti + 1) * n]);
            for j in 0..n {
                let (bj, cj) = (bt[j], ct[j]);
                let (sj, aj) = (&mut st[j], &at[j]);
                for l in 0..LANES {
                    let v = exp(dtv[l] * aj[l]).mul_add(sj[l], dbx[l] * bj);
                    sj[l] = v;
                    acc[l] = v.mul_add(cj, acc[l]);
                }
            }
            let yt = &mut y[ti * LANES..(ti + 1) * LANES];
            for l in 0..LANES {
                yt[l] = dl[l].mul_add(xv[l], acc[l]);
            }
        }
        for l in 0..w {
            for j in 0..n {
                s[l * n + j] = st[j][l];
            }
        }
        dt_sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scan_with_b_and_c_in_registers_gives_the_bits_of_the_general_loop() {
        let t = 7;
        let wave = |len: usize, k: f32| -> Vec<f32> {
            (0..len).map(|i| ((i as f32 * k).sin() * 1.7).tan().clamp(-3.0, 3.0)).collect()
        };
        // 37 rows: the AVX-512 kernel's two blocks of 16 reduced together, and 5 alone.
        for (p_dim, n_dim) in [(5, 16), (37, 16), (37, 48), (64, 128), (37, 40)] {
            let stride = p_dim + 2 * n_dim + 3;
            let (xbc, s0) = (wave(t * stride, 0.37), wave(p_dim * n_dim, 0.91));
            let (dt, decay) = (
                wave(t, 1.3).iter().map(|v| v.abs() * 0.1).collect::<Vec<_>>(),
                wave(t, 0.7).iter().map(|v| (v.abs() * -0.2).exp()).collect::<Vec<_>>(),
            );
            #[cfg(target_arch = "x86_64")]
            let s0_copy = s0.clone();
            let (mut s1, mut s2, mut s3) = (s0.clone(), s0.clone(), s0);
            let (mut y1, mut y2, mut y3) = (vec![0.0f32; t * p_dim], vec![0.0f32; t * p_dim], vec![0.0f32; t * p_dim]);
            let head = ScanInputs {
                xbc: &xbc,
                stride,
                x_off: 1,
                b_off: 1 + p_dim,
                c_off: 1 + p_dim + n_dim,
                p_dim,
                n_dim,
                dt: &dt,
                decay: &decay,
                d_skip: 0.3,
                // The AVX-512 kernel prefetches (a state from memory); it changes no bit.
                from_memory: true,
            };
            // The dispatched kernel (AVX-512 where the CPU has it), the portable one for whole
            // vectors, and the general loop.
            scan_head(&mut s1, &head, &mut y1);
            scan_head_any(&mut s2, &head, &mut y2);
            match n_dim / LANES {
                1 if n_dim == LANES => scan_head_fixed::<1>(&mut s3, &head, &mut y3),
                3 => scan_head_fixed::<3>(&mut s3, &head, &mut y3),
                8 => scan_head_fixed::<8>(&mut s3, &head, &mut y3),
                _ => scan_head_any(&mut s3, &head, &mut y3),
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            // The AVX2 kernel by itself (the dispatch prefers AVX-512 where the CPU has it).
            #[cfg(target_arch = "x86_64")]
            {
                let (mut s4, mut y4) = (s0_copy, vec![0.0f32; t * p_dim]);
                if avx2::try_scan_head(&mut s4, &head, &mut y4) {
                    assert_eq!(bits(&s4), bits(&s2), "AVX2 state, p {p_dim}, d_state {n_dim}");
                    assert_eq!(bits(&y4), bits(&y2), "AVX2 y, p {p_dim}, d_state {n_dim}");
                } else {
                    let avx2 =
                        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
                    assert!(!avx2 || !n_dim.is_multiple_of(LANES), "the AVX2 kernel refused d_state {n_dim}");
                }
            }
            assert_eq!(bits(&s1), bits(&s2), "state, p {p_dim}, d_state {n_dim}");
            assert_eq!(bits(&y1), bits(&y2), "y, p {p_dim}, d_state {n_dim}");
            assert_eq!(bits(&s3), bits(&s2), "portable state, p {p_dim}, d_state {n_dim}");
            assert_eq!(bits(&y3), bits(&y2), "portable y, p {p_dim}, d_state {n_dim}");
        }
    }
}
