//! The JSON config files of a training run (see models/README.md): the architecture and the
//! optimisation of pretraining ([`PretrainFile`]), and of composition fine-tuning
//! ([`ComposeFile`]). Unknown fields are refused, so a typo is an error rather than a default.

use picaso_model::granite_hybrid::LayerKind;
use picaso_model::{GraniteHybridConfig, Mamba2Config};
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

/// Which architecture a run trains.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    /// A pure Mamba-2 (the hand-written CPU path).
    #[default]
    Mamba2,
    /// A dense NoPE Granite 4.0 H hybrid: attention layers among Mamba-2 layers, each followed
    /// by a SwiGLU MLP (candle autograd).
    GraniteHybrid,
}

/// The config file: the architecture (vocabulary from the tokenizer) and the run's settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PretrainFile {
    /// `mamba2` (default) or `granite_hybrid`.
    #[serde(default)]
    pub arch: Arch,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Layers (Mamba-2 layers, plus the attention layers of a hybrid).
    pub n_layer: usize,
    /// A hybrid's attention layers (0-based indices; the others are Mamba-2 layers).
    #[serde(default)]
    pub attention: Vec<usize>,
    /// A hybrid's query heads.
    #[serde(default)]
    pub attn_heads: Option<usize>,
    /// A hybrid's key/value heads (default: attn_heads).
    #[serde(default)]
    pub kv_heads: Option<usize>,
    /// A hybrid's channels per attention head (default: d_model / attn_heads).
    #[serde(default)]
    pub attn_head_dim: Option<usize>,
    /// A hybrid's SwiGLU width (default: d_model).
    #[serde(default)]
    pub mlp: Option<usize>,
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
        self.check_arch()?;
        if !(self.val_fraction > 0.0 && self.val_fraction <= 0.5) {
            return Err(format!(
                "val_fraction = {}: the share of documents held out for validation must be above 0 and at most 0.5 (every second document)",
                self.val_fraction
            ));
        }
        Ok(())
    }

    /// A hybrid's fields only with `arch: granite_hybrid`, and with it consistent sizes.
    fn check_arch(&self) -> Result<(), String> {
        let hybrid_fields = !self.attention.is_empty()
            || self.attn_heads.is_some()
            || self.kv_heads.is_some()
            || self.attn_head_dim.is_some()
            || self.mlp.is_some();
        if self.arch == Arch::Mamba2 {
            return match hybrid_fields {
                true => Err("attention, attn_heads, kv_heads, attn_head_dim and mlp describe a hybrid: add \"arch\": \"granite_hybrid\"".into()),
                false => Ok(()),
            };
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(&i) = self.attention.iter().find(|&&i| i >= self.n_layer || !seen.insert(i)) {
            return Err(format!(
                "attention lists layer {i} twice or beyond the {} layers (0-based indices)",
                self.n_layer
            ));
        }
        if self.attention.len() == self.n_layer {
            return Err("attention lists every layer: a hybrid needs at least one Mamba-2 layer".into());
        }
        let heads = self.attn_heads.ok_or("a hybrid needs attn_heads")?;
        let kv = self.kv_heads.unwrap_or(heads);
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(format!(
                "attn_heads = {heads}, kv_heads = {kv}: both positive, attn_heads a multiple of kv_heads"
            ));
        }
        if self.attn_head_dim == Some(0)
            || self.mlp == Some(0)
            || (self.attn_head_dim.is_none() && self.d_model < heads)
        {
            return Err(
                "attn_head_dim and mlp must be positive (attn_head_dim defaults to d_model / attn_heads)".into()
            );
        }
        Ok(())
    }

    /// The hybrid's architecture (after [`PretrainFile::check`]), its vocabulary still unset (0).
    pub fn hybrid_config(&self) -> GraniteHybridConfig {
        let layers: Vec<LayerKind> = (0..self.n_layer)
            .map(|i| if self.attention.contains(&i) { LayerKind::Attention } else { LayerKind::Mamba })
            .collect();
        let n_mamba = layers.iter().filter(|k| **k == LayerKind::Mamba).count();
        let heads = self.attn_heads.unwrap_or(1);
        let head_dim = self.attn_head_dim.unwrap_or(self.d_model / heads.max(1));
        GraniteHybridConfig {
            family: Default::default(),
            d_model: self.d_model,
            vocab_size: 0,
            layers,
            mamba: Mamba2Config {
                n_layer: n_mamba,
                norm_eps: 1e-5,
                gated_norm_eps: 1e-5,
                time_step_limit: (0.0, f64::INFINITY),
                use_conv_bias: true,
                gate_norm: Default::default(),
                format: picaso_model::CheckpointFormat::HfTransformers,
                ..self.mamba2_config()
            },
            n_heads: heads,
            n_kv_heads: self.kv_heads.unwrap_or(heads),
            head_dim,
            attention_multiplier: 1.0 / (head_dim as f64).sqrt(),
            rope_theta: None,
            partial_rotary_factor: 1.0,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            logits_scaling: 1.0,
            shared_intermediate: self.mlp.unwrap_or(self.d_model),
            mlp_kind: picaso_model::granite_hybrid::MlpKind::SwiGlu,
            without_mlp: Vec::new(),
            n_experts: 0,
            top_k: 0,
            expert_intermediate: 0,
            routing: Default::default(),
            moe_layers: Vec::new(),
            moe_shared_intermediate: 0,
            mup: None,
            moe_latent: 0,
            norm_eps: 1e-5,
            tie_embeddings: true,
        }
    }

    fn mamba2_config(&self) -> Mamba2Config {
        Mamba2Config {
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
        }
    }

    /// The run's config for a Mamba-2, its vocabulary still unset (0): it is the tokenizer's.
    pub fn run_config(&self) -> PretrainConfig {
        self.run_config_of(self.mamba2_config())
    }

    /// The run's settings for the architecture `model`.
    pub fn run_config_of<C>(&self, model: C) -> PretrainConfig<C> {
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
