//! The CPU engine: Mamba-2 on host f32 slices, multi-threaded with rayon.
//!
//! One code path serves prefill (T tokens) and decode (T = 1): projections are matrix products
//! (gemm for T > 1, a bandwidth-bound matrix-vector kernel for T = 1), the causal convolution
//! reads the state's conv tail as its first K-1 rows, and the selective scan runs head by head
//! so each head's (P, N) state stays in L1 while all T tokens stream past it.

pub mod bf16_dot;
pub mod bf16_gemm;
pub mod bf16_tiles;
pub mod f16_state;
pub mod kernels;
mod pool;
#[cfg(target_arch = "x86_64")]
pub mod scan_avx2;
#[cfg(target_arch = "x86_64")]
pub mod scan_avx512;

use rayon::prelude::*;

use crate::config::Mamba2Config;
use crate::state::{LayerState, SsmValue, State};
use crate::weights::Mamba2Weights;
use kernels::Matrix;
pub use pool::on_pool;

/// Rows per rayon task for row-wise work (conv, norms); small enough to balance two cores.
pub(crate) const ROW_CHUNK: usize = 16;

/// Storage precision of the large matrices (projections, embedding, LM head). Small tensors
/// (norms, conv, dt, A, D) and all arithmetic stay f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDtype {
    /// Exact.
    #[default]
    F32,
    /// Half the bytes, so decode (which streams every weight per token) runs about twice as fast.
    Bf16,
}

impl std::str::FromStr for WeightDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            other => Err(format!("unknown weight dtype {other:?}: use f32 or bf16")),
        }
    }
}

/// A Mamba-2 model ready to run on the CPU.
#[derive(Debug)]
pub struct CpuMamba2 {
    config: Mamba2Config,
    io: TokenIo,
    layers: Vec<CpuLayer>,
}

/// What every Mamba shares around its blocks: the token embedding, the final RMSNorm and the
/// LM head (tied to the embedding or not).
#[derive(Debug)]
pub(crate) struct TokenIo {
    embedding: Matrix,
    /// Untied LM head; `None` uses the embedding.
    lm_head: Option<Matrix>,
    norm_f: Vec<f32>,
    norm_eps: f32,
    d_model: usize,
    vocab: usize,
}

impl TokenIo {
    /// Stores the large matrices in `dtype`.
    pub(crate) fn new(
        embedding: Vec<f32>,
        lm_head: Option<Vec<f32>>,
        norm_f: Vec<f32>,
        norm_eps: f64,
        vocab: usize,
        dtype: WeightDtype,
    ) -> Self {
        let d_model = norm_f.len();
        Self {
            embedding: Matrix::new(embedding, d_model, dtype),
            lm_head: lm_head.map(|m| Matrix::new(m, d_model, dtype)),
            norm_f,
            norm_eps: norm_eps as f32,
            d_model,
            vocab,
        }
    }

    /// Embedding rows of `tokens` (T × d_model).
    pub(crate) fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let d = self.d_model;
        let mut h = vec![0.0f32; tokens.len() * d];
        for (row, &tok) in h.chunks_exact_mut(d).zip(tokens) {
            self.embedding.row_into(tok as usize, row);
        }
        h
    }

    /// The final RMSNorm of every row.
    pub(crate) fn final_norm(&self, h: &[f32]) -> Vec<f32> {
        let d = self.d_model;
        let mut out = vec![0.0f32; h.len()];
        rows_par(h, &mut out, d, d, |x, o| kernels::rmsnorm(x, &self.norm_f, self.norm_eps, o));
        out
    }

    /// The LM head matrix (vocab × d_model).
    fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// Logits (rows × vocab) of `rows` final hidden states. `Rows::Independent` computes
    /// each row exactly as it would be alone (a batch of decode steps).
    pub(crate) fn logits(&self, hidden: &[f32], kind: Rows) -> Vec<f32> {
        let (d, v) = (self.d_model, self.vocab);
        let rows = hidden.len() / d;
        let mut out = vec![0.0f32; rows * v];
        on_pool(|| kind.matmul_t(hidden, rows, d, self.head(), v, &mut out, false));
        out
    }

    /// log p(targets[i] | hidden row i) for each row, computed in blocks so the full
    /// (T × vocab) logits never exist at once.
    pub(crate) fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        on_pool(|| self.logprobs_on_pool(hidden, targets))
    }

    fn logprobs_on_pool(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        let (d, v) = (self.d_model, self.vocab);
        const BLOCK: usize = 128;
        let mut out = Vec::with_capacity(targets.len());
        let mut logits = vec![0.0f32; BLOCK * v];
        for (hb, tb) in hidden.chunks(BLOCK * d).zip(targets.chunks(BLOCK)) {
            let rows = tb.len();
            let lg = &mut logits[..rows * v];
            kernels::matmul_t(&hb[..rows * d], rows, d, self.head(), v, lg, false);
            let block: Vec<f32> = lg
                .par_chunks(v)
                .zip(tb.par_iter())
                .map(|(row, &tg)| kernels::log_softmax_at(row, tg as usize))
                .collect();
            out.extend(block);
        }
        out
    }
}

/// One block, laid out for the kernels.
#[derive(Debug)]
pub(crate) struct CpuLayer {
    norm: Vec<f32>,
    in_proj: Matrix,
    in_proj_bias: Option<Vec<f32>>,
    /// Conv kernel transposed to (K, C) so each tap is a contiguous row.
    conv_wt: Vec<f32>,
    /// Conv bias (zeros when the model has none).
    conv_bias: Vec<f32>,
    dt_bias: Vec<f32>,
    /// A = -exp(A_log) per head.
    a: Vec<f32>,
    d: Vec<f32>,
    gated_norm: Vec<f32>,
    out_proj: Matrix,
    out_proj_bias: Option<Vec<f32>>,
}

impl CpuLayer {
    /// Lays out one block's weights for the kernels, the large matrices in `dtype`.
    pub(crate) fn new(
        l: crate::weights::LayerWeights,
        config: &Mamba2Config,
        dtype: WeightDtype,
        kernel: kernels::Bf16Kernel,
    ) -> Self {
        let (c, k) = (config.conv_dim(), config.d_conv);
        let mat = |v: Vec<f32>, cols: usize| Matrix::with_kernel(v, cols, dtype, kernel);
        let mut conv_wt = vec![0.0; k * c];
        for ch in 0..c {
            for j in 0..k {
                conv_wt[j * c + ch] = l.conv_weight[ch * k + j];
            }
        }
        CpuLayer {
            norm: l.norm,
            in_proj: mat(l.in_proj, config.d_model),
            in_proj_bias: l.in_proj_bias,
            conv_wt,
            conv_bias: l.conv_bias.unwrap_or_else(|| vec![0.0; c]),
            dt_bias: l.dt_bias,
            a: l.a_log.iter().map(|v| -v.exp()).collect(),
            d: l.d,
            gated_norm: l.gated_norm,
            out_proj: mat(l.out_proj, config.d_inner()),
            out_proj_bias: l.out_proj_bias,
        }
    }

    /// Whether both projections are batch-invariant.
    pub(crate) fn batch_invariant(&self) -> bool {
        self.in_proj.batch_invariant() && self.out_proj.batch_invariant()
    }
}

impl CpuMamba2 {
    /// Takes ownership of validated weights, storing the large matrices in `dtype`.
    pub fn new(config: Mamba2Config, weights: Mamba2Weights, dtype: WeightDtype) -> Self {
        Self::with_kernel(config, weights, dtype, kernels::Bf16Kernel::detect())
    }

    /// As [`CpuMamba2::new`], with the layers' bf16 projections on a chosen kernel (`Dot` runs
    /// without the instruction too, slowly): tests reach either kernel on any CPU.
    pub fn with_kernel(
        config: Mamba2Config,
        weights: Mamba2Weights,
        dtype: WeightDtype,
        kernel: kernels::Bf16Kernel,
    ) -> Self {
        let layers = weights.layers.into_iter().map(|l| CpuLayer::new(l, &config, dtype, kernel)).collect();
        let io =
            TokenIo::new(weights.embedding, weights.lm_head, weights.norm_f, config.norm_eps, config.vocab_size, dtype);
        Self { config, io, layers }
    }

    /// The config.
    pub fn config(&self) -> &Mamba2Config {
        &self.config
    }

    /// Whether a batched forward pass gives each sequence its lone result to the bit: true when
    /// every projection is batch-invariant ([`Matrix::batch_invariant`]); the conv, scan and
    /// norms work per sequence or per row anyway.
    pub fn batch_invariant(&self) -> bool {
        self.layers.iter().all(CpuLayer::batch_invariant)
    }

    /// Runs `tokens` from `state` (updated in place) and returns the final-normed hidden
    /// states (T × d_model), ready for the LM head. Token ids must be in range (checked by
    /// the caller).
    pub fn forward(&self, tokens: &[u32], state: &mut State) -> Vec<f32> {
        self.forward_batch(tokens, &[tokens.len()], &mut [state])
    }

    /// Runs several sequences at once: `tokens` holds the `lens[i]` new tokens of sequence i
    /// after those of sequence i-1, each continuing from `states[i]` (updated in place). The
    /// projections read each weight once for all rows, so B decode steps cost little more
    /// than one; each sequence gets what [`CpuMamba2::forward`] gives it alone. Returns the
    /// final-normed hidden states of every row.
    /// The SSM values may be held as f16 ([`SsmValue`]).
    pub fn forward_batch<S: SsmValue>(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State<S>]) -> Vec<f32> {
        run_layers(&self.io, &self.layers, tokens, lens, states, |lw, ls, lens, kind, h| {
            self.layer(lw, ls, lens, kind, h)
        })
    }

    /// One Mamba-2 block on `h` (rows × d_model: the sequences' rows one after another),
    /// residual included.
    fn layer<S: SsmValue>(
        &self,
        lw: &CpuLayer,
        states: &mut [&mut LayerState<S>],
        lens: &[usize],
        kind: Rows,
        h: &mut [f32],
    ) {
        let c = &self.config;
        let d = c.d_model;
        let mut xn = vec![0.0f32; h.len()];
        rows_par(h, &mut xn, d, d, |x, o| kernels::rmsnorm(x, &lw.norm, c.norm_eps as f32, o));
        mamba2_mixer(c, lw, &xn, states, lens, kind, h, true);
    }

    /// Logits (rows × vocab) of `rows` final hidden states.
    pub fn logits(&self, hidden: &[f32], kind: Rows) -> Vec<f32> {
        self.io.logits(hidden, kind)
    }

    /// `log p(targets[i] | hidden row i)` for each row.
    pub fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        self.io.logprobs(hidden, targets)
    }
}

/// The Mamba-2 mixer of one block on the normed rows `xn` (rows × d_model: the sequences'
/// rows one after another): in_proj, each sequence's conv and scan from its own state, the
/// gated RMSNorm and out_proj, written to `out` (rows × d_model), or added to it with `acc`.
/// Mamba-2 blocks and the Mamba layers of hybrids share it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mamba2_mixer<S: SsmValue>(
    c: &Mamba2Config,
    lw: &CpuLayer,
    xn: &[f32],
    states: &mut [&mut LayerState<S>],
    lens: &[usize],
    kind: Rows,
    out: &mut [f32],
    acc: bool,
) {
    let (d, di) = (c.d_model, c.d_inner());
    let width = c.d_in_proj();
    let rows = xn.len() / d;

    // in_proj: zxbcdt (rows × width) = [z | xBC | dt].
    let mut zxbcdt = vec![0.0f32; rows * width];
    kind.matmul_t(xn, rows, d, &lw.in_proj, width, &mut zxbcdt, false);
    if let Some(b) = &lw.in_proj_bias {
        add_bias_rows(&mut zxbcdt, b);
    }

    // Each sequence's conv and scan from its own state. A batch whose states outgrow the
    // cache reads each from memory once per step: the scan prefetches it ahead.
    let layer_bytes: usize = states.iter().map(|ls| std::mem::size_of_val(&ls.ssm[..])).sum();
    let from_memory = crate::memory::outgrows_cache(c.n_layer * layer_bytes);
    let mut gated = vec![0.0f32; rows * di];
    per_sequence(states, lens, &zxbcdt, width, &mut gated, di, |ls, zx, t, o| {
        mixer_sequence(c, lw, ls, zx, t, from_memory, o)
    });

    kind.matmul_t(&gated, rows, di, &lw.out_proj, d, out, acc);
    if let Some(b) = &lw.out_proj_bias {
        add_bias_rows(out, b);
    }
}

/// The part of a block that carries state, for one sequence: the causal conv, the selective
/// scan and the gated RMSNorm of its `t` rows of in_proj output `zxbcdt`, written to `gated`
/// (t × d_inner). `from_memory`: see [`kernels::ScanInputs`].
fn mixer_sequence<S: SsmValue>(
    c: &Mamba2Config,
    lw: &CpuLayer,
    ls: &mut LayerState<S>,
    zxbcdt: &[f32],
    t: usize,
    from_memory: bool,
    gated: &mut [f32],
) {
    if t == 0 {
        return;
    }
    let (di, conv_dim, k) = (c.d_inner(), c.conv_dim(), c.d_conv);
    let (nh, p, n, g) = (c.nheads, c.headdim, c.d_state, c.n_groups);
    let width = c.d_in_proj();

    // Causal depthwise conv over [tail; xBC], then SiLU.
    let xbc = causal_conv_silu(zxbcdt, width, di, t, conv_dim, k, &lw.conv_wt, &lw.conv_bias, &mut ls.conv);

    // dt = clamp(softplus(dt_raw + dt_bias)); per-head decay exp(dt·A); head-major (H × T).
    let (lo, hi) = c.time_step_limit;
    let mut dt = vec![0.0f32; nh * t];
    let mut decay = vec![0.0f32; nh * t];
    for hd in 0..nh {
        let a = lw.a[hd];
        let mut log_decay = 0.0f64;
        for ti in 0..t {
            let raw = zxbcdt[ti * width + di + conv_dim + hd] + lw.dt_bias[hd];
            let v = (kernels::softplus(raw) as f64).clamp(lo, hi) as f32;
            dt[hd * t + ti] = v;
            decay[hd * t + ti] = (v * a).exp();
            log_decay += (v * a) as f64;
        }
        ls.log_decay[hd] = (ls.log_decay[hd] as f64 + log_decay) as f32;
    }

    // Selective scan, one head per task; y is head-major (H × T × P).
    let heads_per_group = nh / g;
    let mut y = vec![0.0f32; nh * t * p];
    ls.ssm.par_chunks_mut(p * n).zip(y.par_chunks_mut(t * p)).enumerate().for_each(|(hd, (s, yh))| {
        let grp = hd / heads_per_group;
        let head = kernels::ScanInputs {
            xbc: &xbc,
            stride: conv_dim,
            x_off: hd * p,
            b_off: di + grp * n,
            c_off: di + g * n + grp * n,
            p_dim: p,
            n_dim: n,
            dt: &dt[hd * t..(hd + 1) * t],
            decay: &decay[hd * t..(hd + 1) * t],
            d_skip: lw.d[hd],
            from_memory,
        };
        S::scan_head(s, &head, yh);
    });

    // Gated RMSNorm per token.
    gated.par_chunks_mut(di).enumerate().for_each(|(ti, o)| {
        let mut yt = vec![0.0f32; di];
        for hd in 0..nh {
            yt[hd * p..(hd + 1) * p].copy_from_slice(&y[(hd * t + ti) * p..(hd * t + ti + 1) * p]);
        }
        let z = &zxbcdt[ti * width..ti * width + di];
        kernels::gated_rmsnorm(&yt, z, &lw.gated_norm, di / g, c.gated_norm_eps as f32, o);
    });
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
        kernels::conv_step_silu(&input[offset..offset + c], wt, bias, k, tail, &mut out);
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
        kernels::conv_silu(&seq[start..start + (rows + kt) * c], wt, bias, c, k, o);
    });
    for ch in 0..c {
        for j in 0..kt {
            tail[ch * kt + j] = seq[(t + j) * c + ch];
        }
    }
    out
}

/// What the rows of a forward pass are, which decides how its matrix products run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Tokens of sequences being prefilled: one matrix product (gemm) for all rows.
    Tokens,
    /// One decode step of each of several sequences: each row is multiplied exactly as it
    /// would be alone, so batching never changes a sequence's results (each weight is still
    /// read once for all rows).
    Independent,
}

impl Rows {
    /// `Independent` when every sequence brings one token (decode steps), else `Tokens`.
    pub fn of(lens: &[usize]) -> Self {
        if lens.iter().all(|&t| t == 1) {
            Rows::Independent
        } else {
            Rows::Tokens
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_t(self, x: &[f32], m: usize, k: usize, w: &Matrix, n: usize, out: &mut [f32], acc: bool) {
        match self {
            Rows::Tokens => kernels::matmul_t(x, m, k, w, n, out, acc),
            Rows::Independent => kernels::matmul_rows_t(x, m, k, w, n, out, acc),
        }
    }
}

/// Embeds the tokens of a batch of sequences (`lens[i]` tokens of sequence i, one after
/// another), runs `layer(weights, states of that layer, lens, rows kind, hidden)` for each
/// layer and returns the final-normed hidden states. Shared by the Mamba-1 and Mamba-2 engines.
///
/// Sequences of one token and longer ones run as two passes, so that a sequence's bits never
/// depend on the others: a lone token is a decode step ([`Rows::Independent`]), while rows of
/// longer sequences may share a faster product ([`Rows::Tokens`], e.g. gemm) whose bits
/// differ from a decode step's.
pub(crate) fn run_layers<L, S>(
    io: &TokenIo,
    layers: &[L],
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State<S>],
    layer: impl Fn(&L, &mut [&mut LayerState<S>], &[usize], Rows, &mut [f32]) + Sync,
) -> Vec<f32>
where
    L: Sync,
    S: Send,
{
    by_kind(io.d_model, tokens, lens, states, |tokens, lens, states| {
        run_layers_of_one_kind(io, layers, tokens, lens, states, &layer)
    })
}

/// Runs a batch as at most two passes, its single tokens and its longer sequences apart, with
/// `run(tokens, lens, states)` (each pass's rows of width `d`), and puts the rows back in the
/// sequences' order: a lone token keeps its decode-step bits whatever else is in the batch.
/// Every CPU engine's batched forward goes through it.
pub(crate) fn by_kind<S: Send>(
    d: usize,
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State<S>],
    run: impl Fn(&[u32], &[usize], &mut [&mut State<S>]) -> Vec<f32>,
) -> Vec<f32> {
    assert_eq!(lens.iter().sum::<usize>(), tokens.len(), "lens must add up to the tokens");
    assert_eq!(lens.len(), states.len(), "one state per sequence");
    if tokens.is_empty() {
        return Vec::new();
    }
    let singles = lens.iter().filter(|&&t| t == 1).count();
    if singles == 0 || singles == lens.len() {
        return run(tokens, lens, states);
    }
    // Split by kind, run each part, and put the rows back in the sequences' order.
    let (mut one, mut many) = ((Vec::new(), Vec::new(), Vec::new()), (Vec::new(), Vec::new(), Vec::new()));
    let mut rest = tokens;
    for (s, &t) in states.iter_mut().zip(lens) {
        let (seq, tail) = rest.split_at(t);
        rest = tail;
        let part = if t == 1 { &mut one } else { &mut many };
        part.0.extend_from_slice(seq);
        part.1.push(t);
        part.2.push(&mut **s);
    }
    let h_one = run(&one.0, &one.1, &mut one.2);
    let h_many = run(&many.0, &many.1, &mut many.2);
    let (mut from_one, mut from_many) = (h_one.chunks_exact(d), h_many.chunks(d));
    let mut h = Vec::with_capacity(tokens.len() * d);
    for &t in lens {
        if t == 1 {
            h.extend_from_slice(from_one.next().expect("one row per single token"));
        } else {
            (0..t).for_each(|_| h.extend_from_slice(from_many.next().expect("t rows per sequence")));
        }
    }
    h
}

/// [`run_layers`] of sequences that are all single tokens or all longer.
fn run_layers_of_one_kind<L: Sync, S: Send>(
    io: &TokenIo,
    layers: &[L],
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State<S>],
    layer: &(impl Fn(&L, &mut [&mut LayerState<S>], &[usize], Rows, &mut [f32]) + Sync),
) -> Vec<f32> {
    on_pool(|| {
        let mut h = io.embed(tokens);
        let kind = Rows::of(lens);
        for (l, lw) in layers.iter().enumerate() {
            let mut ls: Vec<&mut LayerState<S>> = states.iter_mut().map(|s| &mut s.layers[l]).collect();
            layer(lw, &mut ls, lens, kind, &mut h);
        }
        for (s, &t) in states.iter_mut().zip(lens) {
            s.advance(t);
        }
        io.final_norm(&h)
    })
}

/// Runs `f(state, input rows, t, output rows)` for each sequence of a batch, in parallel:
/// sequence i owns `lens[i]` consecutive rows of `input` (width `in_width`) and of `output`.
pub(crate) fn per_sequence<S: Send>(
    states: &mut [&mut LayerState<S>],
    lens: &[usize],
    input: &[f32],
    in_width: usize,
    output: &mut [f32],
    out_width: usize,
    f: impl Fn(&mut LayerState<S>, &[f32], usize, &mut [f32]) + Sync,
) {
    let (mut input, mut output) = (input, output);
    let mut seqs = Vec::with_capacity(lens.len());
    for (ls, &t) in states.iter_mut().zip(lens) {
        let (i, rest_in) = input.split_at(t * in_width);
        let (o, rest_out) = std::mem::take(&mut output).split_at_mut(t * out_width);
        (input, output) = (rest_in, rest_out);
        seqs.push((&mut **ls, i, t, o));
    }
    seqs.into_par_iter().for_each(|(ls, i, t, o)| f(ls, i, t, o));
}

/// Applies `f(input_row_block, output_row_block)` over row blocks in parallel.
pub(crate) fn rows_par(x: &[f32], out: &mut [f32], din: usize, dout: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    out.par_chunks_mut(ROW_CHUNK * dout).enumerate().for_each(|(i, o)| {
        let rows = o.len() / dout;
        f(&x[i * ROW_CHUNK * din..(i * ROW_CHUNK + rows) * din], o);
    });
}

pub(crate) fn add_bias_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::kernels::Bf16Kernel;
    use super::*;

    /// The pair layout makes a batched forward pass give each sequence its lone result to the bit
    /// (what batched ingest relies on), on every CPU: without AVX512-BF16 the portable sums run,
    /// `Tiles` runs on AMX where the CPU has it and `DotFma` FMAs where they give the
    /// instruction's bits (else both as `Dot`). A lone token among longer
    /// sequences keeps its decode-step bits.
    #[test]
    fn a_batched_forward_on_the_pair_layout_gives_each_sequence_its_lone_bits() {
        let c = Mamba2Config { d_model: 64, headdim: 16, ..Mamba2Config::tiny(2, 4) };
        for (kernel, invariant) in
            [(Bf16Kernel::Tiles, true), (Bf16Kernel::Dot, true), (Bf16Kernel::DotFma, true), (Bf16Kernel::Widen, false)]
        {
            let m = CpuMamba2::with_kernel(c.clone(), Mamba2Weights::random(&c, 11), WeightDtype::Bf16, kernel);
            assert_eq!(m.batch_invariant(), invariant, "{kernel:?}");
        }
        for kernel in [Bf16Kernel::Tiles, Bf16Kernel::Dot, Bf16Kernel::DotFma] {
            let m = CpuMamba2::with_kernel(c.clone(), Mamba2Weights::random(&c, 11), WeightDtype::Bf16, kernel);
            for lens in [vec![5usize, 1, 9], vec![2, 3], vec![1, 1, 1]] {
                let total: usize = lens.iter().sum();
                let tokens: Vec<u32> = (0..total as u32).map(|i| (i * 37 + 3) % c.vocab_size as u32).collect();
                let zero = State::zeros(crate::state::StateShape::of(&c), "test");
                let mut batched = vec![zero.clone(); lens.len()];
                let mut refs: Vec<&mut State> = batched.iter_mut().collect();
                let hidden = m.forward_batch(&tokens, &lens, &mut refs);
                let mut start = 0;
                for (i, &t) in lens.iter().enumerate() {
                    let mut alone = zero.clone();
                    let h = m.forward(&tokens[start..start + t], &mut alone);
                    let d = c.d_model;
                    let at = format!("{kernel:?} lens {lens:?} sequence {i}");
                    assert!(hidden[start * d..(start + t) * d] == h[..], "{at}: hidden rows differ");
                    for (l, (a, b)) in alone.layers.iter().zip(&batched[i].layers).enumerate() {
                        assert!(a.ssm == b.ssm && a.conv == b.conv && a.log_decay == b.log_decay, "{at}, layer {l}");
                    }
                    start += t;
                }
            }
        }
    }
}
