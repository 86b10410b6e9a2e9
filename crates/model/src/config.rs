//! Model configuration: one runtime [`Mamba2Config`] read from either checkpoint spelling.
//!
//! * HF transformers (`Mamba2ForCausalLM`): `hidden_size`, `num_hidden_layers`, `state_size`,
//!   `head_dim`, `num_heads`, `n_groups`, `expand`, `conv_kernel`, `time_step_limit`, ...
//! * state-spaces (`mamba_ssm`): `d_model`, `n_layer`, `vocab_size`, `pad_vocab_size_multiple`,
//!   and the mixer's own settings under `ssm_cfg` (`d_state`, `headdim`, `ngroups`, ...), whose
//!   defaults are those of `mamba_ssm/modules/mamba2.py`.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::mamba1::Mamba1Config;
use crate::state::{Arch, StateShape};

/// Which checkpoint layout a model folder uses; decides the tensor names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointFormat {
    /// HF transformers: `backbone.embeddings.weight`.
    HfTransformers,
    /// state-spaces `mamba_ssm`: `backbone.embedding.weight`.
    StateSpaces,
}

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
    /// The layout the weights were read from.
    pub format: CheckpointFormat,
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
            format: CheckpointFormat::StateSpaces,
        })
    }

    /// Checks the sizes fit together; called by every constructor.
    pub fn validate(&self, path: &Path) -> Result<()> {
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
        if self.nheads * self.headdim != self.expand * self.d_model {
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
}

/// The config of any supported architecture, as detected from `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// Mamba-1 (`model_type: "mamba"`, or a state-spaces config whose `ssm_cfg.layer` is absent
    /// or "Mamba1").
    Mamba1(Mamba1Config),
    /// Mamba-2 (`model_type: "mamba2"`, or `ssm_cfg.layer: "Mamba2"`).
    Mamba2(Mamba2Config),
    /// A Granite 4.0 H hybrid (`model_type: "granitemoehybrid"`): attention among Mamba-2 layers.
    GraniteHybrid(crate::granite_hybrid::GraniteHybridConfig),
}

impl ModelConfig {
    /// Reads `config.json` in either format and either architecture.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value = parse_json_with_infinity(&text).map_err(|e| Error::config(path, format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(Error::config(path, "expected a JSON object"));
        };
        if map.contains_key("d_model") {
            let empty = Map::new();
            let ssm = match map.get("ssm_cfg") {
                None | Some(Value::Null) => &empty,
                Some(Value::Object(m)) => m,
                Some(_) => return Err(Error::config(path, "`ssm_cfg` must be an object")),
            };
            return match ssm.get("layer").and_then(Value::as_str).unwrap_or("Mamba1") {
                "Mamba1" => Ok(Self::Mamba1(Mamba1Config::from_state_spaces(path, &map, ssm)?)),
                "Mamba2" => {
                    let c = Mamba2Config::from_state_spaces(path, &map)?;
                    c.validate(path)?;
                    Ok(Self::Mamba2(c))
                }
                other => Err(Error::config(
                    path,
                    format!("ssm_cfg.layer is {other:?}; picaso reads \"Mamba1\" and \"Mamba2\""),
                )),
            };
        }
        if !map.contains_key("hidden_size") {
            return Err(Error::config(
                path,
                "neither `hidden_size` (HF transformers format) nor `d_model` (state-spaces format) found; \
                 is this a Mamba config.json?",
            ));
        }
        match map.get("model_type").and_then(Value::as_str) {
            Some("mamba") => Ok(Self::Mamba1(Mamba1Config::from_hf(path, &map)?)),
            Some("granitemoehybrid") => {
                Ok(Self::GraniteHybrid(crate::granite_hybrid::GraniteHybridConfig::from_hf(path, &map)?))
            }
            Some("mamba2") | None => {
                let c = Mamba2Config::from_hf(path, &map)?;
                c.validate(path)?;
                Ok(Self::Mamba2(c))
            }
            Some(other) => Err(Error::config(
                path,
                format!(
                    "model_type is {other:?}; picaso reads Mamba-1 (\"mamba\"), Mamba-2 (\"mamba2\") and Granite 4.0 H \
                     (\"granitemoehybrid\") models"
                ),
            )),
        }
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        match self {
            Self::Mamba1(_) => Arch::Mamba1,
            Self::Mamba2(_) | Self::GraniteHybrid(_) => Arch::Mamba2,
        }
    }
    /// Width of the residual stream.
    pub fn d_model(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.d_model,
            Self::Mamba2(c) => c.d_model,
            Self::GraniteHybrid(c) => c.d_model,
        }
    }
    /// Number of blocks (a hybrid's attention layers included).
    pub fn n_layer(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.n_layer,
            Self::Mamba2(c) => c.n_layer,
            Self::GraniteHybrid(c) => c.n_layer(),
        }
    }
    /// Rows of the embedding matrix (the padded vocabulary).
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.vocab_size,
            Self::Mamba2(c) => c.vocab_size,
            Self::GraniteHybrid(c) => c.vocab_size,
        }
    }
    /// Width of the causal convolution.
    pub fn d_conv(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.d_conv,
            Self::Mamba2(c) => c.d_conv,
            Self::GraniteHybrid(c) => c.mamba.d_conv,
        }
    }
    /// Floats in one context's state (a hybrid's SSM part: its keys and values grow with the
    /// context, 2 × kv_heads × head_dim floats per token and attention layer).
    pub fn state_floats(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.state_floats(),
            Self::Mamba2(c) => c.state_floats(),
            Self::GraniteHybrid(c) => c.state_floats(0),
        }
    }
    /// The shape of this model's states.
    pub fn state_shape(&self) -> StateShape {
        match self {
            Self::Mamba1(c) => StateShape::mamba1(c),
            Self::Mamba2(c) => StateShape::of(c),
            Self::GraniteHybrid(c) => c.state_shape(),
        }
    }
    /// The HF transformers spelling.
    pub fn to_hf_json(&self) -> Value {
        match self {
            Self::Mamba1(c) => c.to_hf_json(),
            Self::Mamba2(c) => c.to_hf_json(),
            Self::GraniteHybrid(c) => c.to_hf_json(),
        }
    }
    /// The checkpoint layout the weights were read from.
    pub fn format(&self) -> CheckpointFormat {
        match self {
            Self::Mamba1(c) => c.format,
            Self::Mamba2(c) => c.format,
            Self::GraniteHybrid(_) => CheckpointFormat::HfTransformers,
        }
    }
    /// The sizes, in one line.
    pub fn describe(&self) -> String {
        match self {
            Self::Mamba1(c) => format!(
                "d_model {} · layers {} · d_inner {} · d_state {} · dt_rank {} · d_conv {} · vocab {}",
                c.d_model,
                c.n_layer,
                c.d_inner(),
                c.d_state,
                c.dt_rank,
                c.d_conv,
                c.vocab_size
            ),
            Self::Mamba2(c) => format!(
                "d_model {} · layers {} · heads {} × headdim {} · d_state {} · groups {} · d_conv {} · vocab {}",
                c.d_model, c.n_layer, c.nheads, c.headdim, c.d_state, c.n_groups, c.d_conv, c.vocab_size
            ),
            Self::GraniteHybrid(c) => c.describe(),
        }
    }
    /// The Mamba-2 config, if this is one (training supports Mamba-2).
    pub fn as_mamba2(&self) -> Option<&Mamba2Config> {
        match self {
            Self::Mamba2(c) => Some(c),
            Self::Mamba1(_) | Self::GraniteHybrid(_) => None,
        }
    }
}

impl From<Mamba2Config> for ModelConfig {
    fn from(c: Mamba2Config) -> Self {
        Self::Mamba2(c)
    }
}

impl From<Mamba1Config> for ModelConfig {
    fn from(c: Mamba1Config) -> Self {
        Self::Mamba1(c)
    }
}

/// Typed access to config fields with messages that name the field.
pub(crate) struct Fields<'a> {
    pub(crate) path: &'a Path,
    pub(crate) map: &'a Map<String, Value>,
}

impl Fields<'_> {
    pub(crate) fn err(&self, key: &str, want: &str) -> Error {
        Error::config(self.path, format!("field `{key}` must be {want}, found {}", self.map[key]))
    }
    pub(crate) fn usize(&self, key: &str) -> Result<usize> {
        match self.map.get(key) {
            None => Err(Error::config(self.path, format!("missing field `{key}`"))),
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| self.err(key, "a non-negative integer")),
        }
    }
    pub(crate) fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(key),
        }
    }
    pub(crate) fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => as_float(v).ok_or_else(|| self.err(key, "a number")),
        }
    }
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.err(key, "true or false")),
        }
    }
    /// A `[min, max]` clamp; absent means no clamp.
    pub(crate) fn limit(&self, key: &str) -> Result<(f64, f64)> {
        match self.map.get(key) {
            None | Some(Value::Null) => Ok((0.0, f64::INFINITY)),
            Some(Value::Array(a)) if a.len() == 2 => match (as_float(&a[0]), as_float(&a[1])) {
                (Some(lo), Some(hi)) => Ok((lo, hi)),
                _ => Err(self.err(key, "a pair of numbers")),
            },
            Some(_) => Err(self.err(key, "a pair of numbers [min, max]")),
        }
    }
}

/// A number, or transformers' spelling of a non-finite float: `{"__float__": "Infinity"}`.
fn as_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Object(m) => match m.get("__float__").and_then(Value::as_str)? {
            "Infinity" | "inf" => Some(f64::INFINITY),
            "-Infinity" | "-inf" => Some(f64::NEG_INFINITY),
            "NaN" | "nan" => Some(f64::NAN),
            _ => None,
        },
        _ => None,
    }
}

/// Parses JSON that may contain Python's bare `Infinity`, `-Infinity` and `NaN` literals (as
/// `json.dumps` writes them) by rewriting them, outside strings, to transformers' object form.
/// Largest size of one dimension: beyond every real model, small enough that products of a few
/// dimensions cannot overflow.
const MAX_DIM: usize = 1 << 24;
/// Most values in a model's weights or in one state (4 TiB of f32).
const MAX_VALUES: u128 = 1 << 40;

/// Refuses a config with a zero size, or whose sizes could overflow arithmetic or never fit in
/// memory, before anything is allocated from them. `weights` and `state` are the value counts
/// they imply, computed in u128 from the `dims` (bounded here by [`MAX_DIM`]).
pub(crate) fn check_sizes(path: &Path, dims: &[(&str, usize)], weights: u128, state: u128) -> Result<()> {
    if let Some((name, _)) = dims.iter().find(|(_, v)| *v == 0) {
        return Err(Error::config(path, format!("{name} must be positive")));
    }
    if let Some((name, v)) = dims.iter().find(|(_, v)| *v > MAX_DIM) {
        return Err(Error::config(path, format!("{name} is {v}, over the largest supported size {MAX_DIM}")));
    }
    for (what, n) in [("weights", weights), ("state", state)] {
        if n > MAX_VALUES {
            return Err(Error::config(
                path,
                format!(
                    "these sizes make the {what} {n} values, over the supported {MAX_VALUES}; is config.json damaged?"
                ),
            ));
        }
    }
    Ok(())
}

pub(crate) fn parse_json_with_infinity(text: &str) -> serde_json::Result<Value> {
    if let Ok(v) = serde_json::from_str(text) {
        return Ok(v);
    }
    let mut out = String::with_capacity(text.len() + 32);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        let literal = ["-Infinity", "Infinity", "NaN"].into_iter().find(|l| rest.starts_with(l));
        if let Some(l) = literal {
            out.push_str(&format!("{{\"__float__\": \"{l}\"}}"));
            rest = &rest[l.len()..];
            continue;
        }
        if c == '"' {
            in_string = true;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    serde_json::from_str(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_infinity_literals_parse() {
        let v = parse_json_with_infinity(r#"{"a": [0.0, Infinity], "s": "Infinity", "b": -Infinity}"#).unwrap();
        assert_eq!(as_float(&v["a"][1]), Some(f64::INFINITY));
        assert_eq!(v["s"], "Infinity");
        assert_eq!(as_float(&v["b"]), Some(f64::NEG_INFINITY));
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
