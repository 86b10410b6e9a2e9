//! The OpenBookQA experiment's results folder.

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::{counted, Method};

use crate::plot::Series;
use crate::report::charts::{against_k, draw_line_charts, empty_charts, not_drawn_note, paired_gains, LineChart};
use crate::report::files::write_all;
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv, methods_in, pct_ci};
use crate::{openbookqa, Result};

/// Writes the OpenBookQA accuracy experiment into `out`.
pub fn write_openbookqa(out: &Path, report: &openbookqa::Report, info: &RunInfo) -> Result<()> {
    let mut csv = String::from("method,k,acc,acc_ci95,acc_norm,acc_norm_ci95,prepare_ms,tokens_processed\n");
    for c in &report.cells {
        writeln!(
            csv,
            "{},{},{:.4},{},{:.4},{},{:.4},{:.1}",
            c.method,
            c.k,
            c.acc,
            ci_csv(c.acc_ci95, 4),
            c.acc_norm,
            ci_csv(c.acc_norm_ci95, 4),
            c.prepare_ms,
            c.tokens_processed
        )
        .expect("string");
    }
    let ks = &report.options.ks;
    let widest = report.cells.iter().filter_map(|c| c.acc_ci95).reduce(f64::max);
    let mut md = format!(
        "# OpenBookQA: accuracy with k facts retrieved from the open book\n\n{}, {} (seed {}). Each cell: acc / acc_norm in %; 95% CI half-width about {} points.\n\n| method |",
        counted(report.questions, &format!("{} question", report.options.split)),
        counted(report.facts, "fact"),
        report.options.seed,
        ci(pct_ci(widest), 1)
    );
    for k in ks {
        write!(md, " k={k} |").expect("string");
    }
    md.push_str(" prepare ms at k=max |\n|---|");
    md.push_str(&"---:|".repeat(ks.len() + 1));
    md.push('\n');
    let naive = report.cell(Method::Naive, 0).expect("naive is always scored");
    write!(md, "| naive |").expect("string");
    for _ in ks {
        write!(md, " {:.1} / {:.1} |", 100.0 * naive.acc, 100.0 * naive.acc_norm).expect("string");
    }
    md.push_str(" 0 |\n");
    let methods = methods_in(report.cells.iter().map(|c| &c.method));
    for &m in methods.iter().filter(|&&m| m != Method::Naive) {
        write!(md, "| {m} |").expect("string");
        for &k in ks {
            let c = report.cell(m, k).expect("filled");
            write!(md, " {:.1} / {:.1} |", 100.0 * c.acc, 100.0 * c.acc_norm).expect("string");
        }
        let last = report.cell(m, *ks.last().expect("non-empty")).expect("filled");
        writeln!(md, " {:.3} |", last.prepare_ms).expect("string");
    }
    if !report.contrasts.is_empty() {
        md.push_str("\nPaired differences on the same questions: how many more questions `a` gets right than `b` (points, ± 95% CI). An interval that excludes 0 resolves the comparison.\n\n| k | a | b | acc | acc_norm |\n|---:|---|---|---:|---:|\n");
        for c in &report.contrasts {
            writeln!(
                md,
                "| {} | {} | {} | {:+.1} ± {} | {:+.1} ± {} |",
                c.k,
                c.a,
                c.b,
                100.0 * c.acc_diff,
                ci(pct_ci(c.acc_diff_ci95), 1),
                100.0 * c.acc_norm_diff,
                ci(pct_ci(c.acc_norm_diff_ci95), 1)
            )
            .expect("string");
        }
    }
    let mut charts = Vec::new();
    if against_k(out, ks, &["acc_norm_vs_k.png", "gain_vs_k.png"])? {
        let series: Vec<Series> = methods
            .iter()
            .map(|&m| {
                let points =
                    ks.iter().map(|&k| (k as f64, 100.0 * report.cell(m, k).expect("filled").acc_norm)).collect();
                Series::line(m.to_string(), points)
            })
            .collect();
        let gains = paired_gains(
            &methods,
            |m, k| {
                report
                    .contrasts
                    .iter()
                    .find(|c| c.a == m && c.b == Method::Naive && c.k == k)
                    .map(|c| (100.0 * c.acc_norm_diff, pct_ci(c.acc_norm_diff_ci95)))
            },
            ks,
        );
        charts.push(LineChart::against_count(
            "acc_norm_vs_k.png",
            "OpenBookQA: acc_norm vs retrieved facts".into(),
            "k (facts)",
            "acc_norm (%)",
            series,
        ));
        charts.push(LineChart::against_count(
            "gain_vs_k.png",
            format!("OpenBookQA: acc_norm over Naive, paired 95% CI ({})", counted(report.questions, "question")),
            "k (facts)",
            "points over Naive",
            gains,
        ));
    }
    md.push_str(&not_drawn_note(&empty_charts(&charts)));
    write_all(out, serde_json::json!({ "run": info, "report": report }), &csv, &md, info)?;
    draw_line_charts(out, &charts)
}
