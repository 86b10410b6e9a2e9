//! Does the model use its context? Each paragraph that has a predecessor in its article is cut
//! into a query half and a continuation half (by tokens); the continuation is scored after the
//! query with nothing before it, after the true previous paragraph, and after a paragraph of
//! another article (the control: any text in front may change the loss; only relevant text
//! should lower it). Differences are paired per passage. The loss on *recall tokens* —
//! continuation tokens that complete a bigram of the previous paragraph — is reported
//! separately: that is where reading the context shows. Also measured: bits per byte of whole
//! articles.
//!
//! Paragraphs are tokenized as they appear in a training stream: the text followed by its
//! blank line (`"\n\n"`).

use std::fmt::Write as _;
use std::path::Path;

use picaso_model::Model;
use picaso_store::Document;
use rand::{Rng, SeedableRng};

use crate::plot::{bar_chart, Bar};
use crate::report::files::{json, write};
use crate::report::run::RunInfo;
use crate::report::tables::{ci, ci_csv};
use crate::stats::mean_ci95;
use crate::wikitext::{check_sample, choose};
use crate::{Error, Result};

/// Shortest paragraph (tokens) that is cut into halves.
pub const MIN_TOKENS: usize = 16;

/// A condition's mean loss.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Condition {
    /// What precedes the query.
    pub context: &'static str,
    /// Mean continuation NLL (nats/token, mean over passages).
    pub loss: f64,
    /// Half-width of its 95% confidence interval (`None` for one passage).
    pub ci95: Option<f64>,
    /// Mean paired difference to no context (negative = lower loss).
    pub delta_vs_none: f64,
    /// Half-width of the paired difference's interval.
    pub delta_ci95: Option<f64>,
    /// The difference relative to no context's mean loss, in percent.
    pub change_pct: f64,
    /// Its interval's half-width, in percentage points.
    pub change_ci95_pct: Option<f64>,
    /// Mean loss on the recall tokens (pooled over passages).
    pub recall_loss: f64,
}

/// The check's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Passages scored.
    pub passages: usize,
    /// Passages eligible (a previous paragraph, and at least [`MIN_TOKENS`] tokens), before
    /// sampling.
    pub eligible: usize,
    /// Seed of the sample and of the random paragraphs.
    pub seed: u64,
    /// Recall tokens over all scored continuations.
    pub recall_tokens: usize,
    /// Continuation tokens over all scored passages.
    pub continuation_tokens: usize,
    /// No context, the true previous paragraph, a random paragraph.
    pub conditions: Vec<Condition>,
    /// How much more the true paragraph lowers the loss than the random one, in points of
    /// relative change (paired; positive = the true paragraph helps more).
    pub previous_over_random_pct: f64,
    /// Its interval's half-width.
    pub previous_over_random_ci95_pct: Option<f64>,
    /// Each scored passage's (document, paragraph) and its loss per condition (none,
    /// previous, random): what another model's report is paired with.
    #[serde(skip)]
    pub per_passage: Vec<((usize, usize), [f64; 3])>,
}

/// One passage: the paragraph's halves and what may precede them.
struct Passage {
    at: (usize, usize),
    previous: Vec<u32>,
    random: Vec<u32>,
    query: Vec<u32>,
    continuation: Vec<u32>,
}

fn encode(model: &Model, paragraph: &str) -> Result<Vec<u32>> {
    Ok(model.tokenizer()?.encode(&format!("{paragraph}\n\n"))?)
}

/// Scores `sample` passages (all when `None`) of `docs`: paragraphs of at least
/// [`MIN_TOKENS`] tokens that have a previous paragraph. The short ones are dropped before the
/// sample is drawn, so that a sample of n scores n passages.
pub fn run(model: &Model, docs: &[Document], sample: Option<usize>, seed: u64) -> Result<Report> {
    check_sample(sample)?;
    let with_text: Vec<usize> = (0..docs.len()).filter(|&d| !docs[d].paragraphs.is_empty()).collect();
    if with_text.len() < 2 {
        return Err(Error::Input("context use needs at least two documents with text".into()));
    }
    let mut eligible = Vec::new();
    for (d, doc) in docs.iter().enumerate() {
        for j in 1..doc.paragraphs.len() {
            let tokens = encode(model, &doc.paragraphs[j])?;
            if tokens.len() >= MIN_TOKENS {
                eligible.push(((d, j), tokens));
            }
        }
    }
    if eligible.is_empty() {
        return Err(Error::Input(format!("no paragraph of at least {MIN_TOKENS} tokens has a previous one")));
    }
    let n_eligible = eligible.len();
    let mut chosen = choose(eligible, sample, seed)?;
    chosen.sort_unstable_by_key(|(at, _)| *at);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut passages = Vec::new();
    for ((d, j), tokens) in chosen {
        let other = loop {
            let o = with_text[rng.random_range(0..with_text.len())];
            if o != d {
                break o;
            }
        };
        let pick = rng.random_range(0..docs[other].paragraphs.len());
        let half = tokens.len() / 2;
        passages.push(Passage {
            at: (d, j),
            previous: encode(model, &docs[d].paragraphs[j - 1])?,
            random: encode(model, &docs[other].paragraphs[pick])?,
            query: tokens[..half].to_vec(),
            continuation: tokens[half..].to_vec(),
        });
    }
    // Per passage and condition: mean continuation loss and the losses of the recall tokens.
    let zero = model.zero_state();
    let mut losses = [Vec::new(), Vec::new(), Vec::new()];
    let mut recall = [0f64; 3];
    let (mut recall_n, mut cont_n) = (0usize, 0usize);
    for p in &passages {
        let bigrams: std::collections::HashSet<(u32, u32)> = p.previous.windows(2).map(|w| (w[0], w[1])).collect();
        let is_recall: Vec<bool> = (0..p.continuation.len())
            .map(|j| {
                let before = if j == 0 { p.query[p.query.len() - 1] } else { p.continuation[j - 1] };
                bigrams.contains(&(before, p.continuation[j]))
            })
            .collect();
        recall_n += is_recall.iter().filter(|&&r| r).count();
        cont_n += p.continuation.len();
        for (c, before) in [&[][..], &p.previous[..], &p.random[..]].into_iter().enumerate() {
            let state = if before.is_empty() { zero.clone() } else { model.prefill(before, &zero)? };
            let scored = model.score_continuation(&p.query, &p.continuation, &state)?;
            let nll: Vec<f64> = scored.logprobs.iter().map(|&l| -f64::from(l)).collect();
            losses[c].push(nll.iter().sum::<f64>() / nll.len() as f64);
            recall[c] += nll.iter().zip(&is_recall).filter(|(_, &r)| r).map(|(l, _)| l).sum::<f64>();
        }
    }
    let (none_mean, _) = mean_ci95(&losses[0]);
    let names = ["none", "previous paragraph", "random paragraph"];
    let conditions = (0..3)
        .map(|c| {
            let (loss, ci95) = mean_ci95(&losses[c]);
            let diffs: Vec<f64> = losses[c].iter().zip(&losses[0]).map(|(a, b)| a - b).collect();
            let (delta_vs_none, delta_ci95) = mean_ci95(&diffs);
            Condition {
                context: names[c],
                loss,
                ci95,
                delta_vs_none,
                delta_ci95,
                change_pct: 100.0 * delta_vs_none / none_mean,
                change_ci95_pct: delta_ci95.map(|ci| 100.0 * ci / none_mean),
                recall_loss: recall[c] / recall_n.max(1) as f64,
            }
        })
        .collect();
    let over: Vec<f64> = losses[2].iter().zip(&losses[1]).map(|(r, p)| r - p).collect();
    let (over_mean, over_ci) = mean_ci95(&over);
    Ok(Report {
        passages: passages.len(),
        eligible: n_eligible,
        seed,
        recall_tokens: recall_n,
        continuation_tokens: cont_n,
        conditions,
        previous_over_random_pct: 100.0 * over_mean / none_mean,
        previous_over_random_ci95_pct: over_ci.map(|ci| 100.0 * ci / none_mean),
        per_passage: passages
            .iter()
            .enumerate()
            .map(|(i, p)| (p.at, [losses[0][i], losses[1][i], losses[2][i]]))
            .collect(),
    })
}

/// One quantity of two models side by side, with the paired interval of their difference.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Paired {
    /// What is compared.
    pub what: String,
    /// The first model's value.
    pub first: f64,
    /// The other model's value.
    pub other: f64,
    /// Mean per-passage difference, other − first.
    pub delta: f64,
    /// Half-width of its 95% interval (`None` for one passage).
    pub ci95: Option<f64>,
}

/// Another model against the first on the same passages. The losses are in nats/token; the
/// changes are each model's relative change against its own no-context loss, in percent, so
/// their difference (in points) says which model reads the context better.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Comparison {
    /// The first model's name.
    pub first: String,
    /// The other model's name.
    pub other: String,
    /// Passages paired.
    pub passages: usize,
    /// Loss per condition, then the relative changes.
    pub rows: Vec<Paired>,
}

/// Pairs `other` with `first` passage by passage. Both must have scored the same passages
/// (same text, seed and sample; a tokenizer that drops a short paragraph breaks the pairing).
pub fn compare(first_name: &str, first: &Report, other_name: &str, other: &Report) -> Result<Comparison> {
    let same = first.per_passage.len() == other.per_passage.len()
        && first.per_passage.iter().zip(&other.per_passage).all(|(a, b)| a.0 == b.0);
    if !same || first.per_passage.is_empty() {
        return Err(Error::Input(format!(
            "{other_name} scored other passages than {first_name} ({} against {}): compare models with the same tokenizer, text, seed and sample",
            other.per_passage.len(),
            first.per_passage.len()
        )));
    }
    // Each report's mean no-context loss (the denominator of its relative changes).
    let none = |r: &Report| r.conditions.iter().find(|c| c.context == "none").map_or(f64::NAN, |c| c.loss);
    let (none_a, none_b) = (none(first), none(other));
    let row = |what: &str, f: &dyn Fn([f64; 3], f64) -> f64| {
        let a: Vec<f64> = first.per_passage.iter().map(|p| f(p.1, none_a)).collect();
        let b: Vec<f64> = other.per_passage.iter().map(|p| f(p.1, none_b)).collect();
        let diffs: Vec<f64> = a.iter().zip(&b).map(|(x, y)| y - x).collect();
        let (delta, ci95) = mean_ci95(&diffs);
        Paired { what: what.to_string(), first: mean_ci95(&a).0, other: mean_ci95(&b).0, delta, ci95 }
    };
    let rows = vec![
        row("loss, no context", &|l, _| l[0]),
        row("loss, previous paragraph", &|l, _| l[1]),
        row("loss, random paragraph", &|l, _| l[2]),
        row("change with the previous paragraph (%)", &|l, n| 100.0 * (l[1] - l[0]) / n),
        row("change with a random paragraph (%)", &|l, n| 100.0 * (l[2] - l[0]) / n),
        row("previous over random (points)", &|l, n| 100.0 * (l[2] - l[1]) / n),
    ];
    Ok(Comparison { first: first_name.into(), other: other_name.into(), passages: first.per_passage.len(), rows })
}

/// Bits per byte of whole documents.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BitsPerByte {
    /// Documents scored.
    pub documents: usize,
    /// Their UTF-8 bytes.
    pub bytes: usize,
    /// Their tokens.
    pub tokens: usize,
    /// Σ NLL / (ln 2 · bytes).
    pub bits_per_byte: f64,
    /// Mean NLL per token (nats).
    pub nats_per_token: f64,
}

/// Each document as its training stream has it — the title line, then its paragraphs, each
/// followed by a blank line — scored from the end-of-text token (documents are separated by it
/// in training), every token counted.
pub fn bits_per_byte(model: &Model, docs: &[Document]) -> Result<BitsPerByte> {
    let tok = model.tokenizer()?;
    let start = tok.eos().ok_or_else(|| Error::Input("the tokenizer has no end-of-text token".into()))?;
    let (mut nll, mut bytes, mut tokens, mut n) = (0f64, 0usize, 0usize, 0usize);
    for d in docs.iter().filter(|d| !d.paragraphs.is_empty()) {
        let mut text = format!("= {} =\n\n", d.id);
        for p in &d.paragraphs {
            text.push_str(p);
            text.push_str("\n\n");
        }
        let ids = tok.encode(&text)?;
        let scored = model.score_continuation(&[start], &ids, &model.zero_state())?;
        nll -= scored.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>();
        bytes += text.len();
        tokens += ids.len();
        n += 1;
    }
    if n == 0 {
        return Err(Error::Input("no document has text".into()));
    }
    Ok(BitsPerByte {
        documents: n,
        bytes,
        tokens,
        bits_per_byte: nll / (std::f64::consts::LN_2 * bytes as f64),
        nats_per_token: nll / tokens as f64,
    })
}

/// Writes the context-use check into `out`.
pub fn write_context_use(out: &Path, source: &str, report: &Report, bpb: &BitsPerByte, info: &RunInfo) -> Result<()> {
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?;
    json(
        &out.join("results.json"),
        &serde_json::json!({ "run": info, "source": source, "report": report, "bits_per_byte": bpb }),
    )?;
    let mut csv = String::from("context,loss,ci95,delta_vs_none,delta_ci95,change_pct,change_ci95_pct,recall_loss\n");
    let mut md = format!(
        "# Context use: continuation loss after the query, by what precedes it\n\n{source}: {} of {} paragraphs that have a previous paragraph in their article (at least {} tokens; seed {}), each cut into a query half and a continuation half. Intervals are 95%, paired per passage. Recall tokens ({} of {} continuation tokens) complete a bigram of the previous paragraph.\n\n| before the query | loss (nats/token) | change vs none | relative change | loss on recall tokens |\n|---|---:|---:|---:|---:|\n",
        report.passages, report.eligible, MIN_TOKENS, report.seed, report.recall_tokens, report.continuation_tokens
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
pub fn write_context_use_comparisons(out: &Path, comparisons: &[Comparison]) -> Result<()> {
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
fn context_use_chart(path: &Path, report: &Report) -> Result<()> {
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
