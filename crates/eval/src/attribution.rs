//! Attribution: which of the candidate contexts does an answer come from? Leave-One-In scores
//! the answer given each candidate alone and picks the most helpful; Leave-One-Out removes each
//! candidate from the full set, composes (or concatenates) the rest and picks the one whose
//! removal hurts the answer most. With composition, every leave-one-out state costs arithmetic
//! only — the paper's case for attributing with composed states.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use picaso_model::{Composition, Method, Model};

use crate::methods::{choice_logliks, start_state, Context};
use crate::plot::{bar_chart, Bar};
use crate::report::files::write_all;
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv};
use crate::stats::{mean_ci95, paired_ci95};
use crate::Result;

/// The candidate each rule picked.
#[derive(Debug, Clone)]
pub struct Picks {
    /// Leave-One-In's pick and its seconds.
    pub loi: (usize, f64),
    /// Each method's Leave-One-Out pick and seconds, in the order of the methods given.
    pub loo: Vec<(usize, f64)>,
}

/// Attributes `answer` (after `prompt`) to one of `candidates`.
pub fn attribute(
    model: &Model,
    prompt: &[u32],
    answer: &[u32],
    candidates: &[Context<'_>],
    methods: &[Method],
) -> Result<Picks> {
    let n = candidates.len();
    let answer = [answer.to_vec()];
    let score = |contexts: &[Context<'_>], method: Method| -> Result<f64> {
        let started = start_state(model, method, contexts)?;
        Ok(choice_logliks(model, &started.state, prompt, &answer)?[0])
    };
    let t0 = Instant::now();
    let mut loi = Vec::with_capacity(n);
    for c in candidates {
        loi.push(score(std::slice::from_ref(c), Method::Concat)?);
    }
    let loi_pick = (0..n).fold(0, |b, i| if loi[i] > loi[b] { i } else { b });
    let loi = (loi_pick, t0.elapsed().as_secs_f64());
    let mut loo = Vec::with_capacity(methods.len());
    for &method in methods {
        let t0 = Instant::now();
        let mut without = Vec::with_capacity(n);
        for i in 0..n {
            let rest: Vec<Context<'_>> =
                candidates.iter().enumerate().filter(|&(j, _)| j != i).map(|(_, c)| *c).collect();
            without.push(score(&rest, method)?);
        }
        let pick = (0..n).fold(0, |b, i| if without[i] < without[b] { i } else { b });
        loo.push((pick, t0.elapsed().as_secs_f64()));
    }
    Ok(Picks { loi, loo })
}

/// One attribution rule's precision.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// "leave-one-in", or "leave-one-out `<method>`".
    pub rule: String,
    /// Share of items where the pick is a gold context.
    pub precision: f64,
    /// Half-width of its 95% confidence interval (`None` for one item).
    pub ci95: Option<f64>,
    /// Mean milliseconds per item.
    pub ms_per_item: f64,
}

/// The attribution experiment's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Where the items came from.
    pub source: String,
    /// Items scored.
    pub items: usize,
    /// Items left out (no gold context, no answer).
    pub skipped: usize,
    /// Mean candidates per item.
    pub mean_candidates: f64,
    /// Precision of a uniformly random pick.
    pub chance: f64,
    /// Leave-One-In, then Leave-One-Out per method.
    pub rows: Vec<Row>,
    /// Rules against each other on the same items: every Leave-One-Out rule against
    /// Leave-One-In, and Leave-One-Out with PICASO-R against the other Leave-One-Out rules.
    pub paired: Vec<RulePair>,
}

/// Rule `a` against rule `b` on the same items: mean of `right_a − right_b` with its paired
/// 95% interval (an interval that excludes 0 resolves which rule attributes better).
#[derive(Debug, Clone, serde::Serialize)]
pub struct RulePair {
    /// The rule compared.
    pub a: String,
    /// What it is compared with.
    pub b: String,
    /// Mean difference of precision.
    pub diff: f64,
    /// Its 95% interval half-width (`None` for one item).
    pub ci95: Option<f64>,
}

/// Accumulates picks into precisions.
pub struct Tally {
    methods: Vec<Method>,
    hits: Vec<Vec<f64>>,
    seconds: Vec<f64>,
    candidates: usize,
    chance: f64,
}

impl Tally {
    /// For Leave-One-Out with `methods`.
    pub fn new(methods: &[Method]) -> Self {
        let rules = methods.len() + 1;
        Self {
            methods: methods.to_vec(),
            hits: vec![Vec::new(); rules],
            seconds: vec![0.0; rules],
            candidates: 0,
            chance: 0.0,
        }
    }

    /// Adds one item's picks; `gold[i]` tells whether candidate `i` is a source of the answer.
    pub fn add(&mut self, picks: &Picks, gold: &[bool]) {
        let all = std::iter::once(&picks.loi).chain(&picks.loo);
        for (r, &(pick, secs)) in all.enumerate() {
            self.hits[r].push(f64::from(u8::from(gold[pick])));
            self.seconds[r] += secs;
        }
        self.candidates += gold.len();
        self.chance += gold.iter().filter(|&&g| g).count() as f64 / gold.len() as f64;
    }

    /// The precisions.
    pub fn report(&self, source: &str, skipped: usize) -> Report {
        let items = self.hits[0].len();
        let n = items.max(1) as f64;
        let names = std::iter::once("leave-one-in".to_string())
            .chain(self.methods.iter().map(|m| format!("leave-one-out {m}")));
        let names: Vec<String> = names.collect();
        let pair = |a: usize, b: usize| {
            let (diff, ci95) = paired_ci95(&self.hits[a], &self.hits[b]);
            RulePair { a: names[a].clone(), b: names[b].clone(), diff, ci95 }
        };
        let mut paired: Vec<RulePair> = (1..names.len()).map(|r| pair(r, 0)).collect();
        if let Some(r) = self.methods.iter().position(|&m| m == Method::Compose(Composition::PicasoR)) {
            paired.extend((1..names.len()).filter(|&o| o != r + 1).map(|o| pair(r + 1, o)));
        }
        let rows = names
            .iter()
            .cloned()
            .zip(&self.hits)
            .zip(&self.seconds)
            .map(|((rule, hits), secs)| {
                let (precision, ci95) = mean_ci95(hits);
                Row { rule, precision, ci95, ms_per_item: 1e3 * secs / n }
            })
            .collect();
        Report {
            source: source.to_string(),
            items,
            skipped,
            mean_candidates: self.candidates as f64 / n,
            chance: self.chance / n,
            rows,
            paired,
        }
    }
}

/// Writes an attribution experiment into `out`.
pub fn write_attribution(out: &Path, report: &Report, info: &RunInfo) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use picaso_model::{Mamba2Config, Mamba2Weights, Method};

    use super::*;

    /// Leave-one-out picks the candidate whose removal lowers the answer's likelihood most,
    /// checked against scoring every subset by hand.
    #[test]
    fn picks_follow_the_rules() {
        let c = Mamba2Config::tiny(2, 4);
        let m = Model::from_weights(c.clone(), Mamba2Weights::random(&c, 5), None);
        let segs: Vec<Vec<u32>> = vec![vec![1, 2, 3], vec![4, 5], vec![6, 7, 8], vec![9, 10]];
        let states: Vec<_> = segs.iter().map(|s| m.prefill(s, &m.zero_state()).unwrap()).collect();
        let ctx: Vec<Context<'_>> = segs.iter().zip(&states).map(|(t, s)| Context { tokens: t, state: s }).collect();
        let (prompt, answer) = ([11u32, 12], [13u32, 14, 15]);
        let method = Method::Compose(Composition::PicasoR);
        let picks = attribute(&m, &prompt, &answer, &ctx, &[method, Method::Concat]).unwrap();
        let ll = |cs: &[Context<'_>], me| {
            let s = start_state(&m, me, cs).unwrap().state;
            choice_logliks(&m, &s, &prompt, &[answer.to_vec()]).unwrap()[0]
        };
        let alone: Vec<f64> = ctx.iter().map(|c| ll(std::slice::from_ref(c), Method::Concat)).collect();
        let best = (0..4).max_by(|&a, &b| alone[a].total_cmp(&alone[b])).unwrap();
        assert_eq!(picks.loi.0, best);
        for (r, me) in [method, Method::Concat].into_iter().enumerate() {
            let without: Vec<f64> = (0..4)
                .map(|i| {
                    let rest: Vec<Context<'_>> = (0..4).filter(|&j| j != i).map(|j| ctx[j]).collect();
                    ll(&rest, me)
                })
                .collect();
            let worst = (0..4).min_by(|&a, &b| without[a].total_cmp(&without[b])).unwrap();
            assert_eq!(picks.loo[r].0, worst);
        }
        let mut t = Tally::new(&[method, Method::Concat]);
        let gold: Vec<bool> = (0..4).map(|i| i == best).collect();
        t.add(&picks, &gold);
        let r = t.report("unit", 0);
        assert_eq!(r.rows[0].precision, 1.0);
        assert_eq!(r.chance, 0.25);
        assert_eq!(r.rows.len(), 3);
        // Rules against Leave-One-In, and PICASO-R's against Concat's: one item, no spread.
        let names: Vec<(&str, &str)> = r.paired.iter().map(|p| (p.a.as_str(), p.b.as_str())).collect();
        assert_eq!(
            names,
            [
                ("leave-one-out picaso-r", "leave-one-in"),
                ("leave-one-out concat", "leave-one-in"),
                ("leave-one-out picaso-r", "leave-one-out concat")
            ]
        );
        let right = |rule: usize| r.rows[rule].precision;
        assert_eq!(r.paired[0].diff, right(1) - right(0));
        assert_eq!(r.paired[2].diff, right(1) - right(2));
    }
}
