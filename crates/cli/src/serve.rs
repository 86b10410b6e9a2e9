//! `picaso serve` (the HTTP API) and `picaso load` (drives a server with concurrent clients and
//! checks every answer).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};

use crate::args::{load_model, ModelArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    db: crate::args::DbArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// all-MiniLM-L6-v2 folder (the store's retriever; default: $PICASO_EMBEDDER, else the one
    /// the store was built with).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port; the address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// Memory for hot context states, MiB.
    #[arg(long, default_value_t = 512)]
    cache_mb: usize,
    /// Memory for prompt-prefix states, MiB (0: off). The state after each prompt and after
    /// each chat message is kept, so a conversation's next turn or a shared system prompt is
    /// not prefilled again; least recently used states go first. 1024 MiB holds ~460 states
    /// of the bundled model or ~50 of mamba2-130m (a hybrid's also hold its keys and values:
    /// they grow with the prefix).
    #[arg(long, default_value_t = 1024)]
    prefix_cache_mb: usize,
    /// Completions preparing at once (retrieval, loading and composing states; others queue);
    /// default: the number of cores.
    #[arg(long)]
    parallel: Option<usize>,
    /// Context and document uploads and attributions running at once (others queue); they have
    /// their own slots, apart from --parallel, so completions never wait behind them (a long
    /// document takes minutes); default: the number of cores.
    #[arg(long)]
    parallel_ingest: Option<usize>,
    /// Most generations advancing together (continuous batching: one batched decode step per
    /// token for all of them).
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Most generations waiting to join the batch; more are answered 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Most prompt tokens prefilled per batch step, over all joining requests: smaller keeps
    /// the running streams' inter-token latency low, larger starts new requests sooner.
    #[arg(long, default_value_t = picaso_server::DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// How the batch holds each generation's SSM state between decode steps: f32 (exact) or
    /// f16 (half the bytes a batched step reads and writes: faster with many clients; log-probs
    /// drift ~1e-3 over hundreds of tokens; Mamba-2 on the cpu engine).
    #[arg(long, default_value = "f32")]
    decode_state: picaso_server::DecodeStates,
    /// Most prompt tokens per request (413 above).
    #[arg(long, default_value_t = 8192)]
    max_prompt_tokens: usize,
    /// Most prompts in one completion request (a list of prompts, one choice each; 400 above).
    #[arg(long, default_value_t = 64)]
    max_prompts: usize,
    /// Most prompt tokens in one request, all its prompts together (413 above).
    #[arg(long, default_value_t = 65536)]
    max_request_tokens: usize,
    /// Chat template for /v1/chat/completions: a tokenizer_config.json with `chat_template`, or
    /// a Jinja file (default: the model folder's tokenizer_config.json, if it has one).
    #[arg(long)]
    chat_template: Option<PathBuf>,
    /// Render chat templates sent with a request (`chat_template`), each in a child process
    /// limited to 512 MiB, 2 s and 2M template instructions (at most 4 at once). Off by default:
    /// a template is a program, and without this flag a request that brings one is refused
    /// with 400. The model's own template and --chat-template are trusted.
    #[arg(long)]
    trust_request_chat_template: bool,
    /// Resident memory, MiB, above which new work (every POST) is answered 503 with
    /// Retry-After, so the server refuses rather than being killed by the kernel; requests in
    /// flight finish (default: 90% of the machine's or cgroup's memory, at least the model's
    /// weights + 1 GiB; 0: no limit).
    #[arg(long)]
    max_memory_mb: Option<u64>,
    /// Largest max_tokens a request may ask for (400 above).
    #[arg(long, default_value_t = 2048)]
    max_tokens_limit: usize,
    /// Most contexts per completion.
    #[arg(long, default_value_t = 64)]
    max_contexts: usize,
    /// Seconds a client has to send a request's headers before its connection is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout_s: f64,
    /// Seconds a client has to send a request's body (then 408).
    #[arg(long, default_value_t = 30.0)]
    body_timeout_s: f64,
    /// Most open connections (more are closed when accepted).
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds the requests in flight have to finish after Ctrl-C or SIGTERM (the server stops
    /// accepting at once); then they are cut. A second signal exits at once.
    #[arg(long, default_value_t = 30.0)]
    shutdown_timeout_s: f64,
}

fn seconds(flag: &str, s: f64) -> Result<std::time::Duration> {
    if !(s.is_finite() && s > 0.0) {
        bail!("{flag} {s}: give a positive number of seconds");
    }
    Ok(std::time::Duration::from_secs_f64(s))
}

/// A long-running server allocates and frees states of megabytes from many threads. glibc's
/// defaults (an arena per thread up to 8 per core; the mmap threshold raised to each freed
/// block's size) let such blocks pile up in the arenas: in a 20-minute soak the resident
/// memory climbed from 358 to 400 MB and went on climbing. Blocks of 1 MiB and more mapped and
/// unmapped each time, and one arena per core, held it flat at 272 MB over the last 7 minutes
/// of a 15-minute soak (docs/benchmarks/serving.md, "Longer soaks").
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn tune_allocator(cores: usize) {
    // SAFETY: mallopt only sets glibc's allocator parameters; called before the server's threads.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, cores.max(2) as libc::c_int);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn tune_allocator(_cores: usize) {}

/// The sandbox for request templates: this very binary, as `picaso render-template`.
fn request_template_sandbox(trust: bool) -> Result<Option<picaso_server::render::Sandbox>> {
    if !trust {
        return Ok(None);
    }
    let exe = std::env::current_exe().context("cannot find this program's path to run template sandboxes")?;
    let limits = picaso_server::render::SandboxLimits::default();
    Ok(Some(picaso_server::render::Sandbox::new(exe, vec!["render-template".into()], limits, 4)))
}

/// Bytes of a model folder's weights (its .safetensors files).
fn weight_bytes(dir: &std::path::Path) -> u64 {
    let files = std::fs::read_dir(dir).into_iter().flatten().flatten();
    files
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    tune_allocator(cores);
    let store = picaso_store::Store::open(a.db.location()?)?;
    let model = load_model(&a.model, true)?;
    let embedder = picaso_store::find_embedder(a.embedder.as_deref(), Some(&store))?;
    let model_name =
        model.dir().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "picaso".to_string());
    let options = picaso_server::Options {
        cache_bytes: a.cache_mb << 20,
        prefix_cache_bytes: a.prefix_cache_mb << 20,
        parallel: a.parallel.unwrap_or(cores),
        parallel_ingest: a.parallel_ingest.unwrap_or(cores),
        max_batch: a.max_batch,
        max_queue: a.max_queue,
        prefill_chunk: a.prefill_chunk,
        decode_states: a.decode_state,
        limits: picaso_server::Limits {
            max_prompt_tokens: a.max_prompt_tokens,
            max_prompts: a.max_prompts.max(1),
            max_request_tokens: a.max_request_tokens,
            max_tokens: a.max_tokens_limit,
            max_contexts: a.max_contexts,
            header_timeout: seconds("--header-timeout-s", a.header_timeout_s)?,
            body_timeout: seconds("--body-timeout-s", a.body_timeout_s)?,
            max_connections: a.max_connections.max(1),
            shutdown_timeout: seconds("--shutdown-timeout-s", a.shutdown_timeout_s)?,
            ..Default::default()
        },
        model_name,
        chat_template: a.chat_template,
        request_templates: request_template_sandbox(a.trust_request_chat_template)?,
        max_memory_bytes: match a.max_memory_mb {
            Some(0) => None,
            Some(mb) => Some(mb << 20),
            None => picaso_server::MemoryGuard::default_limit(weight_bytes(model.dir())),
        },
    };
    match options.max_memory_bytes {
        Some(limit) => {
            eprintln!("memory guard: new work is refused above {} MiB resident (--max-memory-mb)", limit >> 20)
        }
        None => eprintln!("memory guard: off"),
    }
    if options.request_templates.is_none() {
        eprintln!(
            "chat templates sent with a request are refused (--trust-request-chat-template renders them in a sandbox)"
        );
    }
    let app = Arc::new(picaso_server::App::new(model, store, embedder, options).map_err(anyhow::Error::msg)?);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&a.addr)
            .await
            .with_context(|| format!("cannot listen on {} (in use? try another --addr)", a.addr))?;
        println!("listening on http://{}", listener.local_addr()?);
        use std::io::Write;
        std::io::stdout().flush()?;
        picaso_server::serve(app, listener).await?;
        Ok(())
    });
    // Requests cut at the shutdown deadline may still run model work on blocking threads:
    // exit now instead of waiting for them.
    runtime.shutdown_background();
    served
}

#[derive(Args)]
pub struct LoadArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Duration of the run, seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Tokens each completion generates.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Contexts retrieved and composed per request (0: none).
    #[arg(long, default_value_t = 5)]
    retrieve: usize,
    /// Composition method.
    #[arg(long, default_value = "picaso-r")]
    composition: String,
    /// Every n-th request streams (0: none).
    #[arg(long, default_value_t = 4)]
    stream_every: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Prompts the load clients cycle through.
const PROMPTS: [&str; 8] = [
    "The history of the city begins",
    "In the following season the team",
    "The album was released in",
    "During the war, the ship",
    "The species is found in",
    "After the election, the party",
    "The film received positive reviews",
    "The church was built in",
];

/// Checks that a completion answer has the documented form; returns the generated tokens.
fn check_completion(v: &Value, max_tokens: usize, contexts: usize) -> Result<usize> {
    let text_ok = v["choices"][0]["text"].is_string();
    let usage = v["usage"]["completion_tokens"].as_u64().context("no usage.completion_tokens")? as usize;
    let used = v["picaso"]["contexts"].as_array().context("no picaso.contexts")?.len();
    if !text_ok || usage > max_tokens || used != contexts || v["choices"][0]["finish_reason"].is_null() {
        bail!("malformed completion: {v}");
    }
    Ok(usage)
}

/// Reads a server-sent-event stream to its `[DONE]`; returns the final chunk.
fn read_stream(reader: impl std::io::Read) -> Result<Value> {
    use std::io::BufRead;
    let mut last = Value::Null;
    let mut text = String::new();
    for line in std::io::BufReader::new(reader).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            last["choices"][0]["text"] = json!(text);
            return Ok(last);
        }
        let v: Value = serde_json::from_str(data).with_context(|| format!("bad event {data}"))?;
        if v.get("error").is_some() {
            bail!("error event: {v}");
        }
        text.push_str(v["choices"][0]["text"].as_str().context("chunk without text")?);
        if v.get("usage").is_some() {
            last = v;
        }
    }
    bail!("stream ended without [DONE]")
}

#[derive(Default)]
struct ClientLog {
    latencies: Vec<f64>,
    tokens: usize,
    errors: Vec<String>,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((p * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1)]
}

pub fn load(a: LoadArgs) -> Result<()> {
    let base = a.url.trim_end_matches('/').to_string();
    ureq::get(&format!("{base}/health")).call().with_context(|| format!("no server answers at {base}/health"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let handles: Vec<_> = (0..a.clients)
        .map(|c| {
            let (base, stop, composition) = (base.clone(), stop.clone(), a.composition.clone());
            let (max_tokens, retrieve, stream_every) = (a.max_tokens, a.retrieve, a.stream_every);
            std::thread::spawn(move || {
                let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(600)).build();
                let mut log = ClientLog::default();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let stream = stream_every > 0 && (c + i).is_multiple_of(stream_every);
                    let body = json!({
                        "prompt": PROMPTS[(c + i) % PROMPTS.len()], "max_tokens": max_tokens, "temperature": 0.8,
                        "seed": (c * 100_000 + i) as u64, "retrieve": retrieve, "composition": composition, "stream": stream,
                    });
                    let t0 = Instant::now();
                    let result = agent
                        .post(&format!("{base}/v1/completions"))
                        .send_json(body)
                        .map_err(anyhow::Error::from)
                        .and_then(|resp| {
                            if stream {
                                read_stream(resp.into_reader())
                            } else {
                                Ok(resp.into_json::<Value>()?)
                            }
                        })
                        .and_then(|v| check_completion(&v, max_tokens, retrieve));
                    match result {
                        Ok(n) => {
                            log.latencies.push(t0.elapsed().as_secs_f64());
                            log.tokens += n;
                        }
                        Err(e) => log.errors.push(format!("{e:#}")),
                    }
                    i += 1;
                }
                log
            })
        })
        .collect();
    std::thread::sleep(Duration::from_secs_f64(a.seconds));
    stop.store(true, Ordering::Relaxed);
    let mut all = ClientLog::default();
    for h in handles {
        let log = h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))?;
        all.latencies.extend(log.latencies);
        all.tokens += log.tokens;
        all.errors.extend(log.errors);
    }
    let wall = start.elapsed().as_secs_f64();
    all.latencies.sort_by(f64::total_cmp);
    let n = all.latencies.len();
    let report = json!({
        "clients": a.clients, "seconds": wall, "requests": n, "errors": all.errors.len(),
        "requests_per_s": n as f64 / wall, "tokens_per_s": all.tokens as f64 / wall,
        "p50_ms": 1e3 * percentile(&all.latencies, 0.5), "p99_ms": 1e3 * percentile(&all.latencies, 0.99),
        "max_ms": 1e3 * all.latencies.last().copied().unwrap_or(f64::NAN),
        "retrieve": a.retrieve, "composition": a.composition, "max_tokens": a.max_tokens,
        "first_errors": all.errors.iter().take(3).collect::<Vec<_>>(),
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "{n} requests in {wall:.1} s from {} clients: {:.2} requests/s, {:.1} tokens/s, p50 {:.0} ms, p99 {:.0} ms, {} malformed or failed",
            a.clients,
            report["requests_per_s"].as_f64().unwrap_or(0.0),
            report["tokens_per_s"].as_f64().unwrap_or(0.0),
            report["p50_ms"].as_f64().unwrap_or(f64::NAN),
            report["p99_ms"].as_f64().unwrap_or(f64::NAN),
            all.errors.len()
        );
        for e in all.errors.iter().take(3) {
            println!("  {e}");
        }
    }
    if !all.errors.is_empty() {
        bail!("{} of {} requests failed or were malformed", all.errors.len(), n + all.errors.len());
    }
    Ok(())
}
