//! Fine-tuning a model to use composed states (the paper's Section 5): the continuation of a
//! query is scored from the PICASO-R composition of retrieved contexts' states, and the loss
//! is backpropagated
//!
//! * **BPTC** (backpropagation through composition): the context states are recomputed by the
//!   model being trained, so the gradient reaches the weights through the states and through
//!   the composition weights (functions of the contexts' decays);
//! * **BP2C** (backpropagation to composition): the stored states are used as constants
//!   (stop-gradient); only the query and continuation are differentiated. Cheaper per step.
//!
//! Batches are a pure function of (seed, step), like pretraining, so a resumed run replays the
//! uninterrupted one; k is drawn uniformly from 0..=max_k per batch.

use std::borrow::Cow;
use std::path::Path;
use std::rc::Rc;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor};
use picaso_model::{Mamba2Config, State};
use rand::{Rng, SeedableRng};

use crate::checkpoint;
use crate::io;
use crate::mamba::TrainState;
use crate::net::Net;
use crate::optim::{check_counts, check_settings, check_warmup, lr_at, AdamW, AdamWConfig};
use crate::pretrain::save_checkpoint;
use crate::xent::IGNORE;
use crate::Result;

/// Which gradient path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Objective {
    /// Backpropagation through the composition (states recomputed with gradients).
    Bptc,
    /// Backpropagation to the composition (stored states, stop-gradient).
    Bp2c,
}

impl Objective {
    /// The paper's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bptc => "BPTC",
            Self::Bp2c => "BP2C",
        }
    }
}

impl std::str::FromStr for Objective {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "bptc" => Ok(Self::Bptc),
            "bp2c" => Ok(Self::Bp2c),
            _ => Err(format!("objective {s:?}: use bptc or bp2c")),
        }
    }
}

/// A retrieved context: its tokens (for BPTC) and its stored state (for BP2C).
#[derive(Debug, Clone)]
pub struct ContextItem {
    /// Token ids.
    pub tokens: Vec<u32>,
    /// The stored state after them.
    pub state: ContextState,
}

/// Where a context's state comes from when a BP2C step needs it.
#[derive(Clone)]
pub enum ContextState {
    /// Held in memory (generated episodes, recomputed states).
    Held(Box<State>),
    /// Read again at each use: a store's thousands of states do not fit in memory (the bundled
    /// model's 5,486 WikiText-2 train contexts are 11.5 GB in f32), and BPTC never reads them.
    Read(Rc<dyn Fn() -> Result<State>>),
}

impl ContextState {
    /// The state, borrowed when held, read when stored.
    pub fn get(&self) -> Result<Cow<'_, State>> {
        match self {
            Self::Held(s) => Ok(Cow::Borrowed(s)),
            Self::Read(read) => Ok(Cow::Owned(read()?)),
        }
    }
}

impl std::fmt::Debug for ContextState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Held(s) => f.debug_tuple("Held").field(&s.fingerprint).finish(),
            Self::Read(_) => f.write_str("Read"),
        }
    }
}

/// One training example.
#[derive(Debug, Clone)]
pub struct Example {
    /// Retrieved contexts, most relevant first (at least `max_k`).
    pub contexts: Vec<usize>,
    /// Query tokens.
    pub query: Vec<u32>,
    /// Continuation tokens (the loss is on these).
    pub continuation: Vec<u32>,
}

/// Examples and the contexts they refer to.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Where the examples come from, in words (e.g. a store's location): a checkpoint keeps it
    /// to say which examples it was trained on when a resume is given others.
    pub source: String,
    /// Contexts, indexed by [`Example::contexts`].
    pub contexts: Vec<ContextItem>,
    /// Training examples.
    pub train: Vec<Example>,
    /// Held-out examples for validation.
    pub val: Vec<Example>,
}

impl Dataset {
    /// xxh3-128 (hex) of the examples and their contexts' tokens: equal for the same examples
    /// wherever they were read from.
    pub fn fingerprint(&self) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut list = |items: &[u32]| {
            h.update(&(items.len() as u64).to_le_bytes());
            items.iter().for_each(|t| h.update(&t.to_le_bytes()));
        };
        for c in &self.contexts {
            list(&c.tokens);
        }
        for e in self.train.iter().chain(&self.val) {
            list(&e.contexts.iter().map(|&i| i as u32).collect::<Vec<_>>());
            list(&e.query);
            list(&e.continuation);
        }
        list(&[self.train.len() as u32, self.val.len() as u32]);
        format!("{:032x}", h.digest128())
    }
}

/// Everything that defines a fine-tuning run (a resume must match it); `C` is the model's
/// config ([`Net::Config`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ComposeConfig<C = Mamba2Config> {
    /// The architecture (of the starting model).
    pub model: C,
    /// Gradient path.
    pub objective: Objective,
    /// Examples per step.
    pub batch: usize,
    /// Optimiser steps.
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
    /// k is drawn uniformly from min_k..=max_k per batch.
    pub max_k: usize,
    /// Smallest k drawn (0 before this field existed).
    #[serde(default)]
    pub min_k: usize,
    /// Seed of the batch order and of k.
    pub seed: u64,
    /// Validate every this many steps (and at the end).
    pub val_every: u64,
    /// k used for validation (PICASO-R).
    pub val_k: usize,
    /// Save a checkpoint every this many steps.
    pub checkpoint_every: u64,
    /// Chunk length of the scan.
    pub chunk: usize,
}

/// One line of the fine-tuning log.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ComposeRow {
    /// Step (1-based).
    pub step: u64,
    /// k of this step's batch.
    pub k: usize,
    /// Continuation loss of the batch (nats/token).
    pub loss: f64,
    /// Validation loss (PICASO-R at `val_k` of states the current model recomputes, as a
    /// re-ingested store would hold), on validation steps.
    pub val_loss: Option<f64>,
    /// Learning rate.
    pub lr: f64,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Seconds this step took (forward, backward, update; validation excluded).
    pub step_seconds: f64,
    /// Wall seconds of training so far (over resumed parts).
    pub seconds: f64,
}

impl<C> ComposeConfig<C> {
    /// Checks the run's settings: counts of at least 1, `min_k` and `val_k` within `max_k`,
    /// and the optimiser's numbers ([`crate::optim::check_settings`]). [`finetune`] calls it;
    /// callers may call it earlier, before gathering examples.
    pub fn validate(&self) -> Result<()> {
        check_counts(&[
            ("batch", self.batch as u64),
            ("steps", self.steps),
            ("val_every", self.val_every),
            ("checkpoint_every", self.checkpoint_every),
            ("chunk", self.chunk as u64),
        ])?;
        for (name, k) in [("min_k", self.min_k), ("val_k", self.val_k)] {
            if k > self.max_k {
                candle_core::bail!("{name} = {k}: must be from 0 to max_k ({})", self.max_k);
            }
        }
        check_warmup(self.warmup, self.steps)?;
        check_settings(self.lr, self.min_lr, self.clip, &self.adamw)
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct ComposeTrainer<C> {
    config: ComposeConfig<C>,
    step: u64,
    history: Vec<ComposeRow>,
    /// What the run started from; `None` in checkpoints made before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    origin: Option<Origin>,
}

/// A fine-tuning run's starting model and examples, kept in its checkpoint: resumed with other
/// ones, the run would silently go on training the checkpoint's weights on them.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Origin {
    /// Fingerprint of the starting weights (what `picaso_model::Model::fingerprint` gives).
    model: String,
    /// Where the starting weights came from (a model folder), to name in a refusal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    model_source: Option<String>,
    /// [`Dataset::source`].
    data: String,
    /// [`Dataset::fingerprint`].
    data_fingerprint: String,
}

impl Origin {
    /// Refuses a resume from another model or on other examples, naming the original;
    /// `recorded` is `None` for a checkpoint that predates the record (resumed with a warning).
    fn check(&self, recorded: Option<&Origin>, ckpt: &Path) -> Result<()> {
        let Some(was) = recorded else {
            eprintln!(
                "{}: warning: this checkpoint does not record its starting model and examples (it predates the record); resuming without checking that they are the same",
                ckpt.display()
            );
            return Ok(());
        };
        if was.model != self.model {
            let named = |o: &Origin| match &o.model_source {
                Some(source) => format!("{source} (fingerprint {})", o.model),
                None => format!("the model with fingerprint {}", o.model),
            };
            candle_core::bail!(
                "{}: this checkpoint fine-tunes {}, but the model given is {}; resume with the original model (--model), or use a new --out to fine-tune this one",
                ckpt.display(),
                named(was),
                named(self)
            );
        }
        if was.data_fingerprint != self.data_fingerprint {
            candle_core::bail!(
                "{}: this checkpoint was trained on the examples of {}, but those of {} differ; resume with the original examples (the same --db, or the same config), or use a new --out",
                ckpt.display(),
                was.data,
                self.data
            );
        }
        Ok(())
    }
}

/// PICASO-R of `k` states per example. `states` holds `b·k` rows, example by example, each
/// example's contexts in sequence order (the last is nearest the query). Per head, context `i`
/// gets `w_i = (1/k) Σ_{m<k} exp(ℓ_{i+1} + … + ℓ_{i+m})` (indices mod k) — its CASO weight
/// averaged over the k rotations — computed in f64 from cumulative log-decays, never dividing
/// by products of decays. Conv tails are averaged, log-decays summed (as at inference). A
/// hybrid's attention layers get the union of the contexts' keys and values, in sequence
/// order, their padding still masked.
pub fn picaso_r(states: &TrainState, b: usize, k: usize) -> Result<TrainState> {
    let mut out = TrainState::default();
    let union = |x: &Tensor| -> Result<Tensor> {
        let dims = x.dims();
        let mut shape = vec![b, k * dims[1]];
        shape.extend_from_slice(&dims[2..]);
        x.reshape(shape)
    };
    for (keys, values) in states.keys.iter().zip(&states.values) {
        out.keys.push(union(keys)?);
        out.values.push(union(values)?);
    }
    out.kv_mask = states.kv_mask.as_ref().map(union).transpose()?;
    for l in 0..states.ssm.len() {
        let (rows, h, p, n) = states.ssm[l].dims4()?;
        if rows != b * k {
            candle_core::bail!("picaso_r: {rows} states for {b} examples of {k}");
        }
        let dtype = states.ssm[l].dtype();
        let ld = states.log_decay[l].reshape((b, k, h))?; // (B, k, H)
        let ld64 = ld.to_dtype(DType::F64)?;
        let c = Tensor::cat(&[&ld64, &ld64], 1)?.cumsum(1)?; // (B, 2k, H): c_j = ℓ_0 + … + ℓ_j
        let base = c.narrow(1, 0, k)?;
        let mut w = c.narrow(1, 0, k)?.zeros_like()?;
        for m in 0..k {
            w = (w + (c.narrow(1, m, k)? - &base)?.exp()?)?;
        }
        let w = (w / k as f64)?.to_dtype(dtype)?; // (B, k, H)
                                                  // Σ_i w_i ⊙ x_i as one batched product: (B, H, 1, k) @ (B, H, k, P·N).
        let x = states.ssm[l].reshape((b, k, h, p * n))?.transpose(1, 2)?.contiguous()?;
        let wt = w.transpose(1, 2)?.contiguous()?.unsqueeze(2)?;
        out.ssm.push(wt.matmul(&x)?.reshape((b, h, p, n))?);
        let (_, cd, kt) = states.conv[l].dims3()?;
        out.conv.push(states.conv[l].reshape((b, k, cd * kt))?.mean(1)?.reshape((b, cd, kt))?);
        out.log_decay.push(ld.sum(1)?);
    }
    Ok(out)
}

/// Tokens (B, T) of query+continuation right-padded, targets with only the continuation
/// counted, and how many targets count.
fn query_batch(examples: &[&Example], device: &Device) -> Result<(Tensor, Vec<u32>, usize)> {
    let t = examples.iter().map(|e| e.query.len() + e.continuation.len() - 1).max().unwrap_or(1);
    let (mut x, mut y) = (Vec::with_capacity(examples.len() * t), Vec::with_capacity(examples.len() * t));
    for e in examples {
        let all: Vec<u32> = e.query.iter().chain(&e.continuation).copied().collect();
        let inputs = &all[..all.len() - 1];
        for (i, &tok) in inputs.iter().enumerate() {
            x.push(tok);
            y.push(if i + 1 >= e.query.len() { all[i + 1] } else { IGNORE });
        }
        for _ in inputs.len()..t {
            x.push(0);
            y.push(IGNORE);
        }
    }
    let counted = y.iter().filter(|&&t| t != IGNORE).count();
    Ok((Tensor::from_vec(x, (examples.len(), t), device)?, y, counted))
}

/// The composed starting states of `examples` at `k` under `objective`.
fn composed<N: Net>(
    net: &N,
    data: &Dataset,
    examples: &[&Example],
    k: usize,
    objective: Objective,
) -> Result<Option<TrainState>> {
    if k == 0 {
        return Ok(None);
    }
    // Sequence order: the most relevant context last, nearest the query.
    let ids: Vec<usize> = examples.iter().flat_map(|e| e.contexts[..k].iter().rev().copied()).collect();
    let states = match objective {
        Objective::Bptc => {
            let lists: Vec<&[u32]> = ids.iter().map(|&i| data.contexts[i].tokens.as_slice()).collect();
            net.context_states(&lists, 16)?
        }
        Objective::Bp2c => {
            let states: Vec<Cow<'_, State>> =
                ids.iter().map(|&i| data.contexts[i].state.get()).collect::<Result<_>>()?;
            let refs: Vec<&State> = states.iter().map(|s| s.as_ref()).collect();
            net.stack_states(&refs)?
        }
    };
    Ok(Some(picaso_r(&states, examples.len(), k)?))
}

/// Mean continuation loss over `examples` at `k` (no gradient kept).
pub fn eval_loss<N: Net>(
    net: &N,
    data: &Dataset,
    examples: &[Example],
    k: usize,
    objective: Objective,
    micro_batch: usize,
) -> Result<f64> {
    let mut total = 0.0;
    let mut count = 0usize;
    for chunk in examples.chunks(micro_batch.max(1)) {
        let refs: Vec<&Example> = chunk.iter().collect();
        let init = composed(net, data, &refs, k, objective)?;
        let (x, y, n) = query_batch(&refs, net.device())?;
        let (loss, _) = net.loss(&x, &y, init.as_ref())?;
        total += loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * n as f64;
        count += n;
    }
    Ok(total / count.max(1) as f64)
}

/// The mean continuation loss of `examples` at `k` and its gradients, `micro_batch` examples
/// per forward pass. Each micro-batch's loss is weighted by its share of the batch's counted
/// tokens and the gradients are summed, so the step is the one of a single pass over the
/// batch, while the autograd graph held at once shrinks by batch / micro_batch (BPTC at k = 10
/// and batch 8 holds 24 GB in one pass for the bundled model).
fn batch_gradients<N: Net>(
    net: &N,
    data: &Dataset,
    examples: &[&Example],
    k: usize,
    objective: Objective,
    micro_batch: usize,
) -> Result<(f64, GradStore)> {
    let parts: Vec<&[&Example]> = examples.chunks(micro_batch.max(1)).collect();
    let batches = parts.iter().map(|part| query_batch(part, net.device())).collect::<Result<Vec<_>>>()?;
    let total: usize = batches.iter().map(|b| b.2).sum();
    if total == 0 {
        candle_core::bail!("a batch with no continuation tokens to score");
    }
    let mut loss_sum = 0.0;
    let mut summed: Option<GradStore> = None;
    for (part, (x, y, n)) in parts.iter().zip(&batches) {
        if *n == 0 {
            continue;
        }
        let share = *n as f64 / total as f64;
        let init = composed(net, data, part, k, objective)?;
        let (loss, _) = net.loss(x, y, init.as_ref())?;
        loss_sum += loss.to_dtype(DType::F64)?.to_scalar::<f64>()? * share;
        let grads = (loss * share)?.backward()?;
        summed = Some(match summed {
            None => grads,
            Some(mut acc) => {
                for var in net.vars() {
                    let Some(g) = grads.get(var.as_tensor()) else { continue };
                    let sum = match acc.get(var.as_tensor()) {
                        Some(prev) => (prev + g)?,
                        None => g.clone(),
                    };
                    acc.insert(var.as_tensor(), sum);
                }
                acc
            }
        });
    }
    Ok((loss_sum, summed.expect("a batch with counted tokens has a micro-batch")))
}

/// (examples, k) of step `step`.
fn batch_at<'a, C>(data: &'a Dataset, cfg: &ComposeConfig<C>, step: u64) -> (Vec<&'a Example>, usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ step);
    let k = rng.random_range(cfg.min_k.min(cfg.max_k)..=cfg.max_k);
    let examples = (0..cfg.batch).map(|_| &data.train[rng.random_range(0..data.train.len())]).collect();
    (examples, k)
}

/// Fine-tunes `weights` (or resumes `out/checkpoint`) until `config.steps` or `stop_after`
/// steps in this call; `on_row` after each step. Returns the log. `micro_batch` examples go
/// through the model at once (the steps are the same for any value, to float rounding; a
/// smaller one needs less memory). A resume must be given the same config, starting weights
/// and examples as the run that made the checkpoint; `model_source` (where the weights came
/// from) names them when they are not.
#[allow(clippy::too_many_arguments)]
pub fn finetune<N: Net>(
    config: &ComposeConfig<N::Config>,
    weights: &N::Weights,
    model_source: &str,
    data: &Dataset,
    out: &Path,
    stop_after: Option<u64>,
    micro_batch: usize,
    mut on_row: impl FnMut(&ComposeRow),
) -> Result<Vec<ComposeRow>> {
    let device = Device::Cpu;
    config.validate()?;
    if data.train.is_empty() {
        candle_core::bail!("no training examples");
    }
    if let Some(e) = data.train.iter().chain(&data.val).find(|e| e.contexts.len() < config.max_k) {
        candle_core::bail!("an example has {} contexts, fewer than max_k = {}", e.contexts.len(), config.max_k);
    }
    std::fs::create_dir_all(out).map_err(|e| io(e, out))?;
    let origin = Origin {
        model: N::fingerprint(weights, &config.model),
        model_source: Some(model_source.to_string()),
        data: data.source.clone(),
        data_fingerprint: data.fingerprint(),
    };
    checkpoint::recover(out)?;
    let ckpt = out.join(checkpoint::CHECKPOINT);
    let (net, mut opt, mut state) = if ckpt.join("trainer.json").is_file() {
        let text = std::fs::read_to_string(ckpt.join("trainer.json")).map_err(|e| io(e, &ckpt))?;
        let mut state: ComposeTrainer<N::Config> = serde_json::from_str(&text).map_err(|e| io(e, &ckpt))?;
        if &state.config != config {
            candle_core::bail!(
                "{}: this checkpoint was made with another configuration; resume with the same one (see its trainer.json) or use a new --out",
                ckpt.display()
            );
        }
        origin.check(state.origin.as_ref(), &ckpt)?;
        state.origin.get_or_insert(origin);
        let w = N::load_weights(&ckpt, &config.model)?;
        let net = N::build(&config.model, &w, DType::F32, &device)?.with_chunk(config.chunk);
        let mut opt = AdamW::new(net.vars(), config.adamw.clone())?;
        opt.load(&ckpt.join("optimizer.safetensors"))?;
        (net, opt, state)
    } else {
        let net = N::build(&config.model, weights, DType::F32, &device)?.with_chunk(config.chunk);
        let opt = AdamW::new(net.vars(), config.adamw.clone())?;
        (net, opt, ComposeTrainer { config: config.clone(), step: 0, history: Vec::new(), origin: Some(origin) })
    };
    let started = Instant::now();
    let seconds_before = state.history.last().map(|r| r.seconds).unwrap_or(0.0);
    let mut ran = 0u64;
    while state.step < config.steps && stop_after.is_none_or(|n| ran < n) {
        let t0 = Instant::now();
        let (examples, k) = batch_at(data, config, state.step);
        let (loss, grads) = batch_gradients(&net, data, &examples, k, config.objective, micro_batch)?;
        let grad_norm = opt.grad_norm(&grads)?;
        let scale = if grad_norm > config.clip { config.clip / grad_norm } else { 1.0 };
        let lr = lr_at(state.step, config.warmup, config.steps, config.lr, config.min_lr);
        opt.step(&grads, lr, scale)?;
        let step_seconds = t0.elapsed().as_secs_f64();
        state.step += 1;
        ran += 1;
        let last = state.step == config.steps;
        let val_loss = if !data.val.is_empty() && (state.step % config.val_every == 0 || last) {
            Some(eval_loss(&net, data, &data.val, config.val_k, Objective::Bptc, micro_batch)?)
        } else {
            None
        };
        let row = ComposeRow {
            step: state.step,
            k,
            loss,
            val_loss,
            lr,
            grad_norm,
            step_seconds,
            seconds: seconds_before + started.elapsed().as_secs_f64(),
        };
        on_row(&row);
        state.history.push(row);
        if state.step % config.checkpoint_every == 0 || last {
            save_checkpoint(out, &net, &opt, &state)?;
        }
    }
    if ran > 0 && state.step % config.checkpoint_every != 0 && state.step != config.steps {
        save_checkpoint(out, &net, &opt, &state)?;
    }
    Ok(state.history)
}
