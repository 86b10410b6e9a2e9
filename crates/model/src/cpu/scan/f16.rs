//! SSM states stored as f16 while they are decoded: half the bytes to read and write per token.
//!
//! A batched decode step reads and writes every sequence's whole SSM state once (18.9 MB in f32
//! for mamba2-130m), so with 16 sequences the states, not the weights, are most of a step's
//! memory traffic. Held as f16 they cost half. The arithmetic stays f32: a head's values are
//! widened into a per-thread buffer, scanned by the f32 kernel, and rounded back (to nearest,
//! ties to even), so one step from an f16 state gives the bits of the f32 step from its widened
//! values. A one-token step (every batched decode step) on AVX-512 does the same in registers
//! instead ([`super::avx512`]), with no f32 copy of the head: the same operations in the
//! same order, so the same bits. f16 rather than bf16: 11 significant bits against 8; measured
//! on the bundled model (BENCHMARKS.md), bf16 states moved single log-probs ~15× more. A value
//! beyond ±65,504 becomes infinite, and the next logits are then not finite, which decoding
//! reports as an error.

use std::cell::RefCell;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{scan_head, ScanInputs};

/// [`scan_head`] on a state stored as f16: widened, scanned in f32, rounded back.
pub fn scan_head_f16(s: &mut [f16], head: &ScanInputs, y: &mut [f32]) {
    // One token in registers (rounded as it is stored); several go through the f32 copy,
    // rounded once after the last.
    #[cfg(target_arch = "x86_64")]
    if head.dt.len() == 1 {
        let bits: &mut [u16] = s.reinterpret_cast_mut();
        if super::avx512::try_scan_head(bits, head, y) || super::avx2::try_scan_head(bits, head, y) {
            return;
        }
    }
    scan_head_f16_widened(s, head, y)
}

/// [`scan_head_f16`] through an f32 copy of the head: any CPU, any number of tokens (rounded
/// to f16 once, after the last).
pub fn scan_head_f16_widened(s: &mut [f16], head: &ScanInputs, y: &mut [f32]) {
    thread_local! {
        /// One head's state in f32 (32 KiB for mamba2-130m: it stays in L1/L2).
        static HEAD: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    HEAD.with_borrow_mut(|buf| {
        buf.resize(s.len(), 0.0);
        widen(s, buf);
        scan_head(buf, head, y);
        narrow(buf, s);
    });
}

/// `dst[i] = src[i]` as f32 (exact).
pub fn widen(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "widen: lengths differ");
    let bits: &[u16] = src.reinterpret_cast();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; the lengths are equal (asserted).
            return unsafe { x86::widen_avx512(bits, dst) };
        }
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has F16C and AVX; the lengths are equal.
            return unsafe { x86::widen_f16c(bits, dst) };
        }
    }
    widen_scalar(bits, dst);
}

/// `dst[i] = src[i]` rounded to f16 (to nearest, ties to even; beyond ±65,504 → ±∞).
pub fn narrow(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "narrow: lengths differ");
    let bits: &mut [u16] = dst.reinterpret_cast_mut();
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F; the lengths are equal (asserted).
            return unsafe { x86::narrow_avx512(src, bits) };
        }
        if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU has F16C and AVX; the lengths are equal.
            return unsafe { x86::narrow_f16c(src, bits) };
        }
    }
    narrow_scalar(src, bits);
}

fn widen_scalar(src: &[u16], dst: &mut [f32]) {
    for (d, &b) in dst.iter_mut().zip(src) {
        *d = f16::from_bits(b).to_f32();
    }
}

fn narrow_scalar(src: &[f32], dst: &mut [u16]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(v).to_bits();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::avx512::NEAREST;

    /// [`NEAREST`] for F16C, whose immediate has no exception bit.
    const NEAREST_F16C: i32 = _MM_FROUND_TO_NEAREST_INT;

    /// # Safety
    /// The CPU must have AVX-512F, and `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_avx512(src: &[u16], dst: &mut [f32]) {
        let body = src.len() - src.len() % 16;
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= body <= both lengths.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
                _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
        super::widen_scalar(&src[body..], &mut dst[body..]);
    }

    /// # Safety
    /// The CPU must have AVX-512F, and `src.len() == dst.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn narrow_avx512(src: &[f32], dst: &mut [u16]) {
        let body = src.len() - src.len() % 16;
        for i in (0..body).step_by(16) {
            // SAFETY: i + 16 <= body <= both lengths.
            unsafe {
                let v = _mm512_loadu_ps(src.as_ptr().add(i));
                _mm256_storeu_si256(dst.as_mut_ptr().add(i).cast(), _mm512_cvtps_ph::<NEAREST>(v));
            }
        }
        super::narrow_scalar(&src[body..], &mut dst[body..]);
    }

    /// # Safety
    /// The CPU must have F16C and AVX, and `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn widen_f16c(src: &[u16], dst: &mut [f32]) {
        let body = src.len() - src.len() % 8;
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= body <= both lengths.
            unsafe {
                let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        super::widen_scalar(&src[body..], &mut dst[body..]);
    }

    /// # Safety
    /// The CPU must have F16C and AVX, and `src.len() == dst.len()`.
    #[target_feature(enable = "avx,f16c")]
    pub(super) unsafe fn narrow_f16c(src: &[f32], dst: &mut [u16]) {
        let body = src.len() - src.len() % 8;
        for i in (0..body).step_by(8) {
            // SAFETY: i + 8 <= body <= both lengths.
            unsafe {
                let v = _mm256_loadu_ps(src.as_ptr().add(i));
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), _mm256_cvtps_ph::<NEAREST_F16C>(v));
            }
        }
        super::narrow_scalar(&src[body..], &mut dst[body..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_for_every_f16() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut wide = vec![0.0f32; all.len()];
        widen(&all, &mut wide);
        for (h, w) in all.iter().zip(&wide) {
            let expect = h.to_f32();
            assert!(expect.to_bits() == w.to_bits() || (expect.is_nan() && w.is_nan()), "{h:?}: {w} vs {expect}");
        }
    }

    #[test]
    fn narrowing_rounds_to_nearest_even_and_overflows_to_infinity() {
        // Every f16 exactly, the midpoints between neighbours (ties), values just off them,
        // the largest finite f16 and beyond, subnormals, and lengths off the vector width.
        let mut values = vec![65504.0f32, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, -2.9e-8, 0.0, -0.0];
        for b in (0..0x7c00u16).step_by(7) {
            let (lo, hi) = (f16::from_bits(b).to_f32(), f16::from_bits(b + 1).to_f32());
            let mid = (lo + hi) / 2.0;
            values.extend([lo, mid, f32::from_bits(mid.to_bits() + 1), f32::from_bits(mid.to_bits() - 1), -mid]);
        }
        values.push(1.0);
        let mut narrow_bits = vec![f16::ZERO; values.len()];
        narrow(&values, &mut narrow_bits);
        for (v, h) in values.iter().zip(&narrow_bits) {
            assert_eq!(h.to_bits(), f16::from_f32(*v).to_bits(), "{v}");
        }
        // Every instruction set this CPU has gives the same bits, both ways.
        let bits: Vec<u16> = narrow_bits.iter().map(|h| h.to_bits()).collect();
        let mut paths: Vec<(&str, Vec<u16>, Vec<f32>)> = Vec::new();
        let (mut n, mut w) = (vec![0u16; values.len()], vec![0.0f32; values.len()]);
        narrow_scalar(&values, &mut n);
        widen_scalar(&bits, &mut w);
        paths.push(("scalar", n.clone(), w.clone()));
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
                // SAFETY: the features were just detected; the lengths are equal.
                unsafe { (x86::narrow_f16c(&values, &mut n), x86::widen_f16c(&bits, &mut w)) };
                paths.push(("f16c", n.clone(), w.clone()));
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: as above.
                unsafe { (x86::narrow_avx512(&values, &mut n), x86::widen_avx512(&bits, &mut w)) };
                paths.push(("avx512", n.clone(), w.clone()));
            }
        }
        let wide: Vec<u32> = narrow_bits.iter().map(|h| h.to_f32().to_bits()).collect();
        for (name, n, w) in paths {
            assert_eq!(n, bits, "{name}: narrowing");
            assert_eq!(w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), wide, "{name}: widening");
        }
        assert!(f16::from_f32(65520.0).is_infinite() && narrow_bits[2].is_infinite());
        assert_eq!(narrow_bits[0].to_f32(), 65504.0);
    }

    #[test]
    fn a_one_token_step_in_registers_gives_the_widened_steps_bits() {
        // Every d_state the register path takes (and two it leaves to the widened one), states
        // with subnormal, ordinary and near-overflow values, several steps in a row.
        let mut seed = 11u64;
        let mut rand = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for n in [16usize, 32, 48, 64, 80, 96, 112, 128, 40, 144] {
            // 37 rows: two blocks of 16 reduced together, and 5 summed alone.
            let p = 37;
            let stride = p + 2 * n + 3;
            let scale = [6e-6f32, 1.0, 3.0, 60000.0];
            let start: Vec<f16> = (0..p * n).map(|i| f16::from_f32(scale[i % 4] * rand())).collect();
            let (mut fused, mut widened, mut avx2) = (start.clone(), start.clone(), start.clone());
            for step in 0..4 {
                let xbc: Vec<f32> = (0..stride).map(|_| 3.0 * rand()).collect();
                let dt = [0.02 + 0.2 * rand().abs()];
                let decay = [(-dt[0] * (1.0 + rand().abs())).exp()];
                let head = ScanInputs {
                    xbc: &xbc,
                    stride,
                    x_off: 2,
                    b_off: 2 + p,
                    c_off: 2 + p + n,
                    p_dim: p,
                    n_dim: n,
                    dt: &dt,
                    decay: &decay,
                    d_skip: 0.7,
                    from_memory: step % 2 == 1,
                };
                let (mut y_fused, mut y_widened) = (vec![0.0f32; p], vec![0.0f32; p]);
                scan_head_f16(&mut fused, &head, &mut y_fused);
                scan_head_f16_widened(&mut widened, &head, &mut y_widened);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&y_fused), bits(&y_widened), "d_state {n}, step {step}: y");
                let hbits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(hbits(&fused), hbits(&widened), "d_state {n}, step {step}: state");
                // The AVX2 kernel by itself (the dispatch prefers AVX-512 where the CPU has it).
                #[cfg(target_arch = "x86_64")]
                {
                    let mut y_avx2 = vec![0.0f32; p];
                    if super::super::avx2::try_scan_head::<u16>(avx2.reinterpret_cast_mut(), &head, &mut y_avx2) {
                        assert_eq!(bits(&y_avx2), bits(&y_widened), "AVX2, d_state {n}, step {step}: y");
                        assert_eq!(hbits(&avx2), hbits(&widened), "AVX2, d_state {n}, step {step}: state");
                    }
                }
            }
            assert_ne!(fused, start, "d_state {n}: the state moved");
        }
    }

    #[test]
    fn an_f16_scan_is_the_f32_scan_of_the_widened_state_rounded() {
        let (p, n, t) = (3usize, 48usize, 5usize);
        let stride = p + 2 * n;
        let mut seed = 7u64;
        let mut rand = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let xbc: Vec<f32> = (0..t * stride).map(|_| rand()).collect();
        let dt: Vec<f32> = (0..t).map(|_| 0.05 + 0.1 * rand().abs()).collect();
        let decay: Vec<f32> = dt.iter().map(|d| (-d * 0.7).exp()).collect();
        let head = ScanInputs {
            xbc: &xbc,
            stride,
            x_off: 0,
            b_off: p,
            c_off: p + n,
            p_dim: p,
            n_dim: n,
            dt: &dt,
            decay: &decay,
            d_skip: 0.3,
            from_memory: false,
        };
        let start: Vec<f16> = (0..p * n).map(|_| f16::from_f32(4.0 * rand())).collect();
        let (mut half_state, mut y_half) = (start.clone(), vec![0.0f32; t * p]);
        scan_head_f16(&mut half_state, &head, &mut y_half);

        let mut wide: Vec<f32> = start.iter().map(|h| h.to_f32()).collect();
        let mut y = vec![0.0f32; t * p];
        scan_head(&mut wide, &head, &mut y);
        assert_eq!(y_half, y);
        let rounded: Vec<f16> = wide.iter().map(|&v| f16::from_f32(v)).collect();
        assert_eq!(half_state, rounded);
        assert_ne!(half_state, start, "the state moved");
    }
}
