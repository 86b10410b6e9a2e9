//! The JSON config files of a training run (see models/README.md): the architecture and the
//! optimisation of pretraining ([`PretrainFile`]), and of composition fine-tuning
//! ([`ComposeFile`]). Unknown fields are refused, so a typo is an error rather than a default.

use picaso_model::Mamba2Config;
use serde::Deserialize;

use crate::pretrain::PretrainConfig;

/// The fine-tuning config file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComposeFile {
    /// Sequences (or examples) per optimiser step.
    pub batch: usize,
    /// Optimiser steps of the whole run.
    pub steps: u64,
    /// Steps of linear learning-rate warm-up.
    pub warmup: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Gradient-norm clip (default 1).
    #[serde(default = "clip")]
    pub clip: f64,
    /// AdamW's weight decay (default: the optimiser's).
    #[serde(default)]
    pub weight_decay: Option<f64>,
    /// k is drawn uniformly from 0..=max_k per batch.
    #[serde(default = "ten")]
    pub max_k: usize,
    /// Seed of the data order and initialisation.
    #[serde(default)]
    pub seed: u64,
    /// Steps between validations.
    pub val_every: u64,
    /// k of the validation loss.
    #[serde(default = "five")]
    pub val_k: usize,
    /// Passages held out for validation (every n-th of the store).
    #[serde(default = "val_passages")]
    pub val_passages: usize,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
    /// Chunk length of the chunked scan (default 64).
    #[serde(default = "chunk")]
    pub chunk: usize,
    /// Smallest k drawn (1 when every example's first context holds its answer).
    #[serde(default)]
    pub min_k: usize,
    /// Fine-tune on generated recall episodes (the model's synthetic recall vocabulary)
    /// instead of a store.
    #[serde(default)]
    pub recall: Option<RecallEpisodes>,
}

/// The `recall` section of a fine-tuning config: each example asks for one fact of its first
/// context, among max_k − 1 other contexts of facts.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecallEpisodes {
    /// Facts per context.
    pub facts: usize,
    /// Training examples generated (validation: `val_passages` more).
    pub episodes: usize,
}

fn ten() -> usize {
    10
}

fn five() -> usize {
    5
}

fn val_passages() -> usize {
    64
}

/// The config file: the architecture (vocabulary from the tokenizer) and the run's settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PretrainFile {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Mamba-2 layers.
    pub n_layer: usize,
    /// SSM state size per head.
    pub d_state: usize,
    /// Channels per head.
    pub headdim: usize,
    /// Inner width as a multiple of d_model (default 2).
    #[serde(default = "two")]
    pub expand: usize,
    /// Groups sharing B and C (default 1).
    #[serde(default = "one")]
    pub n_groups: usize,
    /// Causal convolution width (default 4).
    #[serde(default = "four")]
    pub d_conv: usize,
    /// Vocabulary of the BPE trained on the corpora (ignored with --tokenizer).
    #[serde(default = "vocab")]
    pub vocab: usize,
    /// Share of documents held out for validation.
    #[serde(default = "val_fraction")]
    pub val_fraction: f64,
    /// Tokens per training window.
    pub seq_len: usize,
    /// Sequences (or examples) per optimiser step.
    pub batch: usize,
    /// Optimiser steps of the whole run.
    pub steps: u64,
    /// Steps of linear learning-rate warm-up.
    pub warmup: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    pub min_lr: f64,
    /// Gradient-norm clip (default 1).
    #[serde(default = "clip")]
    pub clip: f64,
    /// AdamW's weight decay (default: the optimiser's).
    #[serde(default)]
    pub weight_decay: Option<f64>,
    /// Seed of the data order and initialisation.
    #[serde(default)]
    pub seed: u64,
    /// Steps between validations.
    pub val_every: u64,
    /// Validation windows per validation.
    pub val_sequences: usize,
    /// Steps between checkpoints.
    pub checkpoint_every: u64,
    /// Chunk length of the chunked scan (default 64).
    #[serde(default = "chunk")]
    pub chunk: usize,
    /// `random` (offsets with replacement) or `epochs` (each window once per epoch).
    #[serde(default)]
    pub sampler: crate::pretrain::Sampler,
    /// How fresh weights are initialised.
    #[serde(default)]
    pub init: crate::pretrain::InitOptions,
    /// Targets before this window position do not count.
    #[serde(default)]
    pub loss_from: usize,
    /// `f32` (default) or `bf16`: the training step's matrix products with bf16 operands on
    /// AMX tiles (f32 on CPUs without them; the run log says which ran).
    #[serde(default)]
    pub matmul: crate::cpu::ops::Matmul,
    /// Held-out paragraph pairs for the context-use check at each validation.
    #[serde(default)]
    pub context_pairs: usize,
    /// Train the tokenizer on the first documents holding this many MB of text (0: all).
    #[serde(default)]
    pub tokenizer_mb: usize,
    /// Generate multi-query associative recall sequences instead of reading corpora.
    #[serde(default)]
    pub recall: Option<RecallData>,
}

/// The `recall` section of a config: synthetic recall sequences (see `picaso eval recall`),
/// each exactly one training window long, scored on their answers only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecallData {
    /// Key tokens `k0…`.
    pub keys: usize,
    /// Value tokens `v0…`.
    pub values: usize,
    /// Facts per context.
    pub facts: usize,
    /// Contexts per sequence are drawn from 1..=max_k.
    pub max_k: usize,
    /// Sequences generated (the validation share is held out of them).
    pub sequences: usize,
}

impl PretrainFile {
    /// Checks the sizes and the validation share (what serde cannot), before minutes of
    /// reading and tokenizing corpora.
    pub fn check(&self) -> Result<(), String> {
        let shape_ok = self.d_model > 0
            && self.n_layer > 0
            && self.d_state > 0
            && self.headdim > 0
            && self.n_groups > 0
            && self.d_conv > 1
            && (self.d_model * self.expand).is_multiple_of(self.headdim)
            && (self.d_model * self.expand / self.headdim).is_multiple_of(self.n_groups);
        if !shape_ok {
            return Err("sizes must be positive, d_conv at least 2, d_model·expand a multiple of headdim and the heads a multiple of n_groups".into());
        }
        if !(self.val_fraction > 0.0 && self.val_fraction <= 0.5) {
            return Err(format!(
                "val_fraction = {}: the share of documents held out for validation must be above 0 and at most 0.5 (every second document)",
                self.val_fraction
            ));
        }
        Ok(())
    }

    /// The run's config, its vocabulary still unset (0): it is the tokenizer's.
    pub fn run_config(&self) -> PretrainConfig {
        let model = Mamba2Config {
            d_model: self.d_model,
            n_layer: self.n_layer,
            vocab_size: 0,
            d_state: self.d_state,
            headdim: self.headdim,
            nheads: self.d_model * self.expand / self.headdim,
            expand: self.expand,
            n_groups: self.n_groups,
            d_conv: self.d_conv,
            ..Mamba2Config::tiny(self.n_layer, self.d_conv)
        };
        let mut adamw = crate::optim::AdamWConfig::default();
        if let Some(wd) = self.weight_decay {
            adamw.weight_decay = wd;
        }
        PretrainConfig {
            model,
            seq_len: self.seq_len,
            batch: self.batch,
            steps: self.steps,
            warmup: self.warmup,
            lr: self.lr,
            min_lr: self.min_lr,
            clip: self.clip,
            adamw,
            seed: self.seed,
            val_every: self.val_every,
            val_sequences: self.val_sequences,
            checkpoint_every: self.checkpoint_every,
            chunk: self.chunk,
            sampler: self.sampler,
            init: self.init.clone(),
            loss_from: self.loss_from,
            train_stream: None,
            matmul: self.matmul,
        }
    }

    /// Every this many-th document (or recall sequence) is held out for validation.
    pub fn held_out_every(&self) -> usize {
        (1.0 / self.val_fraction).round() as usize
    }
}

fn two() -> usize {
    2
}

fn one() -> usize {
    1
}

fn four() -> usize {
    4
}

fn vocab() -> usize {
    8192
}

fn val_fraction() -> f64 {
    0.01
}

fn clip() -> f64 {
    1.0
}

fn chunk() -> usize {
    64
}
