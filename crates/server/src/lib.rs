//! # picaso-server
//!
//! The HTTP API over a database of states: OpenAI-compatible completions that retrieve
//! contexts, compose their stored states and generate from the composed state (no model work
//! for the contexts), context management, retrieval, health and Prometheus metrics.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | OpenAI's legacy completions (one or several prompts, text or token ids; `logprobs`, `echo`, `max_tokens: 0` to score a prompt) + `contexts` (ids) or `retrieve` (k), `composition` (method); `stream` as server-sent events |
//! | `POST /v1/chat/completions` | OpenAI chat completions: the messages rendered by the model's chat template (`tokenizer_config.json`, or `--chat-template`); the same picaso fields |
//! | `GET /tokenizer_info`, `POST /tokenize`, `POST /detokenize` | the server's tokenizer, in vLLM's shapes (evaluation harnesses tokenize with it) |
//! | `POST /v1/contexts` | add a text as a context → its id (other text for a stored document segment replaces it) |
//! | `GET /v1/contexts` | list contexts, a page at a time (`?after=&limit=`) |
//! | `POST /v1/documents`, `GET /v1/documents/{id}`, `DELETE /v1/documents/{id}` | add or update a document (cut into contexts as `picaso ingest` cuts it); read or remove its contexts |
//! | `GET /v1/documents` | list documents, a page at a time (`?after=&limit=`) |
//! | `GET /v1/contexts/{id}`, `DELETE /v1/contexts/{id}` | read or remove a context |
//! | `POST /v1/search` | retrieval only |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the served model, as OpenAI clients list it |
//! | `GET /health`, `GET /metrics` | liveness; Prometheus text |
//!
//! Concurrency: preparing a completion (retrieval, loading and composing states) runs on a
//! blocking thread, at most `parallel` at a time; uploads and attributions, at most
//! `parallel_ingest` at a time, have their own slots, so completions never wait behind them.
//! Generation is continuously batched: every active generation advances by one batched decode
//! step per token (one pass over the weights for all of them), at most `max_batch` at once and
//! `max_queue` waiting (503 with Retry-After beyond). A client that disconnects, streaming or
//! not, leaves the batch or its queue within one step.
//!
//! Budgets: every chat template renders within [`render::Budget`] (instructions and bytes),
//! off the async threads; a template sent with a request is refused unless the server has a
//! [`render::Sandbox`], where it renders in a child process under memory, CPU and time limits.
//! Above its memory limit ([`MemoryGuard`]) the server answers new work 503.
#![deny(missing_docs)]

pub mod api;
mod app;
mod batcher;
pub mod chat;
mod completions;
pub mod error;
pub mod logprobs;
mod memory;
mod metrics;
mod prefix_cache;
pub mod render;
mod routes;

use std::sync::Arc;

pub use app::{App, Limits, Options};
pub use batcher::{DecodeStates, DEFAULT_PREFILL_CHUNK};
pub use error::ApiError;
pub use memory::{resident_bytes, MemoryGuard};
pub use routes::router;

/// Serves `app` on `listener` until Ctrl-C or SIGTERM, then stops accepting connections (new
/// ones are refused) and finishes the requests in flight, for up to `limits.shutdown_timeout`;
/// those still running then are cut. A second signal during that drain ends it at once with an
/// error (a stuck drain must not make the operator kill the process).
///
/// Slow or hostile clients cannot hold the server: a connection that has not sent its headers
/// within `limits.header_timeout` is closed (a body late past `limits.body_timeout` is answered
/// 408), and beyond `limits.max_connections` open connections new ones are closed at once.
pub async fn serve(app: Arc<App>, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let limits = app.limits.clone();
    let connections = app.metrics.connections.clone();
    let service = hyper_util::service::TowerToHyperService::new(router(app));
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut signals = Signals::new()?;
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                // Errors of one accept (a reset connection, a full descriptor table) must not
                // stop the server; the latter eases as connections close.
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    drop(stream);
                    continue;
                };
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
                let conn = builder.serve_connection(TokioIo::new(stream), service.clone());
                let conn = graceful.watch(conn);
                let open = connections.clone();
                open.inc();
                tokio::spawn(async move {
                    let _ = conn.await;
                    open.dec();
                    drop(slot);
                });
            }
            () = signals.recv() => break,
        }
    }
    // Refuse new connections now, rather than accept them only to cut them after the drain.
    drop(listener);
    let timeout = limits.shutdown_timeout;
    eprintln!(
        "shutting down: finishing the requests in flight (at most {} s; a second Ctrl-C or SIGTERM stops at once)",
        timeout.as_secs_f64()
    );
    tokio::select! {
        () = graceful.shutdown() => Ok(()),
        () = tokio::time::sleep(timeout) => {
            eprintln!("shutdown: requests still running after {} s (--shutdown-timeout-s) are cut", timeout.as_secs_f64());
            Ok(())
        }
        () = signals.recv() => Err(std::io::Error::other(
            "a second shutdown signal: stopped without finishing the requests in flight",
        )),
    }
}

/// Ctrl-C and SIGTERM, listened for from the start to the end of [`serve`]: once listened for,
/// a signal no longer ends the process by itself, so one that arrives during the drain must be
/// heard here too.
struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{signal, SignalKind};
            Ok(Self { interrupt: signal(SignalKind::interrupt())?, terminate: signal(SignalKind::terminate())? })
        }
        #[cfg(not(unix))]
        Ok(Self {})
    }

    /// The next signal.
    async fn recv(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
