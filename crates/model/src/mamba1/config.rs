//! [`Mamba1Config`] from either checkpoint spelling.
//!
//! * HF transformers (`MambaForCausalLM`, `model_type: "mamba"`): `hidden_size`,
//!   `num_hidden_layers`, `state_size`, `conv_kernel`, `expand`, `time_step_rank`, ...
//! * state-spaces (`mamba_ssm`, `MambaLMHeadModel` with `ssm_cfg.layer` absent or "Mamba1"):
//!   `d_model`, `n_layer`, `vocab_size`, `pad_vocab_size_multiple`, and `ssm_cfg` (`d_state`,
//!   `d_conv`, `expand`, `dt_rank`, ...) with the defaults of `mamba_ssm/modules/mamba_simple.py`.

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{CheckpointFormat, Fields};
use crate::error::{Error, Result};

/// Everything that shapes a Mamba-1 model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Mamba1Config {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of Mamba blocks.
    pub n_layer: usize,
    /// Rows of the embedding matrix (the padded vocabulary).
    pub vocab_size: usize,
    /// SSM state size N per channel.
    pub d_state: usize,
    /// Width of the causal depthwise convolution.
    pub d_conv: usize,
    /// d_inner / d_model.
    pub expand: usize,
    /// Rank of the dt projection (x_proj → dt_rank → dt_proj).
    pub dt_rank: usize,
    /// Epsilon of the RMSNorms.
    pub norm_eps: f64,
    /// Whether the LM head is the embedding matrix.
    pub tie_embeddings: bool,
    /// Whether in_proj / out_proj carry biases.
    pub use_bias: bool,
    /// Whether the convolution carries a bias.
    pub use_conv_bias: bool,
    /// The layout the weights were read from.
    pub format: CheckpointFormat,
}

/// `dt_rank: "auto"` = ⌈d_model / 16⌉, as both implementations define it.
fn dt_rank(f: &Fields<'_>, key: &str, d_model: usize) -> Result<usize> {
    match f.map.get(key) {
        None | Some(Value::Null) => Ok(d_model.div_ceil(16)),
        Some(Value::String(s)) if s == "auto" => Ok(d_model.div_ceil(16)),
        Some(_) => f.usize(key),
    }
}

impl Mamba1Config {
    /// Inner width of the mixer: expand * d_model.
    pub fn d_inner(&self) -> usize {
        self.expand * self.d_model
    }
    /// Output width of x_proj: [dt (dt_rank) | B (N) | C (N)].
    pub fn x_proj_dim(&self) -> usize {
        self.dt_rank + 2 * self.d_state
    }
    /// Floats in one context's state: SSM states, conv tails and log-decays of all layers.
    pub fn state_floats(&self) -> usize {
        self.n_layer * self.d_inner() * (2 * self.d_state + self.d_conv - 1)
    }

    /// Reads an HF transformers `MambaConfig` (already parsed).
    pub fn from_hf(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let d_model = f.usize("hidden_size")?;
        let expand = f.usize_or("expand", 2)?;
        if let Some(i) = map.get("intermediate_size").and_then(Value::as_u64) {
            if i as usize != expand * d_model {
                return Err(Error::config(
                    path,
                    format!("intermediate_size ({i}) must equal expand ({expand}) * hidden_size ({d_model})"),
                ));
            }
        }
        let config = Self {
            d_model,
            n_layer: f.usize("num_hidden_layers")?,
            vocab_size: f.usize("vocab_size")?,
            d_state: f.usize_or("state_size", 16)?,
            d_conv: f.usize_or("conv_kernel", 4)?,
            expand,
            dt_rank: dt_rank(&f, "time_step_rank", d_model)?,
            norm_eps: f.f64_or("layer_norm_epsilon", 1e-5)?,
            tie_embeddings: f.bool_or("tie_word_embeddings", true)?,
            use_bias: f.bool_or("use_bias", false)?,
            use_conv_bias: f.bool_or("use_conv_bias", true)?,
            format: CheckpointFormat::HfTransformers,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Reads a state-spaces `MambaLMHeadModel` config (already parsed) whose `ssm_cfg` is
    /// `ssm`.
    pub fn from_state_spaces(path: &Path, map: &Map<String, Value>, ssm: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let s = Fields { path, map: ssm };
        if f.usize_or("d_intermediate", 0)? != 0 {
            return Err(Error::config(path, "d_intermediate > 0 (MLP layers) is not supported"));
        }
        if map.get("attn_layer_idx").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
            return Err(Error::config(path, "attention layers (attn_layer_idx) are not supported"));
        }
        if !f.bool_or("rms_norm", true)? {
            return Err(Error::config(path, "only RMSNorm models (rms_norm = true) are supported"));
        }
        let d_model = f.usize("d_model")?;
        let multiple = f.usize_or("pad_vocab_size_multiple", 8)?.max(1);
        let config = Self {
            d_model,
            n_layer: f.usize("n_layer")?,
            vocab_size: f.usize("vocab_size")?.div_ceil(multiple).saturating_mul(multiple),
            d_state: s.usize_or("d_state", 16)?,
            d_conv: s.usize_or("d_conv", 4)?,
            expand: s.usize_or("expand", 2)?,
            dt_rank: dt_rank(&s, "dt_rank", d_model)?,
            norm_eps: f.f64_or("norm_epsilon", 1e-5)?,
            tie_embeddings: f.bool_or("tie_embeddings", true)?,
            use_bias: s.bool_or("bias", false)?,
            use_conv_bias: s.bool_or("conv_bias", true)?,
            format: CheckpointFormat::StateSpaces,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Checks the sizes are usable.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let (d, l, n, r) = (self.d_model as u128, self.n_layer as u128, self.d_state as u128, self.dt_rank as u128);
        let inner = self.d_model as u128 * self.expand as u128;
        crate::config::check_sizes(
            path,
            &[
                ("d_model", self.d_model),
                ("n_layer", self.n_layer),
                ("vocab_size", self.vocab_size),
                ("d_state", self.d_state),
                ("d_conv", self.d_conv),
                ("expand", self.expand),
                ("dt_rank", self.dt_rank),
            ],
            self.vocab_size as u128 * d
                + l * (d * 3 * inner + inner * (r + 2 * n) + r * inner + inner * (n + self.d_conv as u128 + 4)),
            l * inner * (2 * n + self.d_conv as u128),
        )?;
        if self.norm_eps.is_nan() || self.norm_eps <= 0.0 {
            return Err(Error::config(path, "layer_norm_epsilon must be positive"));
        }
        Ok(())
    }

    /// The HF transformers spelling of this config.
    pub fn to_hf_json(&self) -> Value {
        serde_json::json!({
            "architectures": ["MambaForCausalLM"],
            "model_type": "mamba",
            "hidden_size": self.d_model,
            "intermediate_size": self.d_inner(),
            "num_hidden_layers": self.n_layer,
            "vocab_size": self.vocab_size,
            "state_size": self.d_state,
            "conv_kernel": self.d_conv,
            "expand": self.expand,
            "time_step_rank": self.dt_rank,
            "layer_norm_epsilon": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "use_bias": self.use_bias,
            "use_conv_bias": self.use_conv_bias,
            "residual_in_fp32": true,
        })
    }

    /// A small config for tests: `n_layer` layers, conv width `d_conv`.
    pub fn tiny(n_layer: usize, d_conv: usize) -> Self {
        Self {
            d_model: 32,
            n_layer,
            vocab_size: 61,
            d_state: 8,
            d_conv,
            expand: 2,
            dt_rank: 4,
            norm_eps: 1e-5,
            tie_embeddings: true,
            use_bias: false,
            use_conv_bias: true,
            format: CheckpointFormat::HfTransformers,
        }
    }

    /// The shape of state-spaces/mamba-130m (for benchmarks with random weights).
    pub fn mamba_130m() -> Self {
        Self { d_model: 768, n_layer: 24, vocab_size: 50280, d_state: 16, dt_rank: 48, ..Self::tiny(24, 4) }
    }
}
