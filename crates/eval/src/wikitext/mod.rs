//! The paper's WikiText experiment (Section 6): each passage is split into a query and a
//! continuation of equal tokens; the k segments most similar to the query are retrieved from
//! every other segment; each method turns them into a state, the query is processed from it,
//! and the continuation's mean negative log-likelihood is the score.

use std::collections::HashMap;

use picaso_model::{Method, Model};
use picaso_store::{passages, retrieve_by, Passage, Retriever, Store};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::database::{cache_cap, check_model, Contexts};
use crate::methods::{continuation_nll, start_state};
use crate::stats::{mean_ci95, paired_ci95};
use crate::{Error, Result};

mod report;
pub use report::{picaso_r_share, rewrite_wikitext, write_wikitext};

/// What to run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Options {
    /// Numbers of retrieved contexts to score, ascending (e.g. 1..=10; the scaling experiment
    /// goes to 50).
    pub ks: Vec<usize>,
    /// Methods to score (Naive is always scored: it is the reference).
    pub methods: Vec<Method>,
    /// Score this many passages drawn with `seed` (all if `None`).
    pub sample: Option<usize>,
    /// Seed of the sample.
    pub seed: u64,
    /// Recompute the contexts' states with the given model from their stored tokens instead of
    /// reading the stored states (to evaluate another model, e.g. a fine-tuned one, on a store
    /// ingested once: retrieval uses the stored embeddings, which do not depend on the model).
    pub restate: bool,
    /// Which retriever ranks the segments (dense by default: the store's embeddings).
    #[serde(default, skip_serializing_if = "is_dense")]
    pub retriever: Retriever,
    /// Journal every scored passage here, and resume from what it holds (a long run that is
    /// stopped goes on where it was; see [`crate::journal`]).
    #[serde(skip)]
    pub journal: Option<std::path::PathBuf>,
}

fn is_dense(r: &Retriever) -> bool {
    *r == Retriever::Dense
}

/// One passage's results, as journaled.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Scored {
    query_tokens: usize,
    continuation_tokens: usize,
    naive: f64,
    /// (method, k, loss, seconds to make the state, tokens processed to make it).
    cells: Vec<(String, usize, f64, f64, usize)>,
    /// Whether the query's true neighbour (the segment just before it: the second half of the
    /// previous paragraph) is stored, and its rank among the retrieved (1 = first), if found.
    /// Written so that a journal read back keeps the misses: `None` (no stored neighbour) leaves
    /// the field out, a neighbour not retrieved is `null`, one found its rank. (Journals of
    /// format 1 wrote `null` for both, so a resumed run lost its misses and overstated the
    /// recall; the header's `journal` version keeps them from being resumed.)
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "present")]
    neighbour: Option<Option<usize>>,
}

/// A field that is present: `null` is `Some(None)`, not `None` (see [`Scored::neighbour`]).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Option<usize>>, D::Error> {
    <Option<usize> as serde::Deserialize>::deserialize(d).map(Some)
}

/// The format of the journal's lines ([`Scored`]); a journal of another format is not resumed.
const JOURNAL_FORMAT: u32 = 2;

/// One (method, k) cell of the table.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Cell {
    /// Method.
    pub method: Method,
    /// Contexts.
    pub k: usize,
    /// Mean continuation NLL (nats/token) over the passages.
    pub loss: f64,
    /// Half-width of its 95% confidence interval (`None` for one passage).
    pub ci95: Option<f64>,
    /// Relative improvement over Naive, percent (positive = lower loss).
    pub improvement_pct: f64,
    /// Mean milliseconds to make the state (composition or processing; loading excluded).
    pub prepare_ms: f64,
    /// Mean tokens processed to make the state.
    pub tokens_processed: f64,
}

/// The experiment's results.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Report {
    /// Options used.
    pub options: Options,
    /// Passages in the store.
    pub passages_available: usize,
    /// Passages scored.
    pub passages: usize,
    /// Mean tokens of a query and of a continuation.
    pub mean_query_tokens: f64,
    /// Mean tokens of a continuation.
    pub mean_continuation_tokens: f64,
    /// Naive loss (no context), with its interval.
    pub naive_loss: f64,
    /// Half-width of the naive loss's interval (`None` for one passage).
    pub naive_ci95: Option<f64>,
    /// One cell per (method, k).
    pub cells: Vec<Cell>,
    /// Paired comparisons on the same passages, per k.
    pub contrasts: Vec<Contrast>,
    /// Retrieval recall of the true neighbouring segment (the one just before the query, the
    /// second half of the previous paragraph), per k: the fraction of passages that have one
    /// whose neighbour is among the k retrieved.
    #[serde(default)]
    pub neighbour_recall: Vec<(usize, f64)>,
    /// Passages with a stored neighbour (the denominator of the recall).
    #[serde(default)]
    pub neighbour_passages: usize,
    /// Every passage's loss per (method, k), in the order scored (Naive under every k): what
    /// pairs two models run on the same passages. Not written to results.json.
    #[serde(skip)]
    pub losses: HashMap<(Method, usize), Vec<f64>>,
}

/// Method `a` against method `b` on the same passages: the mean per-passage loss difference
/// `b − a` (positive: `a` is better) with its paired 95% interval — far narrower than the
/// cells' own intervals, because the passages' difficulty cancels.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Contrast {
    /// Contexts.
    pub k: usize,
    /// The method compared.
    pub a: Method,
    /// What it is compared with.
    pub b: Method,
    /// Mean of `loss_b − loss_a` (nats/token).
    pub gain: f64,
    /// Its 95% interval half-width (`None` for one passage).
    pub gain_ci95: Option<f64>,
    /// The same as a percentage of Naive's mean loss.
    pub gain_pct: f64,
    /// Its 95% interval half-width (percentage points).
    pub gain_pct_ci95: Option<f64>,
}

impl Options {
    /// The largest k.
    pub fn max_k(&self) -> usize {
        self.ks.iter().copied().max().unwrap_or(0)
    }
}

/// Refuses a sample of 0, which would score nothing (every experiment's `--sample`): a check
/// that needs no data, so a command can make it before any slow loading.
pub fn check_sample(sample: Option<usize>) -> Result<()> {
    if sample == Some(0) {
        return Err(Error::Input("a sample of 0 passages scores nothing: give --sample of at least 1".into()));
    }
    Ok(())
}

/// The passages to score: all, or `sample` of them drawn with `seed`.
pub fn choose<T>(mut all: Vec<T>, sample: Option<usize>, seed: u64) -> Result<Vec<T>> {
    check_sample(sample)?;
    if let Some(n) = sample {
        all.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        all.truncate(n);
    }
    Ok(all)
}

/// Checks a list of k: non-empty, ascending, no zero.
pub fn check_ks(ks: &[usize]) -> Result<()> {
    if ks.is_empty() || ks[0] == 0 || ks.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::Input(format!("k values {ks:?}: give ascending values of at least 1, e.g. 1,2,5,10")));
    }
    Ok(())
}

impl Report {
    /// The cell of `method` at `k`.
    pub fn cell(&self, method: Method, k: usize) -> Option<&Cell> {
        self.cells.iter().find(|c| c.method == method && c.k == k)
    }

    /// Mean improvement over Naive (percent) of `method` across every k.
    pub fn mean_improvement(&self, method: Method) -> Option<f64> {
        let v: Vec<f64> = self.cells.iter().filter(|c| c.method == method).map(|c| c.improvement_pct).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }
}

/// Runs the experiment; `progress(done, total)` after each passage.
pub fn run(model: &Model, store: &Store, options: &Options, mut progress: impl FnMut(usize, usize)) -> Result<Report> {
    check_model(store, model, options.restate)?;
    check_ks(&options.ks)?;
    let all = passages(store)?;
    let available = all.len();
    let chosen: Vec<&Passage> = choose(all.iter().collect(), options.sample, options.seed)?;
    // Retrieval refuses a k the store cannot supply. Asked once here, before the journal is
    // opened, it refuses it before anything is written into the results folder (a journal left
    // by a refused run would block the corrected command as "other settings").
    if let Some(first) = chosen.first() {
        retrieve_by(store, first, options.max_k(), options.retriever)?;
    }
    let mut methods: Vec<Method> = options.methods.iter().copied().filter(|m| *m != Method::Naive).collect();
    methods.dedup();

    let mut naive = Vec::new();
    let mut losses: HashMap<(Method, usize), Vec<f64>> = HashMap::new();
    let mut costs: HashMap<(Method, usize), (f64, f64)> = HashMap::new();
    let (mut q_tokens, mut c_tokens) = (0usize, 0usize);
    let mut ranks: Vec<Option<usize>> = Vec::new();
    let mut contexts = Contexts::new(store, options.restate);
    let cap = cache_cap(model);
    let (mut journal, mut resumed) = match &options.journal {
        Some(path) => {
            let header = serde_json::json!({
                "experiment": "wikitext",
                "journal": JOURNAL_FORMAT,
                "model": model.fingerprint(),
                "options": options,
                "queries": chosen.iter().map(|p| p.query).collect::<Vec<_>>(),
            });
            let (j, done) = crate::journal::Journal::open::<Scored>(path, &header)?;
            (Some(j), done.into_iter())
        }
        None => (None, Vec::new().into_iter()),
    };
    for (done, passage) in chosen.iter().enumerate() {
        let scored = match resumed.next() {
            Some(s) => s,
            None => {
                let neighbour = passage.previous.map(|i| all[i].continuation);
                let s = score_passage(model, store, passage, neighbour, options, &methods, &mut contexts, cap)?;
                if let Some(j) = journal.as_mut() {
                    j.append(&s)?;
                }
                s
            }
        };
        if let Some(rank) = scored.neighbour {
            ranks.push(rank);
        }
        q_tokens += scored.query_tokens;
        c_tokens += scored.continuation_tokens;
        naive.push(scored.naive);
        for (name, k, nll, seconds, tokens) in scored.cells {
            let method: Method = name.parse().map_err(|e: picaso_model::UnknownMethod| Error::Input(e.to_string()))?;
            losses.entry((method, k)).or_default().push(nll);
            let c = costs.entry((method, k)).or_default();
            c.0 += seconds;
            c.1 += tokens as f64;
        }
        progress(done + 1, chosen.len());
    }

    let n = chosen.len() as f64;
    let (naive_loss, naive_ci95) = mean_ci95(&naive);
    let mut cells = Vec::new();
    for &k in &options.ks {
        cells.push(Cell {
            method: Method::Naive,
            k,
            loss: naive_loss,
            ci95: naive_ci95,
            improvement_pct: 0.0,
            prepare_ms: 0.0,
            tokens_processed: 0.0,
        });
        for &method in &methods {
            let (loss, ci95) = mean_ci95(&losses[&(method, k)]);
            let (secs, toks) = costs[&(method, k)];
            cells.push(Cell {
                method,
                k,
                loss,
                ci95,
                improvement_pct: 100.0 * (naive_loss - loss) / naive_loss,
                prepare_ms: 1e3 * secs / n,
                tokens_processed: toks / n,
            });
        }
    }
    losses.extend(options.ks.iter().map(|&k| ((Method::Naive, k), naive.clone())));
    let contrasts = contrasts(&options.ks, &losses, naive_loss);
    let neighbour_recall = options
        .ks
        .iter()
        .map(|&k| {
            let found = ranks.iter().filter(|r| r.is_some_and(|r| r <= k)).count();
            (k, if ranks.is_empty() { 0.0 } else { found as f64 / ranks.len() as f64 })
        })
        .collect();
    Ok(Report {
        neighbour_recall,
        neighbour_passages: ranks.len(),
        options: options.clone(),
        passages_available: available,
        passages: chosen.len(),
        mean_query_tokens: q_tokens as f64 / n,
        mean_continuation_tokens: c_tokens as f64 / n,
        naive_loss,
        naive_ci95,
        cells,
        contrasts,
        losses,
    })
}

/// Scores one passage: Naive, then every method at every k from its retrieved contexts.
#[allow(clippy::too_many_arguments)]
fn score_passage(
    model: &Model,
    store: &Store,
    passage: &Passage,
    neighbour: Option<i64>,
    options: &Options,
    methods: &[Method],
    contexts: &mut Contexts<'_>,
    cap: usize,
) -> Result<Scored> {
    let query = store.get(passage.query)?.tokens;
    let continuation = store.get(passage.continuation)?.tokens;
    let naive = continuation_nll(model, &model.zero_state(), &query, &continuation)?;
    let ids: Vec<i64> =
        retrieve_by(store, passage, options.max_k(), options.retriever)?.into_iter().map(|(id, _)| id).collect();
    let neighbour = neighbour.map(|n| ids.iter().position(|&id| id == n).map(|i| i + 1));
    contexts.load(model, &ids, cap)?;
    let retrieved = contexts.get(&ids);
    let mut cells = Vec::new();
    for &k in &options.ks {
        for &method in methods {
            // BM25 can find fewer than k segments (a query sharing few terms): all it found.
            let started = start_state(model, method, &retrieved[..k.min(retrieved.len())])?;
            let nll = continuation_nll(model, &started.state, &query, &continuation)?;
            cells.push((method.to_string(), k, nll, started.seconds, started.tokens_processed));
        }
    }
    Ok(Scored { query_tokens: query.len(), continuation_tokens: continuation.len(), naive, cells, neighbour })
}

/// The paper's comparisons ([`claim_pairs`](crate::methods::claim_pairs)) where both methods were scored.
fn contrasts(ks: &[usize], losses: &HashMap<(Method, usize), Vec<f64>>, naive_loss: f64) -> Vec<Contrast> {
    let pairs = crate::methods::claim_pairs();
    let mut out = Vec::new();
    for &k in ks {
        for &(a, b) in &pairs {
            let (Some(la), Some(lb)) = (losses.get(&(a, k)), losses.get(&(b, k))) else { continue };
            let (gain, gain_ci95) = paired_ci95(lb, la);
            let pct = 100.0 / naive_loss;
            let gain_pct_ci95 = gain_ci95.map(|c| c * pct);
            out.push(Contrast { k, a, b, gain, gain_ci95, gain_pct: gain * pct, gain_pct_ci95 });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use picaso_model::Composition;

    use super::*;

    /// A journaled passage keeps whether its neighbour is stored and missed, stored and found,
    /// or not stored: the recall's denominator counts the misses of a resumed run too.
    #[test]
    fn a_journaled_neighbour_keeps_its_misses() {
        for neighbour in [None, Some(None), Some(Some(3))] {
            let s = Scored { query_tokens: 1, continuation_tokens: 2, naive: 0.5, cells: Vec::new(), neighbour };
            let back: Scored = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
            assert_eq!(back.neighbour, neighbour);
        }
    }

    /// Paired gains are the mean per-passage difference; their interval is narrow when the
    /// methods move together even if the passages' losses spread widely.
    #[test]
    fn contrasts_are_paired_per_passage() {
        let naive = vec![2.0, 6.0, 4.0];
        let concat = vec![1.9, 5.9, 3.9];
        let soup = vec![2.0, 6.0, 4.0];
        let r = vec![1.95, 5.95, 3.95];
        let mut losses = HashMap::new();
        losses.insert((Method::Naive, 1), naive);
        losses.insert((Method::Concat, 1), concat);
        losses.insert((Method::Compose(Composition::Soup), 1), soup);
        losses.insert((Method::Compose(Composition::PicasoR), 1), r);
        let c = contrasts(&[1], &losses, 4.0);
        let find = |a: Method, b: Method| c.iter().find(|x| x.a == a && x.b == b).unwrap();
        let cn = find(Method::Concat, Method::Naive);
        assert!((cn.gain - 0.1).abs() < 1e-12 && cn.gain_ci95.unwrap() < 1e-9, "{cn:?}");
        assert!((cn.gain_pct - 2.5).abs() < 1e-9);
        let rs = find(Method::Compose(Composition::PicasoR), Method::Compose(Composition::Soup));
        assert!((rs.gain - 0.05).abs() < 1e-12);
        let rc = find(Method::Compose(Composition::PicasoR), Method::Concat);
        assert!((rc.gain + 0.05).abs() < 1e-12, "PICASO-R is worse than Concat here");
        // Methods that were not scored are left out.
        assert!(c.iter().all(|x| x.a != Method::Compose(Composition::Caso)));
    }

    /// A hybrid's ablations are each paired with Naive and with PICASO-R (which has both halves).
    #[test]
    fn a_hybrids_ablations_are_paired() {
        let mut losses = HashMap::new();
        losses.insert((Method::Naive, 2), vec![3.0, 4.0]);
        losses.insert((Method::Compose(Composition::PicasoR), 2), vec![2.8, 3.7]);
        losses.insert((Method::KvUnion, 2), vec![2.9, 3.8]);
        losses.insert((Method::PicasoRNoKv, 2), vec![3.1, 4.05]);
        let c = contrasts(&[2], &losses, 3.5);
        let gain = |a: Method, b: Method| c.iter().find(|x| x.a == a && x.b == b).map(|x| x.gain);
        let r = Method::Compose(Composition::PicasoR);
        assert!((gain(Method::KvUnion, Method::Naive).unwrap() - 0.15).abs() < 1e-12);
        assert!((gain(Method::PicasoRNoKv, Method::Naive).unwrap() + 0.075).abs() < 1e-12);
        assert!((gain(r, Method::KvUnion).unwrap() - 0.1).abs() < 1e-12);
        assert!((gain(r, Method::PicasoRNoKv).unwrap() - 0.325).abs() < 1e-12);
    }
}
