//! The recall experiment's results folder: one or more models on the same queries.

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::Method;

use crate::plot::{line_chart, Chart, Series};
use crate::recall;
use crate::report::files::{create, write_all};
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv, methods_in, pct_ci};
use crate::{Error, Result};

/// One model's recall run, by name.
pub struct RecallRun<'a> {
    /// Name in tables and file names.
    pub name: &'a str,
    /// Its results.
    pub report: &'a recall::Report,
}

/// Writes the recall experiment of one or more models (same queries) into `out`, with the
/// paired differences of each later model against the first.
pub fn write_recall(out: &Path, runs: &[RecallRun<'_>], paired: &[recall::Paired], info: &RunInfo) -> Result<()> {
    let first = runs.first().ok_or_else(|| Error::Input("no recall runs to write".into()))?;
    let o = &first.report.options;
    let pct = |x: f64| 100.0 * x;
    let mut csv = String::from(
        "model,method,k,queries,exact,exact_ci95,choice,choice_ci95,answer_nll,ready_ms,tokens_processed,order_range,order_flips\n",
    );
    let mut md = format!(
        "# Recall through composition: a fact from one of k contexts\n\n{:?} task: {} facts per context, {} keys, {} values. Per k: {} episodes × {} queries × {} orders of the contexts (seed {}); the answer also competes with {} distractor values. Exact match = greedy decoding reproduces the value.\n",
        o.task.form, o.task.facts, o.task.keys, o.task.values, o.episodes, o.queries, o.orders, o.seed, o.distractors
    );
    let mut chart_names = std::collections::HashSet::new();
    for run in runs {
        // Names that differ only in characters a file name cannot hold get their own charts.
        let mut chart_name = file_safe(run.name);
        for n in 2.. {
            if chart_names.insert(chart_name.clone()) {
                break;
            }
            chart_name = format!("{}-{n}", file_safe(run.name));
        }
        let r = run.report;
        let methods = methods_in(r.cells.iter().map(|c| &c.method));
        let header = |title: &str| {
            let mut h = format!("\n### {title}\n\n| k |");
            for m in &methods {
                write!(h, " {m} |").expect("string");
            }
            h.push_str("\n|---:|");
            h.push_str(&"---:|".repeat(methods.len()));
            h.push('\n');
            h
        };
        writeln!(md, "\n## Model `{}`", run.name).expect("string");
        let mut exact = header("Exact match (%, ± 95% CI)");
        let mut choice = header("Answer chosen among the distractors (%, ± 95% CI)");
        let mut ready = header("Time to the ready state (ms; tokens the model processed)");
        for &k in &o.ks {
            for t in [&mut exact, &mut choice, &mut ready] {
                write!(t, "| {k} |").expect("string");
            }
            for &m in &methods {
                let Some(c) = r.cell(m, k) else {
                    for t in [&mut exact, &mut choice, &mut ready] {
                        t.push_str(" |");
                    }
                    continue;
                };
                write!(exact, " {:.1} ± {} |", pct(c.exact), ci(pct_ci(c.exact_ci95), 1)).expect("string");
                write!(choice, " {:.1} ± {} |", pct(c.choice), ci(pct_ci(c.choice_ci95), 1)).expect("string");
                write!(ready, " {:.2} ({:.0}) |", c.ready_ms, c.tokens_processed).expect("string");
                writeln!(
                    csv,
                    "{},{},{},{},{:.6},{},{:.6},{},{:.6},{:.4},{:.1},{:.6},{:.6}",
                    run.name,
                    m,
                    k,
                    c.queries,
                    c.exact,
                    ci_csv(c.exact_ci95, 6),
                    c.choice,
                    ci_csv(c.choice_ci95, 6),
                    c.answer_nll,
                    c.ready_ms,
                    c.tokens_processed,
                    c.order_range,
                    c.order_flips
                )
                .expect("string");
            }
            for t in [&mut exact, &mut choice, &mut ready] {
                t.push('\n');
            }
        }
        md.push_str(&exact);
        md.push_str(&choice);
        md.push_str(&ready);
        let kmax = *o.ks.last().expect("a report has ks");
        write!(
            md,
            "\n### By position of the context that holds the key (k = {kmax}; 1 = first, {kmax} = next to the query; exact %)\n\n| position |"
        )
        .expect("string");
        for m in &methods {
            write!(md, " {m} |").expect("string");
        }
        writeln!(md, "\n|---:|{}", "---:|".repeat(methods.len())).expect("string");
        for p in 1..=kmax {
            write!(md, "| {p} |").expect("string");
            for &m in &methods {
                match r.positions.iter().find(|c| c.method == m && c.k == kmax && c.position == p) {
                    Some(c) => write!(md, " {:.1} ± {} |", pct(c.exact), ci(pct_ci(c.exact_ci95), 1)),
                    None => write!(md, " |"),
                }
                .expect("string");
            }
            md.push('\n');
        }
        if o.orders > 1 {
            md.push_str("\n### Order: exact match in each order of the same contexts (%), range, share of queries that flip\n\n| k | method | per order | range (points) | flips |\n|---:|---|---|---:|---:|\n");
            for c in r.cells.iter().filter(|c| c.k > 1 && c.method != Method::Naive) {
                let per: Vec<String> = c.order_exact.iter().map(|&x| format!("{:.1}", pct(x))).collect();
                writeln!(
                    md,
                    "| {} | {} | {} | {:.1} | {:.1}% |",
                    c.k,
                    c.method,
                    per.join(" / "),
                    pct(c.order_range),
                    pct(c.order_flips)
                )
                .expect("string");
            }
            if let Some(g) = r.picaso_s_order_gap {
                writeln!(md, "\nPICASO-S: largest change of an answer's log-likelihood between orders {g:.2e} nats (order-invariant up to rounding).").expect("string");
            }
        }
        recall_paired_table(&mut md, "\n### Paired differences on the same queries", &r.contrasts);
        let series: Vec<Series> = methods
            .iter()
            .map(|&m| Series {
                errors: Vec::new(),
                name: m.to_string(),
                points: r.cells.iter().filter(|c| c.method == m).map(|c| (c.k as f64, pct(c.exact))).collect(),
            })
            .collect();
        let title = format!("Recall vs number of contexts ({})", run.name);
        line_chart(
            &out_file(out, "accuracy_vs_k", &chart_name)?,
            &Chart { title: &title, x: "k (contexts)", y: "exact match (%)", log_x: false, whole_x: true },
            &series,
        )?;
        let series: Vec<Series> = methods
            .iter()
            .map(|&m| Series {
                errors: Vec::new(),
                name: m.to_string(),
                points: r
                    .positions
                    .iter()
                    .filter(|c| c.method == m && c.k == kmax)
                    .map(|c| (c.position as f64, pct(c.exact)))
                    .collect(),
            })
            .collect();
        let title = format!("Recall by position of the key's context, k = {kmax} ({})", run.name);
        line_chart(
            &out_file(out, "accuracy_vs_position", &chart_name)?,
            &Chart {
                title: &title,
                x: "position (1 = first, k = next to the query)",
                y: "exact match (%)",
                log_x: false,
                whole_x: true,
            },
            &series,
        )?;
    }
    recall_paired_table(&mut md, "\n## Models compared on the same queries", paired);
    let models: Vec<serde_json::Value> =
        runs.iter().map(|r| serde_json::json!({ "name": r.name, "report": r.report })).collect();
    write_all(out, serde_json::json!({ "run": info, "models": models, "paired": paired }), &csv, &md, info)
}

/// Appends `title` and a table of paired exact-match differences (nothing when `rows` is empty).
fn recall_paired_table(md: &mut String, title: &str, rows: &[recall::Paired]) {
    if rows.is_empty() {
        return;
    }
    let pct = |x: f64| 100.0 * x;
    write!(
        md,
        "{title} (exact match, points, ± 95% CI)\n\n| k | a | b | a | b | a − b |\n|---:|---|---|---:|---:|---:|\n"
    )
    .expect("string");
    for p in rows {
        writeln!(
            md,
            "| {} | {} | {} | {:.1} | {:.1} | {:+.1} ± {} |",
            p.k,
            p.a,
            p.b,
            pct(p.a_exact),
            pct(p.b_exact),
            pct(p.diff),
            ci(pct_ci(p.diff_ci95), 1)
        )
        .expect("string");
    }
}

/// `out/STEM-NAME.png` for a name made by [`file_safe`] (the folder is created).
fn out_file(out: &Path, stem: &str, name: &str) -> Result<std::path::PathBuf> {
    create(out)?;
    Ok(out.join(format!("{stem}-{name}.png")))
}

/// `name` with every character a file name might not hold made `_`.
fn file_safe(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}
