//! Experiments that compare models: fine-tuned against base, context use, associative recall.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use picaso_eval::{report, Method};
use picaso_model::counted;

use super::paper::{run_openbookqa, run_wikitext};
use super::*;
use crate::args::ModelArgs;

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

pub(super) fn finetuned(a: FinetunedArgs) -> Result<()> {
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

pub(super) fn context_use(a: ContextUseArgs) -> Result<()> {
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

pub(super) fn recall(a: RecallArgs) -> Result<()> {
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
