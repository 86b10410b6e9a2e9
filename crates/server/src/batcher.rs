//! Continuous batching: every active generation advances together, one batched decode step
//! per token, so the weights stream from memory once per step for all of them instead of once
//! per request. New requests join between steps: up to a chunk of prompt tokens per step
//! ([`DEFAULT_PREFILL_CHUNK`] unless configured), shared among the joining requests shortest
//! first, the oldest guaranteed its even share ([`shares`]), is prefilled in one forward pass, so a long prompt delays the others by one
//! chunk at most, a short prompt that joins behind a long one starts within a step, and several
//! short ones start together; while no generation streams, nobody waits on the step, and up to
//! [`IDLE_PREFILL_CHUNK`] tokens go in at once. A request whose client went away (its event
//! receiver dropped) leaves before the next step, from the batch or from the queue.
//!
//! Sampling runs per request ([`Decoder`]: its own options, seed and stop strings), and a
//! batched step gives each sequence, to the bit, the logits it would get alone, so batching
//! never changes what a request generates.
//!
//! With [`DecodeStates::F16`] a generation's SSM state is held as f16 from its first decoded
//! token on: a step of 16 sequences then reads and writes half the state bytes, which are most
//! of its memory traffic (the prompt is still prefilled in f32; see [`picaso_model::SsmValue`]).
//!
//! On a GPU ([`Model::states_on_device`]) the running generations' states live in device
//! memory ([`DeviceBatch`]): a state goes there once, at its generation's first decode step, and
//! leaves when the generation ends, so a step moves only tokens and logits.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use half::f16;
use picaso_model::{Decoder, GenerateOptions, Model, Next, Session, SsmValue, State, StopReason};
use prometheus_client::metrics::{counter::Counter, gauge::Gauge, histogram::Histogram};
use rayon::prelude::*;
use tokio::sync::mpsc;

use crate::logprobs::{position, Position};
use crate::prefix_cache::{Origin, PrefixCache};

/// Prompt tokens prefilled per step by default, shared among all joining requests, in
/// one forward pass: a long prompt is cut into chunks, and several short ones start together.
/// Every running stream waits for that prefill, so the chunk trades the joiners' time to first
/// token against the others' inter-token latency (BENCHMARKS.md measures both). Each pass
/// reads every weight once, so a pass of 64 tokens costs ~70 ms and one of 256 ~200 ms on the
/// CPUs measured: 256 lets 8 short prompts join per step at a third of the cost per token.
pub const DEFAULT_PREFILL_CHUNK: usize = 256;

/// How the batch holds its generations' SSM states between decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeStates {
    /// Exact: every generation gets the bits it would get alone, batched or not.
    #[default]
    F32,
    /// Half the bytes per step: faster batched decoding, log-probs within ~1e-3 of f32's over
    /// hundreds of tokens (BENCHMARKS.md). Needs a Mamba-2 model on the cpu engine.
    F16,
}

impl std::str::FromStr for DecodeStates {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            other => Err(format!("unknown decode-state dtype {other:?}: use f32 or f16")),
        }
    }
}

/// A generation to run: the prompt, how to sample, and where its events go (the state it
/// continues from is submitted beside it).
pub(crate) struct Job {
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    /// Report each sampled token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
    /// When the request arrived (for the time to first token).
    pub started: Instant,
    pub events: mpsc::UnboundedSender<Event>,
    /// Next-token logits when the state already holds the whole prompt (a prefix-cache hit of
    /// all of it; `prompt` is then empty).
    pub logits: Option<Vec<f32>>,
    /// Where to keep the prompt's states in the prefix cache, if anywhere.
    pub prefix: Option<PrefixJob>,
}

/// The prefix states a job stores as its prompt goes in: prefill passes stop at each cut, and
/// the state there goes into the prefix cache.
pub(crate) struct PrefixJob {
    pub origin: Origin,
    /// The whole prompt: the job's `prompt` is its tail after the `start` tokens its state
    /// already holds.
    pub tokens: Vec<u32>,
    pub start: usize,
    /// Tokens of the job's `prompt` after which to store the state: ascending, each above 0,
    /// the last its whole length (none when the whole prompt was stored).
    pub cuts: Vec<usize>,
    /// The prefix cache's epoch when the request's contexts were composed.
    pub epoch: u64,
}

/// What a generation reports, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug)]
pub(crate) enum Event {
    /// A sampled token's log-probability (when the job asked for them), sent before the text
    /// it makes. A token that ends the generation (end of text, a stop string) has one too, as
    /// OpenAI reports it.
    Logprob(Position),
    /// New final text.
    Text(String),
    /// The prompt continued from a stored prefix of this many tokens after all: another
    /// request in the batch stored it while this one waited (sent before any text).
    Cached(usize),
    /// The end.
    Done {
        /// Tokens generated.
        tokens: usize,
        /// Why it ended.
        reason: StopReason,
        /// Seconds from the request to its first text (or to the end, if it made none).
        ttft: f64,
    },
    /// The model failed; the message is for the server's log.
    Failed(String),
}

/// The metrics the batcher keeps (handles shared with [`crate::metrics::Metrics`]).
#[derive(Clone, Debug)]
pub(crate) struct BatchMetrics {
    pub completion_tokens: Counter,
    pub cancelled: Counter,
    pub time_to_first_token_seconds: Histogram,
    /// Generations in the running batch.
    pub active: Gauge,
    /// Requests waiting to join it.
    pub queued: Gauge,
    /// Seconds of each batched decode step (the forward pass of every sequence that steps).
    pub step_seconds: Histogram,
    /// Sequences in each batched decode step.
    pub step_sequences: Histogram,
    /// Seconds of each prefill pass over joining prompts.
    pub prefill_seconds: Histogram,
    /// Prompt tokens in each prefill pass.
    pub prefill_tokens: Histogram,
    /// Seconds per batch iteration spent sampling every sequence's next token and handing out
    /// its text (what the batch waits on besides the forward passes).
    pub sample_seconds: Histogram,
}

/// A job's place in the batch or its queue, given back when dropped: before the job's last
/// event is sent, so a client that has its answer can submit again at once.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Hands jobs to the batching thread. Dropping it stops the thread once the batch drains.
pub(crate) struct Batcher {
    jobs: mpsc::UnboundedSender<(Job, State, Slot)>,
    /// Jobs submitted and not yet finished (in the batch or waiting for it).
    outstanding: Arc<AtomicUsize>,
    /// Most outstanding jobs: the batch's cap plus the queue's.
    limit: usize,
    queued: Gauge,
}

/// Why a job was not taken.
pub(crate) enum Refused {
    /// The queue is full: retry later.
    Busy,
    /// The batching thread is gone.
    Stopped,
}

impl Batcher {
    /// Starts the batching thread: at most `max_batch` generations at once, `max_queue` more
    /// waiting to join, and at most `prefill_chunk` prompt tokens prefilled per step.
    pub fn start(
        model: Arc<Model>,
        max_batch: usize,
        max_queue: usize,
        prefill_chunk: usize,
        states: DecodeStates,
        metrics: BatchMetrics,
        prefix: Arc<PrefixCache>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let outstanding = Arc::new(AtomicUsize::new(0));
        let queued = metrics.queued.clone();
        let (max_batch, prefill_chunk) = (max_batch.max(1), prefill_chunk.max(1));
        std::thread::Builder::new()
            .name("picaso-batcher".into())
            .spawn(move || run(&model, rx, max_batch, prefill_chunk, states, &metrics, &prefix))
            .expect("the batching thread starts");
        Self { jobs: tx, outstanding, limit: max_batch + max_queue, queued }
    }

    /// Queues a job that continues from `state`; refuses at once when the batch and the queue
    /// are full.
    pub fn submit(&self, job: Job, state: State) -> Result<(), Refused> {
        let slot = Slot(self.outstanding.clone());
        if self.outstanding.fetch_add(1, Ordering::SeqCst) >= self.limit {
            return Err(Refused::Busy);
        }
        self.queued.inc();
        self.jobs.send((job, state, slot)).map_err(|_| {
            self.queued.dec();
            Refused::Stopped
        })
    }
}

/// A generation's state as the batch holds it.
enum Live {
    F32(State),
    F16(State<f16>),
    /// In the [`DeviceBatch`], from the generation's first decode step on.
    Device,
}

impl Live {
    /// The f32 state on the host (widened back, exactly, if it was held as f16); `None` once
    /// it is in device memory.
    fn wide(&mut self) -> Option<&mut State> {
        if let Live::F16(s) = self {
            *self = Live::F32(s.to_f32());
        }
        match self {
            Live::F32(s) => Some(s),
            Live::F16(_) | Live::Device => None,
        }
    }

    /// Holds the state as f16 from now on.
    fn narrow(&mut self) {
        if let Live::F32(s) = self {
            *self = Live::F16(s.to_f16());
        }
    }
}

/// One generation in the batch.
struct Sequence<'m> {
    /// Unique in the batcher's life: how the [`DeviceBatch`] names it.
    id: u64,
    job: Job,
    state: Live,
    /// Held until the generation ends.
    slot: Option<Slot>,
    decoder: Decoder<'m>,
    /// Prompt tokens already prefilled.
    prefilled: usize,
    /// Next-token logits, once the prompt is in (then after each step).
    logits: Option<Vec<f32>>,
    /// The token this step feeds.
    fed: Option<u32>,
    ttft: Option<f64>,
    /// Finished (done or failed): leaves the batch at the end of the step.
    ended: bool,
    /// Waits, without prefilling, for an earlier sequence to store the state after this many
    /// tokens of the prompt, which both prompts start with (see [`coalesce`]).
    waiting_for: Option<usize>,
    /// Whether the prefix cache was looked up again as it joined.
    rechecked: bool,
}

impl Sequence<'_> {
    /// Whether part of the prompt is still to be prefilled.
    fn joining(&self) -> bool {
        self.prefilled < self.job.prompt.len()
    }

    /// Prompt tokens in the state, counting those it started with.
    fn at(&self) -> usize {
        self.job.prefix.as_ref().map_or(0, |p| p.start) + self.prefilled
    }

    /// The prefix-cache cuts still ahead, in tokens of the whole prompt.
    fn pending_cuts(&self) -> impl Iterator<Item = usize> + '_ {
        let p = self.job.prefix.as_ref().filter(|_| !self.ended && self.waiting_for.is_none());
        p.into_iter().flat_map(move |p| p.cuts.iter().filter(move |&&c| c > self.prefilled).map(move |c| p.start + c))
    }

    fn send(&mut self, event: Event) {
        if matches!(event, Event::Text(_) | Event::Done { .. }) && self.ttft.is_none() {
            self.ttft = Some(self.job.started.elapsed().as_secs_f64());
        }
        if matches!(event, Event::Done { .. } | Event::Failed(_)) {
            self.ended = true;
            self.slot = None;
        }
        // A closed receiver is noticed before the next step.
        let _ = self.job.events.send(event);
    }

    /// Samples from the logits, if there are any: sets the token to feed, or ends.
    fn sample(&mut self, model: &Model, m: &BatchMetrics) {
        let Some(logits) = self.logits.take() else { return };
        let next = self.decoder.push(&logits);
        if let (Some(top_n), Ok(next)) = (self.job.logprobs, &next) {
            let tokenizer = model.tokenizer().ok();
            let sampled = match next {
                Next::Feed { token, .. } | Next::Done { unfed: Some(token), .. } => Some(*token),
                Next::Done { reason: StopReason::Eos, .. } => tokenizer.and_then(|t| t.eos()),
                Next::Done { .. } => None,
            };
            if let Some(token) = sampled {
                let vocab = tokenizer.map_or(usize::MAX, |t| t.vocab_size());
                self.send(Event::Logprob(position(&logits, token, top_n, vocab)));
            }
        }
        match next {
            Ok(Next::Feed { token, text }) => {
                if !text.is_empty() {
                    self.send(Event::Text(text));
                }
                self.fed = Some(token);
            }
            Ok(Next::Done { text, reason, .. }) => {
                if !text.is_empty() {
                    self.send(Event::Text(text));
                }
                let ttft = self.ttft.unwrap_or_else(|| self.job.started.elapsed().as_secs_f64());
                let tokens = self.decoder.tokens().len();
                m.time_to_first_token_seconds.observe(ttft);
                m.completion_tokens.inc_by(tokens as u64);
                self.send(Event::Done { tokens, reason, ttft });
            }
            Err(e) => self.send(Event::Failed(e.to_string())),
        }
    }
}

/// Prompt tokens prefilled per step while no generation is streaming: nobody waits on the
/// step then, so a burst of requests starts in one pass.
const IDLE_PREFILL_CHUNK: usize = 1024;

/// How many prompt tokens each joining request prefills this pass, given the tokens each has
/// `left` (in arrival order). The oldest request is guaranteed its even share of the budget
/// (`budget / joiners`, rounded up); the rest goes shortest-remaining first (equal lengths oldest
/// first), each taking all it needs. Shortest-first finishes prompts one after another instead of
/// all together at the end, which minimises the mean time to first token (8 prompts of equal
/// length: the k-th starts after k/8 of the work, not all after 8/8); a short prompt never waits
/// behind a long one's whole prefill; and the oldest's share keeps a long prompt moving however
/// many short ones arrive (every request becomes the oldest in time), so none starves.
fn shares(left: &[usize], budget: usize) -> Vec<usize> {
    let mut out = vec![0; left.len()];
    let Some(&oldest) = left.first() else { return out };
    out[0] = oldest.min(budget.div_ceil(left.len()));
    let mut budget = budget - out[0];
    let mut order: Vec<usize> = (0..left.len()).collect();
    order.sort_by_key(|&i| left[i]); // stable: the oldest first among equals
    for i in order {
        let more = (left[i] - out[i]).min(budget);
        out[i] += more;
        budget -= more;
    }
    out
}

/// Prefills up to `chunk` prompt tokens of the joining requests (up to
/// [`IDLE_PREFILL_CHUNK`] when none is streaming yet), shared among them by [`shares`], in one
/// forward pass; a request whose prompt is all in gets its first logits. A request's share
/// stops at its next prefix-cache cut, and the state there is stored.
fn prefill_chunks(model: &Model, batch: &mut [Sequence], chunk: usize, m: &BatchMetrics, cache: &PrefixCache) {
    let streaming = batch.iter().any(|s| !s.ended && !s.joining());
    let budget = if streaming { chunk } else { chunk.max(IDLE_PREFILL_CHUNK) };
    // A joining sequence's state is on the host (it goes to the device at its first step).
    let joining: Vec<&mut Sequence> = batch
        .iter_mut()
        .filter(|s| !s.ended && s.joining() && s.waiting_for.is_none() && !matches!(s.state, Live::Device))
        .collect();
    let left: Vec<usize> = joining.iter().map(|s| s.job.prompt.len() - s.prefilled).collect();
    let mut joining: Vec<(&mut Sequence, usize)> = joining
        .into_iter()
        .zip(shares(&left, budget))
        .filter(|(_, n)| *n > 0)
        .map(|(s, n)| {
            let mut end = s.prefilled + n;
            if let Some(p) = &s.job.prefix {
                if let Some(&cut) = p.cuts.iter().find(|&&c| c > s.prefilled) {
                    end = end.min(cut);
                }
            }
            (s, end)
        })
        .collect();
    if joining.is_empty() {
        return;
    }
    let (chunks, mut states): (Vec<&[u32]>, Vec<&mut State>) = joining
        .iter_mut()
        .map(|(s, end)| {
            let s = &mut **s;
            // Host states only (filtered above), so every joining sequence keeps its place
            // against the logits zipped back below.
            (&s.job.prompt[s.prefilled..*end], s.state.wide().expect("device states are filtered out above"))
        })
        .unzip();
    let t0 = Instant::now();
    let done = model.prefill_batch_in_place(&chunks, &mut states);
    m.prefill_seconds.observe(t0.elapsed().as_secs_f64());
    let tokens: usize = chunks.iter().map(|c| c.len()).sum();
    m.prefill_tokens.observe(tokens as f64);
    match done {
        Ok(logits) => {
            for ((s, end), logits) in joining.into_iter().zip(logits) {
                s.prefilled = end;
                let whole = end == s.job.prompt.len();
                if let (Some(p), Some(state)) =
                    (s.job.prefix.as_ref().filter(|p| p.cuts.contains(&end)), s.state.wide())
                {
                    let logits = whole.then(|| logits.clone());
                    cache.insert(&p.origin, &p.tokens[..p.start + end], state.clone(), logits, p.epoch);
                }
                if whole {
                    s.logits = Some(logits);
                    if let Some(p) = &s.job.prefix {
                        cache.record(p.start);
                    }
                }
            }
        }
        Err(e) => joining.into_iter().for_each(|(s, _)| s.send(Event::Failed(e.to_string()))),
    }
}

/// The batching loop: admit, prefill, sample, step.
fn run(
    model: &Model,
    mut jobs: mpsc::UnboundedReceiver<(Job, State, Slot)>,
    max_batch: usize,
    prefill_chunk: usize,
    states: DecodeStates,
    m: &BatchMetrics,
    cache: &PrefixCache,
) {
    let mut batch: Vec<Sequence> = Vec::new();
    let mut ids = 0u64;
    // PICASO_DEVICE_BATCH=1 takes the GPU's path on any engine (a session holds the states),
    // so that its bookkeeping is tested, and can be tried, without a GPU.
    let session_batch = model.states_on_device() || std::env::var("PICASO_DEVICE_BATCH").is_ok_and(|v| v == "1");
    let mut device = match session_batch && states == DecodeStates::F32 {
        false => None,
        true => match model.session(Vec::new()) {
            Ok(session) => Some(DeviceBatch { session, ids: Vec::new() }),
            Err(e) => {
                eprintln!("warning: holding the batch's states on the GPU failed ({e}); they cross to it every step");
                None
            }
        },
    };
    // Jobs submitted and not yet admitted, oldest first. Read off the channel every iteration
    // (not only while the batch has room), so that clients who leave while queued give their
    // place back at once instead of holding it until the batch has room for them.
    let mut waiting: VecDeque<(Job, State, Slot)> = VecDeque::new();
    let mut open = true;
    loop {
        // Wait when idle, else take all that is queued.
        if batch.is_empty() && waiting.is_empty() {
            match open.then(|| jobs.blocking_recv()).flatten() {
                Some(job) => waiting.push_back(job),
                None => return,
            }
        }
        while open {
            match jobs.try_recv() {
                Ok(job) => waiting.push_back(job),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
        }
        // Clients that went away while queued leave now (dropping the job frees its slot).
        waiting.retain(|(job, _, _)| {
            let gone = job.events.is_closed();
            if gone {
                m.queued.dec();
                m.cancelled.inc();
            }
            !gone
        });
        // Admit the oldest, up to the cap.
        while batch.len() < max_batch {
            let Some(job) = waiting.pop_front() else { break };
            ids += 1;
            admit(model, job, ids, &mut batch, m);
        }
        // Clients that went away leave now.
        batch.retain(|s| {
            let gone = s.job.events.is_closed();
            if gone {
                m.cancelled.inc();
                m.completion_tokens.inc_by(s.decoder.tokens().len() as u64);
            }
            !gone
        });
        coalesce(&mut batch, cache);
        prefill_chunks(model, &mut batch, prefill_chunk, m, cache);
        // Each sequence samples on its own (its options, seed and stop strings): the cores
        // share the work instead of one thread doing it while the pool waits.
        let t0 = Instant::now();
        batch.par_iter_mut().for_each(|s| s.sample(model, m));
        m.sample_seconds.observe(t0.elapsed().as_secs_f64());
        // One batched decode step for every sequence that goes on.
        let t0 = Instant::now();
        if states == DecodeStates::F16 {
            batch.iter_mut().filter(|s| s.fed.is_some()).for_each(|s| s.state.narrow());
        }
        let on_device = device.as_mut().map_or(0, |d| d.step(&mut batch));
        let stepped = on_device
            + step(model, &mut batch, |l| match l {
                Live::F32(s) => Some(s),
                Live::F16(_) | Live::Device => None,
            })
            + step(model, &mut batch, |l| match l {
                Live::F16(s) => Some(s),
                Live::F32(_) | Live::Device => None,
            });
        if stepped > 0 {
            m.step_seconds.observe(t0.elapsed().as_secs_f64());
            m.step_sequences.observe(stepped as f64);
        }
        batch.retain(|s| !s.ended);
        m.active.set(batch.len() as i64);
    }
}

/// Joining sequences that share a prefix prefill it once: a sequence that has prefilled
/// nothing yet, whose prompt starts with the tokens up to an earlier sequence's coming
/// prefix-cache cut (same origin), waits for that cut; once it is stored (or the earlier one
/// left), the waiter continues from the longest stored prefix of its prompt. A sequence that
/// waits for nobody looks the cache up again as it joins (a prefix may have been stored since
/// its request was prepared). So 16 agents that arrive together with one system prompt
/// prefill it once, not 16 times.
fn coalesce(batch: &mut [Sequence], cache: &PrefixCache) {
    // Waiters whose cut is no longer ahead of anyone: continue from the cache.
    for i in 0..batch.len() {
        let Some(cut) = batch[i].waiting_for else { continue };
        let ahead = batch[..i].iter().any(|l| l.pending_cuts().any(|c| c == cut) && shares_prefix(l, &batch[i], cut));
        if !ahead {
            batch[i].waiting_for = None;
            resume_from_cache(&mut batch[i], cache);
        }
    }
    // Sequences yet to start: wait for the furthest cut an earlier one will store first, or
    // continue from what the cache holds now.
    for i in 0..batch.len() {
        let s = &batch[i];
        if s.ended || s.prefilled > 0 || s.waiting_for.is_some() || !s.joining() || s.job.prefix.is_none() {
            continue;
        }
        let at = s.at();
        let cut = batch[..i]
            .iter()
            .flat_map(|l| l.pending_cuts().filter(|&c| c > at).filter(|&c| shares_prefix(l, s, c)).collect::<Vec<_>>())
            .max();
        let s = &mut batch[i];
        s.waiting_for = cut;
        if cut.is_none() && !s.rechecked {
            resume_from_cache(s, cache);
        }
        s.rechecked = true;
    }
}

/// Continues `s` from the longest prefix of its prompt the cache holds, if that is further
/// than its state: the prompt and the cuts are rebased on it, and the client is told how many
/// tokens were cached.
fn resume_from_cache(s: &mut Sequence, cache: &PrefixCache) {
    let (Some(p), false) = (&mut s.job.prefix, s.ended) else { return };
    let Some(hit) = cache.lookup(&p.origin, &p.tokens, p.start + s.prefilled) else { return };
    let skip = hit.len - p.start;
    s.state = Live::F32(hit.state);
    if skip == s.job.prompt.len() {
        s.logits = hit.logits;
        cache.record(hit.len);
    }
    p.start = hit.len;
    p.cuts.retain(|&c| c > skip);
    p.cuts.iter_mut().for_each(|c| *c -= skip);
    s.job.prompt.drain(..skip);
    s.prefilled = 0;
    let _ = s.job.events.send(Event::Cached(hit.len));
}

/// Whether `b`'s prompt starts with `a`'s first `n` tokens, from the same origin.
fn shares_prefix(a: &Sequence, b: &Sequence, n: usize) -> bool {
    match (&a.job.prefix, &b.job.prefix) {
        (Some(pa), Some(pb)) => {
            pa.origin == pb.origin && pa.tokens.len() >= n && pb.tokens.len() >= n && pa.tokens[..n] == pb.tokens[..n]
        }
        _ => false,
    }
}

/// One batched decode step for the sequences that have a token to feed and whose state `held`
/// picks (those held as f32, or as f16): each gets its next logits. Returns how many stepped.
fn step<S: SsmValue>(
    model: &Model,
    batch: &mut [Sequence],
    held: impl Fn(&mut Live) -> Option<&mut State<S>>,
) -> usize {
    let (feed, mut states): (Vec<u32>, Vec<&mut State<S>>) =
        batch.iter_mut().filter_map(|s| Some((s.fed?, held(&mut s.state)?))).unzip();
    if feed.is_empty() {
        return 0;
    }
    let result = model.step_batch(&feed, &mut states);
    let stepped = batch.iter_mut().filter_map(|s| (s.fed.is_some() && held(&mut s.state).is_some()).then_some(s));
    match result {
        Ok(logits) => {
            let v = logits.len() / feed.len();
            for (s, l) in stepped.zip(logits.chunks_exact(v)) {
                s.fed = None;
                s.logits = Some(l.to_vec());
            }
        }
        Err(e) => stepped.for_each(|s| s.send(Event::Failed(e.to_string()))),
    }
    feed.len()
}

/// The running generations' states in a GPU's memory, one sequence of `session` each:
/// `ids[i]` names the sequence at position `i`.
struct DeviceBatch<'m> {
    session: Session<'m>,
    ids: Vec<u64>,
}

impl DeviceBatch<'_> {
    /// One decode step for the batch's sequences on the device: first those that left the
    /// batch or ended go, and those about to take their first step come in (their state moves
    /// to the device); then every one (each has a token to feed: it got logits last step, or
    /// just came in with one) gets its next logits. Returns how many stepped.
    fn step(&mut self, batch: &mut [Sequence]) -> usize {
        // Where each sequence is in the batch (joining the session does not move it there).
        let at: HashMap<u64, usize> = batch.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        let mut i = 0;
        while i < self.ids.len() {
            if at.get(&self.ids[i]).is_some_and(|&j| !batch[j].ended) {
                i += 1;
            } else if let Err(e) = self.session.swap_remove(i) {
                return self.fail(batch, &e.to_string());
            } else {
                self.ids.swap_remove(i);
            }
        }
        for s in batch.iter_mut().filter(|s| s.fed.is_some() && !s.ended && matches!(s.state, Live::F32(_))) {
            let Live::F32(state) = std::mem::replace(&mut s.state, Live::Device) else { continue };
            match self.session.push(state) {
                Ok(()) => self.ids.push(s.id),
                Err(e) => s.send(Event::Failed(e.to_string())),
            }
        }
        if self.ids.is_empty() {
            return 0;
        }
        let feed: Option<Vec<u32>> = self.ids.iter().map(|id| batch[*at.get(id)?].fed).collect();
        let Some(feed) = feed else {
            return self.fail(batch, "internal: a sequence on the device has no token to feed");
        };
        match self.session.step(&feed) {
            Ok(logits) => {
                let v = logits.len() / feed.len();
                for (id, l) in self.ids.iter().zip(logits.chunks_exact(v)) {
                    let s = &mut batch[at[id]];
                    s.fed = None;
                    s.logits = Some(l.to_vec());
                }
            }
            Err(e) => {
                for id in &self.ids {
                    batch[at[id]].send(Event::Failed(e.to_string()));
                }
            }
        }
        feed.len()
    }

    /// Fails every sequence on the device (they leave at the next step).
    fn fail(&self, batch: &mut [Sequence], why: &str) -> usize {
        for s in batch.iter_mut().filter(|s| matches!(s.state, Live::Device) && !s.ended) {
            s.send(Event::Failed(why.to_string()));
        }
        0
    }
}

/// Starts a job: a decoder for its options (checked when the request was validated).
fn admit<'m>(
    model: &'m Model,
    (mut job, state, slot): (Job, State, Slot),
    id: u64,
    batch: &mut Vec<Sequence<'m>>,
    m: &BatchMetrics,
) {
    m.queued.dec();
    match Decoder::new(model, &job.opts) {
        Ok(decoder) => batch.push(Sequence {
            id,
            logits: job.logits.take(),
            job,
            state: Live::F32(state),
            slot: Some(slot),
            decoder,
            prefilled: 0,
            fed: None,
            ttft: None,
            ended: false,
            waiting_for: None,
            rechecked: false,
        }),
        Err(e) => {
            drop(slot);
            let _ = job.events.send(Event::Failed(e.to_string()));
        }
    }
    m.active.set(batch.len() as i64);
}

#[cfg(test)]
mod tests {
    use super::shares;

    /// A short prompt that joins behind a long one is prefilled whole in the next pass (the
    /// budget oldest first gave the long one everything: the short one waited out its prefill).
    #[test]
    fn a_short_prompt_is_not_held_behind_a_long_one() {
        assert_eq!(shares(&[7862, 5], 256), [251, 5]);
        assert_eq!(shares(&[7862, 7862, 5], 256), [251, 0, 5]);
    }

    /// The budget is never overspent and all used while there is work for it; the oldest gets
    /// at least its even share; past that, shortest first: a prompt that gets less than it needs
    /// leaves nothing to any longer one but the oldest's share.
    #[test]
    fn shares_go_shortest_first_and_never_starve_the_oldest() {
        assert_eq!(shares(&[1000, 1000, 1000], 256), [256, 0, 0]);
        assert_eq!(shares(&[1000, 50, 1000], 256), [206, 50, 0]);
        assert_eq!(shares(&[10, 20], 256), [10, 20]);
        assert_eq!(shares(&[3, 3, 3, 3], 2), [2, 0, 0, 0]);
        assert_eq!(shares(&[900, 1, 2, 3], 6), [2, 1, 2, 1]);
        assert_eq!(shares(&[], 256), Vec::<usize>::new());
        for left in [vec![1, 500, 2, 70, 9000], vec![300; 40], vec![1; 3], vec![9000, 5, 5, 5, 5]] {
            for budget in [1, 7, 64, 256, 1024] {
                let got = shares(&left, budget);
                let total: usize = got.iter().sum();
                assert!(got.iter().zip(&left).all(|(g, l)| g <= l), "{left:?} {budget}: {got:?}");
                assert_eq!(total, budget.min(left.iter().sum()), "{left:?} {budget}: {got:?}");
                let floor = left[0].min(budget.div_ceil(left.len()));
                assert!(got[0] >= floor, "{left:?} {budget}: {got:?}");
                // Shortest first with what the oldest's share leaves: walking the prompts
                // shortest first (equals oldest first), each gets all it needs, then at most one
                // gets part, then the rest get nothing (the oldest nothing beyond its share).
                let mut order: Vec<usize> = (0..left.len()).collect();
                order.sort_by_key(|&i| left[i]);
                let beyond = |i: usize| if i == 0 { (got[0] - floor, left[0] - floor) } else { (got[i], left[i]) };
                let short = order.iter().position(|&i| beyond(i).0 < beyond(i).1).unwrap_or(order.len());
                for &i in order.iter().skip(short + 1) {
                    assert_eq!(beyond(i).0, 0, "{left:?} {budget}: {got:?}");
                }
            }
        }
    }
}
