//! Writing a results folder's files.

use std::path::Path;

use super::run::RunInfo;
use crate::{Error, Result};

pub(crate) fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

pub(crate) fn json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    write(path, &serde_json::to_string_pretty(value).expect("results serialise"))
}

/// Removes `path` if it is there: a chart of an earlier run that this run does not draw, so
/// that the folder never shows another run's results.
pub(crate) fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io { path: path.to_path_buf(), source: e }),
        _ => Ok(()),
    }
}

pub(crate) fn create(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })
}

/// Writes results.json, results.csv and results.md (the Markdown gets the run's provenance).
pub(crate) fn write_all(out: &Path, value: serde_json::Value, csv: &str, md: &str, info: &RunInfo) -> Result<()> {
    create(out)?;
    json(&out.join("results.json"), &value)?;
    write(&out.join("results.csv"), csv)?;
    write(&out.join("results.md"), &format!("{md}\n{}", info.markdown()))
}
