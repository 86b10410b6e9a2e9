//! The pretraining loop: packed sequences drawn deterministically from a token stream, AdamW
//! with warmup + cosine decay and gradient clipping, periodic validation, and checkpoints that
//! make a killed run resume to the same result as an uninterrupted one.
//!
//! Determinism: the batch of step `s` is a pure function of (seed, s) — no sampler state to
//! save — and a checkpoint holds the weights (f32, exact), the optimiser's moments and step,
//! and the loss history; so resuming at step s replays exactly what the uninterrupted run did.
//!
//! The step runs on the hand-written CPU path ([`crate::cpu`]); the validation steps also
//! measure context use on held-out paragraph pairs ([`ContextPair`]): the loss of a
//! paragraph's second half after its first half, with nothing before, with the true previous
//! paragraph, and with a paragraph of another document.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Tensor};
use picaso_model::granite_hybrid::weights::AttentionWeights;
use picaso_model::{GraniteHybridConfig, GraniteHybridWeights, Mamba2Config, Mamba2Weights};
use rand::{Rng, SeedableRng};

use crate::checkpoint;
use crate::cpu::ops::Matmul;
use crate::cpu::{param_shapes, params, params_mut, CpuTrainer};
use crate::net::Net;
use crate::optim::{check_counts, check_settings, check_warmup, lr_at, AdamW, AdamWConfig, HostAdamW};
use crate::xent::IGNORE;
use crate::{io, Result};

/// Everything that defines a run (saved with each checkpoint; a resume must match it).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PretrainConfig<C = Mamba2Config> {
    /// The architecture.
    pub model: C,
    /// Tokens per training sequence.
    pub seq_len: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Total optimiser steps.
    pub steps: u64,
    /// Warmup steps.
    pub warmup: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Final learning rate.
    pub min_lr: f64,
    /// Gradient clipping (global L2 norm).
    pub clip: f64,
    /// Optimiser settings.
    pub adamw: AdamWConfig,
    /// Seed of the initial weights and of the batch order.
    pub seed: u64,
    /// Validate every this many steps (and at the end).
    pub val_every: u64,
    /// Validation sequences (fixed, evaluated in batches of `batch`).
    pub val_sequences: usize,
    /// Save a checkpoint every this many steps (and at the end).
    pub checkpoint_every: u64,
    /// Chunk length of the scan.
    pub chunk: usize,
    /// How training windows are drawn.
    #[serde(default)]
    pub sampler: Sampler,
    /// Initialisation beyond the Mamba reference's.
    #[serde(default)]
    pub init: InitOptions,
    /// Targets before this position of a window do not count: the loss falls on tokens with
    /// at least this much context (0: every token counts).
    #[serde(default)]
    pub loss_from: usize,
    /// The fingerprint (xxh3-128, hex) of a training stream given in place of the corpora's
    /// (`picaso train pretrain --train-stream`), so a resumed run refuses a different one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_stream: Option<String>,
    /// The precision of the training step's matrix products (validation is always f32).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub matmul: Matmul,
}

fn is_f32(m: &Matmul) -> bool {
    *m == Matmul::F32
}

/// How the windows of a step are drawn from the training stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sampler {
    /// Windows at offsets drawn uniformly (with replacement) — what the first bundled model used.
    #[default]
    Random,
    /// The stream cut into consecutive non-overlapping windows, shuffled anew each epoch: every
    /// token is trained on once per epoch, and a window holds consecutive paragraphs of one
    /// document (documents are long) or of neighbouring documents in the stream's order.
    Epochs,
}

/// Initialisation options that help a small SSM learn to copy from far back.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InitOptions {
    /// Share of each layer's heads given long memory: dt log-uniform in [1e-4, 1e-3] and
    /// |A| in [0.5, 1], so their decay per token is 0.9995–0.99995 (the reference init's median
    /// head halves its content in ~10 tokens).
    pub long_memory: f64,
    /// "Mimetic" init (Trockman et al. 2024): C's rows of in_proj start equal to B's, so a
    /// token's query matches its own key and the SSM starts out attention-like.
    pub mimetic: bool,
}

impl<C> PretrainConfig<C> {
    /// Checks the run's settings (the architecture is the model's to check): counts of at
    /// least 1, `loss_from` inside a window, and the optimiser's numbers
    /// ([`crate::optim::check_settings`]). [`pretrain`] calls it; callers may call it earlier,
    /// before reading the corpora.
    pub fn validate(&self) -> Result<()> {
        check_counts(&[
            ("seq_len", self.seq_len as u64),
            ("batch", self.batch as u64),
            ("steps", self.steps),
            ("val_every", self.val_every),
            ("checkpoint_every", self.checkpoint_every),
            ("chunk", self.chunk as u64),
        ])?;
        if self.loss_from >= self.seq_len {
            candle_core::bail!("loss_from = {}: must be below seq_len ({})", self.loss_from, self.seq_len);
        }
        let long = self.init.long_memory;
        if !(0.0..=1.0).contains(&long) {
            candle_core::bail!("init.long_memory = {long}: the share of heads given long memory must be from 0 to 1");
        }
        check_warmup(self.warmup, self.steps)?;
        check_settings(self.lr, self.min_lr, self.clip, &self.adamw)
    }
}

impl PretrainConfig {
    /// A conservative estimate of the run's peak memory (bytes): parameters with their
    /// gradients and AdamW moments, plus the activations a step keeps for backward — the
    /// logits (batch·seq_len × vocab, three copies) and per layer the projections, conv,
    /// scan decay blocks and norms. Calibrated on the bundled model's run (estimate 2.5× the
    /// raw count: allocator slack and temporaries), whose peak was 2.4 GB.
    pub fn estimated_peak_bytes(&self) -> u64 {
        let c = &self.model;
        let tokens = (self.batch * self.seq_len) as u64;
        let per_layer =
            3 * c.d_in_proj() + 8 * c.conv_dim() + 10 * c.d_inner() + 8 * c.d_model + 4 * c.nheads * self.chunk;
        let per_token = 3 * c.vocab_size + c.n_layer * per_layer;
        let params =
            (c.vocab_size * c.d_model + c.n_layer * (c.d_in_proj() * c.d_model + c.d_inner() * c.d_model)) as u64;
        (2.5 * 4.0 * (tokens * per_token as u64 + 4 * params) as f64) as u64
    }
}

/// One line of the loss history.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LogRow {
    /// Step (1-based, after the update).
    pub step: u64,
    /// Training loss of the step's batch (nats/token).
    pub loss: f64,
    /// Validation loss, on validation steps.
    pub val_loss: Option<f64>,
    /// Learning rate used.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Training tokens so far.
    pub tokens: u64,
    /// Wall seconds spent training so far (over all resumed parts).
    pub seconds: f64,
    /// Context use on the held-out pairs, on validation steps that had pairs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<ContextUse>,
}

/// A held-out paragraph with its predecessor and a paragraph of another document.
#[derive(Debug, Clone)]
pub struct ContextPair {
    /// The true previous paragraph.
    pub previous: Vec<u32>,
    /// A paragraph of another document (the control).
    pub random: Vec<u32>,
    /// The first half of the paragraph.
    pub query: Vec<u32>,
    /// The second half, which is scored.
    pub continuation: Vec<u32>,
}

/// Mean continuation loss (nats/token, mean over pairs) under each context.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ContextUse {
    /// Pairs scored.
    pub pairs: usize,
    /// Nothing before the query.
    pub none: f64,
    /// The true previous paragraph before it.
    pub previous: f64,
    /// A paragraph of another document before it.
    pub random: f64,
    /// Relative gain of the previous paragraph: (none − previous) / none.
    pub gain: f64,
    /// Relative gain of the random paragraph.
    pub random_gain: f64,
    /// Loss on recall tokens (completing a bigram of the previous paragraph): none, previous.
    pub recall: (f64, f64),
}

/// What a checkpoint folder's `trainer.json` holds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct TrainerState<C = Mamba2Config> {
    config: PretrainConfig<C>,
    step: u64,
    history: Vec<LogRow>,
    /// What happened to the run besides steps (warm starts).
    #[serde(default)]
    notes: Vec<String>,
}

/// Training and validation token streams (documents joined by EOS), and held-out paragraph
/// pairs for the context-use check.
#[derive(Default)]
pub struct TokenData {
    /// Training tokens.
    pub train: Vec<u32>,
    /// Validation tokens.
    pub val: Vec<u32>,
    /// Held-out pairs (may be empty).
    pub pairs: Vec<ContextPair>,
    /// Which training tokens count as targets (empty: all). A generated task scores only its
    /// answers: the rest of its tokens are random by construction.
    pub train_mask: Vec<bool>,
    /// Which validation tokens count as targets (empty: all).
    pub val_mask: Vec<bool>,
}

/// Progress after each step.
pub struct Progress<'a> {
    /// The latest row.
    pub row: &'a LogRow,
    /// Total steps of the run.
    pub total: u64,
    /// Tokens per second in this process.
    pub tokens_per_s: f64,
}

/// `normal(n, std)`: n draws from normal(0, std²) (Box–Muller on a generator seeded by `seed`).
fn gaussian(seed: u64) -> impl FnMut(usize, f64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    move |n, std| {
        (0..n)
            .map(|_| {
                let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
                (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect()
    }
}

/// Initial weights in the spirit of the Mamba reference: normal(0, 0.02) embedding and
/// projections (out_proj scaled by 1/√(2·n_layer)), dt_bias = softplus⁻¹ of a log-uniform dt in
/// [0.001, 0.1], A_log = log U(1, 16), D = 1, unit norms.
pub fn init_weights(c: &Mamba2Config, seed: u64) -> Mamba2Weights {
    let mut w = Mamba2Weights::random(c, seed);
    let mut normal = gaussian(seed ^ 0x5eed);
    w.embedding = normal(c.vocab_size * c.d_model, 0.02);
    let out_std = 0.02 / (2.0 * c.n_layer as f64).sqrt();
    let mut rng2 = rand::rngs::StdRng::seed_from_u64(seed ^ 0xd7);
    for l in &mut w.layers {
        l.in_proj = normal(l.in_proj.len(), 0.02);
        l.out_proj = normal(l.out_proj.len(), out_std);
        l.conv_weight = normal(l.conv_weight.len(), 1.0 / (c.d_conv as f64).sqrt());
        l.conv_bias.iter_mut().flatten().for_each(|b| *b = 0.0);
        l.in_proj_bias.iter_mut().flatten().for_each(|b| *b = 0.0);
        l.out_proj_bias.iter_mut().flatten().for_each(|b| *b = 0.0);
        l.norm.iter_mut().for_each(|x| *x = 1.0);
        l.gated_norm.iter_mut().for_each(|x| *x = 1.0);
        l.d.iter_mut().for_each(|x| *x = 1.0);
        for (dtb, al) in l.dt_bias.iter_mut().zip(l.a_log.iter_mut()) {
            let dt = (0.001f64.ln() + rng2.random::<f64>() * (0.1f64.ln() - 0.001f64.ln())).exp();
            *dtb = (dt + (-(-dt).exp_m1()).ln()) as f32; // softplus⁻¹(dt) = dt + log(1 − e^−dt)
            *al = rng2.random_range(1.0f64..16.0).ln() as f32;
        }
    }
    w.norm_f.iter_mut().for_each(|x| *x = 1.0);
    if let Some(h) = &mut w.lm_head {
        *h = normal(h.len(), 0.02);
    }
    w
}

/// [`init_weights`] with the extra options applied (per layer, the first
/// `long_memory · nheads` heads get long memory).
pub fn init_weights_with(c: &Mamba2Config, seed: u64, opts: &InitOptions) -> Mamba2Weights {
    let mut w = init_weights(c, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x10_6e);
    let long = ((opts.long_memory.clamp(0.0, 1.0) * c.nheads as f64).round() as usize).min(c.nheads);
    let (di, gn) = (c.d_inner(), c.n_groups * c.d_state);
    for l in &mut w.layers {
        for h in 0..long {
            let dt = (1e-4f64.ln() + rng.random::<f64>() * (1e-3f64.ln() - 1e-4f64.ln())).exp();
            l.dt_bias[h] = (dt + (-(-dt).exp_m1()).ln()) as f32;
            l.a_log[h] = rng.random_range(0.5f64..1.0).ln() as f32;
        }
        if opts.mimetic {
            // in_proj rows: [z (di) | x (di) | B (gn) | C (gn) | dt]; C ← B.
            let d = c.d_model;
            let (b0, c0) = ((2 * di) * d, (2 * di + gn) * d);
            let b_rows = l.in_proj[b0..b0 + gn * d].to_vec();
            l.in_proj[c0..c0 + gn * d].copy_from_slice(&b_rows);
        }
    }
    w
}

/// Initial weights of a dense NoPE hybrid as `scripts/hybrid_lm.py` makes them: embedding and
/// the projections into the residual stream normal(0, 0.02); the projections out of it
/// (out_proj, o_proj, the MLP's output) normal(0, 0.02 / √(2·n_layer)), two residual branches
/// per layer; each Mamba mixer's dt, A, D, conv and `opts` as [`init_weights_with`]; unit norms.
pub fn init_hybrid_weights(c: &GraniteHybridConfig, seed: u64, opts: &InitOptions) -> GraniteHybridWeights {
    let mut w = GraniteHybridWeights::random(c, seed);
    let mut mamba = init_weights_with(&c.mamba, seed, opts).layers.into_iter();
    let mut normal = gaussian(seed ^ 0x4b1d);
    let out_std = 0.02 / (2.0 * c.n_layer() as f64).sqrt();
    w.embedding = normal(w.embedding.len(), 0.02);
    for l in &mut w.layers {
        l.input_norm.iter_mut().for_each(|x| *x = 1.0);
        let (m, attention) = l.mixer.parts_mut();
        if let Some(m) = m {
            *m = mamba.next().expect("one Mamba-2 layer per layer with a Mamba mixer");
            m.out_proj = normal(m.out_proj.len(), out_std);
        }
        if let Some(AttentionWeights { q, k, v, o }) = attention {
            for p in [q, k, v] {
                *p = normal(p.len(), 0.02);
            }
            *o = normal(o.len(), out_std);
        }
        if let Some(mlp) = &mut l.mlp {
            mlp.norm.iter_mut().for_each(|x| *x = 1.0);
            mlp.input = normal(mlp.input.len(), 0.02);
            mlp.output = normal(mlp.output.len(), out_std);
        }
    }
    w.norm_f.iter_mut().for_each(|x| *x = 1.0);
    if let Some(h) = &mut w.lm_head {
        *h = normal(h.len(), 0.02);
    }
    w
}

/// The (inputs, targets) of step `step`: `batch` windows of `seq_len + 1` tokens, drawn as the
/// config's sampler says from (seed, step) alone. Targets before `loss_from` are ignored.
fn batch_at<C>(tokens: &[u32], mask: &[bool], cfg: &PretrainConfig<C>, step: u64) -> (Vec<u32>, Vec<u32>) {
    let (mut x, mut y) = (Vec::with_capacity(cfg.batch * cfg.seq_len), Vec::with_capacity(cfg.batch * cfg.seq_len));
    let mut take = |o: usize| {
        x.extend_from_slice(&tokens[o..o + cfg.seq_len]);
        y.extend(tokens[o + 1..o + cfg.seq_len + 1].iter().enumerate().map(|(i, &t)| {
            if i < cfg.loss_from || !counts(mask, o + 1 + i) {
                IGNORE
            } else {
                t
            }
        }));
    };
    match cfg.sampler {
        Sampler::Random => {
            let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step);
            let span = tokens.len() - cfg.seq_len - 1;
            for _ in 0..cfg.batch {
                take(rng.random_range(0..=span));
            }
        }
        Sampler::Epochs => {
            let windows = ((tokens.len() - 1) / cfg.seq_len) as u64;
            let mut cached: Option<(u64, Vec<u32>)> = None;
            for i in 0..cfg.batch as u64 {
                let g = step * cfg.batch as u64 + i;
                let (epoch, pos) = (g / windows, (g % windows) as usize);
                if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
                    cached = Some((epoch, epoch_order(windows as usize, cfg.seed, epoch)));
                }
                let order = &cached.as_ref().expect("just set").1;
                take(order[pos] as usize * cfg.seq_len);
            }
        }
    }
    (x, y)
}

/// Whether the target at stream position `j` counts (an empty mask counts everything).
fn counts(mask: &[bool], j: usize) -> bool {
    mask.get(j).copied().unwrap_or(mask.is_empty())
}

/// The window order of one epoch: a permutation seeded by (seed, epoch).
fn epoch_order(windows: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..windows as u32).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_mul(0xA24B_AED4_963E_E407) ^ epoch);
    rand::seq::SliceRandom::shuffle(order.as_mut_slice(), &mut rng);
    order
}

/// What the pretraining loop needs of the model it trains: gradients of a batch, an optimiser
/// step, the loss of every target without gradients (validation, context use), and a
/// checkpoint. The Mamba-2 runs on the hand-written CPU path ([`HostLearner`]); other
/// architectures on candle autograd ([`NetLearner`]).
trait Learner {
    /// The mean loss of (`x`, `y`) (B·T each) and the norm of its gradient, kept for [`Learner::apply`].
    fn gradients(&mut self, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<(f64, f64)>;
    /// An AdamW step with the kept gradients scaled by `scale`.
    fn apply(&mut self, lr: f64, scale: f64) -> Result<()>;
    /// The loss of every target (B·T; 0 where it is [`IGNORE`]), no gradients.
    fn token_losses(&self, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<Vec<f64>>;
    /// Saves the weights, the optimiser and `state` as `out`'s checkpoint.
    fn save(&self, out: &Path, state: &impl serde::Serialize) -> Result<()>;
}

/// A Mamba-2 on the CPU path: host weights, gradients and AdamW moments.
struct HostLearner {
    /// f32 products (validation and context use measure in f32 whatever the step multiplies in).
    trainer: CpuTrainer,
    step_trainer: CpuTrainer,
    config: Mamba2Config,
    weights: Mamba2Weights,
    grads: Mamba2Weights,
    opt: HostAdamW,
}

impl Learner for HostLearner {
    fn gradients(&mut self, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<(f64, f64)> {
        for g in params_mut(&mut self.grads) {
            g.fill(0.0);
        }
        let out = self.step_trainer.loss_and_grads(&self.weights, x, y, b, t, &mut self.grads)?;
        Ok((out.loss, HostAdamW::grad_norm(&params(&self.grads))))
    }

    fn apply(&mut self, lr: f64, scale: f64) -> Result<()> {
        self.opt.step(params_mut(&mut self.weights), &params(&self.grads), lr, scale)
    }

    fn token_losses(&self, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<Vec<f64>> {
        self.trainer.token_losses(&self.weights, x, y, b, t)
    }

    fn save(&self, out: &Path, state: &impl serde::Serialize) -> Result<()> {
        let (w, c) = (&self.weights, &self.config);
        checkpoint::write(out, |p| w.save_pretrained(p, c).map_err(|e| io(e, p)), |p| self.opt.save(p), state)
    }
}

/// Any [`Net`] on candle autograd, f32, with AdamW.
struct NetLearner<N> {
    net: N,
    opt: AdamW,
    grads: Option<candle_core::backprop::GradStore>,
}

impl<N: Net> Learner for NetLearner<N> {
    fn gradients(&mut self, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<(f64, f64)> {
        let tokens = Tensor::from_vec(x.to_vec(), (b, t), self.net.device())?;
        let (loss, _) = self.net.loss(&tokens, y, None)?;
        let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let grads = loss.backward()?;
        let norm = self.opt.grad_norm(&grads)?;
        self.grads = Some(grads);
        Ok((value, norm))
    }

    fn apply(&mut self, lr: f64, scale: f64) -> Result<()> {
        let grads = self.grads.take().ok_or_else(|| candle_core::Error::Msg("apply before gradients".into()))?;
        self.opt.step(&grads, lr, scale)
    }

    fn token_losses(&self, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<Vec<f64>> {
        let (logits, _) = self.net.forward(&Tensor::from_vec(x.to_vec(), (b, t), self.net.device())?, None)?;
        let rows: Vec<f32> = logits.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
        Ok(crate::xent::row_losses(&rows, logits.dim(2)?, y))
    }

    fn save(&self, out: &Path, state: &impl serde::Serialize) -> Result<()> {
        save_checkpoint(out, &self.net, &self.opt, state)
    }
}

/// The mean loss of the counted targets of a batch.
fn mean_loss(l: &impl Learner, x: &[u32], y: &[u32], b: usize, t: usize) -> Result<f64> {
    let counted = y.iter().filter(|&&v| v != IGNORE).count();
    if counted == 0 {
        candle_core::bail!("every target is ignored, the mean is undefined");
    }
    Ok(l.token_losses(x, y, b, t)?.iter().sum::<f64>() / counted as f64)
}

/// Mean validation loss over `n` consecutive windows of `val` (targets where `mask` is false
/// do not count; an empty mask counts all), in batches of `batch`.
fn validation_loss(
    l: &impl Learner,
    val: &[u32],
    mask: &[bool],
    seq_len: usize,
    n: usize,
    batch: usize,
) -> Result<f64> {
    validation_with(val, mask, seq_len, n, batch, |x, y, b| mean_loss(l, x, y, b, seq_len))
}

fn validation_with(
    val: &[u32],
    mask: &[bool],
    seq_len: usize,
    n: usize,
    batch: usize,
    mut mean_loss: impl FnMut(&[u32], &[u32], usize) -> Result<f64>,
) -> Result<f64> {
    let n = n.min(val.len().saturating_sub(1) / seq_len).max(1);
    let mut total = 0.0;
    let mut count = 0usize;
    let mut i = 0;
    while i < n {
        let b = batch.min(n - i);
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for j in i..i + b {
            let o = j * seq_len;
            x.extend_from_slice(&val[o..o + seq_len]);
            y.extend((o + 1..o + seq_len + 1).map(|j| if counts(mask, j) { val[j] } else { IGNORE }));
        }
        total += mean_loss(&x, &y, b)? * b as f64;
        count += b;
        i += b;
    }
    Ok(total / count as f64)
}

/// Context use on `pairs`: each pair's continuation scored after its query with nothing, the
/// previous paragraph or the random one before it, in batches of `batch` sequences.
fn context_use(learner: &impl Learner, pairs: &[ContextPair], batch: usize) -> Result<ContextUse> {
    // One sequence per (pair, condition): [before] + query + continuation, targets on the
    // continuation only; rows padded at the end with ignored targets.
    struct Seq {
        tokens: Vec<u32>,
        first: usize,
    }
    let mut seqs = Vec::with_capacity(pairs.len() * 3);
    for p in pairs {
        for before in [&[][..], &p.previous[..], &p.random[..]] {
            let mut tokens = before.to_vec();
            tokens.extend_from_slice(&p.query);
            let first = tokens.len();
            tokens.extend_from_slice(&p.continuation);
            seqs.push(Seq { tokens, first });
        }
    }
    let mut per_token: Vec<Vec<f64>> = Vec::with_capacity(seqs.len());
    for group in seqs.chunks(batch.max(1)) {
        let t = group.iter().map(|s| s.tokens.len() - 1).max().unwrap_or(1).max(1);
        let (mut x, mut y) = (Vec::with_capacity(group.len() * t), Vec::with_capacity(group.len() * t));
        for s in group {
            let n = s.tokens.len() - 1;
            x.extend_from_slice(&s.tokens[..n]);
            x.extend(std::iter::repeat_n(0u32, t - n));
            // Position i predicts token i + 1: count it when i + 1 is in the continuation.
            y.extend((0..n).map(|i| if i + 1 >= s.first { s.tokens[i + 1] } else { IGNORE }));
            y.extend(std::iter::repeat_n(IGNORE, t - n));
        }
        let losses = learner.token_losses(&x, &y, group.len(), t)?;
        for (r, s) in group.iter().enumerate() {
            let n = s.tokens.len() - 1;
            per_token.push(losses[r * t + s.first - 1..r * t + n].to_vec());
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (mut none, mut previous, mut random) = (0.0, 0.0, 0.0);
    let (mut recall_none, mut recall_prev, mut recall_n) = (0.0, 0.0, 0usize);
    for (i, p) in pairs.iter().enumerate() {
        let (a, b, c) = (&per_token[3 * i], &per_token[3 * i + 1], &per_token[3 * i + 2]);
        none += mean(a);
        previous += mean(b);
        random += mean(c);
        let bigrams: std::collections::HashSet<(u32, u32)> = p.previous.windows(2).map(|w| (w[0], w[1])).collect();
        for (j, &tok) in p.continuation.iter().enumerate() {
            let before = if j == 0 { *p.query.last().unwrap_or(&u32::MAX) } else { p.continuation[j - 1] };
            if bigrams.contains(&(before, tok)) {
                recall_none += a[j];
                recall_prev += b[j];
                recall_n += 1;
            }
        }
    }
    let n = pairs.len().max(1) as f64;
    let (none, previous, random) = (none / n, previous / n, random / n);
    let r = recall_n.max(1) as f64;
    Ok(ContextUse {
        pairs: pairs.len(),
        none,
        previous,
        random,
        gain: (none - previous) / none,
        random_gain: (none - random) / none,
        recall: (recall_none / r, recall_prev / r),
    })
}

/// Saves a checkpoint into `out/checkpoint` atomically (see [`crate::checkpoint`]).
pub(crate) fn save_checkpoint(out: &Path, net: &impl Net, opt: &AdamW, state: &impl serde::Serialize) -> Result<()> {
    checkpoint::write(out, |p| net.save_pretrained(p), |p| opt.save(p), state)
}

/// Where a run starts when `out` has no checkpoint of its own.
pub enum Start<'a> {
    /// Fresh weights from the config's seed and init options.
    Fresh,
    /// A warm start from a model folder (its `config.json` + weights, and `progress.json` if
    /// present: the step and loss history it reached). The optimiser's moments start at zero
    /// — they are not kept with a committed model — which the run log records.
    Warm(&'a Path),
}

/// What a model folder's `progress.json` records of the run that made it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ModelProgress<C = Mamba2Config> {
    /// The run's config.
    pub config: PretrainConfig<C>,
    /// Steps done.
    pub step: u64,
    /// The loss history.
    pub history: Vec<LogRow>,
    /// The run log's notes.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// Writes `progress.json` (config, step, history, notes) of the run in `out` into `dir`, so a
/// model folder can warm-start the run on another machine.
pub fn write_progress(out: &Path, dir: &Path) -> Result<()> {
    let ckpt = out.join("checkpoint").join("trainer.json");
    let text = std::fs::read_to_string(&ckpt).map_err(|e| io(e, &ckpt))?;
    // The architecture's config stays JSON: the same fields follow it whatever it is.
    let state: TrainerState<serde_json::Value> = serde_json::from_str(&text).map_err(|e| io(e, &ckpt))?;
    let p = ModelProgress { config: state.config, step: state.step, history: state.history, notes: state.notes };
    let path = dir.join("progress.json");
    std::fs::write(&path, serde_json::to_string(&p).map_err(|e| io(e, &path))?).map_err(|e| io(e, &path))
}

/// Where the run starts: `out`'s checkpoint (its weights, its trainer state, and the optimiser
/// file to load), else `start`'s weights (`load` reads a folder, `fresh` makes new ones).
#[allow(clippy::type_complexity)]
fn starting_point<C, W>(
    config: &PretrainConfig<C>,
    out: &Path,
    start: Start<'_>,
    load: impl Fn(&Path) -> Result<W>,
    fresh: impl FnOnce() -> W,
) -> Result<(W, TrainerState<C>, Option<std::path::PathBuf>)>
where
    C: Clone + PartialEq + serde::Serialize + serde::de::DeserializeOwned,
{
    checkpoint::recover(out)?;
    let ckpt = out.join(checkpoint::CHECKPOINT);
    if ckpt.join("trainer.json").is_file() {
        let text = std::fs::read_to_string(ckpt.join("trainer.json")).map_err(|e| io(e, &ckpt))?;
        let state: TrainerState<C> = serde_json::from_str(&text).map_err(|e| io(e, &ckpt))?;
        if &state.config != config {
            candle_core::bail!(
                "{}: this checkpoint was made with another configuration; resume with the same one (see its trainer.json) or use a new --out",
                ckpt.display()
            );
        }
        return Ok((load(&ckpt)?, state, Some(ckpt.join("optimizer.safetensors"))));
    }
    let fresh_state = |step, history, notes| TrainerState { config: config.clone(), step, history, notes };
    match start {
        Start::Fresh => Ok((fresh(), fresh_state(0, Vec::new(), Vec::new()), None)),
        Start::Warm(dir) => {
            let weights = load(dir)?;
            let progress = dir.join("progress.json");
            let (step, history, mut notes) = if progress.is_file() {
                let text = std::fs::read_to_string(&progress).map_err(|e| io(e, &progress))?;
                let p: ModelProgress<C> = serde_json::from_str(&text).map_err(|e| io(e, &progress))?;
                if &p.config != config {
                    candle_core::bail!(
                        "{}: the warm-start model was trained with another configuration; use its run config",
                        progress.display()
                    );
                }
                (p.step, p.history, p.notes)
            } else {
                (0, Vec::new(), Vec::new())
            };
            let note = format!(
                "warm start at step {step} from {} (weights only; the optimiser's moments restart at zero)",
                dir.display()
            );
            eprintln!("{note}");
            notes.push(note);
            Ok((weights, fresh_state(step, history, notes), None))
        }
    }
}

/// Checks that the corpus holds a window and creates `out`.
fn prepare<C>(config: &PretrainConfig<C>, data: &TokenData, out: &Path) -> Result<()> {
    config.validate()?;
    if data.train.len() < config.seq_len + 2 {
        return Err(candle_core::Error::Msg(format!(
            "the training corpus has {} tokens, fewer than one sequence of {}",
            data.train.len(),
            config.seq_len + 1
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| io(e, out))
}

/// What differs between the architectures a run can pretrain: the config's vocabulary, the
/// parameter count and memory a run needs, the training itself, and the model folder it makes.
pub trait PretrainArch: Clone + PartialEq + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned {
    /// The trainable model of this architecture (its weights' reading and writing).
    type Net: Net<Config = Self>;
    /// Sets the vocabulary (the tokenizer's, rounded up).
    fn set_vocab(&mut self, vocab: usize);
    /// Parameters of a model of this shape.
    fn n_params(&self) -> usize;
    /// A conservative estimate of a run's peak memory (bytes).
    fn peak_bytes(run: &PretrainConfig<Self>) -> u64;
    /// Trains (or resumes) as [`pretrain`] says.
    fn pretrain(
        run: &PretrainConfig<Self>,
        data: &TokenData,
        out: &Path,
        stop_after: Option<u64>,
        start: Start<'_>,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<Vec<LogRow>>;
    /// Writes the weights of the checkpoint `ckpt` as a model folder `dir`.
    fn export(&self, ckpt: &Path, dir: &Path) -> Result<()> {
        Self::Net::save_weights(&Self::Net::load_weights(ckpt, self)?, self, dir)
    }
}

impl PretrainArch for Mamba2Config {
    type Net = crate::TrainMamba2;

    fn set_vocab(&mut self, vocab: usize) {
        self.vocab_size = vocab;
    }

    fn n_params(&self) -> usize {
        init_weights(self, 0).n_params()
    }

    fn peak_bytes(run: &PretrainConfig<Self>) -> u64 {
        run.estimated_peak_bytes()
    }

    fn pretrain(
        run: &PretrainConfig<Self>,
        data: &TokenData,
        out: &Path,
        stop_after: Option<u64>,
        start: Start<'_>,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<Vec<LogRow>> {
        pretrain_mamba2(run, data, out, stop_after, start, on_progress)
    }
}

impl PretrainArch for GraniteHybridConfig {
    type Net = crate::TrainGraniteHybrid;

    fn set_vocab(&mut self, vocab: usize) {
        self.vocab_size = vocab;
        self.mamba.vocab_size = vocab;
    }

    fn n_params(&self) -> usize {
        GraniteHybridWeights::random(self, 0).n_params(self)
    }

    /// Parameters with gradients and moments, plus what candle's graph keeps per token: the
    /// logits (three copies), per Mamba layer about twice the CPU path's activations, per
    /// attention layer its projections and the (heads × window) scores (four copies), per
    /// layer the MLP (six of its width) and the norms; 2.5× for allocator slack.
    fn peak_bytes(run: &PretrainConfig<Self>) -> u64 {
        let c = &run.model;
        let m = &c.mamba;
        let tokens = (run.batch * run.seq_len) as u64;
        let mamba = 2 * (3 * m.d_in_proj() + 8 * m.conv_dim() + 10 * m.d_inner() + 4 * m.nheads * run.chunk);
        let attention = 4 * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + 4 * c.n_heads * run.seq_len;
        let per_layer = 6 * c.shared_intermediate + 8 * c.d_model;
        let n_attention = c.attention_layers().len();
        let per_token = 3 * c.vocab_size + c.n_mamba() * mamba + n_attention * attention + c.n_layer() * per_layer;
        (2.5 * 4.0 * (tokens * per_token as u64 + 4 * c.n_params() as u64) as f64) as u64
    }

    fn pretrain(
        run: &PretrainConfig<Self>,
        data: &TokenData,
        out: &Path,
        stop_after: Option<u64>,
        start: Start<'_>,
        on_progress: &mut dyn FnMut(&Progress),
    ) -> Result<Vec<LogRow>> {
        let init = || init_hybrid_weights(&run.model, run.seed, &run.init);
        pretrain_net::<Self::Net>(run, init, data, out, stop_after, start, on_progress)
    }
}

/// Trains (or resumes from `out/checkpoint`) a model of `config.model`'s architecture until
/// `config.steps`, or until `stop_after` steps have run in this call. Returns the loss history.
pub fn pretrain<C: PretrainArch>(
    config: &PretrainConfig<C>,
    data: &TokenData,
    out: &Path,
    stop_after: Option<u64>,
    start: Start<'_>,
    mut on_progress: impl FnMut(&Progress),
) -> Result<Vec<LogRow>> {
    C::pretrain(config, data, out, stop_after, start, &mut on_progress)
}

/// [`pretrain`] of a Mamba-2, on the hand-written CPU path.
fn pretrain_mamba2(
    config: &PretrainConfig,
    data: &TokenData,
    out: &Path,
    stop_after: Option<u64>,
    start: Start<'_>,
    on_progress: impl FnMut(&Progress),
) -> Result<Vec<LogRow>> {
    prepare(config, data, out)?;
    let c = &config.model;
    let (weights, mut state, optimizer) = starting_point(
        config,
        out,
        start,
        |dir| Mamba2Weights::load(dir, c).map_err(|e| io(e, dir)),
        || init_weights_with(c, config.seed, &config.init),
    )?;
    let mut opt = HostAdamW::new(param_shapes(c, &weights), config.adamw.clone());
    if let Some(path) = optimizer {
        opt.load(&path)?;
    }
    if config.matmul != Matmul::F32 {
        // Which kernel a (re)start got: a run resumed on another CPU may multiply differently.
        let note = format!("step {}: the step's matrix products run in {}", state.step, config.matmul.describe());
        eprintln!("{note}");
        state.notes.push(note);
    }
    let mut learner = HostLearner {
        trainer: CpuTrainer::new(c, config.chunk)?,
        step_trainer: CpuTrainer::new(c, config.chunk)?.with_matmul(config.matmul),
        config: c.clone(),
        grads: CpuTrainer::zero_grads(&weights),
        weights,
        opt,
    };
    run(config, data, out, stop_after, &mut learner, state, on_progress)
}

/// [`pretrain`] for any architecture [`Net`] trains, on candle autograd in f32: `init` makes
/// the fresh weights. The step's products are f32 whatever `config.matmul` says (refused
/// otherwise).
#[allow(clippy::too_many_arguments)]
pub fn pretrain_net<N: Net>(
    config: &PretrainConfig<N::Config>,
    init: impl FnOnce() -> N::Weights,
    data: &TokenData,
    out: &Path,
    stop_after: Option<u64>,
    start: Start<'_>,
    on_progress: impl FnMut(&Progress),
) -> Result<Vec<LogRow>> {
    if config.matmul != Matmul::F32 {
        candle_core::bail!("matmul {:?}: this architecture trains with f32 products only", config.matmul);
    }
    prepare(config, data, out)?;
    let c = &config.model;
    let (weights, state, optimizer) = starting_point(config, out, start, |dir| N::load_weights(dir, c), init)?;
    let net = N::build(c, &weights, DType::F32, &candle_core::Device::Cpu)?.with_chunk(config.chunk);
    let mut opt = AdamW::new(net.vars(), config.adamw.clone())?;
    if let Some(path) = optimizer {
        opt.load(&path)?;
    }
    let mut learner = NetLearner { net, opt, grads: None };
    run(config, data, out, stop_after, &mut learner, state, on_progress)
}

/// The loop: steps from `state` until `config.steps` (or `stop_after` in this call), with
/// validation, context use and checkpoints as the config says.
fn run<C: serde::Serialize>(
    config: &PretrainConfig<C>,
    data: &TokenData,
    out: &Path,
    stop_after: Option<u64>,
    learner: &mut impl Learner,
    mut state: TrainerState<C>,
    mut on_progress: impl FnMut(&Progress),
) -> Result<Vec<LogRow>> {
    let started = Instant::now();
    let seconds_before = state.history.last().map(|r| r.seconds).unwrap_or(0.0);
    let tokens_per_step = (config.batch * config.seq_len) as u64;
    let mut ran = 0u64;
    while state.step < config.steps && stop_after.is_none_or(|n| ran < n) {
        let step = state.step;
        let (x, y) = batch_at(&data.train, &data.train_mask, config, step);
        let (loss, grad_norm) = learner.gradients(&x, &y, config.batch, config.seq_len)?;
        if !grad_norm.is_finite() || !loss.is_finite() {
            candle_core::bail!(
                "step {}: the loss or the gradient is not finite (loss {loss}, gradient norm {grad_norm}); lower lr and restart from the last checkpoint",
                step + 1
            );
        }
        let scale = if grad_norm > config.clip { config.clip / grad_norm } else { 1.0 };
        let lr = lr_at(step, config.warmup, config.steps, config.lr, config.min_lr);
        learner.apply(lr, scale)?;
        state.step += 1;
        ran += 1;
        let last = state.step == config.steps;
        let validate = state.step.is_multiple_of(config.val_every) || last;
        let val_loss = if validate {
            Some(validation_loss(
                &*learner,
                &data.val,
                &data.val_mask,
                config.seq_len,
                config.val_sequences,
                config.batch,
            )?)
        } else {
            None
        };
        let context = if validate && !data.pairs.is_empty() {
            Some(context_use(&*learner, &data.pairs, config.batch * 2)?)
        } else {
            None
        };
        let row = LogRow {
            step: state.step,
            loss,
            val_loss,
            lr,
            grad_norm,
            tokens: state.step * tokens_per_step,
            seconds: seconds_before + started.elapsed().as_secs_f64(),
            context,
        };
        state.history.push(row);
        let tokens_per_s = (ran * tokens_per_step) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        on_progress(&Progress { row: state.history.last().expect("pushed"), total: config.steps, tokens_per_s });
        if state.step.is_multiple_of(config.checkpoint_every) || last {
            learner.save(out, &state)?;
        }
    }
    if ran > 0 && !state.step.is_multiple_of(config.checkpoint_every) && state.step != config.steps {
        learner.save(out, &state)?;
    }
    Ok(state.history)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(sampler: Sampler, loss_from: usize) -> PretrainConfig {
        PretrainConfig {
            model: Mamba2Config::tiny(1, 4),
            seq_len: 4,
            batch: 3,
            steps: 10,
            warmup: 1,
            lr: 1e-3,
            min_lr: 1e-4,
            clip: 1.0,
            adamw: AdamWConfig::default(),
            seed: 3,
            val_every: 5,
            val_sequences: 2,
            checkpoint_every: 5,
            chunk: 4,
            sampler,
            init: InitOptions::default(),
            loss_from,
            train_stream: None,
            matmul: Default::default(),
        }
    }

    /// Targets are the inputs shifted by one; masked-out targets and those before
    /// `loss_from` are ignored, and an empty mask counts everything.
    #[test]
    fn batches_respect_the_target_mask() {
        let tokens: Vec<u32> = (0..41).collect();
        let mask: Vec<bool> = (0..41).map(|j| j % 3 == 0).collect();
        for sampler in [Sampler::Random, Sampler::Epochs] {
            for loss_from in [0, 2] {
                let cfg = config(sampler, loss_from);
                let (x, y) = batch_at(&tokens, &mask, &cfg, 4);
                let (_, all) = batch_at(&tokens, &[], &cfg, 4);
                for (i, (&xi, &yi)) in x.iter().zip(&y).enumerate() {
                    let counted = i % 4 >= loss_from && (xi + 1) % 3 == 0;
                    assert_eq!(yi, if counted { xi + 1 } else { IGNORE }, "{sampler:?} position {i}");
                    assert_eq!(all[i], if i % 4 >= loss_from { xi + 1 } else { IGNORE });
                }
            }
        }
    }

    #[test]
    fn validation_counts_only_masked_targets() {
        let val: Vec<u32> = (0..9).collect();
        let mask: Vec<bool> = (0..9).map(|j| j == 2 || j == 7).collect();
        let mut seen = Vec::new();
        validation_with(&val, &mask, 4, 2, 2, |_, y, _| {
            seen = y.to_vec();
            Ok(0.0)
        })
        .unwrap();
        assert_eq!(seen, vec![IGNORE, 2, IGNORE, IGNORE, IGNORE, IGNORE, 7, IGNORE]);
    }
}
