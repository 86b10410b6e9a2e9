//! Chat templates: the Jinja template a model ships in `tokenizer_config.json` (`chat_template`)
//! turns a conversation into the prompt text the model was tuned on. Rendered with minijinja,
//! set up as transformers sets up Jinja for `apply_chat_template` (blocks trimmed and
//! left-stripped, `raise_exception`, Python's string and dict methods), so a template renders
//! here as it does there.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::api::{ChatRequest, CompletionRequest, Prompt};
use crate::error::ApiError;
use crate::render::{Budget, Sandbox};

/// A chat template and the special tokens it may name.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// A token in `tokenizer_config.json`: a string, or an object with its `content`.
fn token_of(config: &Value, key: &str) -> Option<String> {
    match &config[key] {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// A template from its source and the special tokens; checked by compiling it.
    pub fn new(source: String, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, String> {
        crate::render::compile(&source).map_err(|e| e.to_string())?;
        Ok(Self { source, bos_token, eos_token })
    }

    /// The template of `tokenizer_config.json`'s contents: its `chat_template`, a string or a
    /// list of named templates (the one named `default`). None when it has none.
    pub fn from_tokenizer_config(config: &Value) -> Result<Option<Self>, String> {
        let source = match &config["chat_template"] {
            Value::String(s) => s.clone(),
            Value::Array(named) => match named.iter().find(|t| t["name"] == "default").or(named.first()) {
                Some(t) => t["template"].as_str().ok_or("a named chat template without `template` text")?.to_string(),
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        Self::new(source, token_of(config, "bos_token"), token_of(config, "eos_token")).map(Some)
    }

    /// The template to serve: `file` when given (a `tokenizer_config.json`, or a Jinja template
    /// as is), else the model folder's `tokenizer_config.json`, if it has one with a template.
    pub fn load(model_dir: &Path, file: Option<&Path>) -> Result<Option<Self>, String> {
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
        let in_model = model_dir.join("tokenizer_config.json");
        let config: Option<Value> = match file {
            Some(file) => {
                let text = read(file)?;
                match serde_json::from_str::<Value>(&text) {
                    Ok(v @ Value::Object(_)) => Some(v),
                    // A template file: the model's tokens still come from its own config.
                    _ => {
                        let tokens = if in_model.is_file() {
                            serde_json::from_str(&read(&in_model)?).unwrap_or(Value::Null)
                        } else {
                            Value::Null
                        };
                        let t = Self::new(text, token_of(&tokens, "bos_token"), token_of(&tokens, "eos_token"));
                        return t.map(Some).map_err(|e| format!("{}: {e}", file.display()));
                    }
                }
            }
            None if in_model.is_file() => Some(
                serde_json::from_str(&read(&in_model)?)
                    .map_err(|e| format!("{} is not JSON: {e}", in_model.display()))?,
            ),
            None => None,
        };
        let Some(config) = config else { return Ok(None) };
        let from = file.unwrap_or(&in_model);
        match Self::from_tokenizer_config(&config) {
            Ok(None) if file.is_some() => Err(format!("{} has no `chat_template`", from.display())),
            other => other.map_err(|e| format!("{}: {e}", from.display())),
        }
    }

    /// The template's source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The end-of-text token the template names, if its config gives one.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages` (checked by [`check_messages`]) into prompt text, in this process
    /// within the render budget. A template that refuses the conversation (`raise_exception`,
    /// say roles that do not alternate) or runs over its budget is the client's 400.
    pub fn render(
        &self,
        messages: &[Value],
        add_generation_prompt: bool,
        extra: Option<&Map<String, Value>>,
    ) -> Result<String, ApiError> {
        let context = context(messages, add_generation_prompt, extra, Some(self));
        Ok(crate::render::render(&self.source, &context, Budget::default())?)
    }
}

/// A template's variables: `extra` (`chat_template_kwargs`), the messages, whether to add the generation prompt, and the
/// special tokens of `tokens` (empty without).
fn context(
    messages: &[Value],
    add_generation_prompt: bool,
    extra: Option<&Map<String, Value>>,
    tokens: Option<&ChatTemplate>,
) -> Value {
    let mut context = extra.cloned().unwrap_or_default();
    context.insert("messages".into(), Value::Array(messages.to_vec()));
    context.insert("add_generation_prompt".into(), json!(add_generation_prompt));
    context.insert("bos_token".into(), json!(tokens.and_then(|t| t.bos_token.clone()).unwrap_or_default()));
    context.insert("eos_token".into(), json!(tokens.and_then(|t| t.eos_token.clone()).unwrap_or_default()));
    Value::Object(context)
}

/// Checks the conversation and puts each message's content in the form templates expect: text.
/// A content that is a list of text parts (OpenAI's other form) becomes their text joined;
/// other parts (images, audio) are refused, as is a message without a `role`.
pub fn check_messages(messages: &[Value]) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request("`messages` is empty; give at least one message (role and content)"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::bad_request(format!(
                "messages[{i}] must be an object with `role` and `content` (e.g. {{\"role\": \"user\", \"content\": \"Hi\"}})"
            )));
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::bad_request(format!(
                "messages[{i}] has no `role` string (system, user, assistant, ...)"
            )));
        }
        let mut obj = obj.clone();
        match obj.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part["type"].as_str(), part["text"].as_str()) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}] is not a text part ({{\"type\": \"text\", \"text\": ...}}); this server takes text only"
                            )))
                        }
                    }
                }
                obj.insert("content".into(), Value::String(text));
            }
            Some(_) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or a list of text parts"
                )))
            }
        }
        out.push(Value::Object(obj));
    }
    Ok(out)
}

/// The text retrieval looks for when a chat completion retrieves contexts: the last user
/// message (the rendered template would match every context on its markup).
pub fn retrieval_query(messages: &[Value]) -> Option<String> {
    messages.iter().rev().find(|m| m["role"] == "user").and_then(|m| m["content"].as_str()).map(str::to_string)
}

/// Byte offsets in `prompt` (the conversation rendered) where the first message ends, when
/// more follow: the state there is what other conversations with the same system prompt share.
/// (A conversation's next turn starts with this whole prompt, whose end is stored anyway; each
/// further cut costs the prefill another pass over the weights.) `first` is the first message
/// rendered alone, without a generation prompt; it must be a prefix of `prompt`: a template that
/// renders it otherwise (or refused it) gives no offset.
fn message_ends(first: Option<&str>, prompt: &str) -> Vec<usize> {
    first
        .filter(|r| !r.is_empty() && r.len() < prompt.len() && prompt.starts_with(r))
        .map(|r| vec![r.len()])
        .unwrap_or_default()
}

/// Renders a conversation and, when more than one message, its first message alone (for
/// [`message_ends`]): with the request's own template in `sandbox` (a child process), or with
/// the server's `template` on a blocking thread, so the async threads (`/health`, streams)
/// never wait on a render. Returns the prompt and the first message's rendering, if any.
async fn render_conversation(
    request_template: Option<String>,
    template: Option<&ChatTemplate>,
    sandbox: Option<&Sandbox>,
    messages: Vec<Value>,
    add_generation_prompt: bool,
    extra: Option<Map<String, Value>>,
) -> Result<(String, Option<String>), ApiError> {
    let first = (messages.len() > 1).then(|| messages[..1].to_vec());
    if let Some(source) = request_template {
        let Some(sandbox) = sandbox else {
            return Err(ApiError::bad_request(
                "this server does not render chat templates sent with a request (`chat_template`): drop the field to                  use the model's template, or start the server with --trust-request-chat-template",
            ));
        };
        // The model's special tokens, under the request's template.
        let mut contexts = vec![context(&messages, add_generation_prompt, extra.as_ref(), template)];
        contexts.extend(first.map(|m| context(&m, false, extra.as_ref(), template)));
        let mut rendered = sandbox.render(&source, contexts, Budget::default()).await?.into_iter();
        let prompt = rendered.next().ok_or_else(|| ApiError::internal("the sandbox rendered nothing"))??;
        return Ok((prompt, rendered.next().and_then(Result::ok)));
    }
    let Some(template) = template.cloned() else {
        return Err(ApiError::bad_request(
            "this model has no chat template (no `chat_template` in its tokenizer_config.json): start the server              with --chat-template FILE, or use POST /v1/completions with the prompt written out",
        ));
    };
    tokio::task::spawn_blocking(move || {
        let prompt = template.render(&messages, add_generation_prompt, extra.as_ref())?;
        let first = first.and_then(|m| template.render(&m, false, extra.as_ref()).ok());
        Ok((prompt, first))
    })
    .await
    .map_err(|e| ApiError::internal(format!("the chat template's render failed: {e}")))?
}

/// What a chat request adds to the completion it becomes.
#[derive(Debug, Clone, Default)]
pub(crate) struct FromChat {
    /// What retrieval embeds instead of the prompt (the last user message, not the rendered
    /// template).
    pub query: Option<String>,
    /// Byte offsets in the rendered prompt where messages end: the prefix cache keeps the
    /// states there (a conversation's next turn, or agents sharing a system prompt, start
    /// from them).
    pub boundaries: Vec<usize>,
}

/// A chat request as the completion it asks for: its messages rendered with the server's
/// template (`template`) or, when the server runs request templates (`sandbox`), the request's
/// own, its options carried over. Returns it with the text retrieval embeds and where messages
/// end.
pub(crate) async fn to_completion(
    req: ChatRequest,
    template: Option<&ChatTemplate>,
    sandbox: Option<&Sandbox>,
    default_max_tokens: usize,
) -> Result<(CompletionRequest, FromChat), ApiError> {
    let unsupported = |what: &str| Err(ApiError::bad_request(format!("{what} is not supported by picaso")));
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (Some(true), Some(n)) if n > crate::logprobs::MAX_TOP_LOGPROBS => {
            return Err(ApiError::bad_request(format!(
                "`top_logprobs` is {n}; give 0 to {}",
                crate::logprobs::MAX_TOP_LOGPROBS
            )));
        }
        (Some(true), n) => Some(n.unwrap_or(0)),
        (_, Some(n)) if n > 0 => {
            return Err(ApiError::bad_request("`top_logprobs` needs `logprobs: true`"));
        }
        _ => None,
    };
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return unsupported("`tools`");
    }
    let max_tokens = match (req.max_tokens, req.max_completion_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::bad_request(format!(
                "`max_tokens` ({a}) and `max_completion_tokens` ({b}) differ; give one of them"
            )))
        }
        (a, b) => a.or(b).unwrap_or(default_max_tokens),
    };
    let messages = check_messages(&req.messages)?;
    let query = retrieval_query(&messages);
    let (prompt, first) = render_conversation(
        req.chat_template.clone(),
        template,
        sandbox,
        messages,
        req.add_generation_prompt.unwrap_or(true),
        req.chat_template_kwargs.clone(),
    )
    .await?;
    let boundaries = message_ends(first.as_deref(), &prompt);
    let completion = CompletionRequest {
        prompt: Prompt::Text(prompt),
        max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        seed: req.seed,
        stop: req.stop,
        stream: req.stream,
        ignore_eos: req.ignore_eos,
        contexts: req.contexts,
        retrieve: req.retrieve,
        retriever: req.retriever,
        hybrid_weight: req.hybrid_weight,
        documents: req.documents,
        filter: req.filter,
        composition: req.composition,
        model: req.model,
        user: req.user,
        n: req.n,
        best_of: None,
        echo: false,
        logprobs,
        suffix: None,
        presence_penalty: req.presence_penalty,
        frequency_penalty: req.frequency_penalty,
        logit_bias: req.logit_bias,
        stream_options: req.stream_options,
    };
    Ok((completion, FromChat { query, boundaries }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'].strip() + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    /// A ChatML template renders as transformers renders it (Python's `.strip()` included), with
    /// and without the generation prompt.
    #[test]
    fn a_chatml_template_renders_as_transformers_does() {
        let t = ChatTemplate::new(CHATML.into(), None, Some("<|im_end|>".into())).unwrap();
        let messages = check_messages(&[
            json!({"role": "system", "content": " Be brief. "}),
            json!({"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}),
        ])
        .unwrap();
        assert_eq!(
            t.render(&messages, true, None).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(!t.render(&messages, false, None).unwrap().ends_with("assistant\n"));
    }

    /// A template's `raise_exception` is the client's 400 with its message; bad messages are
    /// refused before rendering; a template that does not compile is refused at load.
    #[test]
    fn refusals_are_clear() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}".into(), None, None).unwrap();
        let e = t.render(&[json!({"role": "user", "content": "x"})], true, None).unwrap_err();
        assert!(e.message.contains("roles must alternate"), "{}", e.message);
        assert!(check_messages(&[]).is_err());
        assert!(check_messages(&[json!({"content": "x"})]).unwrap_err().message.contains("role"));
        let image = json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        assert!(check_messages(&[image]).unwrap_err().message.contains("text only"));
        assert!(ChatTemplate::new("{% for %}".into(), None, None).is_err());
    }

    /// What instruct models' templates use besides: namespaces, loop controls, `tojson`, and
    /// variables passed through `chat_template_kwargs`.
    #[test]
    fn common_template_constructs_render() {
        let source = "{%- set ns = namespace(n=0) -%}{%- for m in messages -%}{%- if m.role == 'system' %}{% continue %}{% endif -%}\
                      {%- set ns.n = ns.n + 1 -%}{%- endfor -%}{{ ns.n }} {{ messages[0] | tojson }} {{ thinking }}";
        let t = ChatTemplate::new(source.into(), None, None).unwrap();
        let messages = [json!({"role": "system", "content": "s"}), json!({"role": "user", "content": "u"})];
        let extra = json!({"thinking": true});
        let out = t.render(&messages, true, extra.as_object()).unwrap();
        // Booleans print as Python's Jinja prints them.
        assert_eq!(out, "1 {\"content\":\"s\",\"role\":\"system\"} True");
    }

    /// A tokenizer config's template, plain or named, with its tokens as strings or objects.
    #[test]
    fn templates_are_found_in_tokenizer_configs() {
        let plain =
            json!({"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}", "bos_token": {"content": "<s>"}});
        let t = ChatTemplate::from_tokenizer_config(&plain).unwrap().unwrap();
        assert_eq!(t.render(&[json!({"role": "user", "content": "x"})], true, None).unwrap(), "<s>x");
        let named =
            json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]});
        assert_eq!(ChatTemplate::from_tokenizer_config(&named).unwrap().unwrap().source(), "D");
        assert!(ChatTemplate::from_tokenizer_config(&json!({})).unwrap().is_none());
    }
}
