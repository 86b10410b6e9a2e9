//! The selective scan of one head on AVX-512, for states held as f32 or as f16.
//!
//! Each row of the (P, N) state is updated in registers (s ← decay·s + (x·dt)·B) and leaves 16
//! partial sums of its output y = s·C. Two things make this kernel 2–2.8× the row-by-row one
//! (`cargo bench -p picaso-model --bench matvecs -- "scan head"`, mamba2-130m's 64 × 128 head:
//! 0.37 µs against 1.02 per token in f32, 0.74 against 1.43 in f16, 12.6 against 32.3 µs for 32
//! tokens): rows advance four at a time, because a row's partial sums are a chain of N/16
//! dependent multiply-adds that one row alone leaves waiting on each result; and 16 rows'
//! partial sums are reduced together by shuffles (46 vector operations per 16 rows, where 16
//! stores, 256 scalar loads and 240 adds summed them row by row: with the rows advanced four at
//! a time but summed alone it took 0.63 µs). The reduction adds in the halving order of
//! [`super::sum_lanes`], so every CPU's kernel gives the same bits.

use std::arch::x86_64::*;

use super::{prefetch_state_ahead, sum_lanes, with_vectors, ScanInputs};
use crate::cpu::LANES;

/// How a state's values are held: f32, or f16 (as its bits) widened on load and rounded to
/// nearest on store.
pub trait Held: Copy {
    /// # Safety
    /// The CPU must have AVX-512F; `at` must point at 16 readable values.
    unsafe fn load(at: *const Self) -> __m512;
    /// # Safety
    /// The CPU must have AVX-512F; `at` must point at 16 writable values.
    unsafe fn store(at: *mut Self, v: __m512);
}

impl Held for f32 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load(at: *const f32) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe { _mm512_loadu_ps(at) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store(at: *mut f32, v: __m512) {
        // SAFETY: the caller's contract.
        unsafe { _mm512_storeu_ps(at, v) }
    }
}

/// Round to nearest (ties to even), no exceptions: IEEE's rounding, as `half`'s scalar path.
pub(crate) const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

impl Held for u16 {
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load(at: *const u16) -> __m512 {
        // SAFETY: the caller's contract (16 u16 = 32 bytes).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(at.cast())) }
    }
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn store(at: *mut u16, v: __m512) {
        // SAFETY: the caller's contract.
        unsafe { _mm256_storeu_si256(at.cast(), _mm512_cvtps_ph::<NEAREST>(v)) }
    }
}

/// Runs [`scan_head`] where this CPU and head allow it (AVX-512F; d_state a multiple of 16, at
/// most 128; a state of P rows; room for T·P outputs) and says whether it did.
pub fn try_scan_head<H: Held>(s: &mut [H], head: &ScanInputs, y: &mut [f32]) -> bool {
    let nv = head.n_dim / 16;
    if !(head.n_dim.is_multiple_of(16)
        && (1..=8).contains(&nv)
        && s.len() == head.p_dim * head.n_dim
        && y.len() >= head.dt.len() * head.p_dim
        && std::arch::is_x86_feature_detected!("avx512f"))
    {
        return false;
    }
    // SAFETY: the CPU has AVX-512F and the shapes are as `scan_head` requires (checked above).
    unsafe { with_vectors!(nv, scan_head::<H>(s, head, y)) }
    true
}

/// [`super::scan_head`] for d_state N = 16·NV: over every token of `head`, the state
/// `s` (P rows of N values, held as `H`) is updated in place and y (T, P) written. For f16
/// (`H = u16`) each token's values are rounded back as they are stored.
///
/// # Safety
/// The CPU must have AVX-512F; `head.n_dim == 16 * NV`, `s.len() == head.p_dim * head.n_dim`,
/// `y.len() >= head.dt.len() * head.p_dim`, and `head`'s rows hold x, B and C where it says.
#[target_feature(enable = "avx512f")]
pub unsafe fn scan_head<const NV: usize, H: Held>(s: &mut [H], head: &ScanInputs, y: &mut [f32]) {
    let ScanInputs { xbc, stride, x_off, b_off, c_off, p_dim, n_dim, dt, decay, d_skip, from_memory } = *head;
    debug_assert!(n_dim == 16 * NV && s.len() == p_dim * n_dim && y.len() >= dt.len() * p_dim);
    let blocks = p_dim / 16;
    for (t, (&dt_t, &a_t)) in dt.iter().zip(decay).enumerate() {
        let row = &xbc[t * stride..(t + 1) * stride];
        let (x, b, c) = (&row[x_off..x_off + p_dim], &row[b_off..b_off + n_dim], &row[c_off..c_off + n_dim]);
        let yt = &mut y[t * p_dim..(t + 1) * p_dim];
        // SAFETY (every load and store below): b and c hold 16·NV values; s holds p_dim rows of
        // 16·NV values; x and yt hold p_dim values (the caller's contract and the slices above).
        let bv: [__m512; NV] = std::array::from_fn(|j| unsafe { _mm512_loadu_ps(b.as_ptr().add(16 * j)) });
        let cv: [__m512; NV] = std::array::from_fn(|j| unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * j)) });
        let a = _mm512_set1_ps(a_t);
        let rows = s.as_mut_ptr();
        let skip = _mm512_set1_ps(d_skip);
        for blk in 0..blocks {
            let p0 = 16 * blk;
            // Four rows at a time down to one vector of their quarter sums, so few stay live.
            let mut quarters = [_mm512_setzero_ps(); 4];
            for (q, quarter) in quarters.iter_mut().enumerate() {
                let r = p0 + 4 * q;
                let xdt = [x[r] * dt_t, x[r + 1] * dt_t, x[r + 2] * dt_t, x[r + 3] * dt_t];
                if t == 0 && from_memory {
                    prefetch_state_ahead(rows.wrapping_add(r * n_dim), 4 * n_dim);
                }
                // SAFETY: r + 3 < 16·blocks <= p_dim rows.
                let [u0, u1, u2, u3] = unsafe { update_rows4(rows.add(r * n_dim), xdt, a, &bv, &cv) };
                *quarter = halve_quads(halve_pair(u0, u1), halve_pair(u2, u3));
            }
            let sums = reduce_quarters(quarters);
            // As the general loop: the lanes' sum, its (empty) tail, then the skip.
            let xs = unsafe { _mm512_loadu_ps(x.as_ptr().add(p0)) };
            let out = _mm512_add_ps(_mm512_add_ps(sums, _mm512_setzero_ps()), _mm512_mul_ps(skip, xs));
            unsafe { _mm512_storeu_ps(yt.as_mut_ptr().add(p0), out) };
        }
        for p in 16 * blocks..p_dim {
            let mut lanes = [0.0f32; LANES];
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), update_row(rows.add(p * n_dim), x[p] * dt_t, a, &bv, &cv)) };
            yt[p] = sum_lanes(&lanes) + 0.0 + d_skip * x[p];
        }
    }
}

/// One row of N = 16·NV values at `row`: s ← a·s + xdt·B, stored back; returns its 16 partial
/// sums of s·C. ([`update_rows4`] with one row; a single function generic over the number of
/// rows measured 45% slower in f32: 0.54 µs per head and token against 0.37.)
///
/// # Safety
/// The CPU must have AVX-512F; `row` must point at 16·NV values.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn update_row<const NV: usize, H: Held>(
    row: *mut H,
    xdt: f32,
    a: __m512,
    bv: &[__m512; NV],
    cv: &[__m512; NV],
) -> __m512 {
    let xdt = _mm512_set1_ps(xdt);
    let mut acc = _mm512_setzero_ps();
    for j in 0..NV {
        // SAFETY: j < NV, so 16·j + 16 values lie within the row.
        unsafe {
            let at = row.add(16 * j);
            let v = _mm512_fmadd_ps(H::load(at), a, _mm512_mul_ps(xdt, bv[j]));
            H::store(at, v);
            acc = _mm512_fmadd_ps(v, cv[j], acc);
        }
    }
    acc
}

/// [`update_row`] for the four consecutive rows from `rows`, advanced together: each row's
/// sum of s·C is a chain of NV dependent multiply-adds, and four chains side by side keep the
/// multiply-add units busy where one would wait on each result (measured: 2.4× the time).
///
/// # Safety
/// The CPU must have AVX-512F; `rows` must point at 4 rows of 16·NV values.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn update_rows4<const NV: usize, H: Held>(
    rows: *mut H,
    xdt: [f32; 4],
    a: __m512,
    bv: &[__m512; NV],
    cv: &[__m512; NV],
) -> [__m512; 4] {
    let xdt = xdt.map(|v| _mm512_set1_ps(v));
    let mut acc = [_mm512_setzero_ps(); 4];
    for j in 0..NV {
        for r in 0..4 {
            // SAFETY: r < 4 rows and j < NV vectors of 16 values.
            unsafe {
                let at = rows.add(r * 16 * NV + 16 * j);
                let v = _mm512_fmadd_ps(H::load(at), a, _mm512_mul_ps(xdt[r], bv[j]));
                H::store(at, v);
                acc[r] = _mm512_fmadd_ps(v, cv[j], acc[r]);
            }
        }
    }
    acc
}

/// Two rows' 16 lanes each → one vector: lanes 0..8 hold `u`'s l + (l + 8), lanes 8..16 `v`'s.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn halve_pair(u: __m512, v: __m512) -> __m512 {
    let low = _mm512_shuffle_f32x4::<0b01_00_01_00>(u, v);
    let high = _mm512_shuffle_f32x4::<0b11_10_11_10>(u, v);
    _mm512_add_ps(low, high)
}

/// Two [`halve_pair`] results (rows r, r+1 and r+2, r+3) → one vector whose 128-bit quarter q
/// holds row r + q's four sums l + (l + 4).
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn halve_quads(u: __m512, v: __m512) -> __m512 {
    let first = _mm512_shuffle_f32x4::<0b10_00_10_00>(u, v);
    let second = _mm512_shuffle_f32x4::<0b11_01_11_01>(u, v);
    _mm512_add_ps(first, second)
}

/// Four [`halve_quads`] results (rows 4k..4k+4 in vector k) → the 16 rows' sums in row order.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn reduce_quarters(q: [__m512; 4]) -> __m512 {
    // Within each 128-bit quarter: l + (l + 2), two rows per quarter ...
    let t0 =
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(q[0], q[1]), _mm512_shuffle_ps::<0b11_10_11_10>(q[0], q[1]));
    let t1 =
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(q[2], q[3]), _mm512_shuffle_ps::<0b11_10_11_10>(q[2], q[3]));
    // ... then l + (l + 1): quarter q now holds rows q, q + 4, q + 8, q + 12.
    let sums = _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(t0, t1), _mm512_shuffle_ps::<0b11_01_11_01>(t0, t1));
    // Row r sits in lane 4·(r mod 4) + r / 4.
    let rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(rows, sums)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bit-for-bit tests compare this kernel with the portable ones through the dispatching
    /// `scan_head`s; this one makes sure the dispatch does pick it (else they would compare the
    /// portable kernels with themselves).
    #[test]
    fn the_kernel_takes_the_heads_it_can_on_a_cpu_with_avx512() {
        let (p, t) = (37, 2);
        for (n, takes) in [(16, true), (128, true), (40, false), (144, false)] {
            let stride = p + 2 * n;
            let xbc: Vec<f32> = (0..t * stride).map(|i| (i % 7) as f32 * 0.1).collect();
            let (dt, decay) = (vec![0.1f32; t], vec![0.9f32; t]);
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
                d_skip: 0.5,
                from_memory: false,
            };
            let (mut s, mut y) = (vec![0.5f32; p * n], vec![0.0f32; t * p]);
            let mut h = vec![0u16; p * n];
            let avx512 = std::arch::is_x86_feature_detected!("avx512f");
            assert_eq!(try_scan_head(&mut s, &head, &mut y), takes && avx512, "f32, d_state {n}");
            assert_eq!(try_scan_head(&mut h, &head, &mut y), takes && avx512, "f16, d_state {n}");
        }
    }
}
