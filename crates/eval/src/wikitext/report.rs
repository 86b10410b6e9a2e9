//! The WikiText experiment's results folder: tables, charts, and rewriting them from a run's
//! results.json.

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::Method;

use crate::plot::{bar_chart, Bar, Series};
use crate::report::charts::{against_k, draw_line_charts, empty_charts, not_drawn_note, paired_gains, LineChart};
use crate::report::files::{json, remove_stale, write};
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv};
use crate::{wikitext, Error, Result};

/// PICASO-R's mean improvement over Naive as a share of Concat's (the paper: 10.1 / 11.1).
pub fn picaso_r_share(report: &wikitext::Report) -> Option<f64> {
    let r = report.mean_improvement(Method::Compose(picaso_model::Composition::PicasoR))?;
    let c = report.mean_improvement(Method::Concat)?;
    (c != 0.0).then_some(r / c)
}

/// Rewrites a WikiText (or scaling) results folder's tables and charts from its results.json,
/// keeping the run's own command, revision, machine and wall time: how a change to the report
/// or the charts reaches results that took hours to measure, without measuring them again.
pub fn rewrite_wikitext(out: &Path) -> Result<()> {
    #[derive(serde::Deserialize)]
    struct Saved {
        run: RunInfo,
        report: wikitext::Report,
    }
    let path = out.join("results.json");
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
    let saved: Saved = serde_json::from_str(&text).map_err(|e| {
        Error::Input(format!(
            "{}: not the results of a WikiText or scaling run ({e}); re-run the command in its results.md instead",
            path.display()
        ))
    })?;
    write_wikitext(out, &saved.report, &saved.run)
}

/// Writes the WikiText experiment into `out`.
pub fn write_wikitext(out: &Path, report: &wikitext::Report, info: &RunInfo) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?;
    let share = picaso_r_share(report);
    json(
        &out.join("results.json"),
        &serde_json::json!({ "run": info, "report": report, "picaso_r_share_of_concat_gain": share }),
    )?;
    let mut csv = String::from("method,k,loss,ci95,improvement_pct,prepare_ms,tokens_processed\n");
    for c in &report.cells {
        writeln!(
            csv,
            "{},{},{:.6},{},{:.4},{:.4},{:.1}",
            c.method,
            c.k,
            c.loss,
            ci_csv(c.ci95, 6),
            c.improvement_pct,
            c.prepare_ms,
            c.tokens_processed
        )
        .expect("string");
    }
    write(&out.join("results.csv"), &csv)?;

    let ks = &report.options.ks;
    let mut methods: Vec<Method> = Vec::new();
    for c in &report.cells {
        if !methods.contains(&c.method) {
            methods.push(c.method);
        }
    }
    let mut md = format!(
        "# WikiText-2: continuation loss (nats/token) given k retrieved segments\n\n{} of {} passages (seed {}); query {:.1} and continuation {:.1} tokens on average. Naive: {:.4} ± {} (95% CI).\n\n",
        report.passages, report.passages_available, report.options.seed, report.mean_query_tokens, report.mean_continuation_tokens, report.naive_loss, ci(report.naive_ci95, 4)
    );
    md.push_str("| method |");
    for k in ks {
        write!(md, " k={k} |").expect("string");
    }
    md.push_str(" mean improvement vs naive | prepare ms at k=max |\n|---|");
    md.push_str(&"---:|".repeat(ks.len() + 2));
    md.push('\n');
    for &m in &methods {
        write!(md, "| {m} |").expect("string");
        for &k in ks {
            let c = report.cell(m, k).expect("every cell is filled");
            write!(md, " {:.4} |", c.loss).expect("string");
        }
        let last = report.cell(m, report.options.max_k()).expect("filled");
        writeln!(md, " {:.2}% | {:.2} |", report.mean_improvement(m).unwrap_or(0.0), last.prepare_ms).expect("string");
    }
    if let Some(s) = share {
        writeln!(
            md,
            "\nPICASO-R gains {:.1}% of Concat's improvement over Naive (paper: 10.1 / 11.1 = 91%).",
            100.0 * s
        )
        .expect("string");
    }
    if report.neighbour_passages > 0 {
        write!(
            md,
            "\nRetriever: {}. Recall of the true neighbouring segment (the one just before the query) among the k \
             retrieved, over the {} passages that have one:\n\n| k |",
            report.options.retriever, report.neighbour_passages
        )
        .expect("string");
        for (k, _) in &report.neighbour_recall {
            write!(md, " {k} |").expect("string");
        }
        md.push_str("\n|---|");
        md.push_str(&"---:|".repeat(report.neighbour_recall.len()));
        md.push_str("\n| recall |");
        for (_, r) in &report.neighbour_recall {
            write!(md, " {:.3} |", r).expect("string");
        }
        md.push('\n');
    }
    let picaso_r = Method::Compose(picaso_model::Composition::PicasoR);
    if methods.contains(&Method::Concat) && methods.contains(&picaso_r) {
        md.push_str("\nTime to a ready state, per query (composition of stored states vs processing the contexts' tokens):\n\n| k | concat tokens | concat ms | picaso-r ms | speed-up |\n|---:|---:|---:|---:|---:|\n");
        for &k in ks {
            let (c, r) = (report.cell(Method::Concat, k).expect("filled"), report.cell(picaso_r, k).expect("filled"));
            writeln!(
                md,
                "| {k} | {:.0} | {:.2} | {:.3} | {:.0}× |",
                c.tokens_processed,
                c.prepare_ms,
                r.prepare_ms,
                c.prepare_ms / r.prepare_ms.max(1e-9)
            )
            .expect("string");
        }
    }
    // The widest interval of a method's cell; there is none with one passage.
    let widest = report.cells.iter().filter(|c| c.method != Method::Naive).filter_map(|c| c.ci95).reduce(f64::max);
    match widest {
        Some(w) => writeln!(md, "\nLargest 95% confidence half-width of a cell: {w:.4}."),
        None if report.passages < 2 => writeln!(
            md,
            "\nNo 95% confidence intervals (n/a): they need at least 2 passages, and {} was scored.",
            report.passages
        ),
        None => Ok(()),
    }
    .expect("string");
    if !report.contrasts.is_empty() {
        md.push_str("\nPaired differences on the same passages: how much lower `a`'s loss is than `b`'s (nats/token, and % of Naive's loss, ± 95% CI). An interval that excludes 0 resolves the comparison.\n\n| k | a | b | gain (nats) | gain (% of naive) |\n|---:|---|---|---:|---:|\n");
        for c in &report.contrasts {
            writeln!(
                md,
                "| {} | {} | {} | {:+.4} ± {} | {:+.2} ± {} |",
                c.k,
                c.a,
                c.b,
                c.gain,
                ci(c.gain_ci95, 4),
                c.gain_pct,
                ci(c.gain_pct_ci95, 2)
            )
            .expect("string");
        }
    }
    let charts = wikitext_charts(out, report, &methods)?;
    let bars = gain_bars(report, &methods);
    let mut empty = empty_charts(&charts);
    if bars.is_empty() {
        empty.push(GAIN_AT_MAX_K);
    }
    md.push_str(&not_drawn_note(&empty));
    md.push('\n');
    md.push_str(&info.markdown());
    write(&out.join("results.md"), &md)?;
    draw_line_charts(out, &charts)?;
    if bars.is_empty() {
        return remove_stale(&out.join(GAIN_AT_MAX_K));
    }
    let k = report.options.max_k();
    bar_chart(
        &out.join(GAIN_AT_MAX_K),
        &format!("WikiText-2, k = {k}: loss reduction over Naive, paired 95% CI ({} passages)", report.passages),
        "% of Naive's loss",
        &bars,
        None,
    )
}

/// The headline chart's file: each method's paired gain at the largest k.
const GAIN_AT_MAX_K: &str = "gain_at_max_k.png";

/// The WikiText charts against k (with two or more k) and against time.
fn wikitext_charts(out: &Path, report: &wikitext::Report, methods: &[Method]) -> Result<Vec<LineChart>> {
    let mut charts = Vec::new();
    if against_k(out, &report.options.ks, &["gain_vs_k.png", "loss_vs_k.png"])? {
        let gains = paired_gains(
            methods,
            |m, k| {
                report
                    .contrasts
                    .iter()
                    .find(|c| c.a == m && c.b == Method::Naive && c.k == k)
                    .map(|c| (c.gain_pct, c.gain_pct_ci95))
            },
            &report.options.ks,
        );
        let by_k: Vec<Series> = methods
            .iter()
            .map(|&m| {
                let points = report.cells.iter().filter(|c| c.method == m).map(|c| (c.k as f64, c.loss)).collect();
                Series::line(m.to_string(), points)
            })
            .collect();
        let n = report.passages;
        charts.push(LineChart::against_count(
            "gain_vs_k.png",
            format!("WikiText-2: loss reduction over Naive, paired 95% CI ({n} passages)"),
            "k (segments)",
            "% of Naive's loss",
            gains,
        ));
        charts.push(LineChart::against_count(
            "loss_vs_k.png",
            format!("WikiText-2: continuation loss vs retrieved segments ({n} passages)"),
            "k (segments)",
            "loss (nats/token)",
            by_k,
        ));
    }
    let by_time: Vec<Series> = methods
        .iter()
        .filter(|&&m| m != Method::Naive)
        .map(|&m| {
            let points = report.cells.iter().filter(|c| c.method == m).map(|c| (c.prepare_ms, c.loss)).collect();
            Series::line(m.to_string(), points)
        })
        .collect();
    let ks: Vec<String> = report.options.ks.iter().map(usize::to_string).collect();
    charts.push(LineChart {
        file: "loss_vs_time.png",
        title: format!("Loss vs time to make the state (k = {})", ks.join(", ")),
        x: "ms per query to compose / process the contexts (log)",
        y: "loss (nats/token)",
        log_x: true,
        series: by_time,
    });
    Ok(charts)
}

/// The headline at a glance, also when only one k was scored: each method's paired gain over
/// Naive at the largest k (none when Naive alone was scored).
fn gain_bars(report: &wikitext::Report, methods: &[Method]) -> Vec<Bar> {
    let k = report.options.max_k();
    methods
        .iter()
        .filter_map(|&m| {
            let c = report.contrasts.iter().find(|c| c.a == m && c.b == Method::Naive && c.k == k)?;
            Some(Bar { label: m.to_string(), value: c.gain_pct, error: c.gain_pct_ci95 })
        })
        .collect()
}
