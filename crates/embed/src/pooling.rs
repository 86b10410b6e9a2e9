//! Pooling token states into one sentence vector, as sentence-transformers' `Pooling` module
//! does, configured by its `1_Pooling/config.json`: the CLS token, the mean (or the mean scaled
//! by √length), the element-wise max, the position-weighted mean or the last token, over the
//! real (unpadded) tokens. Several modes concatenate, in sentence-transformers' order.

use std::path::Path;

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

/// One way of pooling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingMode {
    /// The first token's state (`[CLS]` / `<s>`).
    Cls,
    /// The element-wise maximum over the real tokens.
    Max,
    /// The mean over the real tokens (all-MiniLM-L6-v2, all-mpnet-base-v2).
    Mean,
    /// The sum over the real tokens divided by √(their number).
    MeanSqrtLen,
    /// The mean weighted by position (1, 2, … from the first token).
    WeightedMean,
    /// The last real token's state.
    LastToken,
}

/// The legacy boolean keys of `1_Pooling/config.json`, in the order sentence-transformers
/// concatenates their outputs.
const LEGACY_KEYS: [(&str, PoolingMode); 6] = [
    ("pooling_mode_cls_token", PoolingMode::Cls),
    ("pooling_mode_max_tokens", PoolingMode::Max),
    ("pooling_mode_mean_tokens", PoolingMode::Mean),
    ("pooling_mode_mean_sqrt_len_tokens", PoolingMode::MeanSqrtLen),
    ("pooling_mode_weightedmean_tokens", PoolingMode::WeightedMean),
    ("pooling_mode_lasttoken", PoolingMode::LastToken),
];

impl PoolingMode {
    /// sentence-transformers' name of the mode.
    pub fn name(self) -> &'static str {
        match self {
            Self::Cls => "cls",
            Self::Max => "max",
            Self::Mean => "mean",
            Self::MeanSqrtLen => "mean_sqrt_len_tokens",
            Self::WeightedMean => "weightedmean",
            Self::LastToken => "lasttoken",
        }
    }
}

impl std::str::FromStr for PoolingMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        LEGACY_KEYS.iter().map(|(_, m)| *m).find(|m| m.name() == s).ok_or_else(|| {
            format!(
                "unknown pooling mode {s:?}; supported: cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken"
            )
        })
    }
}

/// The pooling of a sentence-transformers model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pooling {
    modes: Vec<PoolingMode>,
}

impl Default for Pooling {
    /// Mean pooling, what a BERT folder without `1_Pooling` (all-MiniLM-L6-v2's layout) means.
    fn default() -> Self {
        Self { modes: vec![PoolingMode::Mean] }
    }
}

impl Pooling {
    /// Pooling by `modes`, concatenated in this order (at least one).
    pub fn new(modes: Vec<PoolingMode>) -> Result<Self> {
        if modes.is_empty() {
            return Err(Error::Input("pooling needs at least one mode".into()));
        }
        Ok(Self { modes })
    }

    /// Reads a `1_Pooling/config.json`: either the current `pooling_mode` (a name or a list of
    /// names) or the legacy `pooling_mode_*` booleans. Errors name the file and the key.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let bad = |message: String| Error::Config { path: path.to_path_buf(), message };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let obj = json.as_object().ok_or_else(|| bad("not a JSON object".into()))?;
        let modes = match obj.get("pooling_mode") {
            Some(serde_json::Value::String(s)) => {
                vec![s.parse().map_err(|e: String| bad(format!("`pooling_mode`: {e}")))?]
            }
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .map(|v| {
                    v.as_str()
                        .ok_or_else(|| bad(format!("`pooling_mode` lists {v}, not a mode name")))?
                        .parse()
                        .map_err(|e: String| bad(format!("`pooling_mode`: {e}")))
                })
                .collect::<Result<Vec<_>>>()?,
            Some(other) => return Err(bad(format!("`pooling_mode` must be a name or a list of names, got {other}"))),
            None => {
                for key in obj.keys().filter(|k| k.starts_with("pooling_mode_")) {
                    if !LEGACY_KEYS.iter().any(|(k, _)| k == key) {
                        return Err(bad(format!(
                            "unknown pooling mode key `{key}`; supported: {}",
                            LEGACY_KEYS.map(|(k, _)| k).join(", ")
                        )));
                    }
                }
                let mut modes = Vec::new();
                for (key, mode) in LEGACY_KEYS {
                    match obj.get(key) {
                        None | Some(serde_json::Value::Bool(false)) => {}
                        Some(serde_json::Value::Bool(true)) => modes.push(mode),
                        Some(v) => return Err(bad(format!("`{key}` must be true or false, got {v}"))),
                    }
                }
                modes
            }
        };
        if modes.is_empty() {
            return Err(bad("no pooling mode is set (e.g. \"pooling_mode_mean_tokens\": true)".into()));
        }
        Ok(Self { modes })
    }

    /// The modes, in output order.
    pub fn modes(&self) -> &[PoolingMode] {
        &self.modes
    }

    /// Width of a pooled vector for token states of width `hidden`.
    pub fn dim(&self, hidden: usize) -> usize {
        hidden * self.modes.len()
    }

    /// A short description (`mean`, `cls+max`): recorded in the embedder's fingerprint.
    pub fn describe(&self) -> String {
        self.modes.iter().map(|m| m.name()).collect::<Vec<_>>().join("+")
    }

    /// Pools a (batch, seq, hidden) tensor whose row `b` has `lens[b]` real tokens (at least
    /// one), in f64 then rounded to f32.
    pub fn pool(&self, hidden: &Tensor, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
        let (_, s, h) = hidden.dims3()?;
        let data = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = Vec::with_capacity(lens.len());
        for (row, &len) in data.chunks_exact(s * h).zip(lens) {
            let tokens: Vec<&[f32]> = row.chunks_exact(h).take(len.clamp(1, s)).collect();
            let mut v = Vec::with_capacity(self.dim(h));
            for mode in &self.modes {
                v.extend(pool_one(*mode, &tokens, h));
            }
            out.push(v);
        }
        Ok(out)
    }
}

fn pool_one(mode: PoolingMode, tokens: &[&[f32]], h: usize) -> Vec<f32> {
    let weighted = |weight: &dyn Fn(usize) -> f64| -> Vec<f64> {
        let mut acc = vec![0f64; h];
        for (i, tok) in tokens.iter().enumerate() {
            let w = weight(i);
            for (a, &v) in acc.iter_mut().zip(*tok) {
                *a += w * v as f64;
            }
        }
        acc
    };
    let n = tokens.len() as f64;
    let scaled = |acc: Vec<f64>, denom: f64| acc.into_iter().map(|a| (a / denom.max(1e-9)) as f32).collect();
    match mode {
        PoolingMode::Cls => tokens[0].to_vec(),
        PoolingMode::LastToken => tokens[tokens.len() - 1].to_vec(),
        PoolingMode::Max => (0..h).map(|j| tokens.iter().map(|t| t[j]).fold(f32::NEG_INFINITY, f32::max)).collect(),
        PoolingMode::Mean => scaled(weighted(&|_| 1.0), n),
        PoolingMode::MeanSqrtLen => scaled(weighted(&|_| 1.0), n.sqrt()),
        PoolingMode::WeightedMean => scaled(weighted(&|i| (i + 1) as f64), n * (n + 1.0) / 2.0),
    }
}
