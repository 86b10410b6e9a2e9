//! The fast path's kernels on f32 slices, each a forward and its backward: matrix products
//! (gemm, in the three orientations a linear layer needs), RMSNorm, the causal conv, the
//! selective scan and cross-entropy. Hot loops are compiled for AVX-512, AVX2+FMA and
//! portable code, chosen at run time (`picaso_model::simd_fn!`).

use picaso_model::cpu::activations::exp;
use picaso_model::cpu::matmul::bf16_gemm::{self, Strided};
use picaso_model::cpu::matmul::bf16_tiles;
use picaso_model::cpu::matmul::Bf16Kernel;
use picaso_model::cpu::LANES;
use picaso_model::simd_fn;
use rayon::prelude::*;

// ---------------------------------------------------------------------------------------------
// Matrix products

/// How the trainer's matrix products multiply: in f32, or with both operands rounded to bf16
/// (f32 sums) on AMX tiles, as PyTorch's bf16 autocast does. Weights, gradients, optimiser
/// state and everything else stay f32.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Matmul {
    /// f32 operands (the `gemm` crate).
    #[default]
    F32,
    /// bf16 operands on AMX tiles where the CPU has them, else f32.
    Bf16,
}

impl Matmul {
    /// What runs on this CPU: `Bf16` only with AMX tiles. Without them it is `F32`: a step on
    /// AVX512-BF16's `vdpbf16ps` alone measured slower than the f32 gemm (BENCHMARKS.md);
    /// `PICASO_BF16_KERNEL=dot` still runs that kernel on an AMX CPU, to compare.
    pub fn effective(self) -> Self {
        let kernel = Bf16Kernel::detect();
        if self == Matmul::Bf16 && bf16_tiles::available() && kernel != Bf16Kernel::Widen {
            Matmul::Bf16
        } else {
            Matmul::F32
        }
    }

    /// The name logs report: `f32`, `bf16-amx-tiles` (`bf16-avx512bf16-dot` when forced), or
    /// why a bf16 request runs in f32.
    pub fn describe(self) -> String {
        match (self, self.effective()) {
            (_, Matmul::Bf16) => format!("bf16-{}", Bf16Kernel::detect().name()),
            (Matmul::Bf16, Matmul::F32) => {
                "f32 (bf16 asked for: no AMX tiles here, or PICASO_BF16_KERNEL=widen)".into()
            }
            _ => "f32".into(),
        }
    }
}

/// dst (m×n, row-major) = a (m×k) · b (k×n), or += when `accumulate`, in `mm`'s precision.
#[allow(clippy::too_many_arguments)]
pub fn gemm(mm: Matmul, m: usize, n: usize, k: usize, dst: &mut [f32], accumulate: bool, a: Strided, b: Strided) {
    if mm.effective() == Matmul::Bf16 {
        return bf16_gemm::gemm(Bf16Kernel::detect(), m, n, k, dst, accumulate, a, b);
    }
    assert!(dst.len() >= m * n, "gemm: dst too small");
    assert!(a.fits(m, k), "gemm: a too small");
    assert!(b.fits(k, n), "gemm: b too small");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return;
    }
    let threads = rayon::current_num_threads();
    let parallelism =
        if threads > 1 && m * n * k > 1 << 15 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the asserts above keep every strided access inside the slices.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            if accumulate { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// A linear layer `y = x·wᵀ` for x (m×k) and w (n×k), as PyTorch stores weights.
pub fn linear(mm: Matmul, x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32]) {
    gemm(mm, m, n, k, y, false, Strided::rows(x, k), Strided::rows(w, k).t());
}

/// The linear layer's backward: `dx = dy·w` (written, or added when `accumulate_dx`) and
/// `dw += dyᵀ·x`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    mm: Matmul,
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    dy: &[f32],
    dx: Option<&mut [f32]>,
    dw: &mut [f32],
) {
    if let Some(dx) = dx {
        gemm(mm, m, k, n, dx, false, Strided::rows(dy, n), Strided::rows(w, k));
    }
    gemm(mm, n, k, m, dw, true, Strided::rows(dy, n).t(), Strided::rows(x, k));
}

// ---------------------------------------------------------------------------------------------
// Reductions

/// Σ over rows of `f(row, acc)` in f64, in parallel over fixed blocks added in block order: the
/// result depends neither on scheduling nor on the thread count (a resumed run replays bit for
/// bit on any machine).
pub fn row_sums(rows: usize, width: usize, f: impl Fn(usize, &mut [f64]) + Sync) -> Vec<f64> {
    const BLOCK: usize = 64;
    let partials: Vec<Vec<f64>> = (0..rows.div_ceil(BLOCK))
        .into_par_iter()
        .map(|i| {
            let mut acc = vec![0f64; width];
            for r in i * BLOCK..((i + 1) * BLOCK).min(rows) {
                f(r, &mut acc);
            }
            acc
        })
        .collect();
    let mut sums = vec![0f64; width];
    for p in partials {
        sums.iter_mut().zip(p).for_each(|(s, v)| *s += v);
    }
    sums
}

/// Adds `sums` (f64) into `grad`.
pub fn add_into(grad: &mut [f32], sums: &[f64]) {
    grad.iter_mut().zip(sums).for_each(|(g, s)| *g = (f64::from(*g) + s) as f32);
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for i in 0..LANES {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = 0.0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s = x.mul_add(*y, s);
    }
    acc.iter().sum::<f32>() + s
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// d silu(x) / dx.
#[inline(always)]
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

// ---------------------------------------------------------------------------------------------
// RMSNorm (grouped)

simd_fn! {
    /// One row: out = x / √(mean_group(x²) + eps) · w per group; returns nothing, writes the
    /// groups' inverse RMS into `inv`.
    pub fn rmsnorm_row(x: &[f32], w: &[f32], eps: f32, inv: &mut [f32], out: &mut [f32]) {
        let gw = x.len() / inv.len();
        for (g, r) in inv.iter_mut().enumerate() {
            let xs = &x[g * gw..(g + 1) * gw];
            let ss = dot(xs, xs);
            *r = 1.0 / (ss / gw as f32 + eps).sqrt();
            for ((o, &v), &wv) in out[g * gw..(g + 1) * gw].iter_mut().zip(xs).zip(&w[g * gw..(g + 1) * gw]) {
                *o = v * *r * wv;
            }
        }
    }
}

simd_fn! {
    /// One row of RMSNorm's backward: dx = r·(g·w − x̂·mean(g·w·x̂)) per group, with x̂ = x·r;
    /// adds g·x̂ into the f64 weight-gradient row `dw`.
    pub fn rmsnorm_row_backward(x: &[f32], w: &[f32], inv: &[f32], g: &[f32], dx: &mut [f32]) {
        let gw = x.len() / inv.len();
        for (grp, &r) in inv.iter().enumerate() {
            let span = grp * gw..(grp + 1) * gw;
            let (xs, ws, gs) = (&x[span.clone()], &w[span.clone()], &g[span.clone()]);
            let mut acc = 0.0f32;
            for ((&xv, &wv), &gv) in xs.iter().zip(ws).zip(gs) {
                acc = (gv * wv).mul_add(xv * r, acc);
            }
            let mean = acc / gw as f32;
            for (((d, &xv), &wv), &gv) in dx[span].iter_mut().zip(xs).zip(ws).zip(gs) {
                *d = r * (gv * wv - xv * r * mean);
            }
        }
    }
}

/// RMSNorm over rows of `d` in `groups` groups: writes `out` and the inverse RMS per (row, group).
pub fn rmsnorm(x: &[f32], w: &[f32], groups: usize, eps: f32, inv: &mut [f32], out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d).zip(x.par_chunks(d)).zip(inv.par_chunks_mut(groups)).for_each(|((o, xr), r)| {
        rmsnorm_row(xr, w, eps, r, o);
    });
}

/// RMSNorm's backward: `dx` (written) and the weight gradient (added to `dw`).
pub fn rmsnorm_backward(x: &[f32], w: &[f32], groups: usize, inv: &[f32], g: &[f32], dx: &mut [f32], dw: &mut [f32]) {
    let d = w.len();
    dx.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .zip(inv.par_chunks(groups))
        .zip(g.par_chunks(d))
        .for_each(|(((o, xr), r), gr)| rmsnorm_row_backward(xr, w, r, gr, o));
    let gw = d / groups;
    let sums = row_sums(x.len() / d, d, |row, acc| {
        let (xr, gr, r) = (&x[row * d..][..d], &g[row * d..][..d], &inv[row * groups..][..groups]);
        for (i, a) in acc.iter_mut().enumerate() {
            *a += f64::from(gr[i] * xr[i] * r[i / gw]);
        }
    });
    add_into(dw, &sums);
}

// ---------------------------------------------------------------------------------------------
// Causal depthwise conv + SiLU

simd_fn! {
    /// One output row: pre = bias + Σ_j w[j]·in[t + j − (K−1)] (rows before the sequence are
    /// zero), act = silu(pre). `rows` are the K input rows (None before the start); `wt` is
    /// the kernel as (K, C).
    pub fn conv_row(rows: &[Option<&[f32]>], wt: &[f32], bias: &[f32], pre: &mut [f32], act: &mut [f32]) {
        let c = pre.len();
        pre.copy_from_slice(bias);
        for (j, row) in rows.iter().enumerate() {
            if let Some(x) = row {
                for ((o, &xv), &wv) in pre.iter_mut().zip(&x[..c]).zip(&wt[j * c..(j + 1) * c]) {
                    *o = xv.mul_add(wv, *o);
                }
            }
        }
        for (a, &p) in act.iter_mut().zip(pre.iter()) {
            *a = p * sigmoid(p);
        }
    }
}

simd_fn! {
    /// d pre = d act · silu'(pre), in place on `d`.
    pub fn silu_backward(pre: &[f32], d: &mut [f32]) {
        for (g, &p) in d.iter_mut().zip(pre) {
            *g *= silu_grad(p);
        }
    }
}

simd_fn! {
    /// One input row's gradient: d in[p] = Σ_j dpre[p + (K−1) − j]·w[j] over the rows that
    /// exist (`rows[j]` is dpre at that time, or None past the end).
    pub fn conv_input_row(rows: &[Option<&[f32]>], wt: &[f32], out: &mut [f32]) {
        let c = out.len();
        out.fill(0.0);
        for (j, row) in rows.iter().enumerate() {
            if let Some(g) = row {
                for ((o, &gv), &wv) in out.iter_mut().zip(&g[..c]).zip(&wt[j * c..(j + 1) * c]) {
                    *o = gv.mul_add(wv, *o);
                }
            }
        }
    }
}

/// Geometry of a packed (B, T, width) activation.
#[derive(Clone, Copy)]
pub struct Rows {
    /// Sequences.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
}

impl Rows {
    /// B·T.
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// The causal conv over columns `[col0, col0 + C)` of `input` (rows of `ld`), from a zero
/// tail: writes the pre-activation and the SiLU (both rows of C). `w` is (C, K).
#[allow(clippy::too_many_arguments)]
pub fn conv_forward(
    shape: Rows,
    input: &[f32],
    ld: usize,
    col0: usize,
    w: &[f32],
    bias: &[f32],
    pre: &mut [f32],
    act: &mut [f32],
) {
    let c = bias.len();
    let k = w.len() / c;
    let wt: Vec<f32> = (0..k * c).map(|i| w[(i % c) * k + i / c]).collect();
    pre.par_chunks_mut(c).zip(act.par_chunks_mut(c)).enumerate().for_each(|(r, (p, a))| {
        let t = r % shape.t;
        let rows: Vec<Option<&[f32]>> =
            (0..k).map(|j| (t + j + 1 >= k).then(|| &input[(r + j + 1 - k) * ld + col0..][..c])).collect();
        conv_row(&rows, &wt, bias, p, a);
    });
}

/// The conv's backward from `dpre` (rows of C): the input gradient into columns
/// `[col0, col0 + C)` of `dinput` (rows of `ld`), and the weight and bias gradients (added).
#[allow(clippy::too_many_arguments)]
pub fn conv_backward(
    shape: Rows,
    input: &[f32],
    ld: usize,
    col0: usize,
    w: &[f32],
    dpre: &[f32],
    dinput: &mut [f32],
    dw: &mut [f32],
    dbias: Option<&mut [f32]>,
) {
    let c = dpre.len() / shape.n();
    let k = w.len() / c;
    let wt: Vec<f32> = (0..k * c).map(|i| w[(i % c) * k + i / c]).collect();
    dinput.par_chunks_mut(ld).enumerate().for_each(|(r, row)| {
        let t = r % shape.t;
        // Input row t feeds outputs t + (K−1) − j for j = 0..K.
        let rows: Vec<Option<&[f32]>> = (0..k)
            .map(|j| {
                let out_t = t + k - 1 - j;
                (out_t < shape.t).then(|| &dpre[(r + k - 1 - j) * c..][..c])
            })
            .collect();
        conv_input_row(&rows, &wt, &mut row[col0..col0 + c]);
    });
    let sums = row_sums(shape.n(), c * (k + 1), |r, acc| {
        let t = r % shape.t;
        let g = &dpre[r * c..][..c];
        for j in 0..k {
            if t + j + 1 < k {
                continue;
            }
            let x = &input[(r + j + 1 - k) * ld + col0..][..c];
            for ci in 0..c {
                acc[ci * k + j] += f64::from(g[ci] * x[ci]);
            }
        }
        for ci in 0..c {
            acc[c * k + ci] += f64::from(g[ci]);
        }
    });
    add_into(dw, &sums[..c * k]);
    if let Some(db) = dbias {
        add_into(db, &sums[c * k..]);
    }
}

// ---------------------------------------------------------------------------------------------
// Selective scan, one (sequence, head) at a time

/// Where one head's inputs sit in a row of the conv output (x, B, C) and its sizes.
#[derive(Clone, Copy)]
pub struct HeadView {
    /// Row stride of the conv output.
    pub ld: usize,
    /// Column of the head's x.
    pub x: usize,
    /// Column of its group's B.
    pub b: usize,
    /// Column of its group's C.
    pub c: usize,
    /// Headdim P.
    pub p: usize,
    /// d_state N.
    pub n: usize,
}

impl HeadView {
    /// d_state in whole vectors of [`LANES`], where it is one (the scan keeps B and C in
    /// registers then).
    fn whole_vectors(&self) -> Option<usize> {
        (self.n > 0 && self.n.is_multiple_of(LANES)).then_some(self.n / LANES)
    }
}

simd_fn! {
    /// The scan of one head over `dt.len()` tokens from the zero state: s ← α_t·s + dt_t·x_t⊗B_t,
    /// y_t = s·C_t + D·x_t with α_t = exp(dt_t·A). `xbc` holds the sequence's rows; `y` is
    /// (T, P). The state at the start of each chunk of `chunk` tokens goes to `checkpoints`.
    pub fn scan_forward(
        xbc: &[f32],
        v: HeadView,
        dt: &[f32],
        a: f32,
        d_skip: f32,
        chunk: usize,
        s: &mut [f32],
        checkpoints: &mut [f32],
        y: &mut [f32],
    ) {
        match v.whole_vectors() {
            Some(1) => scan_forward_fixed::<1>(xbc, v, dt, a, d_skip, chunk, s, checkpoints, y),
            Some(2) => scan_forward_fixed::<2>(xbc, v, dt, a, d_skip, chunk, s, checkpoints, y),
            Some(4) => scan_forward_fixed::<4>(xbc, v, dt, a, d_skip, chunk, s, checkpoints, y),
            Some(8) => scan_forward_fixed::<8>(xbc, v, dt, a, d_skip, chunk, s, checkpoints, y),
            _ => scan_forward_any(xbc, v, dt, a, d_skip, chunk, s, checkpoints, y),
        }
    }
}

/// [`scan_forward`] for any d_state.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scan_forward_any(
    xbc: &[f32],
    v: HeadView,
    dt: &[f32],
    a: f32,
    d_skip: f32,
    chunk: usize,
    s: &mut [f32],
    checkpoints: &mut [f32],
    y: &mut [f32],
) {
    let (p_dim, n_dim) = (v.p, v.n);
    s.fill(0.0);
    for (t, &dt_t) in dt.iter().enumerate() {
        if t % chunk == 0 {
            checkpoints[(t / chunk) * p_dim * n_dim..][..p_dim * n_dim].copy_from_slice(s);
        }
        let row = &xbc[t * v.ld..];
        let (x, bm, cm) = (&row[v.x..v.x + p_dim], &row[v.b..v.b + n_dim], &row[v.c..v.c + n_dim]);
        let alpha = exp(dt_t * a);
        let yt = &mut y[t * p_dim..(t + 1) * p_dim];
        for p in 0..p_dim {
            let u = x[p] * dt_t;
            let sp = &mut s[p * n_dim..(p + 1) * n_dim];
            for (sv, &bv) in sp.iter_mut().zip(bm) {
                *sv = sv.mul_add(alpha, u * bv);
            }
            yt[p] = d_skip.mul_add(x[p], dot(sp, cm));
        }
    }
}

/// NV vectors of [`LANES`] values from the start of `from`.
#[inline(always)]
fn vectors<const NV: usize>(from: &[f32]) -> [[f32; LANES]; NV] {
    std::array::from_fn(|j| from[j * LANES..(j + 1) * LANES].try_into().expect("LANES values"))
}

/// [`scan_forward`] for d_state = NV · [`LANES`]: the token's B and C stay in registers, and
/// each state row is updated and read against C in one pass.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn scan_forward_fixed<const NV: usize>(
    xbc: &[f32],
    v: HeadView,
    dt: &[f32],
    a: f32,
    d_skip: f32,
    chunk: usize,
    s: &mut [f32],
    checkpoints: &mut [f32],
    y: &mut [f32],
) {
    let (p_dim, n_dim) = (v.p, NV * LANES);
    s.fill(0.0);
    for (t, &dt_t) in dt.iter().enumerate() {
        if t % chunk == 0 {
            checkpoints[(t / chunk) * p_dim * n_dim..][..p_dim * n_dim].copy_from_slice(s);
        }
        let row = &xbc[t * v.ld..];
        let x = &row[v.x..v.x + p_dim];
        let (b, c) = (vectors::<NV>(&row[v.b..]), vectors::<NV>(&row[v.c..]));
        let alpha = exp(dt_t * a);
        let yt = &mut y[t * p_dim..(t + 1) * p_dim];
        for (p, sp) in s.chunks_exact_mut(n_dim).take(p_dim).enumerate() {
            let u = x[p] * dt_t;
            let mut acc = [0.0f32; LANES];
            for j in 0..NV {
                let sv = &mut sp[j * LANES..(j + 1) * LANES];
                for i in 0..LANES {
                    let nv = sv[i].mul_add(alpha, u * b[j][i]);
                    sv[i] = nv;
                    acc[i] = nv.mul_add(c[j][i], acc[i]);
                }
            }
            yt[p] = d_skip.mul_add(x[p], acc.iter().sum::<f32>());
        }
    }
}

/// Gradients of one head's scan.
pub struct HeadGrads<'a> {
    /// d x (T, P), written.
    pub dx: &'a mut [f32],
    /// d B (T, N), written.
    pub db: &'a mut [f32],
    /// d C (T, N), written.
    pub dc: &'a mut [f32],
    /// d dt (T), written.
    pub ddt: &'a mut [f32],
}

simd_fn! {
    /// The backward of [`scan_forward`] from `dy` (T, P): recomputes each chunk's states from
    /// its checkpoint (`states` holds chunk + 1 of them) and runs the adjoint recurrence
    /// backwards. Returns (dA, dD) of this head.
    pub fn scan_backward(
        xbc: &[f32],
        v: HeadView,
        dt: &[f32],
        a: f32,
        d_skip: f32,
        chunk: usize,
        checkpoints: &[f32],
        dy: &[f32],
        states: &mut [f32],
        ds: &mut [f32],
        g: HeadGrads<'_>,
    ) -> (f64, f64) {
        let args = (xbc, v, dt, a, d_skip, chunk, checkpoints, dy);
        match v.whole_vectors() {
            Some(1) => scan_backward_fixed::<1>(args, states, ds, g),
            Some(2) => scan_backward_fixed::<2>(args, states, ds, g),
            Some(4) => scan_backward_fixed::<4>(args, states, ds, g),
            Some(8) => scan_backward_fixed::<8>(args, states, ds, g),
            _ => scan_backward_any(args, states, ds, g),
        }
    }
}

/// What [`scan_backward`] reads: xbc, the head, dt, A, D, the chunk, the checkpoints and dy.
type BackwardInputs<'a> = (&'a [f32], HeadView, &'a [f32], f32, f32, usize, &'a [f32], &'a [f32]);

/// Recomputes the states of the chunk at `start` (`len` tokens) from its checkpoint into
/// `states` (len + 1 of them).
#[inline(always)]
fn recompute_chunk(inp: &BackwardInputs, start: usize, len: usize, states: &mut [f32]) {
    let (xbc, v, dt, a, _, _, checkpoints, _) = *inp;
    let (p_dim, n_dim) = (v.p, v.n);
    let pn = p_dim * n_dim;
    let c0 = start / inp.5;
    states[..pn].copy_from_slice(&checkpoints[c0 * pn..(c0 + 1) * pn]);
    for i in 0..len {
        let t = start + i;
        let row = &xbc[t * v.ld..];
        let (x, bm) = (&row[v.x..v.x + p_dim], &row[v.b..v.b + n_dim]);
        let alpha = exp(dt[t] * a);
        let (prev, next) = states[i * pn..(i + 2) * pn].split_at_mut(pn);
        for p in 0..p_dim {
            let u = x[p] * dt[t];
            for ((nv, &pv), &bv) in
                next[p * n_dim..(p + 1) * n_dim].iter_mut().zip(&prev[p * n_dim..(p + 1) * n_dim]).zip(bm)
            {
                *nv = pv.mul_add(alpha, u * bv);
            }
        }
    }
}

/// The per-token tail of the adjoint step: d dt, d x and the (dA, dD) contributions, from
/// du = ds·B per row and dα.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn finish_token(
    inp: &BackwardInputs,
    t: usize,
    du: &[f32],
    dalpha: f32,
    g: &mut HeadGrads<'_>,
    da: &mut f64,
    dd: &mut f64,
) {
    let (xbc, v, dt, a, d_skip, _, _, dy) = *inp;
    let p_dim = v.p;
    let x = &xbc[t * v.ld + v.x..][..p_dim];
    let dyt = &dy[t * p_dim..(t + 1) * p_dim];
    let dt_t = dt[t];
    let alpha = exp(dt_t * a);
    // α = exp(dt·A): dla = dα·α; la = dt·A.
    let dla = dalpha * alpha;
    *da += f64::from(dla * dt_t);
    let mut ddt = dla * a;
    let dxt = &mut g.dx[t * p_dim..(t + 1) * p_dim];
    for p in 0..p_dim {
        ddt = x[p].mul_add(du[p], ddt);
        dxt[p] = dt_t.mul_add(du[p], d_skip * dyt[p]);
        *dd += f64::from(dyt[p] * x[p]);
    }
    g.ddt[t] = ddt;
}

/// [`scan_backward`] for any d_state.
#[inline(always)]
fn scan_backward_any(inp: BackwardInputs, states: &mut [f32], ds: &mut [f32], mut g: HeadGrads<'_>) -> (f64, f64) {
    let (xbc, v, dt, a, _, chunk, _, dy) = inp;
    let (p_dim, n_dim) = (v.p, v.n);
    let pn = p_dim * n_dim;
    let t_len = dt.len();
    let (mut da, mut dd) = (0f64, 0f64);
    let mut du = vec![0f32; p_dim];
    ds.fill(0.0);
    for c0 in (0..t_len.div_ceil(chunk)).rev() {
        let start = c0 * chunk;
        let len = chunk.min(t_len - start);
        recompute_chunk(&inp, start, len, states);
        for i in (0..len).rev() {
            let t = start + i;
            let row = &xbc[t * v.ld..];
            let (x, bm, cm) = (&row[v.x..v.x + p_dim], &row[v.b..v.b + n_dim], &row[v.c..v.c + n_dim]);
            let dt_t = dt[t];
            let alpha = exp(dt_t * a);
            let dyt = &dy[t * p_dim..(t + 1) * p_dim];
            let (prev, cur) = states[i * pn..(i + 2) * pn].split_at(pn);
            let dbt = &mut g.db[t * n_dim..(t + 1) * n_dim];
            let dct = &mut g.dc[t * n_dim..(t + 1) * n_dim];
            dbt.fill(0.0);
            dct.fill(0.0);
            let mut dalpha = 0.0f32;
            for p in 0..p_dim {
                let span = p * n_dim..(p + 1) * n_dim;
                let dsp = &mut ds[span.clone()];
                let gy = dyt[p];
                // y_t = s_t·C_t: ds_t += dy ⊗ C, dC += s_t·dy.
                for ((dv, &cv), (dcv, &sv)) in dsp.iter_mut().zip(cm).zip(dct.iter_mut().zip(&cur[span.clone()])) {
                    *dv = gy.mul_add(cv, *dv);
                    *dcv = gy.mul_add(sv, *dcv);
                }
                // s_t = α·s_{t−1} + u⊗B: du = ds·B, dB += ds·u, dα += ds·s_{t−1}.
                let u = x[p] * dt_t;
                du[p] = dot(dsp, bm);
                dalpha += dot(dsp, &prev[span]);
                for (dbv, &dv) in dbt.iter_mut().zip(dsp.iter()) {
                    *dbv = dv.mul_add(u, *dbv);
                }
                for dv in dsp.iter_mut() {
                    *dv *= alpha;
                }
            }
            finish_token(&inp, t, &du, dalpha, &mut g, &mut da, &mut dd);
        }
    }
    (da, dd)
}

/// [`scan_backward`] for d_state = NV · [`LANES`]: the token's B and C, and its dB and dC
/// sums, stay in registers, and each adjoint row is read and written once per token.
///
/// It repeats [`scan_backward_any`]'s walk over chunks and tokens on purpose: sharing it through
/// a closure compiled the token's loop without `simd_fn!`'s target features (a closure does not
/// get them from the function it is inlined into), and the training step ran 5× slower.
#[inline(always)]
fn scan_backward_fixed<const NV: usize>(
    inp: BackwardInputs,
    states: &mut [f32],
    ds: &mut [f32],
    mut g: HeadGrads<'_>,
) -> (f64, f64) {
    let (xbc, v, dt, a, _, chunk, _, dy) = inp;
    let (p_dim, n_dim) = (v.p, NV * LANES);
    let pn = p_dim * n_dim;
    let t_len = dt.len();
    let (mut da, mut dd) = (0f64, 0f64);
    let mut du = vec![0f32; p_dim];
    ds.fill(0.0);
    for c0 in (0..t_len.div_ceil(chunk)).rev() {
        let start = c0 * chunk;
        let len = chunk.min(t_len - start);
        recompute_chunk(&inp, start, len, states);
        for i in (0..len).rev() {
            let t = start + i;
            let row = &xbc[t * v.ld..];
            let x = &row[v.x..v.x + p_dim];
            let (b, c) = (vectors::<NV>(&row[v.b..]), vectors::<NV>(&row[v.c..]));
            let dt_t = dt[t];
            let alpha = exp(dt_t * a);
            let dyt = &dy[t * p_dim..(t + 1) * p_dim];
            let (prev, cur) = states[i * pn..(i + 2) * pn].split_at(pn);
            let mut db = [[0.0f32; LANES]; NV];
            let mut dc = [[0.0f32; LANES]; NV];
            let mut dalpha = [0.0f32; LANES];
            for p in 0..p_dim {
                let (gy, u) = (dyt[p], x[p] * dt_t);
                let dsp = &mut ds[p * n_dim..(p + 1) * n_dim];
                let (sp, pp) = (&cur[p * n_dim..(p + 1) * n_dim], &prev[p * n_dim..(p + 1) * n_dim]);
                let mut dup = [0.0f32; LANES];
                for j in 0..NV {
                    for l in 0..LANES {
                        let k = j * LANES + l;
                        // y_t = s_t·C_t: ds_t += dy ⊗ C, dC += s_t·dy; then s_t = α·s_{t−1} + u⊗B:
                        // du = ds·B, dB += ds·u, dα += ds·s_{t−1}, ds_{t−1} = α·ds_t.
                        let d = gy.mul_add(c[j][l], dsp[k]);
                        dc[j][l] = gy.mul_add(sp[k], dc[j][l]);
                        dup[l] = d.mul_add(b[j][l], dup[l]);
                        dalpha[l] = d.mul_add(pp[k], dalpha[l]);
                        db[j][l] = d.mul_add(u, db[j][l]);
                        dsp[k] = d * alpha;
                    }
                }
                du[p] = dup.iter().sum();
            }
            g.db[t * n_dim..(t + 1) * n_dim].copy_from_slice(db.as_flattened());
            g.dc[t * n_dim..(t + 1) * n_dim].copy_from_slice(dc.as_flattened());
            finish_token(&inp, t, &du, dalpha.iter().sum(), &mut g, &mut da, &mut dd);
        }
    }
    (da, dd)
}

// ---------------------------------------------------------------------------------------------
// Gated RMSNorm: normed = rmsnorm_groups(y · silu(z)) · w

simd_fn! {
    /// One row: v = y·silu(z), then grouped RMSNorm; writes `inv` per group and `out`.
    pub fn gated_norm_row(y: &[f32], z: &[f32], w: &[f32], eps: f32, inv: &mut [f32], out: &mut [f32]) {
        for ((o, &yv), &zv) in out.iter_mut().zip(y).zip(z) {
            *o = yv * zv * sigmoid(zv);
        }
        let gw = y.len() / inv.len();
        for (g, r) in inv.iter_mut().enumerate() {
            let vs = &mut out[g * gw..(g + 1) * gw];
            let ss = dot(vs, vs);
            *r = 1.0 / (ss / gw as f32 + eps).sqrt();
            for (o, &wv) in vs.iter_mut().zip(&w[g * gw..(g + 1) * gw]) {
                *o *= *r * wv;
            }
        }
    }
}

simd_fn! {
    /// One row of the gated norm's backward from `g` (d out): writes dy and dz, and v̂ = v·r
    /// into `vhat` (for the weight gradient).
    pub fn gated_norm_row_backward(
        y: &[f32],
        z: &[f32],
        w: &[f32],
        inv: &[f32],
        g: &[f32],
        vhat: &mut [f32],
        dy: &mut [f32],
        dz: &mut [f32],
    ) {
        let gw = y.len() / inv.len();
        for (grp, &r) in inv.iter().enumerate() {
            let span = grp * gw..(grp + 1) * gw;
            let mut acc = 0.0f32;
            for i in span.clone() {
                let v = y[i] * z[i] * sigmoid(z[i]);
                vhat[i] = v * r;
                acc = (g[i] * w[i]).mul_add(vhat[i], acc);
            }
            let mean = acc / gw as f32;
            for i in span {
                let dv = r * (g[i] * w[i] - vhat[i] * mean);
                let sz = sigmoid(z[i]);
                dy[i] = dv * z[i] * sz;
                dz[i] = dv * y[i] * sz * (1.0 + z[i] * (1.0 - sz));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy over a block of logits

simd_fn! {
    /// One row: returns the loss −log softmax(row)[target] and, when `scale` is given, replaces
    /// the row by scale·(softmax − one-hot).
    pub fn xent_row(row: &mut [f32], target: usize, scale: Option<f32>) -> f64 {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut acc = [0.0f32; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for ch in &mut chunks {
            for i in 0..LANES {
                acc[i] += exp(ch[i] - max);
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|&x| exp(x - max)).sum();
        let sum = f64::from(acc.iter().sum::<f32>() + tail);
        let lse = f64::from(max) + sum.ln();
        let loss = lse - f64::from(row[target]);
        if let Some(scale) = scale {
            let shift = lse as f32;
            for x in row.iter_mut() {
                *x = scale * exp(*x - shift);
            }
            row[target] -= scale;
        }
        loss
    }
}

/// The gradient of silu through the pre-activation, rows in parallel.
pub fn silu_backward_rows(pre: &[f32], d: &mut [f32], width: usize) {
    d.par_chunks_mut(width * 64).zip(pre.par_chunks(width * 64)).for_each(|(g, p)| silu_backward(p, g));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_orientations_match_naive() {
        let (m, k, n) = (5, 7, 3);
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0).collect();
        let mut y = vec![0.0; m * n];
        linear(Matmul::F32, &x, m, k, &w, n, &mut y);
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|l| x[i * k + l] * w[j * k + l]).sum();
                assert!((y[i * n + j] - want).abs() < 1e-5);
            }
        }
        let dy: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut dx = vec![0.0; m * k];
        let mut dw = vec![1.0; n * k];
        linear_backward(Matmul::F32, &x, m, k, &w, n, &dy, Some(&mut dx), &mut dw);
        for i in 0..m {
            for l in 0..k {
                let want: f32 = (0..n).map(|j| dy[i * n + j] * w[j * k + l]).sum();
                assert!((dx[i * k + l] - want).abs() < 1e-5);
            }
        }
        for j in 0..n {
            for l in 0..k {
                let want: f32 = 1.0 + (0..m).map(|i| dy[i * n + j] * x[i * k + l]).sum::<f32>();
                assert!((dw[j * k + l] - want).abs() < 1e-5);
            }
        }
    }
}
