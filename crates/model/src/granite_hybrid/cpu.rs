//! The CPU engine of a Granite 4.0 H, Bamba, Nemotron-H or Falcon-H1 hybrid: each layer is an
//! RMSNorm, a mixer (the Mamba-2 mixer the Mamba-2 engine runs, grouped-query attention over the
//! state's keys and values, or on Falcon-H1 both on the same normed rows, each added to the
//! residual stream), the residual scaled by `residual_multiplier`, then (unless a Nemotron-H
//! mixer has none) an RMSNorm and the MLP (SwiGLU, or Nemotron-H's relu²) plus the routed
//! experts.
//!
//! Prefill (T tokens) and decode (T = 1) are one code path: a sequence's new keys and values
//! are appended to its state, and each new token attends to every key before it (a composed
//! state's union of contexts included), so scoring `a + b` equals scoring `b` from the state
//! of `a`. MoE layers multiply each token only by the experts it is routed to.

use rayon::prelude::*;

use super::config::{GraniteHybridConfig, MlpKind, Routing};
use super::weights::{AttentionWeights, GraniteHybridWeights, MlpWeights, MoeWeights};
use crate::cpu::layers::by_kind;
use crate::cpu::matmul::{Bf16Kernel, Matrix};
use crate::cpu::rows::{rows_par, Rows};
use crate::cpu::token_io::TokenIo;
use crate::cpu::{activations, matmul, norm, on_pool, softmax, WeightDtype};
use crate::mamba2::cpu::{mixer, CpuLayer};
use crate::state::{KvState, LayerState, SsmValue, State};

/// A hybrid model ready to run on the CPU.
#[derive(Debug)]
pub struct CpuGraniteHybrid {
    config: GraniteHybridConfig,
    dims: AttentionDims,
    io: TokenIo,
    layers: Vec<Layer>,
}

/// One layer: a Mamba mixer, attention, or both side by side (Falcon-H1), then the MLP.
#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    /// The `slot`-th Mamba mixer (its state is `state.layers[slot]`).
    mamba: Option<(usize, CpuLayer)>,
    /// The `slot`-th attention (its state is `state.attention[slot]`).
    attention: Option<(usize, Attention)>,
    mlp: Option<Mlp>,
    moe: Option<Moe>,
}

/// Grouped-query attention's projections.
#[derive(Debug)]
struct Attention {
    q: Matrix,
    k: Matrix,
    v: Matrix,
    o: Matrix,
}

#[derive(Debug)]
struct Mlp {
    norm: Vec<f32>,
    /// Inner width.
    inner: usize,
    /// SwiGLU: gate and up (2·inner × d_model); relu²: up (inner × d_model).
    input: Matrix,
    /// Down (d_model × inner).
    output: Matrix,
}

#[derive(Debug)]
struct Moe {
    /// Router (n_experts × d_model), f32: routing decisions must not move with the weights' dtype.
    router: Vec<f32>,
    /// The router's correction bias (Nemotron 3), f32 as the router.
    bias: Option<Vec<f32>>,
    /// Per expert: gate and up (2·inner × width), or up alone for relu² experts (inner ×
    /// width); down (width × inner). The width is d_model, or the latent width.
    experts: Vec<(Matrix, Matrix)>,
    /// Nemotron 3's latent experts: the projection down to the latent width (latent × d_model)
    /// and back up (d_model × latent).
    latent: Option<(Matrix, Matrix)>,
}

impl CpuGraniteHybrid {
    /// Takes ownership of validated weights, storing the large matrices in `dtype` (Falcon-H1's
    /// µP multipliers folded into them first).
    pub fn new(config: GraniteHybridConfig, mut weights: GraniteHybridWeights, dtype: WeightDtype) -> Self {
        if let Some(mup) = &config.mup {
            mup.fold(&config, &mut weights);
        }
        let kernel = Bf16Kernel::detect();
        let mat = |v: Vec<f32>, cols: usize| Matrix::with_kernel(v, cols, dtype, kernel);
        let d = config.d_model;
        let (mut n_mamba, mut n_attention) = (0, 0);
        let gates = config.mlp_kind.projections();
        let layers = weights
            .layers
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let (mamba_weights, attention_weights) = l.mixer.into_parts();
                let mamba = mamba_weights.map(|w| {
                    n_mamba += 1;
                    (n_mamba - 1, CpuLayer::new(w, &config.mamba, dtype, kernel))
                });
                let attention = attention_weights.map(|AttentionWeights { q, k, v, o }| {
                    n_attention += 1;
                    let inner = config.n_heads * config.head_dim;
                    (n_attention - 1, Attention { q: mat(q, d), k: mat(k, d), v: mat(v, d), o: mat(o, inner) })
                });
                let moe = l.moe.map(|MoeWeights { router, bias, gate_up, down, latent }| {
                    let (e, ei, w) = (config.n_experts, config.expert_intermediate, config.expert_width());
                    let experts = (0..e)
                        .map(|x| {
                            let gu = gate_up[x * gates * ei * w..(x + 1) * gates * ei * w].to_vec();
                            let dn = down[x * w * ei..(x + 1) * w * ei].to_vec();
                            (mat(gu, w), mat(dn, ei))
                        })
                        .collect();
                    let latent = latent.map(|(down, up)| (mat(down, d), mat(up, w)));
                    Moe { router, bias, experts, latent }
                });
                let mlp = l.mlp.map(|MlpWeights { norm, input, output }| Mlp {
                    norm,
                    inner: config.mlp_inner(i),
                    input: mat(input, d),
                    output: mat(output, config.mlp_inner(i)),
                });
                Layer { input_norm: l.input_norm, mamba, attention, mlp, moe }
            })
            .collect();
        let io =
            TokenIo::new(weights.embedding, weights.lm_head, weights.norm_f, config.norm_eps, config.vocab_size, dtype);
        let dims = AttentionDims {
            d_model: d,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
            scale: config.attention_multiplier as f32,
            rope: config.rope_theta.map(|theta| (config.rotary_dim(), theta)),
        };
        Self { config, dims, io, layers }
    }

    /// The config.
    pub fn config(&self) -> &GraniteHybridConfig {
        &self.config
    }

    /// Runs `tokens` from `state` (updated in place) and returns the hidden states ready for
    /// the LM head (final-normed, divided by `logits_scaling`).
    pub fn forward(&self, tokens: &[u32], state: &mut State) -> Vec<f32> {
        self.forward_batch(tokens, &[tokens.len()], &mut [state])
    }

    /// Several sequences at once: `lens[i]` tokens continue `states[i]`. The projections read
    /// each weight once for all rows; the mixers run per sequence on its own state. Single
    /// tokens and longer sequences run as separate passes (`cpu::by_kind`), so a
    /// decode step's bits do not depend on what else is in the batch.
    pub fn forward_batch<S: SsmValue>(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State<S>]) -> Vec<f32> {
        by_kind(self.config.d_model, tokens, lens, states, |t, l, s| self.forward_one_kind(t, l, s))
    }

    /// [`CpuGraniteHybrid::forward_batch`] of sequences that are all single tokens or all longer.
    fn forward_one_kind<S: SsmValue>(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State<S>]) -> Vec<f32> {
        let c = &self.config;
        let d = c.d_model;
        on_pool(|| {
            let kind = Rows::of(lens);
            let mut h = self.io.embed(tokens);
            let em = c.embedding_multiplier as f32;
            if em != 1.0 {
                h.iter_mut().for_each(|x| *x *= em);
            }
            let positions: Vec<u64> = states.iter().map(|s| s.position).collect();
            let rows = tokens.len();
            let mut xn = vec![0.0f32; rows * d];
            let mut branch = vec![0.0f32; rows * d];
            for layer in &self.layers {
                rows_par(&h, &mut xn, d, d, |x, o| norm::rmsnorm(x, &layer.input_norm, c.norm_eps as f32, o));
                if let Some((slot, weights)) = &layer.mamba {
                    let mut ls: Vec<&mut LayerState<S>> = states.iter_mut().map(|s| &mut s.layers[*slot]).collect();
                    mixer(&c.mamba, weights, &xn, &mut ls, lens, kind, &mut branch, false);
                    add_scaled(&mut h, &branch, c.residual_multiplier as f32);
                }
                if let Some((slot, a)) = &layer.attention {
                    let mut kv: Vec<&mut KvState> = states.iter_mut().map(|s| &mut s.attention[*slot]).collect();
                    attention(&self.dims, &xn, &mut kv, &positions, lens, kind, [&a.q, &a.k, &a.v, &a.o], &mut branch);
                    add_scaled(&mut h, &branch, c.residual_multiplier as f32);
                }
                if let Some(mlp) = &layer.mlp {
                    rows_par(&h, &mut xn, d, d, |x, o| norm::rmsnorm(x, &mlp.norm, c.norm_eps as f32, o));
                    self.mlp(mlp, layer.moe.as_ref(), &xn, kind, &mut branch);
                    add_scaled(&mut h, &branch, c.residual_multiplier as f32);
                }
            }
            for (s, &t) in states.iter_mut().zip(lens) {
                s.advance(t);
            }
            let mut out = self.io.final_norm(&h);
            let inv = (1.0 / c.logits_scaling) as f32;
            if inv != 1.0 {
                out.iter_mut().for_each(|x| *x *= inv);
            }
            out
        })
    }

    /// The MLP plus the routed experts of the normed rows `xn`, into `out`. Latent experts
    /// (Nemotron 3) take the rows projected down to their width and sum there; the sum is
    /// projected back up.
    fn mlp(&self, mlp: &Mlp, moe: Option<&Moe>, xn: &[f32], kind: Rows, out: &mut [f32]) {
        let c = &self.config;
        let d = c.d_model;
        let rows = xn.len() / d;
        feed_forward(c.mlp_kind, xn, rows, d, mlp.inner, &mlp.input, &mlp.output, kind, out);
        let Some(moe) = moe else { return };
        let e = c.n_experts;
        let routes: Vec<Route> = xn
            .par_chunks(d)
            .map(|x| {
                let logits: Vec<f32> = (0..e).map(|j| matmul::dot(x, &moe.router[j * d..(j + 1) * d])).collect();
                route(&logits, moe.bias.as_deref(), c.top_k, c.routing)
            })
            .collect();
        let (ei, w) = (c.expert_intermediate, c.expert_width());
        let latent_rows = moe.latent.as_ref().map(|(down, _)| {
            let mut x = vec![0.0f32; rows * w];
            kind.matmul_t(xn, rows, d, down, w, &mut x, false);
            x
        });
        let xe = latent_rows.as_deref().unwrap_or(xn);
        let mut latent_sum = moe.latent.as_ref().map(|_| vec![0.0f32; rows * w]);
        let sum = latent_sum.as_deref_mut().unwrap_or(out);
        add_experts(c.mlp_kind, xe, w, ei, routes, &moe.experts, kind, sum);
        if let (Some(sum), Some((_, up))) = (&latent_sum, &moe.latent) {
            kind.matmul_t(sum, rows, w, up, d, out, true);
        }
    }

    /// Logits (rows × vocab) of hidden rows from [`CpuGraniteHybrid::forward`].
    pub fn logits(&self, hidden: &[f32], kind: Rows) -> Vec<f32> {
        self.io.logits(hidden, kind)
    }

    /// `log p(targets[i] | hidden row i)` for each row.
    pub fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        self.io.logprobs(hidden, targets)
    }
}

/// Grouped-query attention of the normed rows `xn` over each sequence's keys and values
/// (the new tokens' appended first), projected by `o` into `out` (rows × d_model).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    dims: &AttentionDims,
    xn: &[f32],
    kv: &mut [&mut KvState],
    positions: &[u64],
    lens: &[usize],
    kind: Rows,
    [wq, wk, wv, wo]: [&Matrix; 4],
    out: &mut [f32],
) {
    let &AttentionDims { d_model: d, n_heads: nh, n_kv_heads: nkv, head_dim: hd, scale, rope } = dims;
    let rows = xn.len() / d;
    let (qw, kvw) = (nh * hd, nkv * hd);
    let mut q = vec![0.0f32; rows * qw];
    let mut k = vec![0.0f32; rows * kvw];
    let mut v = vec![0.0f32; rows * kvw];
    kind.matmul_t(xn, rows, d, wq, qw, &mut q, false);
    kind.matmul_t(xn, rows, d, wk, kvw, &mut k, false);
    kind.matmul_t(xn, rows, d, wv, kvw, &mut v, false);
    // Positions, then each sequence's new keys and values appended to its state.
    let mut prevs = Vec::with_capacity(lens.len());
    let mut at = 0;
    for ((state, &t), &p0) in kv.iter_mut().zip(lens).zip(positions) {
        let (qs, ks) = (&mut q[at * qw..(at + t) * qw], &mut k[at * kvw..(at + t) * kvw]);
        if let Some((rotary, theta)) = rope {
            apply_rope(qs, nh, hd, rotary, p0, theta);
            apply_rope(ks, nkv, hd, rotary, p0, theta);
        }
        prevs.push(state.tokens(kvw));
        state.keys.extend_from_slice(ks);
        state.values.extend_from_slice(&v[at * kvw..(at + t) * kvw]);
        at += t;
    }
    let mut y = vec![0.0f32; rows * qw];
    let mut jobs = Vec::with_capacity(lens.len());
    let (mut y_rest, mut q_rest) = (&mut y[..], &q[..]);
    for ((state, &t), prev) in kv.iter().zip(lens).zip(prevs) {
        let (ys, rest) = std::mem::take(&mut y_rest).split_at_mut(t * qw);
        let (qs, q_tail) = q_rest.split_at(t * qw);
        (y_rest, q_rest) = (rest, q_tail);
        jobs.push((&**state, qs, prev, ys));
    }
    jobs.into_par_iter().for_each(|(state, qs, prev, ys)| {
        if ys.len() / qw >= TILED_FROM {
            attend_rows(qs, state, prev, (nh, nkv, hd), scale, ys)
        } else {
            ys.par_chunks_mut(qw).enumerate().for_each(|(ti, yrow)| {
                attend_row(&qs[ti * qw..(ti + 1) * qw], state, prev + ti + 1, nh, nkv, hd, scale, yrow)
            })
        }
    });
    kind.matmul_t(&y, rows, qw, wo, d, out, false);
}

/// The sizes grouped-query attention runs with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttentionDims {
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// The softmax scale.
    pub scale: f32,
    /// RoPE's rotated channels per head and base; `None` for NoPE.
    pub rope: Option<(usize, f64)>,
}

/// Adds to `sum` (rows × w) each expert's output on the rows routed to it, times their weights
/// (`routes[r]`: row r's experts and weights). Each expert multiplies only its rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn add_experts(
    mlp: MlpKind,
    xe: &[f32],
    w: usize,
    inner: usize,
    routes: Vec<Route>,
    experts: &[(Matrix, Matrix)],
    kind: Rows,
    sum: &mut [f32],
) {
    let mut by_expert: Vec<Route> = vec![Vec::new(); experts.len()];
    for (r, route) in routes.into_iter().enumerate() {
        for (j, weight) in route {
            by_expert[j].push((r, weight));
        }
    }
    let partial: Vec<(Route, Vec<f32>)> = by_expert
        .into_par_iter()
        .enumerate()
        .filter(|(_, rows)| !rows.is_empty())
        .map(|(j, picked)| {
            let mut x = Vec::with_capacity(picked.len() * w);
            for &(r, _) in &picked {
                x.extend_from_slice(&xe[r * w..(r + 1) * w]);
            }
            let mut y = vec![0.0f32; picked.len() * w];
            let (gate_up, down) = &experts[j];
            feed_forward(mlp, &x, picked.len(), w, inner, gate_up, down, kind, &mut y);
            (picked, y)
        })
        .collect();
    for (picked, y) in partial {
        for (i, &(r, weight)) in picked.iter().enumerate() {
            for (o, v) in sum[r * w..(r + 1) * w].iter_mut().zip(&y[i * w..(i + 1) * w]) {
                *o += weight * v;
            }
        }
    }
}

/// (index, weight) pairs: a row's experts, or an expert's rows.
pub(crate) type Route = Vec<(usize, f32)>;

/// A row's experts and their weights from its router logits (see [`Routing`]).
pub(super) fn route(logits: &[f32], bias: Option<&[f32]>, top: usize, routing: Routing) -> Route {
    // Highest first; ties to the lower index.
    let best = |v: &mut Vec<(usize, f32)>, n: usize| {
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(n);
    };
    match routing {
        Routing::Softmax => {
            let mut picked: Vec<(usize, f32)> = logits.iter().copied().enumerate().collect();
            best(&mut picked, top);
            let max = picked[0].1;
            let sum: f32 = picked.iter().map(|(_, l)| (l - max).exp()).sum();
            picked.iter().map(|&(j, l)| (j, (l - max).exp() / sum)).collect()
        }
        Routing::Sigmoid { groups, keep_groups, normalize, scale } => {
            let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
            let choice: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            // Each group scored by the sum of its two best choices; the best groups kept.
            let per = choice.len() / groups;
            let mut group_scores: Vec<(usize, f32)> = (0..groups)
                .map(|g| {
                    let mut v: Vec<(usize, f32)> = choice[g * per..(g + 1) * per].iter().copied().enumerate().collect();
                    best(&mut v, 2);
                    (g, v.iter().map(|(_, s)| s).sum())
                })
                .collect();
            best(&mut group_scores, keep_groups);
            let mut picked: Vec<(usize, f32)> =
                group_scores.iter().flat_map(|&(g, _)| (g * per..(g + 1) * per).map(|j| (j, choice[j]))).collect();
            best(&mut picked, top);
            let sum: f32 = if normalize { picked.iter().map(|&(j, _)| scores[j]).sum::<f32>() + 1e-20 } else { 1.0 };
            picked.iter().map(|&(j, _)| (j, scores[j] / sum * scale as f32)).collect()
        }
    }
}

/// `h += m · branch`.
pub(crate) fn add_scaled(h: &mut [f32], branch: &[f32], m: f32) {
    h.par_chunks_mut(4096).zip(branch.par_chunks(4096)).for_each(|(h, b)| {
        for (x, y) in h.iter_mut().zip(b) {
            *x += m * y;
        }
    });
}

/// SwiGLU of `rows` rows: `down(silu(gate(x)) · up(x))`, where `gate_up` holds the gate's rows
/// then the up projection's (as transformers' `input_linear` does).
#[allow(clippy::too_many_arguments)]
fn swiglu(
    x: &[f32],
    rows: usize,
    d: usize,
    inner: usize,
    gate_up: &Matrix,
    down: &Matrix,
    kind: Rows,
    out: &mut [f32],
    acc: bool,
) {
    let mut gu = vec![0.0f32; rows * 2 * inner];
    kind.matmul_t(x, rows, d, gate_up, 2 * inner, &mut gu, false);
    let mut act = vec![0.0f32; rows * inner];
    act.par_chunks_mut(inner).zip(gu.par_chunks(2 * inner)).for_each(|(a, g)| {
        for (i, o) in a.iter_mut().enumerate() {
            *o = activations::silu(g[i]) * g[inner + i];
        }
    });
    kind.matmul_t(&act, rows, inner, down, d, out, acc);
}

/// The MLP of `kind` (the shared one, or an expert) of `rows` rows, into `out`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn feed_forward(
    mlp: MlpKind,
    x: &[f32],
    rows: usize,
    d: usize,
    inner: usize,
    input: &Matrix,
    down: &Matrix,
    kind: Rows,
    out: &mut [f32],
) {
    match mlp {
        MlpKind::SwiGlu => swiglu(x, rows, d, inner, input, down, kind, out, false),
        MlpKind::Relu2 => relu2_mlp(x, rows, d, inner, input, down, kind, out),
    }
}

/// Nemotron-H's MLP of `rows` rows: `down(relu(up(x))²)`.
#[allow(clippy::too_many_arguments)]
fn relu2_mlp(x: &[f32], rows: usize, d: usize, inner: usize, up: &Matrix, down: &Matrix, kind: Rows, out: &mut [f32]) {
    let mut act = vec![0.0f32; rows * inner];
    kind.matmul_t(x, rows, d, up, inner, &mut act, false);
    act.par_chunks_mut(inner).for_each(|a| {
        for v in a {
            let r = v.max(0.0);
            *v = r * r;
        }
    });
    kind.matmul_t(&act, rows, inner, down, d, out, false);
}

/// Rotates the first `rotary` channels of each head of each row (rows of `heads × hd`) by its
/// position `p0 + row` as transformers' default RoPE does: the first and second halves of
/// those channels form the pairs; the channels past them pass unrotated (partial RoPE).
fn apply_rope(x: &mut [f32], heads: usize, hd: usize, rotary: usize, p0: u64, theta: f64) {
    let half = rotary / 2;
    let inv: Vec<f64> = (0..half).map(|i| theta.powf(-((2 * i) as f64) / rotary as f64)).collect();
    for (r, row) in x.chunks_exact_mut(heads * hd).enumerate() {
        let pos = (p0 + r as u64) as f64;
        // Angles in f64 (transformers' are f32: ~1e-7 relative apart at these positions).
        let (cos, sin): (Vec<f32>, Vec<f32>) =
            inv.iter().map(|&f| ((pos * f).cos() as f32, (pos * f).sin() as f32)).unzip();
        for h in row.chunks_exact_mut(hd) {
            for i in 0..half {
                let (a, b) = (h[i], h[i + half]);
                h[i] = a * cos[i] - b * sin[i];
                h[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

/// Replaces each score by e^(score − max) and returns 1 / their sum (summed in f64): the
/// softmax's weights, still to be scaled.
fn exp_below(scores: &mut [f32], max: f32) -> f32 {
    (1.0 / softmax::exp_below_in_place(scores, max)) as f32
}

/// Query rows per tile of [`attend_rows`].
const ROW_TILE: usize = 64;
/// A sequence's new rows from which [`attend_rows`] runs instead of one [`attend_row`] per row.
const TILED_FROM: usize = 16;

/// A prompt's `t` query rows (all heads, row i seeing the first `prev + i + 1` keys of `kv`)
/// attending as tiles of rows per head: scores = scale · Q·Kᵀ and then softmax(scores) · V as
/// two matrix products, where [`attend_row`] makes one dot product per key and row. Keys a
/// row may not see yet (the tile's later rows') get weight 0.
fn attend_rows(
    qs: &[f32],
    kv: &KvState,
    prev: usize,
    (nh, nkv, hd): (usize, usize, usize),
    scale: f32,
    ys: &mut [f32],
) {
    let (qw, stride, group) = (nh * hd, nkv * hd, nh / nkv);
    let t = qs.len() / qw;
    let tiles: Vec<(usize, usize)> = (0..nh).flat_map(|h| (0..t).step_by(ROW_TILE).map(move |r0| (h, r0))).collect();
    let outs: Vec<Vec<f32>> = tiles
        .par_iter()
        .map(|&(h, r0)| {
            let rows = ROW_TILE.min(t - r0);
            let n = prev + r0 + rows;
            let g = h / group;
            let mut p = vec![0.0f32; rows * n];
            let q = &qs[r0 * qw + h * hd..];
            matmul::matmul_strided((rows, hd, n), q, qw, &kv.keys[g * hd..], (1, stride), scale, &mut p, n);
            for (i, row) in p.chunks_exact_mut(n).enumerate() {
                let (live, unseen) = row.split_at_mut(prev + r0 + i + 1);
                let inv = exp_below(live, softmax::max_ignoring_nan(live));
                live.iter_mut().for_each(|s| *s *= inv);
                unseen.fill(0.0);
            }
            let mut y = vec![0.0f32; rows * hd];
            matmul::matmul_strided((rows, n, hd), &p, n, &kv.values[g * hd..], (stride, 1), 1.0, &mut y, hd);
            y
        })
        .collect();
    for (&(h, r0), y) in tiles.iter().zip(outs) {
        for (i, yr) in y.chunks_exact(hd).enumerate() {
            ys[(r0 + i) * qw + h * hd..(r0 + i) * qw + (h + 1) * hd].copy_from_slice(yr);
        }
    }
}

/// One query row (all heads) attending to the first `n` keys of `kv`: softmax(scale · q·k)
/// weighted values, per head, into `y` (heads × hd).
#[allow(clippy::too_many_arguments)]
fn attend_row(q: &[f32], kv: &KvState, n: usize, nh: usize, nkv: usize, hd: usize, scale: f32, y: &mut [f32]) {
    let group = nh / nkv;
    let stride = nkv * hd;
    let mut scores = vec![0.0f32; n];
    for h in 0..nh {
        let g = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            *s = scale * matmul::dot(qh, &kv.keys[j * stride + g * hd..j * stride + (g + 1) * hd]);
            max = max.max(*s);
        }
        let inv = exp_below(&mut scores, max);
        let yh = &mut y[h * hd..(h + 1) * hd];
        yh.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let w = p * inv;
            for (o, v) in yh.iter_mut().zip(&kv.values[j * stride + g * hd..j * stride + (g + 1) * hd]) {
                *o += w * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both routing rules against values worked by hand: softmax over the top-k logits; and
    /// Nemotron 3's, where the correction bias moves the choice (expert 3 beats expert 2) but
    /// not the weights, the weaker group is dropped whole, and the weights are normalised and
    /// scaled (or only scaled).
    #[test]
    fn routing_picks_and_weighs_experts_as_worked_by_hand() {
        let close = |got: Route, want: &[(usize, f32)]| {
            assert_eq!(got.len(), want.len(), "{got:?}");
            for ((j, w), (wj, ww)) in got.iter().zip(want) {
                assert!(j == wj && (w - ww).abs() < 1e-5, "{got:?} vs {want:?}");
            }
        };
        let logits = [0.0, 1.0, 2.0, -1.0];
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        close(route(&logits, None, 2, Routing::Softmax), &[(2, sig(1.0)), (1, 1.0 - sig(1.0))]);
        let bias = [0.0, 0.0, -0.9, 0.5];
        let rule = |normalize| Routing::Sigmoid { groups: 2, keep_groups: 1, normalize, scale: 2.0 };
        // Choices 0.5, 0.731, -0.019, 0.769: group {0, 1} scores 1.231, group {2, 3} 0.750.
        let (s0, s1) = (sig(0.0), sig(1.0));
        close(route(&logits, Some(&bias), 2, rule(true)), &[(1, 2.0 * s1 / (s0 + s1)), (0, 2.0 * s0 / (s0 + s1))]);
        close(route(&logits, Some(&bias), 2, rule(false)), &[(1, 2.0 * s1), (0, 2.0 * s0)]);
        // Without the bias, group {2, 3} (0.881 + 0.269) loses to {0, 1} (0.5 + 0.731) too, but
        // keeping both groups picks experts 2 and 1.
        let both = Routing::Sigmoid { groups: 2, keep_groups: 2, normalize: false, scale: 1.0 };
        close(route(&logits, None, 2, both), &[(2, sig(2.0)), (1, s1)]);
    }

    /// The tiled prompt attention gives what one row at a time gives, across several tiles,
    /// after earlier keys, with grouped heads.
    #[test]
    fn tiles_of_rows_attend_as_single_rows() {
        let (nh, nkv, hd, prev, t) = (4, 2, 8, 40, 2 * ROW_TILE + 22);
        let (qw, stride) = (nh * hd, nkv * hd);
        let val = |i: usize, salt: usize| (((i * 7919 + salt) % 1013) as f32 / 1013.0 - 0.5) * 3.0;
        let kv = KvState {
            keys: (0..(prev + t) * stride).map(|i| val(i, 1)).collect(),
            values: (0..(prev + t) * stride).map(|i| val(i, 2)).collect(),
        };
        let qs: Vec<f32> = (0..t * qw).map(|i| val(i, 3)).collect();
        let mut tiled = vec![f32::NAN; t * qw];
        attend_rows(&qs, &kv, prev, (nh, nkv, hd), 0.3, &mut tiled);
        let mut rows = vec![0.0f32; t * qw];
        for (i, y) in rows.chunks_exact_mut(qw).enumerate() {
            attend_row(&qs[i * qw..(i + 1) * qw], &kv, prev + i + 1, nh, nkv, hd, 0.3, y);
        }
        let worst = tiled.iter().zip(&rows).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "tiled and single-row attention differ by {worst}");
    }
}
