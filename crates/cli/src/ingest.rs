//! `ingest` and `stats`: filling a store and its totals.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use picaso_model::{counted, StateDtype};
use serde_json::json;

use crate::args::{at_least_one, load_model, DbArgs, ModelArgs};

#[derive(Args)]
pub(crate) struct IngestArgs {
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
    /// Codec of the state files: f32, bf16, int8 or int4 (default: the store's, f32 for a new
    /// store). int8 and int4 keep a scale per 32 values; log-decays stay f32.
    #[arg(long)]
    state_dtype: Option<StateDtype>,
    /// Keep at most this many MiB of state objects (fractions allowed), recorded in the store:
    /// serve, query and eval honour it. The states the policy values most are kept; the others
    /// are recomputed from their tokens when a query retrieves them (answers are the same).
    /// On a store that has states, the lowest-valued go until the rest fit; 0 removes the
    /// budget (every state not held is recomputed and stored).
    #[arg(long)]
    state_budget_mb: Option<f64>,
    /// Which states a budget keeps: work (prefill work saved per byte, times retrievals, with
    /// an aging clock; the default) or lru.
    #[arg(long, requires = "state_budget_mb")]
    state_budget_policy: Option<picaso_store::Policy>,
    /// Also remove the store's documents the source no longer has (a file deleted from
    /// --text-dir, an id gone from --jsonl), so the store mirrors the source.
    #[arg(long)]
    prune: bool,
    /// Print a JSON summary instead of a progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct StatsArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Print JSON: {"contexts", "documents", "tokens", "state_bytes", "state_dtype", "model", ...}.
    #[arg(long)]
    json: bool,
}

pub(crate) fn ingest(a: IngestArgs) -> Result<()> {
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
        store.require_state_dtype(want)?;
    }
    crate::args::apply_state_budget(&store, &model, a.state_budget_mb, a.state_budget_policy)?;
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

pub(crate) fn stats(a: StatsArgs) -> Result<()> {
    let store = picaso_store::Store::open(a.db.location()?)?;
    let s = store.stats()?;
    if a.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!("contexts     {}", s.contexts);
        println!("documents    {}", s.documents);
        println!("tokens       {}", s.tokens);
        let whose = if s.budget.is_some() { "; every context's, held or not" } else { "" };
        println!(
            "state bytes  {} ({:.1} MiB, {}{whose})",
            s.state_bytes,
            s.state_bytes as f64 / 1048576.0,
            s.state_dtype
        );
        if let Some(b) = &s.budget {
            let looked = b.hits + b.misses;
            println!(
                "budget       {:.1} of {:.1} MiB held ({} of {} states, policy {}); {} hits, {} misses ({:.1}% hit)",
                b.held_bytes as f64 / 1048576.0,
                b.budget_bytes as f64 / 1048576.0,
                b.held,
                b.tracked,
                b.policy,
                b.hits,
                b.misses,
                100.0 * b.hits as f64 / looked.max(1) as f64
            );
        }
        println!("model        {}", s.model);
        println!("catalog      {}", s.catalog);
        println!("states       {}", s.states);
    }
    Ok(())
}
