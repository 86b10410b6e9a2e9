//! What several commands share: where a store and a model are, the input tokens, sampling
//! flags, and loading each of them with an error that says what to pass instead.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use picaso_model::{GenerateOptions, LoadOptions, Model, State};

/// Where a store is.
#[derive(Args, Clone, Debug)]
pub(crate) struct DbArgs {
    /// The store: a folder (SQLite and state files inside), or postgres://user@host/db
    /// (metadata and vectors in PostgreSQL with pgvector, shared by several servers).
    #[arg(long)]
    pub db: String,
    /// Where state objects live, given when the store is created: a folder, or
    /// s3://bucket/prefix (configured by the AWS_* environment variables). Recorded in the
    /// store; later commands need only --db.
    #[arg(long)]
    pub states: Option<String>,
}

impl DbArgs {
    /// The parsed location.
    pub fn location(&self) -> Result<picaso_store::Location> {
        Ok(picaso_store::Location::parse(&self.db, self.states.as_deref())?)
    }
}

#[derive(Args, Clone)]
pub(crate) struct ModelArgs {
    /// Model folder (config.json + weights [+ tokenizer.json]) or a Hugging Face repo id;
    /// default: $PICASO_MODEL, else the bundled model.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// tokenizer.json to use instead of the model folder's.
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Engine: cpu (the fast CPU path), `cuda[:N]` (the GPU engine, Mamba-2; a build with the
    /// `cuda` feature), candle-cpu (the generic path, for checking), `candle-cuda[:N]` or metal
    /// (candle on a GPU; the `candle-cuda` / `metal` feature).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Storage of the large weight matrices on the cpu and cuda engines: f32 (exact) or bf16
    /// (half the memory; decode about twice as fast; log-probs move by a few hundredths of a nat).
    #[arg(long, default_value = "f32")]
    pub(crate) weights: picaso_model::WeightDtype,
}

impl ModelArgs {
    /// The model in `dir` with the default engine (for commands that compare several models).
    pub(crate) fn for_dir(dir: &str) -> Self {
        Self {
            model: Some(dir.to_string()),
            tokenizer: None,
            device: "cpu".into(),
            weights: picaso_model::WeightDtype::F32,
        }
    }
}

#[derive(Args)]
pub(crate) struct InputArgs {
    /// Text to tokenize.
    #[arg(long, conflicts_with = "token_ids", required_unless_present = "token_ids")]
    pub(crate) text: Option<String>,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub(crate) token_ids: Option<Vec<u32>>,
}

/// How generated tokens are picked (shared by `generate` and `query`).
#[derive(Args)]
pub(crate) struct SamplingArgs {
    /// Most new tokens.
    #[arg(long, default_value_t = 64)]
    pub(crate) max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Stop when this string appears (repeatable).
    #[arg(long)]
    pub(crate) stop: Vec<String>,
    /// Generate past the end-of-text token, up to --max-tokens.
    #[arg(long)]
    pub(crate) ignore_eos: bool,
}

impl SamplingArgs {
    pub(crate) fn options(self) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
        }
    }
}

/// Where the bundled model lives in a checkout (the training issue puts it there).
pub(crate) const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/picaso-mamba2");
/// Where the bundled Granite-4.0-H-shaped hybrid lives in a checkout.
const BUNDLED_HYBRID: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/picaso-hybrid");

/// The bundled hybrid's folder, if this checkout has it.
pub(crate) fn bundled_hybrid() -> Option<PathBuf> {
    let dir = PathBuf::from(BUNDLED_HYBRID);
    dir.join("config.json").is_file().then_some(dir)
}

/// A `NAME=VALUE` argument (a named model folder or log), both sides non-empty; `usage`
/// (e.g. "NAME=DIR, e.g. bptc=runs/bptc/model") says what to give instead.
pub(crate) fn parse_name_value(s: &str, usage: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, v)) if !n.is_empty() && !v.is_empty() => Ok((n.to_string(), v.to_string())),
        _ => Err(format!("{s:?}: give {usage}")),
    }
}

/// The model used when `--model` is not given: `$PICASO_MODEL`, else the bundled model.
pub(crate) fn default_model_dir() -> Result<PathBuf> {
    if let Some(m) = std::env::var_os("PICASO_MODEL") {
        return resolve_model_dir(&m.to_string_lossy());
    }
    let bundled = PathBuf::from(BUNDLED_MODEL);
    if bundled.join("config.json").is_file() {
        return Ok(bundled);
    }
    bail!(
        "no --model given and no bundled model at {} (it is not trained yet); pass --model DIR or a hub id, or set PICASO_MODEL",
        bundled.display()
    )
}

/// A local folder, or else a hub repo id (`owner/name`) to download.
pub(crate) fn resolve_model_dir(model: &str) -> Result<PathBuf> {
    if model.trim().is_empty() {
        bail!(
            "--model is empty: give a model folder or a Hugging Face repo id (or leave it out for the bundled model)"
        );
    }
    let path = Path::new(model);
    if path.exists() {
        return Ok(path.to_path_buf());
    }
    let looks_like_repo = model.split('/').count() == 2 && !model.starts_with('.') && !model.starts_with('/');
    if looks_like_repo {
        return Ok(picaso_model::hub::download(model)?);
    }
    bail!("{model}: model folder not found")
}

/// The engine `--device` names, refusing `--weights` other than f32 on candle's engines (the cpu
/// and GPU engines store their matrices as `--weights` says).
pub(crate) fn backend_for(device: &str, weights: picaso_model::WeightDtype) -> Result<picaso_model::Backend> {
    let backend: picaso_model::Backend = device.parse()?;
    if weights != picaso_model::WeightDtype::F32 && matches!(backend, picaso_model::Backend::Candle { .. }) {
        bail!(
            "--weights {:?} is the cpu and GPU engines' storage; --device {device} (candle) computes in its device's own precision (drop --weights, or use --device cpu)",
            format!("{weights:?}").to_lowercase(),
        );
    }
    Ok(backend)
}

pub(crate) fn load_model(args: &ModelArgs, need_tokenizer: bool) -> Result<Model> {
    let dir = match &args.model {
        Some(m) => resolve_model_dir(m)?,
        None => default_model_dir()?,
    };
    let backend = backend_for(&args.device, args.weights)?;
    let opts =
        LoadOptions { backend, weight_dtype: args.weights, tokenizer: args.tokenizer.clone(), skip_tokenizer: false };
    let model = Model::load(&dir, &opts)?;
    if need_tokenizer {
        model.tokenizer()?;
    }
    Ok(model)
}

pub(crate) fn tokens_of(model: &Model, input: &InputArgs) -> Result<Vec<u32>> {
    let tokens = match (&input.text, &input.token_ids) {
        (Some(t), _) => model.tokenizer()?.encode(t)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --text or --token-ids"),
    };
    model.check_tokens(&tokens)?;
    Ok(tokens)
}

pub(crate) fn load_state(model: &Model, path: Option<&Path>) -> Result<State> {
    match path {
        None => Ok(model.zero_state()),
        Some(p) => {
            let s = State::load(p)?;
            model.check_state(&s).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            Ok(s)
        }
    }
}

/// A count that must be 1 or more (a flag's value).
pub(crate) fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Sets `store`'s state budget when `--state-budget-mb` is given (0 removes it), kept by
/// `--state-budget-policy` (work by default): `ingest` and the evals that make a store.
pub(crate) fn apply_state_budget(
    store: &picaso_store::Store,
    model: &picaso_model::Model,
    mib: Option<f64>,
    policy: Option<picaso_store::Policy>,
) -> Result<()> {
    if let Some(mib) = mib {
        let budget = picaso_store::Budget::from_mib(mib, policy.unwrap_or_default())
            .map_err(|e| anyhow::anyhow!("--state-budget-mb {e}"))?;
        store.set_budget(budget, model)?;
    }
    Ok(())
}
