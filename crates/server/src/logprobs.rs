//! Token log-probabilities as OpenAI's legacy completions API reports them (`logprobs: N`):
//! each position's token, its log-probability and the N most likely tokens there. Evaluation
//! harnesses score a text with these (`echo` + `logprobs`: the prompt's own tokens), so the
//! numbers must be what `picaso score` computes: a log-softmax over the whole row of logits,
//! accumulated in f64.

use picaso_model::{Model, State, TextTokenizer};

use crate::api::{Logprobs, TopLogprobs};
use crate::error::ApiError;

/// Most alternatives a request may ask for per position (OpenAI's and vLLM's cap).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Prompt tokens scored per forward pass: the logits of a pass are `tokens × vocab` floats, so a
/// long prompt is scored a chunk at a time (256 × 50k vocab = 51 MB) instead of all at once.
const SCORE_CHUNK: usize = 256;

/// One position: the token there, its log-probability and the most likely tokens.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Position {
    /// The token at this position.
    pub token: u32,
    /// log p(token | everything before it).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, likeliest first.
    pub top: Vec<(u32, f32)>,
}

/// log-softmax of `row` at `token`, with the `top_n` likeliest of the first `vocab` ids (ids
/// past the tokenizer's vocabulary are padding and have no text to show). Non-finite logits
/// never enter the top list.
pub(crate) fn position(row: &[f32], token: u32, top_n: usize, vocab: usize) -> Position {
    let max = row.iter().copied().filter(|x| x.is_finite()).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().filter(|x| x.is_finite()).map(|&x| f64::from(x - max).exp()).sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |x: f32| (f64::from(x) - lse) as f32;
    let logprob = row.get(token as usize).map_or(f32::NEG_INFINITY, |&x| lp(x));
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(top_n + 1);
    if top_n > 0 {
        for (id, &x) in row.iter().enumerate().take(vocab) {
            if !x.is_finite() || (top.len() == top_n && x <= top[top_n - 1].1) {
                continue;
            }
            let at = top.partition_point(|&(_, y)| y >= x);
            top.insert(at, (id as u32, x));
            top.truncate(top_n);
        }
    }
    Position { token, logprob, top: top.into_iter().map(|(id, x)| (id, lp(x))).collect() }
}

/// The log-probabilities of every prompt token after the first, scored from `state`:
/// `positions[i]` is token `i + 1`'s. Returns them and the state after every token but the
/// last, from which generation goes on by feeding the last one (so the prompt is processed
/// once, whether or not the request also generates). Blocking: a forward pass per
/// [`SCORE_CHUNK`] tokens.
pub(crate) fn score_prompt(
    model: &Model,
    prompt: &[u32],
    state: State,
    top_n: usize,
) -> Result<(Vec<Position>, State), ApiError> {
    let vocab = model.tokenizer().map_or(usize::MAX, TextTokenizer::vocab_size);
    let context = &prompt[..prompt.len().saturating_sub(1)];
    let mut positions = Vec::with_capacity(context.len());
    let mut state = state;
    for (c, chunk) in context.chunks(SCORE_CHUNK).enumerate() {
        let (logits, next) = model.forward_all_logits(chunk, &state)?;
        state = next;
        let width = logits.len() / chunk.len().max(1);
        for (i, row) in logits.chunks_exact(width.max(1)).enumerate() {
            let target = prompt[c * SCORE_CHUNK + i + 1];
            positions.push(position(row, target, top_n, vocab));
        }
    }
    Ok((positions, state))
}

/// The text a token shows in `tokens` and `top_logprobs`: its own decoding, special tokens
/// included (an end-of-text token shows as itself, not as nothing).
pub(crate) fn token_text(tokenizer: &TextTokenizer, id: u32) -> String {
    tokenizer.inner().decode(&[id], false).unwrap_or_default()
}

/// Builds `choices[].logprobs` piece by piece: echoed prompt tokens (the first without a
/// log-probability, as OpenAI sends it), then generated ones. `text_offset` counts characters
/// from the start of the choice's text.
pub(crate) struct LogprobsBuilder<'t> {
    tokenizer: &'t TextTokenizer,
    offset: usize,
}

impl<'t> LogprobsBuilder<'t> {
    /// Offsets start at `offset` characters (a stream's later chunks go on from the earlier).
    pub fn new(tokenizer: &'t TextTokenizer, offset: usize) -> Self {
        Self { tokenizer, offset }
    }

    /// Characters so far.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Appends the first prompt token: no log-probability, no alternatives.
    pub fn push_first(&mut self, out: &mut Logprobs, token: u32) {
        let text = token_text(self.tokenizer, token);
        out.text_offset.push(self.offset);
        self.offset += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(None);
        out.top_logprobs.push(None);
    }

    /// Appends a scored position.
    pub fn push(&mut self, out: &mut Logprobs, p: &Position) {
        let text = token_text(self.tokenizer, p.token);
        let mut top: Vec<(String, f32)> = Vec::with_capacity(p.top.len() + 1);
        for &(id, lp) in p.top.iter().chain((!p.top.iter().any(|t| t.0 == p.token)).then_some(&(p.token, p.logprob))) {
            let key = if id == p.token { text.clone() } else { token_text(self.tokenizer, id) };
            if !top.iter().any(|(k, _)| *k == key) {
                top.push((key, lp));
            }
        }
        out.text_offset.push(self.offset);
        self.offset += text.chars().count();
        out.tokens.push(text);
        out.token_logprobs.push(Some(p.logprob));
        out.top_logprobs.push(Some(TopLogprobs(top)));
    }
}

#[cfg(test)]
mod tests {
    use super::position;

    /// The log-probabilities are a log-softmax (they exponentiate to 1), the top list is the
    /// likeliest tokens in order, and a token's own log-probability is the one in the list.
    #[test]
    fn a_position_is_a_log_softmax_with_the_likeliest_tokens() {
        let row = [1.0f32, 3.0, -2.0, 3.5, 0.0];
        let p = position(&row, 1, 3, row.len());
        let total: f64 = row.iter().map(|&x| f64::from(position(&row, 0, 0, 5).logprob - 1.0 + x).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
        assert_eq!(p.top.iter().map(|t| t.0).collect::<Vec<_>>(), [3, 1, 0]);
        assert_eq!(p.top[1].1, p.logprob);
        assert!((p.top[0].1 - p.logprob - 0.5).abs() < 1e-6);
    }

    /// Ids past the tokenizer's vocabulary (padding) and non-finite logits are never listed;
    /// zero alternatives lists none.
    #[test]
    fn padding_and_non_finite_logits_are_not_listed() {
        let row = [0.0f32, f32::NAN, 1.0, 9.0];
        let p = position(&row, 0, 4, 3);
        assert_eq!(p.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 0]);
        assert!(position(&row, 0, 0, 3).top.is_empty());
    }
}
