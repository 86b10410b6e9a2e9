//! A query workload against several stores of the same contexts: one that keeps every state,
//! stores under a state budget with different policies, and Concat. Queries are drawn from a
//! pool with Zipf popularity; each retrieves k contexts (the same ids in every store: they are
//! ingested alike) and is timed to its first token's logits in every arm, one arm after the
//! other per query, so that all arms see the same machine at the same moment. A budgeted
//! store's bookkeeping (counting, admitting) runs after the first token, as the server runs it.

use std::time::Instant;

use picaso_model::{Method, Model};
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::query::prepare_deferring;
use crate::store::Store;

/// The queries: which of a pool, in what order.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct WorkloadOptions {
    /// Queries run.
    pub queries: usize,
    /// Zipf exponent of the pool's popularity (1.0: the second most popular query is asked
    /// half as often as the first).
    pub zipf: f64,
    /// Seed of the popularity ranks and the draws.
    pub seed: u64,
}

/// One arm: a store and how it answers.
pub struct Arm<'a> {
    /// Its name in the results.
    pub name: String,
    /// The store.
    pub store: &'a Store,
    /// Composition (or Concat).
    pub method: Method,
}

/// What one arm measured over the workload.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ArmResult {
    /// The arm's name.
    pub name: String,
    /// Queries answered.
    pub queries: usize,
    /// Of the states the queries needed, the fraction found stored (None for Concat).
    pub hit_rate: Option<f64>,
    /// The same over the second half of the queries (after the warm-up of the first).
    pub hit_rate_second_half: Option<f64>,
    /// Time to the first token's logits, milliseconds: median.
    pub ttft_p50_ms: f64,
    /// 99th percentile.
    pub ttft_p99_ms: f64,
    /// Mean.
    pub ttft_mean_ms: f64,
    /// Bytes of state objects read from the store, over all queries.
    pub bytes_read: u64,
    /// States recomputed from their tokens.
    pub recomputed: usize,
    /// Context tokens processed by the model (Concat's prefill, and the recomputations).
    pub context_tokens: u64,
    /// Bytes of state objects the store held at the end.
    pub held_bytes: u64,
}

/// Zipf draws over `n` items whose popularity order is a random permutation.
struct Zipf {
    cumulative: Vec<f64>,
    rank_to_item: Vec<usize>,
}

impl Zipf {
    fn new(n: usize, s: f64, rng: &mut impl Rng) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|r| {
                total += 1.0 / (r as f64).powf(s);
                total
            })
            .collect();
        let mut rank_to_item: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            rank_to_item.swap(i, rng.random_range(0..=i));
        }
        Self { cumulative, rank_to_item }
    }

    fn draw(&self, rng: &mut impl Rng) -> usize {
        let total = *self.cumulative.last().expect("a pool of at least one query");
        let u = rng.random::<f64>() * total;
        let rank = self.cumulative.partition_point(|&c| c < u).min(self.cumulative.len() - 1);
        self.rank_to_item[rank]
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

/// Runs the workload: `pool[i]` is a query's retrieved ids (in composition order) and its
/// prompt tokens; `opts.queries` draws from it with Zipf popularity, each answered by every arm
/// (the time to the first token's logits: the state from the contexts, then the prompt).
pub fn run_workload(
    model: &Model,
    arms: &[Arm<'_>],
    pool: &[(Vec<i64>, Vec<u32>)],
    opts: WorkloadOptions,
) -> Result<Vec<ArmResult>> {
    if pool.is_empty() || arms.is_empty() {
        return Err(Error::Input("a workload needs queries and at least one arm".into()));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
    let zipf = Zipf::new(pool.len(), opts.zipf, &mut rng);
    struct Tally {
        ttft: Vec<f64>,
        needed: [u64; 2],
        found: [u64; 2],
        bytes_read: u64,
        recomputed: usize,
        context_tokens: u64,
    }
    let mut tallies: Vec<Tally> = arms
        .iter()
        .map(|_| Tally {
            ttft: Vec::new(),
            needed: [0; 2],
            found: [0; 2],
            bytes_read: 0,
            recomputed: 0,
            context_tokens: 0,
        })
        .collect();
    for q in 0..opts.queries {
        let (ids, prompt) = &pool[zipf.draw(&mut rng)];
        let half = usize::from(q >= opts.queries / 2);
        for (arm, tally) in arms.iter().zip(&mut tallies) {
            let t = Instant::now();
            let mut prepared = prepare_deferring(arm.store, model, ids, arm.method, None)?;
            let (_logits, _state) = model.prefill_last_logits(prompt, &prepared.state)?;
            tally.ttft.push(t.elapsed().as_secs_f64() * 1e3);
            if let Some(deferred) = prepared.deferred.take() {
                deferred.finish(arm.store)?;
            }
            tally.bytes_read += prepared.bytes_read;
            tally.recomputed += prepared.states_recomputed;
            tally.context_tokens += prepared.tokens_processed as u64;
            if let Method::Compose(_) = arm.method {
                tally.needed[half] += ids.len() as u64;
                tally.found[half] += (ids.len() - prepared.states_recomputed) as u64;
            }
        }
    }
    let mut out = Vec::with_capacity(arms.len());
    for (arm, mut tally) in arms.iter().zip(tallies) {
        tally.ttft.sort_by(f64::total_cmp);
        let rate = |found: u64, needed: u64| (needed > 0).then(|| found as f64 / needed as f64);
        let held_bytes = match arm.store.budget_stats()? {
            Some(b) => b.held_bytes,
            None => arm.store.stats()?.state_bytes,
        };
        out.push(ArmResult {
            name: arm.name.clone(),
            queries: opts.queries,
            hit_rate: rate(tally.found[0] + tally.found[1], tally.needed[0] + tally.needed[1]),
            hit_rate_second_half: rate(tally.found[1], tally.needed[1]),
            ttft_p50_ms: percentile(&tally.ttft, 0.5),
            ttft_p99_ms: percentile(&tally.ttft, 0.99),
            ttft_mean_ms: tally.ttft.iter().sum::<f64>() / tally.ttft.len().max(1) as f64,
            bytes_read: tally.bytes_read,
            recomputed: tally.recomputed,
            context_tokens: tally.context_tokens,
            held_bytes,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Zipf(1) draws: the most popular item about twice as often as the second.
    #[test]
    fn zipf_draws_follow_their_ranks() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let zipf = Zipf::new(50, 1.0, &mut rng);
        let mut counts = vec![0usize; 50];
        for _ in 0..200_000 {
            counts[zipf.draw(&mut rng)] += 1;
        }
        let (first, second) = (counts[zipf.rank_to_item[0]] as f64, counts[zipf.rank_to_item[1]] as f64);
        assert!((first / second - 2.0).abs() < 0.1, "{first} {second}");
        assert!(counts.iter().all(|&c| c > 0));
    }
}
