//! Line charts of a results folder: made before they are drawn (so that results.md can say which
//! had nothing to draw), paired gains against k, and charts an earlier run left removed.

use std::path::Path;

use picaso_model::Method;

use super::files::remove_stale;
use crate::plot::{has_points, line_chart, Chart, Series};
use crate::Result;

/// A line chart of a results folder, made before it is drawn so that results.md can say which
/// charts had nothing to draw.
pub(crate) struct LineChart {
    /// File name in the results folder.
    pub(crate) file: &'static str,
    pub(crate) title: String,
    pub(crate) x: &'static str,
    pub(crate) y: &'static str,
    pub(crate) log_x: bool,
    pub(crate) series: Vec<Series>,
}

impl LineChart {
    /// A chart against a count (k, n): whole-number ticks.
    pub(crate) fn against_count(
        file: &'static str,
        title: String,
        x: &'static str,
        y: &'static str,
        series: Vec<Series>,
    ) -> Self {
        Self { file, title, x, y, log_x: false, series }
    }
}

/// The files of `charts` that have nothing to draw: no finite point in any series (Naive alone
/// takes no time to make a state; a gain over Naive needs a method besides it).
pub(crate) fn empty_charts(charts: &[LineChart]) -> Vec<&'static str> {
    charts.iter().filter(|c| !has_points(&c.series)).map(|c| c.file).collect()
}

/// results.md's line on the charts left out (nothing when none is).
pub(crate) fn not_drawn_note(files: &[&str]) -> String {
    if files.is_empty() {
        return String::new();
    }
    let names: Vec<String> = files.iter().map(|f| format!("`{f}`")).collect();
    format!("\nNot drawn, with nothing to plot for the methods scored: {}.\n", names.join(", "))
}

/// Draws `charts` into `out`. One with nothing to draw is left out (and an earlier run's file
/// of its name removed): a finished run is never failed by an empty chart; results.md says
/// which (see [`empty_charts`]).
pub(crate) fn draw_line_charts(out: &Path, charts: &[LineChart]) -> Result<()> {
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

/// One series per method (Naive left out) of its paired gain over Naive at each k with the
/// interval's half-width (`gain(method, k)`; no error bar where there is none), each method's
/// points shifted a little along x so that the error bars of methods at the same k stay apart.
pub(crate) fn paired_gains(
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
        // A method without paired gains draws nothing: it is not listed in the legend either.
        .filter(|s| !s.points.is_empty())
        .collect()
}

/// Whether charts against k say anything: they need two or more k. With one, the `charts` an
/// earlier run left in `out` are removed, so the folder never shows results of another run.
pub(crate) fn against_k(out: &Path, ks: &[usize], charts: &[&str]) -> Result<bool> {
    if ks.len() > 1 {
        return Ok(true);
    }
    for chart in charts {
        remove_stale(&out.join(chart))?;
    }
    Ok(false)
}
