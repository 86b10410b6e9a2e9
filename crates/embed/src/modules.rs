//! A sentence-transformers folder's `modules.json`: the pipeline after the transformer. picaso
//! runs `Transformer` → `Pooling` → optional `Normalize`; any other module (`Dense`, …) would
//! change the vectors, so it is refused by name rather than skipped.
//!
//! A folder without `modules.json` (the layout picaso first shipped for all-MiniLM-L6-v2) means
//! mean pooling then normalisation, as before.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::pooling::Pooling;

/// What happens to the transformer's token states.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    /// Folder of the transformer's files (`config.json`, weights, tokenizer): the model folder
    /// itself, or a module's subfolder in older layouts (`0_Transformer`).
    pub transformer_dir: PathBuf,
    /// How token states become one vector.
    pub pooling: Pooling,
    /// Whether the vector is L2-normalised last.
    pub normalize: bool,
}

impl Pipeline {
    /// The pipeline of the model folder `dir`.
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("modules.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let pooling_config = dir.join("1_Pooling/config.json");
                let pooling =
                    if pooling_config.is_file() { Pooling::from_file(&pooling_config)? } else { Pooling::default() };
                return Ok(Self { transformer_dir: dir.to_path_buf(), pooling, normalize: true });
            }
            Err(source) => return Err(Error::Io { path, source }),
        };
        let bad = |message: String| Error::Config { path: path.clone(), message };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let modules = json.as_array().ok_or_else(|| bad("not a list of modules".into()))?;
        let (mut transformer_dir, mut pooling, mut normalize) = (None, None, false);
        for (i, m) in modules.iter().enumerate() {
            let kind =
                m.get("type").and_then(|t| t.as_str()).ok_or_else(|| bad(format!("module {i} has no `type`")))?;
            let sub = m.get("path").and_then(|p| p.as_str()).unwrap_or("");
            // `sentence_transformers.models.Pooling`, or a newer package path to the same class.
            let short = kind.rsplit('.').next().unwrap_or(kind);
            match (short, i, transformer_dir.is_some(), pooling.is_some()) {
                ("Transformer", 0, _, _) => transformer_dir = Some(dir.join(sub)),
                ("Pooling", _, true, false) => pooling = Some(Pooling::from_file(&dir.join(sub).join("config.json"))?),
                ("Normalize", _, true, true) if !normalize && i + 1 == modules.len() => normalize = true,
                ("Transformer" | "Pooling" | "Normalize", _, _, _) => {
                    return Err(bad(format!(
                        "module {i} ({kind}) is out of place: picaso runs Transformer, then Pooling, then optionally Normalize"
                    )))
                }
                _ => {
                    return Err(bad(format!(
                        "module {i} has type {kind:?}, which picaso's embedder does not run (it runs Transformer, \
                         Pooling and Normalize); use a model without it"
                    )))
                }
            }
        }
        match (transformer_dir, pooling) {
            (Some(transformer_dir), Some(pooling)) => Ok(Self { transformer_dir, pooling, normalize }),
            (None, _) => Err(bad("no Transformer module (the first module must be one)".into())),
            (Some(_), None) => Err(bad("no Pooling module after the Transformer".into())),
        }
    }
}
