//! Does the model use its context? The continuation of each passage is scored after its
//! query with no context, after the true preceding paragraph, and after a paragraph drawn at
//! random from another document (the control: any text in front might change the loss; only
//! relevant text should lower it).

use picaso_model::Model;
use picaso_store::{passages, Store};
use rand::{Rng, SeedableRng};

use crate::methods::continuation_nll;
use crate::stats::mean_ci95;
use crate::{Error, Result};

/// A condition's mean loss.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Condition {
    /// What precedes the query.
    pub context: &'static str,
    /// Mean continuation NLL (nats/token).
    pub loss: f64,
    /// Half-width of its 95% confidence interval.
    pub ci95: f64,
    /// Mean paired difference to no context (negative = lower loss), with its interval.
    pub delta_vs_none: f64,
    /// Half-width of the paired difference's interval.
    pub delta_ci95: f64,
}

/// The check's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Passages with a stored preceding paragraph that were scored.
    pub passages: usize,
    /// Seed of the sample and of the random paragraphs.
    pub seed: u64,
    /// No context, the true previous paragraph, a random paragraph.
    pub conditions: Vec<Condition>,
}

/// Scores up to `sample` passages that have a preceding paragraph in the store.
pub fn run(model: &Model, store: &Store, sample: usize, seed: u64) -> Result<Report> {
    let all = passages(store)?;
    let with_previous: Vec<usize> = (0..all.len()).filter(|&i| all[i].previous.is_some()).collect();
    if with_previous.is_empty() {
        return Err(Error::Input(format!(
            "{}: no passage has its preceding paragraph stored (ingest whole articles with --segment halves)",
            store.location()
        )));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut chosen = with_previous.clone();
    rand::seq::SliceRandom::shuffle(chosen.as_mut_slice(), &mut rng);
    chosen.truncate(sample.max(1));
    let tokens_of = |i: usize| -> Result<Vec<u32>> {
        let mut t = store.get(all[i].query)?.tokens;
        t.extend(store.get(all[i].continuation)?.tokens);
        Ok(t)
    };
    let (mut none, mut prev, mut random) = (Vec::new(), Vec::new(), Vec::new());
    for &i in &chosen {
        let query = store.get(all[i].query)?.tokens;
        let continuation = store.get(all[i].continuation)?.tokens;
        let zero = model.zero_state();
        none.push(continuation_nll(model, &zero, &query, &continuation)?);
        let before = tokens_of(all[i].previous.expect("filtered"))?;
        prev.push(continuation_nll(model, &model.prefill(&before, &zero)?, &query, &continuation)?);
        let other = loop {
            let j = rng.random_range(0..all.len());
            if all[j].doc != all[i].doc || all.len() == 1 {
                break j;
            }
        };
        random.push(continuation_nll(model, &model.prefill(&tokens_of(other)?, &zero)?, &query, &continuation)?);
    }
    let condition = |context: &'static str, xs: &[f64]| {
        let (loss, ci95) = mean_ci95(xs);
        let diffs: Vec<f64> = xs.iter().zip(&none).map(|(a, b)| a - b).collect();
        let (delta_vs_none, delta_ci95) = mean_ci95(&diffs);
        Condition { context, loss, ci95, delta_vs_none, delta_ci95 }
    };
    Ok(Report {
        passages: chosen.len(),
        seed,
        conditions: vec![
            condition("none", &none),
            condition("previous paragraph", &prev),
            condition("random paragraph", &random),
        ],
    })
}
