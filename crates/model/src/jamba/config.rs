//! [`JambaConfig`]: transformers' `JambaConfig` (AI21's Jamba: Jamba v0.1, 1.5, 1.6, 1.7 and
//! Jamba Reasoning 3B). Layers are Mamba-1 mixers with RMSNorms on the time step, B and C,
//! except every `attn_layer_period`-th from `attn_layer_offset`, which is NoPE grouped-query
//! attention; after each mixer comes a SwiGLU MLP, or on every `expert_layer_period`-th layer
//! from `expert_layer_offset` (when `num_experts` > 1) routed experts instead.

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{CheckpointFormat, Fields};
use crate::error::{Error, Result};
use crate::mamba1::Mamba1Config;
use crate::state::{AttentionShape, StateShape};

/// Everything that shapes a Jamba model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JambaConfig {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Rows of the embedding matrix.
    pub vocab_size: usize,
    /// Layers of the model.
    pub n_layer: usize,
    /// Layer i attends when `i % attn_period == attn_offset` (`attn_layer_period`, `_offset`).
    pub attn_period: usize,
    /// See `attn_period`.
    pub attn_offset: usize,
    /// Layer i has routed experts when `n_experts > 1` and `i % expert_period == expert_offset`.
    pub expert_period: usize,
    /// See `expert_period`.
    pub expert_offset: usize,
    /// Routed experts of an expert layer (`num_experts`; 1: every layer has a dense MLP).
    pub n_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// Inner width of the MLP and of each expert (`intermediate_size`).
    pub intermediate: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads.
    pub n_kv_heads: usize,
    /// Channels per attention head.
    pub head_dim: usize,
    /// The Mamba-1 mixers' settings (`n_layer` counts the Mamba layers; `norm_eps` is also
    /// the epsilon of the time step's, B's and C's RMSNorms).
    pub mamba: Mamba1Config,
    /// Epsilon of every RMSNorm (`rms_norm_eps`).
    pub norm_eps: f64,
    /// Whether the LM head is the embedding matrix.
    pub tie_embeddings: bool,
}

impl JambaConfig {
    /// Reads transformers' `config.json` of a `jamba` model. Options picaso does not implement
    /// are refused by name (never silently computed wrong).
    pub fn from_hf(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let bad = |m: String| Error::config(path, m);
        if let Some(act) = map.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" && act != "swish" {
                return Err(bad(format!("hidden_act is {act:?}; picaso runs Jamba's \"silu\" (SwiGLU)")));
            }
        }
        if !matches!(map.get("sliding_window"), None | Some(Value::Null)) {
            return Err(bad(
                "`sliding_window` on a Jamba model: older transformers versions attend within a window, picaso \
                 attends to every key; remove the key (or set it to null) to run full attention"
                    .into(),
            ));
        }
        let d_model = f.usize("hidden_size")?;
        let n_layer = f.usize("num_hidden_layers")?;
        let n_heads = f.usize_or("num_attention_heads", 32)?;
        let head_dim = match map.get("head_dim") {
            Some(v) if !v.is_null() => f.usize("head_dim")?,
            _ => d_model / n_heads.max(1),
        };
        let norm_eps = f.f64_or("rms_norm_eps", 1e-6)?;
        let dt_rank = match map.get("mamba_dt_rank") {
            None | Some(Value::Null) => d_model.div_ceil(16),
            Some(Value::String(s)) if s == "auto" => d_model.div_ceil(16),
            Some(_) => f.usize("mamba_dt_rank")?,
        };
        // transformers reads `num_local_experts` as `num_experts` (its attribute map).
        let n_experts = match (map.get("num_experts"), map.get("num_local_experts")) {
            (Some(v), Some(w)) if !v.is_null() && !w.is_null() && v != w => {
                return Err(bad(format!("num_experts ({v}) and num_local_experts ({w}) disagree; give one")));
            }
            (None | Some(Value::Null), Some(w)) if !w.is_null() => f.usize("num_local_experts")?,
            _ => f.usize_or("num_experts", 16)?,
        };
        // transformers' default is 8; an explicit null means as many as the query heads.
        let n_kv_heads = match map.get("num_key_value_heads") {
            None => 8,
            Some(Value::Null) => n_heads,
            Some(_) => f.usize("num_key_value_heads")?,
        };
        let tie_embeddings = f.bool_or("tie_word_embeddings", false)?;
        let config = Self {
            d_model,
            vocab_size: f.usize_or("vocab_size", 65536)?,
            n_layer,
            attn_period: f.usize_or("attn_layer_period", 8)?,
            attn_offset: f.usize_or("attn_layer_offset", 4)?,
            expert_period: f.usize_or("expert_layer_period", 2)?,
            expert_offset: f.usize_or("expert_layer_offset", 1)?,
            n_experts,
            top_k: f.usize_or("num_experts_per_tok", 2)?,
            intermediate: f.usize_or("intermediate_size", 14336)?,
            n_heads,
            n_kv_heads,
            head_dim,
            mamba: Mamba1Config {
                d_model,
                n_layer: 0,
                vocab_size: 0,
                d_state: f.usize_or("mamba_d_state", 16)?,
                d_conv: f.usize_or("mamba_d_conv", 4)?,
                expand: f.usize_or("mamba_expand", 2)?,
                dt_rank,
                norm_eps,
                tie_embeddings,
                use_bias: f.bool_or("mamba_proj_bias", false)?,
                use_conv_bias: f.bool_or("mamba_conv_bias", true)?,
                format: CheckpointFormat::HfTransformers,
            },
            norm_eps,
            tie_embeddings,
        };
        config.check_layout(path)?;
        let config = config.with_layout();
        config.validate(path)?;
        Ok(config)
    }

    /// Checks the layer count, periods and offsets, which the layout is computed from.
    fn check_layout(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, m));
        for (name, v) in [
            ("num_hidden_layers", self.n_layer),
            ("attn_layer_period", self.attn_period),
            ("expert_layer_period", self.expert_period),
        ] {
            if v == 0 || v > 1 << 24 {
                return bad(format!("`{name}` is {v}; it must be between 1 and 2^24"));
            }
        }
        if self.attn_offset >= self.attn_period || self.expert_offset >= self.expert_period {
            return bad(format!(
                "attn_layer_offset ({}) and expert_layer_offset ({}) must be below their periods ({}, {})",
                self.attn_offset, self.expert_offset, self.attn_period, self.expert_period
            ));
        }
        if self.mamba_layers().is_empty() {
            return bad(format!(
                "every one of the {} layers attends (attn_layer_period {}, offset {}): a Jamba model without a \
                 Mamba layer has no state for picaso to compose",
                self.n_layer, self.attn_period, self.attn_offset
            ));
        }
        Ok(())
    }

    /// The config with the Mamba settings' layer count and vocabulary filled in from the layout.
    pub fn with_layout(mut self) -> Self {
        self.mamba.n_layer = self.mamba_layers().len();
        self.mamba.vocab_size = self.vocab_size;
        self
    }

    /// Whether layer `i` attends (else it runs a Mamba mixer).
    pub fn attends(&self, i: usize) -> bool {
        i % self.attn_period == self.attn_offset
    }

    /// Whether layer `i` has routed experts (else a dense MLP).
    pub fn has_experts(&self, i: usize) -> bool {
        self.n_experts > 1 && i % self.expert_period == self.expert_offset
    }

    /// The model's index of each attention layer.
    pub fn attention_layers(&self) -> Vec<usize> {
        (0..self.n_layer).filter(|&i| self.attends(i)).collect()
    }

    /// The model's index of each Mamba layer.
    pub fn mamba_layers(&self) -> Vec<usize> {
        (0..self.n_layer).filter(|&i| !self.attends(i)).collect()
    }

    /// Checks that the sizes fit together.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, m));
        self.check_layout(path)?;
        for (name, v) in [
            ("hidden_size", self.d_model),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("intermediate_size", self.intermediate),
            ("num_experts", self.n_experts),
        ] {
            if v == 0 || v > 1 << 24 {
                return bad(format!("`{name}` is {v}; it must be between 1 and 2^24"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.n_experts > 1 && (self.top_k == 0 || self.top_k > self.n_experts) {
            return bad(format!(
                "num_experts_per_tok is {}; it must be 1..=num_experts ({})",
                self.top_k, self.n_experts
            ));
        }
        if self.norm_eps.is_nan() || self.norm_eps <= 0.0 {
            return bad("rms_norm_eps must be positive".into());
        }
        if self.mamba.d_model != self.d_model || self.mamba.vocab_size != self.vocab_size {
            return bad("the Mamba settings' width and vocabulary must be the model's".into());
        }
        if self.mamba.n_layer != self.mamba_layers().len() {
            return bad(format!(
                "the Mamba settings count {} layers; the layout has {}",
                self.mamba.n_layer,
                self.mamba_layers().len()
            ));
        }
        self.mamba.validate(path).map_err(|e| match e {
            Error::Config { path, message } => Error::Config {
                path,
                message: format!(
                    "{message} (in a Jamba config.json: `mamba_d_state`, `mamba_d_conv`, `mamba_expand`, \
                     `mamba_dt_rank`, `rms_norm_eps`)"
                ),
            },
            other => other,
        })?;
        Ok(())
    }

    /// The shape of this model's states: the Mamba layers' as a Mamba-1 model's, plus the
    /// attention layers' keys and values.
    pub fn state_shape(&self) -> StateShape {
        StateShape {
            attention: Some(AttentionShape {
                layers: self.attention_layers(),
                ssm: self.mamba_layers(),
                n_layers: self.n_layer,
                kv_heads: self.n_kv_heads,
                head_dim: self.head_dim,
            }),
            ..StateShape::mamba1(&self.mamba)
        }
    }

    /// Floats in a state after `tokens` tokens.
    pub fn state_floats(&self, tokens: usize) -> usize {
        self.mamba.state_floats() + self.attention_layers().len() * 2 * tokens * self.n_kv_heads * self.head_dim
    }

    /// The HF transformers spelling, for fingerprints and saved models.
    pub fn to_hf_json(&self) -> Value {
        let m = &self.mamba;
        let mut json = serde_json::json!({
            "architectures": ["JambaForCausalLM"],
            "model_type": "jamba",
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layer,
            "vocab_size": self.vocab_size,
            "intermediate_size": self.intermediate,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "attn_layer_period": self.attn_period,
            "attn_layer_offset": self.attn_offset,
            "expert_layer_period": self.expert_period,
            "expert_layer_offset": self.expert_offset,
            "num_experts": self.n_experts,
            "num_experts_per_tok": self.top_k,
            "mamba_d_state": m.d_state,
            "mamba_d_conv": m.d_conv,
            "mamba_expand": m.expand,
            "mamba_dt_rank": m.dt_rank,
            "mamba_conv_bias": m.use_conv_bias,
            "mamba_proj_bias": m.use_bias,
            "rms_norm_eps": self.norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_embeddings,
        });
        if self.head_dim * self.n_heads != self.d_model {
            json["head_dim"] = self.head_dim.into();
        }
        json
    }

    /// One line for `picaso info`.
    pub fn describe(&self) -> String {
        let experts = match self.n_experts {
            1 => "a SwiGLU MLP after every mixer".to_string(),
            e => format!(
                "{e} experts (top {}) on every {} layers from layer {}, a SwiGLU MLP on the rest",
                self.top_k, self.expert_period, self.expert_offset
            ),
        };
        format!(
            "jamba: d_model {}, {} layers ({} Mamba-1: d_inner {}, d_state {}, dt_rank {}; {} attention at {:?}: {} heads, {} kv, head_dim {}, NoPE), {} (inner {}), vocab {}",
            self.d_model,
            self.n_layer,
            self.mamba.n_layer,
            self.mamba.d_inner(),
            self.mamba.d_state,
            self.mamba.dt_rank,
            self.attention_layers().len(),
            self.attention_layers(),
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            experts,
            self.intermediate,
            self.vocab_size
        )
    }

    /// A small config for tests: Mamba, attention, Mamba, Mamba, attention; experts (4, top 2)
    /// on layers 1 and 3.
    pub fn tiny(vocab_size: usize) -> Self {
        Self {
            d_model: 32,
            vocab_size,
            n_layer: 5,
            attn_period: 3,
            attn_offset: 1,
            expert_period: 2,
            expert_offset: 1,
            n_experts: 4,
            top_k: 2,
            intermediate: 24,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            mamba: Mamba1Config { dt_rank: 2, norm_eps: 1e-6, tie_embeddings: false, ..Mamba1Config::tiny(0, 4) },
            norm_eps: 1e-6,
            tie_embeddings: false,
        }
        .with_layout()
    }
}
