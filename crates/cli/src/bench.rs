//! `bench`, `bench-context` and `random-model`: engine and composition throughput on random
//! or given weights.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use picaso_model::{Composition, Model, StateDtype};
use serde_json::json;

use crate::args::{at_least_one, backend_for, load_model, ModelArgs};

#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Model folder; without it, random weights of --random's shape are used.
    #[arg(long, conflicts_with = "random")]
    model: Option<String>,
    /// Random weights in a known shape: `130m` (state-spaces/mamba2-130m), `2.7b`
    /// (state-spaces/mamba2-2.7b), `mamba1-130m` (state-spaces/mamba-130m), `tiny`, or the
    /// Granite 4.0 H hybrids `granite-tiny`, `granite-350m-like` and `granite-micro-like` (2.9 B),
    /// or the Jamba hybrid `jamba-tiny`.
    #[arg(long, default_value = "130m")]
    random: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Storage of the large weight matrices: f32 or bf16.
    #[arg(long, default_value = "f32")]
    weights: picaso_model::WeightDtype,
    /// Engine: cpu (the fast CPU path), `cuda[:N]` (the GPU engine; `cuda` feature),
    /// candle-cpu, `candle-cuda[:N]` or metal (candle; `candle-cuda` / `metal` feature).
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
pub(crate) struct BenchContextArgs {
    /// Model folder; without it, random weights of --random's shape are used.
    #[arg(long, conflicts_with = "random")]
    model: Option<String>,
    /// Random weights in a known shape: `130m` (state-spaces/mamba2-130m), `2.7b`
    /// (state-spaces/mamba2-2.7b), `mamba1-130m` (state-spaces/mamba-130m), `tiny`, or the
    /// Granite 4.0 H hybrids `granite-tiny`, `granite-350m-like` and `granite-micro-like` (2.9 B),
    /// or the Jamba hybrid `jamba-tiny`.
    #[arg(long, default_value = "130m")]
    random: String,
    /// Storage of the large weight matrices: f32 or bf16.
    #[arg(long, default_value = "f32")]
    weights: picaso_model::WeightDtype,
    /// Engine: cpu or `cuda[:N]` (the GPU engine; `cuda` feature). The composition itself runs
    /// on the host (picaso-compose) on either.
    #[arg(long, default_value = "cpu")]
    device: String,
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
pub(crate) struct RandomModelArgs {
    /// Shape: 130m (state-spaces/mamba2-130m), 2.7b (state-spaces/mamba2-2.7b), mamba1-130m
    /// (state-spaces/mamba-130m), tiny, the Granite 4.0 H hybrids granite-tiny,
    /// granite-350m-like and granite-micro-like (2.9 B), or the Jamba hybrid jamba-tiny.
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

pub(crate) fn random_model(a: RandomModelArgs) -> Result<()> {
    if a.out.exists() {
        bail!("{} exists; give a new folder to --out", a.out.display());
    }
    let config = random_config(&a.shape, "--shape")?;
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
        picaso_model::ModelConfig::GraniteHybrid(c) => {
            picaso_model::GraniteHybridWeights::random(c, a.seed).save_pretrained(&a.out, c)?
        }
        picaso_model::ModelConfig::Jamba(c) => {
            picaso_model::JambaWeights::random(c, a.seed).save_pretrained(&a.out, c)?
        }
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
    Ok(match random_config(random, "--random")? {
        picaso_model::ModelConfig::Mamba1(c) => {
            let w = picaso_model::Mamba1Weights::random(&c, seed);
            Model::from_mamba1_weights_on(c, w, None, &backend, weights)?
        }
        picaso_model::ModelConfig::Mamba2(c) => {
            let w = picaso_model::Mamba2Weights::random(&c, seed);
            Model::from_weights_on(c, w, None, &backend, weights)?
        }
        picaso_model::ModelConfig::GraniteHybrid(c) => {
            let w = picaso_model::GraniteHybridWeights::random(&c, seed);
            Model::from_hybrid_weights_on(c, w, None, &backend, weights)?
        }
        picaso_model::ModelConfig::Jamba(c) => {
            let w = picaso_model::JambaWeights::random(&c, seed);
            Model::from_jamba_weights_on(c, w, None, &backend, weights)?
        }
    })
}

#[derive(Args)]
pub(crate) struct BenchCodecsArgs {
    /// Shapes, comma-separated: any of --random's in `bench` (130m, 2.7b, granite-micro-like, …),
    /// or granite-h-tiny-like and nemotron-h-8b-like (states only: too large for random weights
    /// here). Only the shape is used: no weights are made.
    #[arg(long, value_delimiter = ',', default_value = "130m")]
    shapes: Vec<String>,
    /// States composed at once.
    #[arg(long, default_value_t = 10, value_parser = at_least_one)]
    compose_n: usize,
    /// Context tokens per state (a hybrid's keys and values grow with them).
    #[arg(long, default_value_t = 100)]
    tokens: usize,
    /// Contexts whose states a store holds, for the total size (the paper's WikiText-2 setting
    /// stores 3,854).
    #[arg(long, default_value_t = 3854)]
    contexts: u64,
    /// Runs per measurement (best is reported).
    #[arg(long, default_value_t = 3, value_parser = at_least_one)]
    repeats: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn bench_codecs(a: BenchCodecsArgs) -> Result<()> {
    let mut report = Vec::new();
    for name in &a.shapes {
        let shape = match name.as_str() {
            "granite-h-tiny-like" => picaso_model::GraniteHybridConfig::granite_tiny_like().state_shape(),
            "nemotron-h-8b-like" => picaso_model::GraniteHybridConfig::nemotron_h_8b_like().state_shape(),
            _ => random_config(name, "--shapes")?.state_shape(),
        };
        let rows = picaso_model::bench::codecs(&shape, a.compose_n, a.tokens, a.repeats)?;
        if !a.json {
            println!(
                "{name}: {} states of {} context tokens composed (PICASO-R), {} threads",
                a.compose_n,
                a.tokens,
                std::thread::available_parallelism().map_or(1, |n| n.get())
            );
            println!(
                "  codec  MiB/state  GiB/{} ctx  compose ms  read ms  read+write ms  ×read  ×read+write  vs f32",
                a.contexts
            );
            let f32_ms = rows[0].compose_ms;
            for r in &rows {
                println!(
                    "  {:<5} {:>10.2} {:>12.1} {:>11.2} {:>8.2} {:>14.2} {:>6.2} {:>12.2} {:>7.2}×",
                    r.codec,
                    r.state_bytes as f64 / 1048576.0,
                    (r.state_bytes as u64 * a.contexts) as f64 / (1u64 << 30) as f64,
                    r.compose_ms,
                    r.read_ms,
                    r.read_write_ms,
                    r.compose_ms / r.read_ms,
                    r.compose_ms / r.read_write_ms,
                    f32_ms / r.compose_ms
                );
            }
        }
        report.push(json!({"shape": name, "tokens": a.tokens, "compose_n": a.compose_n, "contexts": a.contexts, "codecs": rows}));
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"cpu": picaso_model::bench::cpu_model(), "threads": std::thread::available_parallelism().map_or(1, |n| n.get()), "shapes": report})
            )?
        );
    }
    Ok(())
}

/// The config of a known shape of random weights (`flag` names the option, for the error).
fn random_config(shape: &str, flag: &str) -> Result<picaso_model::ModelConfig> {
    use picaso_model::{GraniteHybridConfig, JambaConfig, Mamba1Config, Mamba2Config, ModelConfig};
    Ok(match shape {
        "130m" => ModelConfig::Mamba2(Mamba2Config::mamba2_130m()),
        "2.7b" => ModelConfig::Mamba2(Mamba2Config::mamba2_2_7b()),
        "mamba1-130m" => ModelConfig::Mamba1(Mamba1Config::mamba_130m()),
        "tiny" => ModelConfig::Mamba2(Mamba2Config::tiny(2, 4)),
        "granite-tiny" => ModelConfig::GraniteHybrid(GraniteHybridConfig::tiny(61)),
        "granite-350m-like" => ModelConfig::GraniteHybrid(GraniteHybridConfig::granite_350m_like()),
        "granite-micro-like" => ModelConfig::GraniteHybrid(GraniteHybridConfig::granite_micro_like()),
        "jamba-tiny" => ModelConfig::Jamba(JambaConfig::tiny(61)),
        other => bail!(
            "{flag} {other:?}: use 130m or 2.7b (Mamba-2), mamba1-130m, tiny, granite-tiny, \
             granite-350m-like or granite-micro-like (Granite 4.0 H hybrids), or jamba-tiny"
        ),
    })
}

pub(crate) fn bench_context(a: BenchContextArgs) -> Result<()> {
    if a.max_k == 0 || a.context_tokens == 0 {
        bail!("--max-k and --context-tokens must be at least 1");
    }
    let model = bench_model(a.model.as_deref(), &a.random, 0, a.weights, &a.device)?;
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

pub(crate) fn bench(a: BenchArgs) -> Result<()> {
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

#[derive(Args)]
pub(crate) struct BenchBudgetArgs {
    /// A WikiText file whose paragraphs are the contexts (e.g. ../shared/data/wikitext-2/wiki.train.tokens).
    #[arg(long)]
    data: PathBuf,
    /// Paragraphs used: the first this many with at least --min-words words, one context each.
    #[arg(long, default_value_t = 2000, value_parser = at_least_one)]
    paragraphs: usize,
    /// Shortest paragraph used, words.
    #[arg(long, default_value_t = 40)]
    min_words: usize,
    /// The budget, as a fraction of every state's bytes (0.1: the states are 10× the budget).
    #[arg(long, default_value_t = 0.1)]
    budget_fraction: f64,
    /// Queries run (each against every arm).
    #[arg(long, default_value_t = 2000, value_parser = at_least_one)]
    queries: usize,
    /// Contexts each query retrieves.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    k: usize,
    /// Zipf exponent of the queries' popularity (a pool of one query per paragraph: its first
    /// words).
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Seed of the popularity order and the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Codec of the states.
    #[arg(long, default_value = "f32")]
    state_dtype: StateDtype,
    /// Folder for the stores: `full` is kept and reused; the budgeted ones are made from it
    /// afresh each run (their state files hard links of its own).
    #[arg(long)]
    work: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
    /// all-MiniLM-L6-v2 folder (default: $PICASO_EMBEDDER, the hub, or ../shared/data).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Copies a folder store: its catalog files copied, its state files hard-linked (a budgeted
/// copy that removes one unlinks only its own name).
fn copy_store(from: &std::path::Path, to: &std::path::Path) -> Result<()> {
    if to.exists() {
        std::fs::remove_dir_all(to).with_context(|| format!("cannot remove {}", to.display()))?;
    }
    std::fs::create_dir_all(to.join("states"))?;
    for f in ["store.sqlite", "store.sqlite-wal"] {
        if from.join(f).exists() {
            std::fs::copy(from.join(f), to.join(f))?;
        }
    }
    for shard in std::fs::read_dir(from.join("states"))?.flatten() {
        let dir = to.join("states").join(shard.file_name());
        std::fs::create_dir_all(&dir)?;
        for file in std::fs::read_dir(shard.path())?.flatten() {
            std::fs::hard_link(file.path(), dir.join(file.file_name()))
                .or_else(|_| std::fs::copy(file.path(), dir.join(file.file_name())).map(|_| ()))?;
        }
    }
    Ok(())
}

pub(crate) fn bench_budget(a: BenchBudgetArgs) -> Result<()> {
    if !(a.budget_fraction > 0.0 && a.budget_fraction < 1.0) {
        bail!("--budget-fraction {}: give a fraction between 0 and 1", a.budget_fraction);
    }
    let model = load_model(&a.model, true)?;
    let embedder = picaso_store::find_embedder(a.embedder.as_deref(), None)?;
    let text = std::fs::read_to_string(&a.data).with_context(|| format!("cannot read {}", a.data.display()))?;
    let paragraphs: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('=') && l.split_whitespace().count() >= a.min_words)
        .take(a.paragraphs)
        .map(picaso_store::detokenize_wikitext)
        .collect();
    if paragraphs.len() < a.paragraphs {
        bail!(
            "{} holds {} paragraphs of {} words or more, not {}",
            a.data.display(),
            paragraphs.len(),
            a.min_words,
            a.paragraphs
        );
    }
    let docs: Vec<picaso_store::Document> = paragraphs
        .iter()
        .enumerate()
        .map(|(i, p)| picaso_store::Document::new(format!("p{i:05}"), vec![p.clone()]))
        .collect();
    let info = picaso_store::StoreInfo {
        fingerprint: model.fingerprint().to_string(),
        dim: embedder.dim(),
        state_dtype: a.state_dtype,
    };
    let full_dir = a.work.join("full");
    {
        let full = picaso_store::Store::open_or_create(full_dir.as_path(), &info)?;
        full.require_state_dtype(a.state_dtype)?;
        let r =
            picaso_store::ingest(&full, &model, &embedder, &docs, picaso_store::Segmentation::Paragraph, 64, |_| {})?;
        eprintln!("full store: {}", r.summary());
    }
    let full = picaso_store::Store::open(full_dir.as_path())?;
    let all_bytes = full.stats()?.state_bytes;
    let budget_bytes = (all_bytes as f64 * a.budget_fraction) as u64;
    let mut budgeted = Vec::new();
    for policy in [picaso_store::Policy::Work, picaso_store::Policy::Lru] {
        let dir = a.work.join(policy.name());
        copy_store(&full_dir, &dir)?;
        let store = picaso_store::Store::open(dir.as_path())?;
        store.set_budget(Some(picaso_store::Budget { bytes: budget_bytes, policy }), &model)?;
        budgeted.push((policy, store));
    }
    // One query per paragraph: its first words; retrieved once (every store has the same ids).
    let tokenizer = model.tokenizer()?;
    let mut pool = Vec::with_capacity(paragraphs.len());
    for p in &paragraphs {
        let query: String = p.split_whitespace().take(12).collect::<Vec<_>>().join(" ");
        let embedding = embedder.embed_one(&query)?;
        let mut ids: Vec<i64> = full.search(&embedding, a.k)?.into_iter().map(|(id, _)| id).collect();
        ids.reverse(); // the most relevant nearest the prompt
        pool.push((ids, tokenizer.encode(&query)?));
    }
    let picaso_r = picaso_model::Method::Compose(Composition::PicasoR);
    let mut arms =
        vec![picaso_store::workload::Arm { name: "every state stored".into(), store: &full, method: picaso_r }];
    for (policy, store) in &budgeted {
        arms.push(picaso_store::workload::Arm { name: format!("budget, {policy}"), store, method: picaso_r });
    }
    arms.push(picaso_store::workload::Arm {
        name: "concat".into(),
        store: &full,
        method: picaso_model::Method::Concat,
    });
    let opts = picaso_store::workload::WorkloadOptions { queries: a.queries, zipf: a.zipf, seed: a.seed };
    let results = picaso_store::workload::run_workload(&model, &arms, &pool, opts)?;
    let setting = json!({
        "paragraphs": paragraphs.len(), "state_bytes_all": all_bytes, "budget_bytes": budget_bytes,
        "queries": a.queries, "k": a.k, "zipf": a.zipf, "seed": a.seed, "state_dtype": a.state_dtype.name(),
        "model": model.fingerprint(), "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
    });
    if a.json {
        println!("{}", json!({ "setting": setting, "arms": results }));
        return Ok(());
    }
    println!(
        "{} paragraphs, states {:.0} MiB ({}), budget {:.0} MiB; {} queries, k = {}, Zipf({})",
        paragraphs.len(),
        all_bytes as f64 / 1048576.0,
        a.state_dtype.name(),
        budget_bytes as f64 / 1048576.0,
        a.queries,
        a.k,
        a.zipf
    );
    println!(
        "  arm                  hit rate  (2nd half)  TTFT p50 ms  p99 ms  mean ms  MiB read  recomputed  ctx tokens"
    );
    for r in &results {
        let pct = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v));
        println!(
            "  {:<20} {:>8} {:>11} {:>12.2} {:>7.2} {:>8.2} {:>9.0} {:>11} {:>11}",
            r.name,
            pct(r.hit_rate),
            pct(r.hit_rate_second_half),
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.ttft_mean_ms,
            r.bytes_read as f64 / 1048576.0,
            r.recomputed,
            r.context_tokens
        );
    }
    Ok(())
}
