//! The paper's experiments over a store: WikiText (and its scaling in k), OpenBookQA,
//! attribution (OpenBookQA, MS MARCO), order sensitivity, fidelity.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Args;
use picaso_eval::{report, Method};
use picaso_model::counted;

use super::*;
use crate::args::ModelArgs;

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

#[allow(clippy::too_many_arguments)]
pub(super) fn run_wikitext(
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

pub(super) fn wikitext(a: WikitextArgs) -> Result<()> {
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

pub(super) fn scaling(a: ScalingArgs) -> Result<()> {
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

pub(super) fn run_openbookqa(
    model: &picaso_model::Model,
    d: &ObqaData,
    options: &picaso_eval::openbookqa::Options,
) -> Result<picaso_eval::openbookqa::Report> {
    let (base, prepared) = obqa_prepare(d, model, |data| options.check(data.facts.len()))?;
    Ok(with_progress("questions", |p| picaso_eval::openbookqa::run(model, &base, &prepared, options, p))?)
}

pub(super) fn openbookqa(a: OpenbookqaArgs) -> Result<()> {
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

pub(super) fn attribution(a: AttributionArgs) -> Result<()> {
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

pub(super) fn msmarco(a: MsmarcoArgs) -> Result<()> {
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

pub(super) fn order(a: OrderArgs) -> Result<()> {
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

pub(super) fn fidelity(a: FidelityArgs) -> Result<()> {
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
