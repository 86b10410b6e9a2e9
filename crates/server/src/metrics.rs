//! Prometheus metrics, served as text at `GET /metrics`.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Label pairs of a metric.
pub type Labels = Vec<(&'static str, String)>;

type HistogramFamily = Family<Labels, Histogram, fn() -> Histogram>;

/// Seconds from 0.5 ms to ~16 s.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// The server's counters, gauges and histograms.
pub struct Metrics {
    registry: Registry,
    /// Requests by endpoint, method and status.
    pub requests: Family<Labels, Counter>,
    /// Request latency by endpoint (a stream's until its last event).
    pub request_seconds: HistogramFamily,
    /// Requests being served (a stream until its last event).
    pub in_flight: Gauge,
    /// Open client connections (at most `limits.max_connections`).
    pub connections: Gauge,
    /// Time to compose states (for concat: to process the context tokens), by method.
    pub compose_seconds: HistogramFamily,
    /// Time to read states from disk for a completion.
    pub load_seconds: Histogram,
    /// States read from disk.
    pub states_loaded: Counter,
    /// States served from the in-memory cache.
    pub cache_hits: Counter,
    /// Bytes held by the state cache.
    pub cache_bytes: Gauge,
    /// States recomputed from their tokens (a store with a state budget did not hold them).
    pub states_recomputed: Counter,
    /// The store's state budget, bytes (0: none), read when scraped.
    pub budget_bytes: Gauge,
    /// Bytes of state objects the budget holds.
    pub budget_held_bytes: Gauge,
    /// States queries found held, over the store's life (its ledger's count).
    pub budget_hits: Gauge,
    /// States queries had to recompute, over the store's life.
    pub budget_misses: Gauge,
    /// Contexts in the store.
    pub contexts: Gauge,
    /// Prompt tokens processed.
    pub prompt_tokens: Counter,
    /// The server's resident memory, bytes (read when scraped).
    pub resident_bytes: Gauge,
    /// The memory guard's limit, bytes (0: none).
    pub memory_limit_bytes: Gauge,
    /// Requests answered 503 because the server was over its memory limit.
    pub refused_memory: Counter,
    /// What the batching thread updates: tokens generated, generations cancelled by a client
    /// going away, time to first token, batch size and queue.
    pub(crate) batch: crate::batcher::BatchMetrics,
    /// What the prefix cache counts: hits, misses, tokens saved, states stored and evicted,
    /// bytes and states held.
    pub(crate) prefix: crate::prefix_cache::PrefixMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("picaso");
        let requests = Family::<Labels, Counter>::default();
        let request_seconds = HistogramFamily::new_with_constructor(seconds_histogram);
        let compose_seconds = HistogramFamily::new_with_constructor(seconds_histogram);
        let batch = crate::batcher::BatchMetrics {
            completion_tokens: Counter::default(),
            cancelled: Counter::default(),
            time_to_first_token_seconds: seconds_histogram(),
            active: Gauge::default(),
            queued: Gauge::default(),
            step_seconds: seconds_histogram(),
            step_sequences: Histogram::new(exponential_buckets(1.0, 2.0, 8)),
            prefill_seconds: seconds_histogram(),
            prefill_tokens: Histogram::new(exponential_buckets(16.0, 2.0, 8)),
            sample_seconds: seconds_histogram(),
        };
        let m = Self {
            requests,
            request_seconds,
            in_flight: Gauge::default(),
            connections: Gauge::default(),
            compose_seconds,
            load_seconds: seconds_histogram(),
            states_loaded: Counter::default(),
            cache_hits: Counter::default(),
            cache_bytes: Gauge::default(),
            states_recomputed: Counter::default(),
            budget_bytes: Gauge::default(),
            budget_held_bytes: Gauge::default(),
            budget_hits: Gauge::default(),
            budget_misses: Gauge::default(),
            contexts: Gauge::default(),
            prompt_tokens: Counter::default(),
            resident_bytes: Gauge::default(),
            memory_limit_bytes: Gauge::default(),
            refused_memory: Counter::default(),
            batch,
            prefix: crate::prefix_cache::PrefixMetrics::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "HTTP requests by endpoint, method and status", m.requests.clone());
        registry.register("request_seconds", "HTTP request latency by endpoint", m.request_seconds.clone());
        registry.register("requests_in_flight", "HTTP requests being served", m.in_flight.clone());
        registry.register("open_connections", "Client connections open", m.connections.clone());
        registry.register("compose_seconds", "Time to compose context states, by method", m.compose_seconds.clone());
        registry.register("state_load_seconds", "Time to read context states from disk", m.load_seconds.clone());
        registry.register(
            "time_to_first_token_seconds",
            "Time from a completion request to its first text",
            m.batch.time_to_first_token_seconds.clone(),
        );
        registry.register("states_loaded", "Context states read from disk", m.states_loaded.clone());
        registry.register("state_cache_hits", "Context states served from memory", m.cache_hits.clone());
        registry.register("state_cache_bytes", "Bytes held by the state cache", m.cache_bytes.clone());
        registry.register("contexts", "Contexts in the store", m.contexts.clone());
        registry.register(
            "states_recomputed",
            "States recomputed from their tokens because the store's budget did not hold them",
            m.states_recomputed.clone(),
        );
        registry.register("state_budget_bytes", "The store's state budget (0: none)", m.budget_bytes.clone());
        registry.register(
            "state_budget_held_bytes",
            "Bytes of state objects the budget holds",
            m.budget_held_bytes.clone(),
        );
        registry.register(
            "state_budget_hits",
            "States queries found held, over the store's life (recorded in the store)",
            m.budget_hits.clone(),
        );
        registry.register(
            "state_budget_misses",
            "States queries recomputed, over the store's life (recorded in the store)",
            m.budget_misses.clone(),
        );
        registry.register("prompt_tokens", "Prompt tokens processed", m.prompt_tokens.clone());
        registry.register("resident_memory_bytes", "The server's resident memory", m.resident_bytes.clone());
        registry.register(
            "memory_limit_bytes",
            "Resident memory above which new work is refused (0: no limit)",
            m.memory_limit_bytes.clone(),
        );
        registry.register(
            "refused_over_memory",
            "Requests answered 503 because the server was over its memory limit",
            m.refused_memory.clone(),
        );
        registry.register("completion_tokens", "Tokens generated", m.batch.completion_tokens.clone());
        registry.register(
            "generations_cancelled",
            "Generations stopped by a client going away",
            m.batch.cancelled.clone(),
        );
        registry.register("batch_active", "Generations advancing together in the batch", m.batch.active.clone());
        registry.register("batch_queued", "Generations waiting to join the batch", m.batch.queued.clone());
        registry.register(
            "batch_step_seconds",
            "Time of each batched decode step (one token of every generation in it)",
            m.batch.step_seconds.clone(),
        );
        registry.register(
            "batch_step_sequences",
            "Generations in each batched decode step",
            m.batch.step_sequences.clone(),
        );
        registry.register(
            "batch_prefill_seconds",
            "Time of each prefill pass over the prompts of joining generations",
            m.batch.prefill_seconds.clone(),
        );
        registry.register(
            "batch_prefill_tokens",
            "Prompt tokens in each prefill pass over joining generations",
            m.batch.prefill_tokens.clone(),
        );
        registry.register(
            "batch_sample_seconds",
            "Time per batch iteration to sample every generation's next token and hand out its text",
            m.batch.sample_seconds.clone(),
        );
        let p = &m.prefix;
        registry.register("prefix_cache_hits", "Prompts that continued from a stored prefix's state", p.hits.clone());
        registry.register("prefix_cache_misses", "Prompts that found no stored prefix", p.misses.clone());
        registry.register(
            "prefix_cache_tokens_saved",
            "Prompt tokens not prefilled because a stored prefix held them",
            p.tokens_saved.clone(),
        );
        registry.register("prefix_cache_stored", "Prefix states stored", p.stored.clone());
        registry.register(
            "prefix_cache_evictions",
            "Prefix states evicted to stay within the budget",
            p.evictions.clone(),
        );
        registry.register("prefix_cache_bytes", "Bytes held by the prefix cache", p.bytes.clone());
        registry.register("prefix_cache_entries", "Prefix states held", p.entries.clone());
        Self { registry, ..m }
    }
}

impl Metrics {
    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}
