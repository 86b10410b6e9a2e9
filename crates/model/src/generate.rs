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
    /// Keep going past the end-of-text token (benchmarks that need exactly `max_tokens`).
    pub ignore_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self { max_tokens: 64, temperature: 0.0, top_p: 1.0, seed: 0, stop: Vec::new(), ignore_eos: false }
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
    let argmax = || argmax(logits);
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

/// Lanes of the vectorised scans below: independent accumulators the compiler keeps in
/// vector registers (a scalar fold over 50,000 logits is one dependent chain, ~30 µs a token).
const LANES: usize = 16;

/// The first index of the largest value, ignoring NaN; 0 when no value exceeds -∞. Greedy
/// decoding's pick: the maxima of 16 lanes, then the first place that holds their maximum.
fn argmax(v: &[f32]) -> usize {
    let pick = |m: f32, x: f32| if x > m { x } else { m };
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = pick(*m, x);
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &x| pick(m, x));
    if max == f32::NEG_INFINITY {
        return 0;
    }
    first_where(v, |x| x == max).unwrap_or(0)
}

/// The index of the first value that is not finite (NaN or ±∞).
fn first_non_finite(v: &[f32]) -> Option<usize> {
    first_where(v, |x| x.to_bits() & 0x7f80_0000 == 0x7f80_0000)
}

/// The first index where `hit` holds, testing blocks of values without branching (so the
/// test vectorises) and searching only the block that has one.
fn first_where(v: &[f32], hit: impl Fn(f32) -> bool) -> Option<usize> {
    const BLOCK: usize = 4 * LANES;
    v.chunks(BLOCK)
        .position(|block| block.iter().fold(false, |any, &x| any | hit(x)))
        .and_then(|b| v[b * BLOCK..].iter().position(|&x| hit(x)).map(|i| b * BLOCK + i))
}

/// What [`Decoder::push`] made of one set of next-token logits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// A token was picked: feed it to the model and push the logits after it. `text` is the
    /// new text that is final (possibly empty: held back while it could become a stop string).
    Feed {
        /// The token to feed.
        token: u32,
        /// New final text.
        text: String,
    },
    /// Generation ended; `text` is the rest of the output.
    Done {
        /// The rest of the text.
        text: String,
        /// Why it ended.
        reason: StopReason,
        /// A generated token the model has not yet seen (its state lags `tokens` by it).
        unfed: Option<u32>,
    },
}

/// The sampling side of generation, one token at a time: given the next-token logits, picks
/// the token, decodes it, watches for EOS, stop strings and the token budget. The model side
/// is the caller's, so one request can run alone ([`generate`]) or in a batch with others
/// (the server) and pick the same tokens.
pub struct Decoder<'m> {
    tokenizer: &'m crate::tokenizer::TextTokenizer,
    vocab: usize,
    opts: GenerateOptions,
    rng: StdRng,
    tokens: Vec<u32>,
    text: String,
    incremental: IncrementalDecoder,
    /// Bytes of `text` already returned.
    emitted: usize,
    /// Longest stop string: text that could still become one is held back.
    hold: usize,
}

impl<'m> Decoder<'m> {
    /// A decoder for `model`'s vocabulary; checks `opts`.
    pub fn new(model: &'m Model, opts: &GenerateOptions) -> Result<Self> {
        opts.validate()?;
        let tokenizer = model.tokenizer()?;
        Ok(Self {
            tokenizer,
            vocab: tokenizer.vocab_size().min(model.config().vocab_size()),
            rng: StdRng::seed_from_u64(opts.seed),
            hold: opts.stop.iter().map(String::len).max().unwrap_or(0),
            opts: opts.clone(),
            tokens: Vec::new(),
            text: String::new(),
            incremental: IncrementalDecoder::default(),
            emitted: 0,
        })
    }

    /// The tokens generated so far (a stop string's tokens included, the EOS token not).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The text generated so far, cut before any stop string once one is found.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Takes the logits after the last fed token and says what comes next.
    pub fn push(&mut self, logits: &[f32]) -> Result<Next> {
        if self.tokens.len() >= self.opts.max_tokens {
            return Ok(self.done(StopReason::Length, None));
        }
        if let Some(i) = first_non_finite(&logits[..self.vocab.min(logits.len())]) {
            return Err(Error::state(format!(
                "the logits after {} generated tokens are not finite ({} for token id {i}): the state \
                 diverged (a state held as f16 does this beyond ±65,504: decode with f32 states)",
                self.tokens.len(),
                logits[i]
            )));
        }
        let next = sample(logits, self.vocab, &self.opts, &mut self.rng);
        if Some(next) == self.tokenizer.eos() && !self.opts.ignore_eos {
            return Ok(self.done(StopReason::Eos, None));
        }
        self.tokens.push(next);
        let searched_from = floor_char_boundary(&self.text, self.text.len().saturating_sub(self.hold));
        let piece = self.incremental.next_piece(self.tokenizer, &self.tokens)?;
        self.text.push_str(&piece);
        if let Some(cut) = self.opts.stop.iter().filter_map(|s| self.text[searched_from..].find(s.as_str())).min() {
            self.text.truncate(searched_from + cut);
            return Ok(self.done(StopReason::Stop, Some(next)));
        }
        if self.tokens.len() == self.opts.max_tokens {
            return Ok(self.done(StopReason::Length, Some(next)));
        }
        // Hold back text that could still become a stop string.
        let safe = floor_char_boundary(&self.text, self.text.len().saturating_sub(self.hold));
        let text = self.text[self.emitted..safe.max(self.emitted)].to_string();
        self.emitted = safe.max(self.emitted);
        Ok(Next::Feed { token: next, text })
    }

    /// Ends generation: everything not yet returned.
    fn done(&mut self, reason: StopReason, unfed: Option<u32>) -> Next {
        let text = self.text[self.emitted.min(self.text.len())..].to_string();
        self.emitted = self.text.len();
        Next::Done { text, reason, unfed }
    }
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
    let mut decoder = Decoder::new(model, opts)?;
    let (mut logits, mut state) = model.prefill_last_logits(prompt, state)?;
    let stop_reason = loop {
        match decoder.push(&logits)? {
            Next::Feed { token, text } => {
                let go_on = text.is_empty() || on_text(&text);
                // One step keeps `state` consistent with the tokens, even when stopping here.
                let after = model.step(token, &mut state)?;
                if !go_on {
                    break StopReason::Cancelled;
                }
                logits = after;
            }
            Next::Done { text, reason, unfed } => {
                if let Some(token) = unfed {
                    model.step(token, &mut state)?;
                }
                if !text.is_empty() {
                    on_text(&text);
                }
                break reason;
            }
        }
    };
    let (tokens, mut text) = (decoder.tokens, decoder.text);
    if stop_reason == StopReason::Cancelled {
        text.truncate(decoder.emitted);
    }
    Ok(Generation { tokens, text, stop_reason, state })
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The plain scalar argmax the vectorised one replaces: first index of the largest value.
    fn argmax_scalar(v: &[f32]) -> usize {
        v.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0
    }

    /// Values from a small set, so that ties, ±0, infinities and NaN all occur.
    fn value() -> impl Strategy<Value = f32> {
        prop_oneof![
            8 => (-4i32..4).prop_map(|i| i as f32 * 0.5),
            1 => Just(-0.0f32),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
            1 => Just(f32::NAN),
        ]
    }

    proptest! {
        #[test]
        fn argmax_and_the_finite_check_agree_with_scalar_scans(v in prop::collection::vec(value(), 0..300)) {
            prop_assert_eq!(argmax(&v), argmax_scalar(&v));
            prop_assert_eq!(first_non_finite(&v), v.iter().position(|x| !x.is_finite()));
        }

        #[test]
        fn argmax_of_finite_logits_is_the_scalar_one(v in prop::collection::vec(-30.0f32..30.0, 1..2000)) {
            prop_assert_eq!(argmax(&v), argmax_scalar(&v));
            prop_assert_eq!(first_non_finite(&v), None);
        }
    }
}
