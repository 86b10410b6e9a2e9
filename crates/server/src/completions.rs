//! A completion request from its prompts to its choices, for `/v1/completions` and
//! `/v1/chat/completions` alike: each prompt is planned (contexts retrieved or looked up and
//! composed), its own tokens scored when the request echoes them with log-probabilities, and
//! its generation handed to the continuous batcher, every prompt's at once so that they share
//! the batch's steps. The events of all of them are merged into one answer, or one stream of
//! chunks, choice by choice.
//!
//! Scoring the prompt runs where concat's prefill runs (a blocking thread, under the
//! preparation gate), not in the batch: the batch's prefill keeps only each sequence's last
//! logits, and scoring needs every position's. The prompt is still processed once: scoring
//! stops before its last token, which the batch then feeds to start generating.

use std::sync::Arc;
use std::time::Instant;

use picaso_model::Method;
use picaso_model::{GenerateOptions, State};
use picaso_store::Filter;
use serde_json::json;
use tokio::sync::mpsc;

use crate::api::{Choice, Completion, CompletionInfo, CompletionRequest, Logprobs, PromptTokensDetails, Usage};
use crate::app::{finish_reason, unix_now, App, Generate, Plan};
use crate::batcher::{Event, PrefixJob};
use crate::chat::FromChat;
use crate::error::ApiError;
use crate::logprobs::{score_prompt, LogprobsBuilder};
use crate::prefix_cache::Origin;

/// How the answer is shaped: OpenAI's legacy completions, or chat completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    /// `text_completion`: `choices[].text`.
    Text,
    /// `chat.completion`: `choices[].message` (`choices[].delta` when streamed).
    Chat,
}

/// One prompt, ready: its plan, what it shows before the generated text, and what the batch is
/// to continue.
pub(crate) struct Prepared {
    plan: Plan,
    /// The prompt's text, with `echo`; else empty.
    echo_text: String,
    /// The echoed prompt's log-probabilities, with `echo` and `logprobs`.
    echo_logprobs: Option<Logprobs>,
    /// Characters of the echoed tokens: where the generated tokens' `text_offset` starts.
    offset: usize,
    /// The tokens to feed and the state they continue, until handed to the batch; None when
    /// nothing is generated (`max_tokens: 0`).
    generate: Option<Generate>,
    /// Whether the prompt generates (`generate` is taken when it joins the batch).
    generates: bool,
}

/// The budgeted store's bookkeeping the prompts left (see [`App::finish_later`]).
pub(crate) fn take_deferred(prepared: &mut [Prepared]) -> Vec<picaso_store::Deferred> {
    prepared.iter_mut().filter_map(|p| p.plan.deferred.take()).collect()
}

/// Plans every prompt of `req`, scoring those it echoes with log-probabilities; each prompt
/// that generates continues from the longest prefix of it the prefix cache holds. Blocking.
pub(crate) fn prepare(
    app: &App,
    req: &CompletionRequest,
    chat: &FromChat,
    method: Method,
    opts: &GenerateOptions,
    filter: Option<&Filter>,
    started: Instant,
) -> Result<Vec<Prepared>, ApiError> {
    let tokenizer = app.model.tokenizer()?;
    let mut out = Vec::new();
    // Read before any context is composed: a context removed meanwhile bumps it, and states
    // composed from it are then not stored.
    let epoch = app.prefix.epoch();
    for (text, tokens) in app.prompts(&req.prompt)? {
        let query = chat.query.as_deref().unwrap_or(&text);
        let (mut plan, state) = app.plan(req, query, tokens.clone(), method, opts.clone(), filter, started)?;
        let generating = opts.max_tokens > 0;
        let (mut echo_logprobs, mut offset) = (None, 0);
        let generate = match req.logprobs.filter(|_| req.echo) {
            // The prompt's log-probabilities need every position's logits: scored whole, never
            // from a stored prefix (whose positions were not kept).
            Some(top_n) => {
                let (positions, state) = score_prompt(&app.model, &tokens, state, top_n)?;
                let (mut logprobs, mut builder) = (Logprobs::default(), LogprobsBuilder::new(tokenizer, 0));
                builder.push_first(&mut logprobs, tokens[0]);
                positions.iter().for_each(|p| builder.push(&mut logprobs, p));
                (echo_logprobs, offset) = (Some(logprobs), builder.offset());
                let last = tokens[tokens.len() - 1];
                generating.then(|| Generate { prompt: vec![last], state, logits: None, prefix: None })
            }
            None if generating => Some(from_prefix(app, &mut plan, &text, tokens, state, &chat.boundaries, epoch)),
            None => None,
        };
        let echo_text = if req.echo { text } else { String::new() };
        out.push(Prepared { plan, echo_text, echo_logprobs, offset, generates: generate.is_some(), generate });
    }
    Ok(out)
}

/// What the batch continues for `tokens`: from the longest prefix the prefix cache holds (its
/// state replaces `state`, the composition the prompt starts from), storing the states at the
/// prompt's end and at the message ends (`boundaries`, bytes of `text`) it prefills.
fn from_prefix(
    app: &App,
    plan: &mut Plan,
    text: &str,
    tokens: Vec<u32>,
    state: State,
    boundaries: &[usize],
    epoch: u64,
) -> Generate {
    if !app.prefix.enabled() {
        return Generate { prompt: tokens, state, logits: None, prefix: None };
    }
    let ids: Vec<i64> = plan.info.contexts.iter().map(|c| c.id).collect();
    let origin = Origin::new(app.model.fingerprint(), plan.info.composition, &ids);
    let (start, state, logits) = match app.prefix.lookup(&origin, &tokens, 0) {
        Some(hit) => (hit.len, hit.state, hit.logits),
        None => (0, state, None),
    };
    plan.info.cached_tokens = start;
    if start == tokens.len() {
        // All of it stored, logits too: nothing to prefill or store.
        app.prefix.record(start);
        return Generate { prompt: Vec::new(), state, logits, prefix: None };
    }
    let mut cuts: Vec<usize> = token_boundaries(app, text, &tokens, boundaries)
        .into_iter()
        .filter(|&b| b > start)
        .map(|b| b - start)
        .collect();
    cuts.push(tokens.len() - start);
    cuts.dedup();
    let prompt = tokens[start..].to_vec();
    Generate { prompt, state, logits, prefix: Some(PrefixJob { origin, tokens, start, cuts, epoch }) }
}

/// Token positions of `text` (tokenized as `tokens`) at the byte offsets `boundaries`: the
/// tokens that end at or before each. Ascending, within the prompt (not its end).
fn token_boundaries(app: &App, text: &str, tokens: &[u32], boundaries: &[usize]) -> Vec<usize> {
    if boundaries.is_empty() {
        return Vec::new();
    }
    let Ok(encoding) = app.model.tokenizer().map(|t| t.inner().encode(text, false)) else { return Vec::new() };
    let Ok(encoding) = encoding else { return Vec::new() };
    if encoding.get_ids() != tokens {
        return Vec::new();
    }
    let offsets = encoding.get_offsets();
    let mut out: Vec<usize> = boundaries
        .iter()
        .map(|&b| offsets.partition_point(|o| o.1 <= b))
        .filter(|&t| t > 0 && t < tokens.len())
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A choice as it builds up.
struct Building {
    text: String,
    logprobs: Option<Logprobs>,
    /// Where the next token's `text_offset` starts.
    offset: usize,
    finish: Option<&'static str>,
    completion_tokens: usize,
    info: CompletionInfo,
}

/// What the request asked for, beside its prompts.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub shape: Shape,
    pub model: String,
    pub logprobs: Option<usize>,
}

/// Hands every prompt that generates to the batch; the events of all of them arrive on one
/// receiver, tagged with their prompt's index. Dropping the receiver cancels them all (each
/// forwarder notices at once, not at its next event, so a generation still queued leaves).
pub(crate) fn submit_all(
    app: &App,
    prepared: &mut [Prepared],
    logprobs: Option<usize>,
) -> Result<mpsc::UnboundedReceiver<(usize, Event)>, ApiError> {
    let (tx, merged) = mpsc::unbounded_channel();
    for (index, p) in prepared.iter_mut().enumerate() {
        let Some(generate) = p.generate.take() else { continue };
        let mut events = app.submit(generate, p.plan.opts.clone(), logprobs, p.plan.started)?;
        let tx = tx.clone();
        tokio::spawn(async move {
            loop {
                let event = tokio::select! {
                    event = events.recv() => event,
                    () = tx.closed() => return,
                };
                let Some(event) = event else { return };
                if tx.send((index, event)).is_err() {
                    return;
                }
            }
        });
    }
    Ok(merged)
}

/// The choices as they start: the echoed prompt, finished already when nothing is generated.
fn start(prepared: &[Prepared]) -> Vec<Building> {
    prepared
        .iter()
        .map(|p| Building {
            text: p.echo_text.clone(),
            logprobs: p.echo_logprobs.clone(),
            offset: p.offset,
            finish: (!p.generates).then_some("length"),
            completion_tokens: 0,
            info: p.plan.info.clone(),
        })
        .collect()
}

/// Applies one event to its choice; returns the text it adds and the log-probabilities it adds.
fn apply(
    app: &App,
    b: &mut Building,
    event: Event,
    with_logprobs: bool,
) -> Result<(String, Option<Logprobs>), ApiError> {
    match event {
        Event::Logprob(p) => {
            let mut builder = LogprobsBuilder::new(app.model.tokenizer()?, b.offset);
            let all = b.logprobs.get_or_insert_with(Logprobs::default);
            builder.push(all, &p);
            b.offset = builder.offset();
            // The entry just pushed, for a stream's next chunk.
            let added = with_logprobs.then(|| Logprobs {
                tokens: all.tokens.last().cloned().into_iter().collect(),
                token_logprobs: all.token_logprobs.last().copied().into_iter().collect(),
                top_logprobs: all.top_logprobs.last().cloned().into_iter().collect(),
                text_offset: all.text_offset.last().copied().into_iter().collect(),
            });
            Ok((String::new(), added))
        }
        Event::Text(piece) => {
            b.text.push_str(&piece);
            Ok((piece, None))
        }
        Event::Cached(n) => {
            b.info.cached_tokens = n;
            Ok((String::new(), None))
        }
        Event::Done { tokens, reason, ttft } => {
            b.finish = Some(finish_reason(reason));
            b.completion_tokens = tokens;
            b.info.time_to_first_token_ms = Some(1e3 * ttft);
            Ok((String::new(), None))
        }
        Event::Failed(message) => Err(ApiError::internal(message)),
    }
}

fn usage(prepared: &[Prepared], choices: &[Building]) -> Usage {
    let prompt_tokens = prepared.iter().map(|p| p.plan.prompt.len()).sum();
    let completion_tokens = choices.iter().map(|c| c.completion_tokens).sum();
    let cached_tokens = choices.iter().map(|c| c.info.cached_tokens).sum();
    Usage {
        prompt_tokens,
        completion_tokens,
        total_tokens: prompt_tokens + completion_tokens,
        prompt_tokens_details: PromptTokensDetails { cached_tokens },
    }
}

/// Waits for every choice and gives the whole answer.
pub(crate) async fn complete(
    app: &Arc<App>,
    mut prepared: Vec<Prepared>,
    answer: &Answer,
) -> Result<serde_json::Value, ApiError> {
    let mut events = submit_all(app, &mut prepared, answer.logprobs)?;
    let mut choices = start(&prepared);
    while choices.iter().any(|c| c.finish.is_none()) {
        let Some((i, event)) = events.recv().await else {
            return Err(ApiError::internal("the batching thread stopped"));
        };
        apply(app, &mut choices[i], event, false)?;
    }
    let usage = usage(&prepared, &choices);
    let several = choices.len() > 1;
    let first_info = choices[0].info.clone();
    let choices = choices
        .into_iter()
        .enumerate()
        .map(|(index, c)| Choice {
            text: c.text,
            index,
            logprobs: if answer.logprobs.is_some() { Some(c.logprobs.unwrap_or_default()) } else { None },
            finish_reason: c.finish,
            picaso: several.then_some(c.info),
        })
        .collect();
    let completion = Completion {
        id: app.completion_id(prefix(answer.shape)),
        object: "text_completion",
        created: unix_now(),
        model: answer.model.clone(),
        choices,
        usage: Some(usage),
        picaso: Some(first_info),
    };
    Ok(shaped(&completion, answer.shape, false, answer.logprobs.unwrap_or(0)))
}

/// Streams the answer as JSON chunks into `out` (the events of [`submit_all`]): each choice's echoed prompt first, then its
/// text as it is generated (with its tokens' log-probabilities), its last chunk carrying its
/// finish reason; the last chunk of all carries the usage. Stops once the client is gone (`out`
/// closed), which cancels every generation of the request.
pub(crate) async fn stream(
    app: Arc<App>,
    prepared: Vec<Prepared>,
    mut events: mpsc::UnboundedReceiver<(usize, Event)>,
    answer: Answer,
    out: mpsc::Sender<String>,
) {
    let id = app.completion_id(prefix(answer.shape));
    let created = unix_now();
    let several = prepared.len() > 1;
    let with_logprobs = answer.logprobs.is_some();
    let chunk = |index: usize, text: String, logprobs: Option<Logprobs>, finish: Option<&'static str>| Completion {
        id: id.clone(),
        object: "text_completion",
        created,
        model: answer.model.clone(),
        choices: vec![Choice { text, index, logprobs, finish_reason: finish, picaso: None }],
        usage: None,
        picaso: None,
    };
    let send = async |c: &Completion| {
        out.send(shaped(c, answer.shape, true, answer.logprobs.unwrap_or(0)).to_string()).await.is_ok()
    };
    let mut choices = start(&prepared);
    let all_done = |choices: &[Building]| choices.iter().all(|c| c.finish.is_some());
    // The head of each choice: its echo (or nothing), and picaso's account of its contexts.
    for (index, c) in choices.iter().enumerate() {
        let logprobs = if with_logprobs { Some(c.logprobs.clone().unwrap_or_default()) } else { None };
        let mut head = chunk(index, c.text.clone(), logprobs, c.finish);
        if index == 0 {
            head.picaso = Some(c.info.clone());
        }
        if several {
            head.choices[0].picaso = Some(c.info.clone());
        }
        if index + 1 == choices.len() && all_done(&choices) {
            head.usage = Some(usage(&prepared, &choices));
        }
        if !send(&head).await {
            return;
        }
    }
    let mut pending: Vec<Option<Logprobs>> = vec![None; choices.len()];
    while !all_done(&choices) {
        let next = tokio::select! {
            next = events.recv() => next,
            () = out.closed() => return,
        };
        let Some((index, event)) = next else { return };
        let finishing = matches!(event, Event::Done { .. });
        let (text, added) = match apply(&app, &mut choices[index], event, with_logprobs) {
            Ok(applied) => applied,
            Err(e) => {
                let message = json!({"error": {"message": e.public_message(), "type": "server_error"}});
                let _ = out.send(message.to_string()).await;
                return;
            }
        };
        if let Some(added) = added {
            // Held until the text they make is sent (a stop string may hold it back).
            merge(pending[index].get_or_insert_with(Logprobs::default), added);
            continue;
        }
        if text.is_empty() && !finishing {
            continue;
        }
        let logprobs = if with_logprobs { Some(pending[index].take().unwrap_or_default()) } else { None };
        let mut c = chunk(index, text, logprobs, if finishing { choices[index].finish } else { None });
        if finishing && all_done(&choices) {
            c.usage = Some(usage(&prepared, &choices));
            c.picaso = Some(choices[0].info.clone());
        }
        if !send(&c).await {
            return;
        }
    }
    let _ = out.send("[DONE]".into()).await;
}

/// Appends `more` to `into`.
fn merge(into: &mut Logprobs, more: Logprobs) {
    into.tokens.extend(more.tokens);
    into.token_logprobs.extend(more.token_logprobs);
    into.top_logprobs.extend(more.top_logprobs);
    into.text_offset.extend(more.text_offset);
}

fn prefix(shape: Shape) -> &'static str {
    match shape {
        Shape::Text => "cmpl",
        Shape::Chat => "chatcmpl",
    }
}

/// The completion as the client's API shapes it: unchanged for completions; for chat, each
/// choice's text becomes the assistant's message (a `delta` in a stream chunk), and its
/// log-probabilities chat's list of tokens, each with its `top_n` likeliest alternatives.
pub(crate) fn shaped(c: &Completion, shape: Shape, chunk: bool, top_n: usize) -> serde_json::Value {
    let mut v = serde_json::to_value(c).unwrap_or_else(|e| json!({"error": {"message": e.to_string()}}));
    if shape == Shape::Text {
        return v;
    }
    v["object"] = json!(if chunk { "chat.completion.chunk" } else { "chat.completion" });
    if let Some(choices) = v["choices"].as_array_mut() {
        for (choice, from) in choices.iter_mut().zip(&c.choices) {
            let text = choice.as_object_mut().and_then(|o| o.remove("text")).unwrap_or(json!(""));
            let message = json!({"role": "assistant", "content": text});
            choice[if chunk { "delta" } else { "message" }] = message;
            choice["logprobs"] = from.logprobs.as_ref().map_or(serde_json::Value::Null, |l| chat_logprobs(l, top_n));
        }
    }
    v
}

/// Legacy `logprobs` as chat completions give them: `{"content": [{token, logprob, bytes,
/// top_logprobs: [{token, logprob, bytes}]}]}`, the alternatives likeliest first.
fn chat_logprobs(l: &Logprobs, top_n: usize) -> serde_json::Value {
    let entry = |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    let content: Vec<serde_json::Value> = (l.tokens.iter().zip(&l.token_logprobs).zip(&l.top_logprobs))
        .filter_map(|((token, lp), top)| {
            let mut top: Vec<(String, f32)> = top.as_ref().map(|t| t.0.clone()).unwrap_or_default();
            top.sort_by(|a, b| b.1.total_cmp(&a.1));
            top.truncate(top_n);
            let mut e = entry(token, (*lp)?);
            e["top_logprobs"] = top.iter().map(|(t, x)| entry(t, *x)).collect();
            Some(e)
        })
        .collect();
    json!({ "content": content })
}
