//! The wire format: request and response bodies of every endpoint. Completions follow OpenAI's
//! legacy completions API (so its clients work unchanged), plus picaso's fields for contexts.

use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

/// A prompt, or several: text, a list of texts, token ids, or a list of token-id lists (all
/// the forms OpenAI and vLLM accept; evaluation harnesses send a batch of token lists).
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Several texts: one choice each.
    Texts(Vec<String>),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids: one choice each.
    TokenLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// How many prompts (choices) this is.
    pub fn count(&self) -> usize {
        match self {
            Prompt::Text(_) | Prompt::Tokens(_) => 1,
            Prompt::Texts(v) => v.len(),
            Prompt::TokenLists(v) => v.len(),
        }
    }
}

/// A JSON list of token ids, or None when an item is not one.
fn token_ids(items: &[serde_json::Value]) -> Option<Vec<u32>> {
    items.iter().map(|i| i.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

impl TryFrom<serde_json::Value> for Prompt {
    type Error = String;

    /// Read by hand, so that a wrong form is told what the right ones are (serde's untagged
    /// enums say only that no variant matched).
    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        const FORMS: &str =
            "`prompt` must be a string, a list of strings, a list of token ids (integers), or a list of token-id lists";
        match v {
            Value::String(s) => Ok(Prompt::Text(s)),
            Value::Array(items) if items.iter().all(Value::is_string) && !items.is_empty() => {
                Ok(Prompt::Texts(items.into_iter().filter_map(|i| i.as_str().map(str::to_string)).collect()))
            }
            Value::Array(items) if items.iter().any(Value::is_array) => {
                let mut lists = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    match item.as_array().and_then(|l| token_ids(l)) {
                        Some(ids) => lists.push(ids),
                        None => {
                            return Err(format!(
                                "{FORMS}; prompt {i} of the list is not a list of token ids (every item must be one)"
                            ))
                        }
                    }
                }
                Ok(Prompt::TokenLists(lists))
            }
            Value::Array(items) => {
                token_ids(&items).map(Prompt::Tokens).ok_or_else(|| format!("{FORMS}; this list mixes other values in"))
            }
            other => Err(format!("{FORMS}, not {}", kind_of(&other))),
        }
    }
}

/// One or several stop strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

impl TryFrom<serde_json::Value> for Stop {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        match v {
            Value::String(s) => Ok(Stop::One(s)),
            Value::Array(items) if items.iter().all(Value::is_string) => {
                Ok(Stop::Many(items.into_iter().filter_map(|i| i.as_str().map(str::to_string)).collect()))
            }
            Value::Array(_) => Err("`stop` must be a string or a list of strings; this list holds other values".into()),
            other => Err(format!("`stop` must be a string or a list of strings, not {}", kind_of(&other))),
        }
    }
}

/// "a number", "an object", ... for error messages.
fn kind_of(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// The prompt, continued from the composed state of the contexts.
    pub prompt: Prompt,
    /// Most new tokens (OpenAI's default: 16, also for null, as in OpenAI's schema).
    #[serde(default = "default_max_tokens", deserialize_with = "null_is::<_, 16>")]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy (OpenAI's default: 1, also for null).
    #[serde(default = "one", deserialize_with = "null_is_one")]
    pub temperature: f32,
    /// Nucleus sampling mass (default 1, also for null).
    #[serde(default = "one", deserialize_with = "null_is_one")]
    pub top_p: f32,
    /// Seed of the sampler; without one, a fresh seed per request.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stream the text as server-sent events (null: false).
    #[serde(default, deserialize_with = "null_is_default")]
    pub stream: bool,
    /// Generate past the end-of-text token, up to `max_tokens` (as vLLM and llama.cpp's
    /// server allow; for benchmarks).
    #[serde(default, deserialize_with = "null_is_default")]
    pub ignore_eos: bool,
    /// picaso: use these contexts (ids, the last nearest the prompt).
    pub contexts: Option<Vec<i64>>,
    /// picaso: retrieve this many contexts by similarity to the prompt.
    pub retrieve: Option<usize>,
    /// picaso: how retrieval ranks contexts: dense (default), bm25 or hybrid.
    pub retriever: Option<String>,
    /// picaso: the dense ranking's weight in hybrid retrieval, 0 to 1 (default 0.5).
    pub hybrid_weight: Option<f32>,
    /// picaso: retrieve only from these documents' contexts (names, as `/v1/documents` lists).
    pub documents: Option<Vec<String>>,
    /// picaso: retrieve only contexts whose metadata holds these values (keys to strings,
    /// numbers, booleans or null).
    #[serde(default, deserialize_with = "filter_object")]
    pub filter: Option<picaso_store::Metadata>,
    /// picaso: how to combine the contexts: picaso-r (default), picaso-s, caso, soup, concat, naive.
    pub composition: Option<String>,
    /// Accepted for compatibility; the server has one model.
    pub model: Option<String>,
    /// Accepted for compatibility; ignored.
    pub user: Option<String>,
    /// Only 1 is supported (several prompts give several choices).
    pub n: Option<usize>,
    /// Only 1 is supported.
    pub best_of: Option<usize>,
    /// Prepend the prompt to the text (and its tokens to `logprobs`; null: false). With
    /// `max_tokens: 0`, scores the prompt without generating.
    #[serde(default, deserialize_with = "null_is_default")]
    pub echo: bool,
    /// Report each token's log-probability and this many likeliest alternatives per position
    /// (0 to 20; null: none).
    #[serde(default, deserialize_with = "logprobs_count")]
    pub logprobs: Option<usize>,
    /// Not supported (must be absent or null).
    pub suffix: Option<String>,
    /// Only 0 is supported.
    pub presence_penalty: Option<f32>,
    /// Only 0 is supported.
    pub frequency_penalty: Option<f32>,
    /// Not supported (must be absent or empty).
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Accepted for compatibility: usage is always sent in the last chunk of a stream.
    pub stream_options: Option<serde_json::Value>,
}

/// `logprobs`: null, or how many alternatives per position (an integer, as OpenAI's legacy
/// API takes it; chat's boolean form belongs to `/v1/chat/completions`).
fn logprobs_count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    match Option::<serde_json::Value>::deserialize(d)? {
        None => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "`logprobs` must be an integer from 0 to 20 (how many likeliest tokens to list at each position) or null, not {}",
                kind_of(&v)
            ))
        }),
    }
}

fn default_max_tokens() -> usize {
    16
}
fn one() -> f32 {
    1.0
}

/// A nullable field: null is its default (OpenAI's schema marks these fields nullable, and
/// clients and proxies send explicit nulls).
fn null_is_default<'de, D: serde::Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}
fn null_is<'de, D: serde::Deserializer<'de>, const N: usize>(d: D) -> Result<usize, D::Error> {
    Ok(Option::<usize>::deserialize(d)?.unwrap_or(N))
}
fn null_is_one<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f32, D::Error> {
    Ok(Option::<f32>::deserialize(d)?.unwrap_or(1.0))
}

/// A JSON object or null, for the field `name` (named in the error: serde's own says only "expected
/// a map").
fn object_named<'de, D: serde::Deserializer<'de>>(
    d: D,
    name: &str,
) -> Result<Option<picaso_store::Metadata>, D::Error> {
    match Option::<serde_json::Value>::deserialize(d)? {
        None => Ok(None),
        Some(serde_json::Value::Object(m)) => Ok(Some(m)),
        Some(other) => Err(serde::de::Error::custom(format!(
            "`{name}` must be a JSON object of keys and values (e.g. {{\"lang\": \"en\"}}), not {}",
            kind_of(&other)
        ))),
    }
}
fn filter_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<picaso_store::Metadata>, D::Error> {
    object_named(d, "filter")
}
fn metadata_object<'de, D: serde::Deserializer<'de>>(d: D) -> Result<picaso_store::Metadata, D::Error> {
    Ok(object_named(d, "metadata")?.unwrap_or_default())
}

/// A context used for a completion.
#[derive(Debug, Clone, Serialize)]
pub struct UsedContext {
    /// Context id.
    pub id: i64,
    /// Cosine similarity to the prompt, when retrieved.
    pub score: Option<f32>,
    /// Its document (null if the context was deleted meanwhile).
    pub doc: Option<String>,
    /// Its place in the document.
    pub segment: Option<u32>,
    /// Its metadata (title, URL, ...: what to cite it by).
    pub metadata: Option<picaso_store::Metadata>,
}

/// What picaso did for a completion (the `picaso` field of the response).
#[derive(Debug, Clone, Serialize)]
pub struct CompletionInfo {
    /// The composition method.
    pub composition: &'static str,
    /// The contexts, in composition order (the last nearest the prompt).
    pub contexts: Vec<UsedContext>,
    /// Context tokens the model processed: concat's, or those of states a budgeted store
    /// recomputed (composing stored states processes none).
    pub context_tokens: usize,
    /// States read from disk.
    pub states_loaded: usize,
    /// States served from the in-memory cache.
    pub cache_hits: usize,
    /// States recomputed from their tokens: a store with a state budget did not hold them
    /// (counted in `states_loaded` too).
    pub states_recomputed: usize,
    /// Milliseconds to retrieve the contexts.
    pub retrieve_ms: f64,
    /// Milliseconds to load the states.
    pub load_ms: f64,
    /// Milliseconds to compose them (for concat: to process the context tokens).
    pub compose_ms: f64,
    /// Prompt tokens whose state came from the prefix cache (not prefilled).
    pub cached_tokens: usize,
    /// Milliseconds from the request to the first generated text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub time_to_first_token_ms: Option<f64>,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
    /// Of the prompt tokens, those the prefix cache held (OpenAI's `cached_tokens`).
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`, as OpenAI reports it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens continued from a stored prefix's state instead of prefilled.
    pub cached_tokens: usize,
}

/// One choice: one per prompt.
#[derive(Debug, Clone, Serialize)]
pub struct Choice {
    /// The text (a piece of it when streaming).
    pub text: String,
    /// Which prompt this answers (its place in `prompt`).
    pub index: usize,
    /// Log-probabilities, when the request asked for them.
    pub logprobs: Option<Logprobs>,
    /// `length` or `stop`; null until the last chunk of a stream.
    pub finish_reason: Option<&'static str>,
    /// picaso's account of this prompt's contexts, when the request has several prompts (with
    /// one, it is the completion's `picaso`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picaso: Option<CompletionInfo>,
}

/// `choices[].logprobs`, as OpenAI's legacy completions API gives it: one entry per token of
/// the choice's text (the echoed prompt's first token has no log-probability).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Logprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability (natural log) given everything before it.
    pub token_logprobs: Vec<Option<f32>>,
    /// The likeliest tokens at each position (the chosen one included) and their
    /// log-probabilities.
    pub top_logprobs: Vec<Option<TopLogprobs>>,
    /// Where each token starts in the choice's text, in characters.
    pub text_offset: Vec<usize>,
}

/// A position's alternatives as OpenAI sends them: a JSON object from token text to
/// log-probability, likeliest first. The chosen token is always in it (OpenAI: "up to
/// logprobs + 1 elements"), so a harness can tell whether it was the likeliest. Two ids with the
/// same text keep the likelier entry (an object has one value per key).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobs(pub Vec<(String, f32)>);

impl Serialize for TopLogprobs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// A completion, or one chunk of a streamed one.
#[derive(Debug, Clone, Serialize)]
pub struct Completion {
    /// `cmpl-<n>`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// The model's name.
    pub model: String,
    /// One choice.
    pub choices: Vec<Choice>,
    /// Token counts (in the last chunk of a stream).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// picaso's account of the contexts (in the first and last chunks of a stream).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub picaso: Option<CompletionInfo>,
}

/// `POST /v1/contexts`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddContext {
    /// The text; it becomes one context.
    pub text: String,
    /// Source document name (default: `api/<hash of the text>`, so re-adding a text is a no-op).
    pub doc: Option<String>,
    /// Segment number within the document (default 0).
    #[serde(default)]
    pub segment: u32,
    /// Metadata the context carries (a JSON object: title, URL, ...; default none).
    #[serde(default, deserialize_with = "metadata_object")]
    pub metadata: picaso_store::Metadata,
}

/// Answer to `POST /v1/contexts`.
#[derive(Debug, Clone, Serialize)]
pub struct AddedContext {
    /// The context id.
    pub id: i64,
    /// Its document.
    pub doc: String,
    /// Its segment.
    pub segment: u32,
    /// Its tokens.
    pub n_tokens: usize,
    /// False when this (doc, segment) was already stored with the same text (its existing id
    /// is returned).
    pub created: bool,
    /// The context this one replaced: the (doc, segment) was stored with other text, or with
    /// this text but without its state file, and is gone now (its id answers 404 from here on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replaced: Option<i64>,
}

/// A listing's query (`GET /v1/contexts` by id, `GET /v1/documents` by name): the page after
/// a key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageQuery<K> {
    /// Items after this key (the previous page's `next_after`).
    pub after: Option<K>,
    /// Items per page (default 100, at most 1000).
    pub limit: Option<usize>,
}

/// `GET /v1/contexts`'s query: the page after an id, of every context or of those whose
/// metadata passes `filter` (a JSON object, URL-encoded, as in `/v1/search`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextsQuery {
    /// Contexts after this id (the previous page's `next_after`).
    pub after: Option<i64>,
    /// Contexts per page (default 100, at most 1000).
    pub limit: Option<usize>,
    /// A metadata filter, as JSON text.
    pub filter: Option<String>,
}

/// The query of `DELETE /v1/contexts`: the contexts to remove, by their metadata.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// A metadata filter, as JSON text (required: without one nothing is removed).
    pub filter: Option<String>,
}

/// A page of a listing.
#[derive(Debug, Clone, Serialize)]
pub struct Page<T, K> {
    /// Always "list".
    pub object: &'static str,
    /// The items: context records as `GET /v1/contexts/{id}` gives them, or documents (id,
    /// contexts, tokens).
    pub data: Vec<T>,
    /// Pass as `after` for the next page; `null` on the last one.
    pub next_after: Option<K>,
}

/// `POST /v1/documents`: a document, cut into contexts as the store's documents are.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddDocument {
    /// The document's id: sending the same id again with other text updates it.
    pub id: String,
    /// Its text (paragraphs separated by blank lines).
    pub text: String,
    /// Metadata every one of its contexts carries (a JSON object: title, URL, ...; default
    /// none). Sent again with other metadata and the same text, the contexts keep their ids
    /// and take the new metadata.
    #[serde(default, deserialize_with = "metadata_object")]
    pub metadata: picaso_store::Metadata,
}

/// One context of a document, in answers about documents.
#[derive(Debug, Clone, Serialize)]
pub struct DocumentContext {
    /// The context id.
    pub id: i64,
    /// Its segment.
    pub segment: u32,
    /// Its tokens.
    pub n_tokens: usize,
}

/// Answer to `POST /v1/documents`: what the request changed and the document's contexts now.
#[derive(Debug, Clone, Serialize)]
pub struct AddedDocument {
    /// The document's id.
    pub id: String,
    /// How the store cuts documents (`paragraph`, `tokens:N`, `halves:N`).
    pub segmentation: String,
    /// Contexts added for segments the store lacked.
    pub added: usize,
    /// Contexts that replaced a segment whose text changed (the old ids are gone).
    pub replaced: usize,
    /// Contexts that replaced a segment with the same text whose state object was missing
    /// (the old ids are gone).
    pub repaired: usize,
    /// Segments the document no longer has, removed.
    pub removed: usize,
    /// Segments stored already with the same text.
    pub skipped: usize,
    /// Of `skipped`, those that took the document's new metadata.
    pub relabelled: usize,
    /// Tokens processed.
    pub tokens: usize,
    /// The document's contexts, in segment order.
    pub contexts: Vec<DocumentContext>,
}

/// Answer to `GET /v1/documents/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct DocumentRecords {
    /// The document's id.
    pub id: String,
    /// Its contexts' records in segment order, as `GET /v1/contexts/{id}` gives them.
    pub contexts: Vec<picaso_store::ContextRecord>,
}

/// `POST /v1/search`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    /// Text to find contexts for.
    pub query: String,
    /// How many (default 5).
    #[serde(default = "default_k")]
    pub k: usize,
    /// How contexts are ranked: dense (default), bm25 or hybrid.
    pub retriever: Option<String>,
    /// The dense ranking's weight in hybrid retrieval, 0 to 1 (default 0.5).
    pub hybrid_weight: Option<f32>,
    /// Only these documents' contexts (names, as `/v1/documents` lists).
    pub documents: Option<Vec<String>>,
    /// Only contexts whose metadata holds these values.
    #[serde(default, deserialize_with = "filter_object")]
    pub filter: Option<picaso_store::Metadata>,
}

fn default_k() -> usize {
    5
}

/// One search hit.
#[derive(Debug, Clone, Serialize)]
pub struct SearchHit {
    /// Context id.
    pub id: i64,
    /// Cosine similarity.
    pub score: f32,
    /// Source document.
    pub doc: String,
    /// The context's place in its document (`seg` in a full context record).
    pub segment: u32,
    /// The context's text.
    pub text: String,
    /// The context's metadata.
    pub metadata: picaso_store::Metadata,
}

/// Answer to `POST /v1/search`.
#[derive(Debug, Clone, Serialize)]
pub struct SearchResponse {
    /// Hits, best first.
    pub results: Vec<SearchHit>,
}

/// `POST /v1/attribute`: which of the contexts does an answer owe most to?
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttributeRequest {
    /// The prompt the answer continues.
    pub prompt: String,
    /// The answer to attribute (for instance a completion's text).
    pub answer: String,
    /// Use these contexts (ids, the last nearest the prompt).
    pub contexts: Option<Vec<i64>>,
    /// Retrieve this many contexts by similarity to the prompt (as a completion with
    /// `retrieve` does).
    pub retrieve: Option<usize>,
    /// How retrieval ranks contexts: dense (default), bm25 or hybrid.
    pub retriever: Option<String>,
    /// The dense ranking's weight in hybrid retrieval, 0 to 1 (default 0.5).
    pub hybrid_weight: Option<f32>,
    /// Retrieve only from these documents' contexts (names, as `/v1/documents` lists).
    pub documents: Option<Vec<String>>,
    /// Retrieve only contexts whose metadata holds these values.
    #[serde(default, deserialize_with = "filter_object")]
    pub filter: Option<picaso_store::Metadata>,
    /// How to combine them: picaso-r (default), picaso-s, caso, soup or concat.
    pub composition: Option<String>,
}

/// One context's share of an answer.
#[derive(Debug, Clone, Serialize)]
pub struct AttributedContext {
    /// Context id.
    pub id: i64,
    /// Cosine similarity to the prompt, when retrieved.
    pub score: Option<f32>,
    /// The answer's log-likelihood with this context left out (nats).
    pub loglik_without: f64,
    /// What the answer loses without it: `loglik` − `loglik_without` (nats; negative when the
    /// answer is likelier without it).
    pub drop: f64,
}

/// Answer to `POST /v1/attribute`.
#[derive(Debug, Clone, Serialize)]
pub struct AttributeResponse {
    /// The composition method.
    pub composition: &'static str,
    /// Tokens in the answer.
    pub answer_tokens: usize,
    /// The answer's log-likelihood after the prompt with every context (nats, summed).
    pub loglik: f64,
    /// The contexts in composition order (the last nearest the prompt).
    pub contexts: Vec<AttributedContext>,
    /// Context ids, the one the answer owes most to first.
    pub ranking: Vec<i64>,
    /// Milliseconds to retrieve the contexts.
    pub retrieve_ms: f64,
    /// Milliseconds for the k + 1 states and scorings.
    pub attribute_ms: f64,
}

/// `POST /tokenize` (vLLM's shape): text, or chat messages rendered with the chat template, to
/// token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeRequest {
    /// The text to tokenize.
    pub prompt: Option<String>,
    /// Or chat messages, rendered with the model's chat template first.
    pub messages: Option<Vec<serde_json::Value>>,
    /// With `messages`: end the rendering with the assistant's turn opening (default true).
    pub add_generation_prompt: Option<bool>,
    /// Accepted for compatibility: picaso's models use no BOS token, so there is nothing to add.
    pub add_special_tokens: Option<bool>,
    /// Also give each token's text.
    #[serde(default, deserialize_with = "null_is_default")]
    pub return_token_strs: bool,
    /// Accepted for compatibility; the server has one model.
    pub model: Option<String>,
}

/// Answer to `POST /tokenize`.
#[derive(Debug, Clone, Serialize)]
pub struct Tokenized {
    /// How many tokens.
    pub count: usize,
    /// Most prompt tokens a request may have on this server.
    pub max_model_len: usize,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Each token's text, when asked for.
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize` (vLLM's shape).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeRequest {
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Accepted for compatibility; the server has one model.
    pub model: Option<String>,
}

/// `POST /v1/chat/completions`: OpenAI's chat completions, the messages rendered into a prompt
/// by the model's chat template, plus picaso's fields for contexts.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    /// The conversation: objects with `role` and `content` (text, or a list of text parts).
    pub messages: Vec<serde_json::Value>,
    /// Most new tokens (default: the server's limit).
    pub max_tokens: Option<usize>,
    /// The same as `max_tokens` (OpenAI's newer name); give one of them.
    pub max_completion_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy (default 1, also for null).
    #[serde(default = "one", deserialize_with = "null_is_one")]
    pub temperature: f32,
    /// Nucleus sampling mass (default 1, also for null).
    #[serde(default = "one", deserialize_with = "null_is_one")]
    pub top_p: f32,
    /// Seed of the sampler.
    pub seed: Option<u64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stream the answer as server-sent events (null: false).
    #[serde(default, deserialize_with = "null_is_default")]
    pub stream: bool,
    /// Accepted for compatibility: usage is always sent in the last chunk of a stream.
    pub stream_options: Option<serde_json::Value>,
    /// Generate past the end-of-text token.
    #[serde(default, deserialize_with = "null_is_default")]
    pub ignore_eos: bool,
    /// Only 1 is supported.
    pub n: Option<usize>,
    /// Report each generated token's log-probability (`choices[].logprobs.content`).
    pub logprobs: Option<bool>,
    /// With `logprobs`: how many likeliest alternatives to list per token (0 to 20).
    pub top_logprobs: Option<usize>,
    /// Only 0 is supported.
    pub presence_penalty: Option<f32>,
    /// Only 0 is supported.
    pub frequency_penalty: Option<f32>,
    /// Not supported (must be absent or empty).
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    /// Not supported (must be absent or empty): the server runs no tools.
    pub tools: Option<Vec<serde_json::Value>>,
    /// Accepted for compatibility; ignored.
    pub user: Option<String>,
    /// Accepted for compatibility; the server has one model.
    pub model: Option<String>,
    /// A Jinja chat template to use instead of the model's (required when the model has none).
    pub chat_template: Option<String>,
    /// End the rendering with the assistant's turn opening (default true).
    pub add_generation_prompt: Option<bool>,
    /// More variables for the template (as transformers' `apply_chat_template` takes them).
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// picaso: use these contexts (ids, the last nearest the prompt).
    pub contexts: Option<Vec<i64>>,
    /// picaso: retrieve this many contexts by similarity to the last user message.
    pub retrieve: Option<usize>,
    /// picaso: how retrieval ranks contexts: dense (default), bm25 or hybrid.
    pub retriever: Option<String>,
    /// picaso: the dense ranking's weight in hybrid retrieval, 0 to 1 (default 0.5).
    pub hybrid_weight: Option<f32>,
    /// picaso: retrieve only from these documents' contexts.
    pub documents: Option<Vec<String>>,
    /// picaso: retrieve only contexts whose metadata holds these values.
    #[serde(default, deserialize_with = "filter_object")]
    pub filter: Option<picaso_store::Metadata>,
    /// picaso: how to combine the contexts: picaso-r (default), picaso-s, caso, soup, concat, naive.
    pub composition: Option<String>,
}
