//! # picaso-server
//!
//! The HTTP API over a database of states: OpenAI-compatible completions that retrieve
//! contexts, compose their stored states and generate from the composed state (no model work
//! for the contexts), context management, retrieval, health and Prometheus metrics.
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | OpenAI completions + `contexts` (ids) or `retrieve` (k), `composition` (method); `stream` as server-sent events |
//! | `POST /v1/contexts` | add a text as a context → its id |
//! | `GET /v1/contexts/{id}`, `DELETE /v1/contexts/{id}` | read or remove a context |
//! | `POST /v1/search` | retrieval only |
//! | `GET /health`, `GET /metrics` | liveness; Prometheus text |
//!
//! Concurrency: each request's model work runs on a blocking thread with its own state (the
//! model's weights are shared read-only), at most `parallel` at a time. A streaming client that
//! disconnects stops its generation within one token.
#![deny(missing_docs)]

pub mod api;
mod app;
pub mod error;
mod metrics;
mod routes;

use std::sync::Arc;

pub use app::{App, Limits, Options};
pub use error::ApiError;
pub use routes::router;

/// Serves `app` on `listener` until Ctrl-C or SIGTERM, then finishes the requests in flight.
pub async fn serve(app: Arc<App>, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    axum::serve(listener, router(app)).with_graceful_shutdown(shutdown_signal()).await
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
