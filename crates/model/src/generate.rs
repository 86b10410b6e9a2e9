//! Sampling and the generation loop: greedy, temperature, nucleus (top-p), seeded, with stop
//! strings and a token budget. Generation starts from any state, composed ones included.

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::model::Model;
use crate::state::State;

/// How to pick tokens.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Most new tokens.
    pub max_tokens: usize,
    /// 0 means greedy; otherwise logits are divided by it before the softmax.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`.
    pub top_p: f32,
    /// Seed of the sampler (generation is reproducible for a given seed).
    pub seed: u64,
    /// Stop when the generated text contains one of these (the stop string is not returned).
    pub stop: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_tokens: 64, temperature: 0.0, top_p: 1.0, seed: 0, stop: Vec::new() }
    }
}

impl GenerateOptions {
    /// Rejects meaningless settings.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::Input(format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::Input("stop strings must not be empty".into()));
        }
        Ok(())
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// `max_tokens` reached.
    Length,
    /// The end-of-text token.
    Eos,
    /// A stop string appeared.
    Stop,
    /// The caller stopped it (`on_text` returned false: a client went away).
    Cancelled,
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    /// New token ids (a stop string's tokens included, the EOS token not).
    pub tokens: Vec<u32>,
    /// New text, cut before any stop string.
    pub text: String,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// The state after the prompt and all generated tokens.
    pub state: State,
}

/// Picks a token id from logits restricted to the first `vocab` entries.
pub fn sample(logits: &[f32], vocab: usize, opts: &GenerateOptions, rng: &mut StdRng) -> u32 {
    let logits = &logits[..vocab.min(logits.len())];
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &v)| if v > best.1 { (i, v) } else { best })
            .0
    };
    if opts.temperature == 0.0 {
        return argmax() as u32;
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(usize, f64)> =
        logits.iter().enumerate().map(|(i, &v)| (i, (((v - max) / opts.temperature) as f64).exp())).collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    if opts.top_p < 1.0 {
        probs.sort_unstable_by(|a, b| b.1.total_cmp(&a.1));
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            acc += p.1 / total;
            if acc >= opts.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let mass: f64 = probs.iter().map(|p| p.1).sum();
    let mut u = rng.random::<f64>() * mass;
    for &(i, p) in &probs {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    probs.last().map(|p| p.0 as u32).unwrap_or_else(|| argmax() as u32)
}

/// Continues `prompt` (at least one token) from `state` and samples up to `max_tokens` tokens,
/// calling `on_text` with each new piece of text as soon as it is final. `on_text` returns
/// whether to go on: false stops generation at once (no further model work).
pub fn generate(
    model: &Model,
    prompt: &[u32],
    state: &State,
    opts: &GenerateOptions,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    opts.validate()?;
    let tokenizer = model.tokenizer()?;
    let vocab = tokenizer.vocab_size().min(model.config().vocab_size());
    let (mut logits, mut state) = model.prefill_last_logits(prompt, state)?;
    let mut rng = StdRng::seed_from_u64(opts.seed);
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut decoder = IncrementalDecoder::default();
    let mut emitted = 0usize; // bytes of `text` already passed to on_text
    let hold = opts.stop.iter().map(String::len).max().unwrap_or(0);
    let mut reason = StopReason::Length;
    while tokens.len() < opts.max_tokens {
        let next = sample(&logits, vocab, opts, &mut rng);
        if Some(next) == tokenizer.eos() {
            reason = StopReason::Eos;
            break;
        }
        tokens.push(next);
        let searched_from = floor_char_boundary(&text, text.len().saturating_sub(hold));
        text.push_str(&decoder.next_piece(tokenizer, &tokens)?);
        if let Some(cut) = opts.stop.iter().filter_map(|s| text[searched_from..].find(s.as_str())).min() {
            text.truncate(searched_from + cut);
            reason = StopReason::Stop;
            break;
        }
        // Hold back text that could still become a stop string.
        let safe = floor_char_boundary(&text, text.len().saturating_sub(hold));
        if safe > emitted {
            let go_on = on_text(&text[emitted..safe]);
            emitted = safe;
            if !go_on {
                // One last step keeps `state` consistent with `tokens`; then no more work.
                model.step(next, &mut state)?;
                text.truncate(emitted);
                reason = StopReason::Cancelled;
                break;
            }
        }
        if tokens.len() < opts.max_tokens {
            logits = model.step(next, &mut state)?;
        } else {
            // Keep the returned state consistent with all generated tokens.
            model.step(next, &mut state)?;
        }
    }
    if text.len() > emitted && reason != StopReason::Cancelled {
        on_text(&text[emitted..]);
    }
    Ok(Generation { tokens, text, stop_reason: reason, state })
}

/// The largest char boundary of `s` at or below `i`.
fn floor_char_boundary(s: &str, i: usize) -> usize {
    (0..=i.min(s.len())).rev().find(|&j| s.is_char_boundary(j)).unwrap_or(0)
}

/// Turns a growing token sequence into text pieces in constant time per token: it decodes only
/// the tokens since the last complete piece (plus a few before, for the tokenizer's spacing
/// rules), and waits while the tail is an incomplete UTF-8 character.
#[derive(Default)]
struct IncrementalDecoder {
    /// Start of the tokens re-decoded for context.
    prefix: usize,
    /// Tokens before this are already in the text.
    read: usize,
}

impl IncrementalDecoder {
    fn next_piece(&mut self, tokenizer: &crate::tokenizer::TextTokenizer, tokens: &[u32]) -> Result<String> {
        let before = tokenizer.decode(&tokens[self.prefix..self.read])?;
        let now = tokenizer.decode(&tokens[self.prefix..])?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') || !now.starts_with(&before) {
            return Ok(String::new());
        }
        self.prefix = self.read;
        self.read = tokens.len();
        Ok(now[before.len()..].to_string())
    }
}
