//! The server's shared state and its operations, free of HTTP: validating a completion request,
//! resolving its contexts into a composed state, generating, adding and finding contexts. The
//! model work runs on blocking threads; `gate` bounds how many completions prepare at once, and
//! `ingest` how many uploads and attributions run, apart, so that these (minutes for a long
//! document) never make a completion wait.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use picaso_embed::Embedder;
use picaso_model::{Composition, GenerateOptions, Method, Model, State, StopReason};
use picaso_store::{
    gather, retrieve_then, ContextRecord, Contexts, DocumentSummary, Filter, NewContext, Retrieval, Retriever,
    StateCache, Store,
};
use tokio::sync::{mpsc, Semaphore};

use crate::api::*;
use crate::batcher::{Batcher, DecodeStates, Event, Job, Refused};
use crate::error::ApiError;
use crate::logprobs::MAX_TOP_LOGPROBS;
use crate::metrics::Metrics;
use crate::prefix_cache::PrefixCache;

/// Most documents one request may limit retrieval to: each name is looked up in the catalog.
const MAX_DOCUMENTS: usize = 1000;

/// Refuses a `documents` list longer than [`MAX_DOCUMENTS`].
fn check_documents(documents: Option<&[String]>) -> Result<(), ApiError> {
    match documents {
        Some(docs) if docs.len() > MAX_DOCUMENTS => Err(ApiError::bad_request(format!(
            "{} documents named; retrieval within documents takes at most {MAX_DOCUMENTS}",
            docs.len()
        ))),
        _ => Ok(()),
    }
}

/// What the server accepts.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Most tokens in a prompt (or an added context); more is answered 413.
    pub max_prompt_tokens: usize,
    /// Most prompts in one completion request (a list of prompts); more is answered 400.
    pub max_prompts: usize,
    /// Most prompt tokens in one request, all its prompts together; more is answered 413.
    pub max_request_tokens: usize,
    /// Largest `max_tokens`; more is answered 400.
    pub max_tokens: usize,
    /// Most contexts per completion (given or retrieved).
    pub max_contexts: usize,
    /// Largest request body in bytes; more is answered 413.
    pub max_body_bytes: usize,
    /// Time a client has to send a request's headers; then the connection is closed.
    pub header_timeout: std::time::Duration,
    /// Time a client has to send a request's body; then it is answered 408.
    pub body_timeout: std::time::Duration,
    /// Most open connections; more are closed as soon as they are accepted.
    pub max_connections: usize,
    /// Time the requests in flight have to finish after a shutdown signal; then they are cut.
    pub shutdown_timeout: std::time::Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_prompt_tokens: 8192,
            max_prompts: 64,
            max_request_tokens: 65536,
            max_tokens: 2048,
            max_contexts: 64,
            max_body_bytes: 1 << 20,
            header_timeout: std::time::Duration::from_secs(10),
            body_timeout: std::time::Duration::from_secs(30),
            max_connections: 512,
            shutdown_timeout: std::time::Duration::from_secs(30),
        }
    }
}

/// How the server runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// Byte budget of the in-memory state cache.
    pub cache_bytes: usize,
    /// Byte budget of the prefix cache (the states after prompts and chat messages, so a
    /// request continues from the longest stored prefix of its prompt); 0 disables it.
    pub prefix_cache_bytes: usize,
    /// Completions preparing at the same time (retrieval, loading and composing states,
    /// concat's prefill); others wait their turn.
    pub parallel: usize,
    /// Context and document uploads and attributions running at the same time; others wait
    /// their turn. Apart from `parallel`: they take up to minutes, and completions must not
    /// wait behind them.
    pub parallel_ingest: usize,
    /// Most generations advancing together in the batch.
    pub max_batch: usize,
    /// Most generations waiting to join the batch; more are answered 503 with Retry-After.
    pub max_queue: usize,
    /// Most prompt tokens prefilled per batch step (see [`crate::DEFAULT_PREFILL_CHUNK`]).
    pub prefill_chunk: usize,
    /// How the batch holds its generations' SSM states between decode steps.
    pub decode_states: DecodeStates,
    /// Request limits.
    pub limits: Limits,
    /// The model name reported in responses.
    pub model_name: String,
    /// A chat template to use instead of the model's (a `tokenizer_config.json` or a Jinja
    /// file); without one, the model folder's `tokenizer_config.json` gives it, if any.
    pub chat_template: Option<std::path::PathBuf>,
    /// Where chat templates sent with a request (`chat_template`) render: None refuses them
    /// (the default; `--trust-request-chat-template` gives a sandbox).
    pub request_templates: Option<crate::render::Sandbox>,
    /// Resident memory above which new work is answered 503 with Retry-After (None: no guard).
    pub max_memory_bytes: Option<u64>,
}

/// Everything a request needs, shared by all of them.
pub struct App {
    /// The model.
    pub model: Arc<Model>,
    /// The store of context states.
    pub store: Store,
    /// The retriever.
    pub embedder: Embedder,
    /// Hot states.
    pub cache: StateCache,
    /// Request limits.
    pub limits: Limits,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// The model name reported in responses.
    pub model_name: String,
    /// The chat template, if the model has one (or the server was given one).
    pub chat: Option<crate::chat::ChatTemplate>,
    /// Where a request's own chat template renders, if the server takes them.
    pub(crate) request_templates: Option<crate::render::Sandbox>,
    /// Refuses new work above the resident-memory limit.
    pub(crate) memory: Option<crate::memory::MemoryGuard>,
    /// The states after prompt prefixes seen.
    pub(crate) prefix: Arc<PrefixCache>,
    /// Slots for completions preparing.
    pub(crate) gate: Arc<Semaphore>,
    /// Slots for uploads and attributions.
    pub(crate) ingest: Arc<Semaphore>,
    batcher: Batcher,
    next_id: AtomicU64,
    boot: u64,
    /// The server adds and deletes contexts: it is the folder store's one writer.
    _writer: picaso_store::WriteLock,
    /// Held while a document or a named segment is written, so two requests for one document
    /// do not interleave their replacements.
    documents: std::sync::Mutex<()>,
}

/// What the batch continues: `prompt` from `state` (with the next-token logits when the state
/// holds the whole prompt already), storing prefix states as `prefix` says.
pub(crate) struct Generate {
    pub prompt: Vec<u32>,
    pub state: State,
    pub logits: Option<Vec<f32>>,
    pub prefix: Option<crate::batcher::PrefixJob>,
}

/// A completion ready to generate: the prompt and the state it continues from.
pub(crate) struct Plan {
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    pub info: CompletionInfo,
    pub started: Instant,
    /// A budgeted store's bookkeeping for this prompt's contexts, left for after the answer
    /// has started ([`App::finish_later`]).
    pub deferred: Option<picaso_store::Deferred>,
}

/// A listing's page size: `limit`, 100 when absent, at most 1,000.
fn page_limit(limit: Option<usize>) -> Result<usize, ApiError> {
    const MAX: usize = 1000;
    match limit.unwrap_or(100) {
        n @ 1..=MAX => Ok(n),
        n => Err(ApiError::bad_request(format!("`limit` is {n}; give 1 to {MAX}"))),
    }
}

/// A page of at most `limit` items from `data`, read with one item more (`limit + 1`): only
/// when that one is there does the page name its last key for the next one.
fn page<T, K>(mut data: Vec<T>, limit: usize, key: impl Fn(&T) -> K) -> Page<T, K> {
    let more = data.len() > limit;
    data.truncate(limit);
    let next_after = if more { data.last().map(key) } else { None };
    Page { object: "list", data, next_after }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(crate) fn finish_reason(r: StopReason) -> &'static str {
    match r {
        StopReason::Length => "length",
        StopReason::Eos | StopReason::Stop | StopReason::Cancelled => "stop",
    }
}

impl App {
    /// Finishes a budgeted store's bookkeeping for answered queries (counting retrievals,
    /// admitting recomputed states) on a blocking thread, off the answer's path. A failure is
    /// logged: the answer stands, and the state not admitted is recomputed next time.
    pub(crate) fn finish_later(self: &Arc<Self>, deferred: Vec<picaso_store::Deferred>) {
        if deferred.is_empty() {
            return;
        }
        let app = self.clone();
        tokio::task::spawn_blocking(move || {
            for d in deferred {
                if let Err(e) = d.finish(&app.store) {
                    eprintln!("state budget: a query's bookkeeping failed: {e}");
                }
            }
        });
    }

    /// Checks that the parts belong together (the store was made with this model and embedder).
    pub fn new(model: Model, store: Store, embedder: Embedder, options: Options) -> Result<Self, String> {
        if store.info().fingerprint != model.fingerprint() {
            return Err(format!(
                "store {} holds states of model {}, not of the given model {}; serve it with the model it was made with",
                store.location(),
                store.info().fingerprint,
                model.fingerprint()
            ));
        }
        if store.info().dim != embedder.dim() {
            return Err(format!(
                "store {} holds {}-dimensional embeddings, the embedder makes {}; use the embedder it was made with",
                store.location(),
                store.info().dim,
                embedder.dim()
            ));
        }
        let writer = store.lock_writes().map_err(|e| e.to_string())?;
        // The server embeds queries and new contexts: it must be the store's embedder.
        store
            .bind_embedder(embedder.fingerprint(), &embedder.dir().display().to_string())
            .map_err(|e| e.to_string())?;
        model.tokenizer().map_err(|e| e.to_string())?;
        let chat = crate::chat::ChatTemplate::load(model.dir(), options.chat_template.as_deref())?;
        if options.decode_states == DecodeStates::F16 && !model.runs_f16_states() {
            return Err(
                "f16 decode states need a Mamba-2 model on the cpu engine (--device cpu); use --decode-state f32"
                    .into(),
            );
        }
        let metrics = Metrics::default();
        metrics.contexts.set(store.len().map_err(|e| e.to_string())? as i64);
        let model = Arc::new(model);
        let prefix = Arc::new(PrefixCache::new(options.prefix_cache_bytes, metrics.prefix.clone()));
        let batcher = Batcher::start(
            model.clone(),
            options.max_batch,
            options.max_queue,
            options.prefill_chunk,
            options.decode_states,
            metrics.batch.clone(),
            prefix.clone(),
        );
        Ok(Self {
            model,
            batcher,
            store,
            embedder,
            cache: StateCache::new(options.cache_bytes),
            limits: options.limits,
            metrics,
            model_name: options.model_name,
            chat,
            request_templates: options.request_templates,
            memory: options.max_memory_bytes.map(crate::memory::MemoryGuard::new),
            prefix,
            gate: Arc::new(Semaphore::new(options.parallel.max(1))),
            ingest: Arc::new(Semaphore::new(options.parallel_ingest.max(1))),
            next_id: AtomicU64::new(0),
            boot: unix_now(),
            _writer: writer,
            documents: std::sync::Mutex::new(()),
        })
    }

    /// Cheap checks done before any model work: everything but the prompt's length. Returns
    /// the composition, the generation's options and the metadata filter, checked.
    pub(crate) fn validate(
        &self,
        req: &CompletionRequest,
    ) -> Result<(Method, GenerateOptions, Option<Filter>), ApiError> {
        let unsupported = |what: &str| Err(ApiError::bad_request(format!("{what} is not supported by picaso")));
        if req.n.is_some_and(|n| n != 1) || req.best_of.is_some_and(|n| n != 1) {
            return unsupported("n or best_of other than 1 (for several answers, send several prompts: a list)");
        }
        if let Some(n) = req.logprobs.filter(|&n| n > MAX_TOP_LOGPROBS) {
            return Err(ApiError::bad_request(format!(
                "`logprobs` is {n}; give 0 to {MAX_TOP_LOGPROBS} (how many likeliest tokens to list at each position)"
            )));
        }
        let prompts = req.prompt.count();
        if prompts == 0 {
            return Err(ApiError::bad_request("`prompt` is an empty list; give at least one prompt"));
        }
        if prompts > self.limits.max_prompts {
            return Err(ApiError::bad_request(format!(
                "{prompts} prompts in one request; this server takes at most {} (send the rest in further requests)",
                self.limits.max_prompts
            )));
        }
        if req.suffix.is_some() {
            return unsupported("suffix");
        }
        if req.presence_penalty.is_some_and(|p| p != 0.0) || req.frequency_penalty.is_some_and(|p| p != 0.0) {
            return unsupported("a presence or frequency penalty");
        }
        if req.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return unsupported("logit_bias");
        }
        let method = match &req.composition {
            None => Method::Compose(Composition::PicasoR),
            Some(name) => {
                Method::parse_among(name, &Method::QUERY).map_err(|e| ApiError::bad_request(e.to_string()))?
            }
        };
        if let Some(m) = req.model.as_deref().filter(|m| !m.is_empty() && *m != self.model_name) {
            return Err(ApiError::not_found(format!(
                "no model {m:?}; this server serves {:?} (GET /v1/models); send that name, or no `model`",
                self.model_name
            )));
        }
        let uses_contexts = req.contexts.as_ref().is_some_and(|c| !c.is_empty()) || req.retrieve.is_some_and(|k| k > 0);
        if method == Method::Naive && uses_contexts {
            return Err(ApiError::bad_request(format!(
                "composition \"naive\" uses no context: drop `contexts` and `retrieve`, or pick {}",
                Method::list(&Method::WITH_CONTEXT)
            )));
        }
        if req.contexts.is_some() && req.retrieve.is_some() {
            return Err(ApiError::bad_request("give either `contexts` (ids) or `retrieve` (a count), not both"));
        }
        let filter =
            self.check_contexts(req.contexts.as_deref(), req.retrieve, req.documents.as_deref(), req.filter.as_ref())?;
        if req.max_tokens > self.limits.max_tokens {
            return Err(ApiError::bad_request(format!(
                "max_tokens {} is over this server's limit of {}",
                req.max_tokens, self.limits.max_tokens
            )));
        }
        let stop = match &req.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 16 {
            return Err(ApiError::bad_request(format!("{} stop strings; at most 16", stop.len())));
        }
        let seed = req.seed.unwrap_or_else(|| {
            let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
            nanos ^ self.next_id.load(Ordering::Relaxed).rotate_left(32)
        });
        let opts = GenerateOptions {
            max_tokens: req.max_tokens,
            temperature: req.temperature,
            top_p: req.top_p,
            seed,
            stop,
            ignore_eos: req.ignore_eos,
        };
        opts.validate()?;
        Ok((method, opts, filter))
    }

    /// The request's prompts as token ids, each with its text (what retrieval embeds and `echo`
    /// shows); refuses an empty prompt, one over the per-prompt limit (413) and a request over
    /// the total (413). Blocking (tokenization).
    pub(crate) fn prompts(&self, prompt: &Prompt) -> Result<Vec<(String, Vec<u32>)>, ApiError> {
        let tokenizer = self.model.tokenizer()?;
        let texts = |v: &[String]| -> Result<Vec<(String, Vec<u32>)>, ApiError> {
            v.iter().map(|t| Ok((t.clone(), tokenizer.encode(t)?))).collect()
        };
        // Ids are checked before they are decoded: an id past the vocabulary is the client's 400.
        let ids = |v: &[Vec<u32>]| -> Result<Vec<(String, Vec<u32>)>, ApiError> {
            let which = |i: usize| if v.len() > 1 { format!("prompt {i}: ") } else { String::new() };
            let check = |i: usize, ids: &[u32]| {
                self.model.check_tokens(ids).map_err(|e| ApiError::bad_request(format!("{}{e}", which(i))))
            };
            v.iter()
                .enumerate()
                .map(|(i, ids)| {
                    check(i, ids)?;
                    Ok((tokenizer.decode(ids)?, ids.clone()))
                })
                .collect()
        };
        let prompts = match prompt {
            Prompt::Text(t) => texts(std::slice::from_ref(t))?,
            Prompt::Texts(v) => texts(v)?,
            Prompt::Tokens(t) => ids(std::slice::from_ref(t))?,
            Prompt::TokenLists(v) => ids(v)?,
        };
        let several = prompts.len() > 1;
        let which = |i: usize| if several { format!("prompt {i}") } else { "the prompt".to_string() };
        for (i, (_, tokens)) in prompts.iter().enumerate() {
            if tokens.is_empty() {
                return Err(ApiError::bad_request(format!("{} is empty; it must have at least one token", which(i))));
            }
            if tokens.len() > self.limits.max_prompt_tokens {
                return Err(ApiError::too_large(format!(
                    "{} has {} tokens; this server accepts at most {}",
                    which(i),
                    tokens.len(),
                    self.limits.max_prompt_tokens
                )));
            }
            self.model.check_tokens(tokens).map_err(|e| ApiError::bad_request(format!("{}: {e}", which(i))))?;
        }
        let total: usize = prompts.iter().map(|p| p.1.len()).sum();
        if total > self.limits.max_request_tokens {
            return Err(ApiError::too_large(format!(
                "the {} prompts have {total} tokens together; this server accepts at most {} per request (send fewer prompts per request)",
                prompts.len(),
                self.limits.max_request_tokens
            )));
        }
        Ok(prompts)
    }

    /// Retrieves or looks up one prompt's contexts and builds the state to continue from;
    /// `query` is the text retrieval embeds. Blocking (model work for concat).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn plan(
        &self,
        req: &CompletionRequest,
        query: &str,
        prompt: Vec<u32>,
        method: Method,
        opts: GenerateOptions,
        filter: Option<&Filter>,
        started: Instant,
    ) -> Result<(Plan, State), ApiError> {
        let t_retrieve = Instant::now();
        let embedded;
        let contexts = match (method, &req.contexts, req.retrieve) {
            (Method::Naive, _, _) | (_, None, None | Some(0)) => Contexts::Nothing,
            (_, Some(ids), _) => Contexts::Ids(ids),
            (_, None, Some(k)) => {
                let retriever = Retriever::parse(req.retriever.as_deref().unwrap_or("dense"), req.hybrid_weight)?;
                embedded = self.embed_for(retriever, query)?;
                Contexts::Retrieved(
                    Retrieval::new(&embedded, k)
                        .within(req.documents.as_deref())
                        .matching(filter)
                        .by(retriever, Some(query))
                        .embedded_by(self.embedder.fingerprint()),
                )
            }
        };
        let (hits, mut prepared) = gather(&self.store, contexts, |ids| {
            picaso_store::prepare_deferring(&self.store, &self.model, ids, method, Some(&self.cache))
        })?;
        // Where each context comes from, to cite it by (one catalog read for all).
        let ids: Vec<i64> = hits.iter().map(|h| h.0).collect();
        let records = if ids.is_empty() { Vec::new() } else { self.store.records(&ids)? };
        let contexts: Vec<UsedContext> = hits
            .iter()
            .zip(records.into_iter().chain(std::iter::repeat(None)))
            .map(|(&(id, score), r)| UsedContext {
                id,
                score,
                segment: r.as_ref().map(|r| r.seg),
                doc: r.as_ref().map(|r| r.doc.clone()),
                metadata: r.map(|r| r.metadata),
            })
            .collect();
        let retrieve_ms = 1e3 * prepared.retrieval_seconds(t_retrieve);
        let m = &self.metrics;
        m.states_loaded.inc_by(prepared.states_loaded as u64);
        m.cache_hits.inc_by(prepared.cache_hits as u64);
        m.states_recomputed.inc_by(prepared.states_recomputed as u64);
        if prepared.states_loaded > 0 {
            m.load_seconds.observe(prepared.load_seconds);
        }
        if !ids.is_empty() {
            m.compose_seconds
                .get_or_create(&vec![("method", method.name().to_string())])
                .observe(prepared.compose_seconds);
        }
        m.prompt_tokens.inc_by(prompt.len() as u64);
        let plan = Plan {
            prompt,
            opts,
            info: CompletionInfo {
                composition: method.name(),
                contexts,
                context_tokens: prepared.tokens_processed,
                states_loaded: prepared.states_loaded,
                cache_hits: prepared.cache_hits,
                states_recomputed: prepared.states_recomputed,
                retrieve_ms,
                load_ms: 1e3 * prepared.load_seconds,
                compose_ms: 1e3 * prepared.compose_seconds,
                cached_tokens: 0,
                time_to_first_token_ms: None,
            },
            started,
            deferred: prepared.deferred.take(),
        };
        Ok((plan, prepared.state))
    }

    /// When the server started (seconds since the Unix epoch): the model's `created`.
    pub(crate) fn created(&self) -> u64 {
        self.boot
    }

    /// Hands a generation to the batch: `generate`'s prompt continues its state, sampled with `opts`; its
    /// events arrive on the returned receiver (dropping it cancels the generation). 503 with
    /// Retry-After when the queue is full.
    pub(crate) fn submit(
        &self,
        generate: Generate,
        opts: GenerateOptions,
        logprobs: Option<usize>,
        started: Instant,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let Generate { prompt, state, logits, prefix } = generate;
        let job = Job { prompt, opts, logprobs, started, events: tx, logits, prefix };
        match self.batcher.submit(job, state) {
            Ok(()) => Ok(rx),
            Err(Refused::Busy) => {
                Err(ApiError::busy("every generation slot and the queue are taken; retry shortly", 1))
            }
            Err(Refused::Stopped) => Err(ApiError::internal("the batching thread stopped")),
        }
    }

    /// A fresh completion id.
    pub(crate) fn completion_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:x}-{n}", self.boot)
    }

    /// Adds one context: its state, embedding and metadata. Blocking.
    pub(crate) fn add_context(&self, req: AddContext) -> Result<AddedContext, ApiError> {
        if req.text.trim().is_empty() {
            return Err(ApiError::bad_request("`text` is empty"));
        }
        let doc = req.doc.unwrap_or_else(|| format!("api/{:032x}", xxhash_rust::xxh3::xxh3_128(req.text.as_bytes())));
        if doc.is_empty() {
            return Err(ApiError::bad_request("`doc` is empty"));
        }
        let stored = match self.store.id_of(&doc, req.segment)? {
            Some(id) => match self.store.get(id) {
                // The same text, still with its state: nothing to do.
                Ok(rec)
                    if rec.text == req.text && self.store.missing_states(std::slice::from_ref(&rec))?.is_empty() =>
                {
                    // Other metadata only: the context keeps its id and state.
                    if rec.metadata != req.metadata {
                        self.store.set_metadata(&[id], &req.metadata)?;
                    }
                    let n_tokens = rec.n_tokens;
                    return Ok(AddedContext {
                        id,
                        doc,
                        segment: req.segment,
                        n_tokens,
                        created: false,
                        replaced: None,
                    });
                }
                Ok(_) => Some(id),
                Err(picaso_store::Error::NotFound(_)) => None, // deleted meanwhile
                Err(e) => return Err(e.into()),
            },
            None => None,
        };
        let tokens = self.model.tokenizer()?.encode(&req.text)?;
        if tokens.len() > self.limits.max_prompt_tokens {
            return Err(ApiError::too_large(format!(
                "the text has {} tokens; this server accepts contexts of at most {}",
                tokens.len(),
                self.limits.max_prompt_tokens
            )));
        }
        let state = self.model.prefill(&tokens, &self.model.zero_state())?;
        let embedding = self.embedder.embed_one(&req.text)?;
        let n_tokens = tokens.len();
        let item = NewContext {
            doc: doc.clone(),
            seg: req.segment,
            text: req.text,
            tokens,
            embedding,
            state,
            metadata: req.metadata,
        };
        // Other text for a stored (doc, segment) replaces it: the old context goes just before
        // the new one is recorded, so its state is never served for text that is gone.
        let _one_writer = self.documents.lock().unwrap_or_else(|p| p.into_inner());
        let mut replaced = None;
        if let Some(old) = stored {
            if self.store.delete_if_present(old)? {
                replaced = Some(old);
            }
            self.cache.remove(old);
            self.prefix.forget_contexts(&[old]);
        }
        let id = match self.store.insert_with(std::slice::from_ref(&item), Some(&self.model))?[0] {
            Some(id) => id,
            // Another request stored the same (doc, segment) meanwhile: the same text is this
            // request's context; other text means two writers raced on one segment.
            None => {
                let id = self.store.id_of(&doc, req.segment)?.ok_or_else(|| ApiError::internal("context vanished"))?;
                if self.store.get(id)?.text != item.text {
                    return Err(ApiError::conflict(format!(
                        "another request stored other text for document {doc:?} segment {} at the same time (context {id}); send yours again to replace it",
                        req.segment
                    )));
                }
                // Stored by that request, not this one.
                return Ok(AddedContext { id, doc, segment: req.segment, n_tokens, created: false, replaced });
            }
        };
        if let Ok(n) = self.store.len() {
            self.metrics.contexts.set(n as i64);
        }
        Ok(AddedContext { id, doc, segment: req.segment, n_tokens, created: true, replaced })
    }

    /// A page of contexts by ascending id. Blocking.
    pub(crate) fn list_contexts(&self, q: ContextsQuery) -> Result<Page<ContextRecord, i64>, ApiError> {
        let limit = page_limit(q.limit)?;
        let after = q.after.unwrap_or(i64::MIN);
        let Some(filter) = &q.filter else {
            let data: Vec<_> = self.store.export(after, limit + 1)?.into_iter().map(|(r, _)| r).collect();
            return Ok(page(data, limit, |r| r.id));
        };
        let filter = filter_param(filter)?;
        let matching = self.store.matching(&filter)?;
        let mut data = Vec::with_capacity(limit + 1);
        // Records of the ids after `after`, a page at a time (one deleted meanwhile is left out).
        for ids in matching[matching.partition_point(|&id| id <= after)..].chunks(limit + 1) {
            data.extend(self.store.records(ids)?.into_iter().flatten());
            if data.len() > limit {
                break;
            }
        }
        data.truncate(limit + 1);
        Ok(page(data, limit, |r| r.id))
    }

    /// Adds or updates a document: cut as the store's documents are, new and changed segments
    /// processed (batched), segments it lost removed. Blocking. Returns whether anything changed.
    pub(crate) fn add_document(&self, req: AddDocument) -> Result<(bool, AddedDocument), ApiError> {
        if req.id.is_empty() {
            return Err(ApiError::bad_request("`id` is empty; name the document (sending it again updates it)"));
        }
        let paragraphs = picaso_store::sources::paragraphs(&req.text);
        if paragraphs.is_empty() {
            return Err(ApiError::bad_request("`text` is empty"));
        }
        let segmentation = match self.store.segmentation()? {
            Some(s) => s.parse().map_err(|e: String| ApiError::internal(format!("the store's segmentation: {e}")))?,
            None => picaso_store::Segmentation::Paragraph,
        };
        let doc = picaso_store::Document { id: req.id, paragraphs, metadata: req.metadata };
        for (seg, _, tokens) in picaso_store::ingest::segments(&self.model, &doc, segmentation)? {
            if tokens.len() > self.limits.max_prompt_tokens {
                return Err(ApiError::too_large(format!(
                    "segment {seg} of the document has {} tokens; this server accepts contexts of at most {} (split the text into shorter paragraphs)",
                    tokens.len(),
                    self.limits.max_prompt_tokens
                )));
            }
        }
        let _one_writer = self.documents.lock().unwrap_or_else(|p| p.into_inner());
        let before: Vec<i64> = self.store.segments_of(&doc.id)?.into_values().collect();
        let report = picaso_store::ingest(
            &self.store,
            &self.model,
            &self.embedder,
            std::slice::from_ref(&doc),
            segmentation,
            16,
            |_| {},
        )?;
        let contexts = self.store.document(&doc.id)?;
        for id in before.iter().filter(|id| !contexts.iter().any(|c| c.id == **id)) {
            self.cache.remove(*id);
        }
        if let Ok(n) = self.store.len() {
            self.metrics.contexts.set(n as i64);
        }
        let changed = report.done + report.removed + report.relabelled > 0;
        if changed {
            // Compositions of the document's old segments are not reused (a segment's id may
            // stay while its text changes).
            self.prefix.forget_contexts(&before);
        }
        Ok((
            changed,
            AddedDocument {
                id: doc.id,
                segmentation: segmentation.to_string(),
                added: report.added(),
                replaced: report.replaced,
                repaired: report.repaired,
                removed: report.removed,
                skipped: report.skipped,
                relabelled: report.relabelled,
                tokens: report.tokens,
                contexts: contexts
                    .iter()
                    .map(|c| DocumentContext { id: c.id, segment: c.seg, n_tokens: c.n_tokens })
                    .collect(),
            },
        ))
    }

    /// A page of documents by name. Blocking.
    pub(crate) fn list_documents(&self, q: PageQuery<String>) -> Result<Page<DocumentSummary, String>, ApiError> {
        let limit = page_limit(q.limit)?;
        let data = self.store.documents(q.after.as_deref(), limit + 1)?;
        Ok(page(data, limit, |d| d.id.clone()))
    }

    /// A document's contexts. Blocking.
    pub(crate) fn get_document(&self, id: String) -> Result<DocumentRecords, ApiError> {
        let contexts = self.store.document(&id)?;
        if contexts.is_empty() {
            return Err(ApiError::not_found(format!("no document {id:?} in this store")));
        }
        Ok(DocumentRecords { id, contexts })
    }

    /// Removes a document's contexts; returns how many. Blocking.
    pub(crate) fn delete_document(&self, id: &str) -> Result<usize, ApiError> {
        let _one_writer = self.documents.lock().unwrap_or_else(|p| p.into_inner());
        let removed = self.store.delete_document(id)?;
        if removed.is_empty() {
            return Err(ApiError::not_found(format!("no document {id:?} in this store")));
        }
        self.forget(&removed);
        Ok(removed.len())
    }

    /// Removes a context. Blocking.
    pub(crate) fn delete_context(&self, id: i64) -> Result<(), ApiError> {
        self.store.delete(id)?;
        self.forget(&[id]);
        Ok(())
    }

    /// Removes every context whose metadata passes the query's filter, all at once; refused
    /// (404, nothing removed) when none does. Blocking. Returns the ids removed.
    pub(crate) fn delete_matching(&self, q: DeleteQuery) -> Result<Vec<i64>, ApiError> {
        let Some(filter) = q.filter else {
            return Err(ApiError::bad_request(
                "DELETE /v1/contexts removes the contexts whose metadata passes `filter` (URL-encoded JSON, e.g. \
                 ?filter=%7B%22source%22%3A%22old%22%7D for {\"source\":\"old\"}); to remove one context, \
                 DELETE /v1/contexts/{id}",
            ));
        };
        let filter = filter_param(&filter)?;
        let _one_writer = self.documents.lock().unwrap_or_else(|p| p.into_inner());
        let matching = self.store.matching(&filter)?;
        if matching.is_empty() {
            let why: String = self.store.why_none_match(&filter)?.iter().map(|w| format!("; {w}")).collect();
            return Err(ApiError::not_found(format!(
                "no context has metadata matching the filter; nothing was removed{why}"
            )));
        }
        let removed = self.store.delete_many(&matching)?;
        self.forget(&removed);
        Ok(removed)
    }

    /// Drops removed contexts from the state cache and updates the context count.
    fn forget(&self, ids: &[i64]) {
        for &id in ids {
            self.cache.remove(id);
        }
        self.prefix.forget_contexts(ids);
        if let Ok(n) = self.store.len() {
            self.metrics.contexts.set(n as i64);
        }
    }

    /// Refuses a context listed twice, more contexts than the server combines, and `documents`
    /// or `filter` without retrieval, naming more documents than [`MAX_DOCUMENTS`] (each is
    /// looked up) or a filter that is not one. Returns the filter, checked.
    fn check_contexts(
        &self,
        ids: Option<&[i64]>,
        retrieve: Option<usize>,
        documents: Option<&[String]>,
        filter: Option<&picaso_store::Metadata>,
    ) -> Result<Option<Filter>, ApiError> {
        if documents.is_some() && retrieve.is_none_or(|k| k == 0) {
            return Err(ApiError::bad_request(
                "`documents` limits retrieval to some documents: give it with `retrieve` (a count), or drop it",
            ));
        }
        if filter.is_some() && retrieve.is_none_or(|k| k == 0) {
            return Err(ApiError::bad_request(
                "`filter` limits retrieval to contexts with some metadata: give it with `retrieve` (a count), or drop it",
            ));
        }
        check_documents(documents)?;
        let filter = filter.map(Filter::new).transpose()?;
        if let Some(ids) = ids {
            let mut seen = std::collections::HashSet::new();
            if let Some(dup) = ids.iter().find(|id| !seen.insert(**id)) {
                return Err(ApiError::bad_request(format!(
                    "context {dup} is listed twice in `contexts`; list each context once (composition weighs each one by its place in the list)"
                )));
            }
        }
        let n_contexts = ids.map(<[i64]>::len).or(retrieve).unwrap_or(0);
        if n_contexts > self.limits.max_contexts {
            return Err(ApiError::bad_request(format!(
                "{n_contexts} contexts requested; this server composes at most {}",
                self.limits.max_contexts
            )));
        }
        Ok(filter)
    }

    /// Attributes an answer to its contexts by leaving each out in turn. Blocking (k + 1
    /// scorings of the prompt and answer; for concat, k + 1 passes over the contexts too).
    pub(crate) fn attribute(&self, req: AttributeRequest) -> Result<AttributeResponse, ApiError> {
        let method = match &req.composition {
            None => Method::Compose(Composition::PicasoR),
            Some(name) => {
                Method::parse_among(name, &Method::QUERY).map_err(|e| ApiError::bad_request(e.to_string()))?
            }
        };
        let retrieve = match (&req.contexts, req.retrieve) {
            (Some(_), Some(_)) => {
                return Err(ApiError::bad_request("give either `contexts` (ids) or `retrieve` (a count), not both"))
            }
            (None, None) => {
                return Err(ApiError::bad_request(
                    "no contexts to attribute the answer to: give `contexts` (ids) or `retrieve` (a count)",
                ))
            }
            (_, k) => k,
        };
        let filter =
            self.check_contexts(req.contexts.as_deref(), retrieve, req.documents.as_deref(), req.filter.as_ref())?;
        let tokenizer = self.model.tokenizer()?;
        let (prompt, answer) = (tokenizer.encode(&req.prompt)?, tokenizer.encode(&req.answer)?);
        if prompt.len() + answer.len() > self.limits.max_prompt_tokens {
            return Err(ApiError::too_large(format!(
                "the prompt and answer have {} tokens together; this server accepts at most {}",
                prompt.len() + answer.len(),
                self.limits.max_prompt_tokens
            )));
        }
        let started = Instant::now();
        let attribute = |ids: &[i64]| {
            picaso_store::attribute(&self.store, &self.model, ids, method, &prompt, &answer, Some(&self.cache))
        };
        let (hits, at): (Vec<(i64, Option<f32>)>, _) = match (&req.contexts, retrieve) {
            (Some(ids), _) => (ids.iter().map(|&id| (id, None)).collect(), attribute(ids)?),
            (None, k) => {
                let retriever = Retriever::parse(req.retriever.as_deref().unwrap_or("dense"), req.hybrid_weight)?;
                let query = self.embed_for(retriever, &req.prompt)?;
                let what = Retrieval::new(&query, k.unwrap_or(0))
                    .within(req.documents.as_deref())
                    .matching(filter.as_ref())
                    .by(retriever, Some(&req.prompt))
                    .embedded_by(self.embedder.fingerprint());
                let (hits, at) = retrieve_then(&self.store, what, attribute)?;
                (hits.into_iter().map(|(id, score)| (id, Some(score))).collect(), at)
            }
        };
        // Retrieval is what the request did besides attributing.
        let retrieve_ms = 1e3 * (started.elapsed().as_secs_f64() - at.seconds).max(0.0);
        let ids: Vec<i64> = hits.iter().map(|h| h.0).collect();
        let contexts = hits
            .iter()
            .enumerate()
            .map(|(i, &(id, score))| AttributedContext { id, score, loglik_without: at.without[i], drop: at.drop(i) })
            .collect();
        Ok(AttributeResponse {
            composition: method.name(),
            answer_tokens: at.answer_tokens,
            loglik: at.loglik,
            contexts,
            ranking: at.ranking().into_iter().map(|i| ids[i]).collect(),
            retrieve_ms,
            attribute_ms: 1e3 * at.seconds,
        })
    }

    /// The query's embedding when `retriever` uses one (BM25 does not: nothing is embedded).
    fn embed_for(&self, retriever: Retriever, query: &str) -> Result<Vec<f32>, ApiError> {
        Ok(if retriever.needs_embedding() { self.embedder.embed_one(query)? } else { Vec::new() })
    }

    /// Retrieval only. Blocking.
    pub(crate) fn search(&self, req: SearchRequest) -> Result<SearchResponse, ApiError> {
        check_documents(req.documents.as_deref())?;
        let filter = req.filter.as_ref().map(Filter::new).transpose()?;
        if req.query.trim().is_empty() {
            return Err(ApiError::bad_request("`query` is empty: give the text to find contexts for"));
        }
        if req.k > self.limits.max_contexts {
            return Err(ApiError::bad_request(format!(
                "k = {} is over the limit of {}",
                req.k, self.limits.max_contexts
            )));
        }
        let retriever = Retriever::parse(req.retriever.as_deref().unwrap_or("dense"), req.hybrid_weight)?;
        let q = self.embed_for(retriever, &req.query)?;
        let scope = picaso_store::Scope { documents: req.documents.as_deref(), filter: filter.as_ref() };
        let query = picaso_store::Query {
            text: Some(&req.query),
            embedding: retriever.needs_embedding().then_some(&q[..]),
            encoder: Some(self.embedder.fingerprint()),
        };
        let results = (self.store.retrieve_records(&query, retriever, req.k, scope)?.into_iter())
            .map(|(rec, score)| SearchHit {
                id: rec.id,
                score,
                doc: rec.doc,
                segment: rec.seg,
                text: rec.text,
                metadata: rec.metadata,
            })
            .collect();
        Ok(SearchResponse { results })
    }
}

/// A metadata filter given in a query string: JSON text (the query string's decoding already
/// undid the URL encoding), checked.
fn filter_param(filter: &str) -> Result<Filter, ApiError> {
    match serde_json::from_str::<serde_json::Value>(filter) {
        Ok(serde_json::Value::Object(f)) => Ok(Filter::new(&f)?),
        _ => Err(ApiError::bad_request(
            "`filter` must be a JSON object, URL-encoded (e.g. ?filter=%7B%22lang%22%3A%22en%22%7D for {\"lang\":\"en\"})",
        )),
    }
}
