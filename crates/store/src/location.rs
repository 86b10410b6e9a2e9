//! Where a store lives, as given on the command line: its catalog (metadata and vectors) and
//! its state objects.
//!
//! * catalog: a folder (SQLite in `DIR/store.sqlite`; also `sqlite://DIR`) or
//!   `postgres://user@host:port/db` (PostgreSQL with pgvector);
//! * states: a folder (`DIR`, `file://DIR`) or `s3://bucket/prefix` (any S3-compatible store,
//!   configured by the standard `AWS_*` environment variables).
//!
//! A store records where its states are when it is created, so later commands only need the
//! catalog URL. A folder store keeps its states in `DIR/states` unless told otherwise.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// The metadata half of a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatalogUrl {
    /// SQLite in this folder.
    Sqlite(PathBuf),
    /// A PostgreSQL connection string (URL or key=value form).
    Postgres(String),
}

/// The state-object half of a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatesUrl {
    /// A local (or shared-filesystem) folder.
    Local(PathBuf),
    /// An S3 bucket and key prefix (no leading or trailing `/`; may be empty).
    S3 {
        /// Bucket name.
        bucket: String,
        /// Key prefix under which state objects live.
        prefix: String,
    },
}

/// A store's location: its catalog, and its states if given explicitly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// Metadata and vectors.
    pub catalog: CatalogUrl,
    /// State objects; `None` means "as recorded in the store" (or `DIR/states` for a new folder
    /// store).
    pub states: Option<StatesUrl>,
}

impl CatalogUrl {
    /// Parses `--db`: a `postgres://` / `postgresql://` URL, `sqlite://DIR`, or a folder.
    pub fn parse(s: &str) -> Result<Self> {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(Self::Postgres(s.to_string()));
        }
        if let Some(dir) = s.strip_prefix("sqlite://") {
            return Ok(Self::Sqlite(PathBuf::from(dir)));
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(Error::Input(format!(
                "store location {s:?}: unknown scheme {scheme:?}; use a folder, sqlite://DIR or postgres://user@host/db"
            )));
        }
        if s.is_empty() {
            return Err(Error::Input("the store location is empty; give a folder or a postgres:// URL".into()));
        }
        Ok(Self::Sqlite(PathBuf::from(s)))
    }
}

impl std::fmt::Display for CatalogUrl {
    /// The URL without its password, fit for messages and logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sqlite(dir) => write!(f, "{}", dir.display()),
            Self::Postgres(url) => f.write_str(&redact(url)),
        }
    }
}

/// `scheme://user:secret@host/...` → `scheme://user@host/...`; `password=...` in key=value
/// strings and query parameters is dropped too.
pub fn redact(url: &str) -> String {
    let mut out = url.to_string();
    if let Some((scheme, rest)) = url.split_once("://") {
        let (auth_end, _) = rest.char_indices().find(|&(_, c)| c == '/' || c == '?').unwrap_or((rest.len(), ' '));
        if let Some(at) = rest[..auth_end].rfind('@') {
            let user = rest[..at].split(':').next().unwrap_or("");
            out = format!("{scheme}://{user}@{}", &rest[at + 1..]);
        }
    }
    let parts: Vec<String> =
        out.split(['&', ' ', '?']).filter(|p| p.starts_with("password=")).map(str::to_string).collect();
    for p in parts {
        out = out.replace(&p, "password=***");
    }
    out
}

impl StatesUrl {
    /// Parses `--states`: `s3://bucket[/prefix]`, `file://DIR` or a folder.
    pub fn parse(s: &str) -> Result<Self> {
        if let Some(rest) = s.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(Error::Input(format!("states location {s:?}: no bucket; use s3://bucket/prefix")));
            }
            return Ok(Self::S3 { bucket: bucket.to_string(), prefix: prefix.trim_matches('/').to_string() });
        }
        if let Some(dir) = s.strip_prefix("file://") {
            return Ok(Self::Local(PathBuf::from(dir)));
        }
        if let Some((scheme, _)) = s.split_once("://") {
            return Err(Error::Input(format!(
                "states location {s:?}: unknown scheme {scheme:?}; use a folder or s3://bucket/prefix"
            )));
        }
        if s.is_empty() {
            return Err(Error::Input("the states location is empty; give a folder or an s3:// URL".into()));
        }
        Ok(Self::Local(PathBuf::from(s)))
    }
}

impl std::fmt::Display for StatesUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Local(dir) => write!(f, "{}", dir.display()),
            Self::S3 { bucket, prefix } if prefix.is_empty() => write!(f, "s3://{bucket}"),
            Self::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
        }
    }
}

impl Location {
    /// Parses `--db` and an optional `--states`.
    pub fn parse(db: &str, states: Option<&str>) -> Result<Self> {
        Ok(Self { catalog: CatalogUrl::parse(db)?, states: states.map(StatesUrl::parse).transpose()? })
    }

    /// A folder store (SQLite and states inside the folder).
    pub fn dir(dir: impl Into<PathBuf>) -> Self {
        Self { catalog: CatalogUrl::Sqlite(dir.into()), states: None }
    }
}

impl From<&std::path::Path> for Location {
    fn from(dir: &std::path::Path) -> Self {
        Self::dir(dir)
    }
}

impl From<&PathBuf> for Location {
    fn from(dir: &PathBuf) -> Self {
        Self::dir(dir.clone())
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.states {
            None => write!(f, "{}", self.catalog),
            Some(s) => write!(f, "{} (states in {s})", self.catalog),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_kind_and_refuses_unknown_schemes() {
        assert_eq!(CatalogUrl::parse("runs/db").unwrap(), CatalogUrl::Sqlite("runs/db".into()));
        assert_eq!(CatalogUrl::parse("sqlite:///tmp/x").unwrap(), CatalogUrl::Sqlite("/tmp/x".into()));
        assert!(matches!(CatalogUrl::parse("postgresql://u@h/d").unwrap(), CatalogUrl::Postgres(_)));
        assert!(CatalogUrl::parse("mysql://h/d").unwrap_err().to_string().contains("unknown scheme"));
        assert_eq!(
            StatesUrl::parse("s3://bucket/a/b/").unwrap(),
            StatesUrl::S3 { bucket: "bucket".into(), prefix: "a/b".into() }
        );
        assert_eq!(StatesUrl::parse("s3://bucket").unwrap().to_string(), "s3://bucket");
        assert!(StatesUrl::parse("s3:///x").is_err());
        assert!(StatesUrl::parse("gs://b").unwrap_err().to_string().contains("unknown scheme"));
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(redact("postgres://me:secret@db:5432/x"), "postgres://me@db:5432/x");
        assert_eq!(redact("postgres://db/x?user=me&password=secret"), "postgres://db/x?user=me&password=***");
        assert_eq!(redact("postgres://me@db/x"), "postgres://me@db/x");
    }
}
