//! Zero-shot against fine-tuned models (`eval finetuned`): each model's WikiText and OpenBookQA
//! results side by side, paired on the same passages and questions.

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::{counted, Method};

use crate::plot::{bar_chart, Bar};
use crate::report::files::write_all;
use crate::report::run::RunInfo;
use crate::report::tables::{ci, methods_in, pct_ci};
use crate::stats::paired_ci95;
use crate::wikitext::picaso_r_share;
use crate::{openbookqa, wikitext, Result};

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
