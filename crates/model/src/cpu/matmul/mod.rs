//! Matrix products with f32 or bf16 weights: the one-input kernel decode streams weights
//! through, the many-input blocks of batched decode, and gemm for prefill. Compiled for AVX-512,
//! AVX2+FMA and portable code, the best chosen at run time.

use picaso_compose::{prefetch_l2, simd_fn};
use rayon::prelude::*;
use std::cell::Cell;

use super::LANES;
use bf16_dot::PairedBf16;

pub mod bf16_dot;
pub mod bf16_gemm;
pub mod bf16_tiles;

/// A weight element the kernels can widen to f32: f32 itself, or bf16 stored as its bits.
pub(super) trait Widen: Copy {
    fn widen(self) -> f32;
    /// Eight elements from `p` widened to f32 (AVX2).
    ///
    /// # Safety
    /// `p` must be valid for eight reads and the CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// Sixteen elements from `p` widened to f32 (AVX-512).
    ///
    /// # Safety
    /// `p` must be valid for sixteen reads and the CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}
impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}
impl Widen for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; bf16 → f32 is the 16 bits moved to the top.
        unsafe {
            let h = _mm_loadu_si128(p.cast());
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract; as load8.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
        }
    }
}

/// The dot products of `R` weight rows with `M` inputs, each in one canonical order: lane `l`
/// of LANES sums the elements `j ≡ l (mod LANES)` of the body in order, the tail (past the last
/// whole LANES) is summed in order, and the lanes are added as a fixed tree, then the tail.
/// Every kernel below computes every dot this way whatever `R` and `M` it blocks with, so a
/// decode step gives the same bits alone or in a batch; blocking only shares loads (a weight
/// load serves `M` inputs, an input load `R` rows) and hides the FMA latency (`R·M` chains).
/// With `prefetch`, asks for the memory [`PREFETCH_AHEAD_BYTES`] ahead of each row.
#[inline(always)]
fn dots<W: Widen, const R: usize, const M: usize>(rows: [&[W]; R], xs: [&[f32]; M], prefetch: bool) -> [[f32; M]; R] {
    assert_same_lengths(&rows, &xs);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA; the lengths are checked above.
        return unsafe { dots_avx2(rows, xs, prefetch) };
    }
    dots_portable(rows, xs, prefetch)
}

/// How the many-input AVX2 kernel holds a dot's 16 lanes (AVX-512 holds them in one register).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Blocking {
    /// Two registers per dot, in one pass ([`dots_avx2`]): 3 × 2 blocks.
    Pairs,
    /// One register per dot, in two passes ([`dots_avx2_halves`]): 2 × 4 blocks, so a block of
    /// four inputs widens each bf16 weight once.
    Halves,
}

/// [`dots`] for the many-input kernel: with AVX-512 where the CPU has it, else with AVX2 as
/// `blocking` says (same bits either way). The one-input kernel stays on AVX2: with AVX-512, a
/// lone in_proj product of mamba2-130m took 109–120 µs on a Zen 4 against AVX2's 91–96.
#[inline(always)]
fn dots_batch<W: Widen, const R: usize, const M: usize>(
    rows: [&[W]; R],
    xs: [&[f32]; M],
    prefetch: bool,
    blocking: Blocking,
) -> [[f32; M]; R] {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        assert_same_lengths(&rows, &xs);
        // SAFETY: the CPU has AVX-512F, AVX2 and FMA; the lengths are checked above.
        return unsafe { dots_avx512(rows, xs, prefetch) };
    }
    #[cfg(target_arch = "x86_64")]
    if blocking == Blocking::Halves && has_avx2_fma() {
        assert_same_lengths(&rows, &xs);
        // SAFETY: the CPU has AVX2 and FMA; the lengths are checked above.
        return unsafe { dots_avx2_halves(rows, xs, prefetch) };
    }
    dots(rows, xs, prefetch)
}

/// [`dots`] with AVX2 for the many-input kernel, one register per dot: the lanes 0–7 of every
/// dot (the first half of each 16 elements) in a first pass over the rows, then the lanes 8–15
/// in a second, so R·M accumulators fit where [`dots_avx2`] needs 2·R·M: a block can span four
/// inputs. Each lane's chain is the same multiply-adds in the same order, and the halves meet
/// in the same lane tree: the same bits. For f32 weights and for 16 inputs, blocks of 4 × 3,
/// 4 × 2, 3 × 3 and 2 × 4 in halves were 1.03–1.26× slower than 3 × 2 in pairs on a Zen 1.
///
/// # Safety
/// The CPU must have AVX2 and FMA, and every row and input must have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2_halves<W: Widen, const R: usize, const M: usize>(
    rows: [&[W]; R],
    xs: [&[f32]; M],
    prefetch: bool,
) -> [[f32; M]; R] {
    use std::arch::x86_64::*;
    let k = xs[0].len();
    let body = k - k % LANES;
    let ahead = PREFETCH_AHEAD_BYTES / std::mem::size_of::<W>();
    let mut halves = [[[_mm256_setzero_ps(); M]; R]; 2];
    for (half, acc) in halves.iter_mut().enumerate() {
        let mut j = half * 8;
        while j < body {
            if prefetch && half == 0 {
                prefetch_rows(&rows, j + ahead);
            }
            // SAFETY: j + 8 <= body <= k, every slice's length.
            unsafe {
                let x: [__m256; M] = std::array::from_fn(|i| _mm256_loadu_ps(xs[i].as_ptr().add(j)));
                for r in 0..R {
                    let w = W::load8(rows[r].as_ptr().add(j));
                    for i in 0..M {
                        acc[r][i] = _mm256_fmadd_ps(w, x[i], acc[r][i]);
                    }
                }
            }
            j += LANES;
        }
    }
    let mut out = [[0.0f32; M]; R];
    for r in 0..R {
        for i in 0..M {
            // The lane tree of lane_sum: v[l] += v[l+8], then the rest.
            // SAFETY: the CPU has AVX2 (this function's contract).
            let sum = unsafe { lane_tree8(_mm256_add_ps(halves[0][r][i], halves[1][r][i])) };
            out[r][i] = sum + tail_dot(rows[r], xs[i], body);
        }
    }
    out
}

/// The SIMD kernels' precondition: every row and input as long as the first input.
#[inline(always)]
fn assert_same_lengths<W>(rows: &[&[W]], xs: &[&[f32]]) {
    let k = xs[0].len();
    assert!(rows.iter().all(|r| r.len() == k) && xs.iter().all(|x| x.len() == k), "dots: lengths differ");
}

/// Whether the CPU has AVX-512F besides AVX2 and FMA (detected once).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_avx512() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| has_avx2_fma() && std::arch::is_x86_feature_detected!("avx512f"))
}

/// Whether the CPU has AVX2 and FMA (detected once).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_avx2_fma() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"))
}

/// [`dots`] with AVX2 intrinsics: each dot's 16 lanes are two registers (lanes 0–7, 8–15), so
/// the block's R·M·2 accumulators stay in the 16 registers, and the lane tree is the same adds
/// in the same order as [`lane_sum`]: the bits equal the portable loop's.
///
/// # Safety
/// The CPU must have AVX2 and FMA, and every row and input must have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2<W: Widen, const R: usize, const M: usize>(
    rows: [&[W]; R],
    xs: [&[f32]; M],
    prefetch: bool,
) -> [[f32; M]; R] {
    use std::arch::x86_64::*;
    let k = xs[0].len();
    let body = k - k % LANES;
    let ahead = PREFETCH_AHEAD_BYTES / std::mem::size_of::<W>();
    let mut lo = [[_mm256_setzero_ps(); M]; R];
    let mut hi = [[_mm256_setzero_ps(); M]; R];
    let mut j = 0;
    while j < body {
        if prefetch {
            prefetch_rows(&rows, j + ahead);
        }
        // SAFETY: j + LANES <= body <= k, every slice's length.
        unsafe {
            let xl: [__m256; M] = std::array::from_fn(|i| _mm256_loadu_ps(xs[i].as_ptr().add(j)));
            let xh: [__m256; M] = std::array::from_fn(|i| _mm256_loadu_ps(xs[i].as_ptr().add(j + 8)));
            for r in 0..R {
                let wl = W::load8(rows[r].as_ptr().add(j));
                let wh = W::load8(rows[r].as_ptr().add(j + 8));
                for i in 0..M {
                    lo[r][i] = _mm256_fmadd_ps(wl, xl[i], lo[r][i]);
                    hi[r][i] = _mm256_fmadd_ps(wh, xh[i], hi[r][i]);
                }
            }
        }
        j += LANES;
    }
    let mut out = [[0.0f32; M]; R];
    for r in 0..R {
        for i in 0..M {
            // The lane tree of lane_sum: v[l] += v[l+8], then the rest.
            // SAFETY: the CPU has AVX2 (this function's contract).
            let sum = unsafe { lane_tree8(_mm256_add_ps(lo[r][i], hi[r][i])) };
            out[r][i] = sum + tail_dot(rows[r], xs[i], body);
        }
    }
    out
}

/// The lane tree of [`lane_sum`] after its first level: the eight sums v[l] + v[l+8], added
/// +4, then +2, then +1, as the portable loop adds them.
///
/// # Safety
/// The CPU must have AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn lane_tree8(s8: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }
}

/// [`dots`] with AVX-512: each dot's 16 lanes are one register, so a block holds up to 32
/// accumulators, and the lane tree adds the upper eight lanes to the lower eight and goes on
/// as [`dots_avx2`] does: the same FMAs and adds in the same order, the same bits.
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA, and every row and input must have the same length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn dots_avx512<W: Widen, const R: usize, const M: usize>(
    rows: [&[W]; R],
    xs: [&[f32]; M],
    prefetch: bool,
) -> [[f32; M]; R] {
    use std::arch::x86_64::*;
    let k = xs[0].len();
    let body = k - k % LANES;
    let ahead = PREFETCH_AHEAD_BYTES / std::mem::size_of::<W>();
    let mut acc = [[_mm512_setzero_ps(); M]; R];
    let mut j = 0;
    while j < body {
        if prefetch {
            prefetch_rows(&rows, j + ahead);
        }
        // SAFETY: j + LANES <= body <= k, every slice's length.
        unsafe {
            let x: [__m512; M] = std::array::from_fn(|i| _mm512_loadu_ps(xs[i].as_ptr().add(j)));
            for r in 0..R {
                let w = W::load16(rows[r].as_ptr().add(j));
                for i in 0..M {
                    acc[r][i] = _mm512_fmadd_ps(w, x[i], acc[r][i]);
                }
            }
        }
        j += LANES;
    }
    let mut out = [[0.0f32; M]; R];
    for r in 0..R {
        for i in 0..M {
            // v[l] += v[l+8] (the upper eight lanes onto the lower), then the rest.
            let v = acc[r][i];
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            // SAFETY: the CPU has AVX-512F (this function's contract).
            let sum = unsafe { lane_tree8(_mm256_add_ps(_mm512_castps512_ps256(v), hi)) };
            out[r][i] = sum + tail_dot(rows[r], xs[i], body);
        }
    }
    out
}

/// [`dots`] in plain Rust: the definition of the order.
#[inline(always)]
fn dots_portable<W: Widen, const R: usize, const M: usize>(
    rows: [&[W]; R],
    xs: [&[f32]; M],
    prefetch: bool,
) -> [[f32; M]; R] {
    let k = xs[0].len();
    let body = k - k % LANES;
    let ahead = PREFETCH_AHEAD_BYTES / std::mem::size_of::<W>();
    let mut acc = [[[0.0f32; LANES]; M]; R];
    let mut j = 0;
    while j < body {
        if prefetch {
            prefetch_rows(&rows, j + ahead);
        }
        for r in 0..R {
            for i in 0..M {
                for l in 0..LANES {
                    acc[r][i][l] = rows[r][j + l].widen().mul_add(xs[i][j + l], acc[r][i][l]);
                }
            }
        }
        j += LANES;
    }
    let mut out = [[0.0f32; M]; R];
    for r in 0..R {
        for i in 0..M {
            out[r][i] = lane_sum(acc[r][i]) + tail_dot(rows[r], xs[i], body);
        }
    }
    out
}

/// Asks for the cache line `at` elements into each row (see [`prefetch_l2`]).
#[inline(always)]
fn prefetch_rows<W>(rows: &[&[W]], at: usize) {
    for row in rows {
        prefetch_l2(row.as_ptr().wrapping_add(at).cast());
    }
}

/// Σ row[t]·x[t] for t from `body` to the end, one chain in order: the tail of every dot.
#[inline(always)]
fn tail_dot<W: Widen>(row: &[W], x: &[f32], body: usize) -> f32 {
    row[body..].iter().zip(&x[body..]).fold(0.0f32, |acc, (w, v)| w.widen().mul_add(*v, acc))
}

/// Σ of the lanes as a fixed tree (halves added pairwise), which vectorises.
#[inline(always)]
fn lane_sum(mut v: [f32; LANES]) -> f32 {
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for l in 0..n {
            v[l] += v[l + n];
        }
    }
    v[0]
}

simd_fn! {
    /// Σ a_i·b_i (in the kernels' canonical order).
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        dots::<f32, 1, 1>([&a[..n]], [&b[..n]], false)[0][0]
    }
}

/// Weight rows per block of the one-input kernel: four chains hide the FMA latency.
const MATVEC_ROWS: usize = 4;

/// out[r] (+)= dot(w[r·k .. (r+1)·k], x) for each row r of `w`.
#[inline(always)]
fn matvec_body<W: Widen>(w: &[W], x: &[f32], out: &mut [f32], accumulate: bool) {
    let k = x.len();
    let store = |o: &mut f32, v: f32| *o = if accumulate { *o + v } else { v };
    let mut blocks = out.chunks_exact_mut(MATVEC_ROWS);
    let mut r = 0;
    for o in &mut blocks {
        let rows = std::array::from_fn(|b| &w[(r + b) * k..(r + b + 1) * k]);
        let v = dots::<W, MATVEC_ROWS, 1>(rows, [x], true);
        o.iter_mut().zip(v).for_each(|(o, v)| store(o, v[0]));
        r += MATVEC_ROWS;
    }
    for o in blocks.into_remainder() {
        store(o, dots::<W, 1, 1>([&w[r * k..(r + 1) * k]], [x], true)[0][0]);
        r += 1;
    }
}

/// Weight rows and inputs per block of the many-input kernel, with AVX2: 3 × 2 dots keep 12
/// registers of accumulators (two each), and each input load serves three rows, which keeps
/// the inputs' traffic from L2 (16 inputs overflow L1) below the FMA rate. Measured against
/// 2 × 3, 4 × 1 and 4 × 2 with `cargo bench -p picaso-model --bench matvecs` (BENCHMARKS.md).
const BATCH_AVX2: (usize, usize) = (3, 2);
/// The same with AVX-512: 4 × 4 dots in 16 of the 32 registers (one each). Measured against
/// 3 × 2, 4 × 2, 4 × 3, 3 × 4, 6 × 2, 6 × 3, 8 × 2 and 2 × 4 on a Zen 4 (BENCHMARKS.md).
const BATCH_AVX512: (usize, usize) = (4, 4);

/// The same with [`Blocking::Halves`]: 2 × 4 dots in 8 registers, 4 inputs and a weight in 5.
const BATCH_AVX2_HALVES: (usize, usize) = (2, 4);

/// The (weight rows, inputs) of a block of the many-input kernel on this CPU.
#[inline(always)]
fn block_shape(blocking: Blocking) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        return BATCH_AVX512;
    }
    match blocking {
        Blocking::Pairs => BATCH_AVX2,
        Blocking::Halves => BATCH_AVX2_HALVES,
    }
}

/// out_t[r·m + i] = dot(w row r, x row i) for the m rows of `x`: each weight row is read from
/// memory once (then from L1) for all m inputs.
#[inline(always)]
fn matvecs_body<W: Widen>(w: &[W], x: &[f32], k: usize, out_t: &mut [f32], blocking: Blocking) {
    let (block_rows, block_inputs) = block_shape(blocking);
    let m = x.len() / k;
    let n = out_t.len() / m;
    let mut r = 0;
    while r < n {
        let rows = block_rows.min(n - r);
        let mut i = 0;
        while i < m {
            let inputs = block_inputs.min(m - i);
            // Full blocks and the edges (smaller blocks of the same order).
            macro_rules! by_shape {
                ($(($r:literal, $c:literal)),*) => {
                    match (rows, inputs) {
                        $(($r, $c) => block::<W, $r, $c>(w, x, k, r, i, m, out_t, blocking),)*
                        _ => unreachable!("blocks are at most 4 × 4"),
                    }
                };
            }
            by_shape!(
                (1, 1),
                (1, 2),
                (1, 3),
                (1, 4),
                (2, 1),
                (2, 2),
                (2, 3),
                (2, 4),
                (3, 1),
                (3, 2),
                (3, 3),
                (3, 4),
                (4, 1),
                (4, 2),
                (4, 3),
                (4, 4)
            );
            i += inputs;
        }
        r += rows;
    }
}

/// out_t[(r0+b)·m + i0+c] = dot(w row r0+b, x row i0+c) for an R × M block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn block<W: Widen, const R: usize, const M: usize>(
    w: &[W],
    x: &[f32],
    k: usize,
    r0: usize,
    i0: usize,
    m: usize,
    out_t: &mut [f32],
    blocking: Blocking,
) {
    let v = dots_batch::<W, R, M>(
        std::array::from_fn(|b| &w[(r0 + b) * k..(r0 + b + 1) * k]),
        std::array::from_fn(|c| &x[(i0 + c) * k..(i0 + c + 1) * k]),
        i0 == 0,
        blocking,
    );
    for (b, vr) in v.iter().enumerate() {
        out_t[(r0 + b) * m + i0..(r0 + b) * m + i0 + M].copy_from_slice(vr);
    }
}

simd_fn! {
    /// [`matvecs_body`] for f32 `w`.
    pub fn matvecs_rows(w: &[f32], x: &[f32], k: usize, out_t: &mut [f32]) {
        matvecs_body(w, x, k, out_t, Blocking::Pairs)
    }
}

/// From this many inputs on, [`matvecs_rows_bf16`] widens each block of weight rows to f32 once
/// and runs the f32 kernel on it for all inputs, instead of widening every weight again for each
/// block of inputs (8 times for 16 inputs on AVX2), whose shifts and zero-extensions compete with
/// the multiply-adds for the vector units. A decode step's products on an AMD EPYC Zen 1 (AVX2):
/// 1.13× at 8 inputs, 1.38× at 16, 1.52× at 32; even at 6; ~0.85× at 4, where the step is
/// bound by memory and the widening loop lacks the kernel's prefetch (BENCHMARKS.md).
const WIDEN_ONCE_MIN_INPUTS: usize = 8;

/// From this many inputs up to [`WIDEN_ONCE_MIN_INPUTS`], bf16 products on AVX2 run in
/// [`Blocking::Halves`]: blocks of four inputs widen each weight once per four instead of per
/// two. A decode step's products on Zen 1: 1.24× at 4 inputs, 1.09× at 6; at 2, 0.83× (a 2 × 2
/// block loads a register per multiply-add), and at 8 widening once wins (BENCHMARKS.md).
const HALVES_MIN_INPUTS: usize = 4;

simd_fn! {
    /// [`matvecs_body`] for bf16 `w` (stored as bits). Widening is exact, so the bits are those
    /// of the f32 kernel on the widened weights whichever way it runs.
    pub fn matvecs_rows_bf16(w: &[u16], x: &[f32], k: usize, out_t: &mut [f32]) {
        let m = x.len() / k;
        if m < WIDEN_ONCE_MIN_INPUTS {
            let blocking = if m >= HALVES_MIN_INPUTS { Blocking::Halves } else { Blocking::Pairs };
            return matvecs_body(w, x, k, out_t, blocking);
        }
        let rows = block_shape(Blocking::Pairs).0;
        with_scratch(&PANEL, rows * k, |panel| {
            for (w, out_t) in w.chunks(rows * k).zip(out_t.chunks_mut(rows * m)) {
                let panel = &mut panel[..w.len()];
                panel.iter_mut().zip(w).for_each(|(p, b)| *p = b.widen());
                matvecs_body(panel, x, k, out_t, Blocking::Pairs);
            }
        })
    }
}

simd_fn! {
    /// out[r] (+)= dot(w[r·k .. (r+1)·k], x) for each row r of f32 `w`.
    pub fn matvec_rows(w: &[f32], x: &[f32], out: &mut [f32], accumulate: bool) {
        matvec_body(w, x, out, accumulate)
    }
}

simd_fn! {
    /// As [`matvec_rows`] with `w` in bf16 (stored as bits).
    pub fn matvec_rows_bf16(w: &[u16], x: &[f32], out: &mut [f32], accumulate: bool) {
        matvec_body(w, x, out, accumulate)
    }
}

/// How far ahead the matrix-vector kernel prefetches.
const PREFETCH_AHEAD_BYTES: usize = 8192;

/// How bf16 weights are multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Kernel {
    /// AMX tiles (`tdpbf16ps`) for every product of the pair layout, decode steps included.
    Tiles,
    /// With the CPU's bf16 dot-product instruction (AVX512-BF16), inputs rounded to bf16.
    Dot,
    /// As `Dot`, with 8 rows or more at once on f32 FMAs that give the instruction's bits: Intel
    /// cores that run the instruction at half the FMAs' rate ([`bf16_dot::fma_gives_dot_bits`]).
    DotFma,
    /// Weights widened to f32 in registers, all arithmetic in f32 (any CPU).
    Widen,
}

impl Bf16Kernel {
    /// The fastest this CPU has: `Tiles` with AMX-BF16, `DotFma` or `Dot` with AVX512-BF16,
    /// else `Widen`. `PICASO_BF16_KERNEL=dot-fma`, `=dot` or `=widen` picks a slower one (to
    /// compare, or to keep inputs in f32); a kernel the CPU lacks falls back to the next.
    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Bf16Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            let asked = std::env::var("PICASO_BF16_KERNEL").unwrap_or_default().to_ascii_lowercase();
            // The kernels allowed, fastest first: anything asked for leaves out those above it.
            let (tiles, dot_fma, dot) = match asked.as_str() {
                "widen" => (false, false, false),
                "dot" => (false, false, true),
                "dot-fma" => (false, true, true),
                _ => (true, true, true),
            };
            if tiles && bf16_tiles::available() {
                Bf16Kernel::Tiles
            } else if dot_fma && bf16_dot::fma_gives_dot_bits() {
                Bf16Kernel::DotFma
            } else if dot && bf16_dot::available() {
                Bf16Kernel::Dot
            } else {
                Bf16Kernel::Widen
            }
        })
    }

    /// The name benchmarks report.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Tiles => "amx-tiles",
            Bf16Kernel::Dot => "avx512bf16-dot",
            Bf16Kernel::DotFma => "avx512bf16-dot+fma",
            Bf16Kernel::Widen => "widen-to-f32",
        }
    }
}

/// A weight matrix (rows × cols, row-major, as PyTorch stores Linear weights) in f32 or bf16.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values as their 16-bit patterns, widened to f32 by the kernels.
    Bf16(Vec<u16>),
    /// bf16 values in the layout of the CPU's bf16 dot-product instruction.
    Bf16Pairs(PairedBf16),
}

impl Matrix {
    /// Stores `v` (rows of `cols` values) in `dtype` (bf16 rounds to nearest even), for the bf16
    /// kernel this CPU runs best ([`Bf16Kernel::detect`]).
    pub fn new(v: Vec<f32>, cols: usize, dtype: super::WeightDtype) -> Self {
        Self::with_kernel(v, cols, dtype, Bf16Kernel::detect())
    }

    /// As [`Matrix::new`] for a chosen bf16 kernel (`Dot` also runs, more slowly, without the
    /// instruction).
    pub fn with_kernel(v: Vec<f32>, cols: usize, dtype: super::WeightDtype, kernel: Bf16Kernel) -> Self {
        assert!(cols > 0 && v.len().is_multiple_of(cols), "Matrix: {} values are not rows of {cols}", v.len());
        match (dtype, kernel) {
            (super::WeightDtype::F32, _) => Matrix::F32(v),
            (super::WeightDtype::Bf16, Bf16Kernel::Widen) => {
                // On huge pages, as the f32 weights are (decode streams every one).
                let mut bits = crate::memory::big_vec(v.len(), 0u16);
                bits.par_iter_mut().zip(&v).for_each(|(b, &x)| *b = bf16_dot::to_bf16(x));
                Matrix::Bf16(bits)
            }
            (super::WeightDtype::Bf16, kernel @ (Bf16Kernel::Dot | Bf16Kernel::DotFma | Bf16Kernel::Tiles)) => {
                Matrix::Bf16Pairs(
                    PairedBf16::from_f32(&v, v.len() / cols, cols)
                        .with_tiles(kernel == Bf16Kernel::Tiles)
                        .with_fma(kernel == Bf16Kernel::DotFma),
                )
            }
        }
    }

    /// Whether a product gives each input row the same bits whatever other rows it shares the
    /// product with (true of the pair layout: every output is one chain over the pairs in order,
    /// on AMX tiles where present, else on `vdpbf16ps`, for one row or many). gemm's blocking,
    /// used for f32 and widened bf16, depends on the number of rows.
    pub fn batch_invariant(&self) -> bool {
        matches!(self, Matrix::Bf16Pairs(_))
    }

    fn len(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len(),
            Matrix::Bf16(v) => v.len(),
            Matrix::Bf16Pairs(p) => p.rows() * p.cols(),
        }
    }

    /// Copies row `r` (of `out.len()` columns) into `out` as f32.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = out.len();
        match self {
            Matrix::F32(v) => out.copy_from_slice(&v[r * k..(r + 1) * k]),
            Matrix::Bf16(v) => out.iter_mut().zip(&v[r * k..(r + 1) * k]).for_each(|(o, b)| *o = b.widen()),
            Matrix::Bf16Pairs(p) => p.row_into(r, out),
        }
    }
}

/// Up to this many rows, [`matmul_t`] multiplies with the matrix-vector kernel of
/// [`matmul_rows_t`] rather than gemm: on mamba2-130m's in_proj the two are even at 128 rows and
/// gemm wins from 256; on out_proj the kernel stays ahead (`cargo bench -p picaso-model --bench
/// matvecs`, BENCHMARKS.md).
pub const ROWS_KERNEL_MAX: usize = 128;

/// out (m×n) (+)= x (m×k) · wᵀ, with w stored (n×k) row-major as in PyTorch checkpoints.
/// One row of x uses a bandwidth-bound matrix-vector kernel, up to [`ROWS_KERNEL_MAX`] rows
/// its many-input form; more use gemm (bf16 weights are widened to f32 one L2-sized tile of
/// rows at a time). The bf16 pair layout runs on AMX tiles from two rows where the CPU has
/// them, else on `vdpbf16ps`.
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: &Matrix, n: usize, out: &mut [f32], accumulate: bool) {
    assert_eq!(x.len(), m * k, "matmul_t: x is not m×k");
    assert_eq!(w.len(), n * k, "matmul_t: w is not n×k");
    assert_eq!(out.len(), m * n, "matmul_t: out is not m×n");
    // Eight tasks per thread balance the cores; at least 64 rows per task keeps scheduling
    // overhead negligible (the LM head would otherwise be ~800 tiny tasks per token).
    let rows = (n / (8 * rayon::current_num_threads())).max(64);
    match w {
        Matrix::F32(w) if m == 1 => out.par_chunks_mut(rows).enumerate().for_each(|(i, o)| {
            matvec_rows(&w[i * rows * k..(i * rows + o.len()) * k], x, o, accumulate);
        }),
        Matrix::Bf16(w) if m == 1 => out.par_chunks_mut(rows).enumerate().for_each(|(i, o)| {
            matvec_rows_bf16(&w[i * rows * k..(i * rows + o.len()) * k], x, o, accumulate);
        }),
        // A few rows: the matrix-vector kernel reads each weight once for all of them, while
        // gemm packs the weights on every call (BENCHMARKS.md: 2× faster at 32 rows).
        Matrix::F32(_) | Matrix::Bf16(_) if m <= ROWS_KERNEL_MAX => matmul_rows_t(x, m, k, w, n, out, accumulate),
        Matrix::F32(w) => gemm_t(x, m, k, w, n, 0, out, n, accumulate),
        Matrix::Bf16Pairs(w) => {
            assert_eq!((w.rows(), w.cols()), (n, k), "matmul_t: w is not n×k");
            w.matmul_t_tiles(x, m, out, accumulate)
        }
        Matrix::Bf16(w) => {
            const TILE: usize = 256;
            let mut tile = vec![0.0f32; TILE.min(n) * k];
            for start in (0..n).step_by(TILE) {
                let rows = TILE.min(n - start);
                let t = &mut tile[..rows * k];
                t.par_chunks_mut(k).zip(w[start * k..(start + rows) * k].par_chunks(k)).for_each(|(dst, src)| {
                    dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.widen());
                });
                gemm_t(x, m, k, t, rows, start, out, n, accumulate);
            }
        }
    }
}

/// out (m×n) (+)= x (m×k) · wᵀ as m independent matrix-vector products: each output equals,
/// to the bit, what [`matmul_t`] gives that row alone (m = 1), so a batch of decode steps
/// gives each sequence exactly its unbatched result. Each weight is read once for all rows.
pub fn matmul_rows_t(x: &[f32], m: usize, k: usize, w: &Matrix, n: usize, out: &mut [f32], accumulate: bool) {
    // The pair layout's outputs (on tiles or `vdpbf16ps`) do not depend on the rows computed
    // together.
    if let Matrix::Bf16Pairs(p) = w {
        return p.matmul_t_tiles(x, m, out, accumulate);
    }
    if m == 1 {
        return matmul_t(x, m, k, w, n, out, accumulate);
    }
    assert_eq!(x.len(), m * k, "matmul_rows_t: x is not m×k");
    assert_eq!(w.len(), n * k, "matmul_rows_t: w is not n×k");
    assert_eq!(out.len(), m * n, "matmul_rows_t: out is not m×n");
    let rows = (n / (8 * rayon::current_num_threads())).max(16);
    // Transposed (n × m) so that each task writes one contiguous block.
    with_scratch(&OUT_T, n * m, |out_t| {
        match w {
            Matrix::F32(w) => out_t.par_chunks_mut(rows * m).enumerate().for_each(|(i, o)| {
                matvecs_rows(&w[i * rows * k..(i * rows + o.len() / m) * k], x, k, o);
            }),
            Matrix::Bf16(w) => out_t.par_chunks_mut(rows * m).enumerate().for_each(|(i, o)| {
                matvecs_rows_bf16(&w[i * rows * k..(i * rows + o.len() / m) * k], x, k, o);
            }),
            Matrix::Bf16Pairs(_) => unreachable!("handled above"),
        }
        for (r, col) in out_t.chunks_exact(m).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                let o = &mut out[i * n + r];
                *o = if accumulate { *o + v } else { v };
            }
        }
    })
}

thread_local! {
    /// [`matmul_rows_t`]'s transposed outputs, as large as the largest call's: up to 25.7 MB on
    /// the thread that runs a forward pass (mamba2-130m's LM head for 128 rows of scoring).
    static OUT_T: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    /// [`matvecs_rows_bf16`]'s block of widened weight rows (9–24 KiB).
    static PANEL: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of this thread's `buffer`, kept between calls: buffers allocated
/// per call were returned to the system and faulted in again on the next, page by page (a
/// decode step's products of 8 sequences took 1.6× as long, depending on what the allocator
/// had cached). Re-entrant: a nested call (a pool thread that steals a task while it waits)
/// finds the buffer taken and uses a fresh one.
fn with_scratch<R>(
    buffer: &'static std::thread::LocalKey<Cell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    let mut v = buffer.take();
    v.clear();
    v.resize(len, 0.0);
    let r = f(&mut v);
    buffer.set(v);
    r
}

/// dst (m×n, rows `dst_rs` apart) = beta · lhs (m×k, rows `lhs_rs` apart) · rhs (k×n), where
/// rhs's element (r, c) is `rhs[r·rhs_rs + c·rhs_cs]`: any strided view, such as the transpose
/// of interleaved keys. On the calling thread: callers run many at once.
#[allow(clippy::too_many_arguments)]
pub fn matmul_strided(
    (m, k, n): (usize, usize, usize),
    lhs: &[f32],
    lhs_rs: usize,
    rhs: &[f32],
    (rhs_rs, rhs_cs): (usize, usize),
    beta: f32,
    dst: &mut [f32],
    dst_rs: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        (0..m).for_each(|i| dst[i * dst_rs..i * dst_rs + n].fill(0.0));
        return;
    }
    assert!(lhs_rs >= k && dst_rs >= n, "matmul_strided: rows overlap");
    assert!(lhs.len() >= (m - 1) * lhs_rs + k, "matmul_strided: lhs is not m×k");
    assert!(rhs.len() > (k - 1) * rhs_rs + (n - 1) * rhs_cs, "matmul_strided: rhs is not k×n");
    assert!(dst.len() >= (m - 1) * dst_rs + n, "matmul_strided: dst is not m×n");
    // SAFETY: the asserts keep every strided access inside the slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            lhs.as_ptr(),
            1,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// out[:, col0 .. col0+n] (+)= x (m×k) · wᵀ for w (n×k); `out` has `ld` columns.
#[allow(clippy::too_many_arguments)]
fn gemm_t(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    col0: usize,
    out: &mut [f32],
    ld: usize,
    accumulate: bool,
) {
    assert!(w.len() == n * k && col0 + n <= ld && out.len() == m * ld);
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the assert above and matmul_t's keep every strided access inside the slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr().add(col0),
            1,
            ld as isize,
            accumulate,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_strided_product_equals_the_naive_one() {
        // rhs read as the transpose of interleaved rows: (r, c) at c·stride + 3 + r.
        let (m, k, n, stride) = (5, 7, 9, 11);
        let lhs: Vec<f32> = (0..m * 8).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
        let rhs: Vec<f32> = (0..n * stride + 3).map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0).collect();
        let mut dst = vec![7.0f32; m * 10];
        matmul_strided((m, k, n), &lhs, 8, &rhs[3..], (1, stride), 0.5, &mut dst, 10);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = 0.5 * (0..k).map(|r| lhs[i * 8 + r] * rhs[3 + j * stride + r]).sum::<f32>();
                assert!((dst[i * 10 + j] - want).abs() < 1e-5, "({i}, {j}): {} vs {want}", dst[i * 10 + j]);
            }
            assert!(dst[i * 10 + n..i * 10 + 10].iter().all(|&x| x == 7.0), "beyond n is left alone");
        }
    }

    #[test]
    fn matvec_equals_gemm_and_naive() {
        // A few rows take the many-input kernel, more take gemm: both equal the naive product.
        for m in [3, ROWS_KERNEL_MAX + 2] {
            let (k, n) = (70, 37);
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0).collect();
            let naive: Vec<f32> = (0..m * n)
                .map(|ij| {
                    let (i, j) = (ij / n, ij % n);
                    (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum()
                })
                .collect();
            let mut g = vec![1.0; m * n];
            matmul_t(&x, m, k, &Matrix::F32(w.clone()), n, &mut g, false);
            for r in 0..m {
                let mut v = vec![0.0; n];
                matmul_t(&x[r * k..(r + 1) * k], 1, k, &Matrix::F32(w.clone()), n, &mut v, false);
                for j in 0..n {
                    assert!((v[j] - naive[r * n + j]).abs() < 1e-4);
                    assert!((g[r * n + j] - naive[r * n + j]).abs() < 1e-4, "m = {m}");
                }
            }
            let mut acc = vec![1.0; m * n];
            matmul_t(&x, m, k, &Matrix::F32(w.clone()), n, &mut acc, true);
            assert!((acc[5] - 1.0 - naive[5]).abs() < 1e-4);
            assert!((acc[m * n - 1] - 1.0 - naive[m * n - 1]).abs() < 1e-4, "m = {m}");
        }
    }

    #[test]
    fn rows_of_a_batch_equal_lone_rows_to_the_bit() {
        // Every block shape the batch kernel takes (full blocks, row and input edges, a tail
        // past the last whole LANES) gives each row what a lone matrix-vector product gives.
        for (k, n) in [(70, 37), (64, 8), (15, 5)] {
            let w: Vec<f32> = (0..n * k).map(|i| (((i * 7919) % 1013) as f32 - 506.0) / 333.0).collect();
            use crate::cpu::WeightDtype::{Bf16, F32};
            for matrix in [
                Matrix::new(w.clone(), k, F32),
                Matrix::with_kernel(w.clone(), k, Bf16, Bf16Kernel::Widen),
                Matrix::with_kernel(w.clone(), k, Bf16, Bf16Kernel::Dot),
                Matrix::with_kernel(w, k, Bf16, Bf16Kernel::DotFma),
            ] {
                // The dot-product kernel rounds its inputs to bf16.
                let input = |v: f32| match matrix {
                    Matrix::Bf16Pairs(_) => half::bf16::from_f32(v).to_f32(),
                    _ => v,
                };
                // bf16 rows run in halves from 4 inputs on (HALVES_MIN_INPUTS) and are widened
                // once per block from 8 (WIDEN_ONCE_MIN_INPUTS).
                for m in 1..=10 {
                    let x: Vec<f32> = (0..m * k).map(|i| (((i * 104_729) % 997) as f32 - 498.0) / 211.0).collect();
                    let mut batch = vec![0.5; m * n];
                    matmul_rows_t(&x, m, k, &matrix, n, &mut batch, true);
                    for i in 0..m {
                        let mut lone = vec![0.5; n];
                        matmul_t(&x[i * k..(i + 1) * k], 1, k, &matrix, n, &mut lone, true);
                        let got: Vec<u32> = batch[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                        let want: Vec<u32> = lone.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "k {k}, n {n}, m {m}, row {i}");
                        let mut naive = vec![0.0f32; n];
                        let mut wr = vec![0.0f32; k];
                        for (r, o) in naive.iter_mut().enumerate() {
                            matrix.row_into(r, &mut wr);
                            *o = 0.5 + wr.iter().zip(&x[i * k..(i + 1) * k]).map(|(a, b)| a * input(*b)).sum::<f32>();
                        }
                        for (a, b) in lone.iter().zip(&naive) {
                            assert!((a - b).abs() < 1e-3 * (1.0 + b.abs()), "{a} vs {b}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_nested_scratch_call_gets_its_own_buffer() {
        thread_local! {
            static BUF: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
        }
        let outer = with_scratch(&BUF, 3, |a| {
            a.fill(1.0);
            let inner = with_scratch(&BUF, 5, |b| {
                assert_eq!(b, &[0.0; 5], "a nested call starts from zeros");
                b.fill(2.0);
                b.iter().sum::<f32>()
            });
            assert_eq!(a, &[1.0; 3], "the nested call left the outer buffer alone");
            inner + a.iter().sum::<f32>()
        });
        assert_eq!(outer, 13.0);
        with_scratch(&BUF, 4, |c| assert_eq!(c, &[0.0; 4], "a kept buffer is cleared"));
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_avx2_and_avx512_dots_equal_the_portable_definition_to_the_bit() {
        if !has_avx2_fma() {
            return;
        }
        for k in [1usize, 15, 16, 17, 64, 70, 771] {
            let w: Vec<f32> = (0..2 * k).map(|i| (((i * 7919) % 1013) as f32 - 506.0) / 333.0).collect();
            let wb: Vec<u16> = w.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let x: Vec<f32> = (0..3 * k).map(|i| (((i * 104_729) % 997) as f32 - 498.0) / 211.0).collect();
            let rows = [&w[..k], &w[k..]];
            let rows_b = [&wb[..k], &wb[k..]];
            let xs = [&x[..k], &x[k..2 * k], &x[2 * k..]];
            // SAFETY: AVX2 and FMA were detected; the slices have equal lengths.
            let (fast, fast_b) = unsafe { (dots_avx2(rows, xs, true), dots_avx2(rows_b, xs, false)) };
            let bits = |v: [[f32; 3]; 2]| v.map(|r| r.map(f32::to_bits));
            assert_eq!(bits(fast), bits(dots_portable(rows, xs, false)), "f32, k {k}");
            assert_eq!(bits(fast_b), bits(dots_portable(rows_b, xs, true)), "bf16, k {k}");
            // SAFETY: as above.
            let (halves, halves_b) = unsafe { (dots_avx2_halves(rows, xs, true), dots_avx2_halves(rows_b, xs, false)) };
            assert_eq!(bits(halves), bits(fast), "halves, f32, k {k}");
            assert_eq!(bits(halves_b), bits(fast_b), "halves, bf16, k {k}");
            if has_avx512() {
                // SAFETY: AVX-512F was detected; the slices have equal lengths.
                let (wide, wide_b) = unsafe { (dots_avx512(rows, xs, true), dots_avx512(rows_b, xs, false)) };
                assert_eq!(bits(wide), bits(fast), "AVX-512, f32, k {k}");
                assert_eq!(bits(wide_b), bits(fast_b), "AVX-512, bf16, k {k}");
            }
        }
    }
}
