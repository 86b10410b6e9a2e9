//! HTTP: the routes, a JSON extractor whose failures are JSON errors, and request metrics.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{FromRequest, MatchedPath, Path, Query, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crate::api::*;
use crate::app::App;
use crate::completions::{self, Shape};
use crate::error::ApiError;

type Shared = State<Arc<App>>;

/// The API's routes over `app`.
pub fn router(app: Arc<App>) -> Router {
    let body_limit = app.limits.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/tokenizer_info", get(tokenizer_info))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/contexts", post(add_context).get(list_contexts).delete(delete_matching))
        .route("/v1/contexts/{id}", get(get_context).delete(delete_context))
        .route("/v1/documents", post(add_document).get(list_documents))
        .route("/v1/documents/{*id}", get(get_document).delete(delete_document))
        .route("/v1/search", post(search))
        .route("/v1/attribute", post(attribute))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), track))
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .with_state(app)
}

/// A JSON body; a body too large is 413, anything unparsable is 400, both as JSON errors.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<Arc<App>> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, app: &Arc<App>) -> Result<Self, ApiError> {
        check_content_type(req.headers())?;
        let limit = app.limits.max_body_bytes;
        let too_large =
            || ApiError::too_large(format!("the request body is over this server's limit of {limit} bytes"));
        // Refuse from the declared length, before reading (and waiting for) any of the body.
        let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large());
        }
        let timeout = app.limits.body_timeout;
        let bytes = tokio::time::timeout(timeout, Bytes::from_request(req, app))
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    format!("the request body did not arrive within {} s", timeout.as_secs_f64()),
                )
            })?
            .map_err(|r| {
                if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    too_large()
                } else {
                    ApiError::new(r.status(), r.body_text())
                }
            })?;
        // Every body is an object: say so, rather than what the first field made of an array.
        if let Some(&first) = bytes.iter().find(|b| !b.is_ascii_whitespace()) {
            if first != b'{' {
                return Err(ApiError::bad_request(
                    "the body must be a JSON object ({\"field\": value, ...}); one request per body",
                ));
            }
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("malformed JSON body: {e}")))
    }
}

/// Bodies are JSON: a content type that is clearly something else (a form upload, XML, HTML,
/// an image, binary) is 415. No content type, `application/json`, `*/*+json`, `text/plain` and
/// `application/x-www-form-urlencoded` (what `curl -d` sends) are read as JSON.
fn check_content_type(headers: &axum::http::HeaderMap) -> Result<(), ApiError> {
    let Some(v) = headers.get(header::CONTENT_TYPE) else { return Ok(()) };
    let media = v.to_str().unwrap_or("").split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let wrong = media.starts_with("multipart/")
        || media.ends_with("/xml")
        || media.ends_with("+xml")
        || media == "text/html"
        || media == "application/octet-stream"
        || ["image/", "audio/", "video/", "font/"].iter().any(|p| media.starts_with(p));
    if wrong {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            format!("the body is {media}; send JSON (Content-Type: application/json)"),
        ));
    }
    Ok(())
}

/// Runs model or disk work off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| ApiError::internal(format!("worker failed: {e}")))?
}

async fn completions(State(app): Shared, ApiJson(req): ApiJson<CompletionRequest>) -> Result<Response, ApiError> {
    run_completion(app, req, crate::chat::FromChat::default(), Shape::Text, Instant::now()).await
}

async fn chat_completions(State(app): Shared, ApiJson(req): ApiJson<ChatRequest>) -> Result<Response, ApiError> {
    let started = Instant::now();
    let (req, chat) =
        crate::chat::to_completion(req, app.chat.as_ref(), app.request_templates.as_ref(), app.limits.max_tokens)
            .await?;
    run_completion(app, req, chat, Shape::Chat, started).await
}

/// A completion, plain or streamed: preparing (retrieval, states, composition, prompt scoring)
/// holds a preparation slot; generating joins the batch.
async fn run_completion(
    app: Arc<App>,
    req: CompletionRequest,
    chat: crate::chat::FromChat,
    shape: Shape,
    started: Instant,
) -> Result<Response, ApiError> {
    let (method, opts, filter) = app.validate(&req)?;
    let permit = app.gate.clone().acquire_owned().await.map_err(|_| ApiError::internal("server shutting down"))?;
    let stream = req.stream;
    let answer = completions::Answer { shape, model: app.model_name.clone(), logprobs: req.logprobs };
    let planner = app.clone();
    let mut prepared = blocking(move || {
        let _permit = permit;
        completions::prepare(&planner, &req, &chat, method, &opts, filter.as_ref(), started)
    })
    .await?;
    app.finish_later(completions::take_deferred(&mut prepared));
    if !stream {
        // Dropped with the handler when the client goes away, which cancels the generations.
        return Ok(Json(completions::complete(&app, prepared, &answer).await?).into_response());
    }
    // Submitted before the stream starts, so a full queue is still a 503.
    let events = completions::submit_all(&app, &mut prepared, answer.logprobs)?;
    let (tx, rx) = tokio::sync::mpsc::channel::<String>(16);
    tokio::spawn(completions::stream(app, prepared, events, answer, tx));
    let chunks = ReceiverStream::new(rx).map(|data| Ok::<_, Infallible>(Event::default().data(data)));
    Ok(Sse::new(chunks).keep_alive(KeepAlive::default()).into_response())
}

/// `GET /tokenizer_info` (vLLM's shape): what a client needs to tokenize as the server does
/// (lm-eval's `local-completions` finds the server's tokenizer here).
async fn tokenizer_info(State(app): Shared) -> Result<Response, ApiError> {
    let tokenizer = app.model.tokenizer()?;
    let eos = tokenizer.eos().map(|id| crate::logprobs::token_text(tokenizer, id));
    Ok(Json(json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "eos_token_id": tokenizer.eos(),
        "bos_token": null,
        "pad_token": null,
        "unk_token": null,
        "vocab_size": tokenizer.vocab_size(),
        "model_max_length": app.limits.max_prompt_tokens,
        "chat_template": app.chat.as_ref().map(|t| t.source()),
    }))
    .into_response())
}

/// `POST /tokenize` (vLLM's shape): text, or chat messages rendered with the chat template.
async fn tokenize(State(app): Shared, ApiJson(req): ApiJson<TokenizeRequest>) -> Result<Response, ApiError> {
    let text = match (req.prompt, req.messages) {
        (Some(text), None) => text,
        (None, Some(messages)) => {
            let messages = crate::chat::check_messages(&messages)?;
            let template = app.chat.clone().ok_or_else(|| {
                ApiError::bad_request("this model has no chat template to render `messages` with; send `prompt` (text)")
            })?;
            let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
            blocking(move || template.render(&messages, add_generation_prompt, None)).await?
        }
        _ => return Err(ApiError::bad_request("give either `prompt` (text) or `messages` (a chat), one of them")),
    };
    let tokenized = blocking(move || {
        let tokenizer = app.model.tokenizer()?;
        let tokens = tokenizer.encode(&text)?;
        let token_strs = req
            .return_token_strs
            .then(|| tokens.iter().map(|&id| crate::logprobs::token_text(tokenizer, id)).collect());
        Ok(Tokenized { count: tokens.len(), max_model_len: app.limits.max_prompt_tokens, tokens, token_strs })
    })
    .await?;
    Ok(Json(tokenized).into_response())
}

/// `POST /detokenize` (vLLM's shape): token ids to text.
async fn detokenize(State(app): Shared, ApiJson(req): ApiJson<DetokenizeRequest>) -> Result<Response, ApiError> {
    let prompt = blocking(move || {
        app.model.check_tokens(&req.tokens)?;
        Ok(app.model.tokenizer()?.decode(&req.tokens)?)
    })
    .await?;
    Ok(Json(json!({ "prompt": prompt })).into_response())
}

async fn add_context(State(app): Shared, ApiJson(req): ApiJson<AddContext>) -> Result<Response, ApiError> {
    let permit = app.ingest.clone().acquire_owned().await.map_err(|_| ApiError::internal("server shutting down"))?;
    let added = blocking(move || {
        let _permit = permit;
        app.add_context(req)
    })
    .await?;
    let status = if added.created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(added)).into_response())
}

/// A query string as parsed, or the 400 that says what is wrong with it.
type QueryOf<T> = Result<Query<T>, axum::extract::rejection::QueryRejection>;

fn parse_query<T>(query: QueryOf<T>) -> Result<T, ApiError> {
    query.map(|Query(q)| q).map_err(|e| ApiError::bad_request(format!("bad query string: {}", e.body_text())))
}

async fn list_contexts(State(app): Shared, query: QueryOf<ContextsQuery>) -> Result<Response, ApiError> {
    let q = parse_query(query)?;
    let listed = blocking(move || app.list_contexts(q)).await?;
    Ok(Json(listed).into_response())
}

async fn delete_matching(State(app): Shared, query: QueryOf<DeleteQuery>) -> Result<Response, ApiError> {
    let q = parse_query(query)?;
    let removed = blocking(move || app.delete_matching(q)).await?;
    Ok(Json(json!({"deleted": removed})).into_response())
}

async fn add_document(State(app): Shared, ApiJson(req): ApiJson<AddDocument>) -> Result<Response, ApiError> {
    let permit = app.ingest.clone().acquire_owned().await.map_err(|_| ApiError::internal("server shutting down"))?;
    let (changed, added) = blocking(move || {
        let _permit = permit;
        app.add_document(req)
    })
    .await?;
    let status = if changed { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(added)).into_response())
}

async fn list_documents(State(app): Shared, query: QueryOf<PageQuery<String>>) -> Result<Response, ApiError> {
    let q = parse_query(query)?;
    let listed = blocking(move || app.list_documents(q)).await?;
    Ok(Json(listed).into_response())
}

/// A document id from the path (slashes included: ids such as `api/…` are paths themselves).
fn parse_doc(id: IdPath) -> Result<String, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::bad_request(format!("the document id in the path is not valid: {e}")))?;
    Ok(id)
}

async fn get_document(State(app): Shared, id: IdPath) -> Result<Response, ApiError> {
    let id = parse_doc(id)?;
    let doc = blocking(move || app.get_document(id)).await?;
    Ok(Json(doc).into_response())
}

async fn delete_document(State(app): Shared, id: IdPath) -> Result<Response, ApiError> {
    let id = parse_doc(id)?;
    let shown = id.clone();
    let removed = blocking(move || app.delete_document(&id)).await?;
    Ok(Json(json!({"id": shown, "deleted": removed})).into_response())
}

type IdPath = Result<Path<String>, axum::extract::rejection::PathRejection>;

fn parse_id(id: IdPath) -> Result<i64, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::bad_request(format!("the context id in the path is not valid: {e}")))?;
    id.parse().map_err(|_| ApiError::bad_request(format!("context id {id:?} is not an integer")))
}

async fn get_context(State(app): Shared, id: IdPath) -> Result<Response, ApiError> {
    let id = parse_id(id)?;
    let rec = blocking(move || Ok(app.store.get(id)?)).await?;
    Ok(Json(rec).into_response())
}

async fn delete_context(State(app): Shared, id: IdPath) -> Result<Response, ApiError> {
    let id = parse_id(id)?;
    blocking(move || app.delete_context(id)).await?;
    Ok(Json(json!({"id": id, "deleted": true})).into_response())
}

async fn attribute(State(app): Shared, ApiJson(req): ApiJson<AttributeRequest>) -> Result<Response, ApiError> {
    let permit = app.ingest.clone().acquire_owned().await.map_err(|_| ApiError::internal("server shutting down"))?;
    let attributed = blocking(move || {
        let _permit = permit;
        app.attribute(req)
    })
    .await?;
    Ok(Json(attributed).into_response())
}

async fn search(State(app): Shared, ApiJson(req): ApiJson<SearchRequest>) -> Result<Response, ApiError> {
    let found = blocking(move || app.search(req)).await?;
    Ok(Json(found).into_response())
}

/// The one model this server serves, as OpenAI's API describes models (clients such as the
/// official `openai` package, LangChain and LiteLLM list them before use).
fn model_object(app: &App) -> serde_json::Value {
    json!({"id": app.model_name, "object": "model", "created": app.created(), "owned_by": "picaso"})
}

async fn list_models(State(app): Shared) -> Response {
    Json(json!({"object": "list", "data": [model_object(&app)]})).into_response()
}

async fn get_model(State(app): Shared, id: IdPath) -> Result<Response, ApiError> {
    let Path(id) = id.map_err(|e| ApiError::bad_request(format!("the model id in the path is not valid: {e}")))?;
    if id != app.model_name {
        return Err(ApiError::not_found(format!("no model {id:?}; this server serves {:?}", app.model_name)));
    }
    Ok(Json(model_object(&app)).into_response())
}

/// 200 when the store's backends answer, 503 (with the reason) when one does not, so a load
/// balancer can route around a server that lost its database.
async fn health(State(app): Shared) -> Result<Response, ApiError> {
    let store = app.clone();
    let contexts = blocking(move || Ok(store.store.len()?)).await?;
    Ok(Json(json!({
        "status": "ok",
        "model": app.model_name,
        "fingerprint": app.model.fingerprint(),
        "contexts": contexts,
    }))
    .into_response())
}

async fn metrics(State(app): Shared) -> Response {
    app.metrics.cache_bytes.set(app.cache.stats().bytes as i64);
    let store = app.clone();
    if let Ok(Some(b)) = blocking(move || Ok(store.store.budget_stats()?)).await {
        let m = &app.metrics;
        m.budget_bytes.set(b.budget_bytes as i64);
        m.budget_held_bytes.set(b.held_bytes as i64);
        m.budget_hits.set(b.hits as i64);
        m.budget_misses.set(b.misses as i64);
    }
    app.metrics.resident_bytes.set(crate::memory::resident_bytes().unwrap_or(0) as i64);
    app.metrics.memory_limit_bytes.set(app.memory.map_or(0, |g| g.limit_bytes()) as i64);
    let body = app.metrics.render();
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], body).into_response()
}

async fn no_route(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!(
        "no route {method} {uri}; the API has POST /v1/completions, POST /v1/chat/completions, GET /tokenizer_info, POST /tokenize, POST /detokenize, GET|POST /v1/contexts, GET|DELETE /v1/contexts/{{id}}, GET|POST /v1/documents, GET|DELETE /v1/documents/{{id}}, POST /v1/search, POST /v1/attribute, GET /v1/models, GET /health, GET /metrics"
    ))
}

async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{method} is not allowed on {}; the API has POST /v1/completions, POST /v1/chat/completions, GET /tokenizer_info, POST /tokenize, POST /detokenize, GET|POST /v1/contexts, GET|DELETE /v1/contexts/{{id}}, GET|POST /v1/documents, GET|DELETE /v1/documents/{{id}}, POST /v1/search, POST /v1/attribute, GET /v1/models, GET /health, GET /metrics",
            uri.path()
        ),
    )
}

/// One request in flight: counted when it starts, and recorded when it ends — with its
/// status, or as 499 (client closed) when the client went away first and the handler (or, for
/// a stream, its body) was dropped.
struct Tracked {
    app: Arc<App>,
    endpoint: String,
    method: String,
    started: Instant,
    status: Option<u16>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let m = &self.app.metrics;
        m.in_flight.dec();
        let status = self.status.unwrap_or(499).to_string();
        m.requests
            .get_or_create(&vec![
                ("endpoint", self.endpoint.clone()),
                ("method", self.method.clone()),
                ("status", status),
            ])
            .inc();
        m.request_seconds
            .get_or_create(&vec![("endpoint", self.endpoint.clone())])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// A stream's body carrying its request's record, so that the request ends with the stream
/// rather than with its head: it is in flight while it streams, its latency is the stream's,
/// and a client that leaves mid-stream is a 499.
struct TrackedBody {
    body: axum::body::BodyDataStream,
    tracked: Tracked,
    /// The status recorded once the body is sent whole.
    status: u16,
}

impl tokio_stream::Stream for TrackedBody {
    type Item = Result<Bytes, axum::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let next = Pin::new(&mut self.body).poll_next(cx);
        if let Poll::Ready(None) = next {
            self.tracked.status = Some(self.status);
        }
        next
    }
}

/// Counts requests and their latency per route (a stream's until its last event).
async fn track(State(app): Shared, req: Request, next: Next) -> Response {
    let endpoint = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_default();
    app.metrics.in_flight.inc();
    let mut tracked =
        Tracked { app: app.clone(), endpoint, method: req.method().to_string(), started: Instant::now(), status: None };
    // New work (every POST) waits for memory; reads, deletes, /health and /metrics never do.
    let refused = match &app.memory {
        Some(guard) if req.method() == Method::POST => guard.check().err(),
        _ => None,
    };
    let resp = match refused {
        Some(e) => {
            app.metrics.refused_memory.inc();
            e.into_response()
        }
        None => next.run(req).await,
    };
    let streams =
        resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if streams {
        let (parts, body) = resp.into_parts();
        let status = parts.status.as_u16();
        let body = TrackedBody { body: body.into_data_stream(), tracked, status };
        return Response::from_parts(parts, axum::body::Body::from_stream(body));
    }
    tracked.status = Some(resp.status().as_u16());
    resp
}
