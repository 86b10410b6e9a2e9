//! Recall through composition: facts spread over k contexts, a query about one of them, and
//! exact-match accuracy of the answer — the sharpest test of how much of each context a
//! method keeps. Natural-text loss moves by a few percent; recall separates the methods by
//! tens of points, shows *which* contexts a method loses (by the position of the context that
//! holds the key), and measures order invariance directly (by re-scoring the same contexts in
//! other orders).
//!
//! Each context is processed once from the zero state (as a store would hold it); every
//! method then makes the state the query continues from ([`crate::methods::start_state`]).
//! A query is scored three ways ([`score_answer`]): greedy exact match of the answer's
//! tokens, whether the answer is more likely than every distractor value, and its
//! log-likelihood.

pub mod task;

use picaso_model::{Composition, Method, Model, State};
use rand::seq::SliceRandom;

use crate::methods::{choice_logliks_after, log_softmax, start_state, Context};
use crate::stats::{mean_ci95, paired_ci95};
use crate::wikitext::check_ks;
use crate::{Error, Result};
pub use task::{Episode, Fact, Form, Task};

mod report;
pub use report::{write_recall, RecallRun};

/// What to run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Options {
    /// The task (vocabulary, facts per context, keys, values).
    pub task: Task,
    /// Numbers of contexts (ascending).
    pub ks: Vec<usize>,
    /// Episodes per k.
    pub episodes: usize,
    /// Queries per episode (cycling through the context positions).
    pub queries: usize,
    /// Orders each episode's contexts are scored in (1: the generated order only).
    pub orders: usize,
    /// Distractor values each answer competes with.
    pub distractors: usize,
    /// Methods (naive included if wanted).
    pub methods: Vec<Method>,
    /// Seed of the episodes and orders.
    pub seed: u64,
}

/// One query's outcome.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AnswerScore {
    /// Greedy decoding produces the answer's tokens exactly.
    pub exact: bool,
    /// The answer is strictly more likely than every distractor.
    pub choice: bool,
    /// Log-likelihood of the answer's tokens (nats, summed).
    pub loglik: f64,
}

/// Accuracy of one method at one k, over every episode, query and order.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    /// Method.
    pub method: Method,
    /// Contexts.
    pub k: usize,
    /// Queries scored (episodes × queries × orders).
    pub queries: usize,
    /// Exact-match accuracy.
    pub exact: f64,
    /// Its 95% interval half-width (`None` for one query).
    pub exact_ci95: Option<f64>,
    /// Accuracy of choosing the answer among the distractors.
    pub choice: f64,
    /// Its 95% interval half-width.
    pub choice_ci95: Option<f64>,
    /// Mean negative log-likelihood of the answer (nats per answer token).
    pub answer_nll: f64,
    /// Mean time to the ready state (ms): composing the stored states, or processing the
    /// contexts' tokens.
    pub ready_ms: f64,
    /// Mean tokens the model processed to make the ready state.
    pub tokens_processed: f64,
    /// Exact-match accuracy in each order (order 0 is the generated one).
    pub order_exact: Vec<f64>,
    /// Best − worst of `order_exact`.
    pub order_range: f64,
    /// Share of queries whose exact match differs between orders.
    pub order_flips: f64,
}

/// Accuracy by the position of the context that holds the key.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PositionCell {
    /// Method.
    pub method: Method,
    /// Contexts.
    pub k: usize,
    /// 1 = first in sequence order (farthest from the query), k = last (next to it).
    pub position: usize,
    /// Queries about a context at this position.
    pub queries: usize,
    /// Exact-match accuracy.
    pub exact: f64,
    /// Its 95% interval half-width (`None` for fewer than two queries).
    pub exact_ci95: Option<f64>,
}

/// A paired comparison on the same queries: `a − b` of exact-match accuracy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Paired {
    /// Contexts.
    pub k: usize,
    /// What is compared (a method, or `model:method`).
    pub a: String,
    /// What it is compared with.
    pub b: String,
    /// Accuracy of `a`.
    pub a_exact: f64,
    /// Accuracy of `b`.
    pub b_exact: f64,
    /// Mean per-query difference `a − b`.
    pub diff: f64,
    /// 95% interval half-width of the paired difference (`None` for one query).
    pub diff_ci95: Option<f64>,
}

/// The experiment's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Options used.
    pub options: Options,
    /// One per (method, k).
    pub cells: Vec<Cell>,
    /// One per (method, k, position).
    pub positions: Vec<PositionCell>,
    /// Method-vs-method comparisons on the same queries, per k.
    pub contrasts: Vec<Paired>,
    /// Largest change of an answer's log-likelihood under PICASO-S between orders of its
    /// inputs (order invariance: rounding only); `None` with one order or without PICASO-S.
    pub picaso_s_order_gap: Option<f64>,
    /// Per cell, the exact-match outcome (0/1) of every query in a fixed order (k, episode,
    /// order, query), for paired comparisons.
    #[serde(skip)]
    pub outcomes: Vec<Vec<f64>>,
}

impl Report {
    /// The cell of `method` at `k`.
    pub fn cell(&self, method: Method, k: usize) -> Option<&Cell> {
        self.cells.iter().find(|c| c.method == method && c.k == k)
    }

    fn outcomes_of(&self, method: Method, k: usize) -> Option<&[f64]> {
        let i = self.cells.iter().position(|c| c.method == method && c.k == k)?;
        Some(&self.outcomes[i])
    }
}

/// Scores `answer` after `prompt` from `state`, against `distractors`.
pub fn score_answer(
    model: &Model,
    state: &State,
    prompt: &[u32],
    answer: &[u32],
    distractors: &[Vec<u32>],
) -> Result<AnswerScore> {
    let (&first, rest) = answer.split_first().ok_or_else(|| Error::Input("an empty answer cannot be scored".into()))?;
    let (logits, after) = model.prefill_last_logits(prompt, state)?;
    let lp = log_softmax(&logits);
    let mut exact = argmax(&logits) == first as usize;
    let mut loglik = lp[first as usize];
    if !rest.is_empty() {
        // Teacher-forced: greedy reproduces the answer iff every answer token is the argmax
        // after the tokens before it.
        let (all, _) = model.forward_all_logits(&answer[..answer.len() - 1], &after)?;
        let vocab = logits.len();
        for (row, &want) in all.chunks(vocab).zip(rest) {
            exact &= argmax(row) == want as usize;
            loglik += log_softmax(row)[want as usize];
        }
    }
    let choice = choice_logliks_after(model, &logits, &after, distractors)?.iter().all(|&ll| loglik > ll);
    Ok(AnswerScore { exact, choice, loglik })
}

fn argmax(xs: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best
}

/// A query's tokens: the prompt, the answer and the distractor values.
struct Asked {
    prompt: Vec<u32>,
    answer: Vec<u32>,
    distractors: Vec<Vec<u32>>,
}

/// Per-query records of one (method, k) cell while the run collects them.
#[derive(Default, Clone)]
struct Tally {
    exact: Vec<f64>,
    choice: Vec<f64>,
    nll: Vec<f64>,
    ready_s: Vec<f64>,
    processed: Vec<f64>,
    /// Position of the key's context, per query (parallel to `exact`).
    position: Vec<usize>,
}

/// Runs the experiment; `progress(done, total)` after each episode.
pub fn run(model: &Model, options: &Options, mut progress: impl FnMut(usize, usize)) -> Result<Report> {
    check_ks(&options.ks)?;
    let o = options;
    if o.episodes == 0 || o.queries == 0 || o.orders == 0 {
        return Err(Error::Input(format!(
            "{} episodes, {} queries, {} orders: each must be at least 1",
            o.episodes, o.queries, o.orders
        )));
    }
    if o.methods.is_empty() {
        return Err(Error::Input("no methods to score".into()));
    }
    o.task.check(*o.ks.last().expect("checked non-empty"))?;
    // The answer competes with exactly this many other values, so that the report's number is
    // the one used: none would make every answer "chosen", and the task has only values − 1.
    if o.distractors == 0 || o.distractors >= o.task.values {
        return Err(Error::Input(format!(
            "--distractors {}: the task has {} values, so an answer can compete with 1 to {} others",
            o.distractors,
            o.task.values,
            o.task.values - 1
        )));
    }
    let tokenizer = model.tokenizer()?;
    let encode = |text: &str| -> Result<Vec<u32>> {
        let ids = tokenizer.encode(text)?;
        model.check_tokens(&ids)?;
        Ok(ids)
    };
    let total = o.ks.len() * o.episodes;
    let mut tallies: Vec<Vec<Tally>> = vec![vec![Tally::default(); o.methods.len()]; o.ks.len()];
    let mut s_gap: Option<f64> = None;
    let mut done = 0;
    for (ki, &k) in o.ks.iter().enumerate() {
        for e in 0..o.episodes {
            let episode = o.task.episode(o.seed, e, k, o.queries)?;
            let tokens: Vec<Vec<u32>> =
                episode.contexts.iter().map(|c| encode(&o.task.context_text(c))).collect::<Result<_>>()?;
            let states: Vec<State> =
                tokens.iter().map(|t| model.prefill(t, &model.zero_state())).collect::<picaso_model::Result<_>>()?;
            let mut rng = task::rng_for(o.seed, e as u64, k as u64, 0xd157);
            let asked: Vec<Asked> = episode
                .queries
                .iter()
                .map(|&(c, f)| {
                    let fact = episode.contexts[c][f];
                    let distractors = o
                        .task
                        .distractors(&episode, fact.value, o.distractors, &mut rng)
                        .into_iter()
                        .map(|v| encode(&o.task.answer_text(v)))
                        .collect::<Result<Vec<_>>>()?;
                    Ok(Asked {
                        prompt: encode(&o.task.query_text(fact.key))?,
                        answer: encode(&o.task.answer_text(fact.value))?,
                        distractors,
                    })
                })
                .collect::<Result<_>>()?;
            let mut s_first: Vec<f64> = Vec::new();
            for r in 0..o.orders {
                // Sequence order: perm[j] is the context at position j (the last is nearest
                // the query). Order 0 is the generated one.
                let mut perm: Vec<usize> = (0..k).collect();
                if r > 0 {
                    perm.shuffle(&mut task::rng_for(o.seed, e as u64, k as u64, 0x0de5 + r as u64));
                }
                // start_state takes the most relevant first and lays it out last: reverse.
                let ctx: Vec<Context<'_>> =
                    perm.iter().rev().map(|&i| Context { tokens: &tokens[i], state: &states[i] }).collect();
                for (mi, &method) in o.methods.iter().enumerate() {
                    let started = start_state(model, method, &ctx)?;
                    let t = &mut tallies[ki][mi];
                    t.ready_s.push(started.seconds);
                    t.processed.push(started.tokens_processed as f64);
                    for (qi, q) in asked.iter().enumerate() {
                        let s = score_answer(model, &started.state, &q.prompt, &q.answer, &q.distractors)?;
                        let position =
                            perm.iter().position(|&i| i == episode.queries[qi].0).expect("a permutation") + 1;
                        t.exact.push(f64::from(u8::from(s.exact)));
                        t.choice.push(f64::from(u8::from(s.choice)));
                        t.nll.push(-s.loglik / q.answer.len() as f64);
                        t.position.push(position);
                        if method == Method::Compose(Composition::PicasoS) && o.orders > 1 {
                            if r == 0 {
                                s_first.push(s.loglik);
                            } else {
                                let gap = (s.loglik - s_first[qi]).abs();
                                s_gap = Some(s_gap.unwrap_or(0.0).max(gap));
                            }
                        }
                    }
                }
            }
            done += 1;
            progress(done, total);
        }
    }

    let mut cells = Vec::new();
    let mut positions = Vec::new();
    let mut outcomes = Vec::new();
    for (ki, &k) in o.ks.iter().enumerate() {
        for (mi, &method) in o.methods.iter().enumerate() {
            let t = &tallies[ki][mi];
            let (exact, exact_ci95) = mean_ci95(&t.exact);
            let (choice, choice_ci95) = mean_ci95(&t.choice);
            // Layout of t.exact: episode-major, then order, then query.
            let per_order = |r: usize| -> Vec<f64> {
                (0..o.episodes)
                    .flat_map(|e| {
                        let at = (e * o.orders + r) * o.queries;
                        t.exact[at..at + o.queries].iter().copied()
                    })
                    .collect()
            };
            let order_exact: Vec<f64> = (0..o.orders).map(|r| mean_ci95(&per_order(r)).0).collect();
            let order_range = order_exact.iter().copied().fold(f64::NEG_INFINITY, f64::max)
                - order_exact.iter().copied().fold(f64::INFINITY, f64::min);
            let flips = (0..o.episodes * o.queries)
                .filter(|&i| {
                    let (e, q) = (i / o.queries, i % o.queries);
                    let v = |r: usize| t.exact[(e * o.orders + r) * o.queries + q];
                    (1..o.orders).any(|r| v(r) != v(0))
                })
                .count();
            cells.push(Cell {
                method,
                k,
                queries: t.exact.len(),
                exact,
                exact_ci95,
                choice,
                choice_ci95,
                answer_nll: mean_ci95(&t.nll).0,
                ready_ms: 1e3 * mean_ci95(&t.ready_s).0,
                tokens_processed: mean_ci95(&t.processed).0,
                order_exact,
                order_range,
                order_flips: flips as f64 / (o.episodes * o.queries) as f64,
            });
            for position in 1..=k {
                let xs: Vec<f64> =
                    t.position.iter().zip(&t.exact).filter(|(&p, _)| p == position).map(|(_, &x)| x).collect();
                let (exact, exact_ci95) = mean_ci95(&xs);
                positions.push(PositionCell { method, k, position, queries: xs.len(), exact, exact_ci95 });
            }
            outcomes.push(t.exact.clone());
        }
    }
    let mut report =
        Report { options: o.clone(), cells, positions, contrasts: Vec::new(), picaso_s_order_gap: s_gap, outcomes };
    report.contrasts = contrasts(&report);
    Ok(report)
}

/// The comparisons that matter, per k, where both methods were run: every method against
/// Concat, and PICASO-R against Soup, CASO and PICASO-S.
fn contrasts(report: &Report) -> Vec<Paired> {
    use Method::*;
    let r = Compose(Composition::PicasoR);
    let mut pairs: Vec<(Method, Method)> =
        report.options.methods.iter().filter(|&&m| m != Concat).map(|&m| (m, Concat)).collect();
    pairs.extend(
        [Compose(Composition::Soup), Compose(Composition::Caso), Compose(Composition::PicasoS)].map(|m| (r, m)),
    );
    let mut out = Vec::new();
    for &k in &report.options.ks {
        for &(a, b) in &pairs {
            if let (Some(xa), Some(xb)) = (report.outcomes_of(a, k), report.outcomes_of(b, k)) {
                out.push(paired(k, a.name().into(), b.name().into(), xa, xb));
            }
        }
    }
    out
}

fn paired(k: usize, a: String, b: String, xa: &[f64], xb: &[f64]) -> Paired {
    let (diff, diff_ci95) = paired_ci95(xa, xb);
    Paired { k, a, b, a_exact: mean_ci95(xa).0, b_exact: mean_ci95(xb).0, diff, diff_ci95 }
}

/// Model `b` against model `a` on the same queries (both runs must have the same options),
/// per method and k: e.g. a fine-tuned model against its zero-shot start.
pub fn compare_models(a_name: &str, a: &Report, b_name: &str, b: &Report) -> Result<Vec<Paired>> {
    if a.options != b.options {
        return Err(Error::Input("paired comparison of two recall runs with different options".into()));
    }
    let mut out = Vec::new();
    for c in &a.cells {
        let (Some(xa), Some(xb)) = (a.outcomes_of(c.method, c.k), b.outcomes_of(c.method, c.k)) else { continue };
        out.push(paired(c.k, format!("{b_name}:{}", c.method), format!("{a_name}:{}", c.method), xb, xa));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use picaso_model::{Mamba2Config, Mamba2Weights, TextTokenizer};

    use super::*;

    /// A random tiny model whose tokenizer is the synthetic recall vocabulary.
    fn model(dir: &std::path::Path) -> Model {
        let tok = task::synthetic_tokenizer(32, 32);
        let path = dir.join("tokenizer.json");
        tok.save(&path, false).unwrap();
        let mut c = Mamba2Config::tiny(2, 4);
        c.vocab_size = 72;
        Model::from_weights(c.clone(), Mamba2Weights::random(&c, 5), Some(TextTokenizer::from_file(&path).unwrap()))
    }

    /// The scorer against brute force: exact match is greedy generation reproducing the
    /// answer; choice is the answer beating each distractor scored whole; the log-likelihood
    /// is the sum of the answer's token log-probs.
    #[test]
    fn scorer_matches_brute_force() {
        let dir = tempfile::tempdir().unwrap();
        let m = model(dir.path());
        let start = m.prefill(&[5, 9, 40, 41], &m.zero_state()).unwrap();
        let prompt = [2u32, 7];
        for answer in [vec![40u32], vec![41, 50, 60], vec![8, 8]] {
            let distractors = vec![vec![42u32], vec![43, 44], vec![answer[0], 45]];
            let got = score_answer(&m, &start, &prompt, &answer, &distractors).unwrap();
            // Greedy decoding, token by token.
            let mut s = start.clone();
            let mut logits = m.prefill_last_logits(&prompt, &s).unwrap();
            let mut greedy = Vec::new();
            for _ in 0..answer.len() {
                let t = argmax(&logits.0) as u32;
                greedy.push(t);
                s = logits.1;
                logits = m.prefill_last_logits(&[t], &s).unwrap();
            }
            assert_eq!(got.exact, greedy == answer, "answer {answer:?}, greedy {greedy:?}");
            let whole = |c: &[u32]| -> f64 {
                m.score_continuation(&prompt, c, &start).unwrap().logprobs.iter().map(|&l| f64::from(l)).sum()
            };
            assert!((got.loglik - whole(&answer)).abs() < 1e-4);
            assert_eq!(got.choice, distractors.iter().all(|d| whole(&answer) > whole(d)));
        }
        // The argmax token is an exact match; a prompt's state that makes it likely is chosen.
        let (l, _) = m.prefill_last_logits(&prompt, &start).unwrap();
        let best = argmax(&l) as u32;
        let s = score_answer(&m, &start, &prompt, &[best], &[vec![(best + 1) % 72]]).unwrap();
        assert!(s.exact && s.choice);
        assert!(score_answer(&m, &start, &prompt, &[], &[]).is_err());
    }

    fn options(methods: Vec<Method>) -> Options {
        Options {
            task: Task { form: Form::Synthetic, facts: 2, keys: 32, values: 32 },
            ks: vec![1, 3],
            episodes: 2,
            queries: 3,
            orders: 3,
            distractors: 4,
            methods,
            seed: 1,
        }
    }

    #[test]
    fn runs_every_method_and_picaso_s_ignores_the_order() {
        let dir = tempfile::tempdir().unwrap();
        let m = model(dir.path());
        let report = run(&m, &options(Method::PAPER.to_vec()), |_, _| {}).unwrap();
        assert_eq!(report.cells.len(), 14);
        assert_eq!(report.positions.len(), 7 * (1 + 3));
        for c in &report.cells {
            assert_eq!(c.queries, 2 * 3 * 3);
            assert!((0.0..=1.0).contains(&c.exact) && (0.0..=1.0).contains(&c.choice));
            assert_eq!(c.order_exact.len(), 3);
        }
        let s = report.cell(Method::Compose(Composition::PicasoS), 3).unwrap();
        assert_eq!(s.order_range, 0.0);
        assert_eq!(s.order_flips, 0.0);
        assert!(report.picaso_s_order_gap.unwrap() < 1e-4);
        // With one context, every method but naive starts from that context's state.
        let one = report.cell(Method::Concat, 1).unwrap().exact;
        for method in &Method::PAPER[1..] {
            assert_eq!(report.cell(*method, 1).unwrap().exact, one, "{method}");
        }
        // Positions cover every query once.
        let n: usize =
            report.positions.iter().filter(|p| p.k == 3 && p.method == Method::Naive).map(|p| p.queries).sum();
        assert_eq!(n, 18);
        // A model compared with itself differs by nothing.
        let same = compare_models("a", &report, "b", &report).unwrap();
        assert!(same.iter().all(|p| p.diff == 0.0));
        assert!(report.contrasts.iter().any(|p| p.a == "picaso-r" && p.b == "soup"));
    }

    #[test]
    fn bad_options_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let m = model(dir.path());
        let mut o = options(vec![Method::Concat]);
        o.ks = vec![17];
        assert!(run(&m, &o, |_, _| {}).unwrap_err().to_string().contains("distinct keys"));
        let mut o = options(vec![Method::Concat]);
        o.episodes = 0;
        assert!(run(&m, &o, |_, _| {}).is_err());
        assert!(run(&m, &options(vec![]), |_, _| {}).unwrap_err().to_string().contains("no methods"));
        let mut o = options(vec![Method::Concat]);
        o.ks = vec![3, 1];
        assert!(run(&m, &o, |_, _| {}).is_err());
        // The answer competes with exactly --distractors values: at least one, at most all the
        // task's other values (32 here).
        let mut o = options(vec![Method::Concat]);
        o.distractors = 32;
        let e = run(&m, &o, |_, _| {}).unwrap_err().to_string();
        assert!(e.contains("32 values") && e.contains("1 to 31"), "{e}");
        o.distractors = 0;
        assert!(run(&m, &o, |_, _| {}).unwrap_err().to_string().contains("1 to 31"));
        o.distractors = 31;
        assert!(run(&m, &o, |_, _| {}).is_ok(), "every other value");
    }
}
