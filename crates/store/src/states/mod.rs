//! Where state files live: a folder or an S3-compatible object store, behind one interface.
//!
//! Objects are content-addressed (`ab/<xxh3-128>.safetensors`) and immutable: a key always
//! names the same bytes, so a write that finds its key present can skip, any cache of them is
//! never stale, and every reader verifies the bytes against the checksum in the key.

mod local;
mod s3;

pub use local::LocalStates;
pub use s3::S3States;

use picaso_model::MappedState;

use crate::error::Result;
use crate::location::StatesUrl;
use crate::runtime::Resilience;

/// xxh3-128 of bytes, as 32 hex digits: the name and checksum of a state file.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// Whether `s` is what [`checksum`] makes: 32 lowercase hex digits.
pub(crate) fn is_checksum(s: &str) -> bool {
    s.len() == 32 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The object key of a state with this checksum.
pub fn key_of(checksum: &str) -> String {
    format!("{}/{checksum}.safetensors", &checksum[..2])
}

/// The checksum a state key names (`ab/<checksum>.safetensors`), `None` for names picaso does
/// not give.
pub fn checksum_of(key: &str) -> Option<&str> {
    key.split_once('/').and_then(|(_, f)| f.strip_suffix(".safetensors")).filter(|s| is_checksum(s))
}

/// What reading one state object found (see [`StateObjects::inspect_many`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Finding {
    /// Present, and its bytes passed the check.
    Sound,
    /// No object under the key.
    Missing,
    /// Present but unreadable, or failing the check: why.
    Damaged(String),
}

/// One stored object, as a listing gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Its key.
    pub key: String,
    /// Its size.
    pub bytes: u64,
}

/// A backend holding state files.
pub trait StateObjects: Send + Sync + std::fmt::Debug {
    /// Where the objects are (no credentials).
    fn url(&self) -> String;
    /// Stores `bytes` under `key` so that readers see the object only once it is complete.
    /// Storing the same key twice is harmless (keys name their content); an object found under
    /// the key with other bytes (damaged) is replaced.
    fn put(&self, key: &str, bytes: &[u8]) -> Result<()>;
    /// Stores `bytes` under `key` unless an object is there already, atomically (two writers
    /// racing: one wins): whether this call stored them. For small objects such as the owner
    /// marker.
    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<bool>;
    /// Whether `key` is stored.
    fn exists(&self, key: &str) -> Result<bool>;
    /// [`StateObjects::exists`] of each key (backends ask concurrently).
    fn exist_many(&self, keys: &[String]) -> Result<Vec<bool>> {
        keys.iter().map(|k| self.exists(k)).collect()
    }
    /// The bytes stored under `key`, `None` if there are none (for small objects other than
    /// states, such as the owner marker).
    fn read(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// The objects under `keys`, parsed (the caller verifies checksums first through
    /// `verify`). Backends fetch them concurrently.
    fn get_many(
        &self,
        keys: &[String],
        verify: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<Vec<MappedState>>;
    /// Reads each of `keys` and hands its bytes to `judge` (fetched concurrently, judged in
    /// parallel, then dropped): for checking a whole store. A key with no object is
    /// [`Finding::Missing`]. Fails only when the backend cannot answer at all.
    fn inspect_many(&self, keys: &[String], judge: &(dyn Fn(usize, &[u8]) -> Finding + Sync)) -> Result<Vec<Finding>>;
    /// Removes `key` (absent keys are fine).
    fn delete(&self, key: &str) -> Result<()>;
    /// Removes each of `keys` (absent keys are fine): every key is tried, and the first error
    /// is returned. Object stores remove many per request.
    fn delete_many(&self, keys: &[String]) -> Result<()> {
        let mut first = Ok(());
        for key in keys {
            let outcome = self.delete(key);
            if first.is_ok() {
                first = outcome;
            }
        }
        first
    }
    /// Every state object stored, with its size, in key order (temporary files and other
    /// objects, such as the owner marker, left out).
    fn entries(&self) -> Result<Vec<Entry>>;
    /// The keys of [`StateObjects::entries`] (for `picaso migrate --verify` and tests).
    fn keys(&self) -> Result<Vec<String>> {
        Ok(self.entries()?.into_iter().map(|e| e.key).collect())
    }
}

/// Opens the state backend at `url`. (Hot states are cached in memory by
/// [`crate::StateCache`], in front of any backend.)
pub fn open(url: &StatesUrl) -> Result<Box<dyn StateObjects>> {
    Ok(match url {
        StatesUrl::Local(dir) => Box::new(LocalStates::new(dir.clone())),
        StatesUrl::S3 { bucket, prefix } => Box::new(S3States::new(bucket, prefix, Resilience::from_env())?),
    })
}
