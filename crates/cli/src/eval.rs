//! `picaso eval`: the experiments of picaso-eval, each writing results.json, results.csv and
//! results.md (with the command, revision, machine and wall time) into `--out`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use picaso_eval::{report, EvalMethod};

use crate::ModelArgs;

#[derive(Subcommand)]
pub enum EvalCommand {
    /// The paper's WikiText experiment: continuation loss given k retrieved segments, per method.
    Wikitext(WikitextArgs),
    /// Does the model use context? Loss with the true previous paragraph vs none vs a random one.
    ContextUse(ContextUseArgs),
}

/// The database of (query, continuation) halves.
#[derive(Args)]
pub struct DataArgs {
    /// Store of WikiText paragraphs ingested with `--segment halves` (created from --data if
    /// missing).
    #[arg(long)]
    db: PathBuf,
    /// A WikiText file (e.g. wikitext-2/wiki.test.tokens) to ingest into --db first
    /// (idempotent: stored segments are skipped).
    #[arg(long, requires = "embedder")]
    data: Option<PathBuf>,
    /// all-MiniLM-L6-v2 folder, for ingesting --data.
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Shortest paragraph kept when ingesting (tokens).
    #[arg(long, default_value_t = picaso_store::sources::HALVES_MIN_TOKENS)]
    min_tokens: usize,
}

#[derive(Args)]
pub struct WikitextArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Score k = 1..=MAX_K retrieved segments.
    #[arg(long, default_value_t = 10)]
    max_k: usize,
    /// Methods besides naive (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "concat,piconcat-r,soup,caso,picaso-s,picaso-r")]
    methods: Vec<EvalMethod>,
    /// Score this many passages drawn with --seed (default: all).
    #[arg(long)]
    sample: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Recompute the contexts' states with --model from the stored tokens (evaluate another
    /// model, e.g. a fine-tuned one, on a store ingested once; retrieval is unchanged).
    #[arg(long)]
    restate: bool,
}

#[derive(Args)]
pub struct ContextUseArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Passages to score (drawn with --seed among those with a stored previous paragraph).
    #[arg(long, default_value_t = 500)]
    sample: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(cmd: EvalCommand) -> Result<()> {
    match cmd {
        EvalCommand::Wikitext(a) => wikitext(a),
        EvalCommand::ContextUse(a) => context_use(a),
    }
}

/// Opens the store, ingesting --data into it first when given.
fn open_store(d: &DataArgs, model: &picaso_model::Model) -> Result<picaso_store::Store> {
    if let Some(data) = &d.data {
        let embedder = crate::load_embedder(d.embedder.as_ref().context("--data needs --embedder")?)?;
        let docs = picaso_store::read_wikitext(data)?;
        let info = picaso_store::StoreInfo {
            fingerprint: model.fingerprint().to_string(),
            dim: embedder.dim(),
            state_dtype: picaso_model::StateDtype::F32,
        };
        let store = picaso_store::Store::open_or_create(&d.db, &info)?;
        let bar = progress("contexts");
        let r = picaso_store::ingest(
            &store,
            model,
            &embedder,
            &docs,
            picaso_store::Segmentation::Halves(d.min_tokens),
            64,
            |p| {
                bar.set_length(p.total as u64);
                bar.set_position(p.done as u64);
            },
        )?;
        bar.finish_and_clear();
        eprintln!("{}: {} contexts added ({} already stored)", d.db.display(), r.done, r.skipped);
        return Ok(store);
    }
    if !d.db.join("store.sqlite").is_file() {
        bail!("--db {}: no store there; pass --data FILE --embedder DIR to build it", d.db.display());
    }
    Ok(picaso_store::Store::open(&d.db)?)
}

fn progress(what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!("{{bar:30}} {{pos}}/{{len}} {what} · ETA {{eta}}"))
            .expect("valid template"),
    );
    bar
}

fn wikitext(a: WikitextArgs) -> Result<()> {
    let started = Instant::now();
    let model = crate::load_model(&a.model, true)?;
    let store = open_store(&a.data, &model)?;
    let options = picaso_eval::wikitext::Options {
        max_k: a.max_k,
        methods: a.methods.clone(),
        sample: a.sample,
        seed: a.seed,
        restate: a.restate,
    };
    let bar = progress("passages");
    let r = picaso_eval::wikitext::run(&model, &store, &options, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    report::write_wikitext(&a.out, &r, &report::RunInfo::collect(started))?;
    print!("{}", std::fs::read_to_string(a.out.join("results.md"))?);
    Ok(())
}

fn context_use(a: ContextUseArgs) -> Result<()> {
    let started = Instant::now();
    let model = crate::load_model(&a.model, true)?;
    let store = open_store(&a.data, &model)?;
    let r = picaso_eval::context_use::run(&model, &store, a.sample, a.seed)?;
    report::write_context_use(&a.out, &r, &report::RunInfo::collect(started))?;
    print!("{}", std::fs::read_to_string(a.out.join("results.md"))?);
    Ok(())
}
