//! The async backends (PostgreSQL, object stores) behind the store's blocking API.
//!
//! The store is called from plain threads: the CLI, rayon workers, the server's blocking pool.
//! Its async clients run on one small runtime owned by this module; a call hands its future to
//! that runtime and waits on a channel, which works from any thread, including one that is
//! itself inside another runtime.

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("picaso-backend")
            .enable_all()
            .build()
            .expect("the backend runtime starts (threads and timers are available)")
    })
}

/// Runs `fut` on the backend runtime and waits for its output.
pub(crate) fn block_on<F>(fut: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    runtime().spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv().expect("backend tasks run to completion (they do not panic)")
}

/// How long to keep retrying a transient failure, and how long one attempt may take: a backend
/// that is down makes calls fail within about `budget`, not hang.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resilience {
    /// Longest single attempt (connect or request).
    pub attempt: Duration,
    /// Total time across retries before giving up with [`crate::Error::Unavailable`].
    pub budget: Duration,
    /// First backoff between attempts; doubled each retry.
    pub backoff: Duration,
}

impl Default for Resilience {
    fn default() -> Self {
        Self { attempt: Duration::from_secs(10), budget: Duration::from_secs(5), backoff: Duration::from_millis(100) }
    }
}

impl Resilience {
    /// Defaults, overridden by `PICASO_BACKEND_TIMEOUT_MS` (one attempt) and
    /// `PICASO_BACKEND_RETRY_MS` (the retry budget).
    pub fn from_env() -> Self {
        let ms = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis);
        let d = Self::default();
        Self {
            attempt: ms("PICASO_BACKEND_TIMEOUT_MS").unwrap_or(d.attempt),
            budget: ms("PICASO_BACKEND_RETRY_MS").unwrap_or(d.budget),
            backoff: d.backoff,
        }
    }
}
