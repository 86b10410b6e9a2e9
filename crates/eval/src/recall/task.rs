//! The recall task: contexts that each hold `m` key → value facts, and queries that name one
//! key. Everything is a pure function of (task, seed, index), so two runs — or two models —
//! see exactly the same episodes.
//!
//! Two vocabularies:
//! * **synthetic** (multi-query associative recall, MQAR; Arora et al., "Zoology", 2023): keys
//!   `k0…` and values `v0…` are single tokens of a word-level vocabulary
//!   ([`synthetic_tokenizer`]) — a context reads `k12 v7 k3 v99`, a query `? k12`, its answer
//!   `v7`. A small model trained on [`training_text`] learns it in minutes;
//! * **natural** language, for any model with a byte-level tokenizer: `The code of Velmora is
//!   4812.`, queried as `The code of Velmora is` → ` 4812`.

use std::collections::HashMap;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::{Error, Result};

/// Which vocabulary the facts are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Form {
    /// Key and value tokens from disjoint ranges of a word-level vocabulary.
    Synthetic,
    /// English sentences with invented names and four-digit codes.
    Natural,
}

impl std::str::FromStr for Form {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "synthetic" => Ok(Self::Synthetic),
            "natural" => Ok(Self::Natural),
            _ => Err(format!("form {s:?}: use synthetic or natural")),
        }
    }
}

/// The task's shape.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Task {
    /// Vocabulary of the facts.
    pub form: Form,
    /// Facts per context (m).
    pub facts: usize,
    /// Distinct keys (synthetic: key tokens; natural: invented names).
    pub keys: usize,
    /// Distinct values (synthetic: value tokens; natural: codes from 1000 on, at most 9000).
    pub values: usize,
}

/// One key → value fact (indices into the task's keys and values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fact {
    /// Key index.
    pub key: usize,
    /// Value index.
    pub value: usize,
}

/// k contexts of facts and the queries asked about them.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    /// The contexts, each `facts` facts; keys are distinct across the episode.
    pub contexts: Vec<Vec<Fact>>,
    /// Queries as (context, fact within it).
    pub queries: Vec<(usize, usize)>,
}

/// The question mark that opens a synthetic query.
pub const QUERY: &str = "?";
/// Filler that pads a synthetic training sequence to its exact length.
pub const PAD: &str = ".";
const EOS: &str = "<|endoftext|>";
const UNK: &str = "<unk>";

impl Task {
    /// Checks the sizes, and that `k` contexts fit in the keys.
    pub fn check(&self, k: usize) -> Result<()> {
        if self.facts == 0 {
            return Err(Error::Input("a context of 0 facts has nothing to recall: give --facts of at least 1".into()));
        }
        if self.values < 2 {
            return Err(Error::Input(format!("{} values: recall needs at least 2", self.values)));
        }
        if self.form == Form::Natural && self.values > 9000 {
            return Err(Error::Input(format!("{} values: natural codes are the 9000 numbers 1000–9999", self.values)));
        }
        if k * self.facts > self.keys {
            return Err(Error::Input(format!(
                "k = {k} contexts × {} facts need {} distinct keys, but the task has {}; lower k or --facts{}",
                self.facts,
                k * self.facts,
                self.keys,
                if self.form == Form::Natural {
                    ", or raise --keys"
                } else {
                    " (the model's vocabulary fixes the keys)"
                }
            )));
        }
        Ok(())
    }

    /// The synthetic task a word-level recall vocabulary supports: its keys and values are
    /// the runs `k0…` and `v0…` of the tokenizer's vocabulary.
    pub fn synthetic_from_vocab(vocab: &HashMap<String, u32>, facts: usize) -> Result<Self> {
        let run = |prefix: char| (0..).take_while(|i| vocab.contains_key(&format!("{prefix}{i}"))).count();
        let (keys, values) = (run('k'), run('v'));
        if keys == 0 || values == 0 || !vocab.contains_key(QUERY) {
            return Err(Error::Input(
                "the model's tokenizer has no synthetic recall vocabulary (tokens ?, k0…, v0…): use --form natural, or a model trained with a recall config (see results/recall)".into(),
            ));
        }
        Ok(Self { form: Form::Synthetic, facts, keys, values })
    }

    /// The text of key `i`.
    pub fn key(&self, i: usize) -> String {
        match self.form {
            Form::Synthetic => format!("k{i}"),
            Form::Natural => name(i),
        }
    }

    /// The text of value `i`.
    pub fn value(&self, i: usize) -> String {
        match self.form {
            Form::Synthetic => format!("v{i}"),
            Form::Natural => (1000 + i).to_string(),
        }
    }

    /// A context's text.
    pub fn context_text(&self, facts: &[Fact]) -> String {
        match self.form {
            Form::Synthetic => facts
                .iter()
                .map(|f| format!("{} {}", self.key(f.key), self.value(f.value)))
                .collect::<Vec<_>>()
                .join(" "),
            Form::Natural => {
                facts
                    .iter()
                    .map(|f| format!("The code of {} is {}.", self.key(f.key), self.value(f.value)))
                    .collect::<Vec<_>>()
                    .join(" ")
                    + "\n\n"
            }
        }
    }

    /// The prompt that asks for key `key`'s value.
    pub fn query_text(&self, key: usize) -> String {
        match self.form {
            Form::Synthetic => format!("{QUERY} {}", self.key(key)),
            Form::Natural => format!("The code of {} is", self.key(key)),
        }
    }

    /// The answer's text as it follows the prompt.
    pub fn answer_text(&self, value: usize) -> String {
        format!(" {}", self.value(value))
    }

    /// Episode `index` of `k` contexts with `queries` queries, for `seed`. The queries cycle
    /// through the context positions so that every position is asked about equally often.
    pub fn episode(&self, seed: u64, index: usize, k: usize, queries: usize) -> Result<Episode> {
        self.check(k)?;
        if k == 0 || queries == 0 {
            return Err(Error::Input(format!(
                "an episode needs k ≥ 1 and queries ≥ 1 (got k = {k}, queries = {queries})"
            )));
        }
        let mut rng = rng_for(seed, index as u64, k as u64, 0x5ec0);
        let keys = rand::seq::index::sample(&mut rng, self.keys, k * self.facts).into_vec();
        let contexts: Vec<Vec<Fact>> = keys
            .chunks(self.facts)
            .map(|c| c.iter().map(|&key| Fact { key, value: rng.random_range(0..self.values) }).collect())
            .collect();
        let first = rng.random_range(0..k);
        let queries = (0..queries).map(|q| ((first + q) % k, rng.random_range(0..self.facts))).collect();
        Ok(Episode { contexts, queries })
    }

    /// `n` distractor values for the answer `value` (fewer only when the task has fewer other
    /// values; [`crate::recall::run`] refuses such an `n`): the episode's other values first
    /// (the confusions that matter), then random ones; all distinct and ≠ `value`.
    pub fn distractors(&self, episode: &Episode, value: usize, n: usize, rng: &mut impl Rng) -> Vec<usize> {
        let mut own: Vec<usize> = episode.contexts.iter().flatten().map(|f| f.value).filter(|&v| v != value).collect();
        own.sort_unstable();
        own.dedup();
        own.shuffle(rng);
        own.truncate(n);
        while own.len() < n.min(self.values - 1) {
            let v = rng.random_range(0..self.values);
            if v != value && !own.contains(&v) {
                own.push(v);
            }
        }
        own
    }
}

/// An invented, pronounceable name for key `i` (distinct for every `i`).
fn name(i: usize) -> String {
    const ONSETS: [&str; 16] = ["b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br"];
    const VOWELS: [&str; 8] = ["a", "e", "i", "o", "u", "ai", "ou", "ia"];
    const CODAS: [&str; 4] = ["n", "r", "s", "th"];
    // Mixed-radix digits of i: at least three syllables, so every name is a word of its own.
    let mut n = i;
    let mut s = String::new();
    for _ in 0..3 {
        s.push_str(ONSETS[n % 16]);
        n /= 16;
        s.push_str(VOWELS[n % 8]);
        n /= 8;
    }
    while n > 0 {
        s.push_str(ONSETS[n % 16]);
        n /= 16;
        s.push_str(VOWELS[n % 8]);
        n /= 8;
    }
    s.push_str(CODAS[i % 4]);
    let mut c = s.chars();
    c.next().map(|f| f.to_uppercase().chain(c).collect()).unwrap_or_default()
}

pub(crate) fn rng_for(seed: u64, a: u64, b: u64, salt: u64) -> rand::rngs::StdRng {
    let mix =
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ a.wrapping_mul(0xBF58_476D_1CE4_E5B9) ^ b.rotate_left(32) ^ salt;
    rand::rngs::StdRng::seed_from_u64(mix)
}

/// The word-level vocabulary of the synthetic task: `<|endoftext|>` (0), `<unk>`, `?`, `.`,
/// then `k0…k{keys-1}` and `v0…v{values-1}`; words are split on whitespace.
pub fn synthetic_tokenizer(keys: usize, values: usize) -> tokenizers::Tokenizer {
    let mut vocab: HashMap<String, u32> = HashMap::new();
    for w in [EOS, UNK, QUERY, PAD] {
        let id = vocab.len() as u32;
        vocab.insert(w.to_string(), id);
    }
    for w in (0..keys).map(|i| format!("k{i}")).chain((0..values).map(|i| format!("v{i}"))) {
        let id = vocab.len() as u32;
        vocab.insert(w, id);
    }
    let model = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token(UNK.into())
        .build()
        .expect("a word-level vocabulary with its unknown token builds; this is a bug");
    let mut t = tokenizers::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::WhitespaceSplit));
    t.add_special_tokens(&[tokenizers::AddedToken::from(EOS, true)]);
    t
}

/// The fewest words [`training_text`] can fill with `max_k` contexts of `facts` facts (two
/// words each) and one query (three).
pub fn min_training_words(facts: usize, max_k: usize) -> usize {
    2 * facts * max_k + 3
}

/// Training sequence `index` of the synthetic task: k ∈ 1..=max_k contexts of facts back to
/// back, then queries `? key value` about them (each fact once before any repeats) until the
/// text is exactly `words` tokens (padded at the front with `.`). The trainer scores only the
/// answers ([`answer_mask`]).
pub fn training_text(task: &Task, seed: u64, index: usize, max_k: usize, words: usize) -> Result<String> {
    if task.form != Form::Synthetic {
        return Err(Error::Input("training sequences are generated for the synthetic form only".into()));
    }
    task.check(max_k)?;
    if max_k == 0 || min_training_words(task.facts, max_k) > words {
        return Err(Error::Input(format!(
            "a sequence of {words} tokens cannot hold {max_k} contexts of {} facts and a query; raise seq_len or lower max_k",
            task.facts
        )));
    }
    let mut rng = rng_for(seed, index as u64, max_k as u64, 0x7a1e);
    let k = rng.random_range(1..=max_k);
    let episode = task.episode(seed ^ 0x7a1e_7a1e, index, k, 1)?;
    let facts: Vec<Fact> = episode.contexts.concat();
    let n_queries = (words - 2 * facts.len()) / 3;
    let pad = words - 2 * facts.len() - 3 * n_queries;
    let mut out: Vec<String> = vec![PAD.to_string(); pad];
    out.extend(facts.iter().flat_map(|f| [task.key(f.key), task.value(f.value)]));
    let mut order: Vec<usize> = Vec::new();
    for _ in 0..n_queries {
        if order.is_empty() {
            order = (0..facts.len()).collect();
            order.shuffle(&mut rng);
        }
        let f = facts[order.pop().expect("refilled above")];
        out.extend([QUERY.to_string(), task.key(f.key), task.value(f.value)]);
    }
    Ok(out.join(" "))
}

/// Which targets of a token stream count: the value after each `? key` (the answers).
pub fn answer_mask(ids: &[u32], query: u32) -> Vec<bool> {
    (0..ids.len()).map(|j| j >= 2 && ids[j - 2] == query).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn synthetic() -> Task {
        Task { form: Form::Synthetic, facts: 4, keys: 64, values: 64 }
    }

    #[test]
    fn episodes_are_deterministic_by_seed_and_well_formed() {
        let t = synthetic();
        let a = t.episode(7, 3, 5, 10).unwrap();
        assert_eq!(a, t.episode(7, 3, 5, 10).unwrap());
        assert_ne!(a, t.episode(8, 3, 5, 10).unwrap());
        assert_ne!(a, t.episode(7, 4, 5, 10).unwrap());
        assert_eq!(a.contexts.len(), 5);
        assert!(a.contexts.iter().all(|c| c.len() == 4));
        let mut keys: Vec<usize> = a.contexts.iter().flatten().map(|f| f.key).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 20, "keys are distinct within an episode");
        // Ten queries over five contexts: every position asked twice.
        let mut per = [0; 5];
        for &(c, f) in &a.queries {
            per[c] += 1;
            assert!(f < 4);
        }
        assert_eq!(per, [2; 5]);
    }

    #[test]
    fn bad_sizes_are_refused_with_the_fix() {
        let t = synthetic();
        let e = t.episode(0, 0, 17, 1).unwrap_err().to_string();
        assert!(e.contains("68 distinct keys") && e.contains("64"), "{e}");
        let zero = Task { facts: 0, ..synthetic() };
        assert!(zero.episode(0, 0, 1, 1).unwrap_err().to_string().contains("0 facts"));
        assert!(t.episode(0, 0, 0, 1).is_err());
        assert!(t.episode(0, 0, 1, 0).is_err());
        assert!(training_text(&t, 0, 0, 8, 60).unwrap_err().to_string().contains("raise seq_len"));
    }

    #[test]
    fn synthetic_text_is_one_token_per_word() {
        let t = synthetic();
        let tok = synthetic_tokenizer(64, 64);
        let ep = t.episode(1, 0, 2, 1).unwrap();
        let ctx = t.context_text(&ep.contexts[0]);
        let ids = tok.encode(ctx.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(ids.len(), 8);
        let f = ep.contexts[0][2];
        assert_eq!(ids[4], tok.token_to_id(&format!("k{}", f.key)).unwrap());
        assert_eq!(ids[5], tok.token_to_id(&format!("v{}", f.value)).unwrap());
        let q = tok.encode(t.query_text(f.key).as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(q, vec![tok.token_to_id(QUERY).unwrap(), ids[4]]);
        let a = tok.encode(t.answer_text(f.value).as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(a, vec![ids[5]]);
        assert_eq!(tok.token_to_id(EOS), Some(0));
        let vocab = tok.get_vocab(true);
        assert_eq!(Task::synthetic_from_vocab(&vocab, 4).unwrap(), t);
        assert!(Task::synthetic_from_vocab(&HashMap::new(), 4).unwrap_err().to_string().contains("--form natural"));
    }

    #[test]
    fn training_text_has_the_exact_length_and_answers_its_queries() {
        let t = synthetic();
        let tok = synthetic_tokenizer(64, 64);
        let q = tok.token_to_id(QUERY).unwrap();
        for i in 0..20 {
            let text = training_text(&t, 5, i, 8, 127).unwrap();
            let ids = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
            assert_eq!(ids.len(), 127);
            assert!(!ids.contains(&tok.token_to_id(UNK).unwrap()));
            // Every answer is the value the key was given before the first query.
            let first_q = ids.iter().position(|&x| x == q).unwrap();
            let pad = tok.token_to_id(PAD).unwrap();
            let facts_from = ids.iter().position(|&x| x != pad).unwrap();
            assert!(facts_from < 3, "at most two pads");
            let facts = &ids[facts_from..first_q];
            assert_eq!(facts.len() % 2, 0);
            let given: HashMap<u32, u32> = facts.chunks(2).map(|c| (c[0], c[1])).collect();
            let mask = answer_mask(&ids, q);
            let answers: Vec<usize> = (0..ids.len()).filter(|&j| mask[j]).collect();
            assert!(!answers.is_empty());
            for j in answers {
                assert_eq!(given.get(&ids[j - 1]), Some(&ids[j]), "sequence {i} position {j}");
            }
        }
        assert_eq!(training_text(&t, 5, 3, 8, 127).unwrap(), training_text(&t, 5, 3, 8, 127).unwrap());
    }

    #[test]
    fn natural_names_are_distinct_words() {
        let names: Vec<String> = (0..5000).map(name).collect();
        let mut sorted = names.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 5000);
        assert!(names.iter().all(|n| n.chars().all(char::is_alphabetic) && n.chars().next().unwrap().is_uppercase()));
        let t = Task { form: Form::Natural, facts: 2, keys: 1000, values: 9000 };
        let ep = t.episode(0, 0, 1, 1).unwrap();
        let text = t.context_text(&ep.contexts[0]);
        assert!(text.starts_with("The code of ") && text.ends_with(".\n\n"), "{text}");
        assert!(t.answer_text(0) == " 1000" && t.answer_text(8999) == " 9999");
        assert!(Task { values: 9001, ..t }.check(1).is_err());
    }

    #[test]
    fn distractors_are_distinct_and_exclude_the_answer() {
        let t = synthetic();
        let ep = t.episode(2, 0, 3, 1).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        for n in [0, 3, 11, 40] {
            let v = ep.contexts[0][0].value;
            let d = t.distractors(&ep, v, n, &mut rng);
            assert_eq!(d.len(), n);
            assert!(!d.contains(&v));
            let mut s = d.clone();
            s.sort_unstable();
            s.dedup();
            assert_eq!(s.len(), n);
        }
    }
}
