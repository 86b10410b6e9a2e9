//! Ingest: documents → segments → (tokens, state, embedding) → store, in batches.
//!
//! Idempotent and resumable: segments whose (document, index) the store already holds with the
//! same text are skipped, and each batch commits on its own, so a killed run loses at most the
//! batch in flight and a re-run completes the rest. A document given again with other text is
//! brought up to date: its changed segments are replaced (new state, new id) and the segments
//! it no longer has are removed, so the store never serves a state of text that is gone. An
//! unchanged segment whose state object has gone missing is processed again (a new id), so
//! running the ingest again repairs a store that lost state files.

use picaso_model::counted;
use std::time::Instant;

use picaso_embed::Embedder;
use picaso_model::Model;

use crate::error::{Error, Result};
use crate::metadata::{check_metadata, Metadata};
use crate::sources::{Document, Segmentation};
use crate::store::{NewContext, Store};

/// A segment waiting to be processed.
#[derive(Debug, Clone)]
struct Pending {
    doc: String,
    seg: u32,
    text: String,
    tokens: Vec<u32>,
    /// The context stored for this (document, segment) with other text, or with the same
    /// text and no state object, removed when this segment's batch commits.
    replaces: Option<i64>,
    /// The stored context has this text but lost its state object.
    repairs: bool,
    /// Its document's metadata.
    metadata: Metadata,
}

/// Progress of a run, reported after each batch.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IngestProgress {
    /// Contexts this run has to process (new and changed segments; unchanged ones excluded).
    pub total: usize,
    /// Contexts processed and committed by this run so far (replacements included).
    pub done: usize,
    /// Of `done`, those that replaced a stored context whose text changed.
    pub replaced: usize,
    /// Of `done`, those that replaced a stored context with the same text whose state object
    /// was missing.
    pub repaired: usize,
    /// Stored contexts removed because their document no longer has their segment (counted
    /// once the last batch has committed).
    pub removed: usize,
    /// Tokens processed by this run so far.
    pub tokens: usize,
    /// Segments skipped because the store already had them, with the same text.
    pub skipped: usize,
    /// Of `skipped`, those whose metadata this run changed (their document's metadata changed
    /// and their text did not; counted once the last batch has committed).
    pub relabelled: usize,
    /// Seconds since the run started.
    pub seconds: f64,
}

impl IngestProgress {
    /// Contexts this run added for segments the store lacked (`done` less the replacements
    /// and repairs).
    pub fn added(&self) -> usize {
        self.done - self.replaced - self.repaired
    }

    /// One line for people: what was added, replaced, removed and skipped.
    pub fn summary(&self) -> String {
        let mut s = format!("added {}", counted(self.added(), "context"));
        if self.replaced > 0 {
            s += &format!(" and replaced {} whose text changed", self.replaced);
        }
        if self.repaired > 0 {
            s += &format!(", repaired {} whose state file was missing", self.repaired);
        }
        s += &format!(" ({} tokens) in {:.1} s", self.tokens, self.seconds);
        if self.removed > 0 {
            s += &format!(", removed {} that their documents no longer have", self.removed);
        }
        s += &format!(", skipped {} already stored", self.skipped);
        if self.relabelled > 0 {
            s += &format!(" (of which {} took their document's new metadata)", self.relabelled);
        }
        s
    }
}

/// What a run has to do: the segments to process, the number of unchanged ones, and the stored
/// contexts whose segments the documents no longer have.
struct Plan {
    pending: Vec<Pending>,
    skipped: usize,
    stale: Vec<i64>,
    /// Unchanged segments stored with other metadata than their document's: (document, ids).
    relabel: Vec<(usize, Vec<i64>)>,
}

/// A document's segments as ingest cuts them: (segment index, text, tokens), empty ones included.
pub fn segments(model: &Model, doc: &Document, segmentation: Segmentation) -> Result<Vec<(u32, String, Vec<u32>)>> {
    let tokenizer = model.tokenizer()?;
    Ok(match segmentation {
        Segmentation::Paragraph => doc
            .paragraphs
            .iter()
            .enumerate()
            .map(|(i, p)| Ok((i as u32, p.clone(), tokenizer.encode(p)?)))
            .collect::<std::result::Result<_, picaso_model::Error>>()?,
        Segmentation::Tokens(n) => {
            let all = tokenizer.encode(&doc.paragraphs.join("\n"))?;
            let mut out = Vec::new();
            let mut start = 0;
            while start < all.len() {
                let end = if start + n >= all.len() {
                    all.len()
                } else {
                    (0..n.min(MAX_CHAR_TOKENS))
                        .map(|back| start + n - back)
                        .find(|&cut| starts_a_character(tokenizer, &all[cut..]))
                        .unwrap_or(start + n)
                };
                let chunk = &all[start..end];
                out.push((out.len() as u32, tokenizer.decode(chunk)?, chunk.to_vec()));
                start = end;
            }
            out
        }
        Segmentation::Halves(min) => {
            let mut out = Vec::new();
            for (p, text) in doc.paragraphs.iter().enumerate() {
                let tokens = tokenizer.encode(text)?;
                if tokens.len() < min {
                    continue;
                }
                let middle = tokens.len() / 2;
                let cut = (0..MAX_CHAR_TOKENS)
                    .flat_map(|d| [middle - d.min(middle), middle + d])
                    .filter(|&c| c > 0 && c < tokens.len())
                    .find(|&c| starts_a_character(tokenizer, &tokens[c..]))
                    .unwrap_or(middle);
                let (a, b) = tokens.split_at(cut);
                out.push((2 * p as u32, tokenizer.decode(a)?, a.to_vec()));
                out.push((2 * p as u32 + 1, tokenizer.decode(b)?, b.to_vec()));
            }
            out
        }
    })
}

/// Most tokens one character can span: byte-level tokens hold at least a byte, a UTF-8
/// character at most four.
const MAX_CHAR_TOKENS: usize = 4;

/// Whether `rest` begins on a character boundary, so a cut before it splits no character in
/// two (each half's text would show U+FFFD for its piece): its first tokens decode to text that
/// does not start with a replacement character.
fn starts_a_character(tokenizer: &picaso_model::TextTokenizer, rest: &[u32]) -> bool {
    tokenizer.decode(&rest[..rest.len().min(MAX_CHAR_TOKENS)]).is_ok_and(|t| !t.starts_with('\u{FFFD}'))
}

/// Cuts `docs` into segments (token ids included) and sets them against what `store` holds:
/// unchanged segments are skipped, changed ones replace their stored context, and stored
/// segments a document no longer has (or has empty) become stale.
fn plan(store: &Store, model: &Model, docs: &[Document], segmentation: Segmentation) -> Result<Plan> {
    let mut ids = std::collections::HashSet::new();
    if let Some(doc) = docs.iter().find(|d| !ids.insert(d.id.as_str())) {
        return Err(Error::Input(format!(
            "two documents have the id {:?}; give every document its own id (the store keeps one context per id and segment)",
            doc.id
        )));
    }
    let mut plan = Plan { pending: Vec::new(), skipped: 0, stale: Vec::new(), relabel: Vec::new() };
    // Unchanged segments' records, and the index of each one's document.
    let (mut unchanged, mut unchanged_doc) = (Vec::new(), Vec::new());
    for (d, doc) in docs.iter().enumerate() {
        check_metadata(&doc.metadata, &format!("document {:?}", doc.id))?;
        let mut stored: std::collections::BTreeMap<u32, crate::ContextRecord> =
            store.document(&doc.id)?.into_iter().map(|r| (r.seg, r)).collect();
        for (seg, text, tokens) in segments(model, doc, segmentation)? {
            let old = stored.remove(&seg);
            if tokens.is_empty() {
                plan.stale.extend(old.map(|r| r.id));
            } else if old.as_ref().is_some_and(|r| r.text == text && r.tokens == tokens) {
                if let Some(r) = old.as_ref().filter(|r| r.metadata != doc.metadata) {
                    match plan.relabel.last_mut() {
                        Some((last, ids)) if *last == d => ids.push(r.id),
                        _ => plan.relabel.push((d, vec![r.id])),
                    }
                }
                unchanged.extend(old);
                unchanged_doc.push(d);
            } else {
                let replaces = old.map(|r| r.id);
                let metadata = doc.metadata.clone();
                plan.pending.push(Pending {
                    doc: doc.id.clone(),
                    seg,
                    text,
                    tokens,
                    replaces,
                    repairs: false,
                    metadata,
                });
            }
        }
        plan.stale.extend(stored.into_values().map(|r| r.id));
    }
    let missing = store.missing_states(&unchanged)?;
    for (r, d) in unchanged.into_iter().zip(unchanged_doc) {
        if missing.contains(&r.id) {
            plan.pending.push(Pending {
                doc: r.doc,
                seg: r.seg,
                text: r.text,
                tokens: r.tokens,
                replaces: Some(r.id),
                repairs: true,
                metadata: docs[d].metadata.clone(),
            });
        } else {
            plan.skipped += 1;
        }
    }
    Ok(plan)
}

/// Tokens per forward pass when a batch's contexts are prefilled together: enough rows to share
/// each weight read widely, few enough that the activations stay small (~160 MiB at mamba2-130m's width).
const PREFILL_TOKENS: usize = 4096;

/// Processes and stores every segment of `docs` the store lacks or holds with other text,
/// `batch` contexts per commit, then removes the stored segments the documents no longer have.
/// A changed segment's old context is deleted just before the batch holding its new one commits
/// (a kill in between leaves the segment absent until the next run, never stale). Where the
/// model is batch-invariant, a batch's contexts share forward passes: each state is still, to
/// the bit, the one its context gives alone (so `--restate` reproduces the store).
pub fn ingest(
    store: &Store,
    model: &Model,
    embedder: &Embedder,
    docs: &[Document],
    segmentation: Segmentation,
    batch: usize,
    mut on_progress: impl FnMut(&IngestProgress),
) -> Result<IngestProgress> {
    ingest_while(store, model, embedder, docs, segmentation, batch, |p| {
        on_progress(p);
        true
    })
}

/// [`ingest()`] that stops when `on_progress` returns false (a caller's callback failed, a user
/// interrupted): the batches committed stay, nothing else is done (not even removing the
/// segments the documents lost), and running it again carries on.
pub fn ingest_while(
    store: &Store,
    model: &Model,
    embedder: &Embedder,
    docs: &[Document],
    segmentation: Segmentation,
    batch: usize,
    mut on_progress: impl FnMut(&IngestProgress) -> bool,
) -> Result<IngestProgress> {
    store.require_model(model)?;
    let _writer = store.lock_writes()?;
    store.bind_segmentation(&segmentation.to_string())?;
    store.bind_embedder(embedder.fingerprint(), &embedder.dir().display().to_string())?;
    let start = Instant::now();
    let Plan { pending, skipped, stale, relabel } = plan(store, model, docs, segmentation)?;
    let mut progress = IngestProgress { total: pending.len(), skipped, ..Default::default() };
    if !on_progress(&progress) {
        return Ok(progress);
    }
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
                metadata: p.metadata.clone(),
            });
        }
        // The chunk's replaced contexts go together (one pass over the index).
        let gone = store.delete_many(&chunk.iter().filter_map(|p| p.replaces).collect::<Vec<_>>())?;
        let replaced: Vec<bool> =
            chunk.iter().map(|p| p.replaces.is_some_and(|id| gone.binary_search(&id).is_ok())).collect();
        // Only what this run inserted counts: a segment another writer stored meanwhile (a
        // concurrent ingest of the same documents into a PostgreSQL store) is skipped.
        for ((p, id), replaced) in chunk.iter().zip(store.insert_with(&items, Some(model))?).zip(replaced) {
            if id.is_some() {
                progress.done += 1;
                if replaced && p.repairs {
                    progress.repaired += 1;
                } else if replaced {
                    progress.replaced += 1;
                }
                progress.tokens += p.tokens.len();
            } else {
                progress.skipped += 1;
            }
        }
        progress.seconds = start.elapsed().as_secs_f64();
        if !on_progress(&progress) {
            return Ok(progress);
        }
    }
    for (d, ids) in relabel {
        progress.relabelled += store.set_metadata(&ids, &docs[d].metadata)? as usize;
    }
    progress.removed += store.delete_many(&stale)?.len();
    progress.seconds = start.elapsed().as_secs_f64();
    Ok(progress)
}

/// Removes the store's documents that `docs` does not hold (files deleted from a folder since
/// it was ingested): with [`ingest()`] of the same `docs`, the store mirrors the source.
/// Returns (documents, contexts) removed. Refuses an empty `docs`, which would empty the store.
pub fn prune(store: &Store, docs: &[Document]) -> Result<(usize, usize)> {
    if docs.is_empty() {
        return Err(Error::Input(
            "the source holds no documents; pruning would remove every document of the store (check the path)".into(),
        ));
    }
    let _writer = store.lock_writes()?;
    let keep: std::collections::HashSet<&str> = docs.iter().map(|d| d.id.as_str()).collect();
    let (mut documents, mut contexts) = (0, 0);
    for doc in store.all_documents()? {
        if !keep.contains(doc.id.as_str()) {
            contexts += store.delete_document(&doc.id)?.len();
            documents += 1;
        }
    }
    Ok((documents, contexts))
}
