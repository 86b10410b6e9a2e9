//! Lexical retrieval: an in-memory BM25 index over the contexts' text.
//!
//! Design decision: a compact hand-written inverted index instead of a search-engine crate.
//! The store already keeps every context's text and rebuilds its vector index from the catalog
//! at open, so it needs no second on-disk format — only term statistics, postings, adds and
//! removes, and a search among an allowed subset (document and metadata scopes). `tantivy`
//! brings 110 crates (40 new to this workspace) for a persistent engine picaso would not use;
//! the `bm25` crate brings 34 (9 new, two proc macros) and has no removal or scoped search.
//! See `docs/retrievers.md` for the measurements.
//!
//! Scoring is Lucene's BM25: `idf(t) = ln(1 + (N − df + 0.5) / (df + 0.5))` and
//! `idf · tf·(k1+1) / (tf + k1·(1 − b + b·len/avglen))`, summed over the query's distinct terms,
//! with k1 = 1.2 and b = 0.75. Terms are the lowercase alphanumeric runs of the text, English
//! stop words and single letters left out, no stemming ([`terms`]).

use std::collections::HashMap;

/// BM25's term-frequency saturation.
pub const K1: f32 = 1.2;
/// BM25's length normalisation.
pub const B: f32 = 0.75;
/// The tokenizer's version, recorded by stores: a change of [`terms`] changes every score.
pub const TOKENIZER: &str = "bm25-unicode-lower-stop/1";

/// Words too common to discriminate (the usual English list).
const STOP_WORDS: [&str; 80] = [
    "a", "about", "after", "all", "also", "an", "and", "any", "are", "as", "at", "be", "been", "but", "by", "can",
    "could", "did", "do", "does", "for", "from", "had", "has", "have", "he", "her", "his", "how", "if", "in", "into",
    "is", "it", "its", "may", "more", "most", "no", "not", "of", "on", "or", "other", "our", "she", "so", "some",
    "such", "than", "that", "the", "their", "them", "then", "there", "these", "they", "this", "those", "to", "up",
    "was", "we", "were", "what", "when", "where", "which", "while", "who", "will", "with", "would", "you", "your", "i",
    "me", "my", "s",
];

/// The terms BM25 indexes in `text`: maximal runs of alphanumeric characters, lowercased, less
/// stop words and one-letter runs (digits are kept).
pub fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .filter(|w| {
            let one_letter = w.chars().count() == 1 && !w.chars().all(|c| c.is_ascii_digit());
            !one_letter && !STOP_WORDS.contains(&w.as_str())
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Row {
    id: i64,
    len: u32,
    live: bool,
    /// (term, frequency), for removal.
    terms: Box<[(u32, u32)]>,
}

/// A BM25 index of texts keyed by context id.
#[derive(Debug, Clone, Default)]
pub struct Bm25Index {
    vocabulary: HashMap<String, u32>,
    /// Per term: (row, frequency), rows ascending; may hold removed rows until compaction.
    postings: Vec<Vec<(u32, u32)>>,
    /// Per term: live rows holding it.
    df: Vec<u32>,
    rows: Vec<Row>,
    by_id: HashMap<i64, u32>,
    live: usize,
    total_len: u64,
}

impl Bm25Index {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Contexts indexed.
    pub fn len(&self) -> usize {
        self.live
    }

    /// Whether no context is indexed.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Whether context `id` is indexed.
    pub fn contains(&self, id: i64) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Indexes `text` as context `id` (replacing what `id` had).
    pub fn add(&mut self, id: i64, text: &str) {
        self.remove(id);
        let mut counts: HashMap<u32, u32> = HashMap::new();
        let words = terms(text);
        for w in &words {
            let next = self.vocabulary.len() as u32;
            let t = *self.vocabulary.entry(w.clone()).or_insert(next);
            if t as usize == self.postings.len() {
                self.postings.push(Vec::new());
                self.df.push(0);
            }
            *counts.entry(t).or_default() += 1;
        }
        let row = self.rows.len() as u32;
        let mut list: Vec<(u32, u32)> = counts.into_iter().collect();
        list.sort_unstable();
        for &(t, tf) in &list {
            self.postings[t as usize].push((row, tf));
            self.df[t as usize] += 1;
        }
        self.rows.push(Row { id, len: words.len() as u32, live: true, terms: list.into() });
        self.by_id.insert(id, row);
        self.live += 1;
        self.total_len += words.len() as u64;
    }

    /// Removes context `id`; whether it was indexed.
    pub fn remove(&mut self, id: i64) -> bool {
        let Some(row) = self.by_id.remove(&id) else { return false };
        let r = &mut self.rows[row as usize];
        r.live = false;
        for &(t, _) in r.terms.iter() {
            self.df[t as usize] -= 1;
        }
        self.live -= 1;
        self.total_len -= r.len as u64;
        if self.rows.len() > 1024 && self.rows.len() > 2 * self.live {
            self.compact();
        }
        true
    }

    /// Drops removed rows (renumbering the rest) and rebuilds the postings from the rows' terms.
    fn compact(&mut self) {
        self.rows.retain(|r| r.live);
        self.by_id = self.rows.iter().enumerate().map(|(row, r)| (r.id, row as u32)).collect();
        for p in &mut self.postings {
            p.clear();
        }
        for (row, r) in self.rows.iter().enumerate() {
            for &(t, tf) in r.terms.iter() {
                self.postings[t as usize].push((row as u32, tf));
            }
        }
    }

    /// The `k` contexts that score highest for `query` (those with at least one of its terms),
    /// best first, equal scores by lower id; only ids in `allowed` (ascending) when given.
    pub fn search(&self, query: &str, k: usize, allowed: Option<&[i64]>) -> Vec<(i64, f32)> {
        if k == 0 || self.live == 0 {
            return Vec::new();
        }
        let mut words = terms(query);
        words.sort_unstable();
        words.dedup();
        let n = self.live as f32;
        let avg = (self.total_len as f32 / n).max(1.0);
        let mut scores: HashMap<u32, f32> = HashMap::new();
        for w in &words {
            let Some(&t) = self.vocabulary.get(w) else { continue };
            let df = self.df[t as usize] as f32;
            if df == 0.0 {
                continue;
            }
            let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
            for &(row, tf) in &self.postings[t as usize] {
                let r = &self.rows[row as usize];
                if !r.live {
                    continue;
                }
                let tf = tf as f32;
                let norm = K1 * (1.0 - B + B * r.len as f32 / avg);
                *scores.entry(row).or_default() += idf * tf * (K1 + 1.0) / (tf + norm);
            }
        }
        let mut hits: Vec<(i64, f32)> = scores
            .into_iter()
            .map(|(row, s)| (self.rows[row as usize].id, s))
            .filter(|(id, _)| allowed.is_none_or(|a| a.binary_search(id).is_ok()))
            .collect();
        let order = |a: &(i64, f32), b: &(i64, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if hits.len() > k {
            hits.select_nth_unstable_by(k - 1, order);
            hits.truncate(k);
        }
        hits.sort_unstable_by(order);
        hits
    }
}
