//! CPU kernels on plain f32 slices. Hot loops are written so LLVM vectorises them (fixed-width
//! lane arrays, no reductions across lanes inside the loop) and compiled three times — AVX-512,
//! AVX2+FMA and portable — with the best chosen at run time, so one binary is fast everywhere.

use picaso_compose::simd_fn;
use rayon::prelude::*;

/// Lanes of the hand-vectorised loops (one AVX-512 register, two AVX2 registers of f32).
pub const LANES: usize = 16;

/// exp(x) for f32 to ~2 ulp, branch-free so that loops calling it vectorise (Cephes expf).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.336_55, 88.376_26);
    let k = (x * LOG2E + 0.5).floor();
    let r = x - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // 2^k by building the exponent bits; k is within [-126, 127] thanks to the clamp.
    y * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// SiLU x·σ(x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// softplus as torch computes it: x above 20, else log(1 + e^x).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

simd_fn! {
    /// Σ a_i·b_i.
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        dot_fixed(&a[..n], &b[..n], false)
    }
}

/// A weight element the kernels can widen to f32: f32 itself, or bf16 stored as its bits.
trait Widen: Copy {
    fn widen(self) -> f32;
}
impl Widen for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}
impl Widen for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

/// dot(row, x) in a fixed order (four chains of LANES lanes, then the tail), whatever calls
/// it: a decode step gives the same bits alone or in a batch. With `prefetch`, asks for the
/// memory [`PREFETCH_AHEAD_BYTES`] ahead of `row`.
#[inline(always)]
fn dot_fixed<W: Widen>(row: &[W], x: &[f32], prefetch: bool) -> f32 {
    // Software prefetch far ahead keeps more DRAM requests in flight than the hardware
    // streamer alone, which stops at 4 KiB boundaries: +25-30% decode throughput here.
    let ahead = PREFETCH_AHEAD_BYTES / std::mem::size_of::<W>();
    let line = 64 / std::mem::size_of::<W>();
    let mut acc = [[0.0f32; LANES]; 4];
    let mut cw = row.chunks_exact(4 * LANES);
    let mut cx = x.chunks_exact(4 * LANES);
    for (a, b) in (&mut cw).zip(&mut cx) {
        if prefetch {
            let p = a.as_ptr().wrapping_add(ahead);
            let mut off = 0;
            while off < 4 * LANES {
                prefetch_l2(p.wrapping_add(off).cast());
                off += line;
            }
        }
        for j in 0..4 {
            for i in 0..LANES {
                acc[j][i] = a[j * LANES + i].widen().mul_add(b[j * LANES + i], acc[j][i]);
            }
        }
    }
    let mut s = 0.0f32;
    for (a, b) in cw.remainder().iter().zip(cx.remainder()) {
        s = a.widen().mul_add(*b, s);
    }
    let mut lanes = [0.0f32; LANES];
    for i in 0..LANES {
        lanes[i] = (acc[0][i] + acc[1][i]) + (acc[2][i] + acc[3][i]);
    }
    lanes.iter().sum::<f32>() + s
}

/// out[r] (+)= dot(w[r·k .. (r+1)·k], x) for each row r of `w`.
#[inline(always)]
fn matvec_body<W: Widen>(w: &[W], x: &[f32], out: &mut [f32], accumulate: bool) {
    let k = x.len();
    for (r, o) in out.iter_mut().enumerate() {
        let v = dot_fixed(&w[r * k..(r + 1) * k], x, true);
        *o = if accumulate { *o + v } else { v };
    }
}

/// out_t[r·m + i] = dot(w row r, x row i) for the m rows of `x`: each weight row is read from
/// memory once (then from L1) for all m inputs.
#[inline(always)]
fn matvecs_body<W: Widen>(w: &[W], x: &[f32], k: usize, out_t: &mut [f32]) {
    let m = x.len() / k;
    for (r, o) in out_t.chunks_exact_mut(m).enumerate() {
        let row = &w[r * k..(r + 1) * k];
        for (i, v) in o.iter_mut().enumerate() {
            *v = dot_fixed(row, &x[i * k..(i + 1) * k], i == 0);
        }
    }
}

simd_fn! {
    /// [`matvecs_body`] for f32 `w`.
    pub fn matvecs_rows(w: &[f32], x: &[f32], k: usize, out_t: &mut [f32]) {
        matvecs_body(w, x, k, out_t)
    }
}

simd_fn! {
    /// [`matvecs_body`] for bf16 `w` (stored as bits).
    pub fn matvecs_rows_bf16(w: &[u16], x: &[f32], k: usize, out_t: &mut [f32]) {
        matvecs_body(w, x, k, out_t)
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

/// Hints the CPU to bring the cache line at `p` into L2. Never faults, even past the end of
/// an allocation, so the address need not be valid.
#[inline(always)]
fn prefetch_l2(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch instructions do not access memory architecturally and never fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p.cast::<i8>(), std::arch::x86_64::_MM_HINT_T1);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A weight matrix (rows × cols, row-major, as PyTorch stores Linear weights) in f32 or bf16.
#[derive(Debug, Clone)]
pub enum Matrix {
    /// f32 values.
    F32(Vec<f32>),
    /// bf16 values as their 16-bit patterns.
    Bf16(Vec<u16>),
}

impl Matrix {
    /// Stores `v` in `dtype` (bf16 rounds to nearest even).
    pub fn new(v: Vec<f32>, dtype: super::WeightDtype) -> Self {
        match dtype {
            super::WeightDtype::F32 => Matrix::F32(v),
            super::WeightDtype::Bf16 => Matrix::Bf16(v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()),
        }
    }

    fn len(&self) -> usize {
        match self {
            Matrix::F32(v) => v.len(),
            Matrix::Bf16(v) => v.len(),
        }
    }

    /// Copies row `r` (of `out.len()` columns) into `out` as f32.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let k = out.len();
        match self {
            Matrix::F32(v) => out.copy_from_slice(&v[r * k..(r + 1) * k]),
            Matrix::Bf16(v) => out.iter_mut().zip(&v[r * k..(r + 1) * k]).for_each(|(o, b)| *o = b.widen()),
        }
    }
}

/// out (m×n) (+)= x (m×k) · wᵀ, with w stored (n×k) row-major as in PyTorch checkpoints.
/// One row of x uses a bandwidth-bound matrix-vector kernel; more use gemm (bf16 weights are
/// widened to f32 one L2-sized tile of rows at a time).
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
        Matrix::F32(w) => gemm_t(x, m, k, w, n, 0, out, n, accumulate),
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
    if m == 1 {
        return matmul_t(x, m, k, w, n, out, accumulate);
    }
    assert_eq!(x.len(), m * k, "matmul_rows_t: x is not m×k");
    assert_eq!(w.len(), n * k, "matmul_rows_t: w is not n×k");
    assert_eq!(out.len(), m * n, "matmul_rows_t: out is not m×n");
    let rows = (n / (8 * rayon::current_num_threads())).max(16);
    // Transposed (n × m) so that each task writes one contiguous block.
    let mut out_t = vec![0.0f32; n * m];
    match w {
        Matrix::F32(w) => out_t.par_chunks_mut(rows * m).enumerate().for_each(|(i, o)| {
            matvecs_rows(&w[i * rows * k..(i * rows + o.len() / m) * k], x, k, o);
        }),
        Matrix::Bf16(w) => out_t.par_chunks_mut(rows * m).enumerate().for_each(|(i, o)| {
            matvecs_rows_bf16(&w[i * rows * k..(i * rows + o.len() / m) * k], x, k, o);
        }),
    }
    for (r, col) in out_t.chunks_exact(m).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            let o = &mut out[i * n + r];
            *o = if accumulate { *o + v } else { v };
        }
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

simd_fn! {
    /// Per row of `x` (rows×d): out = x / sqrt(mean(x²) + eps) · w.
    pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let d = w.len();
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>();
            let scale = 1.0 / (ss / d as f32 + eps).sqrt();
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
                *o = v * scale * g;
            }
        }
    }
}

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
    /// The selective scan of one head over `dt.len()` tokens, updating `s` (P×N) in place:
    /// s ← exp(dt·A)·s + dt·x⊗B, y = s·C + D·x. `xbc` is (T, stride); x, B, C start at the
    /// given offsets of each row. `decay[t]` = exp(dt_t·A). y is written (T, P).
    pub fn scan_head(
        s: &mut [f32],
        xbc: &[f32],
        stride: usize,
        x_off: usize,
        b_off: usize,
        c_off: usize,
        p_dim: usize,
        n_dim: usize,
        dt: &[f32],
        decay: &[f32],
        d_skip: f32,
        y: &mut [f32],
    ) {
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
                yt[p] = acc.iter().sum::<f32>() + tail + d_skip * x[p];
            }
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

simd_fn! {
    /// Gated RMSNorm grouped by `group`: v = y·silu(z); out = v / sqrt(mean_group(v²) + eps) · w.
    /// `y`, `z` and `out` are one token's d_inner values.
    pub fn gated_rmsnorm(y: &[f32], z: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
        for (o, (&yv, &zv)) in out.iter_mut().zip(y.iter().zip(z)) {
            *o = yv * silu(zv);
        }
        for (og, wg) in out.chunks_exact_mut(group).zip(w.chunks_exact(group)) {
            let ss: f32 = og.iter().map(|v| v * v).sum();
            let scale = 1.0 / (ss / group as f32 + eps).sqrt();
            for (o, &g) in og.iter_mut().zip(wg) {
                *o = *o * scale * g;
            }
        }
    }
}

/// log-softmax of `logits` evaluated at `target`: logit[target] - logsumexp(logits).
pub fn log_softmax_at(logits: &[f32], target: usize) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&v| ((v - max) as f64).exp()).sum();
    ((logits[target] - max) as f64 - sum.ln()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let rel = ((exp(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(-1000.0), exp(-87.336_55));
        assert!(exp(1000.0).is_finite());
    }

    #[test]
    fn matvec_equals_gemm_and_naive() {
        let (m, k, n) = (3, 70, 37);
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
                assert!((g[r * n + j] - naive[r * n + j]).abs() < 1e-4);
            }
        }
        let mut acc = vec![1.0; m * n];
        matmul_t(&x, m, k, &Matrix::F32(w.clone()), n, &mut acc, true);
        assert!((acc[5] - 1.0 - naive[5]).abs() < 1e-4);
    }
}
