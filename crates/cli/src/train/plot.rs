//! `picaso train plot` and `plot-context`: a training log's loss chart, and the context-use
//! checks it logged.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;

#[derive(Args)]
pub struct PlotContextArgs {
    /// NAME=LOG: a training log with context-use checks: `scripts/train_gpu.py`'s JSON lines,
    /// a `progress.json` of `picaso train pretrain`, or a model folder holding either. Repeat
    /// to compare runs.
    #[arg(long = "log", required = true, value_parser = named_log)]
    logs: Vec<(String, String)>,
    /// Chart to write (PNG).
    #[arg(long)]
    out: PathBuf,
}

fn named_log(s: &str) -> std::result::Result<(String, String), String> {
    crate::args::parse_name_value(s, "NAME=PATH, e.g. v3=models/picaso-mamba2/train-log.jsonl")
}

#[derive(Args)]
pub struct PlotArgs {
    /// Training log: one JSON object per line with `tokens`, `loss` and optionally `val_loss`.
    #[arg(long)]
    log: PathBuf,
    /// Chart to write (PNG).
    #[arg(long)]
    out: PathBuf,
}

/// A loss chart: `rows` as (x, training loss, validation loss), the training loss averaged
/// over `windows` equal runs of rows (single batches are noisy), validation points as they are.
/// A row without a training loss (a validation when a run was stopped) adds only its point.
pub(super) fn loss_chart(
    path: &std::path::Path,
    chart: &picaso_eval::plot::Chart<'_>,
    names: [&str; 2],
    rows: &[(f64, Option<f64>, Option<f64>)],
    windows: usize,
) -> Result<()> {
    use picaso_eval::plot::{line_chart, Series};
    let trained: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.1.map(|l| (r.0, l))).collect();
    let window = (trained.len() / windows).max(1);
    let train: Vec<(f64, f64)> = trained
        .chunks(window)
        .map(|c| (c.last().expect("chunks are non-empty").0, c.iter().map(|r| r.1).sum::<f64>() / c.len() as f64))
        .collect();
    let val: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.2.map(|v| (r.0, v))).collect();
    let mut series = vec![Series::line(names[0], train)];
    if !val.is_empty() {
        series.push(Series::line(names[1], val));
    }
    line_chart(path, chart, &series).with_context(|| format!("drawing {}", path.display()))
}

pub(super) fn plot_cmd(a: PlotArgs) -> Result<()> {
    #[derive(Deserialize)]
    struct Row {
        tokens: u64,
        loss: Option<f64>,
        val_loss: Option<f64>,
    }
    let text = std::fs::read_to_string(&a.log).with_context(|| format!("reading --log {}", a.log.display()))?;
    let rows: Vec<(f64, Option<f64>, Option<f64>)> =
        json_lines::<Row>(&text, &a.log, "an object with tokens, loss and val_loss")?
            .into_iter()
            .map(|r| (r.tokens as f64 / 1e6, r.loss, r.val_loss))
            .collect();
    if !rows.iter().any(|r| r.1.is_some()) {
        bail!("--log {}: no rows with a training loss", a.log.display());
    }
    draw_pretrain_loss(&a.out, &rows)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// The objects of a JSON-lines `--log` (blank lines skipped); a line that is not `want` is an
/// error naming the file and line.
fn json_lines<T: serde::de::DeserializeOwned>(text: &str, file: &std::path::Path, want: &str) -> Result<Vec<T>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).with_context(|| format!("--log {} line {}: want {want}", file.display(), i + 1))
        })
        .collect()
}

/// One logged context-use check: tokens seen and the three mean losses.
pub(super) struct ContextPoint {
    tokens: u64,
    none: f64,
    previous: f64,
    random: f64,
}

/// The context-use rows of a training log: the JSON lines `scripts/train_gpu.py` writes
/// (`context_use`), or the `progress.json` that `picaso train pretrain` writes into its model
/// folder (`history` rows with `context`); a folder is read through whichever of the two it
/// holds. Rows without a check (most steps) are skipped.
fn read_context_points(path: &std::path::Path) -> Result<Vec<ContextPoint>> {
    #[derive(Deserialize)]
    struct Losses {
        none: f64,
        previous: f64,
        random: f64,
    }
    #[derive(Deserialize)]
    struct Row {
        tokens: u64,
        #[serde(alias = "context_use")]
        context: Option<Losses>,
    }
    #[derive(Deserialize)]
    struct Progress {
        history: Vec<Row>,
    }
    let file =
        if path.is_dir() {
            ["train-log.jsonl", "progress.json"].iter().map(|f| path.join(f)).find(|f| f.is_file()).with_context(
                || format!("--log {}: a folder without train-log.jsonl or progress.json", path.display()),
            )?
        } else {
            path.to_path_buf()
        };
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading --log {}", file.display()))?;
    let rows = match serde_json::from_str::<Progress>(&text) {
        Ok(p) => p.history,
        Err(_) => json_lines::<Row>(
            &text,
            &file,
            "an object with tokens and optionally context_use {none, previous, random} (or a progress.json \
             with a history)",
        )?,
    };
    let points: Vec<ContextPoint> = rows
        .into_iter()
        .filter_map(|r| {
            r.context.map(|c| ContextPoint { tokens: r.tokens, none: c.none, previous: c.previous, random: c.random })
        })
        .collect();
    if points.is_empty() {
        bail!(
            "--log {}: no row has a context-use check (the trainers log one at each validation step \
             when the corpus keeps paragraphs)",
            file.display()
        );
    }
    Ok(points)
}

pub(super) fn plot_context_cmd(a: PlotContextArgs) -> Result<()> {
    use picaso_eval::plot::{line_chart, Chart, Series};
    // Every log is read and the chart drawn before the table starts, so a bad input leaves no
    // half-printed table.
    let logs = a
        .logs
        .iter()
        .map(|(name, path)| Ok((name, read_context_points(std::path::Path::new(path))?)))
        .collect::<Result<Vec<_>>>()?;
    let mut series = Vec::new();
    for (name, points) in &logs {
        let curve = |f: &dyn Fn(&ContextPoint) -> f64| -> Vec<(f64, f64)> {
            points.iter().map(|p| (p.tokens as f64 / 1e6, f(p))).collect()
        };
        series.push(Series::line(format!("{name}: previous paragraph"), curve(&|p| p.none - p.previous)));
        series.push(Series::line(format!("{name}: random paragraph"), curve(&|p| p.none - p.random)));
    }
    let chart = Chart {
        title: "Loss drop from a paragraph before the query, during training",
        x: "tokens (millions)",
        y: "none − with it (nats/token)",
        log_x: false,
        whole_x: false,
    };
    line_chart(&a.out, &chart, &series).with_context(|| format!("drawing {}", a.out.display()))?;
    println!("| run | tokens (M) | none | previous − none | previous gain | random − none |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, points) in &logs {
        for p in points {
            println!(
                "| {name} | {:.1} | {:.4} | {:+.4} | {:.2}% | {:+.4} |",
                p.tokens as f64 / 1e6,
                p.none,
                p.previous - p.none,
                100.0 * (p.none - p.previous) / p.none,
                p.random - p.none
            );
        }
    }
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// Training loss (mean over windows of 1% of the run) and validation loss against tokens seen.
pub(super) fn write_loss_png(path: &std::path::Path, history: &[picaso_train::pretrain::LogRow]) -> Result<()> {
    let rows: Vec<(f64, Option<f64>, Option<f64>)> =
        history.iter().map(|r| (r.tokens as f64 / 1e6, Some(r.loss), r.val_loss)).collect();
    draw_pretrain_loss(path, &rows)
}

/// The pretraining chart of (million tokens, training loss, validation loss) rows.
fn draw_pretrain_loss(path: &std::path::Path, rows: &[(f64, Option<f64>, Option<f64>)]) -> Result<()> {
    let chart = picaso_eval::plot::Chart {
        title: "Pretraining loss",
        x: "tokens (millions)",
        y: "loss (nats/token)",
        log_x: false,
        whole_x: false,
    };
    loss_chart(path, &chart, ["train", "validation"], rows, 100)
}
