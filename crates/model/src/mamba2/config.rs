//! The Mamba-2 configuration: one runtime [`Mamba2Config`] read from either checkpoint spelling.
//!
//! * HF transformers (`Mamba2ForCausalLM`): `hidden_size`, `num_hidden_layers`, `state_size`,
//!   `head_dim`, `num_heads`, `n_groups`, `expand`, `conv_kernel`, `time_step_limit`, ...
//! * state-spaces (`mamba_ssm`): `d_model`, `n_layer`, `vocab_size`, `pad_vocab_size_multiple`,
//!   and the mixer's own settings under `ssm_cfg` (`d_state`, `headdim`, `ngroups`, ...), whose
//!   defaults are those of `mamba_ssm/modules/mamba2.py`.

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{check_sizes, parse_json_with_infinity, CheckpointFormat, Fields};
use crate::error::{Error, Result};

/// Everything that shapes a Mamba-2 model. Derived sizes are methods (`d_inner()`, `conv_dim()`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Mamba2Config {
    /// Width of the residual stream.
    pub d_model: usize,
    /// Number of Mamba-2 blocks.
    pub n_layer: usize,
    /// Rows of the embedding matrix (the padded vocabulary).
    pub vocab_size: usize,
    /// SSM state size N per head and group.
    pub d_state: usize,
    /// Channels per head P.
    pub headdim: usize,
    /// Number of heads H (= expand * d_model / headdim).
    pub nheads: usize,
    /// d_inner / d_model.
    pub expand: usize,
    /// Groups sharing B and C (and the gated norm's groups).
    pub n_groups: usize,
    /// Width of the causal depthwise convolution.
    pub d_conv: usize,
    /// Epsilon of the residual RMSNorms.
    pub norm_eps: f64,
    /// Epsilon of the gated RMSNorm inside the mixer.
    pub gated_norm_eps: f64,
    /// Clamp of dt after the softplus: (min, max), max may be infinite (in JSON: "inf").
    #[serde(with = "limits_json")]
    pub time_step_limit: (f64, f64),
    /// Whether the LM head is the embedding matrix.
    pub tie_embeddings: bool,
    /// Whether in_proj / out_proj carry biases.
    pub use_bias: bool,
    /// Whether the convolution carries a bias.
    pub use_conv_bias: bool,
    /// How the mixer's output is gated and normed.
    #[serde(default)]
    pub gate_norm: GateNorm,
    /// The layout the weights were read from.
    pub format: CheckpointFormat,
}

/// How a Mamba-2 mixer gates its scan output `y` by `silu(z)` and where its grouped RMSNorm
/// (weight `w`) sits. Only the CPU engine runs other than [`GateNorm::NormGated`]; the models
/// that need them (Falcon-H1) are refused elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateNorm {
    /// `rmsnorm(y · silu(z)) · w`: Mamba-2's, Granite 4.0 H's, Bamba's, Nemotron-H's.
    #[default]
    NormGated,
    /// `rmsnorm(y) · w · silu(z)` (Falcon-H1 with `mamba_norm_before_gate`).
    NormThenGate,
    /// `y · silu(z)`, no norm and no weight (Falcon-H1 without `mamba_rms_norm`).
    GateOnly,
}

impl Mamba2Config {
    /// Inner width of the mixer: expand * d_model (= nheads * headdim).
    pub fn d_inner(&self) -> usize {
        self.nheads * self.headdim
    }
    /// Channels that go through the convolution: x, B and C.
    pub fn conv_dim(&self) -> usize {
        self.d_inner() + 2 * self.n_groups * self.d_state
    }
    /// Output width of in_proj: [z, xBC, dt].
    pub fn d_in_proj(&self) -> usize {
        self.d_inner() + self.conv_dim() + self.nheads
    }
    /// Floats in one context's state: SSM states, conv tails and log-decays of all layers.
    pub fn state_floats(&self) -> usize {
        self.n_layer * (self.nheads * self.headdim * self.d_state + self.conv_dim() * (self.d_conv - 1) + self.nheads)
    }

    /// Reads `config.json` in either format.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value = parse_json_with_infinity(&text).map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Error::config(path, "expected a JSON object"));
        };
        let config = if map.contains_key("d_model") {
            Self::from_state_spaces(path, &map)?
        } else if map.contains_key("hidden_size") {
            Self::from_hf(path, &map)?
        } else {
            return Err(Error::config(
                path,
                "neither `hidden_size` (HF transformers format) nor `d_model` (state-spaces format) found; \
                 is this a Mamba-2 config.json?",
            ));
        };
        config.validate(path)?;
        Ok(config)
    }

    pub(crate) fn from_hf(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        if let Some(t) = map.get("model_type").and_then(Value::as_str) {
            if t != "mamba2" {
                return Err(Error::config(
                    path,
                    format!("model_type is {t:?}, not \"mamba2\" (load Mamba-1 models with ModelConfig::from_file)"),
                ));
            }
        }
        let d_model = f.usize("hidden_size")?;
        let headdim = f.usize_or("head_dim", 64)?;
        let expand = f.usize_or("expand", 2)?;
        let nheads = f.usize_or("num_heads", expand.saturating_mul(d_model) / headdim.max(1))?;
        let eps = f.f64_or("layer_norm_epsilon", 1e-5)?;
        Ok(Self {
            d_model,
            n_layer: f.usize("num_hidden_layers")?,
            vocab_size: f.usize("vocab_size")?,
            d_state: f.usize_or("state_size", 128)?,
            headdim,
            nheads,
            expand,
            n_groups: f.usize_or("n_groups", 1)?,
            d_conv: f.usize_or("conv_kernel", 4)?,
            norm_eps: eps,
            gated_norm_eps: eps,
            time_step_limit: f.limit("time_step_limit")?,
            tie_embeddings: f.bool_or("tie_word_embeddings", true)?,
            use_bias: f.bool_or("use_bias", false)?,
            use_conv_bias: f.bool_or("use_conv_bias", true)?,
            gate_norm: GateNorm::NormGated,
            format: CheckpointFormat::HfTransformers,
        })
    }

    pub(crate) fn from_state_spaces(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let empty = Map::new();
        let ssm = match map.get("ssm_cfg") {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(_) => return Err(Error::config(path, "`ssm_cfg` must be an object")),
        };
        let layer = ssm.get("layer").and_then(Value::as_str).unwrap_or("Mamba1");
        if layer != "Mamba2" {
            return Err(Error::config(
                path,
                format!("ssm_cfg.layer is {layer:?}, not \"Mamba2\" (load Mamba-1 models with ModelConfig::from_file)"),
            ));
        }
        if f.usize_or("d_intermediate", 0)? != 0 {
            return Err(Error::config(path, "d_intermediate > 0 (MLP layers) is not supported"));
        }
        if map.get("attn_layer_idx").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
            return Err(Error::config(path, "attention layers (attn_layer_idx) are not supported"));
        }
        let s = Fields { path, map: ssm };
        let d_model = f.usize("d_model")?;
        let expand = s.usize_or("expand", 2)?;
        let headdim = s.usize_or("headdim", 64)?;
        let raw_vocab = f.usize("vocab_size")?;
        let multiple = f.usize_or("pad_vocab_size_multiple", 8)?.max(1);
        if s.bool_or("D_has_hdim", false)? {
            return Err(Error::config(path, "ssm_cfg.D_has_hdim = true is not supported"));
        }
        if s.bool_or("norm_before_gate", false)? {
            return Err(Error::config(path, "ssm_cfg.norm_before_gate = true is not supported"));
        }
        if !s.bool_or("rmsnorm", true)? || !f.bool_or("rms_norm", true)? {
            return Err(Error::config(path, "only RMSNorm models (rms_norm = true) are supported"));
        }
        let d_ssm = match ssm.get("d_ssm") {
            None | Some(Value::Null) => expand.saturating_mul(d_model),
            Some(_) => s.usize("d_ssm")?,
        };
        if d_ssm != expand.saturating_mul(d_model) {
            return Err(Error::config(path, "ssm_cfg.d_ssm different from expand * d_model is not supported"));
        }
        Ok(Self {
            d_model,
            n_layer: f.usize("n_layer")?,
            vocab_size: raw_vocab.div_ceil(multiple).saturating_mul(multiple),
            d_state: s.usize_or("d_state", 128)?,
            headdim,
            nheads: expand.saturating_mul(d_model) / headdim.max(1),
            expand,
            n_groups: s.usize_or("ngroups", 1)?,
            d_conv: s.usize_or("d_conv", 4)?,
            norm_eps: f.f64_or("norm_epsilon", 1e-5)?,
            gated_norm_eps: 1e-5,
            time_step_limit: Fields { path, map: ssm }.limit("dt_limit")?,
            tie_embeddings: f.bool_or("tie_embeddings", true)?,
            use_bias: s.bool_or("bias", false)?,
            use_conv_bias: s.bool_or("conv_bias", true)?,
            gate_norm: GateNorm::NormGated,
            format: CheckpointFormat::StateSpaces,
        })
    }

    /// Checks the sizes fit together; called by every constructor.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.validate_with(path, true)
    }

    /// [`Mamba2Config::validate`], with `expand` held to `nheads · headdim / d_model` only when
    /// `expand_sets_width` (Nemotron-H's mixers take their width from the heads alone, and its
    /// configs keep an `expand` that no longer matches them).
    pub fn validate_with(&self, path: &Path, expand_sets_width: bool) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, m));
        let (d, l) = (self.d_model as u128, self.n_layer as u128);
        let inner = self.nheads as u128 * self.headdim as u128;
        let conv = inner + 2 * self.n_groups as u128 * self.d_state as u128;
        check_sizes(
            path,
            &[
                ("d_model", self.d_model),
                ("n_layer", self.n_layer),
                ("vocab_size", self.vocab_size),
                ("d_state", self.d_state),
                ("headdim", self.headdim),
                ("nheads", self.nheads),
                ("n_groups", self.n_groups),
                ("d_conv", self.d_conv),
                ("expand", self.expand),
            ],
            self.vocab_size as u128 * d
                + l * (d * (2 * inner + conv + self.nheads as u128) + conv * self.d_conv as u128),
            l * (inner * self.d_state as u128 + conv * self.d_conv as u128 + self.nheads as u128),
        )?;
        if expand_sets_width && self.nheads * self.headdim != self.expand * self.d_model {
            return bad(format!(
                "num_heads ({}) * head_dim ({}) must equal expand ({}) * hidden size ({})",
                self.nheads, self.headdim, self.expand, self.d_model
            ));
        }
        if !self.nheads.is_multiple_of(self.n_groups) {
            return bad(format!("num_heads ({}) must be a multiple of n_groups ({})", self.nheads, self.n_groups));
        }
        let (lo, hi) = self.time_step_limit;
        if lo.is_nan() || hi.is_nan() || lo < 0.0 || lo > hi {
            return bad(format!("time_step_limit ({lo}, {hi}) must satisfy 0 <= min <= max"));
        }
        if !(self.norm_eps > 0.0 && self.gated_norm_eps > 0.0) {
            return bad("layer_norm_epsilon must be positive".into());
        }
        Ok(())
    }

    /// The HF transformers spelling of this config (what picaso writes for models it trains).
    pub fn to_hf_json(&self) -> Value {
        let hi = if self.time_step_limit.1.is_infinite() {
            serde_json::json!({"__float__": "Infinity"})
        } else {
            serde_json::json!(self.time_step_limit.1)
        };
        serde_json::json!({
            "architectures": ["Mamba2ForCausalLM"],
            "model_type": "mamba2",
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layer,
            "vocab_size": self.vocab_size,
            "state_size": self.d_state,
            "head_dim": self.headdim,
            "num_heads": self.nheads,
            "expand": self.expand,
            "n_groups": self.n_groups,
            "conv_kernel": self.d_conv,
            "layer_norm_epsilon": self.norm_eps,
            "time_step_limit": [self.time_step_limit.0, hi],
            "tie_word_embeddings": self.tie_embeddings,
            "use_bias": self.use_bias,
            "use_conv_bias": self.use_conv_bias,
            "rms_norm": true,
            "residual_in_fp32": true,
            "norm_before_gate": false,
        })
    }
}

impl Mamba2Config {
    /// A small config for tests: `n_layer` layers, conv width `d_conv`.
    pub fn tiny(n_layer: usize, d_conv: usize) -> Self {
        Self {
            d_model: 32,
            n_layer,
            vocab_size: 61,
            d_state: 8,
            headdim: 8,
            nheads: 8,
            expand: 2,
            n_groups: 2,
            d_conv,
            norm_eps: 1e-5,
            gated_norm_eps: 1e-5,
            time_step_limit: (0.0, f64::INFINITY),
            tie_embeddings: true,
            use_bias: false,
            use_conv_bias: true,
            gate_norm: GateNorm::NormGated,
            format: CheckpointFormat::HfTransformers,
        }
    }

    /// The shape of state-spaces/mamba2-130m (for benchmarks with random weights).
    pub fn mamba2_130m() -> Self {
        Self {
            d_model: 768,
            n_layer: 24,
            vocab_size: 50288,
            d_state: 128,
            headdim: 64,
            nheads: 24,
            expand: 2,
            n_groups: 1,
            d_conv: 4,
            ..Self::tiny(24, 4)
        }
    }

    /// The shape of state-spaces/mamba2-2.7b, the paper's model (for GPU benchmarks).
    pub fn mamba2_2_7b() -> Self {
        Self { d_model: 2560, n_layer: 64, nheads: 80, ..Self::mamba2_130m() }
    }
}

/// JSON for `time_step_limit`: numbers, with infinities as the strings "inf" / "-inf" (JSON
/// has no infinity, and serde_json would write `null`).
mod limits_json {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(untagged)]
    enum Num {
        F(f64),
        S(String),
    }

    fn to(v: f64) -> Num {
        if v.is_finite() {
            Num::F(v)
        } else {
            Num::S(if v > 0.0 { "inf".into() } else { "-inf".into() })
        }
    }

    fn from(n: Num) -> Result<f64, String> {
        match n {
            Num::F(v) => Ok(v),
            Num::S(s) => match s.as_str() {
                "inf" | "Infinity" => Ok(f64::INFINITY),
                "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
                other => Err(format!("time_step_limit entry {other:?} is not a number")),
            },
        }
    }

    pub fn serialize<S: Serializer>(v: &(f64, f64), s: S) -> Result<S::Ok, S::Error> {
        (to(v.0), to(v.1)).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<(f64, f64), D::Error> {
        let (a, b) = <(Num, Num)>::deserialize(d)?;
        Ok((from(a).map_err(serde::de::Error::custom)?, from(b).map_err(serde::de::Error::custom)?))
    }
}
