//! [`Model`]: a loaded Mamba-1 or Mamba-2 language model with its tokenizer. Every operation takes a
//! [`State`] and returns the next one, so a computation can stop after any token and resume
//! later, elsewhere, or from a composed state.

use std::path::{Path, PathBuf};

use crate::config::ModelConfig;
use crate::cpu::{Rows, WeightDtype};
pub use crate::engine::Backend;
use crate::engine::{Engine, Weights};
use crate::error::{Error, Result};
use crate::mamba1::Mamba1Weights;
use crate::mamba2::{Mamba2Config, Mamba2Weights};
use crate::state::{SsmValue, State, StateShape};
use crate::tokenizer::TextTokenizer;

/// How to load a model.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// The engine (default: the CPU fast path).
    pub backend: Backend,
    /// Storage of the large matrices on the CPU engine (bf16 halves memory and decode time).
    pub weight_dtype: WeightDtype,
    /// A `tokenizer.json` to use instead of the one in the model folder.
    pub tokenizer: Option<PathBuf>,
    /// Load without any tokenizer (token-id-only use); otherwise a missing tokenizer is an error
    /// only when text is tokenized.
    pub skip_tokenizer: bool,
}

/// A Mamba language model ready to run.
#[derive(Debug)]
pub struct Model {
    dir: PathBuf,
    config: ModelConfig,
    fingerprint: String,
    n_params: usize,
    engine: Box<dyn Engine>,
    tokenizer: Option<TextTokenizer>,
    tokenizer_error: Option<String>,
}

/// A run of decode steps over a batch of states that the engine keeps where it computes
/// ([`Model::session`]). Each step gives what [`Model::step_batch`] gives for the same states.
pub struct Session<'m> {
    model: &'m Model,
    resident: Box<dyn crate::engine::Resident + 'm>,
    n: usize,
}

impl std::fmt::Debug for Session<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").field("sequences", &self.n).finish_non_exhaustive()
    }
}

impl Session<'_> {
    /// One token per sequence (`tokens[i]` continues sequence i); returns each sequence's
    /// next-token logits (B × vocab).
    pub fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.len() != self.n {
            return Err(Error::Input(format!("{} tokens for a session of {} sequences", tokens.len(), self.n)));
        }
        self.model.check_tokens(tokens)?;
        self.resident.forward_logits(tokens, &vec![1; tokens.len()])
    }

    /// The states as they stand, on the host.
    pub fn states(&self) -> Result<Vec<State>> {
        self.resident.states()
    }

    /// The states, on the host, ending the session (a host engine's come back uncopied).
    pub fn into_states(self) -> Result<Vec<State>> {
        self.resident.into_states()
    }

    /// Adds a sequence that continues from `state`, after the others: a server's request that
    /// joins the running batch (on a GPU its state is copied there once).
    pub fn push(&mut self, state: State) -> Result<()> {
        self.model.check_state(&state)?;
        self.resident.push(state)?;
        self.n += 1;
        Ok(())
    }

    /// Drops sequence `i` (a request that ended); the last sequence takes its place, as
    /// [`Vec::swap_remove`] does.
    pub fn swap_remove(&mut self, i: usize) -> Result<()> {
        if i >= self.n {
            return Err(Error::Input(format!("sequence {i} of a session of {}", self.n)));
        }
        self.resident.swap_remove(i)?;
        self.n -= 1;
        Ok(())
    }

    /// Sequences in the session.
    pub fn len(&self) -> usize {
        self.n
    }

    /// Whether the session has no sequence.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// The outcome of scoring a token sequence.
#[derive(Debug, Clone)]
pub struct Scored {
    /// `logprobs[i] = log p(tokens[i+1] | state, tokens[..=i])`.
    pub logprobs: Vec<f32>,
    /// The state after all tokens.
    pub state: State,
}

impl Model {
    /// Loads `dir/config.json`, the weights and (unless skipped) a tokenizer.
    pub fn load(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let expected = "expected a folder with config.json and model.safetensors";
        if !dir.is_dir() {
            return Err(Error::Input(format!("{}: model folder not found ({expected})", dir.display())));
        }
        let config_file = dir.join("config.json");
        if !config_file.is_file() {
            let why = format!("not found: {} is not a model folder ({expected})", dir.display());
            return Err(Error::io(config_file, std::io::Error::new(std::io::ErrorKind::NotFound, why)));
        }
        let config = ModelConfig::from_file(&config_file)?;
        let weights = Weights::load(dir, &config)?;
        let fingerprint = weights.fingerprint(&config);
        let n_params = weights.n_params(&config);
        let (tokenizer, tokenizer_error) = if options.skip_tokenizer {
            (None, Some("the model was loaded without a tokenizer".to_string()))
        } else {
            let path = options.tokenizer.clone().unwrap_or_else(|| dir.join("tokenizer.json"));
            match TextTokenizer::from_file(&path) {
                Ok(t) => (Some(t), None),
                Err(e) if options.tokenizer.is_some() => return Err(e),
                Err(e) => (None, Some(format!("{e}; give the path of a tokenizer.json (picaso --tokenizer PATH, Python Model(tokenizer=PATH))"))),
            }
        };
        let engine = crate::engine::build(config.clone(), weights, &options.backend, options.weight_dtype)?;
        Ok(Self { dir: dir.to_path_buf(), config, fingerprint, n_params, engine, tokenizer, tokenizer_error })
    }

    /// Builds a model on the CPU engine from weights already in memory (tests, training).
    pub fn from_weights(config: Mamba2Config, weights: Mamba2Weights, tokenizer: Option<TextTokenizer>) -> Self {
        Self::from_weights_on(config, weights, tokenizer, &Backend::Cpu, WeightDtype::F32)
            .expect("the CPU engine cannot fail to build")
    }

    /// Builds a model on `backend` from weights already in memory.
    pub fn from_weights_on(
        config: Mamba2Config,
        weights: Mamba2Weights,
        tokenizer: Option<TextTokenizer>,
        backend: &Backend,
        weight_dtype: WeightDtype,
    ) -> Result<Self> {
        let (config, weights) = (ModelConfig::Mamba2(config), Weights::Mamba2(weights));
        Self::from_parts(config, weights, tokenizer, backend, weight_dtype)
    }

    /// Builds a Mamba-1 model on the CPU engine from weights already in memory (tests).
    pub fn from_mamba1_weights(
        config: crate::mamba1::Mamba1Config,
        weights: Mamba1Weights,
        tokenizer: Option<TextTokenizer>,
    ) -> Self {
        Self::from_mamba1_weights_on(config, weights, tokenizer, &Backend::Cpu, WeightDtype::F32)
            .expect("the CPU engine cannot fail to build")
    }

    /// Builds a Mamba-1 model on `backend` from weights already in memory.
    pub fn from_mamba1_weights_on(
        config: crate::mamba1::Mamba1Config,
        weights: Mamba1Weights,
        tokenizer: Option<TextTokenizer>,
        backend: &Backend,
        weight_dtype: WeightDtype,
    ) -> Result<Self> {
        Self::from_parts(ModelConfig::Mamba1(config), Weights::Mamba1(weights), tokenizer, backend, weight_dtype)
    }

    /// Builds a hybrid model on `backend` from weights already in memory (benchmarks, tests).
    pub fn from_hybrid_weights_on(
        config: crate::granite_hybrid::GraniteHybridConfig,
        weights: crate::granite_hybrid::GraniteHybridWeights,
        tokenizer: Option<TextTokenizer>,
        backend: &Backend,
        weight_dtype: WeightDtype,
    ) -> Result<Self> {
        let (config, weights) = (ModelConfig::GraniteHybrid(config), Weights::GraniteHybrid(weights));
        Self::from_parts(config, weights, tokenizer, backend, weight_dtype)
    }

    /// Builds a Jamba model on `backend` from weights already in memory (benchmarks, tests).
    pub fn from_jamba_weights_on(
        config: crate::jamba::JambaConfig,
        weights: crate::jamba::JambaWeights,
        tokenizer: Option<TextTokenizer>,
        backend: &Backend,
        weight_dtype: WeightDtype,
    ) -> Result<Self> {
        Self::from_parts(ModelConfig::Jamba(config), Weights::Jamba(weights), tokenizer, backend, weight_dtype)
    }

    fn from_parts(
        config: ModelConfig,
        weights: Weights,
        tokenizer: Option<TextTokenizer>,
        backend: &Backend,
        weight_dtype: WeightDtype,
    ) -> Result<Self> {
        let fingerprint = weights.fingerprint(&config);
        let n_params = weights.n_params(&config);
        Ok(Self {
            dir: PathBuf::new(),
            config: config.clone(),
            fingerprint,
            n_params,
            engine: crate::engine::build(config, weights, backend, weight_dtype)?,
            tokenizer_error: tokenizer.is_none().then(|| "no tokenizer".to_string()),
            tokenizer,
        })
    }

    /// The folder the model was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    /// The fingerprint every state of this model carries.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }
    /// Number of parameters.
    pub fn n_params(&self) -> usize {
        self.n_params
    }
    /// Floating-point operations of prefilling `n_tokens` from the zero state, roughly: two
    /// per parameter per token, and per attention layer two per key channel for each pair of
    /// tokens it relates, for the scores and again for the values (n²/2 pairs, causal). What a
    /// stored state saves; a state budget weighs it (picaso-store's budget).
    pub fn prefill_flops(&self, n_tokens: usize) -> f64 {
        let n = n_tokens as f64;
        let dense = 2.0 * self.n_params as f64 * n;
        let attention = self
            .state_shape()
            .attention
            .map_or(0.0, |a| a.layers.len() as f64 * 2.0 * 2.0 * (n * n / 2.0) * (a.kv_heads * a.head_dim) as f64);
        dense + attention
    }
    /// Shape of this model's states.
    pub fn state_shape(&self) -> StateShape {
        self.config.state_shape()
    }
    /// The state before any token.
    pub fn zero_state(&self) -> State {
        State::zeros(self.state_shape(), self.fingerprint.clone())
    }

    /// The tokenizer, or an error saying how to provide one.
    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| Error::Input(self.tokenizer_error.clone().unwrap_or_else(|| "no tokenizer".into())))
    }

    /// Checks that `state` belongs to this model.
    pub fn check_state<S>(&self, state: &State<S>) -> Result<()> {
        state.check_compatible(&self.fingerprint, &self.state_shape())
    }

    /// Checks that every id indexes the embedding.
    pub fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let v = self.config.vocab_size();
        match tokens.iter().position(|&t| t as usize >= v) {
            Some(i) => {
                // Text gives such ids when the tokenizer is not the model's.
                let hint = match self.tokenizer() {
                    Ok(t) if t.vocab_size() > v => format!(
                        "; the tokenizer knows {} tokens, the model {v}: is the tokenizer (--tokenizer, Python tokenizer=) the model's?",
                        t.vocab_size()
                    ),
                    _ => String::new(),
                };
                Err(Error::Input(format!(
                    "token id {} at position {i} is outside the vocabulary (ids must be < {v}){hint}",
                    tokens[i]
                )))
            }
            None => Ok(()),
        }
    }

    fn run(&self, tokens: &[u32], state: &State) -> Result<(Vec<f32>, State)> {
        self.check_tokens(tokens)?;
        self.check_state(state)?;
        let mut next = state.clone();
        let hidden = self.engine.forward_batch(tokens, &[tokens.len()], &mut [&mut next])?;
        Ok((hidden, next))
    }

    /// Processes `tokens` starting from `state` and returns the state after them.
    pub fn prefill(&self, tokens: &[u32], state: &State) -> Result<State> {
        self.run(tokens, state).map(|(_, s)| s)
    }

    /// Like [`Model::prefill`], also returning the next-token logits after the last token.
    pub fn prefill_last_logits(&self, tokens: &[u32], state: &State) -> Result<(Vec<f32>, State)> {
        if tokens.is_empty() {
            return Err(Error::Input("need at least one token to predict the next one".into()));
        }
        let (hidden, next) = self.run(tokens, state)?;
        let d = self.config.d_model();
        Ok((self.engine.logits(&hidden[hidden.len() - d..], Rows::Tokens)?, next))
    }

    /// Next-token logits for every position (T × vocab) and the final state.
    pub fn forward_all_logits(&self, tokens: &[u32], state: &State) -> Result<(Vec<f32>, State)> {
        let (hidden, next) = self.run(tokens, state)?;
        Ok((self.engine.logits(&hidden, Rows::Tokens)?, next))
    }

    /// One token: returns its next-token logits and advances `state` in place.
    pub fn step(&self, token: u32, state: &mut State) -> Result<Vec<f32>> {
        self.check_tokens(&[token])?;
        self.check_state(state)?;
        let hidden = self.engine.forward_batch(&[token], &[1], &mut [state])?;
        self.engine.logits(&hidden, Rows::Tokens)
    }

    /// Holds `states` where the engine computes for a run of decode steps ([`Session`]): on a
    /// GPU they stay in device memory, so only logits cross to the host per step.
    pub fn session(&self, states: Vec<State>) -> Result<Session<'_>> {
        for s in &states {
            self.check_state(s)?;
        }
        let n = states.len();
        Ok(Session { model: self, resident: self.engine.resident(states)?, n })
    }

    /// A session of one sequence that starts from the composition of `states` ([`crate::compose`]):
    /// on a GPU the composition runs there and generation starts from it without a copy back.
    pub fn session_composed(
        &self,
        method: picaso_compose::Composition,
        states: &[&State],
        order: Option<&[usize]>,
    ) -> Result<Session<'_>> {
        for s in states {
            self.check_state(s)?;
        }
        Ok(Session { model: self, resident: self.engine.resident_composed(method, states, order)?, n: 1 })
    }

    /// One decode step of several sequences at once: `tokens[i]` continues `states[i]`
    /// (advanced in place). Returns the next-token logits of each (B × vocab), each to the bit
    /// what [`Model::step`] gives that sequence alone, for one pass over the weights. The
    /// states may hold their SSM values as f16 where [`Model::runs_f16_states`] (a step then
    /// gives the bits of the f32 step from the widened values, and rounds the new ones).
    pub fn step_batch<S: SsmValue>(&self, tokens: &[u32], states: &mut [&mut State<S>]) -> Result<Vec<f32>> {
        if tokens.len() != states.len() {
            return Err(Error::Input(format!("{} tokens for {} states", tokens.len(), states.len())));
        }
        self.check_tokens(tokens)?;
        for s in states.iter() {
            self.check_state(s)?;
        }
        let hidden = self.forward_any(tokens, &vec![1; tokens.len()], states)?;
        self.engine.logits(&hidden, Rows::of(&vec![1; tokens.len()]))
    }

    /// Processes several token sequences (each at least one token) in one forward pass,
    /// `sequences[i]` from `states[i]`, and returns for each the next-token logits after its
    /// last token and the state after it: what [`Model::prefill_last_logits`] gives each alone,
    /// to float rounding (the projections of all rows are one matrix product).
    pub fn prefill_batch(&self, sequences: &[&[u32]], states: &[&State]) -> Result<Vec<(Vec<f32>, State)>> {
        let mut next: Vec<State> = states.iter().map(|&s| s.clone()).collect();
        let mut refs: Vec<&mut State> = next.iter_mut().collect();
        let logits = self.prefill_batch_in_place(sequences, &mut refs)?;
        Ok(logits.into_iter().zip(next).collect())
    }

    /// [`Model::prefill_batch`] continuing each state in place (no copy of the states: a
    /// server's joining requests, whose states are theirs alone). Returns each sequence's
    /// next-token logits. Bad input (token ids, state shapes, empty sequences) is refused before
    /// any state is touched.
    pub fn prefill_batch_in_place(&self, sequences: &[&[u32]], states: &mut [&mut State]) -> Result<Vec<Vec<f32>>> {
        let hidden = self.forward_many(sequences, states)?;
        // The last row of each sequence.
        let d = self.config.d_model();
        let mut last = Vec::with_capacity(sequences.len() * d);
        let mut end = 0;
        for s in sequences {
            end += s.len();
            last.extend_from_slice(&hidden[(end - 1) * d..end * d]);
        }
        // One row per sequence: each as its lone row would be.
        let logits = self.engine.logits(&last, Rows::Independent)?;
        let v = logits.len() / sequences.len();
        Ok(logits.chunks_exact(v).map(<[f32]>::to_vec).collect())
    }

    /// The state after each of several token sequences (each at least one token),
    /// `sequences[i]` from `states[i]`, in one forward pass: what [`Model::prefill`] gives each
    /// alone, to float rounding. Many short contexts (ingest) share each matrix product.
    pub fn prefill_states(&self, sequences: &[&[u32]], states: &[&State]) -> Result<Vec<State>> {
        let mut next: Vec<State> = states.iter().map(|&s| s.clone()).collect();
        self.forward_many(sequences, &mut next.iter_mut().collect::<Vec<_>>())?;
        Ok(next)
    }

    /// The state after each of several token sequences (each at least one token) from the zero
    /// state: to the bit what [`Model::prefill`] gives each alone, so a store built this way
    /// equals one rebuilt context by context. Sequences share forward passes of up to
    /// `max_tokens` tokens where the engine is batch-invariant ([`Model::batch_invariant`]);
    /// otherwise each runs alone.
    pub fn prefill_each(&self, sequences: &[&[u32]], max_tokens: usize) -> Result<Vec<State>> {
        check_nonempty(sequences)?;
        let zero = self.zero_state();
        if !self.batch_invariant() {
            return sequences.iter().map(|s| self.prefill(s, &zero)).collect();
        }
        let mut out = Vec::with_capacity(sequences.len());
        let mut rest = sequences;
        while !rest.is_empty() {
            // At least one sequence per pass, then as many as fit in max_tokens.
            let mut n = 1;
            let mut tokens = rest[0].len();
            while n < rest.len() && tokens + rest[n].len() <= max_tokens {
                tokens += rest[n].len();
                n += 1;
            }
            let (group, tail) = rest.split_at(n);
            out.extend(self.prefill_states(group, &vec![&zero; n])?);
            rest = tail;
        }
        Ok(out)
    }

    /// Whether a forward pass of several sequences gives each, to the bit, what it gives that
    /// sequence alone: on the CPU engine when its projections use the bf16 pair layout (the
    /// AVX512-BF16 kernel, `--weights bf16`), on candle where sequences run one after another.
    pub fn batch_invariant(&self) -> bool {
        self.engine.batch_invariant()
    }

    /// Whether the engine keeps states in a GPU's memory: a decode loop then holds its states
    /// in a [`Session`] (only tokens and logits cross per step) rather than stepping host
    /// states with [`Model::step_batch`] (which copies every state there and back per step).
    pub fn states_on_device(&self) -> bool {
        self.engine.states_on_device()
    }

    /// Whether [`Model::step_batch`] takes states with f16 SSM values: on the CPU engine of a
    /// Mamba-2 or hybrid model.
    pub fn runs_f16_states(&self) -> bool {
        self.engine.runs_f16_states()
    }

    /// The engine's batched pass on f32 or f16 states.
    fn forward_any<S: SsmValue>(
        &self,
        tokens: &[u32],
        lens: &[usize],
        states: &mut [&mut State<S>],
    ) -> Result<Vec<f32>> {
        match S::as_f16(states) {
            Some(f16) => self.engine.forward_batch_f16(tokens, lens, f16),
            None => self.engine.forward_batch(tokens, lens, S::as_f32(states).expect("an SSM value is f32 or f16")),
        }
    }

    /// Continues each state in place with its sequence and returns the hidden rows of the
    /// concatenated sequences. Bad input is refused before any state is touched.
    fn forward_many(&self, sequences: &[&[u32]], states: &mut [&mut State]) -> Result<Vec<f32>> {
        if sequences.len() != states.len() {
            return Err(Error::Input(format!("{} sequences for {} states", sequences.len(), states.len())));
        }
        check_nonempty(sequences)?;
        let tokens: Vec<u32> = sequences.concat();
        self.check_tokens(&tokens)?;
        for s in states.iter() {
            self.check_state(s)?;
        }
        let lens: Vec<usize> = sequences.iter().map(|s| s.len()).collect();
        self.engine.forward_batch(&tokens, &lens, states)
    }

    /// Scores `tokens` from `state`: the first token is context, each later one is scored.
    /// No tokens is refused (a mistake upstream, not an empty answer); one token scores nothing
    /// and moves the state.
    pub fn score(&self, tokens: &[u32], state: &State) -> Result<Scored> {
        if tokens.is_empty() {
            return Err(Error::Input("nothing to score: the input has no tokens".into()));
        }
        let (hidden, next) = self.run(tokens, state)?;
        let d = self.config.d_model();
        let logprobs = if tokens.len() < 2 {
            Vec::new()
        } else {
            self.engine.logprobs(&hidden[..(tokens.len() - 1) * d], &tokens[1..])?
        };
        Ok(Scored { logprobs, state: next })
    }

    /// Scores only `continuation` after `context` from `state`: `logprobs[i] = log p(continuation[i] | ...)`.
    /// `context` must be non-empty (it predicts the first continuation token).
    pub fn score_continuation(&self, context: &[u32], continuation: &[u32], state: &State) -> Result<Scored> {
        let mut next = state.clone();
        let logprobs = self.score_continuation_batch(context, continuation, &mut [&mut next])?.remove(0);
        Ok(Scored { logprobs, state: next })
    }

    /// [`Model::score_continuation`] of one `context` and `continuation` from each of several
    /// states, in one forward pass (each weight read once for all of them), continuing each
    /// state in place: what scoring from each alone gives, to float rounding. Leave-one-out
    /// attribution scores one answer from k + 1 states.
    pub fn score_continuation_batch(
        &self,
        context: &[u32],
        continuation: &[u32],
        states: &mut [&mut State],
    ) -> Result<Vec<Vec<f32>>> {
        if context.is_empty() {
            return Err(Error::Input("scoring a continuation needs at least one context token".into()));
        }
        if states.is_empty() {
            return Ok(Vec::new());
        }
        let all = [context, continuation].concat();
        let hidden = self.forward_many(&vec![&all[..]; states.len()], states)?;
        if continuation.is_empty() {
            return Ok(vec![Vec::new(); states.len()]);
        }
        // Each sequence's rows that predict the continuation.
        let (d, t, from) = (self.config.d_model(), all.len(), context.len() - 1);
        let mut rows = Vec::with_capacity(states.len() * continuation.len() * d);
        for i in 0..states.len() {
            rows.extend_from_slice(&hidden[(i * t + from) * d..(i * t + t - 1) * d]);
        }
        let targets = continuation.repeat(states.len());
        let logprobs = self.engine.logprobs(&rows, &targets)?;
        Ok(logprobs.chunks_exact(continuation.len()).map(<[f32]>::to_vec).collect())
    }
}

/// Refuses an empty sequence among several: each must have a token to end its state on.
fn check_nonempty(sequences: &[&[u32]]) -> Result<()> {
    match sequences.iter().position(|s| s.is_empty()) {
        Some(i) => Err(Error::Input(format!("sequence {i} is empty; each needs at least one token"))),
        None => Ok(()),
    }
}
