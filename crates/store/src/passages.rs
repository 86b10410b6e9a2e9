//! Query/continuation passages of a store ingested with `halves` segmentation, and their
//! retrieved contexts — the examples of the paper's WikiText experiment, shared by evaluation
//! (on the test split) and composition fine-tuning (on the validation split).
//!
//! Paragraph `p` of a document is stored as segment `2p` (its first half, the query) and
//! `2p + 1` (its second half, the continuation). The database of a query is every other
//! segment: its own two halves are never retrieved.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::retriever::{Query, Retriever};
use crate::store::Store;

/// One paragraph as a (query, continuation) pair of stored contexts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Passage {
    /// Source document.
    pub doc: String,
    /// Paragraph index in the document.
    pub paragraph: u32,
    /// Context id of the first half.
    pub query: i64,
    /// Context id of the second half.
    pub continuation: i64,
    /// The passage of paragraph `paragraph − 1` of the same document, if stored.
    pub previous: Option<usize>,
}

/// Every complete pair of the store, in ingest order.
pub fn passages(store: &Store) -> Result<Vec<Passage>> {
    match store.segmentation()? {
        Some(s) if s.starts_with("halves") => {}
        other => {
            return Err(Error::Input(format!(
                "{}: the store was ingested with segmentation {}, not halves; ingest the text with segmentation halves (--segment halves, Python segment=\"halves\") into a new store",
                store.location(),
                other.as_deref().unwrap_or("(unrecorded)")
            )))
        }
    }
    let mut halves: HashMap<(String, u32), [Option<i64>; 2]> = HashMap::new();
    let mut order = Vec::new();
    for id in store.ids()? {
        let (doc, seg) = store.doc_seg(id)?;
        let key = (doc, seg / 2);
        let slot = halves.entry(key.clone()).or_insert_with(|| {
            order.push(key);
            [None, None]
        });
        slot[(seg % 2) as usize] = Some(id);
    }
    let mut out: Vec<Passage> = order
        .into_iter()
        .filter_map(|key| match halves[&key] {
            [Some(query), Some(continuation)] => {
                Some(Passage { doc: key.0, paragraph: key.1, query, continuation, previous: None })
            }
            _ => None,
        })
        .collect();
    if out.is_empty() {
        return Err(Error::Input(format!(
            "{}: no (query, continuation) pairs; ingest the text with segmentation halves (--segment halves, Python segment=\"halves\")",
            store.location()
        )));
    }
    let index: HashMap<(&str, u32), usize> =
        out.iter().enumerate().map(|(i, p)| ((p.doc.as_str(), p.paragraph), i)).collect();
    let previous: Vec<Option<usize>> =
        out.iter().map(|p| p.paragraph.checked_sub(1).and_then(|q| index.get(&(p.doc.as_str(), q)).copied())).collect();
    for (p, prev) in out.iter_mut().zip(previous) {
        p.previous = prev;
    }
    Ok(out)
}

/// The `k` contexts most similar to `passage`'s query (by the stored embeddings), most similar
/// first, leaving out the passage's own halves.
pub fn retrieve(store: &Store, passage: &Passage, k: usize) -> Result<Vec<(i64, f32)>> {
    retrieve_by(store, passage, k, Retriever::Dense)
}

/// [`retrieve`] ranked by `retriever`: the query is the first half's stored embedding and
/// text. BM25 returns only contexts sharing a term with the query, so fewer than `k` can come
/// back (rarely: a query with no indexed term).
pub fn retrieve_by(store: &Store, passage: &Passage, k: usize, retriever: Retriever) -> Result<Vec<(i64, f32)>> {
    let available = store.len()?.saturating_sub(2);
    if k > available {
        return Err(Error::Input(format!(
            "k = {k} contexts asked, but the store holds only {available} besides the query's own passage"
        )));
    }
    let embedding = if retriever.needs_embedding() { Some(store.embedding(passage.query)?) } else { None };
    let text = if retriever.needs_text() { Some(store.get(passage.query)?.text) } else { None };
    let query = Query { text: text.as_deref(), embedding: embedding.as_deref(), encoder: None };
    let hits = store.retrieve_in(&query, retriever, k + 2, crate::scope::Scope::all())?;
    Ok(hits.into_iter().filter(|(id, _)| *id != passage.query && *id != passage.continuation).take(k).collect())
}
