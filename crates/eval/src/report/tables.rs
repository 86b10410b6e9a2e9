//! Table cells: confidence intervals in Markdown and CSV, and the methods of a report in order.

use picaso_model::Method;

/// An interval's half-width in Markdown, "n/a" where there is none: an interval needs at
/// least two items, and a run of one passage (or question, or query) has a mean without one.
pub(crate) fn ci(half: Option<f64>, decimals: usize) -> String {
    half.map_or_else(|| "n/a".into(), |h| format!("{h:.decimals$}"))
}

/// An interval's half-width in CSV: an empty field where there is none (see [`ci`]).
pub(crate) fn ci_csv(half: Option<f64>, decimals: usize) -> String {
    half.map_or_else(String::new, |h| format!("{h:.decimals$}"))
}

/// `half` in percent (accuracies are stored as shares).
pub(crate) fn pct_ci(half: Option<f64>) -> Option<f64> {
    half.map(|h| 100.0 * h)
}

pub(crate) fn methods_in<'a>(cells: impl Iterator<Item = &'a Method>) -> Vec<Method> {
    let mut out: Vec<Method> = Vec::new();
    for &m in cells {
        if !out.contains(&m) {
            out.push(m);
        }
    }
    out
}

pub(crate) fn methods_in_str<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut out: Vec<&str> = Vec::new();
    for n in names {
        if !out.contains(&n) {
            out.push(n);
        }
    }
    out
}
