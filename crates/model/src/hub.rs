//! Download a model folder from the Hugging Face hub by repo id (`state-spaces/mamba2-130m`).
//! Needs network access and the `hub` feature; offline, pass a local folder instead. Files go
//! to the standard hub cache (`$HF_HOME/hub`, default `~/.cache/huggingface/hub`), and
//! `$HF_ENDPOINT` selects a mirror, as with the Python tools.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Files a model folder may need; the optional ones are skipped when absent.
const REQUIRED: &[&str] = &["config.json"];
const WEIGHTS: &[&str] = &["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"];
const OPTIONAL: &[&str] = &["tokenizer.json"];

/// Downloads (or finds in the local hub cache) `repo_id` and returns the folder.
#[cfg(feature = "hub")]
pub fn download(repo_id: &str) -> Result<PathBuf> {
    let repo = repo(repo_id)?;
    let here = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| "?".into());
    let fail = |f: &str, e: hf_hub::api::sync::ApiError| {
        Error::Input(format!(
            "{repo_id} is no folder here ({here}), and downloading its {f} from the Hugging Face hub failed: {e} \
             (a folder: check the path; a hub id: check the name and that this machine is online)"
        ))
    };
    let mut dir = None;
    for f in REQUIRED {
        let p = repo.get(f).map_err(|e| fail(f, e))?;
        dir = p.parent().map(PathBuf::from);
    }
    let mut have_weights = false;
    for f in WEIGHTS {
        if let Ok(p) = repo.get(f) {
            have_weights = true;
            if *f == "model.safetensors.index.json" {
                let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
                let v: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| Error::weights(&p, e.to_string()))?;
                let mut shards: Vec<String> = v["weight_map"]
                    .as_object()
                    .map(|m| m.values().filter_map(|s| s.as_str().map(String::from)).collect())
                    .unwrap_or_default();
                shards.sort();
                shards.dedup();
                for s in shards {
                    repo.get(&s).map_err(|e| fail(&s, e))?;
                }
            }
            break;
        }
    }
    if !have_weights {
        return Err(Error::Input(format!("{repo_id}: no weights on the hub (looked for {WEIGHTS:?})")));
    }
    for f in OPTIONAL {
        let _ = repo.get(f);
    }
    dir.ok_or_else(|| Error::Input(format!("{repo_id}: no local folder")))
}

#[cfg(feature = "hub")]
fn repo(repo_id: &str) -> Result<hf_hub::api::sync::ApiRepo> {
    let api = hf_hub::api::sync::ApiBuilder::from_env().build().map_err(|e| Error::Input(format!("hub: {e}")))?;
    Ok(api.model(repo_id.to_string()))
}

/// Downloads (or finds in the hub cache) `required` files of `repo_id`, and `optional` ones
/// where the repo has them; returns the folder that holds them.
#[cfg(feature = "hub")]
pub fn download_files(repo_id: &str, required: &[&str], optional: &[&str]) -> Result<PathBuf> {
    let repo = repo(repo_id)?;
    let mut dir = None;
    for f in required {
        let p = repo
            .get(f)
            .map_err(|e| Error::Input(format!("downloading {f} of {repo_id} from the Hugging Face hub failed: {e}")))?;
        dir = p.parent().map(PathBuf::from);
    }
    for f in optional {
        let _ = repo.get(f);
    }
    dir.ok_or_else(|| Error::Input(format!("{repo_id}: no files asked for")))
}

/// Without the `hub` feature the download is unavailable.
#[cfg(not(feature = "hub"))]
pub fn download_files(repo_id: &str, _required: &[&str], _optional: &[&str]) -> Result<PathBuf> {
    Err(Error::Input(format!("{repo_id}: this build has no hub support (build with feature `hub`)")))
}

/// Without the `hub` feature the download is unavailable.
#[cfg(not(feature = "hub"))]
pub fn download(repo_id: &str) -> Result<PathBuf> {
    let _ = (REQUIRED, WEIGHTS, OPTIONAL);
    let here = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| "?".into());
    Err(Error::Input(format!(
        "{repo_id} is no folder here ({here}), and this build has no hub support to download it as a hub id \
         (build with feature `hub`)"
    )))
}
