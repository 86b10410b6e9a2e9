//! Commands for stores on shared backends: copy a store between backends, build or drop an
//! approximate index, and measure a backend's query-time latency.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;

use crate::args::{load_model, DbArgs, ModelArgs};

#[derive(Args)]
pub struct MigrateArgs {
    /// The source store: a folder or postgres:// URL.
    #[arg(long)]
    from: String,
    /// The target store (created for the same model if missing; resumable).
    #[arg(long)]
    to: String,
    /// Where the target keeps its state objects (a folder or s3://bucket/prefix); needed when
    /// the target is a new PostgreSQL store.
    #[arg(long)]
    to_states: Option<String>,
    /// Convert the states to this codec (f32, bf16, int8 or int4; default: the source's).
    /// Every target state is then checked to be its source state converted.
    #[arg(long)]
    state_dtype: Option<picaso_model::StateDtype>,
    /// Print a JSON report.
    #[arg(long)]
    json: bool,
}

/// `picaso migrate`: copy, then verify every context read back from the target.
pub fn migrate(a: MigrateArgs) -> Result<()> {
    let from = picaso_store::Store::open(picaso_store::Location::parse(&a.from, None)?)
        .with_context(|| format!("--from {}", picaso_store::location::redact(&a.from)))?;
    let to = picaso_store::Location::parse(&a.to, a.to_states.as_deref())?;
    let bar = (!a.json).then(|| {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} contexts · {per_sec} · ETA {eta}")
                .expect("valid template"),
        );
        bar
    });
    let (target, report) = picaso_store::migrate_to(&from, to, a.state_dtype, |done, total| {
        if let Some(bar) = &bar {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        }
    })?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if a.json {
        println!("{}", json!({"report": report, "target": target.stats()?}));
    } else {
        println!(
            "copied {} contexts ({:.1} MiB of states), skipped {} already there, verified {} in {:.1} s: {} → {}",
            report.copied,
            report.state_bytes as f64 / 1048576.0,
            report.skipped,
            report.verified,
            report.seconds,
            from.location(),
            target.location()
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct IndexArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Build an HNSW index (PostgreSQL): approximate, faster search on large stores.
    #[arg(long, conflicts_with = "exact")]
    hnsw: bool,
    /// Drop the approximate index: exact search.
    #[arg(long)]
    exact: bool,
    /// HNSW: links per node.
    #[arg(long, default_value_t = 16)]
    m: usize,
    /// HNSW: candidate list size while building.
    #[arg(long, default_value_t = 64)]
    ef_construction: usize,
}

/// `picaso index`: choose exact or HNSW search for a PostgreSQL store.
pub fn index(a: IndexArgs) -> Result<()> {
    if a.hnsw == a.exact {
        bail!("give --hnsw (build an approximate index) or --exact (drop it)");
    }
    if a.hnsw && (a.m < 2 || a.ef_construction < 2 * a.m) {
        bail!("--m must be at least 2 and --ef-construction at least 2 × m (pgvector's rule)");
    }
    let store = picaso_store::Store::open(a.db.location()?)?;
    let t0 = std::time::Instant::now();
    store.set_ann_index(a.hnsw.then_some((a.m, a.ef_construction)))?;
    let what = if a.hnsw {
        format!("HNSW index (m {}, ef_construction {}) built", a.m, a.ef_construction)
    } else {
        "no approximate index (dropped if there was one); search is exact".into()
    };
    println!("{}: {what} in {:.1} s", store.location(), t0.elapsed().as_secs_f64());
    Ok(())
}

#[derive(Args)]
pub struct BenchStoreArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Context counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,5,10")]
    ks: Vec<usize>,
    /// Queries per k (stored embeddings of random contexts).
    #[arg(long, default_value_t = 50)]
    queries: usize,
    /// The composition.
    #[arg(long, default_value = "picaso-r")]
    method: picaso_model::Composition,
    /// State cache for the warm measurement, MiB.
    #[arg(long, default_value_t = 512, value_parser = crate::args::at_least_one)]
    cache_mb: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// `picaso bench-store`: retrieval + state loading + composition latency of one backend.
pub fn bench_store(a: BenchStoreArgs) -> Result<()> {
    if a.ks.is_empty() || a.ks.contains(&0) || a.queries == 0 {
        bail!("--ks needs values of at least 1 and --queries at least 1");
    }
    let store = picaso_store::Store::open(a.db.location()?)?;
    let held = store.len()?;
    if let Some(k) = a.ks.iter().find(|&&k| k > held) {
        bail!("--ks {k}: the store {} holds {held} contexts; give k values of at most {held}", store.location());
    }
    let model = load_model(&a.model, false)?;
    let opts = picaso_store::bench::BackendLatencyOptions {
        ks: a.ks.clone(),
        queries: a.queries,
        method: a.method,
        cache_bytes: a.cache_mb << 20,
    };
    let rows = picaso_store::bench::backend_latency(&store, &model, &opts)?;
    let stats = store.stats()?;
    if a.json {
        println!(
            "{}",
            json!({"catalog": stats.catalog, "states": stats.states, "contexts": stats.contexts, "rows": rows})
        );
        return Ok(());
    }
    println!(
        "{} contexts; catalog {}; states {}; {} ({} queries per k), medians in ms",
        stats.contexts,
        stats.catalog,
        stats.states,
        a.method.name(),
        a.queries
    );
    println!(
        "{:>4} {:>10} {:>9} {:>9} {:>9} {:>12} {:>12} {:>7}",
        "k", "retrieve", "load", "compose", "total", "total cached", "exact search", "recall"
    );
    for r in &rows {
        println!(
            "{:>4} {:>10.2} {:>9.2} {:>9.2} {:>9.2} {:>12.2} {:>12.2} {:>7.3}",
            r.k, r.retrieve_ms, r.load_ms, r.compose_ms, r.total_ms, r.total_cached_ms, r.retrieve_exact_ms, r.recall
        );
    }
    Ok(())
}
