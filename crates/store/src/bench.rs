//! What a context costs at query time: composing stored states (PICASO) against processing the
//! contexts' tokens (Concat), for k = 1..K contexts — with the states read from disk, cold
//! (evicted from the page cache) and warm — and the full time to first token of a prompt.

use std::path::Path;
use std::time::Instant;

use picaso_model::{Composition, Method, Model, StateDtype};
use rand::{Rng, SeedableRng};

use crate::error::{Error, Result};
use crate::query::prepare;
use crate::store::{NewContext, Store, StoreInfo};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ContextCostOptions {
    /// Largest number of contexts.
    pub max_k: usize,
    /// Tokens per context.
    pub context_tokens: usize,
    /// Tokens of the prompt that follows the contexts.
    pub prompt_tokens: usize,
    /// Runs per measurement; medians are reported.
    pub repeats: usize,
    /// The composition.
    pub method: Composition,
    /// Precision of the state files.
    pub state_dtype: StateDtype,
}

/// One k: milliseconds, medians of `repeats` runs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ContextCostRow {
    /// Contexts.
    pub k: usize,
    /// Their tokens.
    pub context_tokens: usize,
    /// Concat: process the context tokens into a state.
    pub concat_ms: f64,
    /// PICASO: read the k states from disk after evicting them from the page cache.
    pub load_cold_ms: f64,
    /// PICASO: read the k states, page cache warm.
    pub load_warm_ms: f64,
    /// PICASO: compose the k loaded states.
    pub compose_ms: f64,
    /// `concat_ms` / (cold load + compose).
    pub speedup_cold: f64,
    /// `concat_ms` / (warm load + compose).
    pub speedup_warm: f64,
    /// Concat: time to the first token's logits after contexts + prompt.
    pub ttft_concat_ms: f64,
    /// PICASO, cold page cache: load, compose, process the prompt.
    pub ttft_picaso_cold_ms: f64,
    /// PICASO, warm page cache.
    pub ttft_picaso_warm_ms: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Asks the kernel to drop the file's cached pages, so the next read comes from the disk.
fn evict(path: &Path) {
    #[cfg(target_os = "linux")]
    if let Ok(f) = std::fs::File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on a valid descriptor; failure only means a warmer "cold" run.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = path;
}

/// Builds a store of `max_k` random-token contexts in `dir` and measures each k.
pub fn context_cost(model: &Model, dir: &Path, opts: &ContextCostOptions) -> Result<Vec<ContextCostRow>> {
    let info = StoreInfo { fingerprint: model.fingerprint().to_string(), dim: 1, state_dtype: opts.state_dtype };
    // Only a store of this benchmark's own random contexts, of this length, can be reused.
    let not_ours = |why: String| {
        Error::Input(format!(
            "{}: {why}; bench-context fills a store of its own random contexts: give a new folder (or one an \
             earlier bench-context run with the same --context-tokens made), or leave --db out",
            dir.display()
        ))
    };
    if let Ok(existing) = Store::open(dir) {
        if existing.info().dim != 1 {
            return Err(not_ours(format!(
                "holds a store of real contexts ({}-dimensional embeddings)",
                existing.info().dim
            )));
        }
    }
    let store = Store::open_or_create(dir, &info)?;
    for id in store.ids()? {
        let n = store.get(id)?.n_tokens;
        if n != opts.context_tokens {
            return Err(not_ours(format!(
                "its context {id} has {n} tokens, not --context-tokens {}",
                opts.context_tokens
            )));
        }
    }
    let vocab = model.config().vocab_size().min(model.tokenizer().map(|t| t.vocab_size()).unwrap_or(usize::MAX));
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut random_tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab as u32)).collect() };
    let zero = model.zero_state();
    let have = store.len()?;
    for i in have..opts.max_k {
        let tokens = random_tokens(opts.context_tokens);
        let state = model.prefill(&tokens, &zero)?;
        let item = NewContext {
            doc: "bench".into(),
            seg: i as u32,
            text: String::new(),
            tokens,
            embedding: vec![1.0],
            state,
            metadata: Default::default(),
        };
        store.insert(&[item])?;
    }
    let prompt = random_tokens(opts.prompt_tokens.max(1));
    let ids: Vec<i64> = store.ids()?;
    let reps = opts.repeats.max(1);
    let mut rows = Vec::new();
    for k in 1..=opts.max_k.min(ids.len()) {
        let ids = &ids[..k];
        let (mut tokens, mut files) = (Vec::new(), Vec::new());
        for &id in ids {
            let rec = store.get(id)?;
            tokens.extend(rec.tokens);
            files.push(dir.join(rec.state_file));
        }
        let method = Method::Compose(opts.method);
        let (mut concat, mut ttft_concat) = (Vec::new(), Vec::new());
        let (mut load_cold, mut load_warm, mut compose) = (Vec::new(), Vec::new(), Vec::new());
        let (mut ttft_cold, mut ttft_warm) = (Vec::new(), Vec::new());
        model.prefill(&tokens, &zero)?; // warm-up
        for _ in 0..reps {
            let t0 = Instant::now();
            model.prefill(&tokens, &zero)?;
            concat.push(t0.elapsed().as_secs_f64());
            let all: Vec<u32> = tokens.iter().chain(&prompt).copied().collect();
            let t0 = Instant::now();
            model.prefill_last_logits(&all, &zero)?;
            ttft_concat.push(t0.elapsed().as_secs_f64());
            for cold in [true, false] {
                if cold {
                    files.iter().for_each(|f| evict(f));
                }
                let t0 = Instant::now();
                let p = prepare(&store, model, ids, method, None)?;
                model.prefill_last_logits(&prompt, &p.state)?;
                let ttft = t0.elapsed().as_secs_f64();
                let (load, ttft_list) =
                    if cold { (&mut load_cold, &mut ttft_cold) } else { (&mut load_warm, &mut ttft_warm) };
                load.push(p.load_seconds);
                ttft_list.push(ttft);
                compose.push(p.compose_seconds);
            }
        }
        let ms = |v: Vec<f64>| 1e3 * median(v);
        let (concat_ms, load_cold_ms, load_warm_ms, compose_ms) =
            (ms(concat), ms(load_cold), ms(load_warm), ms(compose));
        rows.push(ContextCostRow {
            k,
            context_tokens: tokens.len(),
            concat_ms,
            load_cold_ms,
            load_warm_ms,
            compose_ms,
            speedup_cold: concat_ms / (load_cold_ms + compose_ms),
            speedup_warm: concat_ms / (load_warm_ms + compose_ms),
            ttft_concat_ms: ms(ttft_concat),
            ttft_picaso_cold_ms: ms(ttft_cold),
            ttft_picaso_warm_ms: ms(ttft_warm),
        });
    }
    Ok(rows)
}

/// What [`backend_latency`] measures.
#[derive(Debug, Clone)]
pub struct BackendLatencyOptions {
    /// Context counts to measure.
    pub ks: Vec<usize>,
    /// Queries per k (stored embeddings of random contexts, seed 0); medians are reported.
    pub queries: usize,
    /// The composition.
    pub method: Composition,
    /// Byte budget of the warm state cache measured next to no cache.
    pub cache_bytes: usize,
}

/// One k on one backend: medians over the queries, milliseconds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BackendLatencyRow {
    /// Contexts retrieved and composed.
    pub k: usize,
    /// Nearest-neighbour search (the catalog's index in use).
    pub retrieve_ms: f64,
    /// Reading and verifying the k states from the backend, no cache.
    pub load_ms: f64,
    /// Composing them.
    pub compose_ms: f64,
    /// retrieve + load + compose, no cache.
    pub total_ms: f64,
    /// The same request with every state already in the cache.
    pub total_cached_ms: f64,
    /// Exhaustive search, for comparison with an approximate index.
    pub retrieve_exact_ms: f64,
    /// Share of the exact top k that the index in use returned (1 for exact search).
    pub recall: f64,
}

/// Retrieval + state loading + composition latency of `store` per k, with no state cache and
/// with a warm one, and the recall of its search against an exhaustive scan.
pub fn backend_latency(store: &Store, model: &Model, opts: &BackendLatencyOptions) -> Result<Vec<BackendLatencyRow>> {
    let ids = store.ids()?;
    if ids.is_empty() {
        return Err(crate::Error::Input(format!("store {} is empty; ingest contexts first", store.location())));
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let queries: Vec<Vec<f32>> = (0..opts.queries.max(1))
        .map(|_| store.embedding(ids[rng.random_range(0..ids.len())]))
        .collect::<Result<_>>()?;
    let method = Method::Compose(opts.method);
    let mut rows = Vec::new();
    for &k in &opts.ks {
        let (mut retrieve, mut retrieve_exact, mut load, mut compose, mut total, mut cached) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut recall = Vec::new();
        let cache = crate::StateCache::new(opts.cache_bytes);
        for q in &queries {
            let t0 = Instant::now();
            let hits = store.search(q, k)?;
            let t_retrieve = t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let exact = store.search_exact(q, k)?;
            retrieve_exact.push(t1.elapsed().as_secs_f64() * 1e3);
            let found = hits.iter().filter(|h| exact.iter().any(|e| e.0 == h.0)).count();
            recall.push(found as f64 / exact.len().max(1) as f64);
            let hit_ids: Vec<i64> = hits.iter().rev().map(|h| h.0).collect();
            let p = prepare(store, model, &hit_ids, method, None)?;
            retrieve.push(t_retrieve * 1e3);
            load.push(p.load_seconds * 1e3);
            compose.push(p.compose_seconds * 1e3);
            total.push((t_retrieve + p.load_seconds + p.compose_seconds) * 1e3);
            prepare(store, model, &hit_ids, method, Some(&cache))?; // fills the cache
            let t2 = Instant::now();
            let hits = store.search(q, k)?;
            let hit_ids: Vec<i64> = hits.iter().rev().map(|h| h.0).collect();
            prepare(store, model, &hit_ids, method, Some(&cache))?;
            cached.push(t2.elapsed().as_secs_f64() * 1e3);
        }
        let mean_recall = recall.iter().sum::<f64>() / recall.len() as f64;
        rows.push(BackendLatencyRow {
            k,
            retrieve_ms: median(retrieve),
            load_ms: median(load),
            compose_ms: median(compose),
            total_ms: median(total),
            total_cached_ms: median(cached),
            retrieve_exact_ms: median(retrieve_exact),
            recall: mean_recall,
        });
    }
    Ok(rows)
}
