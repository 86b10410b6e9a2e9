//! Fidelity: how far each method's state is from the state of processing the contexts
//! (Concat, in its best order), and how far its predictions are. Explains the loss table: a
//! method whose state is far from Concat's but whose next-token distributions are close loses
//! little.

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::{Method, Model, State};
use picaso_store::{passages, retrieve, Passage, Store};

use crate::database::{cache_cap, check_model, Contexts};
use crate::methods::start_state;
use crate::plot::Series;
use crate::report::charts::{draw_line_charts, empty_charts, not_drawn_note, LineChart};
use crate::report::files::write_all;
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv, methods_in};
use crate::stats::mean_ci95;
use crate::wikitext::{check_ks, choose};
use crate::{Error, Result};

/// What to run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Options {
    /// Numbers of retrieved contexts, ascending.
    pub ks: Vec<usize>,
    /// Methods compared with Concat.
    pub methods: Vec<Method>,
    /// Score this many passages drawn with `seed` (all if `None`).
    pub sample: Option<usize>,
    /// Seed of the sample.
    pub seed: u64,
    /// Recompute the states with the model (see the WikiText experiment).
    pub restate: bool,
}

/// One (method, k) row.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// Method.
    pub method: Method,
    /// Contexts.
    pub k: usize,
    /// Per layer, mean of ‖x_method − x_concat‖ / ‖x_concat‖ over passages (SSM states).
    pub relative_distance: Vec<f64>,
    /// Mean KL(concat ‖ method) of the next-token distributions over the continuation's
    /// positions (nats), with its 95% interval half-width.
    pub kl: f64,
    /// Half-width of the KL's interval (`None` for one passage).
    pub kl_ci95: Option<f64>,
}

/// The experiment's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Options used.
    pub options: Options,
    /// Passages scored.
    pub passages: usize,
    /// One row per (method, k).
    pub rows: Vec<Row>,
}

fn log_softmax_rows(logits: &[f32], vocab: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(logits.len());
    for row in logits.chunks(vocab) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = f64::from(max) + row.iter().map(|&l| f64::from(l - max).exp()).sum::<f64>().ln();
        out.extend(row.iter().map(|&l| f64::from(l) - lse));
    }
    out
}

/// Mean over rows of KL(p ‖ q) for row-major log-probabilities.
fn mean_kl(p: &[f64], q: &[f64], vocab: usize) -> f64 {
    let rows = p.len() / vocab;
    let total: f64 = p
        .chunks(vocab)
        .zip(q.chunks(vocab))
        .map(|(a, b)| a.iter().zip(b).map(|(&la, &lb)| la.exp() * (la - lb)).sum::<f64>())
        .sum();
    total / rows as f64
}

fn relative_distances(a: &State, reference: &State) -> Vec<f64> {
    a.layers
        .iter()
        .zip(&reference.layers)
        .map(|(x, r)| {
            let d: f64 = x.ssm.iter().zip(&r.ssm).map(|(&u, &v)| f64::from(u - v).powi(2)).sum();
            let n: f64 = r.ssm.iter().map(|&v| f64::from(v).powi(2)).sum();
            (d / n.max(f64::MIN_POSITIVE)).sqrt()
        })
        .collect()
}

/// Runs the experiment; `progress(done, total)` after each passage.
pub fn run(model: &Model, store: &Store, options: &Options, mut progress: impl FnMut(usize, usize)) -> Result<Report> {
    check_model(store, model, options.restate)?;
    check_ks(&options.ks)?;
    let max_k = *options.ks.last().expect("checked");
    let vocab = model.config().vocab_size();
    let methods: Vec<Method> = options.methods.iter().copied().filter(|m| *m != Method::Concat).collect();
    if methods.is_empty() {
        return Err(Error::Input(format!(
            "methods {:?}: fidelity measures each method against Concat; give a method besides concat",
            options.methods.iter().map(ToString::to_string).collect::<Vec<_>>()
        )));
    }
    let all = passages(store)?;
    let chosen: Vec<&Passage> = choose(all.iter().collect(), options.sample, options.seed)?;
    let mut dist = vec![vec![Vec::<Vec<f64>>::new(); options.ks.len()]; methods.len()];
    let mut kls = vec![vec![Vec::<f64>::new(); options.ks.len()]; methods.len()];
    let mut contexts = Contexts::new(store, options.restate);
    let cap = cache_cap(model);
    for (done, passage) in chosen.iter().enumerate() {
        let mut tokens = store.get(passage.query)?.tokens;
        let from = tokens.len() - 1;
        tokens.extend(store.get(passage.continuation)?.tokens);
        let to = tokens.len() - 1;
        let ids: Vec<i64> = retrieve(store, passage, max_k)?.into_iter().map(|(id, _)| id).collect();
        contexts.load(model, &ids, cap)?;
        let retrieved = contexts.get(&ids);
        let predictions = |state: &State| -> Result<Vec<f64>> {
            let (logits, _) = model.forward_all_logits(&tokens, state)?;
            Ok(log_softmax_rows(&logits[from * vocab..to * vocab], vocab))
        };
        for (ki, &k) in options.ks.iter().enumerate() {
            let concat = start_state(model, Method::Concat, &retrieved[..k])?.state;
            let reference = predictions(&concat)?;
            for (mi, &method) in methods.iter().enumerate() {
                let s = start_state(model, method, &retrieved[..k])?.state;
                dist[mi][ki].push(relative_distances(&s, &concat));
                kls[mi][ki].push(mean_kl(&reference, &predictions(&s)?, vocab));
            }
        }
        progress(done + 1, chosen.len());
    }
    let n_layer = model.config().n_layer();
    let mut rows = Vec::new();
    for (ki, &k) in options.ks.iter().enumerate() {
        for (mi, &method) in methods.iter().enumerate() {
            let relative_distance = (0..n_layer)
                .map(|l| dist[mi][ki].iter().map(|d| d[l]).sum::<f64>() / dist[mi][ki].len() as f64)
                .collect();
            let (kl, kl_ci95) = mean_ci95(&kls[mi][ki]);
            rows.push(Row { method, k, relative_distance, kl, kl_ci95 });
        }
    }
    Ok(Report { options: options.clone(), passages: chosen.len(), rows })
}

/// Writes the fidelity experiment into `out`.
pub fn write_fidelity(out: &Path, report: &Report, info: &RunInfo) -> Result<()> {
    let layers = report.rows.first().map_or(0, |r| r.relative_distance.len());
    let mut csv = String::from("method,k,kl,kl_ci95");
    for l in 0..layers {
        write!(csv, ",rel_dist_layer{l}").expect("string");
    }
    csv.push('\n');
    let mut md = format!(
        "# Fidelity: each method's state and predictions vs Concat's\n\n{} WikiText-2 passages (seed {}). KL(concat ‖ method) of next-token distributions over the continuation (nats/token); relative distance ‖x − x_concat‖ / ‖x_concat‖ of the SSM state per layer.\n\n| k | method | KL | ",
        report.passages, report.options.seed
    );
    for l in 0..layers {
        write!(md, "layer {l} | ").expect("string");
    }
    md.push_str("\n|---:|---|---:|");
    md.push_str(&"---:|".repeat(layers));
    md.push('\n');
    for r in &report.rows {
        write!(csv, "{},{},{:.6},{}", r.method, r.k, r.kl, ci_csv(r.kl_ci95, 6)).expect("string");
        write!(md, "| {} | {} | {:.4} ± {} |", r.k, r.method, r.kl, ci(r.kl_ci95, 4)).expect("string");
        for d in &r.relative_distance {
            write!(csv, ",{d:.6}").expect("string");
            write!(md, " {d:.3} |").expect("string");
        }
        csv.push('\n');
        md.push('\n');
    }
    let methods = methods_in(report.rows.iter().map(|r| &r.method));
    let series: Vec<Series> = methods
        .iter()
        .map(|&m| {
            let points = report.rows.iter().filter(|r| r.method == m).map(|r| (r.k as f64, r.kl)).collect();
            Series::line(m.to_string(), points)
        })
        .collect();
    let charts = [LineChart::against_count(
        "kl_vs_k.png",
        "KL(concat || method) of next-token distributions".into(),
        "k (segments)",
        "KL (nats/token)",
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
    fn kl_of_equal_distributions_is_zero_and_positive_otherwise() {
        let p = log_softmax_rows(&[1.0, 2.0, 3.0, 0.0, 0.0, 0.0], 3);
        assert!(mean_kl(&p, &p, 3).abs() < 1e-12);
        let q = log_softmax_rows(&[3.0, 2.0, 1.0, 0.0, 0.0, 5.0], 3);
        assert!(mean_kl(&p, &q, 3) > 0.1);
        // Row 1 of p is uniform: each row's probabilities sum to one.
        assert!((p[3..].iter().map(|l| l.exp()).sum::<f64>() - 1.0).abs() < 1e-12);
    }
}
