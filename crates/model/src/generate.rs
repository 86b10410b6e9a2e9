//! Sampling and the generation loop: greedy, temperature, nucleus (top-p), seeded, with stop
//! strings and a token budget. Generation starts from any state, composed ones included.

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::cpu::softmax::max_ignoring_nan;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::state::State;
use vectorised::softmax_weights;

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
    /// New text, cut before any stop string (empty for a model without a tokenizer).
    pub text: String,
    /// Why it ended.
    pub stop_reason: StopReason,
    /// The state after the prompt and all generated tokens.
    pub state: State,
}

/// Picks a token id from logits restricted to the first `vocab` entries: the largest at
/// temperature 0, else a draw from softmax(logits / temperature), cut to the nucleus when
/// `top_p` < 1 (one draw of `rng` per sampled pick).
pub fn sample(logits: &[f32], vocab: usize, opts: &GenerateOptions, rng: &mut StdRng) -> u32 {
    let logits = &logits[..vocab.min(logits.len())];
    if opts.temperature == 0.0 {
        return argmax(logits) as u32;
    }
    let max = max_ignoring_nan(logits);
    if max == f32::NEG_INFINITY {
        return argmax(logits) as u32;
    }
    let mut w = vec![0.0f32; logits.len()];
    let sums = softmax_weights(logits, max, opts.temperature, &mut w);
    let u = rng.random::<f64>();
    if opts.top_p < 1.0 {
        let total: f64 = sums.iter().sum();
        let kept = nucleus(&w, total, opts.top_p);
        let mass: f64 = kept.iter().map(|&i| w[i as usize] as f64).sum();
        return draw(kept.iter().map(|&i| (i as usize, w[i as usize])), u * mass)
            .or(kept.last().map(|&i| i as usize))
            .unwrap_or_else(|| argmax(logits)) as u32;
    }
    // The block that holds the draw, by the blocks' sums, then the token within it.
    let mut u = u * sums.iter().sum::<f64>();
    for (b, &sum) in sums.iter().enumerate() {
        if u < sum {
            let start = b * SUM_BLOCK;
            let block = &w[start..(start + SUM_BLOCK).min(w.len())];
            let last = block.iter().rposition(|&p| p > 0.0).unwrap_or(0);
            return (start + draw(block.iter().copied().enumerate(), u).unwrap_or(last)) as u32;
        }
        u -= sum;
    }
    w.iter().rposition(|&p| p > 0.0).unwrap_or_else(|| argmax(logits)) as u32
}

/// Weights summed per block, so that a draw walks one block instead of the whole vocabulary.
const SUM_BLOCK: usize = 1024;

/// The first of `weights` (index, weight) where `u`, less the weights before it, falls below
/// its weight; None when rounding leaves `u` past them all.
fn draw(weights: impl Iterator<Item = (usize, f32)>, mut u: f64) -> Option<usize> {
    for (i, p) in weights {
        let p = p as f64;
        if u < p {
            return Some(i);
        }
        u -= p;
    }
    None
}

/// Loops compiled for the CPU's vector instructions (a module of their own: `simd_fn!` makes
/// public functions, which are not part of this crate's API).
mod vectorised {
    use super::{LANES, SUM_BLOCK};

    picaso_compose::simd_fn! {
        /// w[i] = e^((v[i] − max) / t) (the largest is exactly 1); returns the sum of each
        /// [`SUM_BLOCK`] of weights, in f64. Vectorised (an f32 exp of ~2 ulp, 16 lanes of sums)
        /// and compiled for the CPU's vector instructions: the exp rounds with `floor`, a library
        /// call per value without SSE4.1.
        pub fn softmax_weights(v: &[f32], max: f32, t: f32, w: &mut [f32]) -> Vec<f64> {
            // Plain loops: iterator adapters would be compiled apart from this function, without
            // its instruction set.
            use crate::cpu::activations::exp;
            let mut sums = Vec::with_capacity(v.len().div_ceil(SUM_BLOCK));
            let mut start = 0;
            while start < v.len() {
                let end = (start + SUM_BLOCK).min(v.len());
                let mut lanes = [0.0f64; LANES];
                let mut i = start;
                while i + LANES <= end {
                    let x: &[f32; LANES] = v[i..i + LANES].try_into().expect("a whole chunk");
                    let y: &mut [f32; LANES] = (&mut w[i..i + LANES]).try_into().expect("a whole chunk");
                    for j in 0..LANES {
                        y[j] = exp((x[j] - max) / t);
                        lanes[j] += y[j] as f64;
                    }
                    i += LANES;
                }
                let mut sum = 0.0;
                for lane in lanes {
                    sum += lane;
                }
                for j in i..end {
                    w[j] = exp((v[j] - max) / t);
                    sum += w[j] as f64;
                }
                sums.push(sum);
                start = end;
            }
            sums
        }
    }
}

/// The nucleus: the fewest tokens, most probable first (ties by index), whose probability
/// `w / total` adds up to `top_p`. Only tokens of weight ≥ τ are sorted, for falling τ until
/// they hold the nucleus: every token left out weighs less than every token sorted, so the
/// order the nucleus is cut from is the full sort's.
fn nucleus(w: &[f32], total: f64, top_p: f32) -> Vec<u32> {
    for tau in [1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0, 1.0 / 65536.0, 1.0 / 16_777_216.0, 0.0f32] {
        // One integer per token that sorts as (weight descending, index ascending): weights are
        // ≥ 0, so their bits order as they do.
        let mut keys: Vec<u64> = (0..w.len() as u32)
            .filter(|&i| w[i as usize] >= tau)
            .map(|i| (w[i as usize].to_bits() as u64) << 32 | !i as u64)
            .collect();
        keys.sort_unstable_by(|a, b| b.cmp(a));
        let index = |key: u64| !(key as u32);
        let mut acc = 0.0;
        for (n, &key) in keys.iter().enumerate() {
            acc += w[index(key) as usize] as f64 / total;
            if acc >= top_p as f64 {
                return keys[..=n].iter().map(|&k| index(k)).collect();
            }
        }
        if tau == 0.0 {
            return keys.iter().map(|&k| index(k)).collect();
        }
    }
    unreachable!("the last threshold keeps every token")
}

/// Lanes of the vectorised scans: independent accumulators the compiler keeps in vector
/// registers (a scalar fold over 50,000 logits is one dependent chain, ~30 µs a token).
const LANES: usize = 16;

/// The first index of the largest value, ignoring NaN; 0 when no value exceeds -∞. Greedy
/// decoding's pick: the maxima of 16 lanes, then the first place that holds their maximum.
pub(crate) fn argmax(v: &[f32]) -> usize {
    let max = max_ignoring_nan(v);
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
    /// None for a model without a tokenizer: token ids only (no text, EOS or stop strings).
    tokenizer: Option<&'m crate::tokenizer::TextTokenizer>,
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
    /// A decoder for `model`'s vocabulary; checks `opts`. A model without a tokenizer generates
    /// token ids only (empty text, no EOS): stop strings then need one.
    pub fn new(model: &'m Model, opts: &GenerateOptions) -> Result<Self> {
        opts.validate()?;
        let tokenizer = match model.tokenizer() {
            Ok(t) => Some(t),
            Err(e) if !opts.stop.is_empty() => {
                return Err(Error::Input(format!("stop strings are matched in text, which needs a tokenizer: {e}")))
            }
            Err(_) => None,
        };
        Ok(Self {
            tokenizer,
            vocab: tokenizer.map_or(usize::MAX, |t| t.vocab_size()).min(model.config().vocab_size()),
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
        if next_is_eos(self.tokenizer, next) && !self.opts.ignore_eos {
            return Ok(self.done(StopReason::Eos, None));
        }
        self.tokens.push(next);
        let searched_from = floor_char_boundary(&self.text, self.text.len().saturating_sub(self.hold));
        let piece = match self.tokenizer {
            Some(t) => self.incremental.next_piece(t, &self.tokens)?,
            None => String::new(),
        };
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
    let (mut logits, state) = model.prefill_last_logits(prompt, state)?;
    // The state stays where the engine computes (a GPU's memory) until the end.
    let mut session = model.session(vec![state])?;
    let stop_reason = loop {
        match decoder.push(&logits)? {
            Next::Feed { token, text } => {
                let go_on = text.is_empty() || on_text(&text);
                // One step keeps the state consistent with the tokens, even when stopping here.
                let after = session.step(&[token])?;
                if !go_on {
                    break StopReason::Cancelled;
                }
                logits = after;
            }
            Next::Done { text, reason, unfed } => {
                if let Some(token) = unfed {
                    session.step(&[token])?;
                }
                if !text.is_empty() {
                    on_text(&text);
                }
                break reason;
            }
        }
    };
    let state = session.into_states()?.pop().expect("a session of one sequence");
    let (tokens, mut text) = (decoder.tokens, decoder.text);
    if stop_reason == StopReason::Cancelled {
        text.truncate(decoder.emitted);
    }
    Ok(Generation { tokens, text, stop_reason, state })
}

/// Whether `token` is the tokenizer's end of text (never without a tokenizer).
fn next_is_eos(tokenizer: Option<&crate::tokenizer::TextTokenizer>, token: u32) -> bool {
    tokenizer.and_then(|t| t.eos()) == Some(token)
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

    /// The nucleus by brute force: every token sorted (most probable first, ties by index),
    /// cut where the probability reaches `top_p`.
    fn nucleus_by_full_sort(w: &[f32], total: f64, top_p: f32) -> Vec<u32> {
        let mut all: Vec<u32> = (0..w.len() as u32).collect();
        all.sort_by(|&a, &b| w[b as usize].total_cmp(&w[a as usize]).then(a.cmp(&b)));
        let mut acc = 0.0;
        let keep = all.iter().position(|&i| {
            acc += w[i as usize] as f64 / total;
            acc >= top_p as f64
        });
        all.truncate(keep.map_or(all.len(), |k| k + 1));
        all
    }

    #[test]
    fn weights_are_the_softmax_numerators_and_sums_add_them() {
        let logits: Vec<f32> = (0..2500).map(|i| ((i * 7919) % 1009) as f32 / 37.0 - 20.0).collect();
        let (max, t) = (max_ignoring_nan(&logits), 0.7f32);
        let mut w = vec![0.0; logits.len()];
        let sums = softmax_weights(&logits, max, t, &mut w);
        assert_eq!(sums.len(), 3);
        for (x, &got) in logits.iter().zip(&w) {
            let want = (((x - max) / t) as f64).exp();
            assert!((got as f64 - want).abs() <= 4e-7 * want + 1e-38, "{x}: {got} vs {want}");
        }
        for (b, sum) in sums.iter().enumerate() {
            let want: f64 = w[b * SUM_BLOCK..((b + 1) * SUM_BLOCK).min(w.len())].iter().map(|&p| p as f64).sum();
            assert!((sum - want).abs() <= 1e-12 * want, "block {b}");
        }
        assert_eq!(w.iter().copied().fold(0.0f32, f32::max), 1.0, "the largest weight is exactly 1");
    }

    /// Draws many tokens and compares their frequencies with the probabilities (5 standard
    /// deviations; seeded, so it does not flake).
    fn frequencies_match(logits: &[f32], opts: &GenerateOptions, want: &[(usize, f64)]) {
        let draws = 200_000;
        let mut rng = StdRng::seed_from_u64(opts.seed);
        let mut count = vec![0usize; logits.len()];
        for _ in 0..draws {
            count[sample(logits, logits.len(), opts, &mut rng) as usize] += 1;
        }
        let listed: usize = want.iter().map(|&(i, _)| count[i]).sum();
        for &(i, p) in want {
            let sd = (draws as f64 * p * (1.0 - p)).sqrt();
            let diff = (count[i] as f64 - draws as f64 * p).abs();
            assert!(diff <= 5.0 * sd + 1.0, "token {i}: {} draws, expected {:.0}", count[i], draws as f64 * p);
        }
        if want.iter().map(|w| w.1).sum::<f64>() > 1.0 - 1e-9 {
            assert_eq!(listed, draws, "tokens outside the support were drawn");
        }
    }

    #[test]
    fn temperature_draws_follow_the_softmax_across_blocks() {
        // 3,000 tokens (three blocks of sums), four likely ones in different blocks.
        let mut logits = vec![-30.0f32; 3000];
        for (i, v) in [(5, 2.0), (1500, 1.0), (2047, 1.5), (2999, 0.0)] {
            logits[i] = v;
        }
        let t = 0.8f32;
        let z: f64 = logits.iter().map(|&x| ((x as f64 - 2.0) / t as f64).exp()).sum();
        let want: Vec<(usize, f64)> =
            [5, 1500, 2047, 2999].iter().map(|&i| (i, ((logits[i] as f64 - 2.0) / t as f64).exp() / z)).collect();
        frequencies_match(&logits, &GenerateOptions { temperature: t, seed: 3, ..Default::default() }, &want);
    }

    #[test]
    fn nucleus_draws_stay_in_the_nucleus_in_proportion() {
        // Probabilities ∝ 8, 4, 2, 1, 1 (ties), then a long tail: top_p 0.8 keeps the first
        // three (8 + 4 + 2 of 16 + tail); their shares are 8 : 4 : 2.
        let mut logits = vec![-40.0f32; 5000];
        for (i, v) in [(4000, 3.0), (10, 2.0), (2500, 1.0), (7, 0.0), (3, 0.0)] {
            logits[i] = v * std::f32::consts::LN_2;
        }
        let want = [(4000, 8.0 / 14.0), (10, 4.0 / 14.0), (2500, 2.0 / 14.0)];
        frequencies_match(
            &logits,
            &GenerateOptions { temperature: 1.0, top_p: 0.8, seed: 5, ..Default::default() },
            &want,
        );
    }

    proptest! {
        #[test]
        fn the_nucleus_is_the_full_sorts(
            w in prop::collection::vec(prop_oneof![3 => 0.0f32..1.0, 1 => Just(0.5f32), 1 => Just(0.0f32)], 1..400),
            top_p in 0.01f32..1.0,
        ) {
            let total: f64 = w.iter().map(|&p| p as f64).sum();
            prop_assume!(total > 0.0);
            prop_assert_eq!(nucleus(&w, total, top_p), nucleus_by_full_sort(&w, total, top_p));
        }

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
