//! Model configuration: which architecture a `config.json` describes ([`ModelConfig`]), and the
//! typed field access and size checks every architecture's config reads with.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::mamba1::Mamba1Config;
use crate::mamba2::Mamba2Config;
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

/// The config of any supported architecture, as detected from `config.json`.
// A hybrid's config is a few hundred bytes more than the others, and a model holds one.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum ModelConfig {
    /// Mamba-1 (`model_type: "mamba"`, or a state-spaces config whose `ssm_cfg.layer` is absent
    /// or "Mamba1").
    Mamba1(Mamba1Config),
    /// Mamba-2 (`model_type: "mamba2"`, or `ssm_cfg.layer: "Mamba2"`).
    Mamba2(Mamba2Config),
    /// A Granite 4.0 H hybrid (`model_type: "granitemoehybrid"`), a Bamba one (`"bamba"`), a
    /// Nemotron-H one (`"nemotron_h"`): attention among Mamba-2 layers; or a Falcon-H1 one
    /// (`"falcon_h1"`): attention beside a Mamba-2 mixer in every layer.
    GraniteHybrid(crate::granite_hybrid::GraniteHybridConfig),
    /// A Jamba hybrid (`model_type: "jamba"`): attention among Mamba-1 layers.
    Jamba(crate::jamba::JambaConfig),
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
            Some("bamba") => {
                Ok(Self::GraniteHybrid(crate::granite_hybrid::GraniteHybridConfig::from_bamba(path, &map)?))
            }
            Some("nemotron_h") => {
                Ok(Self::GraniteHybrid(crate::granite_hybrid::GraniteHybridConfig::from_nemotron_h(path, &map)?))
            }
            Some("falcon_h1") => {
                Ok(Self::GraniteHybrid(crate::granite_hybrid::GraniteHybridConfig::from_falcon_h1(path, &map)?))
            }
            Some("jamba") => Ok(Self::Jamba(crate::jamba::JambaConfig::from_hf(path, &map)?)),
            // Its references disagree: transformers' PyTorch path RMS-norms the low-rank time step
            // before `dt_proj`, mamba_ssm's fused kernel (its CUDA path) the projected one.
            Some("falcon_mamba") => Err(Error::config(
                path,
                "model_type is \"falcon_mamba\": transformers' PyTorch path norms the time step before \
                 `dt_proj` and its mamba_ssm kernel path after it, two models that differ, so picaso runs neither",
            )),
            Some("mamba2") | None => {
                let c = Mamba2Config::from_hf(path, &map)?;
                c.validate(path)?;
                Ok(Self::Mamba2(c))
            }
            Some(other) => Err(Error::config(
                path,
                format!(
                    "model_type is {other:?}; picaso reads Mamba-1 (\"mamba\"), Mamba-2 (\"mamba2\"), Granite 4.0 H \
                     (\"granitemoehybrid\"), Bamba (\"bamba\"), Nemotron-H (\"nemotron_h\"), Falcon-H1 (\"falcon_h1\") and \
                     Jamba (\"jamba\") models"
                ),
            )),
        }
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        match self {
            Self::Mamba1(_) | Self::Jamba(_) => Arch::Mamba1,
            Self::Mamba2(_) | Self::GraniteHybrid(_) => Arch::Mamba2,
        }
    }
    /// Width of the residual stream.
    pub fn d_model(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.d_model,
            Self::Mamba2(c) => c.d_model,
            Self::GraniteHybrid(c) => c.d_model,
            Self::Jamba(c) => c.d_model,
        }
    }
    /// Number of blocks (a hybrid's attention layers included).
    pub fn n_layer(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.n_layer,
            Self::Mamba2(c) => c.n_layer,
            Self::GraniteHybrid(c) => c.n_layer(),
            Self::Jamba(c) => c.n_layer,
        }
    }
    /// Rows of the embedding matrix (the padded vocabulary).
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.vocab_size,
            Self::Mamba2(c) => c.vocab_size,
            Self::GraniteHybrid(c) => c.vocab_size,
            Self::Jamba(c) => c.vocab_size,
        }
    }
    /// Width of the causal convolution.
    pub fn d_conv(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.d_conv,
            Self::Mamba2(c) => c.d_conv,
            Self::GraniteHybrid(c) => c.mamba.d_conv,
            Self::Jamba(c) => c.mamba.d_conv,
        }
    }
    /// Floats in one context's state (a hybrid's SSM part: its keys and values grow with the
    /// context, 2 × kv_heads × head_dim floats per token and attention layer).
    pub fn state_floats(&self) -> usize {
        match self {
            Self::Mamba1(c) => c.state_floats(),
            Self::Mamba2(c) => c.state_floats(),
            Self::GraniteHybrid(c) => c.state_floats(0),
            Self::Jamba(c) => c.state_floats(0),
        }
    }
    /// The shape of this model's states.
    pub fn state_shape(&self) -> StateShape {
        match self {
            Self::Mamba1(c) => StateShape::mamba1(c),
            Self::Mamba2(c) => StateShape::of(c),
            Self::GraniteHybrid(c) => c.state_shape(),
            Self::Jamba(c) => c.state_shape(),
        }
    }
    /// The HF transformers spelling.
    pub fn to_hf_json(&self) -> Value {
        match self {
            Self::Mamba1(c) => c.to_hf_json(),
            Self::Mamba2(c) => c.to_hf_json(),
            Self::GraniteHybrid(c) => c.to_hf_json(),
            Self::Jamba(c) => c.to_hf_json(),
        }
    }
    /// The checkpoint layout the weights were read from.
    pub fn format(&self) -> CheckpointFormat {
        match self {
            Self::Mamba1(c) => c.format,
            Self::Mamba2(c) => c.format,
            Self::GraniteHybrid(_) | Self::Jamba(_) => CheckpointFormat::HfTransformers,
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
            Self::Jamba(c) => c.describe(),
        }
    }
    /// The Mamba-2 config, if this is one (training supports Mamba-2).
    pub fn as_mamba2(&self) -> Option<&Mamba2Config> {
        match self {
            Self::Mamba2(c) => Some(c),
            Self::Mamba1(_) | Self::GraniteHybrid(_) | Self::Jamba(_) => None,
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
        let found = self.map.get(key).map_or_else(|| "nothing".to_string(), Value::to_string);
        Error::config(self.path, format!("field `{key}` must be {want}, found {found}"))
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

    /// Falcon Mamba is refused with the reason, any other unknown family with the list of
    /// what loads.
    #[test]
    fn unknown_families_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        for (kind, says) in [("falcon_mamba", "dt_proj"), ("zamba2", "Jamba (\"jamba\")")] {
            std::fs::write(&path, format!(r#"{{"model_type": "{kind}", "hidden_size": 8}}"#)).unwrap();
            let err = ModelConfig::from_file(&path).unwrap_err().to_string();
            assert!(err.contains(kind) && err.contains(says), "{kind}: {err}");
        }
    }

    #[test]
    fn python_infinity_literals_parse() {
        let v = parse_json_with_infinity(r#"{"a": [0.0, Infinity], "s": "Infinity", "b": -Infinity}"#).unwrap();
        assert_eq!(as_float(&v["a"][1]), Some(f64::INFINITY));
        assert_eq!(v["s"], "Infinity");
        assert_eq!(as_float(&v["b"]), Some(f64::NEG_INFINITY));
    }
}
