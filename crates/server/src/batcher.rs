//! Continuous batching: every active generation advances together, one batched decode step
//! per token, so the weights stream from memory once per step for all of them instead of once
//! per request. New requests join between steps: up to a chunk of prompt tokens per step
//! ([`DEFAULT_PREFILL_CHUNK`] unless configured), over all joining requests, is prefilled in one
//! forward pass, so a long prompt delays the others by one chunk at most and several short ones
//! start together; while no generation streams, nobody waits on the step, and up to
//! [`IDLE_PREFILL_CHUNK`] tokens go in at once. A request whose client went away (its event
//! receiver dropped) leaves before the next step.
//!
//! Sampling runs per request ([`Decoder`]: its own options, seed and stop strings), and a
//! batched step gives each sequence, to the bit, the logits it would get alone, so batching
//! never changes what a request generates.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use picaso_model::{Decoder, GenerateOptions, Model, Next, State, StopReason};
use prometheus_client::metrics::{counter::Counter, gauge::Gauge, histogram::Histogram};
use tokio::sync::mpsc;

/// Prompt tokens prefilled per step by default, over all joining requests (oldest first), in
/// one forward pass: a long prompt is cut into chunks, and several short ones start together.
/// Every running stream waits for that prefill, so the chunk trades the joiners' time to first
/// token against the others' inter-token latency (BENCHMARKS.md measures both).
pub const DEFAULT_PREFILL_CHUNK: usize = 64;

/// A generation to run: the prompt, the state it continues from, how to sample, and where
/// its events go.
pub(crate) struct Job {
    pub prompt: Vec<u32>,
    pub state: State,
    pub opts: GenerateOptions,
    /// When the request arrived (for the time to first token).
    pub started: Instant,
    pub events: mpsc::UnboundedSender<Event>,
}

/// What a generation reports, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug)]
pub(crate) enum Event {
    /// New final text.
    Text(String),
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
    jobs: mpsc::UnboundedSender<(Job, Slot)>,
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
        metrics: BatchMetrics,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let outstanding = Arc::new(AtomicUsize::new(0));
        let queued = metrics.queued.clone();
        let (max_batch, prefill_chunk) = (max_batch.max(1), prefill_chunk.max(1));
        std::thread::Builder::new()
            .name("picaso-batcher".into())
            .spawn(move || run(&model, rx, max_batch, prefill_chunk, &metrics))
            .expect("the batching thread starts");
        Self { jobs: tx, outstanding, limit: max_batch + max_queue, queued }
    }

    /// Queues a job; refuses at once when the batch and the queue are full.
    pub fn submit(&self, job: Job) -> Result<(), Refused> {
        let slot = Slot(self.outstanding.clone());
        if self.outstanding.fetch_add(1, Ordering::SeqCst) >= self.limit {
            return Err(Refused::Busy);
        }
        self.queued.inc();
        self.jobs.send((job, slot)).map_err(|_| {
            self.queued.dec();
            Refused::Stopped
        })
    }
}

/// One generation in the batch.
struct Sequence<'m> {
    job: Job,
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
}

impl Sequence<'_> {
    /// Whether part of the prompt is still to be prefilled.
    fn joining(&self) -> bool {
        self.prefilled < self.job.prompt.len()
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
    fn sample(&mut self, m: &BatchMetrics) {
        let Some(logits) = self.logits.take() else { return };
        match self.decoder.push(&logits) {
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

/// Prefills up to `chunk` prompt tokens of the joining requests (up to
/// [`IDLE_PREFILL_CHUNK`] when none is streaming yet), oldest first, in one forward pass; a
/// request whose prompt is all in gets its first logits.
fn prefill_chunks(model: &Model, batch: &mut [Sequence], chunk: usize) {
    let streaming = batch.iter().any(|s| !s.ended && !s.joining());
    let mut budget = if streaming { chunk } else { chunk.max(IDLE_PREFILL_CHUNK) };
    let mut joining: Vec<(&mut Sequence, usize)> = Vec::new();
    for s in batch.iter_mut().filter(|s| !s.ended && s.joining()) {
        if budget == 0 {
            break;
        }
        let end = (s.prefilled + budget).min(s.job.prompt.len());
        budget -= end - s.prefilled;
        joining.push((s, end));
    }
    if joining.is_empty() {
        return;
    }
    let chunks: Vec<&[u32]> = joining.iter().map(|(s, end)| &s.job.prompt[s.prefilled..*end]).collect();
    let states: Vec<&State> = joining.iter().map(|(s, _)| &s.job.state).collect();
    match model.prefill_batch(&chunks, &states) {
        Ok(done) => {
            for ((s, end), (logits, state)) in joining.into_iter().zip(done) {
                s.job.state = state;
                s.prefilled = end;
                if end == s.job.prompt.len() {
                    s.logits = Some(logits);
                }
            }
        }
        Err(e) => joining.into_iter().for_each(|(s, _)| s.send(Event::Failed(e.to_string()))),
    }
}

/// The batching loop: admit, prefill, sample, step.
fn run(
    model: &Model,
    mut jobs: mpsc::UnboundedReceiver<(Job, Slot)>,
    max_batch: usize,
    prefill_chunk: usize,
    m: &BatchMetrics,
) {
    let mut batch: Vec<Sequence> = Vec::new();
    let mut open = true;
    loop {
        // Admit: wait when idle, else take what is queued, up to the cap.
        if batch.is_empty() {
            match open.then(|| jobs.blocking_recv()).flatten() {
                Some(job) => admit(model, job, &mut batch, m),
                None => return,
            }
        }
        while open && batch.len() < max_batch {
            match jobs.try_recv() {
                Ok(job) => admit(model, job, &mut batch, m),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => open = false,
            }
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
        prefill_chunks(model, &mut batch, prefill_chunk);
        for s in &mut batch {
            s.sample(m);
        }
        // One batched decode step for every sequence that goes on.
        let (feed, mut states): (Vec<u32>, Vec<&mut State>) =
            batch.iter_mut().filter_map(|s| Some((s.fed?, &mut s.job.state))).unzip();
        if !feed.is_empty() {
            let result = model.step_batch(&feed, &mut states);
            let stepped = batch.iter_mut().filter(|s| s.fed.is_some());
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
        }
        batch.retain(|s| !s.ended);
        m.active.set(batch.len() as i64);
    }
}

/// Starts a job: a decoder for its options (checked when the request was validated).
fn admit<'m>(model: &'m Model, (job, slot): (Job, Slot), batch: &mut Vec<Sequence<'m>>, m: &BatchMetrics) {
    m.queued.dec();
    match Decoder::new(model, &job.opts) {
        Ok(decoder) => batch.push(Sequence {
            job,
            slot: Some(slot),
            decoder,
            prefilled: 0,
            logits: None,
            fed: None,
            ttft: None,
            ended: false,
        }),
        Err(e) => {
            drop(slot);
            let _ = job.events.send(Event::Failed(e.to_string()));
        }
    }
    m.active.set(batch.len() as i64);
}
