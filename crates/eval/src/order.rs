//! Order sensitivity, the paper's motivation: with n retrieved contexts there are n! orders to
//! concatenate (or CASO-compose) them in, and the loss depends on which one is chosen. PICASO-S
//! is the average over all orders, so it has one value; PICASO-R averages the n rotations only.
//! For each passage and n, random orders are scored and the spread of the loss over them is
//! measured.

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::{compose, Composition, Model};
use picaso_store::{passages, retrieve, Passage, Store};
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::database::{cache_cap, check_model, Contexts};
use crate::methods::{continuation_nll, Context};
use crate::plot::Series;
use crate::report::charts::{draw_line_charts, empty_charts, not_drawn_note, LineChart};
use crate::report::files::write_all;
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv, methods_in_str};
use crate::stats::mean_ci95;
use crate::wikitext::choose;
use crate::{Error, Result};

/// What to run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Options {
    /// Numbers of contexts (each at least 2).
    pub ns: Vec<usize>,
    /// Orders scored per passage and n (all of them when n! is smaller).
    pub orders: usize,
    /// Score this many passages drawn with `seed` (all if `None`).
    pub sample: Option<usize>,
    /// Seed of the sample and of the orders.
    pub seed: u64,
    /// Recompute the states with the model (see the WikiText experiment).
    pub restate: bool,
}

/// Spread of one way of combining over orders, at one n.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Spread {
    /// "concat", "caso", "picaso-r" or "picaso-s".
    pub method: &'static str,
    /// Contexts.
    pub n: usize,
    /// Mean loss over passages and orders.
    pub loss: f64,
    /// Mean over passages of the standard deviation of the loss over orders.
    pub std: f64,
    /// Mean over passages of the loss range (worst order − best order).
    pub range: f64,
    /// Its 95% interval half-width (`None` for one passage).
    pub range_ci95: Option<f64>,
    /// Largest range seen on one passage.
    pub max_range: f64,
}

/// The experiment's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Options used.
    pub options: Options,
    /// Passages scored.
    pub passages: usize,
    /// One row per (method, n).
    pub rows: Vec<Spread>,
    /// Largest difference of PICASO-S's loss between two orders of its inputs (its invariance,
    /// checked: rounding only).
    pub picaso_s_order_gap: f64,
}

/// `count` distinct orders of `n` items: all of them when there are no more than `count`.
fn orders(n: usize, count: usize, rng: &mut rand::rngs::StdRng) -> Vec<Vec<usize>> {
    let total: usize = (1..=n).product();
    if total <= count {
        let mut all = Vec::new();
        permute(&mut (0..n).collect(), 0, &mut all);
        return all;
    }
    let mut out: Vec<Vec<usize>> = Vec::new();
    while out.len() < count {
        let mut p: Vec<usize> = (0..n).collect();
        p.shuffle(rng);
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

fn permute(p: &mut Vec<usize>, at: usize, out: &mut Vec<Vec<usize>>) {
    if at == p.len() {
        out.push(p.clone());
        return;
    }
    for i in at..p.len() {
        p.swap(at, i);
        permute(p, at + 1, out);
        p.swap(at, i);
    }
}

fn spread(xs: &[f64]) -> (f64, f64) {
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let std = (xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64).sqrt();
    let range = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max) - xs.iter().copied().fold(f64::INFINITY, f64::min);
    (std, range)
}

/// Runs the experiment; `progress(done, total)` after each passage.
pub fn run(model: &Model, store: &Store, options: &Options, mut progress: impl FnMut(usize, usize)) -> Result<Report> {
    check_model(store, model, options.restate)?;
    // Ascending and distinct, as every other list of k: a repeated n would be scored twice.
    let ascending = options.ns.windows(2).all(|w| w[0] < w[1]);
    if options.ns.is_empty() || options.ns[0] < 2 || !ascending || options.orders < 2 {
        return Err(Error::Input(format!(
            "n values {:?} and {} orders: give ascending n of at least 2 (e.g. 2,3,4) and at least 2 orders",
            options.ns, options.orders
        )));
    }
    let max_n = options.ns.iter().copied().max().expect("non-empty");
    let all = passages(store)?;
    let chosen: Vec<&Passage> = choose(all.iter().collect(), options.sample, options.seed)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed ^ 0x0de5);
    let names = ["concat", "caso", "picaso-r", "picaso-s"];
    // (method, n) → per-passage (mean loss, std, range).
    let mut per: Vec<Vec<Vec<(f64, f64, f64)>>> = vec![vec![Vec::new(); options.ns.len()]; names.len()];
    let mut gap = 0f64;
    let mut contexts = Contexts::new(store, options.restate);
    let cap = cache_cap(model);
    for (done, passage) in chosen.iter().enumerate() {
        let query = store.get(passage.query)?.tokens;
        let continuation = store.get(passage.continuation)?.tokens;
        let ids: Vec<i64> = retrieve(store, passage, max_n)?.into_iter().map(|(id, _)| id).collect();
        contexts.load(model, &ids, cap)?;
        let retrieved = contexts.get(&ids);
        for (ni, &n) in options.ns.iter().enumerate() {
            let ctx: &[Context<'_>] = &retrieved[..n];
            let states: Vec<_> = ctx.iter().map(|c| c.state).collect();
            let mut losses: [Vec<f64>; 4] = Default::default();
            let ords = orders(n, options.orders, &mut rng);
            for order in &ords {
                let tokens: Vec<u32> = order.iter().flat_map(|&i| ctx[i].tokens.iter().copied()).collect();
                let concat = model.prefill(&tokens, &model.zero_state())?;
                losses[0].push(continuation_nll(model, &concat, &query, &continuation)?);
                for (slot, method) in [(1, Composition::Caso), (2, Composition::PicasoR), (3, Composition::PicasoS)] {
                    let s = compose(method, &states, Some(order))?;
                    losses[slot].push(continuation_nll(model, &s, &query, &continuation)?);
                }
            }
            let (_, s_range) = spread(&losses[3]);
            gap = gap.max(s_range);
            for (m, l) in losses.iter().enumerate() {
                let (std, range) = spread(l);
                per[m][ni].push((l.iter().sum::<f64>() / l.len() as f64, std, range));
            }
        }
        progress(done + 1, chosen.len());
    }
    let mut rows = Vec::new();
    for (ni, &n) in options.ns.iter().enumerate() {
        for (m, name) in names.iter().enumerate() {
            let v = &per[m][ni];
            let col = |f: fn(&(f64, f64, f64)) -> f64| v.iter().map(f).collect::<Vec<f64>>();
            let ranges = col(|x| x.2);
            let (range, range_ci95) = mean_ci95(&ranges);
            rows.push(Spread {
                method: name,
                n,
                loss: mean_ci95(&col(|x| x.0)).0,
                std: mean_ci95(&col(|x| x.1)).0,
                range,
                range_ci95,
                max_range: ranges.iter().copied().fold(0.0, f64::max),
            });
        }
    }
    Ok(Report { options: options.clone(), passages: chosen.len(), rows, picaso_s_order_gap: gap })
}

/// Writes the order-sensitivity experiment into `out`.
pub fn write_order(out: &Path, report: &Report, info: &RunInfo) -> Result<()> {
    let mut csv = String::from("method,n,loss,std,range,range_ci95,max_range\n");
    let mut md = format!(
        "# Order sensitivity: continuation loss over orders of n retrieved contexts\n\n{} WikiText-2 passages (seed {}), up to {} orders each. Spread = worst − best order's loss (nats/token), averaged over passages.\n\n| n | method | mean loss | mean std over orders | mean range (± 95% CI) | largest range |\n|---:|---|---:|---:|---:|---:|\n",
        report.passages, report.options.seed, report.options.orders
    );
    for r in &report.rows {
        writeln!(
            csv,
            "{},{},{:.6},{:.6},{:.6},{},{:.6}",
            r.method,
            r.n,
            r.loss,
            r.std,
            r.range,
            ci_csv(r.range_ci95, 6),
            r.max_range
        )
        .expect("string");
        writeln!(
            md,
            "| {} | {} | {:.4} | {:.4} | {:.4} ± {} | {:.4} |",
            r.n,
            r.method,
            r.loss,
            r.std,
            r.range,
            ci(r.range_ci95, 4),
            r.max_range
        )
        .expect("string");
    }
    writeln!(
        md,
        "\nPICASO-S over its input orders: largest loss difference {:.2e} (order-invariant up to rounding).",
        report.picaso_s_order_gap
    )
    .expect("string");
    let names: Vec<&str> = methods_in_str(report.rows.iter().map(|r| r.method));
    let series: Vec<Series> = names
        .iter()
        .map(|&m| {
            let points = report.rows.iter().filter(|r| r.method == m).map(|r| (r.n as f64, r.range)).collect();
            Series::line(m, points)
        })
        .collect();
    let charts = [LineChart::against_count(
        "range_vs_n.png",
        "Loss range over context orders".into(),
        "n (contexts)",
        "worst − best order (nats/token)",
        series,
    )];
    md.push_str(&not_drawn_note(&empty_charts(&charts)));
    write_all(out, serde_json::json!({ "run": info, "report": report }), &csv, &md, info)?;
    draw_line_charts(out, &charts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_distinct_and_complete_when_few() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let all = orders(3, 10, &mut rng);
        assert_eq!(all.len(), 6);
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 6);
        let some = orders(6, 10, &mut rng);
        assert_eq!(some.len(), 10);
        for p in &some {
            let mut q = p.clone();
            q.sort();
            assert_eq!(q, (0..6).collect::<Vec<_>>());
        }
    }

    #[test]
    fn spread_of_values() {
        let (std, range) = spread(&[1.0, 3.0]);
        assert_eq!((std, range), (1.0, 2.0));
    }
}
