//! General bf16 matrix products for the trainer: `c (+)= bf16(a) · bf16(b)` with f32
//! accumulation, for operands read through strides — the three orientations of a linear layer
//! (`x·wᵀ`, `dy·w`, `dyᵀ·x`). Both operands are rounded and packed into the layouts of
//! [`super::bf16_dot`] on every call (the trainer's weights change every step), then multiplied
//! on AMX tiles where the CPU has them, else with `vdpbf16ps`.
//!
//! Packing is the price of generality, so it is vectorised both ways: when a row's reduction
//! values are adjacent (`x`, `dy` as the left operand) a row is rounded 32 values at a time;
//! when 16 rows are adjacent (`dyᵀ`, `xᵀ`) one column pair of 16 rows is rounded and interleaved
//! per instruction and the 16 × 16 block transposed. A product whose left operand is a
//! transpose is computed as its own transpose where that packs fewer transposed values.

use rayon::prelude::*;

use super::bf16_dot::{self, pair_of, round_input, tile_rows, PairedBf16, BLOCK};
use super::bf16_tiles;
use super::Bf16Kernel;

/// An f32 matrix read through strides: element (r, c) at `data[r * rs + c * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    /// The values.
    pub data: &'a [f32],
    /// Stride between rows.
    pub rs: usize,
    /// Stride between columns.
    pub cs: usize,
}

impl<'a> Strided<'a> {
    /// A row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self { data, rs: cols, cs: 1 }
    }

    /// Its transpose (no copy).
    pub fn t(self) -> Self {
        Self { data: self.data, rs: self.cs, cs: self.rs }
    }

    fn at(&self, r: usize, c: usize) -> f32 {
        self.data[r * self.rs + c * self.cs]
    }

    /// Whether a `rows` × `cols` matrix fits in `data`.
    pub fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || self.data.len() > (rows - 1) * self.rs + (cols - 1) * self.cs
    }
}

/// Whether this CPU multiplies bf16 in hardware (AVX512-BF16, and AMX tiles where present).
pub fn available() -> bool {
    bf16_dot::available()
}

/// c (m × n, row-major) = bf16(a) (m × k) · bf16(b) (k × n), or += with `accumulate`; sums in
/// f32, on AMX tiles when `kernel` is [`Bf16Kernel::Tiles`] (and the CPU has them), else with
/// `vdpbf16ps`. Each output is one chain over k in order: the result depends neither on the
/// thread count nor on m.
///
/// # Panics
/// If the CPU lacks AVX512-BF16 ([`available`]), `kernel` is [`Bf16Kernel::Widen`], or an
/// operand is smaller than its shape.
#[allow(clippy::too_many_arguments)]
pub fn gemm(kernel: Bf16Kernel, m: usize, n: usize, k: usize, c: &mut [f32], accumulate: bool, a: Strided, b: Strided) {
    assert!(available() && kernel != Bf16Kernel::Widen, "bf16_gemm::gemm: this CPU has no AVX512-BF16");
    let tiles = kernel == Bf16Kernel::Tiles && bf16_tiles::available();
    assert!(
        c.len() >= m * n && a.fits(m, k) && b.fits(k, n),
        "bf16_gemm::gemm: an operand is smaller than {m}×{k}·{k}×{n}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    // Values packed, weighting a transposing pack (a left operand whose rows are not
    // contiguous, or a right operand whose columns are not) twice.
    let cost = |a: Strided, b: Strided, m: usize, n: usize| {
        (if a.cs == 1 { 1 } else { 2 }) * m * k + (if b.rs == 1 { 1 } else { 2 }) * k * n
    };
    if cost(b.t(), a.t(), n, m) + 2 * m * n < cost(a, b, m, n) {
        // cᵀ = bᵀ · aᵀ, then added into c transposed.
        let mut ct = vec![0f32; n * m];
        product(tiles, n, m, k, &mut ct, false, b.t(), a.t());
        c[..m * n].par_chunks_mut(n).enumerate().for_each(|(i, row)| {
            for (j, o) in row.iter_mut().enumerate() {
                let v = ct[j * m + i];
                *o = if accumulate { *o + v } else { v };
            }
        });
        return;
    }
    product(tiles, m, n, k, c, accumulate, a, b);
}

/// [`gemm`] for k, m, n ≥ 1, in the orientation given.
#[allow(clippy::too_many_arguments)]
fn product(tiles: bool, m: usize, n: usize, k: usize, c: &mut [f32], accumulate: bool, a: Strided, b: Strided) {
    let tiles = tiles && m >= 2;
    let kp_pad = k.div_ceil(2).next_multiple_of(bf16_tiles::TILE);
    let w = PairedBf16::from_blocks(pack_blocks(b.t(), n, k, kp_pad), n, k, kp_pad).with_tiles(tiles);
    #[cfg(target_arch = "x86_64")]
    {
        if tiles {
            let xp = pack_rows(a, m, k, kp_pad, tile_rows(m));
            return w.run_tiles_packed(&xp, m, c, accumulate);
        }
        let xp = pack_rows(a, m, k, k.div_ceil(2), m);
        w.run_avx512(&xp, m, c, accumulate)
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("gemm asserts AVX512-BF16")
}

/// The rows of `a` (m × k) as bf16 pairs, `stride` pairs apart, `rows` rows (≥ m; the rest
/// zero): [`bf16_dot`]'s input layout. Any CPU (the vectorised ways need AVX512-BF16).
pub(super) fn pack_rows(a: Strided, m: usize, k: usize, stride: usize, rows: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut xp = vec![0u32; rows * stride];
    #[cfg(target_arch = "x86_64")]
    if a.cs == 1 && available() {
        xp.par_chunks_mut(stride).take(m).enumerate().for_each(|(i, dst)| {
            // SAFETY: the CPU has AVX512-BF16; row i has k values in a.data (the caller's
            // shape) and dst kp pairs.
            unsafe { bf16_dot::pack_row_avx512(&a.data[i * a.rs..i * a.rs + k], &mut dst[..kp]) }
        });
        return xp;
    } else if a.rs == 1 && available() {
        // 16 adjacent rows at a time: one column pair of the 16 per instruction, then the
        // 16 pairs × 16 rows block transposed into the rows.
        xp.par_chunks_mut(BLOCK * stride).take(m.div_ceil(BLOCK)).enumerate().for_each(|(blk, dst)| {
            let (i0, valid) = (blk * BLOCK, (m - blk * BLOCK).min(BLOCK));
            let mut t = [[0u32; BLOCK]; BLOCK];
            for p0 in (0..kp).step_by(BLOCK) {
                let np = (kp - p0).min(BLOCK);
                for (pp, lanes) in t.iter_mut().enumerate().take(np) {
                    // SAFETY: as lane_pairs asks: rows i0..i0+valid of columns 2p, 2p+1 (< k).
                    unsafe { lane_pairs(a, i0, valid, 2 * (p0 + pp), k, lanes) };
                }
                for (lane, row) in dst.chunks_mut(stride).take(valid).enumerate() {
                    for (pp, lanes) in t.iter().enumerate().take(np) {
                        row[p0 + pp] = lanes[lane];
                    }
                }
            }
        });
        return xp;
    }
    xp.par_chunks_mut(stride).take(m).enumerate().for_each(|(i, dst)| {
        for (p, d) in dst[..kp].iter_mut().enumerate() {
            let two = [a.at(i, 2 * p), if 2 * p + 1 < k { a.at(i, 2 * p + 1) } else { 0.0 }];
            *d = pair_of(&two, round_input);
        }
    });
    xp
}

/// The rows of `w` (n outputs × k) in [`PairedBf16`]'s blocks of 16 outputs, `kp_pad` pairs
/// each (padding zero).
fn pack_blocks(w: Strided, n: usize, k: usize, kp_pad: usize) -> Vec<u32> {
    let kp = k.div_ceil(2);
    let mut pairs = vec![0u32; n.div_ceil(BLOCK) * kp_pad * BLOCK];
    pairs.par_chunks_mut(kp_pad * BLOCK).enumerate().for_each(|(b, block)| {
        let (j0, valid) = (b * BLOCK, (n - b * BLOCK).min(BLOCK));
        #[cfg(target_arch = "x86_64")]
        if w.rs == 1 && available() {
            // The 16 outputs are adjacent: one pair of columns per instruction, in place.
            for (p, lanes) in block.chunks_exact_mut(BLOCK).take(kp).enumerate() {
                let lanes: &mut [u32; BLOCK] = lanes.try_into().expect("a block row has 16 lanes");
                // SAFETY: as lane_pairs asks: outputs j0..j0+valid of columns 2p, 2p+1 (< k).
                unsafe { lane_pairs(w, j0, valid, 2 * p, k, lanes) };
            }
            return;
        } else if w.cs == 1 && available() {
            let mut row = vec![0u32; kp];
            for lane in 0..valid {
                let j = j0 + lane;
                // SAFETY: the CPU has AVX512-BF16; output j's k values are in w.data.
                unsafe { bf16_dot::pack_row_avx512(&w.data[j * w.rs..j * w.rs + k], &mut row) };
                for (p, &v) in row.iter().enumerate() {
                    block[p * BLOCK + lane] = v;
                }
            }
            return;
        }
        for lane in 0..valid {
            for p in 0..kp {
                let two = [w.at(j0 + lane, 2 * p), if 2 * p + 1 < k { w.at(j0 + lane, 2 * p + 1) } else { 0.0 }];
                block[p * BLOCK + lane] = pair_of(&two, round_input);
            }
        }
    });
    pairs
}

/// For the `valid` adjacent rows r0.. of `m` (`m.rs == 1`) — columns `col` and `col + 1` (0
/// where `col + 1 == k`) rounded to bf16 as one pair per row, into `out`'s first `valid` lanes
/// (the others 0).
///
/// # Safety
/// The CPU must have AVX512-BF16 and AVX512-BW; rows r0..r0+valid (valid ≤ 16) of columns
/// col (and col + 1 where < k) must be inside `m.data`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn lane_pairs(m: Strided, r0: usize, valid: usize, col: usize, k: usize, out: &mut [u32; BLOCK]) {
    use std::arch::x86_64::*;
    debug_assert!(m.rs == 1 && valid <= BLOCK && col < k);
    let mask = ((1u32 << valid) - 1) as __mmask16;
    let base = m.data.as_ptr();
    // SAFETY: the masked lanes are inside m.data (the caller's contract).
    unsafe {
        let even = _mm512_maskz_loadu_ps(mask, base.add(r0 + col * m.cs));
        let odd = if col + 1 < k {
            _mm512_maskz_loadu_ps(mask, base.add(r0 + (col + 1) * m.cs))
        } else {
            _mm512_setzero_ps()
        };
        // Low 16 bf16 from the second operand: the even column's, then the odd column's.
        let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even));
        // Interleave: lane l's pair is (even l, odd l).
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
            1, 16, 0,
        );
        _mm512_storeu_si512(out.as_mut_ptr().cast(), _mm512_permutexvar_epi16(idx, both));
    }
}

#[cfg(test)]
mod tests {
    use super::super::bf16_dot::tests::random;
    use super::*;

    fn bf16(v: f32) -> f64 {
        half::bf16::from_f32(v).to_f64()
    }

    /// Every orientation a linear layer uses (and a padded stride), odd k, outputs across the
    /// 16-lane blocks and rows across the 32-row tile groups, written and accumulated: within
    /// the f32 rounding of a sum of the bf16-rounded operands, on each kernel this CPU has.
    #[test]
    fn products_of_strided_operands_match_the_rounded_operands() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let kernels: &[Bf16Kernel] =
            if bf16_tiles::available() { &[Bf16Kernel::Tiles, Bf16Kernel::Dot] } else { &[Bf16Kernel::Dot] };
        for &kernel in kernels {
            for (m, n, k) in [(1, 17, 5), (2, 16, 32), (33, 37, 33), (70, 129, 64), (17, 300, 257), (300, 40, 1000)] {
                // (name, a's (rs, cs), b's (rs, cs), a's and b's storage lengths)
                let pad = 3;
                let layouts = [
                    ("x·wᵀ", (k, 1), (1, k)),
                    ("dy·w", (k, 1), (n, 1)),
                    ("dyᵀ·x", (1, m), (n, 1)),
                    ("xᵀ·dy", (1, m), (1, k)),
                    ("padded rows", (k + pad, 1), (n + pad, 1)),
                    ("strided both", (2, 2 * m + 1), (2 * n + 1, 2)),
                ];
                for (name, (ars, acs), (brs, bcs)) in layouts {
                    let a_len = (m - 1) * ars + (k - 1) * acs + 1;
                    let b_len = (k - 1) * brs + (n - 1) * bcs + 1;
                    let (ad, bd) = (random(a_len, 1), random(b_len, 2));
                    let a = Strided { data: &ad, rs: ars, cs: acs };
                    let b = Strided { data: &bd, rs: brs, cs: bcs };
                    for accumulate in [false, true] {
                        let start = random(m * n, 3);
                        let mut c = if accumulate { start.clone() } else { vec![f32::NAN; m * n] };
                        gemm(kernel, m, n, k, &mut c, accumulate, a, b);
                        for i in 0..m {
                            for j in 0..n {
                                let terms = (0..k).map(|t| bf16(a.at(i, t)) * bf16(b.at(t, j)));
                                let bound = (k + 2) as f64
                                    * f32::EPSILON as f64
                                    * (terms.clone().map(f64::abs).sum::<f64>() + 1.0);
                                let want = terms.sum::<f64>() + if accumulate { start[i * n + j] as f64 } else { 0.0 };
                                let got = c[i * n + j] as f64;
                                assert!(
                                    (got - want).abs() <= bound,
                                    "{kernel:?} {name} m {m} n {n} k {k} acc {accumulate} ({i},{j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Rows of the left operand give the same bits whatever other rows are multiplied with them
    /// (the trainer's loss of a sequence does not depend on its batch).
    #[test]
    fn a_row_gets_the_same_bits_in_any_batch_of_two_or_more() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let (m, n, k) = (70, 50, 90);
        let (x, w) = (random(m * k, 4), random(n * k, 5));
        for kernel in [Bf16Kernel::Tiles, Bf16Kernel::Dot] {
            let run = |rows: std::ops::Range<usize>| {
                let mut c = vec![0f32; rows.len() * n];
                let a = Strided { data: &x[rows.start * k..rows.end * k], rs: k, cs: 1 };
                gemm(kernel, rows.len(), n, k, &mut c, false, a, Strided { data: &w, rs: 1, cs: k });
                c
            };
            let all = run(0..m);
            for rows in [3..5, 10..47, 40..70] {
                let part = run(rows.clone());
                assert_eq!(part, all[rows.start * n..rows.end * n], "{kernel:?} rows {rows:?}");
            }
        }
    }
}
