//! The CPU engine for Mamba-1: the same kernels as Mamba-2 (projections, conv, norms), and a
//! selective scan whose decay exp(dt_{t,d}·A_{d,n}) is per (channel, state) element. Channels
//! are independent, so the scan runs blocks of 16 channels in parallel, vectorised across the
//! channels (N is often 16: too short to vectorise along), while the T tokens stream past.

use rayon::prelude::*;

use super::config::Mamba1Config;
use super::weights::{Mamba1LayerWeights, Mamba1Weights};
use crate::cpu::conv::causal_conv_silu;
use crate::cpu::layers::run_layers;
use crate::cpu::rows::{add_bias_rows, per_sequence, rows_par, Rows};
use crate::cpu::token_io::TokenIo;
use crate::cpu::Matrix;
use crate::cpu::LANES;
use crate::cpu::{activations, matmul, norm, scan, WeightDtype};
use crate::state::{LayerState, State};

/// One block: its pre-norm and its mixer.
#[derive(Debug)]
struct Layer {
    norm: Vec<f32>,
    mixer: Mixer,
}

/// A Mamba-1 mixer (in_proj to out_proj), laid out for the kernels; Jamba's layers run it too.
#[derive(Debug)]
pub(crate) struct Mixer {
    in_proj: Matrix,
    in_proj_bias: Option<Vec<f32>>,
    /// Conv kernel transposed to (K, D).
    conv_wt: Vec<f32>,
    conv_bias: Vec<f32>,
    x_proj: Matrix,
    /// Jamba's RMSNorms of the low-rank time step, B and C (weights of dt_rank, N, N), and
    /// their epsilon; `None` for Mamba-1 itself.
    inner_norms: Option<([Vec<f32>; 3], f32)>,
    dt_proj: Matrix,
    dt_proj_bias: Vec<f32>,
    /// A = -exp(A_log), (D, N).
    a: Vec<f32>,
    d: Vec<f32>,
    out_proj: Matrix,
    out_proj_bias: Option<Vec<f32>>,
}

impl Mixer {
    /// The mixer of `l` (its `norm` is not the mixer's and is left out), the large matrices
    /// stored in `dtype`, with Jamba's `inner_norms` if given.
    pub(crate) fn new(
        l: Mamba1LayerWeights,
        config: &Mamba1Config,
        dtype: WeightDtype,
        inner_norms: Option<([Vec<f32>; 3], f32)>,
    ) -> Self {
        let (di, k) = (config.d_inner(), config.d_conv);
        let mut conv_wt = vec![0.0; k * di];
        for ch in 0..di {
            for j in 0..k {
                conv_wt[j * di + ch] = l.conv_weight[ch * k + j];
            }
        }
        Self {
            in_proj: Matrix::new(l.in_proj, config.d_model, dtype),
            in_proj_bias: l.in_proj_bias,
            conv_wt,
            conv_bias: l.conv_bias.unwrap_or_else(|| vec![0.0; di]),
            // Small matrices stay exact whatever the storage of the large ones.
            x_proj: Matrix::new(l.x_proj, di, WeightDtype::F32),
            inner_norms,
            dt_proj: Matrix::new(l.dt_proj, config.dt_rank, WeightDtype::F32),
            dt_proj_bias: l.dt_proj_bias,
            a: l.a_log.iter().map(|v| -v.exp()).collect(),
            d: l.d,
            out_proj: Matrix::new(l.out_proj, di, dtype),
            out_proj_bias: l.out_proj_bias,
        }
    }

    /// The mixer on the normed rows `xn` (rows × d_model: the sequences' rows one after
    /// another, `lens[i]` of them continuing `states[i]`), its output written to `out`, or
    /// added to it when `acc`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        c: &Mamba1Config,
        xn: &[f32],
        states: &mut [&mut LayerState],
        lens: &[usize],
        kind: Rows,
        out: &mut [f32],
        acc: bool,
    ) {
        let (d, di) = (c.d_model, c.d_inner());
        let rows = xn.len() / d;
        // in_proj: xz (rows × 2D) = [x | z].
        let mut xz = vec![0.0f32; rows * 2 * di];
        kind.matmul_t(xn, rows, d, &self.in_proj, 2 * di, &mut xz, false);
        if let Some(b) = &self.in_proj_bias {
            add_bias_rows(&mut xz, b);
        }
        // Each sequence's conv and scan from its own state.
        let mut gated = vec![0.0f32; rows * di];
        per_sequence(states, lens, &xz, 2 * di, &mut gated, di, |ls, xz, t, out| self.scan(c, ls, xz, t, out));
        kind.matmul_t(&gated, rows, di, &self.out_proj, d, out, acc);
        if let Some(bias) = &self.out_proj_bias {
            add_bias_rows(out, bias);
        }
    }

    /// The part of a block that carries state, for one sequence: conv, projections to dt, B
    /// and C (each RMS-normed first on Jamba), the selective scan and the gate, from its `t`
    /// rows of in_proj output `xz`, written to `gated` (t × d_inner).
    fn scan(&self, c: &Mamba1Config, ls: &mut LayerState, xz: &[f32], t: usize, gated: &mut [f32]) {
        if t == 0 {
            return;
        }
        let (di, n, k, r) = (c.d_inner(), c.d_state, c.d_conv, c.dt_rank);

        // Causal depthwise conv over [tail; x], then SiLU.
        let xc = causal_conv_silu(xz, 2 * di, 0, t, di, k, &self.conv_wt, &self.conv_bias, &mut ls.conv);

        // x_proj → [dt_low | B | C] (Jamba: each RMS-normed); dt = softplus(dt_proj(dt_low) +
        // bias), all (T × ·).
        let xp = c.x_proj_dim();
        let mut xdbl = vec![0.0f32; t * xp];
        matmul::matmul_t(&xc, t, di, &self.x_proj, xp, &mut xdbl, false);
        if let Some(([w_dt, w_b, w_c], eps)) = &self.inner_norms {
            let mut x = vec![0.0f32; r.max(n)];
            for row in xdbl.chunks_exact_mut(xp) {
                for (part, w) in [(0..r, w_dt), (r..r + n, w_b), (r + n..xp, w_c)] {
                    let x = &mut x[..part.len()];
                    x.copy_from_slice(&row[part.clone()]);
                    norm::rmsnorm(x, w, *eps, &mut row[part]);
                }
            }
        }
        let low: Vec<f32> = xdbl.chunks_exact(xp).flat_map(|row| row[..r].iter().copied()).collect();
        let mut dt = vec![0.0f32; t * di];
        matmul::matmul_t(&low, t, r, &self.dt_proj, di, &mut dt, false);
        for row in dt.chunks_exact_mut(di) {
            for (v, b) in row.iter_mut().zip(&self.dt_proj_bias) {
                *v = activations::softplus(*v + b);
            }
        }

        // Selective scan, LANES channels per task, vectorised across channels; y block-major
        // (block, T, LANES).
        let b: Vec<f32> = xdbl.chunks_exact(xp).flat_map(|row| row[r..r + n].iter().copied()).collect();
        let cm: Vec<f32> = xdbl.chunks_exact(xp).flat_map(|row| row[r + n..].iter().copied()).collect();
        let mut y_blk = vec![0.0f32; di.div_ceil(LANES) * t * LANES];
        ls.ssm
            .par_chunks_mut(LANES * n)
            .zip(ls.log_decay.par_chunks_mut(LANES * n))
            .zip(y_blk.par_chunks_mut(t * LANES))
            .enumerate()
            .for_each(|(bi, ((s, ld), y))| {
                let ch0 = bi * LANES;
                let w = s.len() / n;
                let a = &self.a[ch0 * n..(ch0 + w) * n];
                let dt_sum = scan::scan_channels(s, a, &self.d[ch0..ch0 + w], &dt, &xc, di, ch0, &b, &cm, t, y);
                // The log-decay of element (c, j) grows by Σ_t dt_t·A_cj = A_cj·Σ_t dt_t.
                for (l, (ldc, ac)) in ld.chunks_exact_mut(n).zip(a.chunks_exact(n)).enumerate() {
                    for (v, &aj) in ldc.iter_mut().zip(ac) {
                        *v = (f64::from(*v) + f64::from(aj) * dt_sum[l]) as f32;
                    }
                }
            });

        // y · silu(z).
        gated.par_chunks_mut(di).enumerate().for_each(|(ti, o)| {
            let z = &xz[ti * 2 * di + di..(ti + 1) * 2 * di];
            for (ch, (ov, &zv)) in o.iter_mut().zip(z).enumerate() {
                *ov = y_blk[((ch / LANES) * t + ti) * LANES + ch % LANES] * activations::silu(zv);
            }
        });
    }
}

/// A Mamba-1 model ready to run on the CPU.
#[derive(Debug)]
pub struct CpuMamba1 {
    config: Mamba1Config,
    io: TokenIo,
    layers: Vec<Layer>,
}

impl CpuMamba1 {
    /// Takes ownership of validated weights, storing the large matrices in `dtype`.
    pub fn new(config: Mamba1Config, weights: Mamba1Weights, dtype: WeightDtype) -> Self {
        let layers = weights
            .layers
            .into_iter()
            .map(|mut l| Layer { norm: std::mem::take(&mut l.norm), mixer: Mixer::new(l, &config, dtype, None) })
            .collect();
        let io =
            TokenIo::new(weights.embedding, weights.lm_head, weights.norm_f, config.norm_eps, config.vocab_size, dtype);
        Self { config, io, layers }
    }

    /// The config.
    pub fn config(&self) -> &Mamba1Config {
        &self.config
    }

    /// Runs `tokens` from `state` (updated in place) and returns the final-normed hidden
    /// states (T × d_model).
    pub fn forward(&self, tokens: &[u32], state: &mut State) -> Vec<f32> {
        self.forward_batch(tokens, &[tokens.len()], &mut [state])
    }

    /// Several sequences at once, as [`crate::mamba2::CpuMamba2::forward_batch`].
    pub fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Vec<f32> {
        run_layers(&self.io, &self.layers, tokens, lens, states, |lw, ls, lens, kind, h| {
            self.layer(lw, ls, lens, kind, h)
        })
    }

    /// One Mamba-1 block on `h` (rows × d_model: the sequences' rows one after another),
    /// residual included.
    fn layer(&self, lw: &Layer, states: &mut [&mut LayerState], lens: &[usize], kind: Rows, h: &mut [f32]) {
        let c = &self.config;
        let d = c.d_model;
        let mut xn = vec![0.0f32; h.len()];
        rows_par(h, &mut xn, d, d, |x, o| norm::rmsnorm(x, &lw.norm, c.norm_eps as f32, o));
        lw.mixer.run(c, &xn, states, lens, kind, h, true);
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
