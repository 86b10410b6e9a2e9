//! The pretraining loop: packed sequences drawn deterministically from a token stream, AdamW
//! with warmup + cosine decay and gradient clipping, periodic validation, and checkpoints that
//! make a killed run resume to the same result as an uninterrupted one.
//!
//! Determinism: the batch of step `s` is a pure function of (seed, s) — no sampler state to
//! save — and a checkpoint holds the weights (f32, exact), the optimiser's moments and step,
//! and the loss history; so resuming at step s replays exactly what the uninterrupted run did.

use std::path::Path;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use picaso_model::{Mamba2Config, Mamba2Weights};
use rand::{Rng, SeedableRng};

use crate::mamba::TrainMamba2;
use crate::optim::{lr_at, AdamW, AdamWConfig};
use crate::Result;

/// Everything that defines a run (saved with each checkpoint; a resume must match it).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PretrainConfig {
    /// The architecture.
    pub model: Mamba2Config,
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
}

/// What a checkpoint folder's `trainer.json` holds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct TrainerState {
    config: PretrainConfig,
    step: u64,
    history: Vec<LogRow>,
}

/// Training and validation token streams (documents joined by EOS).
pub struct TokenData {
    /// Training tokens.
    pub train: Vec<u32>,
    /// Validation tokens.
    pub val: Vec<u32>,
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

/// Initial weights in the spirit of the Mamba reference: normal(0, 0.02) embedding and
/// projections (out_proj scaled by 1/√(2·n_layer)), dt_bias = softplus⁻¹ of a log-uniform dt in
/// [0.001, 0.1], A_log = log U(1, 16), D = 1, unit norms.
pub fn init_weights(c: &Mamba2Config, seed: u64) -> Mamba2Weights {
    let mut w = Mamba2Weights::random(c, seed);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut normal = |n: usize, std: f64| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
                (std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect()
    };
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

/// The (inputs, targets) of step `step`: `batch` windows of `seq_len + 1` tokens at offsets drawn
/// from (seed, step).
fn batch_at(tokens: &[u32], cfg: &PretrainConfig, step: u64, device: &Device) -> Result<(Tensor, Vec<u32>)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step);
    let span = tokens.len() - cfg.seq_len - 1;
    let (mut x, mut y) = (Vec::with_capacity(cfg.batch * cfg.seq_len), Vec::with_capacity(cfg.batch * cfg.seq_len));
    for _ in 0..cfg.batch {
        let o = rng.random_range(0..=span);
        x.extend_from_slice(&tokens[o..o + cfg.seq_len]);
        y.extend_from_slice(&tokens[o + 1..o + cfg.seq_len + 1]);
    }
    Ok((Tensor::from_vec(x, (cfg.batch, cfg.seq_len), device)?, y))
}

/// Mean validation loss over `val_sequences` consecutive windows of the validation stream.
pub fn validation_loss(net: &TrainMamba2, val: &[u32], seq_len: usize, n: usize, batch: usize) -> Result<f64> {
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
            y.extend_from_slice(&val[o + 1..o + seq_len + 1]);
        }
        let dev = net.device();
        let (loss, _) = net.loss(&Tensor::from_vec(x, (b, seq_len), dev)?, &y, None)?;
        total += loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * b as f64;
        count += b;
        i += b;
    }
    Ok(total / count as f64)
}

pub(crate) fn io(e: impl std::fmt::Display, path: &Path) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {e}", path.display()))
}

/// Saves a checkpoint into `out/checkpoint` atomically (written aside, then renamed).
pub(crate) fn save_checkpoint(out: &Path, net: &TrainMamba2, opt: &AdamW, state: &impl serde::Serialize) -> Result<()> {
    let tmp = out.join("checkpoint.tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io(e, &tmp))?;
    net.to_weights()?.save_pretrained(&tmp, net.config()).map_err(|e| io(e, &tmp))?;
    opt.save(&tmp.join("optimizer.safetensors"))?;
    let json = serde_json::to_string_pretty(state).map_err(|e| io(e, &tmp))?;
    std::fs::write(tmp.join("trainer.json"), json).map_err(|e| io(e, &tmp))?;
    let dst = out.join("checkpoint");
    let old = out.join("checkpoint.old");
    let _ = std::fs::remove_dir_all(&old);
    if dst.exists() {
        std::fs::rename(&dst, &old).map_err(|e| io(e, &dst))?;
    }
    std::fs::rename(&tmp, &dst).map_err(|e| io(e, &dst))?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// Trains (or resumes from `out/checkpoint`) until `config.steps`, or until `stop_after` steps
/// have run in this call. Returns the loss history.
pub fn pretrain(
    config: &PretrainConfig,
    data: &TokenData,
    out: &Path,
    stop_after: Option<u64>,
    mut on_progress: impl FnMut(&Progress),
) -> Result<Vec<LogRow>> {
    let device = Device::Cpu;
    if data.train.len() < config.seq_len + 2 {
        return Err(candle_core::Error::Msg(format!(
            "the training corpus has {} tokens, fewer than one sequence of {}",
            data.train.len(),
            config.seq_len + 1
        )));
    }
    std::fs::create_dir_all(out).map_err(|e| io(e, out))?;
    let ckpt = out.join("checkpoint");
    let (net, mut opt, mut state) = if ckpt.join("trainer.json").is_file() {
        let text = std::fs::read_to_string(ckpt.join("trainer.json")).map_err(|e| io(e, &ckpt))?;
        let state: TrainerState = serde_json::from_str(&text).map_err(|e| io(e, &ckpt))?;
        if &state.config != config {
            return Err(candle_core::Error::Msg(format!(
                "{}: this checkpoint was made with another configuration; resume with the same one (see its trainer.json) or use a new --out",
                ckpt.display()
            )));
        }
        let weights = Mamba2Weights::load(&ckpt, &config.model).map_err(|e| io(e, &ckpt))?;
        let net = TrainMamba2::from_weights(&config.model, &weights, DType::F32, &device)?.with_chunk(config.chunk);
        let mut opt = AdamW::new(net.vars(), config.adamw.clone())?;
        opt.load(&ckpt.join("optimizer.safetensors"))?;
        (net, opt, state)
    } else {
        let weights = init_weights(&config.model, config.seed);
        let net = TrainMamba2::from_weights(&config.model, &weights, DType::F32, &device)?.with_chunk(config.chunk);
        let opt = AdamW::new(net.vars(), config.adamw.clone())?;
        (net, opt, TrainerState { config: config.clone(), step: 0, history: Vec::new() })
    };
    let started = Instant::now();
    let seconds_before = state.history.last().map(|r| r.seconds).unwrap_or(0.0);
    let tokens_per_step = (config.batch * config.seq_len) as u64;
    let mut ran = 0u64;
    while state.step < config.steps && stop_after.is_none_or(|n| ran < n) {
        let step = state.step;
        let (x, y) = batch_at(&data.train, config, step, &device)?;
        let (loss, _) = net.loss(&x, &y, None)?;
        let grads = loss.backward()?;
        let grad_norm = opt.grad_norm(&grads)?;
        let scale = if grad_norm > config.clip { config.clip / grad_norm } else { 1.0 };
        let lr = lr_at(step, config.warmup, config.steps, config.lr, config.min_lr);
        opt.step(&grads, lr, scale)?;
        state.step += 1;
        ran += 1;
        let last = state.step == config.steps;
        let val_loss = if state.step % config.val_every == 0 || last {
            Some(validation_loss(&net, &data.val, config.seq_len, config.val_sequences, config.batch)?)
        } else {
            None
        };
        let row = LogRow {
            step: state.step,
            loss: loss.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            val_loss,
            lr,
            grad_norm,
            tokens: state.step * tokens_per_step,
            seconds: seconds_before + started.elapsed().as_secs_f64(),
        };
        state.history.push(row);
        let tokens_per_s = (ran * tokens_per_step) as f64 / started.elapsed().as_secs_f64().max(1e-9);
        on_progress(&Progress { row: state.history.last().expect("pushed"), total: config.steps, tokens_per_s });
        if state.step % config.checkpoint_every == 0 || last {
            save_checkpoint(out, &net, &opt, &state)?;
        }
    }
    if ran > 0 && state.step % config.checkpoint_every != 0 && state.step != config.steps {
        save_checkpoint(out, &net, &opt, &state)?;
    }
    Ok(state.history)
}
