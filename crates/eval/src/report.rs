//! Writing results: `results.json` (everything), a CSV and a Markdown table, each with the
//! exact command, git revision, machine and wall time that produced it.

use picaso_model::counted;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use crate::plot::{bar_chart, has_points, line_chart, Bar, Chart, Series};
use crate::stats::paired_ci95;
use crate::{attribution, context_use, fidelity, openbookqa, order, recall, wikitext, Error, Result};
use picaso_model::Method;

/// Where and how a result was made.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// The command line.
    pub command: String,
    /// The source revision of the binary that made it (`git describe --always --dirty` at build
    /// time), "unknown" when it was not built from a checkout.
    pub git_revision: String,
    /// CPU model and core count.
    pub machine: String,
    /// Seconds the run took.
    pub wall_seconds: f64,
}

/// The revision [`RunInfo::collect`] records: set once by the binary, from its build.
static REVISION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Names the source revision this program was built from (the `picaso` binary passes its
/// build-time `git describe`): results then name the code that made them, not whatever
/// checkout the command happens to run in.
pub fn set_revision(revision: &str) {
    let _ = REVISION.set(revision.to_string());
}

impl RunInfo {
    /// Describes this process's run, started at `started`.
    pub fn collect(started: Instant) -> Self {
        // Arguments that are not UTF-8 (a path) are shown with U+FFFD, never a panic.
        let command = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        let git_revision = REVISION.get().cloned().unwrap_or_else(|| "unknown".into());
        let cpu = picaso_model::bench::cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string());
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

/// An interval's half-width in Markdown, "n/a" where there is none: an interval needs at
/// least two items, and a run of one passage (or question, or query) has a mean without one.
fn ci(half: Option<f64>, decimals: usize) -> String {
    half.map_or_else(|| "n/a".into(), |h| format!("{h:.decimals$}"))
}

/// An interval's half-width in CSV: an empty field where there is none (see [`ci`]).
fn ci_csv(half: Option<f64>, decimals: usize) -> String {
    half.map_or_else(String::new, |h| format!("{h:.decimals$}"))
}

/// `half` in percent (accuracies are stored as shares).
fn pct_ci(half: Option<f64>) -> Option<f64> {
    half.map(|h| 100.0 * h)
}

/// A line chart of a results folder, made before it is drawn so that results.md can say which
/// charts had nothing to draw.
struct LineChart {
    /// File name in the results folder.
    file: &'static str,
    title: String,
    x: &'static str,
    y: &'static str,
    log_x: bool,
    series: Vec<Series>,
}

impl LineChart {
    /// A chart against a count (k, n): whole-number ticks.
    fn against_count(file: &'static str, title: String, x: &'static str, y: &'static str, series: Vec<Series>) -> Self {
        Self { file, title, x, y, log_x: false, series }
    }
}

/// The files of `charts` that have nothing to draw: no finite point in any series (Naive alone
/// takes no time to make a state; a gain over Naive needs a method besides it).
fn empty_charts(charts: &[LineChart]) -> Vec<&'static str> {
    charts.iter().filter(|c| !has_points(&c.series)).map(|c| c.file).collect()
}

/// results.md's line on the charts left out (nothing when none is).
fn not_drawn_note(files: &[&str]) -> String {
    if files.is_empty() {
        return String::new();
    }
    let names: Vec<String> = files.iter().map(|f| format!("`{f}`")).collect();
    format!("\nNot drawn, with nothing to plot for the methods scored: {}.\n", names.join(", "))
}

/// Removes `path` if it is there: a chart of an earlier run that this run does not draw, so
/// that the folder never shows another run's results.
fn remove_stale(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io { path: path.to_path_buf(), source: e }),
        _ => Ok(()),
    }
}

/// Draws `charts` into `out`. One with nothing to draw is left out (and an earlier run's file
/// of its name removed): a finished run is never failed by an empty chart; results.md says
/// which (see [`empty_charts`]).
fn draw_line_charts(out: &Path, charts: &[LineChart]) -> Result<()> {
    for c in charts {
        let path = out.join(c.file);
        if !has_points(&c.series) {
            remove_stale(&path)?;
            continue;
        }
        let chart = Chart { title: &c.title, x: c.x, y: c.y, log_x: c.log_x, whole_x: !c.log_x };
        line_chart(&path, &chart, &c.series)?;
    }
    Ok(())
}

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

/// Writes the context-use check into `out`.
pub fn write_context_use(
    out: &Path,
    source: &str,
    report: &context_use::Report,
    bpb: &context_use::BitsPerByte,
    info: &RunInfo,
) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?;
    json(
        &out.join("results.json"),
        &serde_json::json!({ "run": info, "source": source, "report": report, "bits_per_byte": bpb }),
    )?;
    let mut csv = String::from("context,loss,ci95,delta_vs_none,delta_ci95,change_pct,change_ci95_pct,recall_loss\n");
    let mut md = format!(
        "# Context use: continuation loss after the query, by what precedes it\n\n{source}: {} of {} paragraphs that have a previous paragraph in their article (at least {} tokens; seed {}), each cut into a query half and a continuation half. Intervals are 95%, paired per passage. Recall tokens ({} of {} continuation tokens) complete a bigram of the previous paragraph.\n\n| before the query | loss (nats/token) | change vs none | relative change | loss on recall tokens |\n|---|---:|---:|---:|---:|\n",
        report.passages, report.eligible, context_use::MIN_TOKENS, report.seed, report.recall_tokens, report.continuation_tokens
    );
    for c in &report.conditions {
        writeln!(
            csv,
            "{},{:.6},{},{:.6},{},{:.4},{},{:.6}",
            c.context,
            c.loss,
            ci_csv(c.ci95, 6),
            c.delta_vs_none,
            ci_csv(c.delta_ci95, 6),
            c.change_pct,
            ci_csv(c.change_ci95_pct, 4),
            c.recall_loss
        )
        .expect("string");
        writeln!(
            md,
            "| {} | {:.4} ± {} | {:+.4} ± {} | {:+.2}% ± {} | {:.3} |",
            c.context,
            c.loss,
            ci(c.ci95, 4),
            c.delta_vs_none,
            ci(c.delta_ci95, 4),
            c.change_pct,
            ci(c.change_ci95_pct, 2),
            c.recall_loss
        )
        .expect("string");
    }
    writeln!(
        md,
        "\nThe true previous paragraph lowers the loss by {:+.2} ± {} points more than a random paragraph of another article.\n\nBits per byte over the {} whole articles ({} bytes, {} tokens): **{:.4}** ({:.4} nats/token).\n",
        report.previous_over_random_pct, ci(report.previous_over_random_ci95_pct, 2), bpb.documents, bpb.bytes, bpb.tokens, bpb.bits_per_byte, bpb.nats_per_token
    )
    .expect("string");
    md.push_str(&info.markdown());
    write(&out.join("results.csv"), &csv)?;
    write(&out.join("results.md"), &md)?;
    // Per passage, so runs scored apart can still be paired after the fact.
    let mut passages = String::from("document,paragraph,none,previous,random\n");
    for ((d, j), l) in &report.per_passage {
        writeln!(passages, "{d},{j},{:.6},{:.6},{:.6}", l[0], l[1], l[2]).expect("string");
    }
    write(&out.join("passages.csv"), &passages)?;
    context_use_chart(&out.join("change.png"), report)
}

/// Other models against the first (`eval context-use --compare`): `comparison.json`,
/// `comparison.csv`, and a section per model at the end of `results.md`.
pub fn write_context_use_comparisons(out: &Path, comparisons: &[context_use::Comparison]) -> Result<()> {
    json(&out.join("comparison.json"), &comparisons)?;
    let mut csv = String::from("first,other,passages,what,first_value,other_value,delta,ci95\n");
    let md_path = out.join("results.md");
    let mut md = std::fs::read_to_string(&md_path).map_err(|source| Error::Io { path: md_path.clone(), source })?;
    for c in comparisons {
        writeln!(
            md,
            "\n## {} against {}\n\nThe same {} passages, paired per passage (95%). Changes are each model's against its own no-context loss.\n\n| | {} | {} | {} − {} |\n|---|---:|---:|---:|",
            c.other, c.first, c.passages, c.first, c.other, c.other, c.first
        )
        .expect("string");
        for r in &c.rows {
            writeln!(
                csv,
                "{},{},{},{},{:.6},{:.6},{:.6},{}",
                c.first,
                c.other,
                c.passages,
                r.what,
                r.first,
                r.other,
                r.delta,
                ci_csv(r.ci95, 6)
            )
            .expect("string");
            writeln!(md, "| {} | {:.4} | {:.4} | {:+.4} ± {} |", r.what, r.first, r.other, r.delta, ci(r.ci95, 4))
                .expect("string");
        }
    }
    write(&out.join("comparison.csv"), &csv)?;
    write(&md_path, &md)
}

/// The conditions' relative change of the continuation's loss against no context: on all
/// tokens (paired intervals) and on the recall tokens (pooled, so without one).
fn context_use_chart(path: &Path, report: &context_use::Report) -> Result<()> {
    let Some(none) = report.conditions.iter().find(|c| c.context == "none") else {
        return Err(Error::Input("context use: no 'none' condition to compare with".into()));
    };
    let others = report.conditions.iter().filter(|c| c.context != "none");
    let mut bars: Vec<Bar> = others
        .clone()
        .map(|c| Bar {
            label: format!("{}, all tokens", short(c.context)),
            value: c.change_pct,
            error: c.change_ci95_pct,
        })
        .collect();
    // Recall tokens are pooled over passages: no interval, and none at all in a text without any.
    bars.extend(others.filter(|_| report.recall_tokens > 0).map(|c| Bar {
        label: format!("{}, recall tokens", short(c.context)),
        value: 100.0 * (c.recall_loss - none.recall_loss) / none.recall_loss,
        error: None,
    }));
    // "previous paragraph" → "previous": four labels of 960 pixels.
    fn short(context: &str) -> &str {
        context.split(' ').next().unwrap_or(context)
    }
    bar_chart(
        path,
        &format!("Continuation loss against no context ({} passages, paired 95% CI)", report.passages),
        "change of loss (%)",
        &bars,
        None,
    )
}

fn create(out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })
}

/// Writes results.json, results.csv and results.md (the Markdown gets the run's provenance).
fn write_all(out: &Path, value: serde_json::Value, csv: &str, md: &str, info: &RunInfo) -> Result<()> {
    create(out)?;
    json(&out.join("results.json"), &value)?;
    write(&out.join("results.csv"), csv)?;
    write(&out.join("results.md"), &format!("{md}\n{}", info.markdown()))
}

fn methods_in<'a>(cells: impl Iterator<Item = &'a Method>) -> Vec<Method> {
    let mut out: Vec<Method> = Vec::new();
    for &m in cells {
        if !out.contains(&m) {
            out.push(m);
        }
    }
    out
}

/// One series per method (Naive left out) of its paired gain over Naive at each k with the
/// interval's half-width (`gain(method, k)`; no error bar where there is none), each method's
/// points shifted a little along x so that the error bars of methods at the same k stay apart.
fn paired_gains(
    methods: &[Method],
    gain: impl Fn(Method, usize) -> Option<(f64, Option<f64>)>,
    ks: &[usize],
) -> Vec<Series> {
    let shown: Vec<Method> = methods.iter().copied().filter(|&m| m != Method::Naive).collect();
    let step = ks.windows(2).map(|w| (w[1] - w[0]) as f64).fold(f64::MAX, f64::min).min(1.0);
    let step = if step == f64::MAX { 1.0 } else { step };
    shown
        .iter()
        .enumerate()
        .map(|(i, &m)| {
            let shift = (i as f64 - (shown.len() as f64 - 1.0) / 2.0) * 0.5 * step / shown.len().max(1) as f64;
            let (points, errors) = ks
                .iter()
                .filter_map(|&k| gain(m, k).map(|(g, e)| ((k as f64 + shift, g), e.unwrap_or(f64::NAN))))
                .unzip();
            Series { name: m.to_string(), points, errors }
        })
        .collect()
}

/// Whether charts against k say anything: they need two or more k. With one, the `charts` an
/// earlier run left in `out` are removed, so the folder never shows results of another run.
fn against_k(out: &Path, ks: &[usize], charts: &[&str]) -> Result<bool> {
    if ks.len() > 1 {
        return Ok(true);
    }
    for chart in charts {
        remove_stale(&out.join(chart))?;
    }
    Ok(false)
}

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

/// Writes an attribution experiment into `out`.
pub fn write_attribution(out: &Path, report: &attribution::Report, info: &RunInfo) -> Result<()> {
    let mut csv = String::from("rule,precision,ci95,ms_per_item\n");
    let mut md = format!(
        "# Attribution ({}): which candidate context is the answer's source?\n\n{} items ({} left out), {:.1} candidates each on average; a random pick is right {:.1}% of the time.\n\n| rule | precision | ms per item |\n|---|---:|---:|\n",
        report.source,
        report.items,
        report.skipped,
        report.mean_candidates,
        100.0 * report.chance
    );
    for r in &report.rows {
        writeln!(csv, "{},{:.4},{},{:.3}", r.rule, r.precision, ci_csv(r.ci95, 4), r.ms_per_item).expect("string");
        writeln!(md, "| {} | {:.3} ± {} | {:.1} |", r.rule, r.precision, ci(r.ci95, 3), r.ms_per_item).expect("string");
    }
    if !report.paired.is_empty() {
        md.push_str("\nPaired on the same items: precision of `a` minus that of `b` (± 95% CI; an interval that excludes 0 resolves the comparison).\n\n| a | b | a − b |\n|---|---|---:|\n");
        for p in &report.paired {
            writeln!(md, "| {} | {} | {:+.3} ± {} |", p.a, p.b, p.diff, ci(p.ci95, 3)).expect("string");
        }
    }
    write_all(out, serde_json::json!({ "run": info, "report": report }), &csv, &md, info)?;
    let bars: Vec<Bar> = report
        .rows
        .iter()
        .filter(|r| r.precision.is_finite())
        .map(|r| Bar {
            label: r.rule.replace("leave-one-in", "LOI").replace("leave-one-out", "LOO"),
            value: r.precision,
            error: r.ci95,
        })
        .collect();
    if bars.is_empty() {
        return Ok(());
    }
    bar_chart(
        &out.join("precision.png"),
        &format!("Attribution precision, {} items (LOI leave-one-in, LOO leave-one-out; 95% CI)", report.items),
        "share of items whose pick is the source",
        &bars,
        Some(("a random pick", report.chance)),
    )
}

/// Writes the order-sensitivity experiment into `out`.
pub fn write_order(out: &Path, report: &order::Report, info: &RunInfo) -> Result<()> {
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

fn methods_in_str<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}

/// Writes the fidelity experiment into `out`.
pub fn write_fidelity(out: &Path, report: &fidelity::Report, info: &RunInfo) -> Result<()> {
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

/// One model's results in the fine-tuning comparison.
pub struct ModelResults<'a> {
    /// Name (zero-shot, bptc, bp2c, …).
    pub name: &'a str,
    /// Its WikiText report.
    pub wikitext: &'a wikitext::Report,
    /// Its OpenBookQA report.
    pub openbookqa: &'a openbookqa::Report,
}

/// Each model with every model before it, as (later, earlier).
fn later_earlier<'m, 'a>(
    models: &'m [ModelResults<'a>],
) -> impl Iterator<Item = (&'m ModelResults<'a>, &'m ModelResults<'a>)> {
    models.iter().enumerate().flat_map(move |(j, m)| models[..j].iter().map(move |e| (m, e)))
}

/// Every pair of models, each later one against each earlier one (the first is the zero-shot
/// model; later pairs set the fine-tuned models against each other), paired on the same
/// passages at the largest k: every method's loss, and the later model's PICASO-R against the
/// earlier model's Concat (does fine-tuning close the gap?).
fn finetuned_pairs(md: &mut String, models: &[ModelResults<'_>]) {
    let [first, _, ..] = models else { return };
    let k = first.wikitext.options.max_k();
    let pct = 100.0 / first.wikitext.naive_loss;
    writeln!(
        md,
        "\nPaired on the same passages at k={k}: how much lower each model's loss is than an earlier model's (nats/token and % of `{}`'s Naive loss, ± 95% CI; an interval that excludes 0 resolves it).\n\n| model | method | against | gain (nats) | gain (%) |\n|---|---|---|---:|---:|",
        first.name
    )
    .expect("string");
    let picaso_r = Method::Compose(picaso_model::Composition::PicasoR);
    for (m, earlier) in later_earlier(models) {
        let mut rows: Vec<(Method, Method)> =
            methods_in(m.wikitext.cells.iter().map(|c| &c.method)).into_iter().map(|x| (x, x)).collect();
        rows.push((picaso_r, Method::Concat));
        for (mine, theirs) in rows {
            let (Some(a), Some(b)) = (m.wikitext.losses.get(&(mine, k)), earlier.wikitext.losses.get(&(theirs, k)))
            else {
                continue;
            };
            if a.len() != b.len() {
                continue;
            }
            let (gain, half) = paired_ci95(b, a);
            writeln!(
                md,
                "| {} | {mine} | {} {theirs} | {gain:+.4} ± {} | {:+.2} ± {} |",
                m.name,
                earlier.name,
                ci(half, 4),
                gain * pct,
                ci(half.map(|h| h * pct), 2)
            )
            .expect("string");
        }
    }
}

/// Every model's methods at the largest k as loss reductions from the *first* model's Naive loss
/// (paired on the same passages, 95% intervals), with the first model's Concat as the line to
/// reach: what fine-tuning bought at a glance.
fn finetuned_chart(out: &Path, models: &[ModelResults<'_>]) -> Result<()> {
    let Some(first) = models.first() else { return Ok(()) };
    let k = first.wikitext.options.max_k();
    let pct = 100.0 / first.wikitext.naive_loss;
    let Some(base) = first.wikitext.losses.get(&(Method::Naive, k)) else { return Ok(()) };
    let gain = |m: &ModelResults<'_>, method: Method| {
        let a = m.wikitext.losses.get(&(method, k)).filter(|a| a.len() == base.len())?;
        let (g, half) = paired_ci95(base, a);
        Some((g * pct, half.map(|h| h * pct)))
    };
    let mut bars = Vec::new();
    for (i, m) in models.iter().enumerate() {
        for method in methods_in(m.wikitext.cells.iter().map(|c| &c.method)) {
            if i == 0 && method == Method::Naive {
                continue;
            }
            if let Some((value, error)) = gain(m, method) {
                bars.push(Bar { label: format!("{} {method}", m.name), value, error });
            }
        }
    }
    if bars.is_empty() {
        return Ok(());
    }
    let reference = gain(first, Method::Concat);
    let name = format!("{} concat", first.name);
    bar_chart(
        &out.join("gain_vs_first_naive.png"),
        &format!(
            "WikiText-2, k = {k}: loss reduction from {}'s Naive, paired 95% CI ({} passages)",
            first.name, first.wikitext.passages
        ),
        &format!("% of {}'s Naive loss", first.name),
        &bars,
        reference.map(|(v, _)| (name.as_str(), v)),
    )
}

/// OpenBookQA's part of [`finetuned_pairs`]: acc_norm, paired on the same questions.
fn finetuned_obqa_pairs(md: &mut String, models: &[ModelResults<'_>]) {
    let [first, _, ..] = models else { return };
    let kq = *first.openbookqa.options.ks.last().expect("non-empty");
    writeln!(
        md,
        "\nOpenBookQA, paired on the same questions at k={kq}: acc_norm of each model minus an earlier model's (points, ± 95% CI).\n\n| model | method | against | a − b |\n|---|---|---|---:|"
    )
    .expect("string");
    for (m, earlier) in later_earlier(models) {
        for method in methods_in(m.openbookqa.cells.iter().map(|c| &c.method)) {
            let key = (method, if method == Method::Naive { 0 } else { kq });
            let (Some(a), Some(b)) = (m.openbookqa.right_norm.get(&key), earlier.openbookqa.right_norm.get(&key))
            else {
                continue;
            };
            if a.len() != b.len() {
                continue;
            }
            let (d, half) = paired_ci95(a, b);
            writeln!(md, "| {} | {method} | {} | {:+.1} ± {} |", m.name, earlier.name, 100.0 * d, ci(pct_ci(half), 1))
                .expect("string");
        }
    }
    md.push('\n');
}

/// Writes the fine-tuned-vs-zero-shot comparison into `out` (each model's own results are in
/// sub-folders written by the other writers).
pub fn write_finetuned(out: &Path, models: &[ModelResults<'_>], info: &RunInfo) -> Result<()> {
    let mut csv = String::from("model,experiment,method,k,value\n");
    let mut md = String::from("# Zero-shot vs fine-tuned models\n\n");
    if let Some(first) = models.first() {
        let k = first.wikitext.options.max_k();
        writeln!(
            md,
            "## WikiText-2 ({} passages, seed {}): loss at k={k} and mean improvement over Naive across k\n",
            first.wikitext.passages, first.wikitext.options.seed
        )
        .expect("string");
        md.push_str("| model | method | loss at k=max | mean improvement vs naive |\n|---|---|---:|---:|\n");
        for m in models {
            let naive = m.wikitext.naive_loss;
            writeln!(md, "| {} | naive | {naive:.4} | 0.00% |", m.name).expect("string");
            writeln!(csv, "{},wikitext,naive,0,{naive:.6}", m.name).expect("string");
            for method in methods_in(m.wikitext.cells.iter().map(|c| &c.method)) {
                if method == Method::Naive {
                    continue;
                }
                let c = m.wikitext.cell(method, m.wikitext.options.max_k()).expect("filled");
                let imp = m.wikitext.mean_improvement(method).unwrap_or(0.0);
                writeln!(md, "| {} | {method} | {:.4} | {imp:.2}% |", m.name, c.loss).expect("string");
                writeln!(csv, "{},wikitext,{method},{},{:.6}", m.name, c.k, c.loss).expect("string");
            }
            if let Some(s) = picaso_r_share(m.wikitext) {
                writeln!(md, "| {} | picaso-r share of concat's gain | | {:.0}% |", m.name, 100.0 * s).expect("string");
            }
        }
        finetuned_pairs(&mut md, models);
        finetuned_chart(out, models)?;
        md.push_str("\n![every model's methods against the first model's Naive](gain_vs_first_naive.png)\n");
        let q = first.openbookqa;
        let k = *q.options.ks.last().expect("non-empty");
        writeln!(md, "\n## OpenBookQA ({}): acc / acc_norm (%) at k={k}\n", counted(q.questions, "question"))
            .expect("string");
        md.push_str("| model | method | acc | acc_norm |\n|---|---|---:|---:|\n");
        for m in models {
            for method in methods_in(m.openbookqa.cells.iter().map(|c| &c.method)) {
                let c = m.openbookqa.cell(method, k).expect("filled");
                writeln!(md, "| {} | {method} | {:.1} | {:.1} |", m.name, 100.0 * c.acc, 100.0 * c.acc_norm)
                    .expect("string");
                writeln!(csv, "{},openbookqa-acc_norm,{method},{},{:.4}", m.name, c.k, c.acc_norm).expect("string");
            }
        }
        finetuned_obqa_pairs(&mut md, models);
    }
    let value = serde_json::json!({
        "run": info,
        "models": models.iter().map(|m| serde_json::json!({"name": m.name, "wikitext": m.wikitext, "openbookqa": m.openbookqa})).collect::<Vec<_>>(),
    });
    write_all(out, value, &csv, &md, info)
}

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
