//! `query`: retrieve contexts, compose their states, continue with a prompt; `--attribute`
//! ranks the contexts by what the answer owes each.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use picaso_model::{counted, generate, Method};
use serde_json::json;

use crate::args::{at_least_one, load_model, DbArgs, ModelArgs, SamplingArgs};

#[derive(Args)]
pub(crate) struct QueryArgs {
    #[command(flatten)]
    db: DbArgs,
    /// The prompt.
    prompt: String,
    #[command(flatten)]
    model: ModelArgs,
    /// all-MiniLM-L6-v2 folder (to retrieve; default: $PICASO_EMBEDDER, else the one the store
    /// was built with).
    #[arg(long)]
    embedder: Option<PathBuf>,
    /// Contexts to retrieve.
    #[arg(long, default_value_t = 5, value_parser = at_least_one)]
    k: usize,
    #[command(flatten)]
    retriever: crate::retriever::RetrieverArgs,
    /// picaso-r, picaso-s, caso, soup, concat or naive.
    #[arg(long, default_value = "picaso-r", value_parser = |s: &str| Method::parse_among(s, &Method::QUERY))]
    method: Method,
    /// Use these context ids (in this order, the last nearest the prompt) instead of retrieving.
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<i64>>,
    /// Retrieve only from this document's contexts (its name, as `picaso documents` lists it;
    /// repeat for several).
    #[arg(long = "doc", value_name = "NAME", conflicts_with = "ids")]
    docs: Vec<String>,
    /// Retrieve only contexts whose metadata passes this condition (repeat: all must hold):
    /// KEY=VALUE, KEY!=VALUE, KEY>VALUE, KEY>=VALUE, KEY<VALUE, KEY<=VALUE (numbers by value,
    /// strings by code point: `date>=2024-01-01`), KEY^=TEXT (a string starting with TEXT:
    /// `url^=https://en.wikipedia.org/`), KEY~=PATTERN (a string a regex matches, Rust's
    /// syntax: `'title~=(?i)^the .+ war$'`), or a filter as a JSON object, for the
    /// operators $in, $nin, $exists, $contains, $elemMatch and $not, $or / $and / $nor of
    /// filters, and keys within objects (`'{"lang": {"$in": ["en", "fr"]}}'`,
    /// `'{"year": {"$not": {"$gte": 2020}}}'`, `'{"author": {"name": "Ann"}}'`,
    /// `'{"authors": {"$elemMatch": {"name": "Ann", "role": "editor"}}}'`).
    /// VALUE is JSON when it reads as a JSON number, boolean, null or quoted string
    /// (`year=2024`, `draft=false`, `year='"2024"'`), else the text as given (`lang=en`).
    /// Metadata comes from a JSON line's fields other than `text` and `id`.
    #[arg(long = "filter", value_name = "CONDITION", conflicts_with = "ids")]
    filters: Vec<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Also tell which context the answer owes most to: each is left out in turn, the others
    /// are combined again by --method and the answer is scored; prints the log-likelihood the
    /// answer loses without each (leave-one-out, the paper's attribution).
    #[arg(long)]
    attribute: bool,
    /// Attribute this answer (text continuing the prompt) instead of generating one; implies
    /// --attribute.
    #[arg(long)]
    answer: Option<String>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub(crate) fn query(a: QueryArgs) -> Result<()> {
    if a.method == Method::Naive && a.ids.as_ref().is_some_and(|ids| !ids.is_empty()) {
        bail!(
            "--method naive uses no context, so --ids would be ignored: drop --ids, or pick {}",
            Method::list(&Method::WITH_CONTEXT)
        );
    }
    if a.method == Method::Naive && !a.docs.is_empty() {
        bail!(
            "--method naive retrieves nothing, so --doc would be ignored: drop --doc, or pick {}",
            Method::list(&Method::WITH_CONTEXT)
        );
    }
    if a.method == Method::Naive && !a.filters.is_empty() {
        bail!(
            "--method naive retrieves nothing, so --filter would be ignored: drop --filter, or pick {}",
            Method::list(&Method::WITH_CONTEXT)
        );
    }
    let filter = (!a.filters.is_empty()).then(|| picaso_store::Filter::from_args(&a.filters)).transpose()?;
    let retriever = a.retriever.retriever()?;
    let store = picaso_store::Store::open(a.db.location()?)?;
    let model = load_model(&a.model, true)?;
    let t_retrieve = Instant::now();
    // The states read to generate, kept for --attribute (which would read them again: from S3,
    // a second download).
    let cache = picaso_store::StateCache::new(if a.attribute { usize::MAX } else { 0 });
    // The state to generate from. An answer given with --answer is not generated, so its
    // contexts are only looked up: attribution builds the states it scores.
    let prepare = |ids: &[i64]| match a.answer {
        Some(_) => Ok(None),
        None => picaso_store::prepare(&store, &model, ids, a.method, Some(&cache)).map(Some),
    };
    // Most relevant last (nearest the prompt), as composition wants.
    let embedder = match (&a.ids, a.method, retriever.needs_embedding()) {
        (None, m, true) if m != Method::Naive => {
            Some(picaso_store::find_embedder(a.embedder.as_deref(), Some(&store))?)
        }
        _ => None,
    };
    let q = match &embedder {
        Some(e) => e.embed_one(&a.prompt)?,
        None => Vec::new(),
    };
    let contexts = match &a.ids {
        Some(ids) => picaso_store::Contexts::Ids(ids),
        None if a.method == Method::Naive => picaso_store::Contexts::Nothing,
        None => {
            // BM25 needs no embedder: none is loaded.
            let docs = (!a.docs.is_empty()).then_some(&a.docs[..]);
            let mut what = picaso_store::Retrieval::new(&q, a.k)
                .within(docs)
                .matching(filter.as_ref())
                .by(retriever, Some(&a.prompt));
            if let Some(e) = &embedder {
                what = what.embedded_by(e.fingerprint());
            }
            picaso_store::Contexts::Retrieved(what)
        }
    };
    let (hits, prepared) = picaso_store::gather(&store, contexts, prepare)?;
    let ready = prepared.as_ref().map_or(0.0, |p| p.load_seconds + p.compose_seconds);
    let retrieve_seconds =
        prepared.as_ref().map_or(t_retrieve.elapsed().as_secs_f64(), |p| p.retrieval_seconds(t_retrieve));
    let ids: Vec<i64> = hits.iter().map(|h| h.0).collect();
    if let (true, Some(filter)) = (ids.is_empty(), &filter) {
        bail!(
            "no context of the store{} has metadata matching --filter {}: check the keys and values \
             (`picaso contexts --json` shows each context's metadata; values are compared as JSON, so \
             year=2024 does not match \"2024\", and a range compares numbers with numbers, strings with \
             strings){}",
            if a.docs.is_empty() { String::new() } else { format!(" within --doc {:?}", a.docs) },
            a.filters.join(" --filter "),
            if a.docs.is_empty() { crate::contexts::why_none_match(&store, filter)? } else { String::new() }
        );
    }
    if ids.is_empty() && a.ids.is_none() && a.method != Method::Naive {
        if store.is_empty()? {
            eprintln!(
                "(the store holds no contexts: {} has nothing to combine, so this answers without context)",
                a.method.name()
            );
        } else {
            eprintln!(
                "(no context shares a term with the prompt, so bm25 retrieved none and this answers without context; \
                 --retriever dense or hybrid retrieves by meaning)"
            );
        }
    }
    let tokenizer = model.tokenizer()?;
    let prompt = tokenizer.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("the prompt must contain at least one token");
    }
    if a.attribute || a.answer.is_some() {
        if a.method == Method::Naive {
            bail!(
                "--attribute leaves each context out in turn, but naive uses none: pick {}",
                Method::list(&Method::WITH_CONTEXT)
            );
        }
        if ids.is_empty() {
            bail!("no contexts to attribute the answer to: retrieve some (--k) or name them (--ids)");
        }
    }
    // The answer: the one given, else generated (streamed to stdout unless --json).
    let (generation, answer) = match (&a.answer, &prepared) {
        (Some(answer), _) => {
            let tokens = tokenizer.encode(answer)?;
            if tokens.is_empty() {
                bail!("--answer {answer:?} has no tokens: give the text to attribute");
            }
            (None, tokens)
        }
        (None, None) => unreachable!("the state is prepared unless --answer is given"),
        (None, Some(prepared)) => {
            let opts = a.sampling.options();
            let t0 = Instant::now();
            let mut first = None;
            let mut out = std::io::stdout();
            let g = generate(&model, &prompt, &prepared.state, &opts, |piece| {
                first.get_or_insert_with(|| t0.elapsed().as_secs_f64());
                // A closed stdout (`| head`) stops generation.
                a.json || out.write_all(piece.as_bytes()).and_then(|()| out.flush()).is_ok()
            })?;
            // The answer attributed is the text shown: a stop string's tokens are cut from it
            // (and may end mid-token), so its tokens are the text's own.
            let tokens = match g.stop_reason {
                picaso_model::StopReason::Stop => tokenizer.encode(&g.text)?,
                _ => g.tokens.clone(),
            };
            (Some((g, first)), tokens)
        }
    };
    let attribution = if a.attribute || a.answer.is_some() {
        if answer.is_empty() {
            eprintln!("(the answer is empty: nothing to attribute)");
            None
        } else {
            Some(picaso_store::attribute(&store, &model, &ids, a.method, &prompt, &answer, Some(&cache))?)
        }
    } else {
        None
    };
    let doc_of = |id: i64| store.get(id).map(|r| (r.doc, r.seg, r.text)).unwrap_or_default();
    if a.json {
        let contexts: Vec<_> = hits
            .iter()
            .enumerate()
            .map(|(i, (id, score))| {
                let (doc, metadata) = store.get(*id).map(|r| (r.doc, r.metadata)).unwrap_or_default();
                let mut c = json!({"id": id, "score": score, "doc": doc, "metadata": metadata});
                if let Some(at) = &attribution {
                    c["loglik_without"] = json!(at.without[i]);
                    c["drop"] = json!(at.drop(i));
                }
                c
            })
            .collect();
        let mut v = json!({"method": a.method.name(), "retriever": retriever.name(), "contexts": contexts, "retrieve_ms": 1e3 * retrieve_seconds});
        if let Some(p) = &prepared {
            v["load_ms"] = json!(1e3 * p.load_seconds);
            v["compose_ms"] = json!(1e3 * p.compose_seconds);
        }
        if let Some((g, first)) = &generation {
            v["time_to_first_token_ms"] = json!(first.map(|f| 1e3 * (ready + f)));
            v["text"] = json!(g.text);
            v["token_ids"] = json!(g.tokens);
            v["stop_reason"] = json!(g.stop_reason);
        }
        if let Some(at) = &attribution {
            v["attribution"] = json!({
                "answer": tokenizer.decode(&answer)?, "answer_tokens": at.answer_tokens, "loglik": at.loglik,
                "ranking": at.ranking().iter().map(|&i| ids[i]).collect::<Vec<_>>(), "ms": 1e3 * at.seconds,
            });
        }
        println!("{v}");
        return Ok(());
    }
    if let Some((_, first)) = &generation {
        println!();
        let first = first
            .map_or_else(|| "no token generated".into(), |f| format!("first token after {:.1} ms", 1e3 * (ready + f)));
        let sources: Vec<String> = ids
            .iter()
            .map(|&id| {
                let (doc, seg, _) = doc_of(id);
                format!("{id} ({doc} #{seg})")
            })
            .collect();
        let contexts =
            if sources.is_empty() { "no context".to_string() } else { format!("contexts {}", sources.join(", ")) };
        eprintln!("[{} · {contexts} · state ready in {:.1} ms · {first}]", a.method.name(), 1e3 * ready);
    }
    if let Some(at) = &attribution {
        print_attribution(at, &ids, doc_of);
    }
    Ok(())
}

/// The attribution table: the contexts, the one the answer owes most to first.
fn print_attribution(at: &picaso_store::Attribution, ids: &[i64], doc_of: impl Fn(i64) -> (String, u32, String)) {
    println!(
        "attribution: the answer's {} tokens have log-likelihood {:.3} nats with all {} contexts ({}); without each:",
        at.answer_tokens,
        at.loglik,
        ids.len(),
        at.method.name()
    );
    println!("  {:>10}  {:>6}  context", "drop nats", "id");
    for i in at.ranking() {
        let (doc, segment, text) = doc_of(ids[i]);
        println!("  {:>+10.3}  {:>6}  {doc} #{segment}: {}", at.drop(i), ids[i], crate::demo::snippet(&text, 60));
    }
    eprintln!("[leave-one-out over {} in {:.1} ms]", counted(ids.len(), "context"), 1e3 * at.seconds);
}
