//! State objects in an S3-compatible store (AWS S3, MinIO, Garage, Ceph RGW, ...), through the
//! `object_store` crate. Configuration comes from the standard environment variables
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`,
//! `AWS_ALLOW_HTTP` for plain-HTTP endpoints, ...).
//!
//! An S3 PUT is atomic: an object becomes visible only once complete, so a killed writer
//! leaves nothing behind. Requests are bounded by a timeout and retried with exponential
//! backoff within the retry budget ([`Resilience`]); past it, calls fail with
//! [`Error::Unavailable`].

use std::sync::Arc;

use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};
use picaso_model::MappedState;
use rayon::prelude::*;

use super::{Entry, Finding, StateObjects};
use crate::error::{Error, Result};
use crate::runtime::{block_on, Resilience};

/// State objects under `s3://bucket/prefix`.
#[derive(Debug, Clone)]
pub struct S3States {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
}

impl S3States {
    /// Connects (lazily: no request is made here) to `bucket` with keys under `prefix`.
    pub fn new(bucket: &str, prefix: &str, r: Resilience) -> Result<Self> {
        // Two TLS backends are linked (the hub client uses ring, object_store aws-lc-rs), so
        // rustls cannot pick one by itself: choose once per process (an Err means one is set).
        let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
        let url = if prefix.is_empty() { format!("s3://{bucket}") } else { format!("s3://{bucket}/{prefix}") };
        let retry = RetryConfig {
            backoff: object_store::BackoffConfig { init_backoff: r.backoff, max_backoff: r.budget / 2, base: 2.0 },
            max_retries: 10,
            retry_timeout: r.budget,
        };
        let client = ClientOptions::new()
            .with_timeout(r.attempt)
            .with_connect_timeout(r.attempt.min(std::time::Duration::from_secs(3)));
        // Our timeouts first, then the AWS_* environment on top (as `from_env` reads it), so
        // settings such as AWS_ALLOW_HTTP are kept and the user can override timeouts.
        let mut builder = AmazonS3Builder::new().with_client_options(client).with_retry(retry);
        for (key, value) in std::env::vars() {
            if key.starts_with("AWS_") {
                if let Ok(k) = key.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                    builder = builder.with_config(k, value);
                }
            }
        }
        builder = builder.with_bucket_name(bucket);
        if std::env::var_os("AWS_REGION").is_none() && std::env::var_os("AWS_DEFAULT_REGION").is_none() {
            builder = builder.with_region("us-east-1");
        }
        let store = builder.build().map_err(|e| Error::Backend {
            backend: url.clone(),
            message: format!("cannot configure S3 access: {e}"),
        })?;
        Ok(Self { store: Arc::new(store), prefix: prefix.to_string(), url })
    }

    fn path(&self, key: &str) -> ObjectPath {
        if self.prefix.is_empty() {
            ObjectPath::from(key)
        } else {
            ObjectPath::from(format!("{}/{key}", self.prefix))
        }
    }

    /// The objects under `keys`, all requests in flight at once (latency, not bandwidth,
    /// dominates small objects).
    fn fetch_all(&self, keys: &[String]) -> Vec<object_store::Result<bytes::Bytes>> {
        let store = self.store.clone();
        let paths: Vec<ObjectPath> = keys.iter().map(|k| self.path(k)).collect();
        block_on(async move {
            let gets = paths.into_iter().map(|p| {
                let store = store.clone();
                async move { store.get(&p).await?.bytes().await }
            });
            futures_util::future::join_all(gets).await
        })
    }

    fn error(&self, key: &str, e: object_store::Error) -> Error {
        classify(&self.url, key, e)
    }
}

/// Maps an object-store error to the store's: missing objects (a not-found [`Error::Io`], as
/// for a folder) and refusals (4xx, credentials) are permanent; everything else (connection refused, timeouts, 5xx after retries) is
/// [`Error::Unavailable`].
fn classify(url: &str, key: &str, e: object_store::Error) -> Error {
    use object_store::Error as E;
    let backend = url.to_string();
    match e {
        // As a folder's missing file, so callers tell "missing" from "damaged" the same way.
        E::NotFound { .. } => Error::Io {
            path: format!("{url}/{key}").into(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such object"),
        },
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => Error::Backend {
            backend,
            message: format!("{e}; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy"),
        },
        // A 4xx answer (bad bucket, signature, policy) will not improve by retrying. The
        // crate does not export its retry error type, so its message is the signal.
        E::Generic { .. } if e.to_string().contains("status code: 4") => {
            Error::Backend { backend, message: e.to_string() }
        }
        other => Error::Unavailable { backend, message: chain(&other) },
    }
}

/// An error and its causes, `a: b: c` (the causes say what actually failed).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let s = c.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cause = c.source();
    }
    out
}

impl StateObjects for S3States {
    fn url(&self) -> String {
        self.url.clone()
    }

    fn put(&self, key: &str, bytes: &[u8]) -> Result<()> {
        let (store, path) = (self.store.clone(), self.path(key));
        let payload = object_store::PutPayload::from(bytes.to_vec());
        block_on(async move { store.put(&path, payload).await }).map_err(|e| self.error(key, e))?;
        Ok(())
    }

    fn put_new(&self, key: &str, bytes: &[u8]) -> Result<bool> {
        let (store, path) = (self.store.clone(), self.path(key));
        let payload = object_store::PutPayload::from(bytes.to_vec());
        let opts = object_store::PutOptions::from(object_store::PutMode::Create);
        match block_on(async move { store.put_opts(&path, payload, opts).await }) {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            // A service without conditional writes (If-None-Match): look, then write. Two
            // creations racing on such a service can both write; the last marker stays.
            Err(e)
                if e.to_string().contains("status code: 501")
                    || matches!(e, object_store::Error::NotImplemented { .. }) =>
            {
                if self.exists(key)? {
                    return Ok(false);
                }
                self.put(key, bytes)?;
                Ok(true)
            }
            Err(e) => Err(self.error(key, e)),
        }
    }

    fn exists(&self, key: &str) -> Result<bool> {
        let (store, path) = (self.store.clone(), self.path(key));
        match block_on(async move { store.head(&path).await }) {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.error(key, e)),
        }
    }

    fn exist_many(&self, keys: &[String]) -> Result<Vec<bool>> {
        let store = self.store.clone();
        let paths: Vec<ObjectPath> = keys.iter().map(|k| self.path(k)).collect();
        // All in flight at once, as in get_many: each answer is a round trip.
        let heads = block_on(async move {
            let heads = paths.into_iter().map(|p| {
                let store = store.clone();
                async move { store.head(&p).await }
            });
            futures_util::future::join_all(heads).await
        });
        heads
            .into_iter()
            .zip(keys)
            .map(|(r, k)| match r {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(self.error(k, e)),
            })
            .collect()
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let (store, path) = (self.store.clone(), self.path(key));
        match block_on(async move { store.get(&path).await?.bytes().await }) {
            Ok(bytes) => Ok(Some(bytes.to_vec())),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(key, e)),
        }
    }

    fn get_many(
        &self,
        keys: &[String],
        verify: &(dyn Fn(usize, &[u8]) -> Result<()> + Sync),
    ) -> Result<Vec<MappedState>> {
        let fetched = self.fetch_all(keys);
        let blobs: Vec<bytes::Bytes> =
            fetched.into_iter().zip(keys).map(|(r, k)| r.map_err(|e| self.error(k, e))).collect::<Result<_>>()?;
        blobs
            .into_par_iter()
            .enumerate()
            .map(|(i, b)| {
                verify(i, &b)?;
                MappedState::from_buffer(b).map_err(|e| Error::Model(e.at_state_file(std::path::Path::new(&keys[i]))))
            })
            .collect()
    }

    fn inspect_many(&self, keys: &[String], judge: &(dyn Fn(usize, &[u8]) -> Finding + Sync)) -> Result<Vec<Finding>> {
        let fetched = self.fetch_all(keys);
        let blobs: Vec<Option<bytes::Bytes>> = fetched
            .into_iter()
            .zip(keys)
            .map(|(r, k)| match r {
                Ok(b) => Ok(Some(b)),
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(self.error(k, e)),
            })
            .collect::<Result<_>>()?;
        Ok(blobs
            .into_par_iter()
            .enumerate()
            .map(|(i, b)| match b {
                Some(b) => judge(i, &b),
                None => Finding::Missing,
            })
            .collect())
    }

    fn delete(&self, key: &str) -> Result<()> {
        let (store, path) = (self.store.clone(), self.path(key));
        match block_on(async move { store.delete(&path).await }) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.error(key, e)),
        }
    }

    /// S3's DeleteObjects: a thousand keys per request, up to twenty requests in flight
    /// (object_store falls back to one DELETE per key where `AWS_DISABLE_BULK_DELETE` is set,
    /// for services without it).
    fn delete_many(&self, keys: &[String]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let store = self.store.clone();
        let paths: Vec<object_store::Result<ObjectPath>> = keys.iter().map(|k| Ok(self.path(k))).collect();
        let outcomes: Vec<object_store::Result<ObjectPath>> =
            block_on(async move { store.delete_stream(futures_util::stream::iter(paths).boxed()).collect().await });
        match outcomes.into_iter().find_map(|o| o.err().filter(|e| !matches!(e, object_store::Error::NotFound { .. })))
        {
            None => Ok(()),
            Some(e) => Err(self.error(&format!("(one of {} objects removed together)", keys.len()), e)),
        }
    }

    fn entries(&self) -> Result<Vec<Entry>> {
        let store = self.store.clone();
        let prefix = (!self.prefix.is_empty()).then(|| ObjectPath::from(self.prefix.as_str()));
        let metas = block_on(async move { store.list(prefix.as_ref()).try_collect::<Vec<_>>().await })
            .map_err(|e| self.error("(listing)", e))?;
        let strip = if self.prefix.is_empty() { String::new() } else { format!("{}/", self.prefix) };
        let mut entries: Vec<Entry> = metas
            .into_iter()
            .filter_map(|m| {
                let key = m.location.to_string().strip_prefix(&strip)?.to_string();
                key.ends_with(".safetensors").then_some(Entry { key, bytes: m.size })
            })
            .collect();
        entries.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(entries)
    }
}
