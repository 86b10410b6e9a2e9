//! Which of the contexts behind an answer does it come from? Each context is left out in turn,
//! the others are combined again by the same method, and the answer is scored after the prompt
//! from that state: the log-likelihood the answer loses without a context is what it owes to
//! it. With a composed method every leave-one-out state is arithmetic on the stored states, no
//! model work for the contexts (the paper's case for attributing with composed states); with
//! concat each one processes the other contexts' tokens again. The answer is scored from
//! several states in each forward pass.

use std::time::Instant;

use picaso_model::{compose_views, Model, State, StateView};

use crate::cache::StateCache;
use crate::error::{Error, Result};
use crate::store::Store;
use picaso_model::Method;

/// The answer's log-likelihood with every context and with each left out.
#[derive(Debug, Clone)]
pub struct Attribution {
    /// How the contexts were combined.
    pub method: Method,
    /// The answer's log-likelihood after the prompt (nats, summed over its tokens), from the
    /// state of all the contexts.
    pub loglik: f64,
    /// Per context, in the order given: the answer's log-likelihood with that context left out.
    pub without: Vec<f64>,
    /// Tokens in the answer.
    pub answer_tokens: usize,
    /// Seconds for the whole attribution (states, compositions and k + 1 scorings).
    pub seconds: f64,
}

impl Attribution {
    /// What the answer owes to context `i`: the log-likelihood it loses when `i` is left out
    /// (nats; negative when the answer is likelier without it).
    pub fn drop(&self, i: usize) -> f64 {
        self.loglik - self.without[i]
    }

    /// The contexts' positions, the one whose removal costs the answer most first (ties in the
    /// order given).
    pub fn ranking(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.without.len()).collect();
        order.sort_by(|&a, &b| self.drop(b).total_cmp(&self.drop(a)));
        order
    }
}

/// Attributes `answer`, continuing `prompt`, to the contexts `ids` (in composition order, the
/// last nearest the prompt) combined by `method`: k + 1 states (all contexts, then each left
/// out), each scored on the answer. States are read once, through `cache` when one is given.
pub fn attribute(
    store: &Store,
    model: &Model,
    ids: &[i64],
    method: Method,
    prompt: &[u32],
    answer: &[u32],
    cache: Option<&StateCache>,
) -> Result<Attribution> {
    if method == Method::Naive {
        return Err(Error::Input(format!(
            "naive uses no context, so there is nothing to attribute; use {}",
            Method::list(&Method::WITH_CONTEXT)
        )));
    }
    method.check_among(&Method::WITH_CONTEXT).map_err(|e| Error::Input(e.to_string()))?;
    if ids.is_empty() {
        return Err(Error::Input("no contexts to attribute the answer to; give ids or retrieve some".into()));
    }
    if prompt.is_empty() {
        return Err(Error::Input("the prompt must have at least one token (it predicts the answer's first)".into()));
    }
    if answer.is_empty() {
        return Err(Error::Input("the answer is empty: there is nothing to attribute".into()));
    }
    store.require_model(model)?;
    model.check_tokens(prompt)?;
    model.check_tokens(answer)?;
    let started = Instant::now();
    // What each state is built from: the contexts' tokens (concat) or their stored states.
    let tokens: Vec<Vec<u32>> = match method {
        Method::Concat => ids.iter().map(|&id| Ok(store.get(id)?.tokens)).collect::<Result<_>>()?,
        _ => Vec::new(),
    };
    let mapped = match method {
        Method::Compose(_) => store.states_for(model, ids, cache)?.states,
        _ => Vec::new(),
    };
    // The state of the contexts at positions `keep`, combined by the method.
    let state_of = |keep: &[usize]| -> Result<State> {
        if keep.is_empty() {
            return Ok(model.zero_state());
        }
        Ok(match method {
            Method::Compose(m) => {
                compose_views(m, &keep.iter().map(|&i| mapped[i].view()).collect::<Vec<StateView<'_>>>(), None)?
            }
            _ => {
                let joined: Vec<u32> = keep.iter().flat_map(|&i| tokens[i].iter().copied()).collect();
                model.prefill(&joined, &model.zero_state())?
            }
        })
    };
    // Scored a group at a time: each pass over the weights serves the group, and at most a
    // group of states is in memory at once.
    let subsets: Vec<Vec<usize>> = subsets(ids.len()).collect();
    let mut lls = Vec::with_capacity(subsets.len());
    for group in subsets.chunks(SCORE_GROUP) {
        let mut states: Vec<State> = group.iter().map(|keep| state_of(keep)).collect::<Result<_>>()?;
        let scored =
            model.score_continuation_batch(prompt, answer, &mut states.iter_mut().collect::<Vec<&mut State>>())?;
        lls.extend(scored.iter().map(|logprobs| logprobs.iter().map(|&l| f64::from(l)).sum::<f64>()));
    }
    Ok(Attribution {
        method,
        loglik: lls[0],
        without: lls[1..].to_vec(),
        answer_tokens: answer.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// States scored together in one forward pass.
const SCORE_GROUP: usize = 8;

/// The positions kept in each of the k + 1 states: all of `0..k`, then each one left out.
fn subsets(k: usize) -> impl Iterator<Item = Vec<usize>> {
    std::iter::once((0..k).collect()).chain((0..k).map(move |out| (0..k).filter(|&i| i != out).collect()))
}
