//! Reading a HF `config.json`: typed fields with defaults, every error naming the file and
//! field at fault. Shared by the BERT and MPNet configs.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A parsed `config.json`.
pub(crate) struct HfConfig {
    path: PathBuf,
    json: serde_json::Value,
}

impl HfConfig {
    pub(crate) fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Config { path: path.to_path_buf(), message: format!("not JSON: {e}") })?;
        if !json.is_object() {
            return Err(Error::Config { path: path.to_path_buf(), message: "not a JSON object".into() });
        }
        Ok(Self { path: path.to_path_buf(), json })
    }

    pub(crate) fn bad(&self, message: String) -> Error {
        Error::Config { path: self.path.clone(), message }
    }

    fn field(&self, name: &str) -> Option<&serde_json::Value> {
        self.json.get(name).filter(|v| !v.is_null())
    }

    /// A non-negative integer; `default` when absent (`None`: required).
    pub(crate) fn uint(&self, name: &str, default: Option<usize>) -> Result<usize> {
        match (self.field(name), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(self.bad(format!("missing field `{name}`"))),
            (Some(v), _) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.bad(format!("field `{name}` must be a non-negative integer, got {v}"))),
        }
    }

    pub(crate) fn string(&self, name: &str, default: &str) -> Result<String> {
        match self.field(name) {
            None => Ok(default.to_string()),
            Some(v) => v
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| self.bad(format!("field `{name}` must be a string, got {v}"))),
        }
    }

    pub(crate) fn float(&self, name: &str, default: f64) -> Result<f64> {
        match self.field(name) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| self.bad(format!("field `{name}` must be a number, got {v}"))),
        }
    }

    /// Fails naming the first of `fields` that is 0.
    pub(crate) fn require_positive(&self, fields: &[(&str, usize)]) -> Result<()> {
        match fields.iter().find(|(_, v)| *v == 0) {
            Some((name, _)) => Err(self.bad(format!("field `{name}` must be positive"))),
            None => Ok(()),
        }
    }

    /// Fails unless `hidden` splits evenly into `heads`.
    pub(crate) fn require_heads(&self, hidden: usize, heads: usize) -> Result<()> {
        if !hidden.is_multiple_of(heads) {
            return Err(
                self.bad(format!("field `hidden_size` ({hidden}) is not divisible by `num_attention_heads` ({heads})"))
            );
        }
        Ok(())
    }

    pub(crate) fn require_eps(&self, eps: f64) -> Result<()> {
        if !(eps.is_finite() && eps > 0.0) {
            return Err(self.bad(format!("field `layer_norm_eps` must be a positive number, got {eps}")));
        }
        Ok(())
    }
}
