//! `picaso eval`: the experiments of picaso-eval, each writing results.json, results.csv and
//! results.md (with the command, revision, machine and wall time) into `--out`.

use picaso_model::counted;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use picaso_eval::{report, Method};

use crate::args::ModelArgs;

#[derive(Subcommand)]
pub enum EvalCommand {
    /// The paper's WikiText experiment: continuation loss given k retrieved segments, per method.
    Wikitext(WikitextArgs),
    /// The WikiText experiment with many more contexts (k up to 50, past the training length).
    Scaling(ScalingArgs),
    /// OpenBookQA: multiple-choice accuracy with k facts retrieved from the open book.
    Openbookqa(OpenbookqaArgs),
    /// Attribution on OpenBookQA: find each answer's gold fact among distractors, by
    /// leave-one-in and leave-one-out.
    Attribution(AttributionArgs),
    /// Attribution on MS MARCO v2.1 (dev_v2.1.json): find the passages selected for the answer.
    Msmarco(MsmarcoArgs),
    /// How much the order of n contexts changes the loss, for Concat, CASO, PICASO-R, PICASO-S.
    OrderSensitivity(OrderArgs),
    /// Distance of each method's state and predictions to Concat's.
    Fidelity(FidelityArgs),
    /// WikiText and OpenBookQA for several models (zero-shot and fine-tuned) side by side.
    Finetuned(FinetunedArgs),
    /// Does the model use context? Loss with the true previous paragraph vs none vs a random one.
    ContextUse(ContextUseArgs),
    /// Recall: facts spread over k contexts, a query about one, exact-match accuracy per
    /// method, per k and per position of the context that holds the key.
    Recall(RecallArgs),
    /// Rewrite a WikiText or scaling results folder's tables and charts from its results.json
    /// (after the report or the charts changed), keeping the run's command, revision and times.
    Replot(ReplotArgs),
}

#[derive(Args)]
pub struct ReplotArgs {
    /// The results folder (holds results.json).
    results: PathBuf,
}

#[derive(Args)]
pub struct RecallArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Name of --model in the tables (default: its folder's name).
    #[arg(long)]
    name: Option<String>,
    /// Another model scored on the same queries, NAME=DIR (e.g. a fine-tuned one); repeat for
    /// several. Its differences to --model are paired per query.
    #[arg(long, value_parser = parse_named)]
    compare: Vec<(String, String)>,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// synthetic (keys k0…, values v0…: the model's tokenizer must hold that vocabulary, as a
    /// recall-trained model's does) or natural ("The code of Velmora is 4812.", any model).
    #[arg(long, default_value = "synthetic")]
    form: picaso_eval::recall::Form,
    /// Numbers of contexts (comma-separated, ascending).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    ks: Vec<usize>,
    /// Facts per context.
    #[arg(long, default_value_t = 4)]
    facts: usize,
    /// Invented names to draw keys from (natural form; the synthetic form uses the model's keys).
    #[arg(long, default_value_t = 1000)]
    keys: usize,
    /// Episodes (sets of k contexts) per k.
    #[arg(long, default_value_t = 100)]
    episodes: usize,
    /// Queries per episode (they cycle through the context positions).
    #[arg(long, default_value_t = 4)]
    queries: usize,
    /// Orders each episode's contexts are scored in (order spread; 1 = the generated order).
    #[arg(long, default_value_t = 2)]
    orders: usize,
    /// Distractor values the answer competes with (at least 1; at most the task's values − 1).
    #[arg(long, default_value_t = 9)]
    distractors: usize,
    /// Methods (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "naive,concat,piconcat-r,soup,caso,picaso-s,picaso-r")]
    methods: Vec<Method>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
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
    /// Score these k instead (comma-separated, ascending), e.g. 1,2,5,10.
    #[arg(long, value_delimiter = ',', conflicts_with = "max_k")]
    ks: Option<Vec<usize>>,
    /// Methods besides naive (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "concat,piconcat-r,soup,caso,picaso-s,picaso-r")]
    methods: Vec<Method>,
    #[command(flatten)]
    retriever: crate::retriever::RetrieverArgs,
    #[command(flatten)]
    sampling: Sampling,
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

#[derive(Args)]
pub struct ScalingArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Numbers of retrieved segments (comma-separated, ascending).
    #[arg(long, value_delimiter = ',', default_value = "1,2,5,10,20,30,40,50")]
    ks: Vec<usize>,
    /// Methods besides naive (PIConcat-R is left out by default: it processes k × k segments).
    #[arg(long, value_delimiter = ',', default_value = "concat,soup,caso,picaso-s,picaso-r")]
    methods: Vec<Method>,
    #[command(flatten)]
    sampling: Sampling,
}

/// The OpenBookQA release folder and the retriever.
#[derive(Args)]
pub struct ObqaData {
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

#[derive(Args)]
pub struct OpenbookqaArgs {
    #[command(flatten)]
    data: ObqaData,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Numbers of retrieved facts (comma-separated, ascending).
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,5,10")]
    ks: Vec<usize>,
    /// Methods besides naive.
    #[arg(long, value_delimiter = ',', default_value = "concat,piconcat-r,soup,caso,picaso-s,picaso-r")]
    methods: Vec<Method>,
    /// Score this many questions drawn with --seed (default: all).
    #[arg(long)]
    sample: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
pub struct AttributionArgs {
    #[command(flatten)]
    data: ObqaData,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Distractors per question, drawn uniformly from MIN-MAX.
    #[arg(long, default_value = "4-9")]
    distractors: String,
    /// Leave-one-out methods.
    #[arg(long, value_delimiter = ',', default_value = "concat,soup,caso,picaso-r,picaso-s")]
    methods: Vec<Method>,
    /// Score this many questions drawn with --seed (default: all).
    #[arg(long)]
    sample: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
pub struct MsmarcoArgs {
    /// MS MARCO v2.1 JSON (dev_v2.1.json from <https://microsoft.github.io/msmarco/>).
    #[arg(long)]
    data: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Leave-one-out methods.
    #[arg(long, value_delimiter = ',', default_value = "concat,soup,caso,picaso-r,picaso-s")]
    methods: Vec<Method>,
    /// Score this many queries drawn with --seed (default: all).
    #[arg(long)]
    sample: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
pub struct OrderArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Numbers of contexts (comma-separated, each at least 2).
    #[arg(long, value_delimiter = ',', default_value = "2,3,4,5,6")]
    ns: Vec<usize>,
    /// Orders per passage and n (all n! when fewer).
    #[arg(long, default_value_t = 10)]
    orders: usize,
    #[command(flatten)]
    sampling: Sampling,
}

#[derive(Args)]
pub struct FidelityArgs {
    #[command(flatten)]
    data: DataArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Numbers of retrieved segments (comma-separated, ascending).
    #[arg(long, value_delimiter = ',', default_value = "1,2,5,10")]
    ks: Vec<usize>,
    /// Methods compared with Concat.
    #[arg(long, value_delimiter = ',', default_value = "naive,piconcat-r,soup,caso,picaso-s,picaso-r")]
    methods: Vec<Method>,
    #[command(flatten)]
    sampling: Sampling,
}

#[derive(Args)]
pub struct FinetunedArgs {
    #[command(flatten)]
    data: DataArgs,
    /// OpenBookQA's Data/Main folder.
    #[arg(long)]
    obqa: PathBuf,
    /// Models to compare: NAME=DIR, comma-separated (e.g. zero-shot=models/picaso-mamba2,bptc=runs/bptc/model).
    #[arg(long, value_delimiter = ',', required = true)]
    models: Vec<String>,
    /// Results folder (one sub-folder per model and experiment, and the comparison).
    #[arg(long)]
    out: PathBuf,
    /// WikiText: k = 1..=MAX_K.
    #[arg(long, default_value_t = 10)]
    max_k: usize,
    /// WikiText: score these k instead (comma-separated, ascending), e.g. `10` to score every
    /// passage at one k in a tenth of the time.
    #[arg(long, value_delimiter = ',', conflicts_with = "max_k")]
    ks: Option<Vec<usize>>,
    /// OpenBookQA: numbers of retrieved facts.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,5,10")]
    obqa_ks: Vec<usize>,
    /// Methods besides naive.
    #[arg(long, value_delimiter = ',', default_value = "concat,soup,caso,picaso-s,picaso-r")]
    methods: Vec<Method>,
    /// WikiText passages to score (drawn with --seed); OpenBookQA scores all 500 questions.
    #[arg(long)]
    sample: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Args)]
pub struct ContextUseArgs {
    /// A WikiText file (raw `wiki.test.raw` or tokenized `wiki.test.tokens`; detokenized as
    /// lm-evaluation-harness does).
    #[arg(long, conflicts_with = "wikipedia")]
    wikitext: Option<PathBuf>,
    /// A `wikipedia` corpus file (`articles.txt.gz`): its held-out articles (see --held-out-every).
    #[arg(long)]
    wikipedia: Option<PathBuf>,
    /// With --wikipedia: article i is held out when i % N == N − 1 (what `train pretrain` holds
    /// out with val_fraction 1/N).
    #[arg(long, default_value_t = 100)]
    held_out_every: usize,
    #[command(flatten)]
    model: ModelArgs,
    /// Name of --model in the comparison tables (default: its folder's name).
    #[arg(long)]
    name: Option<String>,
    /// Another model scored on the same passages, NAME=DIR; repeat for several. Its results go
    /// to OUT/NAME, its differences to --model (paired per passage) to OUT/comparison.*.
    #[arg(long, value_parser = parse_named)]
    compare: Vec<(String, String)>,
    /// Results folder.
    #[arg(long)]
    out: PathBuf,
    /// Passages to score, drawn with --seed (default: every eligible paragraph).
    #[arg(long)]
    sample: Option<usize>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

pub fn run(cmd: EvalCommand) -> Result<()> {
    match cmd {
        EvalCommand::Wikitext(a) => wikitext(a),
        EvalCommand::Scaling(a) => scaling(a),
        EvalCommand::Openbookqa(a) => openbookqa(a),
        EvalCommand::Attribution(a) => attribution(a),
        EvalCommand::Msmarco(a) => msmarco(a),
        EvalCommand::OrderSensitivity(a) => order(a),
        EvalCommand::Fidelity(a) => fidelity(a),
        EvalCommand::Finetuned(a) => finetuned(a),
        EvalCommand::ContextUse(a) => context_use(a),
        EvalCommand::Recall(a) => recall(a),
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
            state_dtype: picaso_model::StateDtype::F32,
        };
        let store = picaso_store::Store::open_or_create(d.db.location()?, &info)?;
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
    picaso_store::Store::open(d.db.location()?)
        .with_context(|| format!("--db {}: pass --data FILE to build the store", d.db.db))
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

#[allow(clippy::too_many_arguments)]
fn run_wikitext(
    model: &picaso_model::Model,
    store: &picaso_store::Store,
    ks: Vec<usize>,
    methods: &[Method],
    retriever: picaso_store::Retriever,
    s: &Sampling,
    out: &std::path::Path,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<picaso_eval::wikitext::Report> {
    let options = picaso_eval::wikitext::Options {
        ks,
        methods: methods.to_vec(),
        sample: s.sample,
        seed: s.seed,
        restate: s.restate,
        retriever,
        journal: Some(journal(out)),
    };
    Ok(picaso_eval::wikitext::run(model, store, &options, progress)?)
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

/// Removes a finished run's journal (its results are in the report now).
fn finish_journal(out: &std::path::Path) -> Result<()> {
    match std::fs::remove_file(journal(out)) {
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

fn wikitext(a: WikitextArgs) -> Result<()> {
    let ks = ks_or_up_to(&a.ks, a.max_k);
    let retriever = a.retriever.retriever()?;
    store_experiment(
        &a.data,
        &a.model,
        &a.out,
        |m, s, p| run_wikitext(m, s, ks, &a.methods, retriever, &a.sampling, &a.out, p),
        report::write_wikitext,
    )
}

fn scaling(a: ScalingArgs) -> Result<()> {
    store_experiment(
        &a.data,
        &a.model,
        &a.out,
        |m, s, p| run_wikitext(m, s, a.ks.clone(), &a.methods, picaso_store::Retriever::Dense, &a.sampling, &a.out, p),
        report::write_wikitext,
    )
}

/// Loads OpenBookQA, checks the settings against it with `check` (it needs only the data, so
/// a bad setting is refused before the slow part), then builds the open book's states and
/// embeds the questions.
fn obqa_prepare(
    d: &ObqaData,
    model: &picaso_model::Model,
    check: impl FnOnce(&picaso_eval::openbookqa::Data) -> picaso_eval::Result<()>,
) -> Result<(picaso_eval::openbookqa::FactBase, picaso_eval::openbookqa::Prepared)> {
    use picaso_eval::openbookqa;
    let data = openbookqa::load(&d.data, &d.split)?;
    check(&data)?;
    let embedder = picaso_store::find_embedder(d.embedder.as_deref(), None)?;
    eprintln!(
        "{}, {}: processing and embedding",
        counted(data.facts.len(), "fact"),
        counted(data.questions.len(), "question")
    );
    let base = openbookqa::FactBase::build(model, &embedder, &data.facts)?;
    let prepared = openbookqa::Prepared::new(model, &embedder, data.questions)?;
    Ok((base, prepared))
}

fn run_openbookqa(
    model: &picaso_model::Model,
    d: &ObqaData,
    options: &picaso_eval::openbookqa::Options,
) -> Result<picaso_eval::openbookqa::Report> {
    let (base, prepared) = obqa_prepare(d, model, |data| options.check(data.facts.len()))?;
    Ok(with_progress("questions", |p| picaso_eval::openbookqa::run(model, &base, &prepared, options, p))?)
}

fn openbookqa(a: OpenbookqaArgs) -> Result<()> {
    let started = Instant::now();
    check_out(&a.out)?;
    let model = crate::args::load_model(&a.model, true)?;
    let options = picaso_eval::openbookqa::Options {
        split: a.data.split.clone(),
        ks: a.ks,
        methods: a.methods,
        sample: a.sample,
        seed: a.seed,
    };
    let r = run_openbookqa(&model, &a.data, &options)?;
    report::write_openbookqa(&a.out, &r, &report::RunInfo::collect(started))?;
    print_results(&a.out)
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

fn attribution(a: AttributionArgs) -> Result<()> {
    let started = Instant::now();
    check_out(&a.out)?;
    let model = crate::args::load_model(&a.model, true)?;
    let options = picaso_eval::openbookqa::AttributionOptions {
        distractors: parse_range(&a.distractors)?,
        methods: a.methods,
        sample: a.sample,
        seed: a.seed,
    };
    let (base, prepared) = obqa_prepare(&a.data, &model, |data| options.check(data.facts.len()))?;
    let r =
        with_progress("questions", |p| picaso_eval::openbookqa::attribution(&model, &base, &prepared, &options, p))?;
    report::write_attribution(&a.out, &r, &report::RunInfo::collect(started))?;
    print_results(&a.out)
}

fn msmarco(a: MsmarcoArgs) -> Result<()> {
    let started = Instant::now();
    check_out(&a.out)?;
    picaso_eval::wikitext::check_sample(a.sample)?;
    let model = crate::args::load_model(&a.model, true)?;
    let data = picaso_eval::msmarco::load(&a.data)?;
    let r = with_progress("queries", |p| {
        picaso_eval::msmarco::attribution(&model, &data, &a.methods, a.sample, a.seed, p)
    })?;
    report::write_attribution(&a.out, &r, &report::RunInfo::collect(started))?;
    print_results(&a.out)
}

fn order(a: OrderArgs) -> Result<()> {
    let options = picaso_eval::order::Options {
        ns: a.ns,
        orders: a.orders,
        sample: a.sampling.sample,
        seed: a.sampling.seed,
        restate: a.sampling.restate,
    };
    store_experiment(
        &a.data,
        &a.model,
        &a.out,
        |m, s, p| Ok(picaso_eval::order::run(m, s, &options, p)?),
        report::write_order,
    )
}

fn fidelity(a: FidelityArgs) -> Result<()> {
    let options = picaso_eval::fidelity::Options {
        ks: a.ks,
        methods: a.methods,
        sample: a.sampling.sample,
        seed: a.sampling.seed,
        restate: a.sampling.restate,
    };
    store_experiment(
        &a.data,
        &a.model,
        &a.out,
        |m, s, p| Ok(picaso_eval::fidelity::run(m, s, &options, p)?),
        report::write_fidelity,
    )
}

fn finetuned(a: FinetunedArgs) -> Result<()> {
    let started = Instant::now();
    check_out(&a.out)?;
    let named = a
        .models
        .iter()
        .map(|m| crate::args::parse_name_value(m, "NAME=DIR, e.g. bptc=runs/bptc/model").map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    check_names(named.iter().map(|(name, _)| name.as_str()))?;
    let obqa = ObqaData { data: a.obqa.clone(), embedder: a.data.embedder.clone(), split: "test".into() };
    // Every model but the store's own recomputes the states from the stored tokens.
    let sampling = Sampling { sample: a.sample, seed: a.seed, restate: true };
    let ks = ks_or_up_to(&a.ks, a.max_k);
    // Settings refused before the first model is scored, not after it (OpenBookQA comes last).
    picaso_eval::wikitext::check_ks(&ks)?;
    picaso_eval::wikitext::check_sample(a.sample)?;
    let obqa_options = picaso_eval::openbookqa::Options {
        split: obqa.split.clone(),
        ks: a.obqa_ks.clone(),
        methods: a.methods.clone(),
        sample: None,
        seed: a.seed,
    };
    obqa_options.check(picaso_eval::openbookqa::load(&obqa.data, &obqa.split)?.facts.len())?;
    let mut results = Vec::new();
    for (name, dir) in &named {
        eprintln!("== {name}: {dir}");
        let margs = ModelArgs::for_dir(dir);
        let model = crate::args::load_model(&margs, true)?;
        let store = open_store(&a.data, &model)?;
        let wt = a.out.join(name).join("wikitext");
        let w = with_progress("passages", |p| {
            run_wikitext(&model, &store, ks.clone(), &a.methods, picaso_store::Retriever::Dense, &sampling, &wt, p)
        })?;
        // The journal stays until the comparison is written: it holds the per-passage losses
        // that pair this model with the others, so a run stopped at a later model resumes
        // without scoring this one again.
        report::write_wikitext(&wt, &w, &report::RunInfo::collect(started))?;
        let q = run_openbookqa(&model, &obqa, &obqa_options)?;
        report::write_openbookqa(&a.out.join(name).join("openbookqa"), &q, &report::RunInfo::collect(started))?;
        results.push((name.clone(), w, q));
    }
    let models: Vec<report::ModelResults<'_>> =
        results.iter().map(|(name, w, q)| report::ModelResults { name, wikitext: w, openbookqa: q }).collect();
    report::write_finetuned(&a.out, &models, &report::RunInfo::collect(started))?;
    for (name, _) in &named {
        finish_journal(&a.out.join(name).join("wikitext"))?;
    }
    print_results(&a.out)
}

fn context_use(a: ContextUseArgs) -> Result<()> {
    let started = Instant::now();
    check_out(&a.out)?;
    check_names(a.name.as_deref().into_iter().chain(a.compare.iter().map(|(name, _)| name.as_str())))?;
    picaso_eval::wikitext::check_sample(a.sample)?;
    let (source, docs) = match (&a.wikitext, &a.wikipedia) {
        (Some(f), _) => (format!("WikiText {}", f.display()), picaso_store::read_wikitext(f)?),
        (None, Some(f)) => {
            if a.held_out_every < 2 {
                bail!("--held-out-every must be at least 2");
            }
            let spec: picaso_train::corpus::CorpusSpec =
                format!("wikipedia:{}", f.display()).parse().map_err(anyhow::Error::msg)?;
            let articles = picaso_train::corpus::read_corpus(&spec)?;
            let docs = articles
                .iter()
                .enumerate()
                .filter(|(i, _)| i % a.held_out_every == a.held_out_every - 1)
                .map(|(_, text)| picaso_store::Document {
                    id: text.lines().next().unwrap_or("").trim_matches(|c| c == '=' || c == ' ').to_string(),
                    paragraphs: picaso_train::corpus::prose_paragraphs(text).into_iter().map(String::from).collect(),
                    metadata: Default::default(),
                })
                .collect();
            (format!("held-out Wikipedia articles of {} (every {}th)", f.display(), a.held_out_every), docs)
        }
        (None, None) => bail!("give --wikitext FILE (e.g. wiki.test.raw) or --wikipedia articles.txt.gz"),
    };
    let mut models = vec![(a.name.clone(), a.model, a.out.clone())];
    for (name, dir) in &a.compare {
        models.push((Some(name.clone()), ModelArgs::for_dir(dir), a.out.join(name)));
    }
    let mut reports = Vec::new();
    for (name, args, out) in &models {
        let model = crate::args::load_model(args, true)?;
        let name = name.clone().unwrap_or_else(|| {
            model.dir().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
        });
        // The first model's default name (its folder's) may be a name given with --compare.
        if reports.is_empty() && a.compare.iter().any(|(other, _)| *other == name) {
            bail!("model name {name:?} (--model's folder): the name is already taken by --compare; give --name");
        }
        eprintln!("{name} ({}) on {}: {}; scoring…", model.dir().display(), source, counted(docs.len(), "document"));
        let report = picaso_eval::context_use::run(&model, &docs, a.sample, a.seed)?;
        let bpb = picaso_eval::context_use::bits_per_byte(&model, &docs)?;
        report::write_context_use(out, &source, &report, &bpb, &report::RunInfo::collect(started))?;
        reports.push((name, report));
    }
    if reports.len() > 1 {
        let (first, rest) = reports.split_first().expect("at least one model");
        let comparisons = rest
            .iter()
            .map(|(name, r)| picaso_eval::context_use::compare(&first.0, &first.1, name, r))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        report::write_context_use_comparisons(&a.out, &comparisons)?;
    }
    print_results(&a.out)
}

fn recall(a: RecallArgs) -> Result<()> {
    use picaso_eval::recall::{compare_models, run, Form, Options, Task};
    let started = Instant::now();
    check_out(&a.out)?;
    check_names(a.name.as_deref().into_iter().chain(a.compare.iter().map(|(name, _)| name.as_str())))?;
    let mut models = vec![(a.name.clone(), a.model)];
    models.extend(a.compare.iter().map(|(n, d)| (Some(n.clone()), ModelArgs::for_dir(d))));
    let mut runs: Vec<(String, picaso_eval::recall::Report)> = Vec::new();
    let mut task: Option<Task> = None;
    for (name, args) in &models {
        let model = crate::args::load_model(args, true)?;
        let name = name.clone().unwrap_or_else(|| {
            model.dir().file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
        });
        // The first model's default name (its folder's) may be a name given with --compare.
        if runs.is_empty() && a.compare.iter().any(|(other, _)| *other == name) {
            bail!("model name {name:?} (--model's folder): the name is already taken by --compare; give --name");
        }
        let this = match a.form {
            Form::Synthetic => Task::synthetic_from_vocab(&model.tokenizer()?.inner().get_vocab(true), a.facts)
                .with_context(|| format!("model {name}"))?,
            Form::Natural => Task { form: Form::Natural, facts: a.facts, keys: a.keys, values: 9000 },
        };
        if task.as_ref().is_some_and(|t| *t != this) {
            bail!("model {name}: its recall vocabulary differs from the first model's, so their queries differ");
        }
        let options = Options {
            task: this.clone(),
            ks: a.ks.clone(),
            episodes: a.episodes,
            queries: a.queries,
            orders: a.orders,
            distractors: a.distractors,
            methods: a.methods.clone(),
            seed: a.seed,
        };
        task = Some(this);
        eprintln!("{name}: {}", model.dir().display());
        let r = with_progress("episodes", |p| run(&model, &options, p))?;
        runs.push((name, r));
    }
    let mut paired = Vec::new();
    for (name, r) in &runs[1..] {
        paired.extend(compare_models(&runs[0].0, &runs[0].1, name, r)?);
    }
    let list: Vec<report::RecallRun<'_>> = runs.iter().map(|(name, r)| report::RecallRun { name, report: r }).collect();
    report::write_recall(&a.out, &list, &paired, &report::RunInfo::collect(started))?;
    print_results(&a.out)
}
