//! MS MARCO v2.1 (Bajaj et al., 2016) for attribution, as in the paper: each query comes with
//! about ten passages, those marked `is_selected` were used to write the answer; attribution
//! must find one of them. The data cannot be downloaded here: users get `dev_v2.1.json` from
//! <https://microsoft.github.io/msmarco/> and pass it to `picaso eval msmarco --data`.
//!
//! The file is column-oriented: `{"query": {"0": "…"}, "passages": {"0": [{"is_selected": 1,
//! "passage_text": "…", "url": "…"}, …]}, "answers": {"0": ["…"]}, "wellFormedAnswers":
//! {"0": [] or "[]"}, "query_id": …}`.

use std::path::Path;

use picaso_model::Model;
use serde_json::Value;

use crate::attribution::{self, Tally};
use crate::methods::Context;
use crate::wikitext::choose;
use crate::{Error, Result};
use picaso_model::Method;

/// One query with its passages and answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    /// The row key of the file.
    pub key: String,
    /// The question.
    pub query: String,
    /// Candidate passages.
    pub passages: Vec<String>,
    /// Whether each passage was selected to write the answer.
    pub selected: Vec<bool>,
    /// The well-formed answer if there is one, else the first answer.
    pub answer: String,
}

/// The usable queries of a file and how many were left out (no answer, no selected passage,
/// or every passage selected, which leaves nothing to attribute).
#[derive(Debug, Clone)]
pub struct Data {
    /// Usable queries, in file order.
    pub queries: Vec<Query>,
    /// Queries left out.
    pub skipped: usize,
}

fn strings(v: Option<&Value>) -> Vec<String> {
    match v {
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_str().map(str::to_string)).collect(),
        // The release writes an empty list of well-formed answers as the string "[]".
        _ => Vec::new(),
    }
}

/// Reads an MS MARCO v2.1 JSON file.
pub fn load(path: &Path) -> Result<Data> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::Input(format!("{}: {e}; --data must be MS MARCO v2.1's dev_v2.1.json (or train/eval)", path.display()))
    })?;
    let bad = |what: String| Error::Input(format!("{}: {what}; expected MS MARCO v2.1 JSON", path.display()));
    let root: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let column =
        |name: &str| root.get(name).and_then(Value::as_object).ok_or_else(|| bad(format!("no \"{name}\" column")));
    let (queries, passages, answers) = (column("query")?, column("passages")?, column("answers")?);
    let well_formed = root.get("wellFormedAnswers").and_then(Value::as_object);
    let mut keys: Vec<&String> = queries.keys().collect();
    keys.sort_by_key(|k| (k.parse::<u64>().unwrap_or(u64::MAX), k.as_str()));
    let mut out = Vec::new();
    let mut skipped = 0;
    for key in keys {
        let query = queries[key].as_str().ok_or_else(|| bad(format!("query {key} is not a string")))?;
        let rows = passages
            .get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| bad(format!("query {key} has no passages list")))?;
        let mut texts = Vec::with_capacity(rows.len());
        let mut selected = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter().enumerate() {
            let text = row
                .get("passage_text")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("passage {i} of query {key} has no passage_text")))?;
            let sel = row
                .get("is_selected")
                .and_then(Value::as_i64)
                .ok_or_else(|| bad(format!("passage {i} of query {key} has no is_selected")))?;
            texts.push(text.to_string());
            selected.push(sel != 0);
        }
        let answer = strings(well_formed.and_then(|w| w.get(key)))
            .into_iter()
            .chain(strings(answers.get(key)))
            .find(|a| !a.trim().is_empty() && a.trim() != "No Answer Present.");
        let n_sel = selected.iter().filter(|&&s| s).count();
        match answer {
            Some(answer) if n_sel > 0 && n_sel < selected.len() => {
                out.push(Query { key: key.clone(), query: query.to_string(), passages: texts, selected, answer })
            }
            _ => skipped += 1,
        }
    }
    if out.is_empty() {
        return Err(bad(format!("no usable query ({skipped} without an answer or a selected passage)")));
    }
    Ok(Data { queries: out, skipped })
}

/// How a query and its answer are laid out for the model.
pub fn prompt_text(query: &str) -> String {
    format!("Question: {query}\nAnswer:")
}

/// Attribution on MS MARCO: the candidates are a query's passages, the gold ones those
/// selected to write the answer.
pub fn attribution(
    model: &Model,
    data: &Data,
    methods: &[Method],
    sample: Option<usize>,
    seed: u64,
    mut progress: impl FnMut(usize, usize),
) -> Result<attribution::Report> {
    let tok = model.tokenizer()?;
    let chosen = choose(data.queries.iter().collect(), sample, seed)?;
    let mut tally = Tally::new(methods);
    for (done, q) in chosen.iter().enumerate() {
        let mut tokens = Vec::with_capacity(q.passages.len());
        for p in &q.passages {
            tokens.push(tok.encode(&format!("{p}\n"))?);
        }
        let states =
            tokens.iter().map(|t| model.prefill(t, &model.zero_state())).collect::<picaso_model::Result<Vec<_>>>()?;
        let candidates: Vec<Context<'_>> =
            tokens.iter().zip(&states).map(|(t, s)| Context { tokens: t, state: s }).collect();
        let prompt = tok.encode(&prompt_text(&q.query))?;
        let answer = tok.encode(&format!(" {}", q.answer))?;
        let picks = attribution::attribute(model, &prompt, &answer, &candidates, methods)?;
        tally.add(&picks, &q.selected);
        progress(done + 1, chosen.len());
    }
    Ok(tally.report("msmarco", data.skipped))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/msmarco_v2.1_tiny.json")
    }

    /// The hand-made fixture in the release's layout: well-formed answers preferred, "[]"
    /// strings read as empty, unusable queries counted, rows in numeric key order.
    #[test]
    fn reads_the_release_layout() {
        let d = load(&fixture()).unwrap();
        assert_eq!(d.skipped, 2, "no answer present, and every passage selected");
        let keys: Vec<&str> = d.queries.iter().map(|q| q.key.as_str()).collect();
        assert_eq!(keys, ["0", "2", "10"]);
        let q0 = &d.queries[0];
        assert_eq!(q0.query, "what is the boiling point of water at sea level");
        assert_eq!(q0.selected, [false, true, false]);
        assert_eq!(q0.answer, "The boiling point of water at sea level is 100 degrees Celsius.");
        assert_eq!(d.queries[1].answer, "Paris", "no well-formed answer: the first answer");
    }

    #[test]
    fn bad_files_are_explained() {
        let dir = tempfile::tempdir().unwrap();
        let missing = load(&dir.path().join("nope.json")).unwrap_err().to_string();
        assert!(missing.contains("dev_v2.1.json"), "{missing}");
        let p = dir.path().join("x.json");
        std::fs::write(&p, r#"{"query": {"0": "q"}}"#).unwrap();
        let e = load(&p).unwrap_err().to_string();
        assert!(e.contains("no \"passages\" column"), "{e}");
        std::fs::write(&p, "[1, 2").unwrap();
        assert!(load(&p).unwrap_err().to_string().contains("not JSON"));
    }
}
