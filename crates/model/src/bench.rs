//! Throughput measurements behind `picaso bench`: prefill (tokens → state), scoring, decode,
//! and composition against a plain read of the same bytes. Best of `repeats` runs after a
//! warm-up, wall-clock, all cores.

use std::time::Instant;

use rayon::prelude::*;

use crate::composition::{compose, compose_into};
use crate::cpu::matmul::Bf16Kernel;
use crate::error::Result;
use crate::model::Model;
use crate::state::State;
use picaso_compose::Composition;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Tokens in the prefill and scoring runs.
    pub prompt_tokens: usize,
    /// Tokens generated one at a time in the decode run.
    pub decode_tokens: usize,
    /// Runs per measurement; the best is reported.
    pub repeats: usize,
    /// States composed in the composition run (0 skips it).
    pub compose_n: usize,
    /// Sequences decoded together in the batched decode run (0 skips it).
    pub decode_batch: usize,
}

/// Results, in the units BENCHMARKS.md reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// Prefill to a state, no logits (what ingestion costs), tokens/s.
    pub prefill_tokens_per_s: f64,
    /// Prefill with log-probabilities of every token, tokens/s.
    pub score_tokens_per_s: f64,
    /// Greedy decode from the prefilled state, tokens/s.
    pub decode_tokens_per_s: f64,
    /// Greedy decode of `decode_batch` sequences together, one batched step per token
    /// ([`Model::step_batch`]: what a server's continuous batching runs), tokens/s of all
    /// sequences; `None` when skipped.
    pub batched_decode_tokens_per_s: Option<f64>,
    /// The same with the states' SSM values held as f16 ([`crate::SsmValue`]; `serve
    /// --decode-state f16`); `None` when skipped or where the engine cannot.
    pub batched_decode_f16_state_tokens_per_s: Option<f64>,
    /// Sequences in the batched decode run.
    pub decode_batch: usize,
    /// `decode_batch` prompts of `prompt_tokens` each prefilled in one forward pass, each to
    /// its first logits ([`Model::prefill_batch`], copies of the zero state included: a server
    /// starts requests that join together this way, in place), tokens/s of all prompts; `None`
    /// when skipped.
    pub batched_prefill_tokens_per_s: Option<f64>,
    /// Milliseconds per composition of `compose_n` states into a fresh state, per method.
    pub compose_ms: Vec<(String, f64)>,
    /// The same into a reused output state (no allocation, no page faults).
    pub compose_into_ms: Vec<(String, f64)>,
    /// Milliseconds to read the same `compose_n` states once (a parallel sum): the floor.
    pub read_states_ms: f64,
    /// Bytes of one state (f32).
    pub state_bytes: usize,
    /// Peak resident memory of the process so far, bytes (Linux only).
    pub peak_rss_bytes: Option<u64>,
    /// Worker threads.
    pub threads: usize,
    /// The kernel bf16 weights run on this CPU ([`Bf16Kernel`]).
    pub bf16_kernel: &'static str,
    /// The CPU's model name (Linux: /proc/cpuinfo), so a number says where it was measured.
    pub cpu: Option<String>,
}

/// Seconds of the fastest of `repeats` runs of `f` after a warm-up; what `f` returns is dropped
/// inside the timed run.
fn best_of<T>(repeats: usize, mut f: impl FnMut() -> Result<T>) -> Result<f64> {
    best_of_with(repeats, || (), |()| f().map(drop))
}

/// As [`best_of`] for work that consumes fresh inputs (decode advances its states): `setup`
/// makes them before the clock starts, and what `f` returns is dropped after it stops.
fn best_of_with<I, T>(repeats: usize, mut setup: impl FnMut() -> I, mut f: impl FnMut(I) -> Result<T>) -> Result<f64> {
    f(setup())?; // warm-up
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let input = setup();
        let t0 = Instant::now();
        let out = f(input)?;
        best = best.min(t0.elapsed().as_secs_f64());
        drop(out);
    }
    Ok(best)
}

/// Runs the measurements on `model` with deterministic pseudo-random tokens.
pub fn run(model: &Model, opts: &BenchOptions) -> Result<BenchReport> {
    let vocab = model.config().vocab_size().min(50_000) as u64;
    let tokens: Vec<u32> =
        (0..opts.prompt_tokens as u64).map(|i| ((i * 2_654_435_761 + 12_345) % vocab) as u32).collect();
    let zero = model.zero_state();
    let prefill = best_of(opts.repeats, || model.prefill(&tokens, &zero))?;
    let score = best_of(opts.repeats, || model.score(&tokens, &zero))?;
    let (logits, state) = model.prefill_last_logits(&tokens, &zero)?;
    // Decode runs in a session, as `generate` does: on a GPU the state stays on the device.
    let decode = best_of_with(
        opts.repeats,
        || model.session(vec![state.clone()]),
        |session| {
            let mut session = session?;
            let mut next = argmax(&logits);
            for _ in 0..opts.decode_tokens {
                next = argmax(&session.step(&[next])?);
            }
            Ok(())
        },
    )?;
    let decode_per_token = decode / opts.decode_tokens.max(1) as f64;
    let batched_decode_tokens_per_s = match opts.decode_batch {
        0 => None,
        b => Some(batched_decode(model, &state, b, opts, vocab)?),
    };
    let batched_decode_f16_state_tokens_per_s = match opts.decode_batch {
        0 => None,
        _ if !model.runs_f16_states() => None,
        b => Some(batched_decode_f16(model, &state.to_f16(), b, opts, vocab)?),
    };
    let batched_prefill_tokens_per_s = match opts.decode_batch {
        0 => None,
        b => Some(batched_prefill(model, &tokens, b, opts, vocab)?),
    };
    let mut compose_ms = Vec::new();
    let mut compose_into_ms = Vec::new();
    let mut read_states_ms = 0.0;
    if opts.compose_n > 0 {
        let states: Vec<State> = (0..opts.compose_n)
            .map(|i| {
                let seg: Vec<u32> = tokens.iter().skip(i * 7).take(16).copied().collect();
                model.prefill(&seg, &zero)
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&State> = states.iter().collect();
        read_states_ms = 1e3 * best_of(opts.repeats.max(5), || Ok(read_all(&refs)))?;
        for m in Composition::ALL {
            let t = best_of(opts.repeats.max(5), || compose(m, &refs, None))?;
            compose_ms.push((m.name().to_string(), 1e3 * t));
            let mut out = model.zero_state();
            let t = best_of(opts.repeats.max(5), || compose_into(m, &refs, None, &mut out))?;
            compose_into_ms.push((m.name().to_string(), 1e3 * t));
        }
    }
    Ok(BenchReport {
        prefill_tokens_per_s: opts.prompt_tokens as f64 / prefill,
        score_tokens_per_s: opts.prompt_tokens as f64 / score,
        decode_tokens_per_s: 1.0 / decode_per_token,
        batched_decode_tokens_per_s,
        batched_decode_f16_state_tokens_per_s,
        decode_batch: opts.decode_batch,
        batched_prefill_tokens_per_s,
        compose_ms,
        compose_into_ms,
        read_states_ms,
        state_bytes: zero.nbytes_f32(),
        peak_rss_bytes: peak_rss(),
        threads: rayon::current_num_threads(),
        bf16_kernel: Bf16Kernel::detect().name(),
        cpu: cpu_model(),
    })
}

/// The CPU's model name from /proc/cpuinfo (Linux), for saying where a number was measured.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// Tokens/s of `b` sequences decoded together from `state`, one batched step per token. Each
/// sequence starts with its own first token, so the sequences differ (as a server's do) from
/// the first step on.
fn batched_decode(model: &Model, state: &State, b: usize, opts: &BenchOptions, vocab: u64) -> Result<f64> {
    let firsts: Vec<u32> = (0..b as u64).map(|i| ((i * 40_503 + 7) % vocab) as u32).collect();
    let t = best_of_with(
        opts.repeats,
        || model.session(vec![state.clone(); b]),
        |session| {
            let mut session = session?;
            let mut next = firsts.clone();
            for _ in 0..opts.decode_tokens {
                let logits = session.step(&next)?;
                next = logits.chunks_exact(logits.len() / b).map(argmax).collect();
            }
            Ok(())
        },
    )?;
    Ok((b * opts.decode_tokens.max(1)) as f64 / t)
}

/// [`batched_decode`] with f16 SSM values, as `serve --state-dtype f16` holds them.
fn batched_decode_f16(
    model: &Model,
    state: &State<half::f16>,
    b: usize,
    opts: &BenchOptions,
    vocab: u64,
) -> Result<f64> {
    let firsts: Vec<u32> = (0..b as u64).map(|i| ((i * 40_503 + 7) % vocab) as u32).collect();
    let t = best_of_with(
        opts.repeats,
        || (0..b).map(|_| state.clone()).collect::<Vec<_>>(),
        |mut states| {
            let mut next = firsts.clone();
            for _ in 0..opts.decode_tokens {
                let mut refs: Vec<&mut State<half::f16>> = states.iter_mut().collect();
                let logits = model.step_batch(&next, &mut refs)?;
                next = logits.chunks_exact(logits.len() / b).map(argmax).collect();
            }
            Ok(states)
        },
    )?;
    Ok((b * opts.decode_tokens.max(1)) as f64 / t)
}

/// Tokens/s of `b` different prompts of `tokens.len()` tokens each, prefilled together from
/// the zero state to their first logits.
fn batched_prefill(model: &Model, tokens: &[u32], b: usize, opts: &BenchOptions, vocab: u64) -> Result<f64> {
    let prompts: Vec<Vec<u32>> =
        (0..b as u64).map(|i| tokens.iter().map(|&t| ((t as u64 + i * 7_919) % vocab) as u32).collect()).collect();
    let seqs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let zero = model.zero_state();
    let zeros = vec![&zero; b];
    let t = best_of(opts.repeats, || model.prefill_batch(&seqs, &zeros))?;
    Ok((b * tokens.len()) as f64 / t)
}

/// Greedy decoding's pick, as `generate` makes it.
fn argmax(v: &[f32]) -> u32 {
    crate::generate::argmax(v) as u32
}

/// Sums every float of every state once (SSM states, conv tails and log-decays, all of which
/// composing reads), in parallel: the memory-bandwidth floor of composing.
/// Sixteen independent lanes let the compiler vectorise (a plain f32 `sum` cannot reorder).
fn read_all(states: &[&State]) -> f32 {
    let arrays: Vec<&[f32]> =
        states.iter().flat_map(|s| s.layers.iter()).flat_map(|l| [&l.ssm[..], &l.conv[..], &l.log_decay[..]]).collect();
    arrays.par_iter().flat_map(|a| a.par_chunks(16 * 1024)).map(picaso_compose::lane_sum).sum()
}

fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// One codec's row of [`codecs`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct CodecBench {
    /// The codec.
    pub codec: &'static str,
    /// Bytes of one state file's tensors in it.
    pub state_bytes: usize,
    /// Milliseconds to compose the states (PICASO-R) straight from their file bytes into a
    /// reused f32 state: the best of the repeats, page cache warm.
    pub compose_ms: f64,
    /// Milliseconds to read the same bytes once (a parallel sum): the floor of reading them.
    pub read_ms: f64,
    /// Milliseconds to read them and write the f32 output once: the floor of the memory
    /// traffic composing makes.
    pub read_write_ms: f64,
}

/// Composition of `n` states of `shape` (keys and values of `tokens` tokens for a hybrid) in
/// every codec, each from its own file bytes in memory, against the floor of reading those
/// bytes. Random values: speed does not depend on them.
pub fn codecs(shape: &crate::StateShape, n: usize, tokens: usize, repeats: usize) -> Result<Vec<CodecBench>> {
    use crate::state::{KvState, MappedState, StateDtype};
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 40) as f32 / (1u64 << 24) as f32
    };
    let states: Vec<State> = (0..n)
        .map(|_| {
            let mut s = State::zeros(shape.clone(), "bench");
            for l in &mut s.layers {
                l.ssm.iter_mut().for_each(|x| *x = next() - 0.5);
                l.conv.iter_mut().for_each(|x| *x = next() - 0.5);
                l.log_decay.iter_mut().for_each(|x| *x = -next());
            }
            let kv = shape.attention.as_ref().map_or(0, |a| a.token_len() * tokens);
            for a in &mut s.attention {
                *a = KvState {
                    keys: (0..kv).map(|_| next() - 0.5).collect(),
                    values: (0..kv).map(|_| next() - 0.5).collect(),
                };
            }
            s.n_tokens = tokens as u64;
            s.position = tokens as u64;
            s
        })
        .collect();
    let mut out = State::zeros(shape.clone(), "bench");
    let mut rows = Vec::new();
    for codec in StateDtype::ALL {
        let mapped: Vec<MappedState> =
            states.iter().map(|s| MappedState::from_buffer(s.to_bytes(codec)?)).collect::<Result<_>>()?;
        let views: Vec<_> = mapped.iter().map(MappedState::view).collect();
        let compose =
            best_of(repeats, || crate::composition::compose_views_into(Composition::PicasoR, &views, None, &mut out))?;
        let files: Vec<&[u8]> = mapped.iter().map(MappedState::bytes).collect();
        let read = best_of(repeats.max(5), || Ok(read_bytes(&files)))?;
        let out_len: usize = out.layers.iter().map(|l| l.ssm.len()).sum();
        let read_write = best_of(repeats.max(5), || {
            let sum = read_bytes(&files);
            out.layers.par_iter_mut().for_each(|l| l.ssm.par_chunks_mut(16 * 1024).for_each(|c| c.fill(sum as f32)));
            Ok(out_len)
        })?;
        rows.push(CodecBench {
            codec: codec.name(),
            state_bytes: shape.nbytes(codec, tokens),
            compose_ms: 1e3 * compose,
            read_ms: 1e3 * read,
            read_write_ms: 1e3 * read_write,
        });
    }
    Ok(rows)
}

/// Reads every byte of `files` once, in parallel (8-byte words, lanes the compiler vectorises).
fn read_bytes(files: &[&[u8]]) -> u64 {
    files
        .par_iter()
        .flat_map(|f| f.par_chunks(64 * 1024))
        .map(|c| {
            let mut lanes = [0u64; 8];
            let words = c.chunks_exact(64);
            let rest: u64 = words.remainder().iter().map(|&b| b as u64).sum();
            for w in words {
                for (j, l) in lanes.iter_mut().enumerate() {
                    *l = l.wrapping_add(u64::from_le_bytes(w[8 * j..8 * j + 8].try_into().expect("8 bytes")));
                }
            }
            lanes.iter().fold(rest, |a, &l| a.wrapping_add(l))
        })
        .reduce(|| 0, u64::wrapping_add)
}
