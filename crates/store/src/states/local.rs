//! State files in a folder: written to a temporary file, fsynced and renamed into place (so a
//! file is visible only when complete), read through memory maps.

use std::path::PathBuf;

use picaso_model::MappedState;
use rayon::prelude::*;

use super::{Entry, Finding, StateObjects};
use crate::error::{Error, Result};

/// A folder of state files.
#[derive(Debug, Clone)]
pub struct LocalStates {
    dir: PathBuf,
}

impl LocalStates {
    /// State files under `dir` (created on first write).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }
}

impl StateObjects for LocalStates {
    fn url(&self) -> String {
        self.dir.display().to_string()
    }

    fn put(&self, key: &str, bytes: &[u8]) -> Result<()> {
        let path = self.path(key);
        // A content-addressed hit is rare, and a file found under the key may be damaged (a
        // disk error, a hand edit): it is kept only if it holds exactly these bytes, so writing
        // the state again repairs it.
        if std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == bytes.len() as u64)
            && std::fs::read(&path).is_ok_and(|old| old == bytes)
        {
            return Ok(());
        }
        let parent = path.parent().expect("state keys have a folder");
        std::fs::create_dir_all(parent).map_err(|e| Error::Io { path: parent.to_path_buf(), source: e })?;
        Ok(picaso_model::state::write_atomic(&path, bytes)?)
    }

    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<bool> {
        use std::io::Write;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = self.path(key);
        let dir = path.parent().expect("keys name files").to_path_buf();
        let io = |source| Error::Io { path: path.clone(), source };
        std::fs::create_dir_all(&dir).map_err(io)?;
        // Written whole to a temporary file, then linked into place: a link fails where a file
        // is, so of two writers one wins, and readers never see a partial object.
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = path.file_name().expect("keys name files").to_string_lossy();
        let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
        let linked = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()?;
            std::fs::hard_link(&tmp, &path)
        })();
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => {
                if let Ok(d) = std::fs::File::open(&dir) {
                    let _ = d.sync_all(); // persist the link
                }
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            // A file system without hard links (some network and FUSE mounts): an exclusive
            // create is as exclusive, though a reader could see the object before it is whole.
            Err(e) if matches!(e.kind(), std::io::ErrorKind::Unsupported | std::io::ErrorKind::PermissionDenied) => {
                let created = std::fs::OpenOptions::new().write(true).create_new(true).open(&path);
                match created {
                    Ok(mut f) => {
                        f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io)?;
                        Ok(true)
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
                    Err(e) => Err(io(e)),
                }
            }
            Err(e) => Err(io(e)),
        }
    }

    fn exists(&self, key: &str) -> Result<bool> {
        Ok(self.path(key).is_file())
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.path(key);
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Io { path, source: e }),
        }
    }

    fn get_many(
        &self,
        keys: &[String],
        verify: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<Vec<MappedState>> {
        // Map every file and request its pages up front, so the disk works on all at once.
        let mut maps = Vec::with_capacity(keys.len());
        for key in keys {
            let path = self.path(key);
            let file = std::fs::File::open(&path).map_err(|e| Error::Io { path: path.clone(), source: e })?;
            // SAFETY: state files are written once and never modified in place (atomic rename).
            let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::Io { path: path.clone(), source: e })?;
            #[cfg(unix)]
            let _ = mmap.advise(memmap2::Advice::WillNeed); // only a hint
            maps.push((mmap, path));
        }
        maps.into_par_iter()
            .enumerate()
            .map(|(i, (mmap, path))| {
                verify(i, &mmap)?;
                MappedState::new(mmap).map_err(|e| Error::Model(e.at_state_file(&path)))
            })
            .collect()
    }

    fn inspect_many(&self, keys: &[String], judge: &(dyn Fn(usize, &[u8]) -> Finding + Sync)) -> Result<Vec<Finding>> {
        Ok(keys
            .par_iter()
            .enumerate()
            .map(|(i, key)| {
                let path = self.path(key);
                let map = std::fs::File::open(&path).and_then(|file| {
                    // SAFETY: state files are written once and never modified in place (atomic
                    // rename); the map lives only while it is judged.
                    unsafe { memmap2::Mmap::map(&file) }
                });
                match map {
                    Ok(map) => judge(i, &map),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Finding::Missing,
                    Err(e) => Finding::Damaged(format!("{} cannot be read: {e}", path.display())),
                }
            })
            .collect())
    }

    fn delete(&self, key: &str) -> Result<()> {
        match std::fs::remove_file(self.path(key)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io { path: self.path(key), source: e }),
            _ => Ok(()),
        }
    }

    fn entries(&self) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let Ok(shards) = std::fs::read_dir(&self.dir) else { return Ok(out) };
        for shard in shards.flatten() {
            let Ok(files) = std::fs::read_dir(shard.path()) else { continue };
            for f in files.flatten() {
                let name = f.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") && !name.starts_with('.') {
                    let bytes = f.metadata().map(|m| m.len()).unwrap_or(0);
                    out.push(Entry { key: format!("{}/{name}", shard.file_name().to_string_lossy()), bytes });
                }
            }
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}
