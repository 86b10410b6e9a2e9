//! Ingest: documents → segments → (tokens, state, embedding) → store, in batches.
//!
//! Idempotent and resumable: segments whose (document, index) the store already holds are
//! skipped, and each batch commits on its own, so a killed run loses at most the batch in
//! flight and a re-run completes the rest.

use std::time::Instant;

use picaso_embed::Embedder;
use picaso_model::Model;

use crate::error::{Error, Result};
use crate::sources::{Document, Segmentation};
use crate::store::{NewContext, Store};

/// A segment waiting to be processed.
#[derive(Debug, Clone)]
struct Pending {
    doc: String,
    seg: u32,
    text: String,
    tokens: Vec<u32>,
}

/// Progress of a run, reported after each batch.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IngestProgress {
    /// Contexts this run has to process (stored ones excluded).
    pub total: usize,
    /// Contexts processed and committed by this run so far.
    pub done: usize,
    /// Tokens processed by this run so far.
    pub tokens: usize,
    /// Segments skipped because the store already had them.
    pub skipped: usize,
    /// Seconds since the run started.
    pub seconds: f64,
}

/// Cuts `docs` into segments (token ids included), leaving out those `store` already holds
/// and empty ones.
fn plan(store: &Store, model: &Model, docs: &[Document], segmentation: Segmentation) -> Result<(Vec<Pending>, usize)> {
    let tokenizer = model.tokenizer()?;
    let mut ids = std::collections::HashSet::new();
    if let Some(doc) = docs.iter().find(|d| !ids.insert(d.id.as_str())) {
        return Err(Error::Input(format!(
            "two documents have the id {:?}; give every document its own id (the store keeps one context per id and segment)",
            doc.id
        )));
    }
    let mut pending = Vec::new();
    let mut skipped = 0;
    for doc in docs {
        let have = store.segments_of(&doc.id)?;
        let segments: Vec<(u32, String, Vec<u32>)> = match segmentation {
            Segmentation::Paragraph => doc
                .paragraphs
                .iter()
                .enumerate()
                .map(|(i, p)| Ok((i as u32, p.clone(), tokenizer.encode(p)?)))
                .collect::<std::result::Result<_, picaso_model::Error>>()?,
            Segmentation::Tokens(n) => {
                let all = tokenizer.encode(&doc.paragraphs.join("\n"))?;
                all.chunks(n)
                    .enumerate()
                    .map(|(i, c)| Ok((i as u32, tokenizer.decode(c)?, c.to_vec())))
                    .collect::<std::result::Result<_, picaso_model::Error>>()?
            }
            Segmentation::Halves(min) => {
                let mut out = Vec::new();
                for (p, text) in doc.paragraphs.iter().enumerate() {
                    let tokens = tokenizer.encode(text)?;
                    if tokens.len() < min {
                        continue;
                    }
                    let (a, b) = tokens.split_at(tokens.len() / 2);
                    out.push((2 * p as u32, tokenizer.decode(a)?, a.to_vec()));
                    out.push((2 * p as u32 + 1, tokenizer.decode(b)?, b.to_vec()));
                }
                out
            }
        };
        for (seg, text, tokens) in segments {
            if have.contains(&seg) {
                skipped += 1;
            } else if !tokens.is_empty() {
                pending.push(Pending { doc: doc.id.clone(), seg, text, tokens });
            }
        }
    }
    Ok((pending, skipped))
}

/// Tokens per forward pass when a batch's contexts are prefilled together: enough rows to share
/// each weight read widely, few enough that the activations stay small (~160 MiB at mamba2-130m's width).
const PREFILL_TOKENS: usize = 4096;

/// Processes and stores every segment of `docs` the store lacks, `batch` contexts per commit.
/// Where the model is batch-invariant, a batch's contexts share forward passes: each state is
/// still, to the bit, the one its context gives alone (so `--restate` reproduces the store).
pub fn ingest(
    store: &Store,
    model: &Model,
    embedder: &Embedder,
    docs: &[Document],
    segmentation: Segmentation,
    batch: usize,
    mut on_progress: impl FnMut(&IngestProgress),
) -> Result<IngestProgress> {
    if store.info().fingerprint != model.fingerprint() {
        return Err(Error::WrongModel {
            location: store.location().to_string(),
            stored: store.info().fingerprint.clone(),
            given: model.fingerprint().to_string(),
        });
    }
    let _writer = store.lock_writes()?;
    store.bind_segmentation(&segmentation.to_string())?;
    store.bind_embedder(embedder.fingerprint(), &embedder.dir().display().to_string())?;
    let start = Instant::now();
    let (pending, skipped) = plan(store, model, docs, segmentation)?;
    let mut progress = IngestProgress { total: pending.len(), skipped, ..Default::default() };
    on_progress(&progress);
    for chunk in pending.chunks(batch.max(1)) {
        let texts: Vec<&str> = chunk.iter().map(|p| p.text.as_str()).collect();
        let embeddings = embedder.embed(&texts)?;
        let tokens: Vec<&[u32]> = chunk.iter().map(|p| p.tokens.as_slice()).collect();
        let states = model.prefill_each(&tokens, PREFILL_TOKENS)?;
        let mut items = Vec::with_capacity(chunk.len());
        for ((p, embedding), state) in chunk.iter().zip(embeddings).zip(states) {
            items.push(NewContext {
                doc: p.doc.clone(),
                seg: p.seg,
                text: p.text.clone(),
                tokens: p.tokens.clone(),
                embedding,
                state,
            });
        }
        store.insert(&items)?;
        progress.done += chunk.len();
        progress.tokens += chunk.iter().map(|p| p.tokens.len()).sum::<usize>();
        progress.seconds = start.elapsed().as_secs_f64();
        on_progress(&progress);
    }
    progress.seconds = start.elapsed().as_secs_f64();
    Ok(progress)
}
