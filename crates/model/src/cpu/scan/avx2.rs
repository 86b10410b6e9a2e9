//! The selective scan of one head on AVX2 + FMA (CPUs without AVX-512), for states held as
//! f32 or as f16 (F16C).
//!
//! The portable kernel, compiled for AVX2, came out as 128-bit and 64-bit loads and scalar sums
//! (`perf annotate` on an AMD EPYC Zen 3): the scan was 32% of a 512-token prefill there. Here
//! each row's 16 partial sums are two 256-bit registers (lanes 0..8 and 8..16 of
//! [`super::sum_lanes`]'s order), two rows advance together (four independent chains of
//! multiply-adds), and eight rows' sums are reduced together by shuffles in `sum_lanes`'s
//! halving order, so this kernel gives the portable kernel's bits.

use std::arch::x86_64::*;

use super::{prefetch_state_ahead, sum_lanes, with_vectors, ScanInputs};
use crate::cpu::LANES;

/// How a state's values are held: f32, or f16 (as its bits) widened on load and rounded to
/// nearest on store.
pub trait Held: Copy {
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `at` must point at 8 readable values.
    unsafe fn load(at: *const Self) -> __m256;
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; `at` must point at 8 writable values.
    unsafe fn store(at: *mut Self, v: __m256);
}

impl Held for f32 {
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load(at: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(at) }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store(at: *mut f32, v: __m256) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_ps(at, v) }
    }
}

impl Held for u16 {
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load(at: *const u16) -> __m256 {
        // SAFETY: the caller's contract (8 u16 = 16 bytes).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at.cast())) }
    }
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn store(at: *mut u16, v: __m256) {
        // SAFETY: the caller's contract.
        unsafe { _mm_storeu_si128(at.cast(), _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)) }
    }
}

/// Runs [`scan_head`] where this CPU and head allow it (AVX2, FMA and F16C; d_state a multiple
/// of 16, at most 128; a state of P rows; room for T·P outputs) and says whether it did.
pub fn try_scan_head<H: Held>(s: &mut [H], head: &ScanInputs, y: &mut [f32]) -> bool {
    let nv = head.n_dim / LANES;
    if !(head.n_dim.is_multiple_of(LANES)
        && (1..=8).contains(&nv)
        && s.len() == head.p_dim * head.n_dim
        && y.len() >= head.dt.len() * head.p_dim
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c"))
    {
        return false;
    }
    // SAFETY: the CPU has AVX2, FMA and F16C, and the shapes are as `scan_head` requires.
    unsafe { with_vectors!(nv, scan_head::<H>(s, head, y)) }
    true
}

/// [`super::scan_head`] for d_state N = 16·NV: over every token of `head`, the state
/// `s` (P rows of N values, held as `H`) is updated in place and y (T, P) written. For f16
/// (`H = u16`) each token's values are rounded back as they are stored.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `head.n_dim == 16 * NV`, `s.len() == head.p_dim *
/// head.n_dim`, `y.len() >= head.dt.len() * head.p_dim`, and `head`'s rows hold x, B and C
/// where it says.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn scan_head<const NV: usize, H: Held>(s: &mut [H], head: &ScanInputs, y: &mut [f32]) {
    let ScanInputs { xbc, stride, x_off, b_off, c_off, p_dim, n_dim, dt, decay, d_skip, from_memory } = *head;
    debug_assert!(n_dim == LANES * NV && s.len() == p_dim * n_dim && y.len() >= dt.len() * p_dim);
    let blocks = p_dim / 8;
    let rows = s.as_mut_ptr();
    let skip = _mm256_set1_ps(d_skip);
    for (t, (&dt_t, &a_t)) in dt.iter().zip(decay).enumerate() {
        let row = &xbc[t * stride..(t + 1) * stride];
        let (x, b, c) = (&row[x_off..x_off + p_dim], &row[b_off..b_off + n_dim], &row[c_off..c_off + n_dim]);
        let yt = &mut y[t * p_dim..(t + 1) * p_dim];
        let a = _mm256_set1_ps(a_t);
        for blk in 0..blocks {
            let p0 = 8 * blk;
            // Two rows at a time; each pair leaves one vector of their four-lane sums.
            let mut pairs = [_mm256_setzero_ps(); 4];
            for (q, pair) in pairs.iter_mut().enumerate() {
                let r = p0 + 2 * q;
                if t == 0 && from_memory {
                    prefetch_state_ahead(rows.wrapping_add(r * n_dim), 2 * n_dim);
                }
                // SAFETY: r + 1 < 8·blocks <= p_dim rows; b and c hold 16·NV values.
                let [u, v] =
                    unsafe { update_rows2::<NV, H>(rows.add(r * n_dim), [x[r] * dt_t, x[r + 1] * dt_t], a, b, c) };
                *pair = halve_pair(u, v);
            }
            let sums = reduce_pairs(pairs);
            // As the general loop: the lanes' sum, its (empty) tail, then the skip.
            // SAFETY: p0 + 8 <= p_dim values of x and yt.
            unsafe {
                let xs = _mm256_loadu_ps(x.as_ptr().add(p0));
                let out = _mm256_add_ps(_mm256_add_ps(sums, _mm256_setzero_ps()), _mm256_mul_ps(skip, xs));
                _mm256_storeu_ps(yt.as_mut_ptr().add(p0), out);
            }
        }
        for p in 8 * blocks..p_dim {
            // SAFETY: row p < p_dim; b and c hold 16·NV values.
            let [lo, hi] = unsafe { update_row::<NV, H>(rows.add(p * n_dim), x[p] * dt_t, a, b, c) };
            let mut lanes = [0.0f32; LANES];
            // SAFETY: `lanes` holds 16 values.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
            }
            yt[p] = sum_lanes(&lanes) + 0.0 + d_skip * x[p];
        }
    }
}

/// One row of N = 16·NV values at `row`: s ← a·s + xdt·B, stored back; returns its 16 partial
/// sums of s·C as lanes 0..8 and 8..16.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `row` must point at 16·NV values, `b` and `c` hold
/// 16·NV values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn update_row<const NV: usize, H: Held>(row: *mut H, xdt: f32, a: __m256, b: &[f32], c: &[f32]) -> [__m256; 2] {
    let xdt = _mm256_set1_ps(xdt);
    let mut acc = [_mm256_setzero_ps(); 2];
    for j in 0..2 * NV {
        // SAFETY: j < 2·NV, so 8·j + 8 values lie within the row, b and c.
        unsafe {
            let at = row.add(8 * j);
            let v = _mm256_fmadd_ps(H::load(at), a, _mm256_mul_ps(xdt, _mm256_loadu_ps(b.as_ptr().add(8 * j))));
            H::store(at, v);
            acc[j % 2] = _mm256_fmadd_ps(v, _mm256_loadu_ps(c.as_ptr().add(8 * j)), acc[j % 2]);
        }
    }
    acc
}

/// [`update_row`] for the two consecutive rows from `rows`, advanced together (four chains of
/// multiply-adds side by side, where one row's two would wait on each result); returns each
/// row's lanes 0..8 and 8..16 already added, l + (l + 8).
///
/// # Safety
/// As [`update_row`], with `rows` pointing at 2 rows of 16·NV values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn update_rows2<const NV: usize, H: Held>(
    rows: *mut H,
    xdt: [f32; 2],
    a: __m256,
    b: &[f32],
    c: &[f32],
) -> [__m256; 2] {
    let xdt = xdt.map(|v| _mm256_set1_ps(v));
    let mut acc = [[_mm256_setzero_ps(); 2]; 2];
    for j in 0..2 * NV {
        // SAFETY: j < 2·NV vectors of 8 values, within b, c and each of the two rows.
        unsafe {
            let (bj, cj) = (_mm256_loadu_ps(b.as_ptr().add(8 * j)), _mm256_loadu_ps(c.as_ptr().add(8 * j)));
            for r in 0..2 {
                let at = rows.add(r * LANES * NV + 8 * j);
                let v = _mm256_fmadd_ps(H::load(at), a, _mm256_mul_ps(xdt[r], bj));
                H::store(at, v);
                acc[r][j % 2] = _mm256_fmadd_ps(v, cj, acc[r][j % 2]);
            }
        }
    }
    acc.map(|[lo, hi]| _mm256_add_ps(lo, hi))
}

/// Two rows' eight sums l + (l + 8) → one vector: lanes 0..4 hold `u`'s l + (l + 4), lanes
/// 4..8 `v`'s.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn halve_pair(u: __m256, v: __m256) -> __m256 {
    let low = _mm256_permute2f128_ps::<0x20>(u, v);
    let high = _mm256_permute2f128_ps::<0x31>(u, v);
    _mm256_add_ps(low, high)
}

/// Four [`halve_pair`] results (rows 2k, 2k + 1 in vector k) → the eight rows' sums in row order.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn reduce_pairs(p: [__m256; 4]) -> __m256 {
    // Within each 128-bit half: l + (l + 2); the low half holds rows 0, 2 (then 4, 6), the high
    // half rows 1, 3 (then 5, 7) ...
    let t0 =
        _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(p[0], p[1]), _mm256_shuffle_ps::<0b11_10_11_10>(p[0], p[1]));
    let t1 =
        _mm256_add_ps(_mm256_shuffle_ps::<0b01_00_01_00>(p[2], p[3]), _mm256_shuffle_ps::<0b11_10_11_10>(p[2], p[3]));
    // ... then l + (l + 1): lanes hold rows 0, 2, 4, 6, 1, 3, 5, 7.
    let sums = _mm256_add_ps(_mm256_shuffle_ps::<0b10_00_10_00>(t0, t1), _mm256_shuffle_ps::<0b11_01_11_01>(t0, t1));
    _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}
