//! The `picaso` command: a thin shell over the library crates. Parses flags, calls the library,
//! prints text or JSON. Errors print one line to stderr and exit with status 1 (2 for usage).

use picaso_model::counted;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use picaso_model::{compose, generate, Composition, GenerateOptions, LoadOptions, Method, Model, State, StateDtype};
use serde_json::json;

mod backends;
mod contexts;
mod demo;
mod eval;
mod retriever;
mod serve;
mod train;

#[derive(Parser)]
#[command(
    name = "picaso",
    version,
    about = "A database of SSM states: process contexts once, compose their states, generate."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The main job, end to end: ingest a corpus (built in, or WikiText with --data) with the
    /// bundled model, answer prompts with naive / concat / picaso-r, print loss and time to
    /// first token.
    Demo(demo::DemoArgs),
    /// Print a model's config, parameter count and state size per context.
    Info(InfoArgs),
    /// Log-probabilities of a token sequence, optionally continuing from a saved state.
    Score(ScoreArgs),
    /// Process tokens and save the state after them.
    State(StateArgs),
    /// Generate text from a prompt, optionally continuing from a saved state.
    Generate(GenerateArgs),
    /// Compose saved states into one (soup, caso, picaso-s, picaso-r).
    Compose(ComposeArgs),
    /// Print the composition weights for scalar log-decays (for inspection and teaching).
    Weights(WeightsArgs),
    /// Measure prefill, scoring, decode and composition throughput.
    Bench(BenchArgs),
    /// Write a model folder with random weights of a known shape (for speed benchmarks of the
    /// server or of peers: the same weights for every engine).
    RandomModel(RandomModelArgs),
    /// What k contexts cost at query time: composing their stored states vs processing them.
    BenchContext(BenchContextArgs),
    /// Add documents to a store of states (idempotent, resumable).
    Ingest(IngestArgs),
    /// Totals of a store.
    Stats(StatsArgs),
    /// List a store's documents (name, contexts, tokens).
    Documents(contexts::DocumentsArgs),
    /// List a store's contexts: all, one document's, or some ids.
    Contexts(contexts::ContextsArgs),
    /// Remove contexts, or whole documents, from a store.
    Delete(contexts::DeleteArgs),
    /// Verify every state object of a store against its catalog; --repair recomputes the
    /// broken ones from their stored tokens.
    Check(contexts::CheckArgs),
    /// Retrieve contexts, compose their states, continue with a prompt.
    Query(QueryArgs),
    /// Copy a store to another backend (folder, S3 + PostgreSQL), verifying every context.
    Migrate(backends::MigrateArgs),
    /// Choose exact or approximate (HNSW) search for a PostgreSQL store.
    Index(backends::IndexArgs),
    /// Latency of retrieval + state loading + composition on a store's backends.
    BenchStore(backends::BenchStoreArgs),
    /// Serve the HTTP API (OpenAI-compatible completions over the store).
    Serve(serve::ServeArgs),
    /// Drive a running server with concurrent clients; report throughput and latency.
    Load(serve::LoadArgs),
    /// Train a model: pretraining, composition fine-tuning (BPTC / BP2C), loss charts.
    #[command(subcommand)]
    Train(train::TrainCommand),
    /// Run an experiment (the paper's WikiText, OpenBookQA, attribution and more) and write its report.
    #[command(subcommand)]
    Eval(eval::EvalCommand),
}

/// Where a store is.
#[derive(Args, Clone, Debug)]
pub struct DbArgs {
    /// The store: a folder (SQLite and state files inside), or postgres://user@host/db
    /// (metadata and vectors in PostgreSQL with pgvector, shared by several servers).
    #[arg(long)]
    pub db: String,
    /// Where state objects live, given when the store is created: a folder, or
    /// s3://bucket/prefix (configured by the AWS_* environment variables). Recorded in the
    /// store; later commands need only --db.
    #[arg(long)]
    pub states: Option<String>,
}

impl DbArgs {
    /// The parsed location.
    pub fn location(&self) -> Result<picaso_store::Location> {
        Ok(picaso_store::Location::parse(&self.db, self.states.as_deref())?)
    }
}

#[derive(Args)]
struct IngestArgs {
    /// The store (created if missing).
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// all-MiniLM-L6-v2 folder (model.safetensors, config.json, tokenizer.json); default:
    /// $PICASO_EMBEDDER, the store's own, the hub, or ../shared/data/all-MiniLM-L6-v2.
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// A folder of .txt files, one document each.
    #[arg(long, group = "source", required_unless_present_any = ["jsonl", "wikitext"])]
    text_dir: Option<PathBuf>,
    /// A JSON-lines file: {"text": ..., "id": ...} per line (a line without an id is named
    /// FILE:LINE); every other field (title, url, date, ...) is the document's metadata, carried
    /// by each of its contexts and matched by `query --filter`.
    #[arg(long, group = "source")]
    jsonl: Option<PathBuf>,
    /// A WikiText file (articles start at ` = Title = ` lines).
    #[arg(long, group = "source")]
    wikitext: Option<PathBuf>,
    /// paragraph (one context per paragraph), `tokens:N`, or `halves[:MIN]` (paragraphs of at least
    /// MIN tokens, default 16, as two halves: segments 2p and 2p+1, the WikiText experiment).
    #[arg(long, default_value = "paragraph")]
    segment: picaso_store::Segmentation,
    /// Contexts per committed batch.
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    batch: usize,
    /// Precision of the state files: f32 or bf16 (default: the store's, f32 for a new store).
    #[arg(long)]
    state_dtype: Option<StateDtype>,
    /// Also remove the store's documents the source no longer has (a file deleted from
    /// --text-dir, an id gone from --jsonl), so the store mirrors the source.
    #[arg(long)]
    prune: bool,
    /// Print a JSON summary instead of a progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct StatsArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON: {"contexts", "documents", "tokens", "state_bytes", "model"}.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct QueryArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The prompt.
    prompt: String,
    #[command(flatten)]
    model: ModelArgs,
    /// all-MiniLM-L6-v2 folder (to retrieve; default: $PICASO_EMBEDDER, else the one the store
    /// was built with).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Contexts to retrieve.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    k: usize,
    #[command(flatten)]
    retriever: retriever::RetrieverArgs,
    /// picaso-r, picaso-s, caso, soup, concat or naive.
    #[arg(long, default_value = "picaso-r", value_parser = |s: &str| Method::parse_among(s, &Method::QUERY))]
    method: Method,
    /// Use these context ids (in this order, the last nearest the prompt) instead of retrieving.
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<i64>>,
    /// Retrieve only from this document's contexts (its name, as `picaso documents` lists it;
    /// repeat for several).
    #[arg(long = "doc", value_name = "NAME", conflicts_with = "ids")]
    docs: Vec<String>,
    /// Retrieve only contexts whose metadata passes this condition (repeat: all must hold):
    /// KEY=VALUE, KEY!=VALUE, KEY>VALUE, KEY>=VALUE, KEY<VALUE, KEY<=VALUE (numbers by value,
    /// strings by code point: `date>=2024-01-01`), KEY^=TEXT (a string starting with TEXT:
    /// `url^=https://en.wikipedia.org/`), KEY~=PATTERN (a string a regex matches, Rust's
    /// syntax: `'title~=(?i)^the .+ war$'`), or a filter as a JSON object, for the
    /// operators $in, $nin, $exists, $contains, $elemMatch and $not, $or / $and / $nor of
    /// filters, and keys within objects (`'{"lang": {"$in": ["en", "fr"]}}'`,
    /// `'{"year": {"$not": {"$gte": 2020}}}'`, `'{"author": {"name": "Ann"}}'`,
    /// `'{"authors": {"$elemMatch": {"name": "Ann", "role": "editor"}}}'`).
    /// VALUE is JSON when it reads as a JSON number, boolean, null or quoted string
    /// (`year=2024`, `draft=false`, `year='"2024"'`), else the text as given (`lang=en`).
    /// Metadata comes from a JSON line's fields other than `text` and `id`.
    #[arg(long = "filter", value_name = "CONDITION", conflicts_with = "ids")]
    filters: Vec<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Also tell which context the answer owes most to: each is left out in turn, the others
    /// are combined again by --method and the answer is scored; prints the log-likelihood the
    /// answer loses without each (leave-one-out, the paper's attribution).
    #[arg(long)]
    attribute: bool,
    /// Attribute this answer (text continuing the prompt) instead of generating one; implies
    /// --attribute.
    #[arg(long)]
    answer: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// Model folder; without it, random weights of --random's shape (130m = mamba2-130m, mamba1-130m, tiny) are used.
    #[arg(long, conflicts_with = "random")]
    model: Option<String>,
    /// Random weights in a known shape: `130m` (state-spaces/mamba2-130m), `mamba1-130m`
    /// (state-spaces/mamba-130m) or `tiny`.
    #[arg(long, default_value = "130m")]
    random: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Storage of the large weight matrices: f32 or bf16.
    #[arg(long, default_value = "f32")]
    weights: picaso_model::WeightDtype,
    /// Engine: cpu (the fast CPU path), candle-cpu, `cuda[:N]` or metal (need a build with the
    /// `cuda` / `metal` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Tokens to prefill and score.
    #[arg(long, default_value_t = 512, value_parser = at_least_one)]
    prompt_tokens: usize,
    /// Tokens to decode one at a time.
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    decode_tokens: usize,
    /// Runs per measurement (best is reported).
    #[arg(long, default_value_t = 3, value_parser = at_least_one)]
    repeats: usize,
    /// States to compose (0 skips the composition benchmark).
    #[arg(long, default_value_t = 10)]
    compose_n: usize,
    /// Sequences to decode together, one batched step per token, as `serve` batches its
    /// clients; as many prompts are also prefilled together (0 skips both).
    #[arg(long, default_value_t = 16)]
    decode_batch: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchContextArgs {
    /// Model folder; without it, random weights of --random's shape (130m = mamba2-130m, mamba1-130m, tiny) are used.
    #[arg(long, conflicts_with = "random")]
    model: Option<String>,
    /// Random weights in a known shape: `130m` (state-spaces/mamba2-130m), `mamba1-130m`
    /// (state-spaces/mamba-130m) or `tiny`.
    #[arg(long, default_value = "130m")]
    random: String,
    /// Storage of the large weight matrices: f32 or bf16.
    #[arg(long, default_value = "f32")]
    weights: picaso_model::WeightDtype,
    /// Store folder for the benchmark's contexts (default: a temporary folder).
    #[arg(long)]
    db: Option<PathBuf>,
    /// Measure k = 1..=max_k contexts.
    #[arg(long, default_value_t = 10)]
    max_k: usize,
    /// Tokens per context.
    #[arg(long, default_value_t = 100)]
    context_tokens: usize,
    /// Tokens of the prompt after the contexts (for the time to first token).
    #[arg(long, default_value_t = 32, value_parser = at_least_one)]
    prompt_tokens: usize,
    /// Runs per measurement (medians are reported).
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    repeats: usize,
    /// Composition method.
    #[arg(long, default_value = "picaso-r")]
    method: Composition,
    /// Precision of the state files.
    #[arg(long, default_value = "f32")]
    state_dtype: StateDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ModelArgs {
    /// Model folder (config.json + weights [+ tokenizer.json]) or a Hugging Face repo id;
    /// default: $PICASO_MODEL, else the bundled model.
    #[arg(long)]
    model: Option<String>,
    /// tokenizer.json to use instead of the model folder's.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Engine: cpu (the fast CPU path), candle-cpu (the generic path, for checking),
    /// `cuda[:N]` or metal (need a build with the `cuda` / `metal` feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Storage of the large weight matrices on the cpu engine: f32 (exact) or bf16 (half the
    /// memory; decode about twice as fast; log-probs move by a few hundredths of a nat).
    #[arg(long, default_value = "f32")]
    weights: picaso_model::WeightDtype,
}

impl ModelArgs {
    /// The model in `dir` with the default engine (for commands that compare several models).
    fn for_dir(dir: &str) -> Self {
        Self {
            model: Some(dir.to_string()),
            tokenizer: None,
            device: "cpu".into(),
            weights: picaso_model::WeightDtype::F32,
        }
    }
}

#[derive(Args)]
struct InputArgs {
    /// Text to tokenize.
    #[arg(long, conflicts_with = "token_ids", required_unless_present = "token_ids")]
    text: Option<String>,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    token_ids: Option<Vec<u32>>,
}

#[derive(Args)]
struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: InputArgs,
    /// Continue from this state file (the first token is still context, not scored).
    #[arg(long)]
    state: Option<PathBuf>,
    /// Print JSON: {"token_ids", "logprobs", "mean_nll"}.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct StateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: InputArgs,
    /// Continue from this state file instead of the empty state.
    #[arg(long)]
    from: Option<PathBuf>,
    /// Where to write the state (safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Precision of the SSM states and conv tails on disk (log-decays stay f32).
    #[arg(long, default_value = "f32")]
    dtype: StateDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (at least one token).
    #[arg(long)]
    prompt: String,
    /// Start from this state file (e.g. a composed state).
    #[arg(long)]
    state: Option<PathBuf>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print JSON instead of streaming text.
    #[arg(long)]
    json: bool,
}

/// How generated tokens are picked (shared by `generate` and `query`).
#[derive(Args)]
struct SamplingArgs {
    /// Most new tokens.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Generate past the end-of-text token, up to --max-tokens.
    #[arg(long)]
    ignore_eos: bool,
}

impl SamplingArgs {
    fn options(self) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
        }
    }
}

#[derive(Args)]
struct ComposeArgs {
    /// soup, caso, picaso-s or picaso-r.
    #[arg(long)]
    method: Composition,
    /// State files, in order.
    #[arg(long, num_args = 1.., required = true)]
    state_files: Vec<PathBuf>,
    /// Order of the contexts as indices into --state-files, e.g. 2,0,1 (last = nearest the prompt).
    #[arg(long, value_delimiter = ',')]
    order: Option<Vec<usize>>,
    /// Where to write the composed state.
    #[arg(long)]
    out: PathBuf,
    /// Precision on disk.
    #[arg(long, default_value = "f32")]
    dtype: StateDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct WeightsArgs {
    /// soup, caso, picaso-s or picaso-r.
    #[arg(long)]
    method: Composition,
    /// One log-decay per context (<= 0), comma-separated, in order.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, required = true)]
    log_decays: Vec<f64>,
    /// Print JSON: {"method", "weights"}.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    picaso_model::reuse_freed_buffers();
    picaso_eval::report::set_revision(env!("PICASO_GIT_REVISION"));
    let cli = Cli::parse();
    // Output piped into a reader that quits (`picaso info | head`) ends the process quietly, as
    // for any Unix tool, instead of a panic on the failed write (Rust ignores SIGPIPE). Not for
    // the server, which must outlive any one client.
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_)) {
        // SAFETY: restores the default action of one signal, before any other thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_message(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, outermost first, `: `-joined, skipping a cause whose text the
/// message already ends with (errors that print their source themselves, as ours do for file
/// errors, would otherwise say it twice). A backtrace that a cause carries in its text (candle's
/// errors do when `RUST_BACKTRACE` is set) goes after the whole message, not inside it.
fn error_message(e: &anyhow::Error) -> String {
    let mut message = String::new();
    let mut backtrace = String::new();
    for cause in e.chain() {
        let mut text = cause.to_string();
        if let Some(at) = text.find(BACKTRACE_START) {
            if backtrace.is_empty() {
                backtrace = text[at..].to_string();
            }
            text.truncate(at);
        }
        if message.is_empty() {
            message = text;
        } else if !message.ends_with(&text) {
            message = format!("{message}: {text}");
        }
    }
    message + &backtrace
}

/// How a captured backtrace's text begins: a new line and its first frame.
const BACKTRACE_START: &str = "\n   0: ";

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Info(a) => info(a),
        Command::Score(a) => score(a),
        Command::State(a) => state(a),
        Command::Generate(a) => generate_cmd(a),
        Command::Compose(a) => compose_cmd(a),
        Command::Weights(a) => weights_cmd(a),
        Command::Bench(a) => bench(a),
        Command::RandomModel(a) => random_model(a),
        Command::BenchContext(a) => bench_context(a),
        Command::Ingest(a) => ingest(a),
        Command::Stats(a) => stats(a),
        Command::Documents(a) => contexts::documents(a),
        Command::Contexts(a) => contexts::list(a),
        Command::Delete(a) => contexts::delete(a),
        Command::Check(a) => contexts::check(a),
        Command::Query(a) => query(a),
        Command::Migrate(a) => backends::migrate(a),
        Command::Index(a) => backends::index(a),
        Command::BenchStore(a) => backends::bench_store(a),
        Command::Serve(a) => serve::serve(a),
        Command::Load(a) => serve::load(a),
        Command::Train(c) => train::run(c),
        Command::Eval(c) => eval::run(c),
        Command::Demo(a) => demo::run(a),
    }
}

/// Where the bundled model lives in a checkout (the training issue puts it there).
const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/picaso-mamba2");

/// The model used when `--model` is not given: `$PICASO_MODEL`, else the bundled model.
/// A `NAME=VALUE` argument (a named model folder or log), both sides non-empty; `usage`
/// (e.g. "NAME=DIR, e.g. bptc=runs/bptc/model") says what to give instead.
fn parse_name_value(s: &str, usage: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, v)) if !n.is_empty() && !v.is_empty() => Ok((n.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: give {usage}")),
    }
}

fn default_model_dir() -> Result<PathBuf> {
    if let Some(m) = std::env::var_os("PICASO_MODEL") {
        return resolve_model_dir(&m.to_string_lossy());
    }
    let bundled = PathBuf::from(BUNDLED_MODEL);
    if bundled.join("config.json").is_file() {
        return Ok(bundled);
    }
    bail!(
        "no --model given and no bundled model at {} (it is not trained yet); pass --model DIR or a hub id, or set PICASO_MODEL",
        bundled.display()
    )
}

/// A local folder, or else a hub repo id (`owner/name`) to download.
fn resolve_model_dir(model: &str) -> Result<PathBuf> {
    if model.trim().is_empty() {
        bail!(
            "--model is empty: give a model folder or a Hugging Face repo id (or leave it out for the bundled model)"
        );
    }
    let path = Path::new(model);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let looks_like_repo = model.split('/').count() == 2 && !model.starts_with('.') && !model.starts_with('/');
    if looks_like_repo {
        return Ok(picaso_model::hub::download(model)?);
    }
    bail!("{model}: model folder not found")
}

/// The engine `--device` names, refusing `--weights` other than f32 off the cpu engine.
fn backend_for(device: &str, weights: picaso_model::WeightDtype) -> Result<picaso_model::Backend> {
    let backend: picaso_model::Backend = device.parse()?;
    if weights != picaso_model::WeightDtype::F32 && !matches!(backend, picaso_model::Backend::Cpu) {
        bail!(
            "--weights {:?} is the cpu engine's storage; --device {device} computes in its device's own precision (drop --weights, or use --device cpu)",
            format!("{weights:?}").to_lowercase(),
        );
    }
    Ok(backend)
}

pub fn load_model(args: &ModelArgs, need_tokenizer: bool) -> Result<Model> {
    let dir = match &args.model {
        Some(m) => resolve_model_dir(m)?,
        None => default_model_dir()?,
    };
    let backend = backend_for(&args.device, args.weights)?;
    let opts =
        LoadOptions { backend, weight_dtype: args.weights, tokenizer: args.tokenizer.clone(), skip_tokenizer: false };
    let model = Model::load(&dir, &opts)?;
    if need_tokenizer {
        model.tokenizer()?;
    }
    Ok(model)
}

fn tokens_of(model: &Model, input: &InputArgs) -> Result<Vec<u32>> {
    let tokens = match (&input.text, &input.token_ids) {
        (Some(t), _) => model.tokenizer()?.encode(t)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --text or --token-ids"),
    };
    model.check_tokens(&tokens)?;
    Ok(tokens)
}

fn load_state(model: &Model, path: Option<&Path>) -> Result<State> {
    match path {
        None => Ok(model.zero_state()),
        Some(p) => {
            let s = State::load(p)?;
            model.check_state(&s).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            Ok(s)
        }
    }
}

fn info(a: InfoArgs) -> Result<()> {
    let model = load_model(&a.model, false)?;
    let c = model.config();
    let bytes = model.zero_state().nbytes_f32();
    let shape = model.state_shape();
    // A hybrid's attention layers keep every context token's keys and values.
    let kv_per_token = shape.attention.as_ref().map_or(0, |a| 4 * 2 * a.token_len() * a.layers.len());
    let v = json!({
        "model": model.dir(),
        "fingerprint": model.fingerprint(),
        "arch": c.arch(),
        "format": c.format(),
        "config": c.to_hf_json(),
        "parameters": model.n_params(),
        "state_bytes_f32": bytes,
        // Log-decays stay f32 in a bf16 state file.
        "state_bytes_bf16": bytes / 2 + shape.n_layer * shape.log_decay_len() * 2,
        "kv_bytes_f32_per_token": kv_per_token,
        "tokenizer": model.tokenizer().ok().map(|t| t.vocab_size()),
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("model        {}", model.dir().display());
        println!("fingerprint  {}", model.fingerprint());
        let layers = match c {
            picaso_model::ModelConfig::GraniteHybrid(_) => "granite-hybrid: mamba2 and attention layers".to_string(),
            _ => c.arch().to_string(),
        };
        println!("format       {layers} ({:?})", c.format());
        println!("shape        {}", c.describe());
        println!("parameters   {} ({:.1} M)", model.n_params(), model.n_params() as f64 / 1e6);
        println!(
            "state        {:.2} MiB f32 per context ({:.2} MiB bf16)",
            bytes as f64 / 1048576.0,
            v["state_bytes_bf16"].as_f64().unwrap_or(0.0) / 1048576.0
        );
        if kv_per_token > 0 {
            println!(
                "             + {:.1} KiB f32 per context token ({:.1} KiB bf16): the attention layers' keys and values",
                kv_per_token as f64 / 1024.0,
                kv_per_token as f64 / 2048.0
            );
        }
        match model.tokenizer() {
            Ok(t) => println!("tokenizer    {} ids", t.vocab_size()),
            Err(e) => println!("tokenizer    none ({e})"),
        }
    }
    Ok(())
}

fn score(a: ScoreArgs) -> Result<()> {
    let model = load_model(&a.model, a.input.text.is_some())?;
    let tokens = tokens_of(&model, &a.input)?;
    let start = load_state(&model, a.state.as_deref())?;
    let scored = model.score(&tokens, &start)?;
    let n = scored.logprobs.len();
    let mean_nll = if n == 0 { None } else { Some(-scored.logprobs.iter().map(|&v| v as f64).sum::<f64>() / n as f64) };
    if a.json {
        println!("{}", json!({"token_ids": tokens, "logprobs": scored.logprobs, "mean_nll": mean_nll}));
    } else {
        for (i, lp) in scored.logprobs.iter().enumerate() {
            println!("{:>6} {:>8} {:>10.4}", i + 1, tokens[i + 1], lp);
        }
        match mean_nll {
            Some(m) => println!("mean NLL {m:.4} nats over {n} tokens (perplexity {:.2})", m.exp()),
            None => println!("one token: nothing scored (the first token is context)"),
        }
    }
    Ok(())
}

fn state(a: StateArgs) -> Result<()> {
    let model = load_model(&a.model, a.input.text.is_some())?;
    let tokens = tokens_of(&model, &a.input)?;
    let start = load_state(&model, a.from.as_deref())?;
    let t0 = Instant::now();
    let s = model.prefill(&tokens, &start)?;
    let secs = t0.elapsed().as_secs_f64();
    s.save(&a.out, a.dtype)?;
    let bytes = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    if a.json {
        println!(
            "{}",
            json!({"out": a.out.to_string_lossy(), "n_tokens": s.n_tokens, "new_tokens": tokens.len(), "bytes": bytes, "fingerprint": s.fingerprint, "seconds": secs})
        );
    } else {
        println!(
            "wrote {} ({} tokens, {:.2} MiB) in {:.3} s",
            a.out.display(),
            s.n_tokens,
            bytes as f64 / 1048576.0,
            secs
        );
    }
    Ok(())
}

fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let model = load_model(&a.model, true)?;
    let prompt = model.tokenizer()?.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("--prompt must contain at least one token");
    }
    let start = load_state(&model, a.state.as_deref())?;
    let opts = a.sampling.options();
    let t0 = Instant::now();
    let mut first_token = None;
    let mut out = std::io::stdout();
    let g = generate(&model, &prompt, &start, &opts, |piece| {
        first_token.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        // A closed stdout (`| head`) stops generation.
        a.json || out.write_all(piece.as_bytes()).and_then(|()| out.flush()).is_ok()
    })?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        println!(
            "{}",
            json!({"text": g.text, "token_ids": g.tokens, "stop_reason": g.stop_reason, "prompt_tokens": prompt.len(),
                   "seconds": secs, "time_to_first_token": first_token})
        );
    } else {
        println!();
    }
    Ok(())
}

fn compose_cmd(a: ComposeArgs) -> Result<()> {
    let states = a.state_files.iter().map(|p| Ok(State::load(p)?)).collect::<Result<Vec<_>>>()?;
    let refs: Vec<&State> = states.iter().collect();
    let t0 = Instant::now();
    let composed = compose(a.method, &refs, a.order.as_deref())?;
    let secs = t0.elapsed().as_secs_f64();
    composed.save(&a.out, a.dtype)?;
    if a.json {
        println!(
            "{}",
            json!({"out": a.out.to_string_lossy(), "method": a.method.name(), "contexts": states.len(), "n_tokens": composed.n_tokens, "compose_seconds": secs})
        );
    } else {
        println!(
            "wrote {} ({} of {}, {:.2} ms)",
            a.out.display(),
            a.method,
            counted(states.len(), "state"),
            secs * 1e3
        );
    }
    Ok(())
}

fn weights_cmd(a: WeightsArgs) -> Result<()> {
    let w = picaso_compose::weights(a.method, &a.log_decays)?;
    if a.json {
        println!("{}", json!({"method": a.method.name(), "weights": w}));
    } else {
        for (i, (ld, wi)) in a.log_decays.iter().zip(&w).enumerate() {
            println!("context {i}: log-decay {ld:>10.4}  weight {wi:.6}");
        }
    }
    Ok(())
}

#[derive(Args)]
struct RandomModelArgs {
    /// Shape: 130m (state-spaces/mamba2-130m), mamba1-130m (state-spaces/mamba-130m) or tiny.
    #[arg(long, default_value = "130m")]
    shape: String,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Folder to write (config.json, model.safetensors; must not exist yet).
    #[arg(long)]
    out: PathBuf,
    /// A tokenizer.json to copy beside the weights (GPT-NeoX-20B's for the 130m shapes).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

fn random_model(a: RandomModelArgs) -> Result<()> {
    if a.out.exists() {
        bail!("{} exists; give a new folder to --out", a.out.display());
    }
    let config = match a.shape.as_str() {
        "130m" => picaso_model::ModelConfig::Mamba2(picaso_model::Mamba2Config::mamba2_130m()),
        "mamba1-130m" => picaso_model::ModelConfig::Mamba1(picaso_model::Mamba1Config::mamba_130m()),
        "tiny" => picaso_model::ModelConfig::Mamba2(picaso_model::Mamba2Config::tiny(2, 4)),
        other => bail!("--shape {other:?}: use 130m (Mamba-2), mamba1-130m or tiny"),
    };
    if let Some(t) = &a.tokenizer {
        let known = picaso_model::TextTokenizer::from_file(t)?.vocab_size();
        if known > config.vocab_size() {
            bail!(
                "{} knows {known} tokens, but a {} model has {}: text would give ids it cannot read (drop --tokenizer, or use a larger --shape)",
                t.display(),
                a.shape,
                config.vocab_size()
            );
        }
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    match &config {
        picaso_model::ModelConfig::Mamba1(c) => {
            picaso_model::Mamba1Weights::random(c, a.seed).save_pretrained(&a.out, c)?
        }
        picaso_model::ModelConfig::Mamba2(c) => {
            picaso_model::Mamba2Weights::random(c, a.seed).save_pretrained(&a.out, c)?
        }
        picaso_model::ModelConfig::GraniteHybrid(_) => bail!("--shape: no random hybrid shape is offered"),
    }
    if let Some(t) = &a.tokenizer {
        std::fs::copy(t, a.out.join("tokenizer.json")).with_context(|| format!("copying {}", t.display()))?;
    }
    println!("wrote {} ({} shape, seed {})", a.out.display(), a.shape, a.seed);
    Ok(())
}

/// The model to benchmark: a folder, or random weights of a known shape.
fn bench_model(
    model: Option<&str>,
    random: &str,
    seed: u64,
    weights: picaso_model::WeightDtype,
    device: &str,
) -> Result<Model> {
    if let Some(m) = model {
        let args = ModelArgs { model: Some(m.to_string()), tokenizer: None, device: device.into(), weights };
        return load_model(&args, false);
    }
    let backend = backend_for(device, weights)?;
    if random == "mamba1-130m" {
        let config = picaso_model::Mamba1Config::mamba_130m();
        let w = picaso_model::Mamba1Weights::random(&config, seed);
        return Ok(Model::from_mamba1_weights_on(config, w, None, &backend, weights)?);
    }
    let config = match random {
        "130m" => picaso_model::Mamba2Config::mamba2_130m(),
        "tiny" => picaso_model::Mamba2Config::tiny(2, 4),
        other => bail!("--random {other:?}: use 130m (Mamba-2), mamba1-130m or tiny"),
    };
    let w = picaso_model::Mamba2Weights::random(&config, seed);
    Ok(Model::from_weights_on(config, w, None, &backend, weights)?)
}

fn bench_context(a: BenchContextArgs) -> Result<()> {
    if a.max_k == 0 || a.context_tokens == 0 {
        bail!("--max-k and --context-tokens must be at least 1");
    }
    let model = bench_model(a.model.as_deref(), &a.random, 0, a.weights, "cpu")?;
    let tmp;
    let dir = match &a.db {
        Some(d) => d.clone(),
        None => {
            tmp = std::env::temp_dir().join(format!("picaso-bench-context-{}", std::process::id()));
            tmp
        }
    };
    let opts = picaso_store::bench::ContextCostOptions {
        max_k: a.max_k,
        context_tokens: a.context_tokens,
        prompt_tokens: a.prompt_tokens,
        repeats: a.repeats,
        method: a.method,
        state_dtype: a.state_dtype,
    };
    let rows = picaso_store::bench::context_cost(&model, &dir, &opts);
    if a.db.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let rows = rows?;
    if a.json {
        println!("{}", json!({"method": a.method.name(), "n_params": model.n_params(), "rows": rows}));
        return Ok(());
    }
    println!(
        "{} parameters, {} contexts of {} tokens, {} ({} state files), prompt {} tokens; medians of {} runs, ms",
        model.n_params(),
        a.max_k,
        a.context_tokens,
        a.method.name(),
        format!("{:?}", a.state_dtype).to_lowercase(),
        a.prompt_tokens,
        a.repeats
    );
    println!(
        "{:>3} {:>7} {:>10} {:>10} {:>10} {:>9} {:>8} {:>8} {:>11} {:>11} {:>11}",
        "k",
        "tokens",
        "concat",
        "load cold",
        "load warm",
        "compose",
        "× cold",
        "× warm",
        "ttft concat",
        "ttft cold",
        "ttft warm"
    );
    for r in &rows {
        println!(
            "{:>3} {:>7} {:>10.2} {:>10.2} {:>10.2} {:>9.2} {:>8.1} {:>8.1} {:>11.2} {:>11.2} {:>11.2}",
            r.k,
            r.context_tokens,
            r.concat_ms,
            r.load_cold_ms,
            r.load_warm_ms,
            r.compose_ms,
            r.speedup_cold,
            r.speedup_warm,
            r.ttft_concat_ms,
            r.ttft_picaso_cold_ms,
            r.ttft_picaso_warm_ms
        );
    }
    Ok(())
}

fn bench(a: BenchArgs) -> Result<()> {
    let model = bench_model(a.model.as_deref(), &a.random, a.seed, a.weights, &a.device)?;
    let opts = picaso_model::bench::BenchOptions {
        prompt_tokens: a.prompt_tokens.max(1),
        decode_tokens: a.decode_tokens,
        repeats: a.repeats,
        compose_n: a.compose_n,
        decode_batch: a.decode_batch,
    };
    let r = picaso_model::bench::run(&model, &opts)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    println!("model        {} parameters, {} threads", model.n_params(), r.threads);
    println!("prefill      {:>8.1} tokens/s  ({} tokens → state)", r.prefill_tokens_per_s, opts.prompt_tokens);
    println!("score        {:>8.1} tokens/s  (with log-probs of every token)", r.score_tokens_per_s);
    println!("decode       {:>8.1} tokens/s  ({:.2} ms/token)", r.decode_tokens_per_s, 1e3 / r.decode_tokens_per_s);
    if let Some(t) = r.batched_decode_tokens_per_s {
        println!(
            "decode ×{:<3}  {:>8.1} tokens/s  ({:.2} ms per step of all {}; {:.1}× one sequence)",
            r.decode_batch,
            t,
            1e3 * r.decode_batch as f64 / t,
            r.decode_batch,
            t / r.decode_tokens_per_s
        );
    }
    if let Some(t) = r.batched_decode_f16_state_tokens_per_s {
        println!(
            "  f16 states  {:>8.1} tokens/s  ({:.2} ms per step of all {}; serve --decode-state f16)",
            t,
            1e3 * r.decode_batch as f64 / t,
            r.decode_batch
        );
    }
    if let Some(t) = r.batched_prefill_tokens_per_s {
        println!(
            "prefill ×{:<3} {:>8.1} tokens/s  ({} prompts of {} tokens in one pass, to their first logits)",
            r.decode_batch, t, r.decode_batch, opts.prompt_tokens
        );
    }
    if !r.compose_ms.is_empty() {
        println!(
            "read states  {:>8.2} ms  ({} × {:.1} MiB, {:.1} GB/s)",
            r.read_states_ms,
            opts.compose_n,
            r.state_bytes as f64 / 1048576.0,
            (opts.compose_n * r.state_bytes) as f64 / r.read_states_ms / 1e6
        );
        for ((m, ms), (_, into)) in r.compose_ms.iter().zip(&r.compose_into_ms) {
            println!(
                "compose      {:>8.2} ms  {m:<8} ({:.2}× the read); into a reused state {:.2} ms ({:.2}×)",
                ms,
                ms / r.read_states_ms,
                into,
                into / r.read_states_ms
            );
        }
    }
    if let Some(b) = r.peak_rss_bytes {
        println!("peak memory  {:.0} MiB", b as f64 / 1048576.0);
    }
    Ok(())
}

fn ingest(a: IngestArgs) -> Result<()> {
    let model = load_model(&a.model, true)?;
    let location = a.db.location()?;
    let existing = picaso_store::Store::open(location.clone()).ok();
    let embedder = picaso_store::find_embedder(a.embedder.as_deref(), existing.as_ref())?;
    drop(existing);
    let docs = match (&a.text_dir, &a.jsonl, &a.wikitext) {
        (Some(d), _, _) => picaso_store::read_text_dir(d)?,
        (_, Some(f), _) => picaso_store::read_jsonl(f)?,
        (_, _, Some(f)) => picaso_store::read_wikitext(f)?,
        _ => bail!("give one of --text-dir, --jsonl or --wikitext"),
    };
    let info = picaso_store::StoreInfo {
        fingerprint: model.fingerprint().to_string(),
        dim: embedder.dim(),
        state_dtype: a.state_dtype.unwrap_or_default(),
    };
    let store = picaso_store::Store::open_or_create(location, &info)?;
    if let Some(want) = a.state_dtype {
        let kept = store.info().state_dtype;
        if want != kept {
            bail!(
                "store {} keeps its states in {}; --state-dtype {} would mix precisions in one store (leave the flag out, or ingest into a new store)",
                store.location(),
                format!("{kept:?}").to_lowercase(),
                format!("{want:?}").to_lowercase()
            );
        }
    }
    let bar = (!a.json).then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} contexts · {per_sec} · {msg} · ETA {eta}")
                .expect("valid template"),
        );
        bar
    });
    let report = picaso_store::ingest(&store, &model, &embedder, &docs, a.segment, a.batch, |p| {
        if let Some(bar) = &bar {
            bar.set_length(p.total as u64);
            bar.set_position(p.done as u64);
            bar.set_message(format!("{:.0} tokens/s", p.tokens as f64 / p.seconds.max(1e-9)));
        }
    })?;
    if let Some(bar) = bar {
        bar.finish();
    }
    // After the ingest: a run that fails part way removes nothing.
    let pruned = if a.prune { picaso_store::prune(&store, &docs)? } else { (0, 0) };
    let stats = store.stats()?;
    if a.json {
        println!(
            "{}",
            json!({
                "added": report.added(),
                "replaced": report.replaced,
                "repaired": report.repaired,
                "removed": report.removed,
                "skipped": report.skipped,
                "relabelled": report.relabelled,
                "pruned_documents": pruned.0,
                "pruned_contexts": pruned.1,
                "tokens": report.tokens,
                "seconds": report.seconds,
                "store": stats
            })
        );
    } else {
        let pruned = match pruned {
            (0, _) => String::new(),
            (d, c) => {
                format!(", pruned {} ({}) the source no longer has", counted(d, "document"), counted(c, "context"))
            }
        };
        println!(
            "{}{pruned}; the store holds {} from {}",
            report.summary(),
            counted(stats.contexts, "context"),
            counted(stats.documents, "document")
        );
    }
    Ok(())
}

fn stats(a: StatsArgs) -> Result<()> {
    let store = picaso_store::Store::open(a.db.location()?)?;
    let s = store.stats()?;
    if a.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!("contexts     {}", s.contexts);
        println!("documents    {}", s.documents);
        println!("tokens       {}", s.tokens);
        println!("state bytes  {} ({:.1} MiB)", s.state_bytes, s.state_bytes as f64 / 1048576.0);
        println!("model        {}", s.model);
        println!("catalog      {}", s.catalog);
        println!("states       {}", s.states);
    }
    Ok(())
}

/// A count that must be 1 or more (a flag's value).
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn query(a: QueryArgs) -> Result<()> {
    if a.method == Method::Naive && a.ids.as_ref().is_some_and(|ids| !ids.is_empty()) {
        bail!(
            "--method naive uses no context, so --ids would be ignored: drop --ids, or pick {}",
            Method::list(&Method::WITH_CONTEXT)
        );
    }
    if a.method == Method::Naive && !a.docs.is_empty() {
        bail!(
            "--method naive retrieves nothing, so --doc would be ignored: drop --doc, or pick {}",
            Method::list(&Method::WITH_CONTEXT)
        );
    }
    if a.method == Method::Naive && !a.filters.is_empty() {
        bail!(
            "--method naive retrieves nothing, so --filter would be ignored: drop --filter, or pick {}",
            Method::list(&Method::WITH_CONTEXT)
        );
    }
    let filter = (!a.filters.is_empty()).then(|| picaso_store::Filter::from_args(&a.filters)).transpose()?;
    let retriever = a.retriever.retriever()?;
    let store = picaso_store::Store::open(a.db.location()?)?;
    let model = load_model(&a.model, true)?;
    let t_retrieve = Instant::now();
    // The states read to generate, kept for --attribute (which would read them again: from S3,
    // a second download).
    let cache = picaso_store::StateCache::new(if a.attribute { usize::MAX } else { 0 });
    // The state to generate from. An answer given with --answer is not generated, so its
    // contexts are only looked up: attribution builds the states it scores.
    let prepare = |ids: &[i64]| match a.answer {
        Some(_) => Ok(None),
        None => picaso_store::prepare(&store, &model, ids, a.method, Some(&cache)).map(Some),
    };
    // Best first from retrieval; composition wants the most relevant last (nearest the prompt).
    let (hits, prepared): (Vec<(i64, Option<f32>)>, _) = match &a.ids {
        Some(ids) => (ids.iter().map(|&i| (i, None)).collect(), prepare(ids)?),
        None if a.method == Method::Naive => (Vec::new(), prepare(&[])?),
        None => {
            // BM25 needs no embedder: none is loaded.
            let embedder = match retriever.needs_embedding() {
                true => Some(picaso_store::find_embedder(a.embedder.as_deref(), Some(&store))?),
                false => None,
            };
            let q = match &embedder {
                Some(e) => e.embed_one(&a.prompt)?,
                None => Vec::new(),
            };
            let docs = (!a.docs.is_empty()).then_some(&a.docs[..]);
            let mut what = picaso_store::Retrieval::new(&q, a.k)
                .within(docs)
                .matching(filter.as_ref())
                .by(retriever, Some(&a.prompt));
            if let Some(e) = &embedder {
                what = what.embedded_by(e.fingerprint());
            }
            let (hits, prepared) = picaso_store::retrieve_then(&store, what, prepare)?;
            (hits.into_iter().map(|(i, s)| (i, Some(s))).collect(), prepared)
        }
    };
    // Retrieval is what the preparation did besides loading and composing.
    let ready = prepared.as_ref().map_or(0.0, |p| p.load_seconds + p.compose_seconds);
    let retrieve_seconds = (t_retrieve.elapsed().as_secs_f64() - ready).max(0.0);
    let ids: Vec<i64> = hits.iter().map(|h| h.0).collect();
    if let (true, Some(filter)) = (ids.is_empty(), &filter) {
        bail!(
            "no context of the store{} has metadata matching --filter {}: check the keys and values \
             (`picaso contexts --json` shows each context's metadata; values are compared as JSON, so \
             year=2024 does not match \"2024\", and a range compares numbers with numbers, strings with \
             strings){}",
            if a.docs.is_empty() { String::new() } else { format!(" within --doc {:?}", a.docs) },
            a.filters.join(" --filter "),
            if a.docs.is_empty() { contexts::why_none_match(&store, filter)? } else { String::new() }
        );
    }
    if ids.is_empty() && a.ids.is_none() && a.method != Method::Naive {
        if store.is_empty()? {
            eprintln!(
                "(the store holds no contexts: {} has nothing to combine, so this answers without context)",
                a.method.name()
            );
        } else {
            eprintln!(
                "(no context shares a term with the prompt, so bm25 retrieved none and this answers without context; \
                 --retriever dense or hybrid retrieves by meaning)"
            );
        }
    }
    let tokenizer = model.tokenizer()?;
    let prompt = tokenizer.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("the prompt must contain at least one token");
    }
    if a.attribute || a.answer.is_some() {
        if a.method == Method::Naive {
            bail!(
                "--attribute leaves each context out in turn, but naive uses none: pick {}",
                Method::list(&Method::WITH_CONTEXT)
            );
        }
        if ids.is_empty() {
            bail!("no contexts to attribute the answer to: retrieve some (--k) or name them (--ids)");
        }
    }
    // The answer: the one given, else generated (streamed to stdout unless --json).
    let (generation, answer) = match (&a.answer, &prepared) {
        (Some(answer), _) => {
            let tokens = tokenizer.encode(answer)?;
            if tokens.is_empty() {
                bail!("--answer {answer:?} has no tokens: give the text to attribute");
            }
            (None, tokens)
        }
        (None, None) => unreachable!("the state is prepared unless --answer is given"),
        (None, Some(prepared)) => {
            let opts = a.sampling.options();
            let t0 = Instant::now();
            let mut first = None;
            let mut out = std::io::stdout();
            let g = generate(&model, &prompt, &prepared.state, &opts, |piece| {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                // A closed stdout (`| head`) stops generation.
                a.json || out.write_all(piece.as_bytes()).and_then(|()| out.flush()).is_ok()
            })?;
            // The answer attributed is the text shown: a stop string's tokens are cut from it
            // (and may end mid-token), so its tokens are the text's own.
            let tokens = match g.stop_reason {
                picaso_model::StopReason::Stop => tokenizer.encode(&g.text)?,
                _ => g.tokens.clone(),
            };
            (Some((g, first)), tokens)
        }
    };
    let attribution = if a.attribute || a.answer.is_some() {
        if answer.is_empty() {
            eprintln!("(the answer is empty: nothing to attribute)");
            None
        } else {
            Some(picaso_store::attribute(&store, &model, &ids, a.method, &prompt, &answer, Some(&cache))?)
        }
    } else {
        None
    };
    let doc_of = |id: i64| store.get(id).map(|r| (r.doc, r.seg, r.text)).unwrap_or_default();
    if a.json {
        let contexts: Vec<_> = hits
            .iter()
            .enumerate()
            .map(|(i, (id, score))| {
                let (doc, metadata) = store.get(*id).map(|r| (r.doc, r.metadata)).unwrap_or_default();
                let mut c = json!({"id": id, "score": score, "doc": doc, "metadata": metadata});
                if let Some(at) = &attribution {
                    c["loglik_without"] = json!(at.without[i]);
                    c["drop"] = json!(at.drop(i));
                }
                c
            })
            .collect();
        let mut v = json!({"method": a.method.name(), "retriever": retriever.name(), "contexts": contexts, "retrieve_ms": 1e3 * retrieve_seconds});
        if let Some(p) = &prepared {
            v["load_ms"] = json!(1e3 * p.load_seconds);
            v["compose_ms"] = json!(1e3 * p.compose_seconds);
        }
        if let Some((g, first)) = &generation {
            v["time_to_first_token_ms"] = json!(first.map(|f| 1e3 * (ready + f)));
            v["text"] = json!(g.text);
            v["token_ids"] = json!(g.tokens);
            v["stop_reason"] = json!(g.stop_reason);
        }
        if let Some(at) = &attribution {
            v["attribution"] = json!({
                "answer": tokenizer.decode(&answer)?, "answer_tokens": at.answer_tokens, "loglik": at.loglik,
                "ranking": at.ranking().iter().map(|&i| ids[i]).collect::<Vec<_>>(), "ms": 1e3 * at.seconds,
            });
        }
        println!("{v}");
        return Ok(());
    }
    if let Some((_, first)) = &generation {
        println!();
        let first = first
            .map_or_else(|| "no token generated".into(), |f| format!("first token after {:.1} ms", 1e3 * (ready + f)));
        let sources: Vec<String> = ids
            .iter()
            .map(|&id| {
                let (doc, seg, _) = doc_of(id);
                format!("{id} ({doc} #{seg})")
            })
            .collect();
        let contexts =
            if sources.is_empty() { "no context".to_string() } else { format!("contexts {}", sources.join(", ")) };
        eprintln!("[{} · {contexts} · state ready in {:.1} ms · {first}]", a.method.name(), 1e3 * ready);
    }
    if let Some(at) = &attribution {
        print_attribution(at, &ids, doc_of);
    }
    Ok(())
}

/// The attribution table: the contexts, the one the answer owes most to first.
fn print_attribution(at: &picaso_store::Attribution, ids: &[i64], doc_of: impl Fn(i64) -> (String, u32, String)) {
    println!(
        "attribution: the answer's {} tokens have log-likelihood {:.3} nats with all {} contexts ({}); without each:",
        at.answer_tokens,
        at.loglik,
        ids.len(),
        at.method.name()
    );
    println!("  {:>10}  {:>6}  context", "drop nats", "id");
    for i in at.ranking() {
        let (doc, segment, text) = doc_of(ids[i]);
        println!("  {:>+10.3}  {:>6}  {doc} #{segment}: {}", at.drop(i), ids[i], demo::snippet(&text, 60));
    }
    eprintln!("[leave-one-out over {} in {:.1} ms]", counted(ids.len(), "context"), 1e3 * at.seconds);
}

#[cfg(test)]
mod tests {
    /// Clap checks the whole command tree (duplicate or conflicting argument names across
    /// flattened groups) only when asked; release builds would otherwise misparse silently.
    #[test]
    fn command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    /// A cause the message already ends with is said once; other causes are joined on.
    #[test]
    fn an_error_says_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory (os error 2)");
        let own = anyhow::Error::from(picaso_model::Error::Io { path: "/m/config.json".into(), source: io() });
        assert_eq!(super::error_message(&own), "/m/config.json: No such file or directory (os error 2)");
        let wrapped = anyhow::Error::from(io()).context("reading /m/config.json");
        assert_eq!(super::error_message(&wrapped), "reading /m/config.json: No such file or directory (os error 2)");
    }

    /// A backtrace inside a cause's text (candle's errors under `RUST_BACKTRACE=1`) follows the
    /// whole message instead of splitting it.
    #[test]
    fn a_backtrace_follows_the_message() {
        let trace = "\n   0: candle_core::error::Error::bt\n   1: picaso::main";
        let e = anyhow::anyhow!("lr = -1: must be above 0{trace}").context("--config c.json");
        assert_eq!(super::error_message(&e), format!("--config c.json: lr = -1: must be above 0{trace}"));
    }
}
