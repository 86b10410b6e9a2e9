//! A journal of finished items, so that an experiment stopped at any point resumes where it
//! was: one JSON line per scored item after a header line that names the run's settings.
//!
//! Each line is flushed and synced before the next item starts, so a kill loses at most the
//! item in flight; a torn last line (the kill came mid-write) is dropped on reopening.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Error, Result};

/// An open journal, appending.
pub struct Journal {
    path: PathBuf,
    file: File,
}

fn io(path: &Path, source: std::io::Error) -> Error {
    Error::Io { path: path.to_path_buf(), source }
}

impl Journal {
    /// Opens the journal at `path` for a run described by `header`, with the items it already
    /// holds, or starts a new one. A journal made for other settings is refused (it cannot be
    /// resumed; deleting it starts over).
    pub fn open<T: DeserializeOwned>(path: &Path, header: &serde_json::Value) -> Result<(Self, Vec<T>)> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        let mut items = Vec::new();
        let mut good_len = 0u64;
        if path.exists() {
            let reader = BufReader::new(File::open(path).map_err(|e| io(path, e))?);
            let lines = reader.split(b'\n');
            let mut first = true;
            let total = std::fs::metadata(path).map_err(|e| io(path, e))?.len();
            for line in lines {
                let line = line.map_err(|e| io(path, e))?;
                let complete = good_len + (line.len() as u64) < total; // its newline is there
                if first && !complete {
                    break; // the header itself was torn: start over
                }
                if first {
                    let found: Option<serde_json::Value> = serde_json::from_slice(&line).ok();
                    if found.as_ref() != Some(header) {
                        return Err(Error::Input(format!(
                            "{}: a journal of a run with other settings ({}); run with the same settings to resume it, or delete it to start over",
                            path.display(),
                            found.map(|f| f.to_string()).unwrap_or_else(|| "unreadable".into())
                        )));
                    }
                    first = false;
                } else {
                    match serde_json::from_slice::<T>(&line) {
                        Ok(item) if complete => items.push(item),
                        _ => break, // torn by a kill mid-write: dropped, and overwritten below
                    }
                }
                good_len += line.len() as u64 + 1;
            }
        }
        let mut file =
            OpenOptions::new().create(true).write(true).truncate(false).open(path).map_err(|e| io(path, e))?;
        file.set_len(good_len).map_err(|e| io(path, e))?;
        file.seek(std::io::SeekFrom::End(0)).map_err(|e| io(path, e))?;
        let mut journal = Self { path: path.to_path_buf(), file };
        if good_len == 0 {
            journal.line(header)?;
        }
        Ok((journal, items))
    }

    fn line(&mut self, value: &impl Serialize) -> Result<()> {
        let mut bytes = serde_json::to_vec(value).map_err(|e| Error::Input(format!("journal entry: {e}")))?;
        bytes.push(b'\n');
        self.file.write_all(&bytes).map_err(|e| io(&self.path, e))?;
        self.file.sync_data().map_err(|e| io(&self.path, e))
    }

    /// Records one finished item.
    pub fn append(&mut self, item: &impl Serialize) -> Result<()> {
        self.line(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resumes_drops_a_torn_line_and_refuses_other_settings() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j").join("journal.jsonl");
        let header = serde_json::json!({"ks": [1, 2]});
        let (mut j, items) = Journal::open::<u32>(&path, &header).unwrap();
        assert!(items.is_empty());
        j.append(&7u32).unwrap();
        j.append(&8u32).unwrap();
        drop(j);
        // A kill mid-write leaves a partial line.
        std::fs::OpenOptions::new().append(true).open(&path).unwrap().write_all(b"12").unwrap();
        let (mut j, items) = Journal::open::<u32>(&path, &header).unwrap();
        assert_eq!(items, [7, 8]);
        j.append(&9u32).unwrap();
        drop(j);
        let (_, items) = Journal::open::<u32>(&path, &header).unwrap();
        assert_eq!(items, [7, 8, 9]);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 4, "{text}");
        let other = serde_json::json!({"ks": [1, 3]});
        let e = Journal::open::<u32>(&path, &other).err().unwrap().to_string();
        assert!(e.contains("other settings") && e.contains("delete it"), "{e}");
    }
}
