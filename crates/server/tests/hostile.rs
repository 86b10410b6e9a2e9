//! Hostile clients against an in-process server: chat-template bombs sent eight at once while
//! `/health` is polled and an ordinary completion is asked for. Every bomb must get a 4xx
//! within 5 s, `/health` must answer within 1 s throughout, the completion must succeed, and
//! the server's resident memory must stay under 1 GiB above its idle size. Also: request
//! templates are refused unless the server has a sandbox, and the memory guard refuses new work
//! (503, Retry-After) above its limit while reads still answer.
//!
//! Needs the GPT-NeoX tokenizer and all-MiniLM-L6-v2 from ../shared/data (skipped without).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use picaso_model::{LoadOptions, Mamba2Config, Mamba2Weights, Model};
use picaso_server::render::{Sandbox, SandboxLimits};
use serde_json::{json, Value};

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}\
                      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// The bombs (tests/fixtures/template_bombs.json, which scripts/template_bombs.py sends too):
/// name and template.
fn bombs() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/template_bombs.json");
    let list: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let field = |b: &Value, k: &str| b[k].as_str().unwrap().to_string();
    list.iter().map(|b| (field(b, "name"), field(b, "template"))).collect()
}

/// A path under ../shared/data, or None (with a note).
fn shared(rel: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data").join(rel);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipping: {} not found (the shared data folder is beside the checkout in CI)", p.display());
        None
    }
}

/// This process's resident memory, bytes.
fn rss() -> u64 {
    picaso_server::resident_bytes().unwrap_or(0)
}

struct Server {
    url: String,
    _tmp: tempfile::TempDir,
}

/// A server over a tiny random Mamba-2 with ChatML as its own template and an empty store, on
/// a runtime of its own; `sandbox` renders request templates, `memory` is the guard's limit.
fn start(sandbox: bool, memory: Option<u64>) -> Option<Server> {
    let (tokenizer, embedder) = (shared("gpt-neox-20b-tokenizer/tokenizer.json")?, shared("all-MiniLM-L6-v2")?);
    let tmp = tempfile::tempdir().unwrap();
    let model_dir = tmp.path().join("model");
    std::fs::create_dir_all(&model_dir).unwrap();
    let config = Mamba2Config { vocab_size: 50280, d_model: 16, headdim: 8, nheads: 4, ..Mamba2Config::tiny(2, 4) };
    Mamba2Weights::random(&config, 1).save_pretrained(&model_dir, &config).unwrap();
    std::fs::copy(tokenizer, model_dir.join("tokenizer.json")).unwrap();
    let tokenizer_config = json!({"chat_template": CHATML, "eos_token": "<|im_end|>"});
    std::fs::write(model_dir.join("tokenizer_config.json"), tokenizer_config.to_string()).unwrap();
    let model = Model::load(&model_dir, &LoadOptions::default()).unwrap();
    let embedder = picaso_store::find_embedder(Some(&embedder), None).unwrap();
    let info = picaso_store::StoreInfo {
        fingerprint: model.fingerprint().to_string(),
        dim: embedder.dim(),
        state_dtype: Default::default(),
    };
    let store = {
        let location = picaso_store::Location::parse(tmp.path().join("db").to_str().unwrap(), None).unwrap();
        picaso_store::Store::open_or_create(location, &info).unwrap()
    };
    // A slot per bomb: a ninth template would wait for one (503 after the wall limit), which is
    // the server at capacity, not what this test is about.
    let sandbox = sandbox.then(|| {
        let program = PathBuf::from(env!("CARGO_BIN_EXE_picaso-render-template"));
        Sandbox::new(program, Vec::new(), SandboxLimits::default(), 8)
    });
    let options = picaso_server::Options {
        cache_bytes: 64 << 20,
        prefix_cache_bytes: 64 << 20,
        parallel: 2,
        parallel_ingest: 1,
        max_batch: 8,
        max_queue: 64,
        prefill_chunk: picaso_server::DEFAULT_PREFILL_CHUNK,
        decode_states: Default::default(),
        limits: picaso_server::Limits::default(),
        model_name: "tiny".into(),
        chat_template: None,
        request_templates: sandbox,
        max_memory_bytes: memory,
    };
    let app = Arc::new(picaso_server::App::new(model, store, embedder, options).unwrap());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || runtime.block_on(picaso_server::serve(app, listener)));
    Some(Server { url, _tmp: tmp })
}

/// POSTs `body`: the status and the JSON answer.
fn post(url: &str, body: &Value) -> (u16, Value) {
    let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(60)).build();
    match agent.post(url).send_json(body.clone()) {
        Ok(r) => (r.status(), r.into_json().unwrap_or(Value::Null)),
        Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
        Err(e) => panic!("{url}: {e}"),
    }
}

fn chat(template: Option<&str>) -> Value {
    let mut body = json!({"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4});
    if let Some(t) = template {
        body["chat_template"] = json!(t);
    }
    body
}

#[test]
fn template_bombs_get_4xx_fast_while_the_server_keeps_serving() {
    let Some(server) = start(true, None) else { return };
    let chat_url = format!("{}/v1/chat/completions", server.url);
    // Warm up (first tokenization, first child), then the idle size.
    assert_eq!(post(&chat_url, &chat(None)).0, 200);
    assert_eq!(post(&chat_url, &chat(Some(CHATML))).0, 200);
    let idle = rss();
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(idle));
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss(), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let health = {
        let (done, url) = (done.clone(), format!("{}/health", server.url));
        std::thread::spawn(move || {
            let mut worst = Duration::ZERO;
            while !done.load(Ordering::Relaxed) {
                let t = Instant::now();
                let ok = ureq::get(&url).timeout(Duration::from_secs(30)).call().is_ok_and(|r| r.status() == 200);
                assert!(ok, "/health failed under attack");
                worst = worst.max(t.elapsed());
                std::thread::sleep(Duration::from_millis(50));
            }
            worst
        })
    };
    let started = Instant::now();
    let attackers: Vec<_> = bombs()
        .into_iter()
        .map(|(name, template)| {
            let url = chat_url.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let (status, body) = post(&url, &chat(Some(&template)));
                (name, status, t.elapsed(), body["error"]["message"].as_str().unwrap_or("").to_string())
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    let (status, body) = post(&chat_url, &chat(None));
    let ordinary = t.elapsed();
    assert_eq!(status, 200, "an ordinary completion under attack: {body}");
    let results: Vec<_> = attackers.into_iter().map(|a| a.join().unwrap()).collect();
    let all = started.elapsed();
    done.store(true, Ordering::Relaxed);
    let worst_health = health.join().unwrap();
    sampler.join().unwrap();
    let grown = peak.load(Ordering::Relaxed).saturating_sub(idle);
    println!("| bomb | status | time to answer | message |\n|---|---|---|---|");
    for (name, status, took, message) in &results {
        println!(
            "| {name} | {status} | {:.2} s | {} |",
            took.as_secs_f64(),
            message.chars().take(90).collect::<String>()
        );
    }
    println!(
        "all 8 answered in {:.2} s; ordinary completion {:.3} s; worst /health {:.3} s; resident memory idle {} MiB, peak +{} MiB",
        all.as_secs_f64(),
        ordinary.as_secs_f64(),
        worst_health.as_secs_f64(),
        idle >> 20,
        grown >> 20
    );
    for (name, status, took, message) in &results {
        assert!((400..500).contains(status), "{name}: {status} {message}");
        assert!(*took < Duration::from_secs(5), "{name}: {took:?}");
    }
    assert!(worst_health < Duration::from_secs(1), "/health took {worst_health:?}");
    assert!(grown < 1 << 30, "resident memory grew {} MiB", grown >> 20);
}

/// Without a sandbox a request's template is refused with 400 naming the flag; with one it
/// renders as the same template does in the server (the same prompt length).
#[test]
fn request_templates_need_the_sandbox_and_render_as_the_servers_own() {
    let Some(closed) = start(false, None) else { return };
    let (status, body) = post(&format!("{}/v1/chat/completions", closed.url), &chat(Some(CHATML)));
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("--trust-request-chat-template"), "{body}");
    // The model's own template still serves.
    assert_eq!(post(&format!("{}/v1/chat/completions", closed.url), &chat(None)).0, 200);
    let open = start(true, None).unwrap();
    let url = format!("{}/v1/chat/completions", open.url);
    let two = |template: Option<&str>| {
        let mut body = chat(template);
        body["messages"] = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]);
        let (status, answer) = post(&url, &body);
        assert_eq!(status, 200, "{answer}");
        answer["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    assert_eq!(two(Some(CHATML)), two(None));
    // A template's own error is the client's 400, with its message.
    let (status, body) = post(&url, &chat(Some("{{ raise_exception('roles must alternate') }}")));
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("roles must alternate"), "{body}");
}

/// Above its memory limit the server answers new work 503 with Retry-After; reads answer.
#[test]
fn the_memory_guard_refuses_new_work_and_keeps_reads() {
    let Some(server) = start(false, Some(1 << 20)) else { return };
    let agent = ureq::AgentBuilder::new().build();
    match agent.post(&format!("{}/v1/chat/completions", server.url)).send_json(chat(None)) {
        Err(ureq::Error::Status(503, r)) => {
            assert_eq!(r.header("retry-after"), Some("1"));
            let body: Value = r.into_json().unwrap();
            assert!(body["error"]["message"].as_str().unwrap().contains("--max-memory-mb"), "{body}");
        }
        other => panic!("expected 503, got {other:?}"),
    }
    assert_eq!(agent.get(&format!("{}/health", server.url)).call().unwrap().status(), 200);
    let metrics = agent.get(&format!("{}/metrics", server.url)).call().unwrap().into_string().unwrap();
    assert!(metrics.contains("picaso_refused_over_memory_total 1"), "{metrics}");
}
