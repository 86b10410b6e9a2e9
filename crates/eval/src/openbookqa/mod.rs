//! OpenBookQA (Mihaylov et al., 2018): multiple-choice science questions answered with facts
//! retrieved from the open book. Each question's choices are scored by log-likelihood after
//! the question, from the state each method makes of the k facts most similar to the question;
//! accuracy and length-normalised accuracy are computed as lm-evaluation-harness does.
//!
//! The data is the release's `Data/Main` folder: `openbook.txt` (one quoted fact per line),
//! `test.jsonl`, and, for attribution, `../Additional/test_complete.jsonl` (the gold fact of
//! each question, `fact1`); `Additional/` inside the folder is accepted too.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use picaso_embed::Embedder;
use picaso_model::{Method, Model, State};
use serde::Deserialize;

use crate::attribution::{self, Tally};
use crate::methods::{choice_logliks, start_state, Context};
use crate::stats::{mean_ci95, paired_ci95};
use crate::wikitext::{check_ks, check_sample, choose};
use crate::{Error, Result};

mod report;
pub use report::write_openbookqa;

/// One question.
#[derive(Debug, Clone)]
pub struct Question {
    /// The release's id.
    pub id: String,
    /// The question (often a sentence to complete).
    pub stem: String,
    /// The answer choices, in label order.
    pub choices: Vec<String>,
    /// Index of the correct choice.
    pub answer: usize,
    /// The open-book fact the question was written from, when known.
    pub fact: Option<String>,
}

/// The open book and the questions of one split.
#[derive(Debug, Clone)]
pub struct Data {
    /// Facts, quotes stripped.
    pub facts: Vec<String>,
    /// Questions.
    pub questions: Vec<Question>,
}

#[derive(Deserialize)]
struct RawQuestion {
    id: String,
    question: RawStem,
    #[serde(rename = "answerKey")]
    answer_key: String,
    fact1: Option<String>,
}

#[derive(Deserialize)]
struct RawStem {
    stem: String,
    choices: Vec<RawChoice>,
}

#[derive(Deserialize)]
struct RawChoice {
    text: String,
    label: String,
}

const WHERE: &str =
    "the OpenBookQA release's Data/Main folder (openbook.txt, test.jsonl), from https://allenai.org/data/open-book-qa";

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Input(format!("{}: {e}; --data must be {WHERE}", path.display())))
}

fn parse_questions(path: &Path) -> Result<Vec<Question>> {
    let mut out = Vec::new();
    for (i, line) in read(path)?.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |what: String| Error::Input(format!("{}:{}: {what}", path.display(), i + 1));
        let raw: RawQuestion =
            serde_json::from_str(line).map_err(|e| bad(format!("not an OpenBookQA question ({e})")))?;
        if raw.question.choices.len() < 2 {
            return Err(bad(format!("{} choices; a question needs at least 2", raw.question.choices.len())));
        }
        let answer = raw
            .question
            .choices
            .iter()
            .position(|c| c.label == raw.answer_key)
            .ok_or_else(|| bad(format!("answerKey {:?} is none of the choices' labels", raw.answer_key)))?;
        out.push(Question {
            id: raw.id,
            stem: raw.question.stem,
            choices: raw.question.choices.into_iter().map(|c| c.text).collect(),
            answer,
            fact: raw.fact1,
        });
    }
    if out.is_empty() {
        return Err(Error::Input(format!("{}: no questions", path.display())));
    }
    Ok(out)
}

/// The splits an evaluation reads: the release's third, `train`, is for training (and is not
/// in every copy of the data).
pub const SPLITS: [&str; 2] = ["test", "dev"];

/// Reads `split` (`test` or `dev`) from the release folder `dir`.
pub fn load(dir: &Path, split: &str) -> Result<Data> {
    if !SPLITS.contains(&split) {
        return Err(Error::Input(format!("split {split:?}: use test or dev (train is for training, not evaluation)")));
    }
    let facts: Vec<String> = read(&dir.join("openbook.txt"))?
        .lines()
        .map(|l| l.trim().trim_matches('"').trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    if facts.is_empty() {
        return Err(Error::Input(format!("{}: no facts", dir.join("openbook.txt").display())));
    }
    let mut questions = parse_questions(&dir.join(format!("{split}.jsonl")))?;
    // The gold facts live in Additional/<split>_complete.jsonl.
    let complete: Option<PathBuf> = [dir.join("Additional"), dir.join("../Additional")]
        .into_iter()
        .map(|d| d.join(format!("{split}_complete.jsonl")))
        .find(|p| p.is_file());
    if let Some(path) = complete {
        let gold: HashMap<String, Option<String>> =
            parse_questions(&path)?.into_iter().map(|q| (q.id, q.fact)).collect();
        for q in &mut questions {
            if q.fact.is_none() {
                q.fact = gold.get(&q.id).cloned().flatten();
            }
        }
    }
    Ok(Data { facts, questions })
}

/// How a fact is laid out for the model: one sentence per line, so that concatenated facts
/// and the question that follows read as text.
pub fn fact_text(fact: &str) -> String {
    format!("{}.\n", fact.trim_end_matches('.'))
}

/// The facts with their tokens, states (from the zero state) and embeddings: the open book
/// as a database of states.
pub struct FactBase {
    texts: Vec<String>,
    tokens: Vec<Vec<u32>>,
    states: Vec<State>,
    embeddings: Vec<Vec<f32>>,
}

impl FactBase {
    /// Processes and embeds every fact once.
    pub fn build(model: &Model, embedder: &Embedder, facts: &[String]) -> Result<Self> {
        let tok = model.tokenizer()?;
        let mut tokens = Vec::with_capacity(facts.len());
        let mut states = Vec::with_capacity(facts.len());
        for f in facts {
            let t = tok.encode(&fact_text(f))?;
            states.push(model.prefill(&t, &model.zero_state())?);
            tokens.push(t);
        }
        let refs: Vec<&str> = facts.iter().map(String::as_str).collect();
        let embeddings = embedder.embed(&refs)?;
        Ok(Self { texts: facts.to_vec(), tokens, states, embeddings })
    }

    /// Facts in the base.
    pub fn len(&self) -> usize {
        self.texts.len()
    }

    /// Whether the base is empty.
    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// The index of the fact with this text.
    pub fn find(&self, text: &str) -> Option<usize> {
        let t = text.trim();
        self.texts.iter().position(|f| f == t)
    }

    /// The `k` facts most similar to `query` (cosine of normalised embeddings), most similar
    /// first, skipping `exclude`.
    pub fn nearest(&self, query: &[f32], k: usize, exclude: &[usize]) -> Vec<usize> {
        let mut scored: Vec<(usize, f32)> = self
            .embeddings
            .iter()
            .enumerate()
            .filter(|(i, _)| !exclude.contains(i))
            .map(|(i, e)| (i, e.iter().zip(query).map(|(a, b)| a * b).sum()))
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        scored.into_iter().take(k).map(|(i, _)| i).collect()
    }

    /// Fact `i` as a context.
    pub fn context(&self, i: usize) -> Context<'_> {
        Context { tokens: &self.tokens[i], state: &self.states[i] }
    }
}

/// The questions, tokenised and embedded.
pub struct Prepared {
    questions: Vec<Question>,
    prompts: Vec<Vec<u32>>,
    choices: Vec<Vec<Vec<u32>>>,
    embeddings: Vec<Vec<f32>>,
}

impl Prepared {
    /// Tokenises (choices with a leading space, as lm-evaluation-harness) and embeds.
    pub fn new(model: &Model, embedder: &Embedder, questions: Vec<Question>) -> Result<Self> {
        let tok = model.tokenizer()?;
        let mut prompts = Vec::new();
        let mut choices = Vec::new();
        for q in &questions {
            prompts.push(tok.encode(&q.stem)?);
            choices.push(
                q.choices.iter().map(|c| tok.encode(&format!(" {c}"))).collect::<picaso_model::Result<Vec<_>>>()?,
            );
        }
        for (q, p) in questions.iter().zip(&prompts) {
            if p.is_empty() {
                return Err(Error::Input(format!("question {}: empty stem", q.id)));
            }
        }
        let stems: Vec<&str> = questions.iter().map(|q| q.stem.as_str()).collect();
        let embeddings = embedder.embed(&stems)?;
        Ok(Self { questions, prompts, choices, embeddings })
    }
}

/// What to run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Options {
    /// The split the questions come from (`test` or `dev`), for the report.
    pub split: String,
    /// Numbers of retrieved facts to score, ascending.
    pub ks: Vec<usize>,
    /// Methods besides Naive (always scored).
    pub methods: Vec<Method>,
    /// Score this many questions drawn with `seed` (all if `None`).
    pub sample: Option<usize>,
    /// Seed of the sample.
    pub seed: u64,
}

impl Options {
    /// Checks the settings against an open book of `facts` facts. It needs only the book's
    /// size, so a command checks before the slow processing and embedding of the book.
    pub fn check(&self, facts: usize) -> Result<()> {
        check_ks(&self.ks)?;
        check_sample(self.sample)?;
        let max_k = *self.ks.last().expect("checked non-empty");
        if max_k > facts {
            return Err(Error::Input(format!("k = {max_k} facts asked, but the open book holds {facts}")));
        }
        Ok(())
    }
}

/// One (method, k) cell.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cell {
    /// Method.
    pub method: Method,
    /// Facts (0 for Naive).
    pub k: usize,
    /// Accuracy: the choice with the highest log-likelihood is the answer.
    pub acc: f64,
    /// Half-width of its 95% confidence interval (`None` for one question).
    pub acc_ci95: Option<f64>,
    /// Accuracy with log-likelihoods divided by the choice's length in characters (lm-eval's
    /// acc_norm).
    pub acc_norm: f64,
    /// Half-width of its 95% confidence interval.
    pub acc_norm_ci95: Option<f64>,
    /// Mean milliseconds to make the state from the facts.
    pub prepare_ms: f64,
    /// Mean tokens processed to make it.
    pub tokens_processed: f64,
}

/// The accuracy experiment's results.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// Options used.
    pub options: Options,
    /// Questions scored.
    pub questions: usize,
    /// Facts in the open book.
    pub facts: usize,
    /// Naive first (k = 0), then one cell per (method, k).
    pub cells: Vec<Cell>,
    /// The paper's comparisons, paired on the same questions, per k.
    pub contrasts: Vec<Contrast>,
    /// Per question, right (1) or not (0) by acc_norm, per (method, k), in the order scored
    /// (Naive under k = 0): what pairs two models. Not written to results.json.
    #[serde(skip)]
    pub right_norm: HashMap<(Method, usize), Vec<f64>>,
}

/// Method `a` against method `b` on the same questions: the mean per-question difference of
/// being right (a − b, in accuracy points / 100) with its paired 95% interval, for acc and
/// acc_norm.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Contrast {
    /// Facts.
    pub k: usize,
    /// The method compared.
    pub a: Method,
    /// What it is compared with.
    pub b: Method,
    /// Mean of `right_a − right_b` by acc.
    pub acc_diff: f64,
    /// Its 95% interval half-width (`None` for one question).
    pub acc_diff_ci95: Option<f64>,
    /// Mean of `right_a − right_b` by acc_norm.
    pub acc_norm_diff: f64,
    /// Its 95% interval half-width.
    pub acc_norm_diff_ci95: Option<f64>,
}

/// The paper's comparisons ([`claim_pairs`](crate::methods::claim_pairs)) where both methods were scored;
/// Naive's answers (k = 0) stand for every k.
fn contrasts(ks: &[usize], hits: &HashMap<(Method, usize), Hits>) -> Vec<Contrast> {
    let get = |m: Method, k: usize| hits.get(&(m, if m == Method::Naive { 0 } else { k }));
    let mut out = Vec::new();
    for &k in ks {
        for (a, b) in crate::methods::claim_pairs() {
            let (Some(ha), Some(hb)) = (get(a, k), get(b, k)) else { continue };
            let (acc_diff, acc_diff_ci95) = paired_ci95(&ha.0, &hb.0);
            let (acc_norm_diff, acc_norm_diff_ci95) = paired_ci95(&ha.1, &hb.1);
            out.push(Contrast { k, a, b, acc_diff, acc_diff_ci95, acc_norm_diff, acc_norm_diff_ci95 });
        }
    }
    out
}

impl Report {
    /// The cell of `method` at `k`.
    pub fn cell(&self, method: Method, k: usize) -> Option<&Cell> {
        self.cells.iter().find(|c| c.method == method && (c.k == k || method == Method::Naive))
    }
}

/// Per question: correct by acc, correct by acc_norm; summed seconds and tokens to prepare.
type Hits = (Vec<f64>, Vec<f64>, f64, f64);

fn argmax(xs: &[f64]) -> usize {
    (0..xs.len()).fold(0, |best, i| if xs[i] > xs[best] { i } else { best })
}

/// Scores the questions for every method and k; `progress(done, total)` after each question.
pub fn run(
    model: &Model,
    base: &FactBase,
    data: &Prepared,
    options: &Options,
    mut progress: impl FnMut(usize, usize),
) -> Result<Report> {
    options.check(base.len())?;
    let max_k = *options.ks.last().expect("checked non-empty");
    let chosen = choose((0..data.questions.len()).collect(), options.sample, options.seed)?;
    let mut methods: Vec<Method> = options.methods.iter().copied().filter(|m| *m != Method::Naive).collect();
    methods.dedup();
    let mut hits: HashMap<(Method, usize), Hits> = HashMap::new();
    for (done, &qi) in chosen.iter().enumerate() {
        let q = &data.questions[qi];
        let lens: Vec<f64> = q.choices.iter().map(|c| c.chars().count().max(1) as f64).collect();
        let mut record = |key: (Method, usize), ll: &[f64], secs: f64, toks: usize| {
            let norm: Vec<f64> = ll.iter().zip(&lens).map(|(l, n)| l / n).collect();
            let e = hits.entry(key).or_default();
            e.0.push(f64::from(u8::from(argmax(ll) == q.answer)));
            e.1.push(f64::from(u8::from(argmax(&norm) == q.answer)));
            e.2 += secs;
            e.3 += toks as f64;
        };
        let naive = choice_logliks(model, &model.zero_state(), &data.prompts[qi], &data.choices[qi])?;
        record((Method::Naive, 0), &naive, 0.0, 0);
        let facts: Vec<Context<'_>> =
            base.nearest(&data.embeddings[qi], max_k, &[]).into_iter().map(|i| base.context(i)).collect();
        for &k in &options.ks {
            for &method in &methods {
                let started = start_state(model, method, &facts[..k])?;
                let ll = choice_logliks(model, &started.state, &data.prompts[qi], &data.choices[qi])?;
                record((method, k), &ll, started.seconds, started.tokens_processed);
            }
        }
        progress(done + 1, chosen.len());
    }
    let n = chosen.len() as f64;
    let cell = |method: Method, k: usize| {
        let (acc, norm, secs, toks) = &hits[&(method, k)];
        let (acc, acc_ci95) = mean_ci95(acc);
        let (acc_norm, acc_norm_ci95) = mean_ci95(norm);
        Cell {
            method,
            k,
            acc,
            acc_ci95,
            acc_norm,
            acc_norm_ci95,
            prepare_ms: 1e3 * secs / n,
            tokens_processed: toks / n,
        }
    };
    let mut cells = vec![cell(Method::Naive, 0)];
    for &k in &options.ks {
        for &m in &methods {
            cells.push(cell(m, k));
        }
    }
    let contrasts = contrasts(&options.ks, &hits);
    let right_norm = hits.into_iter().map(|(key, h)| (key, h.1)).collect();
    Ok(Report { options: options.clone(), questions: chosen.len(), facts: base.len(), cells, contrasts, right_norm })
}

/// Attribution options for OpenBookQA.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AttributionOptions {
    /// Distractors per question: drawn uniformly from this range (inclusive).
    pub distractors: (usize, usize),
    /// Leave-one-out methods.
    pub methods: Vec<Method>,
    /// Score this many questions drawn with `seed` (all if `None`).
    pub sample: Option<usize>,
    /// Seed of the sample, the number of distractors and the candidates' order.
    pub seed: u64,
}

impl AttributionOptions {
    /// Checks the settings against an open book of `facts` facts (before the slow embedding,
    /// as [`Options::check`]).
    pub fn check(&self, facts: usize) -> Result<()> {
        let (lo, hi) = self.distractors;
        if lo == 0 || lo > hi || hi >= facts {
            return Err(Error::Input(format!(
                "distractors {lo}..={hi}: need 1 ≤ min ≤ max < {facts} (the facts in the open book)"
            )));
        }
        check_sample(self.sample)
    }
}

/// Attribution on OpenBookQA: the candidates are the question's gold fact and the retrieved
/// facts most similar to the question besides it, in random order; the answer to attribute is
/// the correct choice.
pub fn attribution(
    model: &Model,
    base: &FactBase,
    data: &Prepared,
    options: &AttributionOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<attribution::Report> {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    options.check(base.len())?;
    let (lo, hi) = options.distractors;
    let with_gold: Vec<(usize, usize)> = (0..data.questions.len())
        .filter_map(|i| data.questions[i].fact.as_deref().and_then(|f| base.find(f)).map(|g| (i, g)))
        .collect();
    let skipped = data.questions.len() - with_gold.len();
    if with_gold.is_empty() {
        return Err(Error::Input(
            "no question's gold fact (fact1) is in the open book; attribution needs the split's gold facts, Additional/<split>_complete.jsonl (test_complete.jsonl or dev_complete.jsonl), beside the Main folder".into(),
        ));
    }
    let chosen = choose(with_gold, options.sample, options.seed)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(options.seed ^ 0x5eed);
    let mut tally = Tally::new(&options.methods);
    for (done, &(qi, gold)) in chosen.iter().enumerate() {
        let d = rng.random_range(lo..=hi);
        let mut ids = base.nearest(&data.embeddings[qi], d, &[gold]);
        ids.push(gold);
        ids.shuffle(&mut rng);
        let candidates: Vec<Context<'_>> = ids.iter().map(|&i| base.context(i)).collect();
        let is_gold: Vec<bool> = ids.iter().map(|&i| i == gold).collect();
        let q = &data.questions[qi];
        let answer = &data.choices[qi][q.answer];
        let picks = attribution::attribute(model, &data.prompts[qi], answer, &candidates, &options.methods)?;
        tally.add(&picks, &is_gold);
        progress(done + 1, chosen.len());
    }
    Ok(tally.report("openbookqa", skipped))
}
