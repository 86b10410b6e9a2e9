//! The prefix cache end to end (issue 82): a server that continues from stored prompt
//! prefixes answers as one that prefills every prompt whole (`--prefix-cache-mb 0`), for the
//! bundled Mamba-2 and hybrid models; conversations and shared system prompts hit it, and
//! `usage.prompt_tokens_details.cached_tokens` says how much; compositions never share a
//! prefix with other contexts or none; prompt log-probabilities are never taken from it; and
//! it stays within its budget.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod common;
use common::{ok_s, shared, write_docs, Server, TestDb};

fn bundled(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(name)
}

/// A store of the test documents for `model` (ids 1 to 4), in `tmp`.
fn store(tmp: &Path, model: &Path, embedder: &Path) -> String {
    let docs = tmp.join("docs");
    write_docs(&docs);
    let db = tmp.join("db").to_str().unwrap().to_string();
    let testdb = TestDb { db: db.clone(), states: None };
    let (m, e) = (model.to_str().unwrap(), embedder.to_str().unwrap());
    ok_s(&common::args(&["ingest"], &testdb, &["--model", m, "--embedder", e, "--text-dir", docs.to_str().unwrap()]));
    db
}

/// A copy of the store `db` (each server is its store's one writer).
fn copy_of(db: &str) -> String {
    let to = format!("{db}-copy");
    let status = std::process::Command::new("cp").args(["-r", db, &to]).status().unwrap();
    assert!(status.success());
    to
}

fn serve(db: &str, model: &Path, embedder: &Path, more: &[&str]) -> Server {
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tokenizer_config.json");
    let mut args = vec![
        "--db",
        db,
        "--model",
        model.to_str().unwrap(),
        "--embedder",
        embedder.to_str().unwrap(),
        "--chat-template",
        template.to_str().unwrap(),
    ];
    args.extend_from_slice(more);
    Server::start(&args)
}

fn post(server: &Server, path: &str, body: &Value) -> Value {
    let (status, v) = server.call_json("POST", path, Some(body.clone()));
    assert_eq!(status, 200, "{body} → {v}");
    v
}

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or_else(|| panic!("no cached_tokens: {v}"))
}

/// The generated tokens' log-probabilities of a chat answer.
fn chat_logprobs(v: &Value) -> Vec<f64> {
    v["choices"][0]["logprobs"]["content"].as_array().unwrap().iter().map(|t| t["logprob"].as_f64().unwrap()).collect()
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(worst < 1e-3, "{what}: log-probs differ by {worst}: {a:?} vs {b:?}");
}

const SYSTEM: &str = "You are a careful assistant. Answer in one short sentence, and say where the answer comes from.";

fn answers_as_a_cold_run(model_name: &str) {
    let Some(embedder) = shared("all-MiniLM-L6-v2") else { return };
    let model = bundled(model_name);
    let tmp = tempfile::tempdir().unwrap();
    let db = store(tmp.path(), &model, &embedder);
    let warm = serve(&db, &model, &embedder, &[]);
    let cold = serve(&copy_of(&db), &model, &embedder, &["--prefix-cache-mb", "0"]);

    // A conversation of four turns, each answer sent back as the next turn's history.
    let questions = ["Where is the Eiffel Tower?", "When was it finished?", "What is Mamba?", "Tell me about cats."];
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    let mut prompt_tokens = 0;
    for (turn, q) in questions.iter().enumerate() {
        messages.push(json!({"role": "user", "content": q}));
        let body =
            json!({"messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
        let (w, c) = (post(&warm, "/v1/chat/completions", &body), post(&cold, "/v1/chat/completions", &body));
        let content = w["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        assert_eq!(content, c["choices"][0]["message"]["content"].as_str().unwrap(), "{model_name} turn {turn}");
        close(&chat_logprobs(&w), &chat_logprobs(&c), &format!("{model_name} turn {turn}"));
        assert_eq!(cached(&c), 0, "the cold server stores nothing");
        assert_eq!(w["usage"]["prompt_tokens"], c["usage"]["prompt_tokens"]);
        if turn > 0 {
            // At least the previous prompt (its end was stored) is not prefilled again.
            assert!(cached(&w) >= prompt_tokens, "{model_name} turn {turn}: {} < {prompt_tokens}: {w}", cached(&w));
            assert_eq!(w["picaso"]["cached_tokens"].as_u64(), Some(cached(&w)));
        }
        prompt_tokens = w["usage"]["prompt_tokens"].as_u64().unwrap();
        messages.push(json!({"role": "assistant", "content": content}));
    }
    assert!(warm.metric("picaso_prefix_cache_hits_total") >= 3.0);
    assert!(warm.metric("picaso_prefix_cache_tokens_saved_total") > 0.0);
    assert!(warm.metric("picaso_prefix_cache_bytes") > 0.0);
    assert_eq!(cold.metric("picaso_prefix_cache_bytes"), 0.0);

    // Another agent with the same system prompt: the system message's state is shared.
    let agent = json!({"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is Paris in France?"}],
        "max_tokens": 8, "temperature": 0});
    let (w, c) = (post(&warm, "/v1/chat/completions", &agent), post(&cold, "/v1/chat/completions", &agent));
    assert_eq!(w["choices"][0]["message"], c["choices"][0]["message"]);
    assert!(cached(&w) > 10, "the system prompt is cached: {w}");

    // Completions: the same prompt again is a hit of all of it (its logits were kept), a
    // longer one continues from it; both answer as cold.
    let prompt = "The Eiffel Tower is in Paris. It was finished in";
    for p in [prompt.to_string(), format!("{prompt} 1889, and")] {
        let body = json!({"prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 3});
        let (w, c) = (post(&warm, "/v1/completions", &body), post(&cold, "/v1/completions", &body));
        assert_eq!(w["choices"][0]["text"], c["choices"][0]["text"], "{p}");
        let lps = |v: &Value| -> Vec<f64> {
            v["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        close(&lps(&w), &lps(&c), &p);
    }
    let again = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    let w = post(&warm, "/v1/completions", &again);
    assert_eq!(Some(cached(&w)), w["usage"]["prompt_tokens"].as_u64(), "a whole-prompt hit: {w}");

    // Echo with log-probabilities needs every prompt position: never from the cache, and the
    // prompt's log-probabilities are the cold server's.
    let echo = json!({"prompt": format!("{prompt} 1889, and"), "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 1});
    let (w, c) = (post(&warm, "/v1/completions", &echo), post(&cold, "/v1/completions", &echo));
    assert_eq!(cached(&w), 0, "{w}");
    let lps = |v: &Value| -> Vec<f64> {
        v["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().iter().filter_map(Value::as_f64).collect()
    };
    close(&lps(&w), &lps(&c), "echo");
    assert_eq!(w["choices"][0]["text"], c["choices"][0]["text"]);
}

#[test]
fn a_cached_prefix_answers_as_a_cold_run_mamba2() {
    answers_as_a_cold_run("picaso-mamba2");
}

#[test]
fn a_cached_prefix_answers_as_a_cold_run_hybrid() {
    answers_as_a_cold_run("picaso-hybrid");
}

/// A prompt's prefix is keyed on the contexts composed before it: the same tokens after other
/// contexts (or none, or another method) share nothing; removing a context drops the prefixes
/// composed from it.
#[test]
fn compositions_key_their_prefixes_and_removed_contexts_leave() {
    let Some(embedder) = shared("all-MiniLM-L6-v2") else { return };
    let model = bundled("picaso-mamba2");
    let tmp = tempfile::tempdir().unwrap();
    let db = store(tmp.path(), &model, &embedder);
    let warm = serve(&db, &model, &embedder, &[]);
    let cold = serve(&copy_of(&db), &model, &embedder, &["--prefix-cache-mb", "0"]);
    let prompt = "Tell me where the tower stands and when it was finished.";
    let ask = |contexts: Value, composition: &str| json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "contexts": contexts, "composition": composition});
    let first = post(&warm, "/v1/completions", &ask(json!([2, 3]), "picaso-r"));
    assert_eq!(cached(&first), 0);
    for (contexts, composition) in [(json!([3, 2]), "picaso-r"), (json!([2, 3]), "soup"), (json!([2]), "picaso-r")] {
        let v = post(&warm, "/v1/completions", &ask(contexts.clone(), composition));
        assert_eq!(cached(&v), 0, "{contexts} {composition}: {v}");
        let c = post(&cold, "/v1/completions", &ask(contexts, composition));
        assert_eq!(v["choices"][0]["text"], c["choices"][0]["text"]);
    }
    let plain = post(&warm, "/v1/completions", &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0}));
    assert_eq!(cached(&plain), 0, "no contexts is another origin: {plain}");
    let again = post(&warm, "/v1/completions", &ask(json!([2, 3]), "picaso-r"));
    assert!(cached(&again) > 0, "{again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    let c = post(&cold, "/v1/completions", &ask(json!([2, 3]), "picaso-r"));
    assert_eq!(again["choices"][0]["text"], c["choices"][0]["text"]);

    let entries = warm.metric("picaso_prefix_cache_entries");
    let (status, _) = warm.call("DELETE", "/v1/contexts/3", None);
    assert_eq!(status, 200);
    // The three compositions with context 3 are gone; those without it stay.
    assert_eq!(warm.metric("picaso_prefix_cache_entries"), entries - 3.0);
    let v = post(&warm, "/v1/completions", &ask(json!([2]), "picaso-r"));
    assert!(cached(&v) > 0, "{v}");
}

/// Many distinct prompts through a small budget: bytes held never pass it, the least recently
/// used go, and a hybrid's keys and values count (its long prompts cost more).
#[test]
fn the_cache_stays_within_its_budget() {
    let Some(embedder) = shared("all-MiniLM-L6-v2") else { return };
    for (name, budget_mb) in [("picaso-mamba2", 8.0), ("picaso-hybrid", 4.0)] {
        let model = bundled(name);
        let tmp = tempfile::tempdir().unwrap();
        let db = store(tmp.path(), &model, &embedder);
        let server = serve(&db, &model, &embedder, &["--prefix-cache-mb", &format!("{budget_mb}")]);
        let mut peak: f64 = 0.0;
        for i in 0..12 {
            let long =
                "The tower was painted again that year, and the city argued about its colour. ".repeat(4 * i + 1);
            let body = json!({"prompt": format!("{i}: {long}"), "max_tokens": 2, "temperature": 0});
            post(&server, "/v1/completions", &body);
            peak = peak.max(server.metric("picaso_prefix_cache_bytes"));
        }
        assert!(peak <= budget_mb * 1048576.0, "{name}: {peak} bytes held");
        assert!(peak > 0.0, "{name}");
        assert!(server.metric("picaso_prefix_cache_evictions_total") > 0.0, "{name}: nothing evicted");
    }
}

/// Agents that send the same long system prompt at the same moment prefill it once: the first
/// stores it, the others wait for it and continue from it; each answers as a cold server does.
#[test]
fn agents_arriving_together_prefill_a_shared_system_prompt_once() {
    let Some(embedder) = shared("all-MiniLM-L6-v2") else { return };
    let model = bundled("picaso-mamba2");
    let tmp = tempfile::tempdir().unwrap();
    let db = store(tmp.path(), &model, &embedder);
    let warm = serve(&db, &model, &embedder, &[]);
    let cold = serve(&copy_of(&db), &model, &embedder, &["--prefix-cache-mb", "0"]);
    let system = "You are one of several agents working on a shared plan. Read the plan carefully. ".repeat(40);
    let (_, n) =
        warm.call_json("POST", "/tokenize", Some(json!({"prompt": format!("<|system|>\n{}\n", system.trim())})));
    let system_tokens = n["count"].as_u64().unwrap();
    let body = |i: usize| {
        json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("Agent {i}: what is your next step?")}],
            "max_tokens": 6, "temperature": 0})
    };
    let agents = 8;
    let answers: Vec<Value> = std::thread::scope(|scope| {
        let warm = &warm;
        let handles: Vec<_> =
            (0..agents).map(|i| scope.spawn(move || post(warm, "/v1/chat/completions", &body(i)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let prompt: u64 = answers.iter().map(|v| v["usage"]["prompt_tokens"].as_u64().unwrap()).sum();
    let saved: u64 = answers.iter().map(cached).sum();
    // All but the first continue from the system prompt (to a token or two of its end).
    assert!(
        saved + 2 * agents as u64 >= (agents as u64 - 1) * system_tokens,
        "{saved} of {prompt} cached: {answers:?}"
    );
    assert!(prompt - saved < system_tokens + 2 * (prompt / agents as u64 - system_tokens) * agents as u64);
    for (i, w) in answers.iter().enumerate() {
        let c = post(&cold, "/v1/chat/completions", &body(i));
        assert_eq!(w["choices"][0]["message"], c["choices"][0]["message"], "agent {i}");
    }
}
