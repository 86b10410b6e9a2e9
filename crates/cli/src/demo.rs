//! `picaso demo`: the main job end to end. Ingests WikiText articles into a store with the
//! bundled model, then for a few passages gives the first half as the prompt and compares
//! how the retrieved contexts reach the model — not at all (naive), as tokens (concat), or as
//! one composed state (picaso-r): the loss of the true second half, the time to first token,
//! and the start of the generated text.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use picaso_model::{generate, GenerateOptions, Method};
use picaso_store::{prepare, ContextMethod};

use crate::ModelArgs;

#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A WikiText file to take articles from.
    #[arg(long, default_value = "../shared/data/wikitext-2/wiki.test.tokens")]
    data: PathBuf,
    /// all-MiniLM-L6-v2 folder (the retriever).
    #[arg(long, default_value = "../shared/data/all-MiniLM-L6-v2")]
    embedder: PathBuf,
    /// Store folder (created; re-runs reuse it).
    #[arg(long, default_value = "target/demo-db")]
    db: PathBuf,
    /// Articles to ingest (from the start of the file).
    #[arg(long, default_value_t = 12)]
    articles: usize,
    /// Prompts to answer.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Contexts retrieved per prompt.
    #[arg(long, default_value_t = 5)]
    k: usize,
    /// Tokens generated per answer.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
}

struct Row {
    method: &'static str,
    loss: f64,
    ttft_ms: f64,
    output: String,
}

pub fn run(a: DemoArgs) -> Result<()> {
    let model = crate::load_model(&a.model, true)?;
    if !a.data.is_file() {
        bail!(
            "--data {}: no such file; pass a WikiText file (wikitext-2-raw-v1 from the Hugging Face hub, or ../shared/data/wikitext-2 beside a picaso checkout)",
            a.data.display()
        );
    }
    let embedder = crate::load_embedder(&a.embedder)?;
    let mut docs = picaso_store::read_wikitext(&a.data)?;
    docs.truncate(a.articles.max(1));
    let info = picaso_store::StoreInfo {
        fingerprint: model.fingerprint().to_string(),
        dim: embedder.dim(),
        state_dtype: picaso_model::StateDtype::F32,
    };
    let store = picaso_store::Store::open_or_create(&a.db, &info).with_context(|| {
        format!("{}: a demo store of another model? remove the folder or pass --db", a.db.display())
    })?;
    let t0 = Instant::now();
    let seg = picaso_store::Segmentation::Halves(picaso_store::sources::HALVES_MIN_TOKENS);
    let r = picaso_store::ingest(&store, &model, &embedder, &docs, seg, 32, |_| {})?;
    let stats = store.stats()?;
    println!(
        "store {}: {} contexts from {} articles ({} new, {} tokens processed in {:.1} s); model {} ({} parameters)\n",
        a.db.display(),
        stats.contexts,
        stats.documents,
        r.done,
        r.tokens,
        t0.elapsed().as_secs_f64(),
        model.dir().display(),
        model.n_params()
    );

    let passages = picaso_store::passages(&store)?;
    let n = a.prompts.clamp(1, passages.len());
    let methods = [
        ("naive", ContextMethod::Naive),
        ("concat", ContextMethod::Concat),
        ("picaso-r", ContextMethod::Compose(Method::PicasoR)),
    ];
    let mut totals = vec![(0.0, 0.0); methods.len()];
    let opts = GenerateOptions { max_tokens: a.max_tokens, ..Default::default() };
    for i in 0..n {
        let passage = &passages[i * passages.len() / n];
        let query = store.get(passage.query)?;
        let continuation = store.get(passage.continuation)?;
        let hits = picaso_store::retrieve(&store, passage, a.k)?;
        // Least relevant first: the most relevant context ends nearest the prompt.
        let ids: Vec<i64> = hits.iter().rev().map(|(id, _)| *id).collect();
        println!("prompt {}: {}…", i + 1, snippet(&query.text, 110));
        println!("  true continuation: {}…", snippet(&continuation.text, 90));
        let mut rows = Vec::new();
        for (name, method) in methods {
            let started = Instant::now();
            let prepared = prepare(&store, &model, &ids, method, None)?;
            let mut first: Option<f64> = None;
            let out = generate(&model, &query.tokens, &prepared.state, &opts, |_| {
                first.get_or_insert_with(|| started.elapsed().as_secs_f64());
                true
            })?;
            let ttft = first.unwrap_or_else(|| started.elapsed().as_secs_f64());
            let loss =
                picaso_eval::methods::continuation_nll(&model, &prepared.state, &query.tokens, &continuation.tokens)?;
            rows.push(Row { method: name, loss, ttft_ms: 1e3 * ttft, output: out.text });
        }
        println!("  {:<9} {:>7} {:>9}  output", "method", "loss", "TTFT ms");
        for (j, r) in rows.iter().enumerate() {
            println!("  {:<9} {:>7.3} {:>9.1}  {}", r.method, r.loss, r.ttft_ms, snippet(&r.output, 70));
            totals[j].0 += r.loss;
            totals[j].1 += r.ttft_ms;
        }
        println!();
    }
    println!("mean over {n} prompts, k = {} retrieved contexts each:", a.k);
    println!("  {:<9} {:>7} {:>9}", "method", "loss", "TTFT ms");
    for ((name, _), (loss, ttft)) in methods.iter().zip(&totals) {
        println!("  {:<9} {:>7.3} {:>9.1}", name, loss / n as f64, ttft / n as f64);
    }
    println!("\nloss: mean negative log-likelihood of the true continuation (nats/token; lower is better)");
    Ok(())
}

fn snippet(text: &str, chars: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    flat.chars().take(chars).collect()
}
