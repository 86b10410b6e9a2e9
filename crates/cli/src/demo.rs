//! `picaso demo`: the main job end to end. Ingests a corpus into a store with the bundled
//! model (and into a second store with the bundled hybrid, whose answers it prints beside the
//! Mamba-2's; `--model` runs one model), then answers prompts three ways — without the retrieved contexts (naive), with them
//! as tokens in front of the prompt (concat), and with their stored states composed into one
//! (picaso-r) — and prints, per prompt and method, the loss of the true answer, the time to
//! first token and the generated text.
//!
//! The default corpus ships inside the binary (`crates/cli/demo/`): short articles about
//! invented places and people, and prompts whose answers only a retrieved paragraph supplies.
//! `--data` demos on WikiText instead: each paragraph's first half is the prompt, its second
//! half the answer (the paper's WikiText experiment).

use picaso_model::counted;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use picaso_model::{generate, Composition, GenerateOptions, Method, Model};
use picaso_store::{prepare, Document, Store};

use crate::args::ModelArgs;

/// The built-in corpus: articles (`= Title =`, blank-line paragraphs) written for this demo.
const CORPUS: &str = include_str!("../demo/corpus.txt");
/// Its prompts: one JSON object per line, `{"prompt", "answer"}`.
const PROMPTS: &str = include_str!("../demo/prompts.jsonl");

#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// A WikiText file (raw `wiki.test.raw` or tokenized) to demo on instead of the built-in
    /// corpus: paragraphs are cut in halves, the first is the prompt, the second the answer.
    #[arg(long)]
    data: Option<PathBuf>,
    /// all-MiniLM-L6-v2 folder (the retriever; default: $PICASO_EMBEDDER, the store's own, the
    /// Hugging Face hub, or ../shared/data/all-MiniLM-L6-v2).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Store folder (created; re-runs reuse it). Default: target/demo-db, or
    /// target/demo-db-wikitext with --data. The bundled hybrid's store is this folder's name
    /// with `-hybrid` appended.
    #[arg(long)]
    db: Option<PathBuf>,
    /// Articles to ingest from --data (from the start of the file).
    #[arg(long, default_value_t = 12)]
    articles: usize,
    /// Prompts to answer.
    #[arg(long, default_value_t = 4)]
    prompts: usize,
    /// Contexts retrieved per prompt.
    #[arg(long, default_value_t = 3)]
    k: usize,
    /// Tokens generated per answer.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
}

/// A prompt, its true answer and the contexts retrieved for it (least relevant first, so the
/// most relevant ends nearest the prompt).
struct Question {
    prompt: Vec<u32>,
    prompt_text: String,
    answer: Vec<u32>,
    answer_text: String,
    contexts: Vec<i64>,
}

struct Row {
    method: &'static str,
    loss: f64,
    ttft_ms: f64,
    output: String,
}

/// The built-in corpus as documents; each paragraph keeps the blank line that ends it, as
/// the model saw paragraphs in training.
fn builtin_documents() -> Vec<Document> {
    picaso_train::corpus::wikipedia_articles(CORPUS)
        .iter()
        .map(|article| Document {
            id: article.lines().next().unwrap_or("").trim_matches(|c| c == '=' || c == ' ').to_string(),
            paragraphs: picaso_train::corpus::prose_paragraphs(article).iter().map(|p| format!("{p}\n\n")).collect(),
            metadata: Default::default(),
        })
        .collect()
}

fn builtin_prompts() -> Result<Vec<(String, String)>> {
    PROMPTS
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).context("demo/prompts.jsonl")?;
            let get = |k: &str| v[k].as_str().map(String::from).with_context(|| format!("demo prompt lacks {k}"));
            Ok((get("prompt")?, get("answer")?))
        })
        .collect()
}

/// A model the demo runs, with its own store (a store holds one model's states).
struct Subject {
    name: String,
    model: Model,
    store: Store,
}

/// The models to run: `--model` (or `$PICASO_MODEL`) alone, else the bundled Mamba-2 and, where
/// it is bundled too, the hybrid beside it (its store is `DB-hybrid`).
fn subjects(a: &DemoArgs, db: &std::path::Path, embedder: &picaso_embed::Embedder) -> Result<Vec<Subject>> {
    let mut wanted = vec![(a.model.clone(), db.to_path_buf())];
    if a.model.model.is_none() && std::env::var_os("PICASO_MODEL").is_none() {
        if let Some(hybrid) = crate::args::bundled_hybrid() {
            let model =
                crate::args::ModelArgs { model: Some(hybrid.to_string_lossy().into_owned()), ..a.model.clone() };
            let mut hybrid_db = db.as_os_str().to_owned();
            hybrid_db.push("-hybrid");
            wanted.push((model, PathBuf::from(hybrid_db)));
        }
    }
    wanted
        .into_iter()
        .map(|(args, db)| {
            let model = crate::args::load_model(&args, true)?;
            let info = picaso_store::StoreInfo {
                fingerprint: model.fingerprint().to_string(),
                dim: embedder.dim(),
                state_dtype: picaso_model::StateDtype::F32,
            };
            let store = Store::open_or_create(&db, &info).with_context(|| {
                format!("{}: a demo store of another model? remove the folder or pass --db", db.display())
            })?;
            let name = model.dir().file_name().map_or("model".into(), |n| n.to_string_lossy().into_owned());
            Ok(Subject { name, model, store })
        })
        .collect()
}

pub fn run(a: DemoArgs) -> Result<()> {
    if let Some(d) = &a.data {
        if !d.is_file() {
            bail!(
                "--data {}: no such file; pass a WikiText file (wikitext-2-raw-v1 from the Hugging Face hub, or ../shared/data/wikitext-2 beside a picaso checkout), or leave --data out for the built-in corpus",
                d.display()
            );
        }
    }
    let db = a
        .db
        .clone()
        .unwrap_or_else(|| PathBuf::from(if a.data.is_some() { "target/demo-db-wikitext" } else { "target/demo-db" }));
    // The retriever first: without one the demo stops at once with what to fetch.
    let existing = Store::open(&db).ok();
    let embedder = picaso_store::find_embedder(a.embedder.as_deref(), existing.as_ref())?;
    drop(existing);
    let subjects = subjects(&a, &db, &embedder)?;
    let (docs, segmentation) = match &a.data {
        Some(d) => {
            let mut docs = picaso_store::read_wikitext(d)?;
            docs.truncate(a.articles.max(1));
            (docs, picaso_store::Segmentation::Halves(picaso_store::sources::HALVES_MIN_TOKENS))
        }
        None => (builtin_documents(), picaso_store::Segmentation::Paragraph),
    };
    let mut questions = Vec::new();
    for s in &subjects {
        let t0 = Instant::now();
        let r = picaso_store::ingest(&s.store, &s.model, &embedder, &docs, segmentation, 32, |_| {})?;
        let stats = s.store.stats()?;
        println!(
            "store {}: {} from {} ({} new, {} tokens processed in {:.1} s); model {} ({} parameters)",
            s.store.location(),
            counted(stats.contexts, "context"),
            counted(stats.documents, "document"),
            r.done,
            r.tokens,
            t0.elapsed().as_secs_f64(),
            s.model.dir().display(),
            s.model.n_params()
        );
        questions.push(match &a.data {
            Some(_) => wikitext_questions(&s.store, a.prompts, a.k)?,
            None => builtin_questions(&s.store, &s.model, &embedder, a.prompts, a.k)?,
        });
    }
    println!();
    let methods =
        [("naive", Method::Naive), ("concat", Method::Concat), ("picaso-r", Method::Compose(Composition::PicasoR))];
    let mut totals = vec![vec![(0.0, 0.0); methods.len()]; subjects.len()];
    let opts = GenerateOptions { max_tokens: a.max_tokens, ..Default::default() };
    let several = subjects.len() > 1;
    for (i, first) in questions[0].iter().enumerate() {
        println!("prompt {}: {}", i + 1, snippet(&first.prompt_text, 110));
        let sources: Vec<String> = first
            .contexts
            .iter()
            .rev()
            .map(|&id| subjects[0].store.get(id).map(|c| format!("{} #{}", c.doc, c.seg)))
            .collect::<std::result::Result<_, _>>()?;
        println!("  retrieved (best first): {}", sources.join(", "));
        println!("  true answer: {}", snippet(&first.answer_text, 90));
        for (s, subject) in subjects.iter().enumerate() {
            let (model, store, q) = (&subject.model, &subject.store, &questions[s][i]);
            if several {
                println!("  {}:", subject.name);
            }
            let mut rows = Vec::new();
            // The states picaso-r reads, kept for the attribution below (which would read them again).
            let cache = picaso_store::StateCache::new(usize::MAX);
            for (name, method) in methods {
                let started = Instant::now();
                let prepared = prepare(store, model, &q.contexts, method, Some(&cache))?;
                let mut first: Option<f64> = None;
                let out = generate(model, &q.prompt, &prepared.state, &opts, |_| {
                    first.get_or_insert_with(|| started.elapsed().as_secs_f64());
                    true
                })?;
                let ttft = first.unwrap_or_else(|| started.elapsed().as_secs_f64());
                let loss = picaso_eval::methods::continuation_nll(model, &prepared.state, &q.prompt, &q.answer)?;
                rows.push(Row { method: name, loss, ttft_ms: 1e3 * ttft, output: out.text });
            }
            println!("  {:<9} {:>7} {:>9}  output", "method", "loss", "TTFT ms");
            for (j, r) in rows.iter().enumerate() {
                println!("  {:<9} {:>7.3} {:>9.1}  {}", r.method, r.loss, r.ttft_ms, snippet(&r.output, 70));
                totals[s][j].0 += r.loss;
                totals[s][j].1 += r.ttft_ms;
            }
            // Which retrieved context the true answer owes most to, by leaving each out of the
            // composed state (`picaso query --answer`).
            if !q.contexts.is_empty() && !q.answer.is_empty() {
                let picaso_r = Method::Compose(Composition::PicasoR);
                let at =
                    picaso_store::attribute(store, model, &q.contexts, picaso_r, &q.prompt, &q.answer, Some(&cache))?;
                let top = at.ranking()[0];
                let c = store.get(q.contexts[top])?;
                println!(
                    "  the true answer owes most to {} #{}: {:+.2} nats without it (leave-one-out over picaso-r, {:.0} ms)",
                    c.doc,
                    c.seg,
                    at.drop(top),
                    1e3 * at.seconds
                );
            }
        }
        println!();
    }
    let n = questions[0].len() as f64;
    println!("mean over {}, k = {} retrieved contexts each:", counted(questions[0].len(), "prompt"), a.k);
    for (subject, totals) in subjects.iter().zip(&totals) {
        if several {
            println!("  {}:", subject.name);
        }
        println!("  {:<9} {:>7} {:>9}", "method", "loss", "TTFT ms");
        for ((name, _), (loss, ttft)) in methods.iter().zip(totals) {
            println!("  {:<9} {:>7.3} {:>9.1}", name, loss / n, ttft / n);
        }
    }
    println!("\nloss: mean negative log-likelihood of the true answer (nats/token; lower is better)");
    Ok(())
}

/// The built-in prompts, each with the contexts retrieved for it.
fn builtin_questions(
    store: &Store,
    model: &Model,
    embedder: &picaso_embed::Embedder,
    n: usize,
    k: usize,
) -> Result<Vec<Question>> {
    let tok = model.tokenizer()?;
    let mut out = Vec::new();
    for (prompt_text, answer_text) in builtin_prompts()?.into_iter().take(n.max(1)) {
        let hits = store.search(&embedder.embed_one(&prompt_text)?, k.max(1))?;
        out.push(Question {
            prompt: tok.encode(&prompt_text)?,
            answer: tok.encode(&answer_text)?,
            contexts: hits.iter().rev().map(|(id, _)| *id).collect(),
            prompt_text,
            answer_text,
        });
    }
    Ok(out)
}

/// WikiText passages spread over the store: the query half is the prompt, the continuation
/// the answer; contexts retrieved by the query's stored embedding.
fn wikitext_questions(store: &Store, n: usize, k: usize) -> Result<Vec<Question>> {
    let passages = picaso_store::passages(store)?;
    if passages.is_empty() {
        bail!("{}: no passages to ask about", store.location());
    }
    let n = n.clamp(1, passages.len());
    let mut out = Vec::new();
    for i in 0..n {
        let passage = &passages[i * passages.len() / n];
        let query = store.get(passage.query)?;
        let continuation = store.get(passage.continuation)?;
        let hits = picaso_store::retrieve(store, passage, k)?;
        out.push(Question {
            prompt: query.tokens,
            prompt_text: query.text,
            answer: continuation.tokens,
            answer_text: continuation.text,
            contexts: hits.iter().rev().map(|(id, _)| *id).collect(),
        });
    }
    Ok(out)
}

/// The start of `text` on one line, at most `chars` characters, with an ellipsis when cut.
pub(crate) fn snippet(text: &str, chars: usize) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() > chars {
        format!("{}…", flat.chars().take(chars).collect::<String>())
    } else {
        flat
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_answer_is_in_the_corpus() {
        let docs = builtin_documents();
        assert!(docs.len() >= 6 && docs.iter().map(|d| d.paragraphs.len()).sum::<usize>() >= 24);
        let prompts = builtin_prompts().unwrap();
        assert!(prompts.len() >= 6);
        let text = CORPUS.split_whitespace().collect::<Vec<_>>().join(" ");
        for (prompt, answer) in prompts {
            // The first words of the answer (a name) occur in the corpus, so only a retrieved
            // paragraph can supply them.
            let name: String = answer.split([',', '.']).next().unwrap().trim().to_string();
            assert!(text.contains(&name), "{prompt}: {name} is not in the corpus");
        }
    }
}
