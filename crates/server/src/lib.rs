//! # picaso-server
//!
//! The HTTP API over a database of states: OpenAI-compatible completions that retrieve
//! contexts, compose their stored states and generate from the composed state (no model work
//! for the contexts), context management, retrieval, health and Prometheus metrics.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | OpenAI completions + `contexts` (ids) or `retrieve` (k), `composition` (method); `stream` as server-sent events |
//! | `POST /v1/contexts` | add a text as a context → its id (other text for a stored document segment replaces it) |
//! | `GET /v1/contexts` | list contexts, a page at a time (`?after=&limit=`) |
//! | `POST /v1/documents`, `GET /v1/documents/{id}`, `DELETE /v1/documents/{id}` | add or update a document (cut into contexts as `picaso ingest` cuts it); read or remove its contexts |
//! | `GET /v1/documents` | list documents, a page at a time (`?after=&limit=`) |
//! | `GET /v1/contexts/{id}`, `DELETE /v1/contexts/{id}` | read or remove a context |
//! | `POST /v1/search` | retrieval only |
//! | `GET /v1/models`, `GET /v1/models/{id}` | the served model, as OpenAI clients list it |
//! | `GET /health`, `GET /metrics` | liveness; Prometheus text |
//!
//! Concurrency: preparing a request (retrieval, loading and composing states) runs on a
//! blocking thread, at most `parallel` at a time. Generation is continuously batched: every
//! active generation advances by one batched decode step per token (one pass over the weights
//! for all of them), at most `max_batch` at once and `max_queue` waiting (503 with Retry-After
//! beyond). A client that disconnects, streaming or not, leaves the batch within one step.
#![deny(missing_docs)]

pub mod api;
mod app;
mod batcher;
pub mod error;
mod metrics;
mod routes;

use std::sync::Arc;

pub use app::{App, Limits, Options};
pub use batcher::{DecodeStates, DEFAULT_PREFILL_CHUNK};
pub use error::ApiError;
pub use routes::router;

/// Serves `app` on `listener` until Ctrl-C or SIGTERM, then finishes the requests in flight.
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
    let mut shutdown = std::pin::pin!(shutdown_signal());
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
            _ = &mut shutdown => break,
        }
    }
    graceful.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}
