//! The `picaso` command: a thin shell over the library crates. Parses flags, calls the library,
//! prints text or JSON. Errors print one line to stderr and exit with status 1 (2 for usage).

use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

mod args;
mod backends;
mod bench;
mod contexts;
mod demo;
mod eval;
mod ingest;
mod model;
mod query;
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
    Info(model::InfoArgs),
    /// Log-probabilities of a token sequence, optionally continuing from a saved state.
    Score(model::ScoreArgs),
    /// Process tokens and save the state after them.
    State(model::StateArgs),
    /// Generate text from a prompt, optionally continuing from a saved state.
    Generate(model::GenerateArgs),
    /// Compose saved states into one (soup, caso, picaso-s, picaso-r).
    Compose(model::ComposeArgs),
    /// Print the composition weights for scalar log-decays (for inspection and teaching).
    Weights(model::WeightsArgs),
    /// Measure prefill, scoring, decode and composition throughput.
    Bench(bench::BenchArgs),
    /// Write a model folder with random weights of a known shape (for speed benchmarks of the
    /// server or of peers: the same weights for every engine).
    RandomModel(bench::RandomModelArgs),
    /// What k contexts cost at query time: composing their stored states vs processing them.
    BenchContext(bench::BenchContextArgs),
    /// Bytes per context and composition time of every state codec (f32, bf16, int8, int4)
    /// at a model's shape, against the floor of reading the bytes.
    BenchCodecs(bench::BenchCodecsArgs),
    /// A Zipf workload of queries against stores that keep every state, keep a state budget
    /// (work and LRU policies) and against Concat: hit rate, time to first token, bytes read.
    BenchBudget(bench::BenchBudgetArgs),
    /// Add documents to a store of states (idempotent, resumable).
    Ingest(ingest::IngestArgs),
    /// Totals of a store.
    Stats(ingest::StatsArgs),
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
    Query(query::QueryArgs),
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
    /// Render one chat template sent with a request, under memory and CPU limits (a job on
    /// stdin, its results on stdout): `picaso serve --trust-request-chat-template` runs it.
    #[command(hide = true)]
    RenderTemplate,
    /// Train a model: pretraining, composition fine-tuning (BPTC / BP2C), loss charts.
    #[command(subcommand)]
    Train(train::TrainCommand),
    /// Run an experiment (the paper's WikiText, OpenBookQA, attribution and more) and write its report.
    #[command(subcommand)]
    Eval(eval::EvalCommand),
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
        Command::Info(a) => model::info(a),
        Command::Score(a) => model::score(a),
        Command::State(a) => model::state(a),
        Command::Generate(a) => model::generate_cmd(a),
        Command::Compose(a) => model::compose_cmd(a),
        Command::Weights(a) => model::weights_cmd(a),
        Command::Bench(a) => bench::bench(a),
        Command::RandomModel(a) => bench::random_model(a),
        Command::BenchContext(a) => bench::bench_context(a),
        Command::BenchCodecs(a) => bench::bench_codecs(a),
        Command::BenchBudget(a) => bench::bench_budget(a),
        Command::Ingest(a) => ingest::ingest(a),
        Command::Stats(a) => ingest::stats(a),
        Command::Documents(a) => contexts::documents(a),
        Command::Contexts(a) => contexts::list(a),
        Command::Delete(a) => contexts::delete(a),
        Command::Check(a) => contexts::check(a),
        Command::Query(a) => query::query(a),
        Command::Migrate(a) => backends::migrate(a),
        Command::Index(a) => backends::index(a),
        Command::BenchStore(a) => backends::bench_store(a),
        Command::Serve(a) => serve::serve(a),
        Command::Load(a) => serve::load(a),
        Command::RenderTemplate => std::process::exit(picaso_server::render::sandbox_main()),
        Command::Train(c) => train::run(c),
        Command::Eval(c) => eval::run(c),
        Command::Demo(a) => demo::run(a),
    }
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
