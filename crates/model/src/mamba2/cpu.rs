//! The Mamba-2 CPU engine: each block an RMSNorm and the Mamba-2 mixer (in_proj, causal conv,
//! the per-head scan from the block's state, gated RMSNorm, out_proj). The hybrid's Mamba layers
//! run the same mixer (`mixer`).

use rayon::prelude::*;

use crate::cpu::conv::causal_conv_silu;
use crate::cpu::layers::run_layers;
use crate::cpu::matmul::{Bf16Kernel, Matrix};
use crate::cpu::rows::{add_bias_rows, per_sequence, rows_par, Rows};
use crate::cpu::token_io::TokenIo;
use crate::cpu::{activations, norm, scan, WeightDtype};
use crate::state::{LayerState, SsmValue, State};

use super::{GateNorm, LayerWeights, Mamba2Config, Mamba2Weights};

/// A Mamba-2 model ready to run on the CPU.
#[derive(Debug)]
pub struct CpuMamba2 {
    config: Mamba2Config,
    io: TokenIo,
    layers: Vec<CpuLayer>,
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
    pub(crate) fn new(l: LayerWeights, config: &Mamba2Config, dtype: WeightDtype, kernel: Bf16Kernel) -> Self {
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
        Self::with_kernel(config, weights, dtype, Bf16Kernel::detect())
    }

    /// As [`CpuMamba2::new`], with the layers' bf16 projections on a chosen kernel (`Dot` runs
    /// without the instruction too, slowly): tests reach either kernel on any CPU.
    pub fn with_kernel(config: Mamba2Config, weights: Mamba2Weights, dtype: WeightDtype, kernel: Bf16Kernel) -> Self {
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
        rows_par(h, &mut xn, d, d, |x, o| norm::rmsnorm(x, &lw.norm, c.norm_eps as f32, o));
        mixer(c, lw, &xn, states, lens, kind, h, true);
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
pub(crate) fn mixer<S: SsmValue>(
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
/// (t × d_inner). `from_memory`: see [`scan::ScanInputs`].
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
            let v = (activations::softplus(raw) as f64).clamp(lo, hi) as f32;
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
        let head = scan::ScanInputs {
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

    // Gate and RMSNorm per token.
    let eps = c.gated_norm_eps as f32;
    gated.par_chunks_mut(di).enumerate().for_each(|(ti, o)| {
        let mut yt = vec![0.0f32; di];
        for hd in 0..nh {
            yt[hd * p..(hd + 1) * p].copy_from_slice(&y[(hd * t + ti) * p..(hd * t + ti + 1) * p]);
        }
        let z = &zxbcdt[ti * width..ti * width + di];
        match c.gate_norm {
            GateNorm::NormGated => norm::gated_rmsnorm(&yt, z, &lw.gated_norm, di / g, eps, o),
            GateNorm::NormThenGate => norm::rmsnorm_then_gate(&yt, z, &lw.gated_norm, di / g, eps, o),
            GateNorm::GateOnly => {
                o.iter_mut().zip(yt.iter().zip(z)).for_each(|(o, (&y, &z))| *o = y * activations::silu(z))
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Bf16Kernel;

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
