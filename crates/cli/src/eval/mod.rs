//! `picaso eval`: the experiments of picaso-eval, each writing results.json, results.csv and
//! results.md (with the command, revision, machine and wall time) into `--out`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use picaso_eval::report;

use crate::args::ModelArgs;

mod models;
mod paper;

#[derive(Subcommand)]
pub enum EvalCommand {
    /// The paper's WikiText experiment: continuation loss given k retrieved segments, per method.
    Wikitext(paper::WikitextArgs),
    /// The WikiText experiment with many more contexts (k up to 50, past the training length).
    Scaling(paper::ScalingArgs),
    /// OpenBookQA: multiple-choice accuracy with k facts retrieved from the open book.
    Openbookqa(paper::OpenbookqaArgs),
    /// Attribution on OpenBookQA: find each answer's gold fact among distractors, by
    /// leave-one-in and leave-one-out.
    Attribution(paper::AttributionArgs),
    /// Attribution on MS MARCO v2.1 (dev_v2.1.json): find the passages selected for the answer.
    Msmarco(paper::MsmarcoArgs),
    /// How much the order of n contexts changes the loss, for Concat, CASO, PICASO-R, PICASO-S.
    OrderSensitivity(paper::OrderArgs),
    /// Distance of each method's state and predictions to Concat's.
    Fidelity(paper::FidelityArgs),
    /// WikiText and OpenBookQA for several models (zero-shot and fine-tuned) side by side.
    Finetuned(models::FinetunedArgs),
    /// Does the model use context? Loss with the true previous paragraph vs none vs a random one.
    ContextUse(models::ContextUseArgs),
    /// Recall: facts spread over k contexts, a query about one, exact-match accuracy per
    /// method, per k and per position of the context that holds the key.
    Recall(models::RecallArgs),
    /// Rewrite a WikiText or scaling results folder's tables and charts from its results.json
    /// (after the report or the charts changed), keeping the run's command, revision and times.
    Replot(ReplotArgs),
}

#[derive(Args)]
pub struct ReplotArgs {
    /// The results folder (holds results.json).
    results: PathBuf,
}

fn parse_named(s: &str) -> std::result::Result<(String, String), String> {
    crate::args::parse_name_value(s, "NAME=DIR, e.g. bptc=runs/recall-bptc/model")
}

/// The database of (query, continuation) halves.
#[derive(Args)]
pub struct DataArgs {
    /// Store of WikiText paragraphs ingested with `--segment halves` (created from --data if
    /// missing).
    #[command(flatten)]
    db: crate::args::DbArgs,
    /// A WikiText file (e.g. wikitext-2/wiki.test.tokens) to ingest into --db first
    /// (idempotent: stored segments are skipped).
    #[arg(long)]
    data: Option<PathBuf>,
    /// all-MiniLM-L6-v2 folder, for ingesting --data (default: $PICASO_EMBEDDER, the store's
    /// own, the hub, or ../shared/data/all-MiniLM-L6-v2).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Shortest paragraph kept when ingesting (tokens; at least 2, one for each half).
    #[arg(long, default_value_t = picaso_store::sources::HALVES_MIN_TOKENS, value_parser = at_least_two)]
    min_tokens: usize,
    /// Codec of the states of a store made from --data: f32, bf16, int8 or int4 (default: an
    /// existing store's, f32 for a new one). An existing store in another codec is refused.
    #[arg(long)]
    state_dtype: Option<picaso_model::StateDtype>,
    /// A state budget for the store, MiB (as `ingest --state-budget-mb`): states it does not
    /// hold are recomputed when a passage retrieves them; the answers are the same. 0 removes
    /// a budget.
    #[arg(long)]
    state_budget_mb: Option<f64>,
    /// Which states the budget keeps: work (the default) or lru.
    #[arg(long, requires = "state_budget_mb")]
    state_budget_policy: Option<picaso_store::Policy>,
}

/// Which passages, and whether the states are recomputed.
#[derive(Args, Clone)]
pub struct Sampling {
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

/// The OpenBookQA release folder and the retriever.
#[derive(Args)]
struct ObqaData {
    /// OpenBookQA's Data/Main folder (openbook.txt, test.jsonl; Additional/ beside or inside it
    /// for the gold facts).
    #[arg(long)]
    data: PathBuf,
    /// all-MiniLM-L6-v2 folder (retrieval of facts by similarity to the question; default:
    /// $PICASO_EMBEDDER, the hub, or ../shared/data/all-MiniLM-L6-v2).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Split: test or dev (the release's train split is for training, not evaluation).
    #[arg(long, default_value = "test", value_parser = picaso_eval::openbookqa::SPLITS)]
    split: String,
}

pub fn run(cmd: EvalCommand) -> Result<()> {
    match cmd {
        EvalCommand::Wikitext(a) => paper::wikitext(a),
        EvalCommand::Scaling(a) => paper::scaling(a),
        EvalCommand::Openbookqa(a) => paper::openbookqa(a),
        EvalCommand::Attribution(a) => paper::attribution(a),
        EvalCommand::Msmarco(a) => paper::msmarco(a),
        EvalCommand::OrderSensitivity(a) => paper::order(a),
        EvalCommand::Fidelity(a) => paper::fidelity(a),
        EvalCommand::Finetuned(a) => models::finetuned(a),
        EvalCommand::ContextUse(a) => models::context_use(a),
        EvalCommand::Recall(a) => models::recall(a),
        EvalCommand::Replot(a) => {
            report::rewrite_wikitext(&a.results)?;
            print_results(&a.results)
        }
    }
}

/// Refuses an `--out` that is a file, before any work (the results go into a folder; creating
/// it would fail with "File exists" once the work is done).
fn check_out(out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        bail!("--out {}: a file, not a folder; give a folder for the results", out.display());
    }
    Ok(())
}

/// Checks the names models are given (`--name`, `--compare NAME=DIR`, `--models NAME=DIR`).
/// Each names a folder or file under --out, so it must be a plain name: not empty, `.` or `..`,
/// and without a path separator, which would write outside --out; and each must be unique, or
/// one model's results would overwrite another's. Refused rather than renamed, so that the
/// folders are called what the user typed.
/// A paragraph split into a query half and a continuation half needs a token for each.
fn at_least_two(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n < 2 => Err("must be at least 2: each half of a paragraph needs a token".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn check_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        if name.is_empty() || name == "." || name == ".." || name.contains(['/', '\\']) {
            bail!(
                "model name {name:?}: it names the model's results under --out; give a plain name (not empty, . or .., without / or \\)"
            );
        }
        if !seen.insert(name) {
            bail!("model name {name:?}: the name is already taken; give each model its own");
        }
    }
    Ok(())
}

/// Refuses to ingest --data into a store cut otherwise than the eval would cut it, in the
/// eval's own terms: the store's message names ingest's --segment, which the eval has not.
fn check_segmentation(store: &picaso_store::Store, min_tokens: usize) -> Result<()> {
    let wanted = picaso_store::Segmentation::Halves(min_tokens).to_string();
    match store.segmentation()? {
        Some(s) if s != wanted => match s.strip_prefix("halves:") {
            Some(n) => bail!(
                "--db {}: the store's paragraphs were ingested with --min-tokens {n}, not {min_tokens}; pass --min-tokens {n}, or a new --db",
                store.location()
            ),
            None => bail!(
                "--db {}: the store was ingested with segmentation {s}, not halves; give a new --db to ingest --data into",
                store.location()
            ),
        },
        _ => Ok(()),
    }
}

/// Opens the store, ingesting --data into it first when given.
fn open_store(d: &DataArgs, model: &picaso_model::Model) -> Result<picaso_store::Store> {
    if let Some(data) = &d.data {
        let existing = picaso_store::Store::open(d.db.location()?).ok();
        if let Some(store) = &existing {
            check_segmentation(store, d.min_tokens)?;
        }
        let embedder = picaso_store::find_embedder(d.embedder.as_deref(), existing.as_ref())?;
        drop(existing);
        let docs = picaso_store::read_wikitext(data)?;
        let info = picaso_store::StoreInfo {
            fingerprint: model.fingerprint().to_string(),
            dim: embedder.dim(),
            state_dtype: d.state_dtype.unwrap_or_default(),
        };
        let store = picaso_store::Store::open_or_create(d.db.location()?, &info)?;
        if let Some(want) = d.state_dtype {
            store.require_state_dtype(want)?;
        }
        crate::args::apply_state_budget(&store, model, d.state_budget_mb, d.state_budget_policy)?;
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
        eprintln!("{}: {}", store.location(), r.summary());
        return Ok(store);
    }
    let store = picaso_store::Store::open(d.db.location()?)
        .with_context(|| format!("--db {}: pass --data FILE to build the store", d.db.db))?;
    if let Some(want) = d.state_dtype {
        store.require_state_dtype(want)?;
    }
    crate::args::apply_state_budget(&store, model, d.state_budget_mb, d.state_budget_policy)?;
    Ok(store)
}

fn progress(what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!("{{bar:30}} {{pos}}/{{len}} {what} · ETA {{eta}}"))
            .expect("valid template"),
    );
    bar
}

/// Runs an experiment with a progress bar over its items.
fn with_progress<T>(what: &str, f: impl FnOnce(&mut dyn FnMut(usize, usize)) -> T) -> T {
    let bar = progress(what);
    let out = f(&mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    out
}

fn print_results(out: &std::path::Path) -> Result<()> {
    print!("{}", std::fs::read_to_string(out.join("results.md"))?);
    Ok(())
}

/// The k to score: `--ks` if given, else 1..=`--max-k`.
fn ks_or_up_to(ks: &Option<Vec<usize>>, max_k: usize) -> Vec<usize> {
    ks.clone().unwrap_or_else(|| (1..=max_k).collect())
}

/// Where an experiment journals its finished passages, so that a stopped run resumes: in its
/// results folder until the report is written.
fn journal(out: &std::path::Path) -> PathBuf {
    out.join("journal.jsonl")
}

/// Keeps a finished run's journal as `passages.jsonl`: every passage's figures, for paired
/// comparisons the report does not make (a rerun into the same folder starts afresh).
fn finish_journal(out: &std::path::Path) -> Result<()> {
    match std::fs::rename(journal(out), out.join("passages.jsonl")) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
        _ => Ok(()),
    }
}

/// An experiment over a store of halves: loads the model and the store, runs `run` with a
/// progress bar over passages, writes the report with `write`, and prints its table.
fn store_experiment<R>(
    data: &DataArgs,
    model: &ModelArgs,
    out: &std::path::Path,
    run: impl FnOnce(&picaso_model::Model, &picaso_store::Store, &mut dyn FnMut(usize, usize)) -> Result<R>,
    write: impl FnOnce(&std::path::Path, &R, &report::RunInfo) -> picaso_eval::Result<()>,
) -> Result<()> {
    let started = Instant::now();
    check_out(out)?;
    let model = crate::args::load_model(model, true)?;
    let store = open_store(data, &model)?;
    let r = with_progress("passages", |p| run(&model, &store, p))?;
    write(out, &r, &report::RunInfo::collect(started))?;
    finish_journal(out)?;
    print_results(out)
}

fn parse_range(s: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| x.trim().parse::<usize>().ok();
    match s.split_once('-').map(|(a, b)| (parse(a), parse(b))) {
        Some((Some(lo), Some(hi))) => Ok((lo, hi)),
        _ => match parse(s) {
            Some(n) => Ok((n, n)),
            None => bail!("--distractors {s:?}: give MIN-MAX (e.g. 4-9) or one number"),
        },
    }
}
