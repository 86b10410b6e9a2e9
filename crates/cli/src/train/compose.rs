//! `picaso train compose`: fine-tuning a model to use composed states (BPTC, BP2C) on a
//! store's passages or on generated recall episodes.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use picaso_model::ModelConfig;
use picaso_train::run_file::{ComposeFile, RecallEpisodes};
use picaso_train::{Net, TrainGraniteHybrid, TrainMamba2};

use super::plot::loss_chart;

#[derive(Args)]
pub struct ComposeArgs {
    /// bptc (backprop through the composition: context states recomputed with gradients) or
    /// bp2c (stored states, stop-gradient: cheaper per step).
    #[arg(long)]
    objective: picaso_train::compose::Objective,
    /// Store of training passages ingested with `--segment halves` by the starting model
    /// (e.g. WikiText-2 train; never the test split you evaluate on). Not used with a config
    /// that generates recall episodes (a `recall` section).
    #[arg(long)]
    db: Option<String>,
    /// Where the store's state objects live (see `picaso ingest`).
    #[arg(long, requires = "db")]
    states: Option<String>,
    #[command(flatten)]
    model: crate::args::ModelArgs,
    /// The run's JSON config (see models/README.md).
    #[arg(long)]
    config: PathBuf,
    /// Output folder: checkpoint/, finetune.csv, loss.png, model/.
    #[arg(long)]
    out: PathBuf,
    /// Stop after this many steps in this call (the run resumes later).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Examples per forward pass (default: the whole batch). The gradients of a batch's
    /// micro-batches are summed, so the steps are the same; a smaller value needs less memory
    /// (BPTC of the bundled model at k = 10 holds 24 GB for a batch of 8 in one pass).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    micro_batch: Option<u64>,
    /// Recompute the contexts' states with --model from the stored tokens (a store ingested
    /// by another model with the same tokenizer; retrieval uses the stored embeddings). The
    /// result equals a store this model ingested.
    #[arg(long)]
    restate: bool,
}

pub(super) fn compose_cmd(a: ComposeArgs) -> Result<()> {
    let text =
        std::fs::read_to_string(&a.config).with_context(|| format!("reading --config {}", a.config.display()))?;
    let f: ComposeFile = serde_json::from_str(&text).with_context(|| format!("--config {}", a.config.display()))?;
    let model = crate::args::load_model(&a.model, true)?;
    match model.config() {
        ModelConfig::Mamba2(c) => run::<TrainMamba2>(&a, &f, &model, c.clone()),
        ModelConfig::GraniteHybrid(c) => run::<TrainGraniteHybrid>(&a, &f, &model, c.clone()),
        ModelConfig::Mamba1(_) | ModelConfig::Jamba(_) => bail!(
            "{}: fine-tuning supports Mamba-2 models and the Mamba-2 hybrids (Granite 4.0 H and kin); this one has \
             Mamba-1 layers",
            model.dir().display()
        ),
    }
}

/// Gathers the examples and fine-tunes `model`, whose architecture `N` trains.
fn run<N: Net>(a: &ComposeArgs, f: &ComposeFile, model: &picaso_model::Model, arch: N::Config) -> Result<()> {
    let config = compose_config(a, f, arch);
    // Checked before the examples are gathered (retrieval over a whole store).
    config.validate().with_context(|| format!("--config {}", a.config.display()))?;
    let data = match (&f.recall, &a.db) {
        (Some(r), None) => recall_examples(model, f, r)?,
        (None, Some(db)) => {
            store_examples(model, &crate::args::DbArgs { db: db.clone(), states: a.states.clone() }, f, a.restate)?
        }
        (Some(_), Some(_)) => bail!("--config has a \"recall\" section, which generates its examples: drop --db"),
        (None, None) => bail!(
            "give --db (a store of passages ingested with --segment halves), or a config with a \"recall\" section"
        ),
    };
    fit_compose::<N>(a, &config, model, &data)
}

/// The fine-tuning run's config: the file's settings for the model's architecture `model`.
fn compose_config<C>(a: &ComposeArgs, f: &ComposeFile, model: C) -> picaso_train::compose::ComposeConfig<C> {
    let mut adamw = picaso_train::optim::AdamWConfig::default();
    if let Some(wd) = f.weight_decay {
        adamw.weight_decay = wd;
    }
    picaso_train::compose::ComposeConfig {
        model,
        objective: a.objective,
        batch: f.batch,
        steps: f.steps,
        warmup: f.warmup,
        lr: f.lr,
        min_lr: f.min_lr,
        clip: f.clip,
        adamw,
        max_k: f.max_k,
        min_k: f.min_k,
        seed: f.seed,
        val_every: f.val_every,
        val_k: f.val_k,
        checkpoint_every: f.checkpoint_every,
        chunk: f.chunk,
    }
}

/// Recall examples: episode i of max_k contexts (generated with the config's seed), asking
/// for one fact of its first context — "most relevant first", as retrieval would rank it.
fn recall_examples(
    model: &picaso_model::Model,
    f: &ComposeFile,
    r: &RecallEpisodes,
) -> Result<picaso_train::compose::Dataset> {
    use picaso_eval::recall::Task;
    use picaso_train::compose::{ContextItem, ContextState, Dataset, Example};
    let tok = model.tokenizer()?;
    let task = Task::synthetic_from_vocab(&tok.inner().get_vocab(true), r.facts)?;
    let source = format!("{} recall episodes of {} facts per context", r.episodes, r.facts);
    let mut data = Dataset { source, contexts: Vec::new(), train: Vec::new(), val: Vec::new() };
    let bar = indicatif::ProgressBar::new((r.episodes + f.val_passages) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} recall episodes · ETA {eta}")
            .expect("valid template"),
    );
    for i in 0..r.episodes + f.val_passages {
        // Validation episodes come from another seed than any training one.
        let seed = if i < r.episodes { f.seed } else { f.seed ^ 0x7a1d_a7e0 };
        let ep = task.episode(seed, i, f.max_k.max(1), 1)?;
        let (c, fact) = ep.queries[0];
        let mut contexts = Vec::with_capacity(ep.contexts.len());
        for j in std::iter::once(c).chain((0..ep.contexts.len()).filter(|&j| j != c)) {
            let tokens = tok.encode(&task.context_text(&ep.contexts[j]))?;
            let state = ContextState::Held(Box::new(model.prefill(&tokens, &model.zero_state())?));
            contexts.push(data.contexts.len());
            data.contexts.push(ContextItem { tokens, state });
        }
        let fact = ep.contexts[c][fact];
        let example = Example {
            contexts,
            query: tok.encode(&task.query_text(fact.key))?,
            continuation: tok.encode(&task.answer_text(fact.value))?,
        };
        if i < r.episodes {
            data.train.push(example)
        } else {
            data.val.push(example)
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    eprintln!(
        "{} training and {} validation recall episodes of {} contexts",
        data.train.len(),
        data.val.len(),
        f.max_k
    );
    Ok(data)
}

/// Examples from a store of halves: every passage with its retrieved contexts; every n-th
/// passage held out.
fn store_examples(
    model: &picaso_model::Model,
    db: &crate::args::DbArgs,
    f: &ComposeFile,
    restate: bool,
) -> Result<picaso_train::compose::Dataset> {
    use picaso_train::compose::{ContextItem, ContextState, Dataset, Example};
    let store = std::rc::Rc::new(picaso_store::Store::open(db.location()?)?);
    if store.info().fingerprint != model.fingerprint() && !restate {
        bail!(
            "--db {}: its states were made by model {}, not by the model being fine-tuned ({}); ingest the passages with this model, or pass --restate to recompute them",
            store.location(),
            store.info().fingerprint,
            model.fingerprint()
        );
    }

    // Examples: every passage with its retrieved contexts. Validation holds out every n-th
    // *document* whole: a held-out paragraph of an article the model trains on shares its
    // names and facts, so its loss rewards memorising the training articles (on WikiText-2
    // train such paragraphs improved 1.2% while the test split's unseen articles got 2.2%
    // worse). A store of fewer documents than that holds out every n-th passage instead.
    let passages = picaso_store::passages(&store)?;
    let every = (passages.len() / f.val_passages.max(1)).max(2);
    let held_out = held_out_documents(&passages, every);
    let mut slot: std::collections::HashMap<i64, usize> = std::collections::HashMap::new();
    let restated = if restate { " (states recomputed, --restate)" } else { "" };
    let source = format!("store {}{restated}", store.location());
    let mut data = Dataset { source, contexts: Vec::new(), train: Vec::new(), val: Vec::new() };
    let bar = indicatif::ProgressBar::new(passages.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} passages retrieved · ETA {eta}")
            .expect("valid template"),
    );
    for (i, p) in passages.iter().enumerate() {
        let mut contexts = Vec::with_capacity(f.max_k);
        for (id, _) in picaso_store::retrieve(&store, p, f.max_k)? {
            let next = data.contexts.len();
            let at = *slot.entry(id).or_insert(next);
            if at == next {
                let tokens = store.get(id)?.tokens;
                let state = if restate {
                    ContextState::Held(Box::new(model.prefill(&tokens, &model.zero_state())?))
                } else {
                    let store = store.clone();
                    ContextState::Read(std::rc::Rc::new(move || {
                        store
                            .load_state(id)
                            .map_err(|e| candle_core::Error::Msg(format!("reading a context's state: {e}")))
                    }))
                };
                data.contexts.push(ContextItem { tokens, state });
            }
            contexts.push(at);
        }
        let example =
            Example { contexts, query: store.get(p.query)?.tokens, continuation: store.get(p.continuation)?.tokens };
        match &held_out {
            Some(docs) if docs.contains(p.doc.as_str()) => {
                // Beyond the cap a held-out article's passages are used for nothing.
                if data.val.len() < f.val_passages {
                    data.val.push(example)
                }
            }
            None if i % every == every - 1 && data.val.len() < f.val_passages => data.val.push(example),
            _ => data.train.push(example),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    eprintln!(
        "{} training and {} validation passages, {} distinct contexts",
        data.train.len(),
        data.val.len(),
        data.contexts.len()
    );
    Ok(data)
}

/// Every `every`-th document of `passages` (in store order), or `None` when there are fewer
/// than `2 · every` documents to choose from.
fn held_out_documents(passages: &[picaso_store::Passage], every: usize) -> Option<std::collections::HashSet<&str>> {
    let mut seen = std::collections::HashSet::new();
    let docs: Vec<&str> = passages.iter().map(|p| p.doc.as_str()).filter(|d| seen.insert(*d)).collect();
    (docs.len() >= 2 * every).then(|| docs.into_iter().skip(every - 1).step_by(every).collect())
}

/// Fine-tunes `model` on `data` as `config` says; writes OUT's log, chart and model.
fn fit_compose<N: Net>(
    a: &ComposeArgs,
    config: &picaso_train::compose::ComposeConfig<N::Config>,
    model: &picaso_model::Model,
    data: &picaso_train::compose::Dataset,
) -> Result<()> {
    let weights = N::load_weights(model.dir(), &config.model)?;
    let bar = indicatif::ProgressBar::new(config.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} · {msg} · ETA {eta}")
            .expect("valid template"),
    );
    let plain = bar.is_hidden();
    let micro = a.micro_batch.map_or(config.batch, |m| m as usize);
    let history = picaso_train::compose::finetune::<N>(
        config,
        &weights,
        &model.dir().display().to_string(),
        data,
        &a.out,
        a.stop_after,
        micro,
        |r| {
            bar.set_position(r.step);
            let val = r.val_loss.map(|v| format!(" · val {v:.3}")).unwrap_or_default();
            let msg = format!("k {} · loss {:.3}{val} · {:.2} s/step", r.k, r.loss, r.step_seconds);
            if plain && (r.step % 10 == 0 || r.val_loss.is_some()) {
                eprintln!("step {}/{} · {msg}", r.step, config.steps);
            }
            bar.set_message(msg);
        },
    )?;
    bar.finish();

    let csv_path = a.out.join("finetune.csv");
    let mut csv = std::fs::File::create(&csv_path).with_context(|| format!("writing {}", csv_path.display()))?;
    writeln!(csv, "step,k,seconds,step_seconds,lr,grad_norm,train_loss,val_loss")?;
    for r in &history {
        let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
        writeln!(
            csv,
            "{},{},{:.3},{:.4},{:e},{:.4},{:.6},{val}",
            r.step, r.k, r.seconds, r.step_seconds, r.lr, r.grad_norm, r.loss
        )?;
    }
    let rows: Vec<(f64, Option<f64>, Option<f64>)> =
        history.iter().map(|r| (r.step as f64, Some(r.loss), r.val_loss)).collect();
    let title = format!("Composition fine-tuning ({})", config.objective.name());
    let chart = picaso_eval::plot::Chart {
        title: &title,
        x: "step",
        y: "continuation loss (nats/token)",
        log_x: false,
        whole_x: true,
    };
    let val_name = format!("validation (PICASO-R, k = {})", config.val_k);
    loss_chart(&a.out.join("loss.png"), &chart, ["train (k drawn 0..max_k)", &val_name], &rows, 50)?;
    let model_dir = a.out.join("model");
    let w = N::load_weights(&a.out.join("checkpoint"), &config.model)?;
    N::save_weights(&w, &config.model, &model_dir)?;
    let tok = model.dir().join("tokenizer.json");
    if tok.is_file() {
        std::fs::copy(&tok, model_dir.join("tokenizer.json"))?;
    }
    let steps: Vec<f64> = history.iter().map(|r| r.step_seconds).collect();
    let mean_step = steps.iter().sum::<f64>() / steps.len().max(1) as f64;
    println!(
        "{}",
        serde_json::json!({
            "objective": config.objective, "step": history.last().map(|r| r.step), "steps": config.steps,
            "val_loss": history.iter().rev().find_map(|r| r.val_loss),
            "first_val_loss": history.iter().find_map(|r| r.val_loss),
            "mean_step_seconds": mean_step, "seconds": history.last().map(|r| r.seconds),
            "model": model_dir.to_string_lossy(), "log_csv": csv_path.to_string_lossy(),
        })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::held_out_documents;
    use picaso_store::Passage;

    fn passages(docs: usize, per_doc: u32) -> Vec<Passage> {
        let mut out = Vec::new();
        for d in 0..docs {
            for paragraph in 0..per_doc {
                let id = out.len() as i64 * 2;
                out.push(Passage {
                    doc: format!("doc {d}"),
                    paragraph,
                    query: id,
                    continuation: id + 1,
                    previous: None,
                });
            }
        }
        out
    }

    #[test]
    fn validation_holds_out_whole_documents() {
        let all = passages(100, 3);
        let held = held_out_documents(&all, 10).expect("enough documents");
        let expected: std::collections::HashSet<String> = (0..10).map(|i| format!("doc {}", 10 * i + 9)).collect();
        assert_eq!(held.iter().map(|d| d.to_string()).collect::<std::collections::HashSet<_>>(), expected);
    }

    #[test]
    fn too_few_documents_fall_back_to_passages() {
        assert!(held_out_documents(&passages(19, 30), 10).is_none());
        assert!(held_out_documents(&passages(20, 30), 10).is_some());
    }
}
