//! Writing results: `results.json` (everything), a CSV and a Markdown table, each with the
//! exact command, git revision, machine and wall time that produced it.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use crate::methods::EvalMethod;
use crate::plot::{line_chart, Chart, Series};
use crate::{context_use, wikitext, Error, Result};

/// Where and how a result was made.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RunInfo {
    /// The command line.
    pub command: String,
    /// `git describe --always --dirty` of the working directory, if it is a checkout.
    pub git_revision: String,
    /// CPU model and core count.
    pub machine: String,
    /// Seconds the run took.
    pub wall_seconds: f64,
}

impl RunInfo {
    /// Describes this process's run, started at `started`.
    pub fn collect(started: Instant) -> Self {
        let command = std::env::args().collect::<Vec<_>>().join(" ");
        // The working directory's checkout, else the one this binary was built from.
        let describe = |dir: &str| {
            std::process::Command::new("git")
                .args(["-C", dir, "describe", "--always", "--dirty"])
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        let git_revision =
            describe(".").or_else(|| describe(env!("CARGO_MANIFEST_DIR"))).unwrap_or_else(|| "unknown".into());
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Self {
            command,
            git_revision,
            machine: format!("{cpu}, {cores} cores"),
            wall_seconds: started.elapsed().as_secs_f64(),
        }
    }

    fn markdown(&self) -> String {
        format!(
            "Command: `{}`  \nRevision: `{}` · machine: {} · wall time: {:.0} s\n",
            self.command, self.git_revision, self.machine, self.wall_seconds
        )
    }
}

fn write(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

fn json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    write(path, &serde_json::to_string_pretty(value).expect("results serialise"))
}

/// PICASO-R's mean improvement over Naive as a share of Concat's (the paper: 10.1 / 11.1).
pub fn picaso_r_share(report: &wikitext::Report) -> Option<f64> {
    let r = report.mean_improvement(EvalMethod::Compose(picaso_model::Method::PicasoR))?;
    let c = report.mean_improvement(EvalMethod::Concat)?;
    (c != 0.0).then_some(r / c)
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
            "{},{},{:.6},{:.6},{:.4},{:.4},{:.1}",
            c.method, c.k, c.loss, c.ci95, c.improvement_pct, c.prepare_ms, c.tokens_processed
        )
        .expect("string");
    }
    write(&out.join("results.csv"), &csv)?;

    let ks: Vec<usize> = (1..=report.options.max_k).collect();
    let mut methods: Vec<EvalMethod> = Vec::new();
    for c in &report.cells {
        if !methods.contains(&c.method) {
            methods.push(c.method);
        }
    }
    let mut md = format!(
        "# WikiText-2: continuation loss (nats/token) given k retrieved segments\n\n{} of {} passages (seed {}); query {:.1} and continuation {:.1} tokens on average. Naive: {:.4} ± {:.4} (95% CI).\n\n",
        report.passages, report.passages_available, report.options.seed, report.mean_query_tokens, report.mean_continuation_tokens, report.naive_loss, report.naive_ci95
    );
    md.push_str("| method |");
    for k in &ks {
        write!(md, " k={k} |").expect("string");
    }
    md.push_str(" mean improvement vs naive | prepare ms at k=max |\n|---|");
    md.push_str(&"---:|".repeat(ks.len() + 2));
    md.push('\n');
    for &m in &methods {
        write!(md, "| {m} |").expect("string");
        for &k in &ks {
            let c = report.cell(m, k).expect("every cell is filled");
            write!(md, " {:.4} |", c.loss).expect("string");
        }
        let last = report.cell(m, report.options.max_k).expect("filled");
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
    let ci = report.cells.iter().filter(|c| c.method != EvalMethod::Naive).map(|c| c.ci95).fold(0.0, f64::max);
    writeln!(md, "Largest 95% confidence half-width of a cell: {ci:.4}.\n").expect("string");
    md.push_str(&info.markdown());
    write(&out.join("results.md"), &md)?;
    plot_wikitext(out, report, &methods)
}

fn plot_wikitext(out: &Path, report: &wikitext::Report, methods: &[EvalMethod]) -> Result<()> {
    let by_k: Vec<Series> = methods
        .iter()
        .map(|&m| Series {
            name: m.to_string(),
            points: report.cells.iter().filter(|c| c.method == m).map(|c| (c.k as f64, c.loss)).collect(),
        })
        .collect();
    let title = format!("WikiText-2: continuation loss vs retrieved segments ({} passages)", report.passages);
    line_chart(
        &out.join("loss_vs_k.png"),
        &Chart { title: &title, x: "k (segments)", y: "loss (nats/token)", log_x: false },
        &by_k,
    )?;
    let by_time: Vec<Series> = methods
        .iter()
        .filter(|&&m| m != EvalMethod::Naive)
        .map(|&m| Series {
            name: m.to_string(),
            points: report.cells.iter().filter(|c| c.method == m).map(|c| (c.prepare_ms, c.loss)).collect(),
        })
        .collect();
    line_chart(
        &out.join("loss_vs_time.png"),
        &Chart {
            title: "Loss vs time to make the state (k = 1..max)",
            x: "ms per query to compose / process the contexts (log)",
            y: "loss (nats/token)",
            log_x: true,
        },
        &by_time,
    )
}

/// Writes the context-use check into `out`.
pub fn write_context_use(out: &Path, report: &context_use::Report, info: &RunInfo) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?;
    json(&out.join("results.json"), &serde_json::json!({ "run": info, "report": report }))?;
    let mut csv = String::from("context,loss,ci95,delta_vs_none,delta_ci95\n");
    let mut md = format!(
        "# Context use: continuation loss after the query, by what precedes it\n\n{} WikiText-2 passages with a stored preceding paragraph (seed {}).\n\n| before the query | loss (nats/token) | change vs none |\n|---|---:|---:|\n",
        report.passages, report.seed
    );
    for c in &report.conditions {
        writeln!(csv, "{},{:.6},{:.6},{:.6},{:.6}", c.context, c.loss, c.ci95, c.delta_vs_none, c.delta_ci95)
            .expect("string");
        writeln!(
            md,
            "| {} | {:.4} ± {:.4} | {:+.4} ± {:.4} |",
            c.context, c.loss, c.ci95, c.delta_vs_none, c.delta_ci95
        )
        .expect("string");
    }
    md.push('\n');
    md.push_str(&info.markdown());
    write(&out.join("results.csv"), &csv)?;
    write(&out.join("results.md"), &md)
}
