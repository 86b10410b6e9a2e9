//! Commands on a model and state files, no store: `info`, `score`, `state`, `generate`,
//! `compose`, `weights`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use picaso_model::{compose, counted, generate, Composition, State, StateDtype};
use serde_json::json;

use crate::args::{load_model, load_state, tokens_of, InputArgs, ModelArgs, SamplingArgs};

#[derive(Args)]
pub(crate) struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: InputArgs,
    /// Continue from this state file (the first token is still context, not scored).
    #[arg(long)]
    state: Option<PathBuf>,
    /// Print JSON: {"token_ids", "logprobs", "mean_nll"}.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct StateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    input: InputArgs,
    /// Continue from this state file instead of the empty state.
    #[arg(long)]
    from: Option<PathBuf>,
    /// Where to write the state (safetensors).
    #[arg(long)]
    out: PathBuf,
    /// Codec of the SSM states, conv tails, keys and values on disk: f32, bf16, int8 or int4
    /// (log-decays stay f32).
    #[arg(long, default_value = "f32")]
    dtype: StateDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt (at least one token).
    #[arg(long)]
    prompt: String,
    /// Start from this state file (e.g. a composed state).
    #[arg(long)]
    state: Option<PathBuf>,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Print JSON instead of streaming text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct ComposeArgs {
    /// soup, caso, picaso-s or picaso-r.
    #[arg(long)]
    method: Composition,
    /// State files, in order.
    #[arg(long, num_args = 1.., required = true)]
    state_files: Vec<PathBuf>,
    /// Order of the contexts as indices into --state-files, e.g. 2,0,1 (last = nearest the prompt).
    #[arg(long, value_delimiter = ',')]
    order: Option<Vec<usize>>,
    /// Where to write the composed state.
    #[arg(long)]
    out: PathBuf,
    /// Codec on disk: f32, bf16, int8 or int4 (the inputs may be in any codec).
    #[arg(long, default_value = "f32")]
    dtype: StateDtype,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub(crate) struct WeightsArgs {
    /// soup, caso, picaso-s or picaso-r.
    #[arg(long)]
    method: Composition,
    /// One log-decay per context (<= 0), comma-separated, in order.
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, required = true)]
    log_decays: Vec<f64>,
    /// Print JSON: {"method", "weights"}.
    #[arg(long)]
    json: bool,
}

pub(crate) fn info(a: InfoArgs) -> Result<()> {
    let model = load_model(&a.model, false)?;
    let c = model.config();
    let bytes = model.zero_state().nbytes_f32();
    let shape = model.state_shape();
    // A hybrid's attention layers keep every context token's keys and values.
    let kv_per_token = shape.attention.as_ref().map_or(0, |a| 4 * 2 * a.token_len() * a.layers.len());
    let v = json!({
        "model": model.dir(),
        "fingerprint": model.fingerprint(),
        "arch": c.arch(),
        "format": c.format(),
        "config": c.to_hf_json(),
        "parameters": model.n_params(),
        "state_bytes_f32": bytes,
        // Per codec, log-decays in f32 and int8/int4 scales included; a hybrid's keys and
        // values beside them after 100 and 1,000 context tokens.
        "state_bytes": picaso_model::StateDtype::ALL.iter().map(|&c| (c.name().to_string(), json!({
            "0": shape.nbytes(c, 0), "100": shape.nbytes(c, 100), "1000": shape.nbytes(c, 1000),
        }))).collect::<serde_json::Map<_, _>>(),
        "state_bytes_bf16": shape.nbytes(picaso_model::StateDtype::Bf16, 0),
        "kv_bytes_f32_per_token": kv_per_token,
        "tokenizer": model.tokenizer().ok().map(|t| t.vocab_size()),
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("model        {}", model.dir().display());
        println!("fingerprint  {}", model.fingerprint());
        let layers = match c {
            picaso_model::ModelConfig::GraniteHybrid(h) => format!("{}: mamba2 and attention layers", h.family.name()),
            picaso_model::ModelConfig::Jamba(_) => "jamba: mamba1 and attention layers".to_string(),
            _ => c.arch().to_string(),
        };
        println!("format       {layers} ({:?})", c.format());
        println!("shape        {}", c.describe());
        println!("parameters   {} ({:.1} M)", model.n_params(), model.n_params() as f64 / 1e6);
        let mib = |c, t| shape.nbytes(c, t) as f64 / 1048576.0;
        let per_codec = |t| {
            picaso_model::StateDtype::ALL
                .iter()
                .map(|&c| format!("{:.2} {c}", mib(c, t)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        println!("state        MiB per context: {}", per_codec(0));
        if kv_per_token > 0 {
            println!("             with keys and values of 1,000 tokens: {}", per_codec(1000));
        }
        if kv_per_token > 0 {
            println!(
                "             + {:.1} KiB f32 per context token ({:.1} KiB bf16): the attention layers' keys and values",
                kv_per_token as f64 / 1024.0,
                kv_per_token as f64 / 2048.0
            );
        }
        match model.tokenizer() {
            Ok(t) => println!("tokenizer    {} ids", t.vocab_size()),
            Err(e) => println!("tokenizer    none ({e})"),
        }
    }
    Ok(())
}

pub(crate) fn score(a: ScoreArgs) -> Result<()> {
    let model = load_model(&a.model, a.input.text.is_some())?;
    let tokens = tokens_of(&model, &a.input)?;
    let start = load_state(&model, a.state.as_deref())?;
    let scored = model.score(&tokens, &start)?;
    let n = scored.logprobs.len();
    let mean_nll = if n == 0 { None } else { Some(-scored.logprobs.iter().map(|&v| v as f64).sum::<f64>() / n as f64) };
    if a.json {
        println!("{}", json!({"token_ids": tokens, "logprobs": scored.logprobs, "mean_nll": mean_nll}));
    } else {
        for (i, lp) in scored.logprobs.iter().enumerate() {
            println!("{:>6} {:>8} {:>10.4}", i + 1, tokens[i + 1], lp);
        }
        match mean_nll {
            Some(m) => println!("mean NLL {m:.4} nats over {n} tokens (perplexity {:.2})", m.exp()),
            None => println!("one token: nothing scored (the first token is context)"),
        }
    }
    Ok(())
}

pub(crate) fn state(a: StateArgs) -> Result<()> {
    let model = load_model(&a.model, a.input.text.is_some())?;
    let tokens = tokens_of(&model, &a.input)?;
    let start = load_state(&model, a.from.as_deref())?;
    let t0 = Instant::now();
    let s = model.prefill(&tokens, &start)?;
    let secs = t0.elapsed().as_secs_f64();
    s.save(&a.out, a.dtype)?;
    let bytes = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    if a.json {
        println!(
            "{}",
            json!({"out": a.out.to_string_lossy(), "n_tokens": s.n_tokens, "new_tokens": tokens.len(), "bytes": bytes, "fingerprint": s.fingerprint, "seconds": secs})
        );
    } else {
        println!(
            "wrote {} ({} tokens, {:.2} MiB) in {:.3} s",
            a.out.display(),
            s.n_tokens,
            bytes as f64 / 1048576.0,
            secs
        );
    }
    Ok(())
}

pub(crate) fn generate_cmd(a: GenerateArgs) -> Result<()> {
    let model = load_model(&a.model, true)?;
    let prompt = model.tokenizer()?.encode(&a.prompt)?;
    if prompt.is_empty() {
        bail!("--prompt must contain at least one token");
    }
    let start = load_state(&model, a.state.as_deref())?;
    let opts = a.sampling.options();
    let t0 = Instant::now();
    let mut first_token = None;
    let mut out = std::io::stdout();
    let g = generate(&model, &prompt, &start, &opts, |piece| {
        first_token.get_or_insert_with(|| t0.elapsed().as_secs_f64());
        // A closed stdout (`| head`) stops generation.
        a.json || out.write_all(piece.as_bytes()).and_then(|()| out.flush()).is_ok()
    })?;
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        println!(
            "{}",
            json!({"text": g.text, "token_ids": g.tokens, "stop_reason": g.stop_reason, "prompt_tokens": prompt.len(),
                   "seconds": secs, "time_to_first_token": first_token})
        );
    } else {
        println!();
    }
    Ok(())
}

pub(crate) fn compose_cmd(a: ComposeArgs) -> Result<()> {
    let states = a.state_files.iter().map(|p| Ok(State::load(p)?)).collect::<Result<Vec<_>>>()?;
    let refs: Vec<&State> = states.iter().collect();
    let t0 = Instant::now();
    let composed = compose(a.method, &refs, a.order.as_deref())?;
    let secs = t0.elapsed().as_secs_f64();
    composed.save(&a.out, a.dtype)?;
    if a.json {
        println!(
            "{}",
            json!({"out": a.out.to_string_lossy(), "method": a.method.name(), "contexts": states.len(), "n_tokens": composed.n_tokens, "compose_seconds": secs})
        );
    } else {
        println!(
            "wrote {} ({} of {}, {:.2} ms)",
            a.out.display(),
            a.method,
            counted(states.len(), "state"),
            secs * 1e3
        );
    }
    Ok(())
}

pub(crate) fn weights_cmd(a: WeightsArgs) -> Result<()> {
    let w = picaso_compose::weights(a.method, &a.log_decays)?;
    if a.json {
        println!("{}", json!({"method": a.method.name(), "weights": w}));
    } else {
        for (i, (ld, wi)) in a.log_decays.iter().zip(&w).enumerate() {
            println!("context {i}: log-decay {ld:>10.4}  weight {wi:.6}");
        }
    }
    Ok(())
}
