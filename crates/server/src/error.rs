//! API errors: every failure becomes a JSON body `{"error": {"message", "type", "code"}}` (the
//! OpenAI shape) with a 4xx status for the client's mistakes and 5xx for the server's.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What went wrong and how to fix it.
    pub message: String,
    /// Seconds after which a retry may succeed (sent as Retry-After).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with `status`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), retry_after: None }
    }
    /// 400: the request is malformed or asks for something unsupported.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    /// 404: no such resource.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    /// 409: the request collides with a concurrent change; retrying decides it.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }
    /// 413: the request is too large.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, message)
    }
    /// 503: a backend (database, object store) is down; retry later.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }
    /// 503 with a Retry-After of `seconds`: the server is at capacity.
    pub fn busy(message: impl Into<String>, seconds: u32) -> Self {
        Self { retry_after: Some(seconds), ..Self::unavailable(message) }
    }
    /// 500: the server failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }
}

impl ApiError {
    /// The message for the client. A server failure's details (file paths, backend messages)
    /// go to the server's log instead, and the client gets an id to quote.
    pub fn public_message(&self) -> String {
        if self.status == StatusCode::INTERNAL_SERVER_ERROR {
            use std::sync::atomic::{AtomicU64, Ordering};
            static NEXT: AtomicU64 = AtomicU64::new(1);
            let id = NEXT.fetch_add(1, Ordering::Relaxed);
            eprintln!("internal error #{id}: {}", self.message);
            format!("internal server error #{id}; the server's log has the details")
        } else {
            self.message.clone()
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            json!({"error": {"message": self.public_message(), "type": self.kind(), "code": self.status.as_u16()}});
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        response
    }
}

impl From<picaso_store::Error> for ApiError {
    fn from(e: picaso_store::Error) -> Self {
        use picaso_store::Error as E;
        match e {
            E::NotFound(_) => Self::not_found(e.to_string()),
            E::Input(_) => Self::bad_request(e.to_string()),
            E::Unavailable { .. } => Self::unavailable(e.to_string()),
            E::Model(m) => m.into(),
            E::Embed(picaso_embed::Error::Input(_)) => Self::bad_request(e.to_string()),
            _ => Self::internal(e.to_string()),
        }
    }
}

impl From<picaso_model::Error> for ApiError {
    fn from(e: picaso_model::Error) -> Self {
        match e {
            picaso_model::Error::Input(_) => Self::bad_request(e.to_string()),
            _ => Self::internal(e.to_string()),
        }
    }
}

impl From<picaso_embed::Error> for ApiError {
    fn from(e: picaso_embed::Error) -> Self {
        match e {
            picaso_embed::Error::Input(_) => Self::bad_request(e.to_string()),
            _ => Self::internal(e.to_string()),
        }
    }
}
