//! What a context costs at query time: composing stored states (PICASO) against processing the
//! contexts' tokens (Concat), for k = 1..K contexts — with the states read from disk, cold
//! (evicted from the page cache) and warm — and the full time to first token of a prompt.

use std::path::Path;
use std::time::Instant;

use picaso_model::{Method, Model, StateDtype};
use rand::{Rng, SeedableRng};

use crate::error::Result;
use crate::query::{prepare, ContextMethod};
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
    pub method: Method,
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
    let store = Store::open_or_create(dir, &info)?;
    let vocab = model.config().vocab_size().min(model.tokenizer().map(|t| t.vocab_size()).unwrap_or(usize::MAX));
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let mut random_tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab as u32)).collect() };
    let zero = model.zero_state();
    let have = store.len();
    for i in have..opts.max_k {
        let tokens = random_tokens(opts.context_tokens);
        let state = model.prefill(&tokens, &zero)?;
        let item =
            NewContext { doc: "bench".into(), seg: i as u32, text: String::new(), tokens, embedding: vec![1.0], state };
        store.insert(&[item])?;
    }
    let prompt = random_tokens(opts.prompt_tokens.max(1));
    let ids: Vec<i64> = store.ids();
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
        let method = ContextMethod::Compose(opts.method);
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
