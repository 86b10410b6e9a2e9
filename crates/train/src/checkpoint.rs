//! Checkpoint folders that survive a kill or a power cut at any moment.
//!
//! A save writes `OUT/checkpoint.tmp` (its `trainer.json` last), flushes it to disk, then swaps
//! it in: `checkpoint` → `checkpoint.old`, `checkpoint.tmp` → `checkpoint`, and only then
//! deletes `checkpoint.old`. A run stopped between the two renames has no `checkpoint` but two
//! complete folders beside it; [`recover`] puts the newer one back before a run resumes.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::{io, Result};

/// The folder a run resumes from.
pub(crate) const CHECKPOINT: &str = "checkpoint";
const TMP: &str = "checkpoint.tmp";
const OLD: &str = "checkpoint.old";

/// Whether `dir` holds a whole checkpoint: its `trainer.json`, written last, is readable JSON.
fn is_complete(dir: &Path) -> bool {
    std::fs::read(dir.join("trainer.json")).is_ok_and(|b| serde_json::from_slice::<serde_json::Value>(&b).is_ok())
}

/// Flushes a file or a folder (its entries) to disk.
fn sync(path: &Path) -> Result<()> {
    File::open(path).and_then(|f| f.sync_all()).map_err(|e| io(e, path))
}

/// Deletes a checkpoint folder, `trainer.json` first, so that one deleted halfway never
/// looks complete.
fn remove(dir: &Path) -> Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    let marker = dir.join("trainer.json");
    if marker.exists() {
        std::fs::remove_file(&marker).map_err(|e| io(e, &marker))?;
    }
    std::fs::remove_dir_all(dir).map_err(|e| io(e, dir))
}

/// Makes `out/checkpoint` the newest complete checkpoint when a save was interrupted between
/// its renames: `checkpoint.tmp` if complete (it is only renamed after being flushed), else
/// `checkpoint.old`. Does nothing when `checkpoint` is complete or there is nothing to recover.
pub(crate) fn recover(out: &Path) -> Result<()> {
    let dst = out.join(CHECKPOINT);
    if is_complete(&dst) {
        return Ok(());
    }
    let Some(src) = [out.join(TMP), out.join(OLD)].into_iter().find(|d| is_complete(d)) else {
        return Ok(());
    };
    remove(&dst)?;
    std::fs::rename(&src, &dst).map_err(|e| io(e, &src))?;
    sync(out)?;
    eprintln!(
        "{}: an earlier save was interrupted; resuming from {} (renamed to {CHECKPOINT})",
        out.display(),
        src.display()
    );
    Ok(())
}

/// Writes weights (by `save_weights`: `config.json` and the tensors), optimiser state (by
/// `save_optimizer`) and `state` into
/// `out/checkpoint.tmp`, flushes them, then swaps it in for `out/checkpoint`.
pub(crate) fn write(
    out: &Path,
    save_weights: impl FnOnce(&Path) -> Result<()>,
    save_optimizer: impl FnOnce(&Path) -> Result<()>,
    state: &impl serde::Serialize,
) -> Result<()> {
    let tmp = out.join(TMP);
    remove(&tmp)?;
    std::fs::create_dir_all(&tmp).map_err(|e| io(e, &tmp))?;
    save_weights(&tmp)?;
    save_optimizer(&tmp.join("optimizer.safetensors"))?;
    for entry in std::fs::read_dir(&tmp).map_err(|e| io(e, &tmp))? {
        sync(&entry.map_err(|e| io(e, &tmp))?.path())?;
    }
    // trainer.json last: its presence marks the folder complete (see `recover`).
    let json = serde_json::to_vec_pretty(state).map_err(|e| io(e, &tmp))?;
    let path = tmp.join("trainer.json");
    File::create(&path).and_then(|mut f| f.write_all(&json).and_then(|()| f.sync_all())).map_err(|e| io(e, &path))?;
    sync(&tmp)?;

    let (dst, old) = (out.join(CHECKPOINT), out.join(OLD));
    if is_complete(&dst) {
        remove(&old)?;
        std::fs::rename(&dst, &old).map_err(|e| io(e, &dst))?;
    } else {
        remove(&dst)?;
    }
    std::fs::rename(&tmp, &dst).map_err(|e| io(e, &dst))?;
    sync(out)?;
    remove(&old)
}
