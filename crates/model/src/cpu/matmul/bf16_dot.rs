//! bf16 matrix products on the CPU's bf16 dot-product instruction (AVX512-BF16 `vdpbf16ps`:
//! AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids and later). The inputs are rounded to
//! bf16 (nearest even) and each instruction adds, for 16 outputs at once, the products of one pair
//! of columns into f32 accumulators: twice the multiply-adds of an f32 FMA, and the weights are
//! never widened. CPUs without the instruction keep the widening kernels of [`super`].
//!
//! Layout: the weight rows are grouped in blocks of 16, and within a block pair `p` holds, for
//! each of the 16 rows, its columns `2p` and `2p + 1` side by side in one u32 — the instruction's
//! operand layout. One 64-byte load then holds a pair of 16 rows, and one input pair broadcast to
//! every lane feeds 16 dot products. Every output is one chain over the pairs in order, whatever
//! the number of input rows computed with it: a decode step, a batch of decode steps and a
//! prefill give each row the same bits.
//!
//! Some Intel cores run `vdpbf16ps` at half the rate of f32 FMAs (Emerald Rapids with AMX
//! hidden: 32 vs 64 multiply-adds per cycle). There, products of 8 rows or more (which compute
//! rather than stream the weights) run on FMAs over the pairs widened in registers, in the order
//! the instruction adds them (the odd product, then the even) and with its flushing of
//! subnormals: the instruction's bits, at up to twice its rate ([`PairedBf16::with_fma`]).

use picaso_compose::prefetch_l2;
use rayon::prelude::*;

use super::Widen;
use super::{bf16_gemm, bf16_tiles};

/// Output rows per block: one AVX-512 register of f32 accumulators.
pub(super) const BLOCK: usize = 16;

/// Whether this CPU has AVX512-BF16 (detected once).
pub fn available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// A bf16 weight matrix (n rows × k columns) in the dot-product instruction's pair layout.
#[derive(Debug, Clone)]
pub struct PairedBf16 {
    /// `n.div_ceil(16)` blocks of `kp_pad` × 16 pairs; padding (rows past n, the odd column
    /// past k, the pairs past `k.div_ceil(2)`) is zero.
    pairs: Vec<u32>,
    n: usize,
    k: usize,
    /// Pairs per block: `k.div_ceil(2)` rounded up to whole AMX tiles (16 pairs).
    kp_pad: usize,
    /// [`PairedBf16::matmul_t_tiles`] runs on AMX tiles.
    tiles: bool,
    /// Several rows run on FMAs with the instruction's bits ([`PairedBf16::with_fma`]).
    fma: bool,
}

/// Two bf16 bit patterns as one pair: `lo` (the even column) in the low half.
fn pair(lo: u16, hi: u16) -> u32 {
    lo as u32 | (hi as u32) << 16
}

/// Two values (the second 0 when absent) rounded by `round` as one pair.
pub(super) fn pair_of(two: &[f32], round: fn(f32) -> u16) -> u32 {
    pair(round(two[0]), two.get(1).map_or(0, |&v| round(v)))
}

/// Element `j` of a row from its pair (`j / 2`): the low half for even `j`.
fn half_of(two: u32, j: usize) -> u16 {
    if j.is_multiple_of(2) {
        two as u16
    } else {
        (two >> 16) as u16
    }
}

/// f32 → bf16 bits, rounding to nearest even (NaN stays NaN).
pub(super) fn to_bf16(v: f32) -> u16 {
    half::bf16::from_f32(v).to_bits()
}

impl PairedBf16 {
    /// Rounds `w` (n × k, row-major) to bf16 and lays it out in pairs.
    pub fn from_f32(w: &[f32], n: usize, k: usize) -> Self {
        assert_eq!(w.len(), n * k, "PairedBf16: w is not {n}×{k}");
        let kp_pad = k.div_ceil(2).next_multiple_of(bf16_tiles::TILE);
        // On huge pages: a decode step streams every pair, and 4 KiB pages cost a TLB miss each.
        let mut pairs = crate::memory::big_vec(n.div_ceil(BLOCK) * kp_pad * BLOCK, 0u32);
        pairs.par_chunks_mut(kp_pad * BLOCK).enumerate().for_each(|(b, block)| {
            for lane in 0..BLOCK.min(n - b * BLOCK) {
                let row = &w[(b * BLOCK + lane) * k..(b * BLOCK + lane + 1) * k];
                for (p, two) in row.chunks(2).enumerate() {
                    block[p * BLOCK + lane] = pair_of(two, to_bf16);
                }
            }
        });
        Self { pairs, n, k, kp_pad, tiles: false, fma: false }
    }

    /// A matrix from pairs already in this layout (`n.div_ceil(16)` blocks of `kp_pad` × 16,
    /// `kp_pad` a multiple of 16 pairs, padding zero).
    pub(super) fn from_blocks(pairs: Vec<u32>, n: usize, k: usize, kp_pad: usize) -> Self {
        assert!(kp_pad.is_multiple_of(bf16_tiles::TILE) && kp_pad >= k.div_ceil(2), "PairedBf16: bad padding");
        assert_eq!(pairs.len(), n.div_ceil(BLOCK) * kp_pad * BLOCK, "PairedBf16: pairs are not {n}×{k}");
        Self { pairs, n, k, kp_pad, tiles: false, fma: false }
    }

    /// Lets [`PairedBf16::matmul_t_tiles`] run on AMX tiles, if the CPU has them
    /// ([`bf16_tiles::available`]).
    pub fn with_tiles(mut self, tiles: bool) -> Self {
        self.tiles = tiles && bf16_tiles::available();
        self
    }

    /// Lets products of 8 rows or more run on f32 FMAs over the widened pairs, where
    /// [`fma_gives_dot_bits`] (the instruction's bits, so a row's bits still do not depend on
    /// the rows beside it); fewer rows (a decode step, a small batch), which stream the
    /// weights, keep the instruction.
    pub fn with_fma(mut self, fma: bool) -> Self {
        self.fma = fma && fma_gives_dot_bits();
        self
    }

    /// Rows (outputs).
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Columns (inputs).
    pub fn cols(&self) -> usize {
        self.k
    }

    /// Copies row `r` into `out` (k values) as f32.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.n && out.len() == self.k, "PairedBf16::row_into: row {r} of {}×{}", self.n, self.k);
        let block = self.block(r / BLOCK);
        for (j, o) in out.iter_mut().enumerate() {
            *o = half_of(block[(j / 2) * BLOCK + r % BLOCK], j).widen();
        }
    }

    /// As [`PairedBf16::matmul_t`], on AMX tiles where they are enabled ([`PairedBf16::with_tiles`]).
    /// Each output's bits are again the same whatever `m` (a tile computes every output as its
    /// own chain over the pairs in order, whatever the other rows of the tile hold), but not
    /// those of `vdpbf16ps`: the tiles add a pair's two products in another order. So a matrix
    /// with tiles runs every product on them, a decode step of one row included.
    pub fn matmul_t_tiles(&self, x: &[f32], m: usize, out: &mut [f32], accumulate: bool) {
        #[cfg(target_arch = "x86_64")]
        if self.tiles && m >= 1 && self.n > 0 {
            assert_eq!(x.len(), m * self.k, "PairedBf16::matmul_t_tiles: x is not m×k");
            assert_eq!(out.len(), m * self.n, "PairedBf16::matmul_t_tiles: out is not m×n");
            return self.run_tiles(x, m, out, accumulate);
        }
        self.matmul_t(x, m, out, accumulate)
    }

    /// out (m × n) (+)= bf16(x) (m × k) · wᵀ with `vdpbf16ps`. Each output's bits are the same
    /// whatever `m`.
    pub fn matmul_t(&self, x: &[f32], m: usize, out: &mut [f32], accumulate: bool) {
        let (n, k) = (self.n, self.k);
        assert_eq!(x.len(), m * k, "PairedBf16::matmul_t: x is not m×k");
        assert_eq!(out.len(), m * n, "PairedBf16::matmul_t: out is not m×n");
        if m == 0 || n == 0 {
            return;
        }
        let xp = pack_rows(x, m, k);
        #[cfg(target_arch = "x86_64")]
        if available() {
            return self.run_avx512(&xp, m, out, accumulate);
        }
        self.run_portable(&xp, m, out, accumulate);
    }

    /// The pairs of output block `b` (`kp_pad` × 16).
    fn block(&self, b: usize) -> &[u32] {
        let len = self.kp_pad * BLOCK;
        &self.pairs[b * len..(b + 1) * len]
    }

    /// Blocks of 16 rows.
    fn blocks(&self) -> usize {
        self.n.div_ceil(BLOCK)
    }

    #[cfg(target_arch = "x86_64")]
    pub(super) fn run_avx512(&self, xp: &[u32], m: usize, out: &mut [f32], accumulate: bool) {
        let kp = self.k.div_ceil(2);
        if self.fma && m >= FMA_MIN_ROWS {
            // The inputs as the f32 values of their bf16 (2·kp per row, the padding 0).
            let mut xf = vec![0.0f32; m * 2 * kp];
            xf.par_chunks_mut(2 * kp).zip(xp.par_chunks(kp)).for_each(|(row, pairs)| {
                for (two, &pair) in row.chunks_exact_mut(2).zip(pairs) {
                    two[0] = half_of(pair, 0).widen();
                    two[1] = half_of(pair, 1).widen();
                }
            });
            // SAFETY: fma is only set where fma_gives_dot_bits() (so the CPU has AVX-512 F);
            // xf holds m rows of kp pairs of values.
            return self.run_panels(m, out, accumulate, FMA_ROWS, FMA_PANEL_BLOCKS, |i, mr, nb, panel| unsafe {
                dispatch_fma(mr, nb, &Panel { x: xf.as_ptr().add(i * 2 * kp), ..panel })
            });
        }
        let panel = if m == 1 { DECODE_BLOCKS } else { PANEL_BLOCKS };
        // SAFETY: the caller checked AVX512-BF16; xp holds m rows of kp pairs.
        self.run_panels(m, out, accumulate, ROWS, panel, |i, mr, nb, args| unsafe {
            dispatch(mr, nb, &Panel { x: xp.as_ptr().add(i * kp), ..args })
        })
    }

    /// Runs `micro(i, mr, nb, panel)` over every group of `rows` input rows (from row `i`, `mr`
    /// of them) and panel of `panel` blocks (`nb` of them), the panel's `x` left for `micro`
    /// to set. One task per panel of blocks; a task computes every input row against its
    /// panel, so the panel's weights are read from memory once and then from L2.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    fn run_panels<X>(
        &self,
        m: usize,
        out: &mut [f32],
        accumulate: bool,
        rows: usize,
        panel: usize,
        micro: impl Fn(usize, usize, usize, Panel<X>) + Sync,
    ) {
        let n = self.n;
        let out = SharedOut(out.as_mut_ptr());
        let tasks = self.blocks().div_ceil(panel);
        // Decode streams the weights: fewer, larger tasks (see matmul::matmul_t).
        let per_task = if m == 1 { (tasks / (8 * rayon::current_num_threads())).max(1) } else { 1 };
        (0..tasks.div_ceil(per_task)).into_par_iter().for_each(|t| {
            for p in t * per_task..((t + 1) * per_task).min(tasks) {
                let b0 = p * panel;
                let nb = panel.min(self.blocks() - b0);
                let col0 = b0 * BLOCK;
                let valid = (n - col0).min(nb * BLOCK) - (nb - 1) * BLOCK;
                // The next panel (which this thread most often runs next: rayon hands each
                // thread a run of consecutive tasks) is prefetched into L2, a share of its
                // pairs in each call on this one, all its blocks at once: the order its own
                // first call reads them in. That call then reads L2 while this panel's calls
                // compute, instead of every panel's first call waiting on memory with the FMAs
                // idle. A decode step (m = 1) streams with its own prefetch.
                let next = if m > 1 && p + 1 < tasks { self.blocks().min(b0 + 2 * panel) - (b0 + panel) } else { 0 };
                let calls = m.div_ceil(rows);
                let mut i = 0;
                while i < m {
                    let mr = rows.min(m - i);
                    let call = i / rows;
                    // The task writes only columns col0..col0+nb·16 (masked to n) of out's rows
                    // i..i+mr, which no other task writes.
                    let args = Panel {
                        x: std::ptr::null(),
                        kp: self.k.div_ceil(2),
                        w: self.block(b0).as_ptr(),
                        w_stride: self.kp_pad * BLOCK,
                        // SAFETY: i < m and col0 < n, inside out (m × n).
                        out: unsafe { out.at(i * n + col0) },
                        ld: n,
                        valid,
                        accumulate,
                        // Blocks b0 + panel .. + next exist; none when next = 0.
                        prefetch: self.pairs.as_ptr().wrapping_add((b0 + panel) * self.kp_pad * BLOCK),
                        prefetch_blocks: next,
                        prefetch_every: calls,
                        prefetch_from: call * self.k.div_ceil(2) / calls,
                    };
                    micro(i, mr, nb, args);
                    i += mr;
                }
            }
        });
    }

    /// [`PairedBf16::matmul_t`] on AMX tiles: a panel of two blocks (32 outputs) at a time,
    /// which keeps their weights in cache while every group of 32 input rows passes them.
    #[cfg(target_arch = "x86_64")]
    fn run_tiles(&self, x: &[f32], m: usize, out: &mut [f32], accumulate: bool) {
        let xp = pack_rows_strided(x, m, self.k, self.kp_pad, tile_rows(m));
        self.run_tiles_packed(&xp, m, out, accumulate)
    }

    /// [`PairedBf16::run_tiles`] of inputs already packed: [`tile_rows`]`(m)` rows of `kp_pad`
    /// pairs (rows past m zero). Up to 16 rows use one input tile, which halves the
    /// instructions of a decode step; one group of rows streams the weights, several panels
    /// per task.
    #[cfg(target_arch = "x86_64")]
    pub(super) fn run_tiles_packed(&self, xp: &[u32], m: usize, out: &mut [f32], accumulate: bool) {
        const GROUP: usize = TILE_GROUP;
        let (n, kp) = (self.n, self.kp_pad);
        let groups = m.div_ceil(GROUP);
        let one_tile = m <= bf16_tiles::TILE;
        assert!(self.tiles && xp.len() >= tile_rows(m) * kp && out.len() >= m * n, "run_tiles_packed: sizes");
        let out = SharedOut(out.as_mut_ptr());
        let blocks = self.blocks();
        let panels = blocks.div_ceil(2);
        // One group of rows (a decode step, a batch of them) streams the weights: fewer, larger
        // tasks, as in run_avx512.
        let (weights, per_task) = if groups == 1 {
            (bf16_tiles::Weights::Stream, (panels / (8 * rayon::current_num_threads())).max(1))
        } else {
            (bf16_tiles::Weights::Cached, 1)
        };
        (0..panels.div_ceil(per_task)).into_par_iter().for_each(|t| {
            let mut c = [0.0f32; 1024];
            // SAFETY: `tiles` is only set where bf16_tiles::available(); xp holds tile_rows(m) rows
            // of kp pairs (kp a positive multiple of 16), each block kp pairs of 16 outputs; the
            // task writes only columns b0·16 .. b0·16 + cols of out's first m rows for its
            // panels, which no other task writes.
            unsafe {
                bf16_tiles::with_tiles(|| {
                    for panel in t * per_task..((t + 1) * per_task).min(panels) {
                        let b0 = 2 * panel;
                        let w0 = self.block(b0).as_ptr();
                        // An odd last block is multiplied twice and its copy dropped.
                        let w1 = if b0 + 1 < blocks { self.block(b0 + 1).as_ptr() } else { w0 };
                        let cols = (n - b0 * BLOCK).min(2 * BLOCK);
                        if one_tile {
                            bf16_tiles::tile_1x2(xp.as_ptr(), 4 * kp, w0, w1, kp / 16, &mut c);
                            store_tiles(&c, m, cols, out.at(b0 * BLOCK), n, accumulate);
                        } else {
                            for g in 0..groups {
                                let x = xp.as_ptr().add(g * GROUP * kp);
                                bf16_tiles::tile_2x2(x, 4 * kp, w0, w1, kp / 16, &mut c, weights);
                                let rows = (m - g * GROUP).min(GROUP);
                                store_tiles(&c, rows, cols, out.at(g * GROUP * n + b0 * BLOCK), n, accumulate);
                            }
                        }
                    }
                })
            }
        });
    }

    /// The same sums in plain Rust, for CPUs without the instruction (rounding may differ from
    /// the instruction's in the last bit).
    fn run_portable(&self, xp: &[u32], m: usize, out: &mut [f32], accumulate: bool) {
        let (n, kp) = (self.n, self.k.div_ceil(2));
        for i in 0..m {
            let xr = &xp[i * kp..(i + 1) * kp];
            for r in 0..n {
                let block = self.block(r / BLOCK);
                let mut acc = 0.0f32;
                for (p, &xv) in xr.iter().enumerate() {
                    let wv = block[p * BLOCK + r % BLOCK];
                    acc += half_of(xv, 0).widen() * half_of(wv, 0).widen()
                        + half_of(xv, 1).widen() * half_of(wv, 1).widen();
                }
                let o = &mut out[i * n + r];
                *o = if accumulate { *o + acc } else { acc };
            }
        }
    }
}

/// Input rows per group of AMX tiles (2 tiles of 16 rows).
pub(super) const TILE_GROUP: usize = 2 * bf16_tiles::TILE;

/// Rows the AMX kernels read for `m` input rows (the rows past m packed as zeros): one tile of
/// 16 up to 16 rows, else whole groups of 32.
pub(super) fn tile_rows(m: usize) -> usize {
    if m <= bf16_tiles::TILE {
        bf16_tiles::TILE
    } else {
        m.next_multiple_of(TILE_GROUP)
    }
}

/// An input rounded to bf16 as `vcvtne2ps2bf16` rounds it: nearest even, subnormals to ±0.
pub(super) fn round_input(v: f32) -> u16 {
    to_bf16(if v.is_subnormal() { 0.0f32.copysign(v) } else { v })
}

/// Rows of x rounded to bf16 pairs (m × k.div_ceil(2); an odd k pads with 0).
fn pack_rows(x: &[f32], m: usize, k: usize) -> Vec<u32> {
    pack_rows_strided(x, m, k, k.div_ceil(2), m)
}

/// Rows of x rounded to bf16 pairs, `stride` pairs apart, `rows` rows (≥ m; AMX tiles read
/// whole groups of rows). Everything past the values is zero.
fn pack_rows_strided(x: &[f32], m: usize, k: usize, stride: usize, rows: usize) -> Vec<u32> {
    bf16_gemm::pack_rows(bf16_gemm::Strided { data: x, rs: k, cs: 1 }, m, k, stride, rows)
}

/// Writes (or adds) the first `rows` rows and `cols` columns of the 32 × 32 outputs of
/// [`bf16_tiles::tile_2x2`] to `out` (rows `ld` apart).
///
/// # Safety
/// The CPU must have AVX-512; `out` must hold `rows` rows of `cols` columns, `ld` apart.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_tiles(c: &[f32; 1024], rows: usize, cols: usize, out: *mut f32, ld: usize, accumulate: bool) {
    use std::arch::x86_64::*;
    for r in 0..rows {
        for b in 0..cols.div_ceil(BLOCK) {
            let valid = (cols - b * BLOCK).min(BLOCK);
            let mask = ((1u32 << valid) - 1) as __mmask16;
            let tile = (r / BLOCK) * 2 + b;
            // SAFETY: the tile row is inside c; the masked lanes are inside out's row r.
            unsafe {
                let v = _mm512_loadu_ps(c.as_ptr().add(tile * 256 + (r % BLOCK) * BLOCK));
                store16(out.add(r * ld + b * BLOCK), mask, v, accumulate);
            }
        }
    }
}

/// Writes (or adds, with `accumulate`) the `mask`ed lanes of 16 outputs at `o`.
///
/// # Safety
/// The CPU must have AVX-512; the masked lanes must be inside `o`'s allocation.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn store16(o: *mut f32, mask: std::arch::x86_64::__mmask16, v: std::arch::x86_64::__m512, accumulate: bool) {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract.
    unsafe {
        let v = if accumulate { _mm512_add_ps(_mm512_maskz_loadu_ps(mask, o), v) } else { v };
        _mm512_mask_storeu_ps(o, mask, v);
    }
}

/// [`pack_rows`] of one row with `vcvtne2ps2bf16`.
///
/// # Safety
/// The CPU must have AVX512-BF16, and `dst.len()` must be `row.len().div_ceil(2)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn pack_row_avx512(row: &[f32], dst: &mut [u32]) {
    use std::arch::x86_64::*;
    let body = row.len() - row.len() % 32;
    let mut j = 0;
    while j < body {
        // SAFETY: j + 32 <= body <= row.len(), and dst holds (j + 32) / 2 pairs.
        unsafe {
            // The low 16 bf16 of the result come from the second operand: x[j..j+16] first.
            let v =
                _mm512_cvtne2ps_pbh(_mm512_loadu_ps(row.as_ptr().add(j + 16)), _mm512_loadu_ps(row.as_ptr().add(j)));
            _mm512_storeu_si512(dst.as_mut_ptr().add(j / 2).cast(), std::mem::transmute::<__m512bh, __m512i>(v));
        }
        j += 32;
    }
    for (d, two) in dst[body / 2..].iter_mut().zip(row[body..].chunks(2)) {
        *d = pair_of(two, round_input);
    }
}

/// Input rows per micro-kernel call, and blocks (of 16 outputs) per panel: 6 × 4 = 24 of the 32
/// AVX-512 registers accumulate, 4 hold the panel's weights and 1 the broadcast input.
const ROWS: usize = 6;
const PANEL_BLOCKS: usize = 4;
/// A decode step (one input row) runs 8 blocks at once: 8 independent chains cover the
/// instruction's latency, and 8 weight streams keep the memory busy.
const DECODE_BLOCKS: usize = 8;
/// How far ahead (bytes) a decode step prefetches each weight stream.
const PREFETCH_AHEAD_BYTES: usize = 4096;

/// `out`, written by several tasks at disjoint columns.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements (see run_avx512).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `i` past the start (a method, so closures capture the whole wrapper).
    ///
    /// # Safety
    /// `i` must be inside the slice the pointer came from.
    unsafe fn at(self, i: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(i) }
    }
}

/// One micro-kernel call: `mr` input rows against `nb` consecutive blocks.
struct Panel<X> {
    /// The first input row: `kp` pairs (`u32`, for `vdpbf16ps`) or `2·kp` values (`f32`, for
    /// FMAs); the rows follow one another.
    x: *const X,
    kp: usize,
    /// First pair of the first block; blocks are `w_stride` pairs apart.
    w: *const u32,
    w_stride: usize,
    /// Output of the first row's first column; rows are `ld` apart.
    out: *mut f32,
    ld: usize,
    /// Valid outputs (1..=16) of the last block (the others are padding and not stored).
    valid: usize,
    accumulate: bool,
    /// Blocks (`w_stride` pairs apart, from `prefetch`: the next panel's) to prefetch into L2
    /// alongside the products, one 64-byte pair of rows per block per pair of columns: every
    /// `prefetch_every`-th iteration (the panel's calls) the next pair of every block, from
    /// pair `prefetch_from` (this call's share).
    prefetch: *const u32,
    prefetch_blocks: usize,
    prefetch_every: usize,
    prefetch_from: usize,
}

impl<X> Panel<X> {
    /// At iteration `p` of the call's loop over pairs, prefetches its share of the next panel
    /// (see [`Panel::prefetch`]).
    ///
    /// # Safety
    /// `p` must be under `kp`.
    #[inline(always)]
    unsafe fn prefetch_next(&self, p: usize) {
        if self.prefetch_blocks == 0 || !(p as u32).is_multiple_of(self.prefetch_every as u32) {
            return;
        }
        // Under kp: the last call's share ends at pair kp - 1.
        let pair = self.prefetch_from + p / self.prefetch_every;
        for b in 0..self.prefetch_blocks {
            // SAFETY: the caller's contract; the blocks are inside the matrix (run_panels).
            prefetch_l2(unsafe { self.prefetch.add(b * self.w_stride + pair * BLOCK) }.cast());
        }
    }
}

/// Calls [`micro`] with `mr` and `nb` as constants.
///
/// # Safety
/// As [`micro`].
#[cfg(target_arch = "x86_64")]
unsafe fn dispatch(mr: usize, nb: usize, a: &Panel<u32>) {
    macro_rules! shapes {
        ($(($r:literal, $b:literal)),*) => {
            match (mr, nb) {
                // SAFETY: the caller's contract.
                $(($r, $b) => unsafe { micro::<$r, $b>(a) },)*
                _ => unreachable!("micro-kernels are at most {ROWS} rows × {DECODE_BLOCKS} blocks"),
            }
        };
    }
    shapes!(
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
        (1, 5),
        (1, 6),
        (1, 7),
        (1, 8),
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
        (4, 4),
        (5, 1),
        (5, 2),
        (5, 3),
        (5, 4),
        (6, 1),
        (6, 2),
        (6, 3),
        (6, 4)
    )
}

/// out[i][b·16 + l] (+)= Σ_p dot(x row i pair p, block b row l pair p), each sum one chain of
/// `vdpbf16ps` over p in order.
///
/// # Safety
/// The CPU must have AVX512-BF16; `a.x` must hold MR rows of `a.kp` pairs, `a.w` NB blocks of
/// `a.w_stride` pairs, and `a.out` MR rows (`a.ld` apart) of NB·16 columns, the last block's
/// first `a.valid`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn micro<const MR: usize, const NB: usize>(a: &Panel<u32>) {
    use std::arch::x86_64::*;
    let block_len = a.w_stride;
    let ahead = PREFETCH_AHEAD_BYTES / 4;
    let mut acc = [[_mm512_setzero_ps(); NB]; MR];
    for p in 0..a.kp {
        // SAFETY: p < kp, so every read is inside the rows and blocks of the contract.
        unsafe {
            let w: [__m512bh; NB] = std::array::from_fn(|b| {
                let at = a.w.add(b * block_len + p * BLOCK);
                if MR == 1 {
                    prefetch_l2(at.wrapping_add(ahead).cast());
                }
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(at.cast()))
            });
            a.prefetch_next(p);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*a.x.add(i * a.kp + p) as i32));
                for (b, v) in row.iter_mut().enumerate() {
                    *v = _mm512_dpbf16_ps(*v, x, w[b]);
                }
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (b, &v) in row.iter().enumerate() {
            let mask: __mmask16 = if b + 1 == NB { ((1u32 << a.valid) - 1) as u16 } else { u16::MAX };
            // SAFETY: the contract: the masked lanes are inside out's row.
            unsafe { store16(a.out.add(i * a.ld + b * BLOCK), mask, v, a.accumulate) };
        }
    }
}

/// Whether f32 FMAs over widened pairs give `vdpbf16ps`'s bits on this CPU, and run faster:
/// an Intel CPU with AVX512-BF16 (AMD's Zen 4 and 5 run the instruction at the FMAs' rate or
/// better) on which both kernels give the same bits for awkward values (subnormals,
/// cancellation), checked at first use.
pub fn fma_gives_dot_bits() -> bool {
    static SAME: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    return *SAME.get_or_init(|| intel_with_the_instruction() && kernels_agree(8));
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this is an Intel CPU with AVX512-BF16 (where the FMA kernel is worth checking).
#[cfg(target_arch = "x86_64")]
fn intel_with_the_instruction() -> bool {
    let id = std::arch::x86_64::__cpuid(0);
    let intel = [id.ebx, id.edx, id.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e]; // "GenuineIntel"
    intel && available()
}

/// Whether the FMA kernel gives the instruction's bits for `matrices` matrices of 16 × 32
/// [`awkward_pairs`] and [`FMA_MIN_ROWS`] input rows of them, added to awkward outputs.
#[cfg(target_arch = "x86_64")]
pub(super) fn kernels_agree(matrices: u64) -> bool {
    (0..matrices).all(|seed| {
        let (kp, m) = (bf16_tiles::TILE, FMA_MIN_ROWS);
        let cases = awkward_pairs(BLOCK * kp + m * kp + m * BLOCK, seed);
        let mut cases = cases.into_iter();
        let pairs: Vec<u32> = cases.by_ref().take(BLOCK * kp).map(|c| c.2).collect();
        let xp: Vec<u32> = cases.by_ref().take(m * kp).map(|c| c.1).collect();
        let start: Vec<f32> = cases.map(|c| c.0).collect();
        let w = PairedBf16::from_blocks(pairs, BLOCK, 2 * kp, kp);
        let run = |fma: bool| {
            let mut out = start.clone();
            PairedBf16 { fma, ..w.clone() }.run_avx512(&xp, m, &mut out, true);
            out
        };
        let (dot, fma) = (run(false), run(true));
        dot.iter().zip(&fma).all(|(a, b)| a.to_bits() == b.to_bits())
    })
}

/// (output, input pair, weight pair) triples that exercise every case of the instruction's
/// arithmetic: values over the whole exponent range, zeros, cancellation, and subnormal
/// operands, products and sums.
pub(super) fn awkward_pairs(len: usize, seed: u64) -> Vec<(f32, u32, u32)> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut next = move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 32) as u32
    };
    let special = [0u16, 0x8000, 0x0001, 0x807f, 0x0080, 0x3f80, 0x1f80, 0x2000, 0x7f7f, 0x00ff];
    (0..len)
        .map(|i| {
            let mut half = || -> u16 {
                let sign = next() & 0x8000;
                (match i % 7 {
                    0 => special[next() as usize % special.len()] as u32,
                    // Exponents near the bottom: subnormal products and sums.
                    1 | 2 => sign | (next() % 0x1000),
                    // Near 1, and anywhere.
                    3 | 4 => sign | (0x3e00 + next() % 0x0200),
                    _ => next() & 0x7f7f | sign,
                }) as u16
            };
            let x = half() as u32 | (half() as u32) << 16;
            let w = half() as u32 | (half() as u32) << 16;
            let out = match i % 3 {
                0 => f32::from_bits((next() % 0x0100_0000) | (next() & 0x8000_0000)),
                _ => f32::from_bits((next() & 0x8000_0000) | (0x3000_0000 + next() % 0x1800_0000)),
            };
            (out, x, w)
        })
        .collect()
}

/// Input rows per FMA micro-kernel call, and blocks per panel: 6 × 3 = 18 registers
/// accumulate, 6 hold the panel's widened weights (odd and even halves) and 2 an input pair.
const FMA_ROWS: usize = 6;
/// Fewer rows stream the weights at the memory's speed either way, and do it with fewer
/// instructions on `vdpbf16ps` (4 rows measured 16.0 ms a decode step's products against 18.2).
const FMA_MIN_ROWS: usize = 8;
const FMA_PANEL_BLOCKS: usize = 3;

/// Calls [`micro_fma`] with `mr` and `nb` as constants.
///
/// # Safety
/// As [`micro_fma`].
#[cfg(target_arch = "x86_64")]
unsafe fn dispatch_fma(mr: usize, nb: usize, a: &Panel<f32>) {
    macro_rules! shapes {
        ($(($r:literal, $b:literal)),*) => {
            match (mr, nb) {
                // SAFETY: the caller's contract.
                $(($r, $b) => unsafe { micro_fma::<$r, $b>(a) },)*
                _ => unreachable!("FMA micro-kernels are 1 to {FMA_ROWS} rows × at most {FMA_PANEL_BLOCKS} blocks"),
            }
        };
    }
    shapes!(
        (1, 1),
        (1, 2),
        (1, 3),
        (2, 1),
        (2, 2),
        (2, 3),
        (3, 1),
        (3, 2),
        (3, 3),
        (4, 1),
        (4, 2),
        (4, 3),
        (5, 1),
        (5, 2),
        (5, 3),
        (6, 1),
        (6, 2),
        (6, 3)
    )
}

/// As [`micro`], with FMAs: out[i][b·16 + l] (+)= Σ_p (x odd · w odd, then x even · w even),
/// the weights' halves widened to f32 in registers, the inputs already the f32 values of their
/// bf16. Subnormal operands and results are flushed to zero (MXCSR's DAZ and FTZ, set for
/// the products and restored before the stores), as the instruction flushes them.
///
/// # Safety
/// The CPU must have AVX-512 F; `a.x` must hold MR rows of `2·a.kp` values, `a.w` NB blocks
/// of `a.w_stride` pairs, and `a.out` MR rows (`a.ld` apart) of NB·16 columns, the last
/// block's first `a.valid`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_fma<const MR: usize, const NB: usize>(a: &Panel<f32>) {
    use std::arch::x86_64::*;
    const DAZ_FTZ: u32 = 1 << 6 | 1 << 15;
    let odd_half = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut acc = [[_mm512_setzero_ps(); NB]; MR];
    let mut mxcsr = 0u32;
    // SAFETY: stmxcsr and ldmxcsr read and write the 4 bytes given; round to nearest even
    // stays (the products and sums are then the instruction's).
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut mxcsr, options(nostack, preserves_flags));
        let flushing = mxcsr & !(3 << 13) | DAZ_FTZ;
        std::arch::asm!("ldmxcsr [{}]", in(reg) &flushing, options(nostack, preserves_flags, readonly));
    }
    for p in 0..a.kp {
        // SAFETY: p < kp, so every read is inside the rows and blocks of the contract.
        unsafe {
            let mut even = [_mm512_setzero_ps(); NB];
            let mut odd = [_mm512_setzero_ps(); NB];
            for b in 0..NB {
                let v = _mm512_loadu_si512(a.w.add(b * a.w_stride + p * BLOCK).cast());
                even[b] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                odd[b] = _mm512_castsi512_ps(_mm512_and_si512(v, odd_half));
            }
            a.prefetch_next(p);
            for (i, row) in acc.iter_mut().enumerate() {
                let x = a.x.add(i * 2 * a.kp + 2 * p);
                let (x_even, x_odd) = (_mm512_set1_ps(*x), _mm512_set1_ps(*x.add(1)));
                for (b, v) in row.iter_mut().enumerate() {
                    *v = _mm512_fmadd_ps(x_even, even[b], _mm512_fmadd_ps(x_odd, odd[b], *v));
                }
            }
        }
    }
    // SAFETY: as above; the stores below run in the caller's mode, as the instruction's do.
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &mxcsr, options(nostack, preserves_flags, readonly)) };
    for (i, row) in acc.iter().enumerate() {
        for (b, &v) in row.iter().enumerate() {
            let mask: __mmask16 = if b + 1 == NB { ((1u32 << a.valid) - 1) as u16 } else { u16::MAX };
            // SAFETY: the contract: the masked lanes are inside out's row.
            unsafe { store16(a.out.add(i * a.ld + b * BLOCK), mask, v, a.accumulate) };
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `len` values in [-1, 1) from a fixed LCG (also used by `bf16_gemm`'s tests).
    pub(in crate::cpu) fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
            })
            .collect()
    }

    /// Σ in f64 of the bf16-rounded operands (what the kernel approximates in f32), and a bound
    /// on the f32 sum's rounding error: k ulps of Σ|terms|.
    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<(f64, f64)> {
        let r = |v: f32| to_bf16(v).widen() as f64;
        let mut out = vec![(0.0, 0.0); m * n];
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|t| r(x[i * k + t]) * r(w[j * k + t]));
                let abs: f64 = terms.clone().map(f64::abs).sum();
                out[i * n + j] = (terms.sum(), k as f64 * f32::EPSILON as f64 * abs);
            }
        }
        out
    }

    #[test]
    fn products_match_the_rounded_operands_and_rows_do_not_depend_on_the_batch() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16 (the portable path is tested below)");
            return;
        }
        // Odd k (a padded pair), n not a multiple of 16 (masked stores), m across the 6-row kernel.
        for (m, n, k) in [(1, 37, 33), (7, 70, 64), (13, 16, 5), (2, 129, 768)] {
            let (x, w) = (random(m * k, 1), random(n * k, 2));
            let mat = PairedBf16::from_f32(&w, n, k);
            let mut out = vec![0.0f32; m * n];
            mat.matmul_t(&x, m, &mut out, false);
            for (got, (want, bound)) in out.iter().zip(reference(&x, &w, m, n, k)) {
                assert!((*got as f64 - want).abs() <= bound, "m {m} n {n} k {k}: {got} vs {want}");
            }
            // Each row alone gives the same bits, and accumulate adds to what is there.
            for i in 0..m {
                let mut alone = vec![1.0f32; n];
                mat.matmul_t(&x[i * k..(i + 1) * k], 1, &mut alone, true);
                for (a, b) in alone.iter().zip(&out[i * n..(i + 1) * n]) {
                    assert_eq!(a.to_bits(), (1.0 + b).to_bits(), "m {m} n {n} k {k} row {i}");
                }
            }
        }
    }

    /// Where the FMA kernel is used, it gives the instruction's bits: on values that exercise
    /// every rounding and flushing case, and on a product of the model's shapes, for every
    /// number of rows (each row's bits as it gets them alone, on the instruction).
    #[test]
    fn fma_batches_give_the_instructions_bits() {
        #[cfg(target_arch = "x86_64")]
        if !intel_with_the_instruction() {
            eprintln!("skipped: no Intel CPU with AVX512-BF16 here (the FMA kernel is not used)");
            return;
        }
        #[cfg(not(target_arch = "x86_64"))]
        return;
        #[cfg(target_arch = "x86_64")]
        assert!(kernels_agree(256), "the FMA kernel differs from vdpbf16ps on awkward values");
        assert!(fma_gives_dot_bits());
        let (n, k) = (70, 768);
        let (x, w) = (random(13 * k, 5), random(n * k, 6));
        let (dot, fma) = (PairedBf16::from_f32(&w, n, k), PairedBf16::from_f32(&w, n, k).with_fma(true));
        assert!(fma.fma && !dot.fma);
        for m in 1..=13 {
            let (mut a, mut b) = (vec![0.25f32; m * n], vec![0.25f32; m * n]);
            dot.matmul_t(&x[..m * k], m, &mut a, true);
            fma.matmul_t(&x[..m * k], m, &mut b, true);
            assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "{m} rows");
        }
    }

    #[test]
    fn amx_tiles_match_the_rounded_operands_and_rows_do_not_depend_on_the_batch() {
        if !bf16_tiles::available() {
            eprintln!("skipped: this CPU has no AMX-BF16 (or the OS does not grant it)");
            return;
        }
        // Rows across and past the tile groups of 32, outputs with an odd last block and a
        // masked one, k with padded pairs and an odd column.
        for (m, n, k) in [(2, 16, 32), (33, 37, 33), (70, 70, 64), (128, 129, 768), (17, 48, 1537), (1, 100, 768)] {
            let (x, w) = (random(m * k, 7), random(n * k, 8));
            let mat = PairedBf16::from_f32(&w, n, k).with_tiles(true);
            let mut out = vec![0.0f32; m * n];
            mat.matmul_t_tiles(&x, m, &mut out, false);
            for (got, (want, bound)) in out.iter().zip(reference(&x, &w, m, n, k)) {
                assert!((*got as f64 - want).abs() <= bound, "m {m} n {n} k {k}: {got} vs {want}");
            }
            // Any consecutive rows give the same bits — one row (a decode step), up to 16 (one
            // input tile), more (pairs of tiles) — and accumulate adds.
            for (i, j) in [(0, 1), (m - 1, m), (0, 2), (1, m), (m / 2, m)] {
                if j > m || j <= i {
                    continue;
                }
                let mut part = vec![1.0f32; (j - i) * n];
                mat.matmul_t_tiles(&x[i * k..j * k], j - i, &mut part, true);
                for (a, b) in part.iter().zip(&out[i * n..j * n]) {
                    assert_eq!(a.to_bits(), (1.0 + b).to_bits(), "m {m} n {n} k {k} rows {i}..{j}");
                }
            }
        }
    }

    #[test]
    fn the_portable_path_computes_the_same_products() {
        let (m, n, k) = (3, 21, 11);
        let (x, w) = (random(m * k, 3), random(n * k, 4));
        let mat = PairedBf16::from_f32(&w, n, k);
        let mut out = vec![0.0f32; m * n];
        mat.run_portable(&pack_rows(&x, m, k), m, &mut out, false);
        for (got, (want, bound)) in out.iter().zip(reference(&x, &w, m, n, k)) {
            assert!((*got as f64 - want).abs() <= bound, "{got} vs {want}");
        }
    }

    #[test]
    fn rows_read_back_as_their_rounded_values() {
        let (n, k) = (19, 7);
        let w = random(n * k, 5);
        let mat = PairedBf16::from_f32(&w, n, k);
        let mut row = vec![0.0f32; k];
        for r in 0..n {
            mat.row_into(r, &mut row);
            for (got, want) in row.iter().zip(&w[r * k..(r + 1) * k]) {
                assert_eq!(got.to_bits(), to_bf16(*want).widen().to_bits());
            }
        }
    }

    #[test]
    fn inputs_round_to_nearest_even_and_subnormals_flush_to_zero() {
        // Subnormals at both ends of a row: in the vectorised body and in the scalar tail.
        let mut x = random(77, 6);
        x[3] = 1e-40;
        x.extend([f32::MAX, -1e-40, -0.0, 3.0039062, f32::NAN]);
        let packed = pack_rows(&x, 1, x.len());
        for (j, v) in x.iter().enumerate() {
            let bits = half_of(packed[j / 2], j);
            let want = if v.is_subnormal() { to_bf16(0.0f32.copysign(*v)) } else { to_bf16(*v) };
            if v.is_nan() {
                assert!(bits.widen().is_nan(), "element {j}");
            } else {
                assert_eq!(bits, want, "element {j} ({v})");
            }
        }
    }
}
