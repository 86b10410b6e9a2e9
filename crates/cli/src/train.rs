//! `picaso train pretrain`: corpora → tokenizer → packed token streams → a trained Mamba-2
//! folder (`OUT/model`, loadable with `--model`), resumable from `OUT/checkpoint`.

use picaso_model::counted;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use picaso_model::Mamba2Config;
use picaso_train::corpus::{read_corpus, CorpusSpec};
use picaso_train::pretrain::{pretrain, PretrainConfig, TokenData};
use serde::Deserialize;

#[derive(Subcommand)]
pub enum TrainCommand {
    /// Pretrain a Mamba-2 from text corpora (resumes OUT/checkpoint if present).
    Pretrain(PretrainArgs),
    /// Fine-tune a model to use composed states (BPTC or BP2C) on a store of WikiText halves
    /// (resumes OUT/checkpoint if present).
    Compose(ComposeArgs),
    /// Draw a training log (JSON lines with tokens, loss and optional val_loss, as
    /// `scripts/train_gpu.py` writes) as a loss chart.
    Plot(PlotArgs),
    /// Draw what the context-use check logged during training (the loss drop a held-out
    /// paragraph's continuation gets from its previous paragraph, and from a random one, in
    /// nats/token) for one or more training logs, and print it as a table.
    PlotContext(PlotContextArgs),
}

#[derive(Args)]
pub struct PlotContextArgs {
    /// NAME=LOG: a training log with context-use checks: `scripts/train_gpu.py`'s JSON lines,
    /// a `progress.json` of `picaso train pretrain`, or a model folder holding either. Repeat
    /// to compare runs.
    #[arg(long = "log", required = true, value_parser = named_log)]
    logs: Vec<(String, String)>,
    /// Chart to write (PNG).
    #[arg(long)]
    out: PathBuf,
}

fn named_log(s: &str) -> std::result::Result<(String, String), String> {
    crate::args::parse_name_value(s, "NAME=PATH, e.g. v3=models/picaso-mamba2/train-log.jsonl")
}

#[derive(Args)]
pub struct PlotArgs {
    /// Training log: one JSON object per line with `tokens`, `loss` and optionally `val_loss`.
    #[arg(long)]
    log: PathBuf,
    /// Chart to write (PNG).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
pub struct ComposeArgs {
    /// bptc (backprop through the composition: context states recomputed with gradients) or
    /// bp2c (stored states, stop-gradient: cheaper per step).
    #[arg(long)]
    objective: picaso_train::compose::Objective,
    /// Store of training passages ingested with `--segment halves` by the starting model
    /// (e.g. WikiText-2 train; never the test split you evaluate on). Not used with a config
    /// that generates recall episodes (a `recall` section).
    #[arg(long)]
    db: Option<String>,
    /// Where the store's state objects live (see `picaso ingest`).
    #[arg(long, requires = "db")]
    states: Option<String>,
    #[command(flatten)]
    model: crate::args::ModelArgs,
    /// The run's JSON config (see models/README.md).
    #[arg(long)]
    config: PathBuf,
    /// Output folder: checkpoint/, finetune.csv, loss.png, model/.
    #[arg(long)]
    out: PathBuf,
    /// Stop after this many steps in this call (the run resumes later).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Examples per forward pass (default: the whole batch). The gradients of a batch's
    /// micro-batches are summed, so the steps are the same; a smaller value needs less memory
    /// (BPTC of the bundled model at k = 10 holds 24 GB for a batch of 8 in one pass).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    micro_batch: Option<u64>,
    /// Recompute the contexts' states with --model from the stored tokens (a store ingested
    /// by another model with the same tokenizer; retrieval uses the stored embeddings). The
    /// result equals a store this model ingested.
    #[arg(long)]
    restate: bool,
}

/// The fine-tuning config file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ComposeFile {
    batch: usize,
    steps: u64,
    warmup: u64,
    lr: f64,
    min_lr: f64,
    #[serde(default = "clip")]
    clip: f64,
    #[serde(default)]
    weight_decay: Option<f64>,
    /// k is drawn uniformly from 0..=max_k per batch.
    #[serde(default = "ten")]
    max_k: usize,
    #[serde(default)]
    seed: u64,
    val_every: u64,
    /// k of the validation loss.
    #[serde(default = "five")]
    val_k: usize,
    /// Passages held out for validation (every n-th of the store).
    #[serde(default = "val_passages")]
    val_passages: usize,
    checkpoint_every: u64,
    #[serde(default = "chunk")]
    chunk: usize,
    /// Smallest k drawn (1 when every example's first context holds its answer).
    #[serde(default)]
    min_k: usize,
    /// Fine-tune on generated recall episodes (the model's synthetic recall vocabulary)
    /// instead of a store.
    #[serde(default)]
    recall: Option<RecallEpisodes>,
}

/// The `recall` section of a fine-tuning config: each example asks for one fact of its first
/// context, among max_k − 1 other contexts of facts.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecallEpisodes {
    /// Facts per context.
    facts: usize,
    /// Training examples generated (validation: `val_passages` more).
    episodes: usize,
}

fn ten() -> usize {
    10
}
fn five() -> usize {
    5
}
fn val_passages() -> usize {
    64
}

#[derive(Args)]
pub struct PretrainArgs {
    /// A corpus, KIND:PATH (text, kjv, brown, nlp-corpus, gcide, wikitext); repeat for several.
    /// Not used with a config that generates its data (a `recall` section).
    #[arg(long)]
    corpus: Vec<CorpusSpec>,
    /// The run's JSON config (architecture and optimisation; see models/README.md).
    #[arg(long)]
    config: PathBuf,
    /// Output folder: tokenizer.json, checkpoint/, loss.csv, model/.
    #[arg(long)]
    out: PathBuf,
    /// Use this tokenizer.json instead of training a BPE of the config's `vocab` on the corpora.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Stop after this many steps in this call (the run resumes later).
    #[arg(long)]
    stop_after: Option<u64>,
    /// When OUT has no checkpoint, start from this model folder instead of fresh weights (e.g.
    /// the bundled model on a new machine; its progress.json gives the step reached).
    #[arg(long)]
    warm_start: Option<PathBuf>,
    /// Train on this token stream instead of the corpora's training text: the run tokenizer's
    /// ids as little-endian u16 (`.u16`) or u32 (`.u32`), e.g. `scripts/pack_neighbours.py`'s
    /// reordered stream (in-context pretraining). Validation and the context-use pairs still
    /// come from the corpora; give the tokenizer the stream was made with (--tokenizer).
    #[arg(long)]
    train_stream: Option<PathBuf>,
}

/// The config file: the architecture (vocabulary from the tokenizer) and the run's settings.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunFile {
    d_model: usize,
    n_layer: usize,
    d_state: usize,
    headdim: usize,
    #[serde(default = "two")]
    expand: usize,
    #[serde(default = "one")]
    n_groups: usize,
    #[serde(default = "four")]
    d_conv: usize,
    /// Vocabulary of the BPE trained on the corpora (ignored with --tokenizer).
    #[serde(default = "vocab")]
    vocab: usize,
    /// Share of documents held out for validation.
    #[serde(default = "val_fraction")]
    val_fraction: f64,
    seq_len: usize,
    batch: usize,
    steps: u64,
    warmup: u64,
    lr: f64,
    min_lr: f64,
    #[serde(default = "clip")]
    clip: f64,
    #[serde(default)]
    weight_decay: Option<f64>,
    #[serde(default)]
    seed: u64,
    val_every: u64,
    val_sequences: usize,
    checkpoint_every: u64,
    #[serde(default = "chunk")]
    chunk: usize,
    /// `random` (offsets with replacement) or `epochs` (each window once per epoch).
    #[serde(default)]
    sampler: picaso_train::pretrain::Sampler,
    #[serde(default)]
    init: picaso_train::pretrain::InitOptions,
    /// Targets before this window position do not count.
    #[serde(default)]
    loss_from: usize,
    /// `f32` (default) or `bf16`: the training step's matrix products with bf16 operands on
    /// AMX tiles (f32 on CPUs without them; the run log says which ran).
    #[serde(default)]
    matmul: picaso_train::cpu::ops::Matmul,
    /// Held-out paragraph pairs for the context-use check at each validation.
    #[serde(default)]
    context_pairs: usize,
    /// Train the tokenizer on the first documents holding this many MB of text (0: all).
    #[serde(default)]
    tokenizer_mb: usize,
    /// Generate multi-query associative recall sequences instead of reading corpora.
    #[serde(default)]
    recall: Option<RecallData>,
}

/// The `recall` section of a config: synthetic recall sequences (see `picaso eval recall`),
/// each exactly one training window long, scored on their answers only.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RecallData {
    /// Key tokens `k0…`.
    keys: usize,
    /// Value tokens `v0…`.
    values: usize,
    /// Facts per context.
    facts: usize,
    /// Contexts per sequence are drawn from 1..=max_k.
    max_k: usize,
    /// Sequences generated (the validation share is held out of them).
    sequences: usize,
}

impl RunFile {
    /// The run's config, its vocabulary still unset (0): it is the tokenizer's.
    fn run_config(&self) -> PretrainConfig {
        let model = Mamba2Config {
            d_model: self.d_model,
            n_layer: self.n_layer,
            vocab_size: 0,
            d_state: self.d_state,
            headdim: self.headdim,
            nheads: self.d_model * self.expand / self.headdim,
            expand: self.expand,
            n_groups: self.n_groups,
            d_conv: self.d_conv,
            ..Mamba2Config::tiny(self.n_layer, self.d_conv)
        };
        let mut adamw = picaso_train::optim::AdamWConfig::default();
        if let Some(wd) = self.weight_decay {
            adamw.weight_decay = wd;
        }
        PretrainConfig {
            model,
            seq_len: self.seq_len,
            batch: self.batch,
            steps: self.steps,
            warmup: self.warmup,
            lr: self.lr,
            min_lr: self.min_lr,
            clip: self.clip,
            adamw,
            seed: self.seed,
            val_every: self.val_every,
            val_sequences: self.val_sequences,
            checkpoint_every: self.checkpoint_every,
            chunk: self.chunk,
            sampler: self.sampler,
            init: self.init.clone(),
            loss_from: self.loss_from,
            train_stream: None,
            matmul: self.matmul,
        }
    }

    /// Every this many-th document (or recall sequence) is held out for validation.
    fn held_out_every(&self) -> usize {
        (1.0 / self.val_fraction).round() as usize
    }
}

/// The error for a validation split shorter than one window (`seq_len + 1` tokens), saying
/// what would lengthen it: the split is one in `every` of `units` documents (or sequences),
/// whole, so a single long document cannot be split however val_fraction is set.
fn short_validation(val_tokens: usize, seq_len: usize, units: usize, every: usize, unit: &str) -> anyhow::Error {
    let problem = format!(
        "the validation split has {val_tokens} tokens, fewer than one window of seq_len + 1 = {}: it holds out one {unit} in {every} (by val_fraction), whole, and there are {units}",
        seq_len + 1
    );
    let fix = if units < 2 {
        format!("give at least two {unit}s (in a text corpus, paragraphs separated by a blank line or .txt files)")
    } else if units < every {
        format!("raise val_fraction to at least 1/{units} or give more {unit}s")
    } else {
        format!("raise val_fraction, give more or longer {unit}s, or lower seq_len")
    };
    anyhow::anyhow!("{problem}; {fix}")
}

fn two() -> usize {
    2
}
fn one() -> usize {
    1
}
fn four() -> usize {
    4
}
fn vocab() -> usize {
    8192
}
fn val_fraction() -> f64 {
    0.01
}
fn clip() -> f64 {
    1.0
}
fn chunk() -> usize {
    64
}

pub fn run(cmd: TrainCommand) -> Result<()> {
    match cmd {
        TrainCommand::Pretrain(a) => pretrain_cmd(a),
        TrainCommand::Compose(a) => compose_cmd(a),
        TrainCommand::Plot(a) => plot_cmd(a),
        TrainCommand::PlotContext(a) => plot_context_cmd(a),
    }
}

fn pretrain_cmd(a: PretrainArgs) -> Result<()> {
    let text =
        std::fs::read_to_string(&a.config).with_context(|| format!("reading --config {}", a.config.display()))?;
    let f: RunFile = serde_json::from_str(&text).with_context(|| format!("--config {}", a.config.display()))?;
    let shape_ok = f.d_model > 0
        && f.n_layer > 0
        && f.d_state > 0
        && f.headdim > 0
        && f.n_groups > 0
        && f.d_conv > 1
        && (f.d_model * f.expand).is_multiple_of(f.headdim)
        && (f.d_model * f.expand / f.headdim).is_multiple_of(f.n_groups);
    if !shape_ok {
        bail!(
            "--config: sizes must be positive, d_conv at least 2, d_model·expand a multiple of headdim and the heads a multiple of n_groups"
        );
    }
    if !(f.val_fraction > 0.0 && f.val_fraction <= 0.5) {
        bail!(
            "--config: val_fraction = {}: the share of documents held out for validation must be above 0 and at most 0.5 (every second document)",
            f.val_fraction
        );
    }
    // Checked before the corpora are read and tokenized (minutes for a large one); the
    // vocabulary is the tokenizer's, set below.
    let mut config = f.run_config();
    config.validate().with_context(|| format!("--config {}", a.config.display()))?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;

    let (tok_path, mut data) = match &f.recall {
        Some(r) => recall_data(&a, &f, r)?,
        None => text_data(&a, &f)?,
    };
    let tokenizer = picaso_model::TextTokenizer::from_file(&tok_path)?;
    let train_stream = match &a.train_stream {
        Some(_) if f.recall.is_some() => {
            bail!("--train-stream replaces a corpus's training text; a config with a \"recall\" section generates its own")
        }
        Some(path) => {
            let (ids, fingerprint) = read_train_stream(path, tokenizer.vocab_size())?;
            eprintln!(
                "{}: {} training tokens in place of the corpora's {}",
                path.display(),
                ids.len(),
                data.train.len()
            );
            data.train = ids;
            Some(fingerprint)
        }
        None => None,
    };
    config.model.vocab_size = tokenizer.vocab_size().div_ceil(8) * 8;
    config.train_stream = train_stream;
    let need = config.estimated_peak_bytes();
    if let Some(avail) = available_memory_bytes() {
        if need > avail {
            bail!(
                "--config: this run needs about {:.1} GiB of memory (batch·seq_len = {} tokens, vocab {}), but {:.1} GiB is available; lower batch or seq_len",
                need as f64 / 1073741824.0,
                config.batch * config.seq_len,
                config.model.vocab_size,
                avail as f64 / 1073741824.0
            );
        }
    }
    let n_params = picaso_train::pretrain::init_weights(&config.model, 0).n_params();
    eprintln!("{} parameters ({:.1} MiB in f32)", n_params, n_params as f64 * 4.0 / 1048576.0);
    let bar = indicatif::ProgressBar::new(config.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} · {msg} · ETA {eta}")
            .expect("valid template"),
    );
    // Without a terminal (a log file, CI) the bar is hidden: print a line every 25 steps.
    let plain = bar.is_hidden();
    let start = match &a.warm_start {
        Some(dir) => picaso_train::pretrain::Start::Warm(dir),
        None => picaso_train::pretrain::Start::Fresh,
    };
    let history = pretrain(&config, &data, &a.out, a.stop_after, start, |p| {
        bar.set_position(p.row.step);
        let mut val = p.row.val_loss.map(|v| format!(" · val {v:.3}")).unwrap_or_default();
        if let Some(c) = &p.row.context {
            val += &format!(
                " · context gain {:+.2}% (random {:+.2}%, recall {:.2}→{:.2})",
                100.0 * c.gain,
                100.0 * c.random_gain,
                c.recall.0,
                c.recall.1
            );
        }
        let msg = format!("loss {:.3}{val} · {:.0} tokens/s", p.row.loss, p.tokens_per_s);
        if plain && (p.row.step % 25 == 0 || p.row.val_loss.is_some()) {
            let left =
                (p.total - p.row.step) as f64 * (config.batch * config.seq_len) as f64 / p.tokens_per_s.max(1e-9);
            eprintln!("step {}/{} · {msg} · ETA {:.0} min", p.row.step, p.total, left / 60.0);
        }
        bar.set_message(msg);
    })?;
    bar.finish();
    if history.is_empty() {
        // `--stop-after 0` on a new run: the tokenizer and the token cache are the product.
        eprintln!(
            "stopped before the first step; the tokenizer is {} and the token streams are cached in {}",
            tok_path.display(),
            a.out.join("tokens.bin").display()
        );
        return Ok(());
    }

    // The loss curve as CSV, and the model as a loadable folder.
    let csv_path = a.out.join("loss.csv");
    let mut csv = std::fs::File::create(&csv_path).with_context(|| format!("writing {}", csv_path.display()))?;
    writeln!(csv, "step,tokens,seconds,lr,grad_norm,train_loss,val_loss,context_gain,random_gain")?;
    for r in &history {
        let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
        let (gain, random) =
            r.context.as_ref().map(|c| (c.gain.to_string(), c.random_gain.to_string())).unwrap_or_default();
        writeln!(
            csv,
            "{},{},{:.3},{:e},{:.4},{:.6},{val},{gain},{random}",
            r.step, r.tokens, r.seconds, r.lr, r.grad_norm, r.loss
        )?;
    }
    write_loss_png(&a.out.join("loss.png"), &history)?;
    let ckpt = a.out.join("checkpoint");
    let model_dir = a.out.join("model");
    let weights = picaso_model::Mamba2Weights::load(&ckpt, &config.model)?;
    weights.save_pretrained(&model_dir, &config.model)?;
    std::fs::copy(&tok_path, model_dir.join("tokenizer.json"))?;
    picaso_train::pretrain::write_progress(&a.out, &model_dir)?;
    let last = history.last();
    println!(
        "{}",
        serde_json::json!({
            "step": last.map(|r| r.step), "steps": config.steps, "train_loss": last.map(|r| r.loss),
            "val_loss": history.iter().rev().find_map(|r| r.val_loss), "seconds": last.map(|r| r.seconds),
            "parameters": n_params, "model": model_dir.to_string_lossy(), "loss_csv": csv_path.to_string_lossy(),
            "loss_png": a.out.join("loss.png").to_string_lossy(),
        })
    );
    Ok(())
}

/// The tokenizer (given, trained earlier, or trained now) and the token streams of the text
/// corpora; every ⌈1/val_fraction⌉-th document is held out for validation.
fn text_data(a: &PretrainArgs, f: &RunFile) -> Result<(PathBuf, TokenData)> {
    if a.corpus.is_empty() {
        bail!("give at least one --corpus KIND:PATH (or a config with a \"recall\" section, which generates its data)");
    }
    // Documents, in the order given.
    let mut docs = Vec::new();
    for spec in &a.corpus {
        let d = read_corpus(spec)?;
        let bytes: usize = d.iter().map(String::len).sum();
        eprintln!("{spec}: {}, {:.1} MB", counted(d.len(), "document"), bytes as f64 / 1e6);
        docs.extend(d);
    }

    // Tokenizer: given, already trained by an earlier call, or trained now.
    let tok_path = a.out.join("tokenizer.json");
    if let Some(t) = &a.tokenizer {
        std::fs::copy(t, &tok_path).with_context(|| format!("copying --tokenizer {}", t.display()))?;
    } else if !tok_path.is_file() {
        let mut take = docs.len();
        if f.tokenizer_mb > 0 {
            let mut bytes = 0;
            take = docs
                .iter()
                .position(|d| {
                    bytes += d.len();
                    bytes > f.tokenizer_mb * 1_000_000
                })
                .map_or(docs.len(), |i| i + 1);
        }
        eprintln!("training a byte-level BPE of {} entries on {take} documents…", f.vocab);
        let tok = picaso_train::bpe::train_bpe(&docs[..take], f.vocab).map_err(anyhow::Error::msg)?;
        tok.save(&tok_path, false).map_err(|e| anyhow::anyhow!("saving {}: {e}", tok_path.display()))?;
    }
    let tokenizer = picaso_model::TextTokenizer::from_file(&tok_path)?;
    let eos = tokenizer.eos().context("the tokenizer has no end-of-text token (<|endoftext|>)")?;

    // Token streams; every ⌈1/val_fraction⌉-th document is held out for validation. Encoding
    // tens of millions of tokens takes minutes, so a resumed run reads them from OUT/tokens.bin
    // when the tokenizer, the corpora and the split are the same.
    let every = f.held_out_every();
    let key = {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(&std::fs::read(&tok_path)?);
        for spec in &a.corpus {
            h.update(spec.to_string().as_bytes());
        }
        for d in &docs {
            h.update(&(d.len() as u64).to_le_bytes());
        }
        h.update(format!("{every}/{}/{}", f.context_pairs, f.seed).as_bytes());
        format!("{:032x}", h.digest128())
    };
    let cache = a.out.join("tokens.bin");
    let data = match read_token_cache(&cache, &key) {
        Some(d) => {
            eprintln!("token streams read from {}", cache.display());
            d
        }
        None => {
            eprintln!("tokenizing {}…", counted(docs.len(), "document"));
            let encoded = tokenizer
                .inner()
                .encode_batch(docs.iter().map(String::as_str).collect::<Vec<_>>(), false)
                .map_err(|e| anyhow::anyhow!("tokenizing the corpora: {e}"))?;
            let mut data = TokenData::default();
            let mut held_out = Vec::new();
            for (i, e) in encoded.iter().enumerate() {
                let stream = if i % every == every - 1 {
                    held_out.push(i);
                    &mut data.val
                } else {
                    &mut data.train
                };
                stream.extend_from_slice(e.get_ids());
                stream.push(eos);
            }
            drop(encoded);
            data.pairs = context_pairs(&tokenizer, &docs, &held_out, f.context_pairs, f.seed)?;
            write_token_cache(&cache, &key, &data)?;
            data
        }
    };
    let n_docs = docs.len();
    drop(docs);
    if data.val.len() < f.seq_len + 1 {
        return Err(short_validation(data.val.len(), f.seq_len, n_docs, every, "document"));
    }
    eprintln!(
        "{} training tokens, {} validation tokens, {} held-out paragraph pairs",
        data.train.len(),
        data.val.len(),
        data.pairs.len()
    );
    Ok((tok_path, data))
}

/// The synthetic recall vocabulary and its generated token streams: sequence i is held out
/// for validation when i % ⌈1/val_fraction⌉ is the last residue; every sequence is seq_len − 1
/// tokens and an end-of-text, so the `epochs` sampler's windows are whole sequences.
fn recall_data(a: &PretrainArgs, f: &RunFile, r: &RecallData) -> Result<(PathBuf, TokenData)> {
    use picaso_eval::recall::task::{
        answer_mask, min_training_words, synthetic_tokenizer, training_text, Form, Task, QUERY,
    };
    if !a.corpus.is_empty() || a.tokenizer.is_some() {
        bail!(
            "--config has a \"recall\" section, which generates its data and vocabulary: drop --corpus and --tokenizer"
        );
    }
    if f.sampler != picaso_train::pretrain::Sampler::Epochs {
        bail!("--config: recall sequences must be trained whole; set \"sampler\": \"epochs\"");
    }
    let task = Task { form: Form::Synthetic, facts: r.facts, keys: r.keys, values: r.values };
    let tok = synthetic_tokenizer(r.keys, r.values);
    let tok_path = a.out.join("tokenizer.json");
    tok.save(&tok_path, false).map_err(|e| anyhow::anyhow!("saving {}: {e}", tok_path.display()))?;
    let eos = tok.token_to_id("<|endoftext|>").expect("the recall vocabulary has an end-of-text token");
    let query = tok.token_to_id(QUERY).expect("the recall vocabulary has a query token");
    // A sequence is seq_len − 1 words and an end-of-text.
    if r.max_k == 0 {
        bail!("--config: recall.max_k = 0: a sequence needs at least 1 context");
    }
    let need = min_training_words(r.facts, r.max_k) + 1;
    if f.seq_len < need {
        bail!(
            "--config: seq_len = {}: a recall sequence of up to {} contexts (max_k) of {} facts, a query and an end-of-text needs a seq_len of at least {need}; raise seq_len or lower max_k or facts",
            f.seq_len,
            r.max_k,
            r.facts
        );
    }
    let every = f.held_out_every();
    let mut data = TokenData::default();
    for i in 0..r.sequences {
        let text = training_text(&task, f.seed, i, r.max_k, f.seq_len - 1).context("--config: recall")?;
        let enc =
            tok.encode(text.as_str(), false).map_err(|e| anyhow::anyhow!("tokenizing recall sequence {i}: {e}"))?;
        let stream = if i % every == every - 1 { &mut data.val } else { &mut data.train };
        stream.extend_from_slice(enc.get_ids());
        stream.push(eos);
    }
    if data.val.len() < f.seq_len + 1 {
        return Err(short_validation(data.val.len(), f.seq_len, r.sequences, every, "sequence"));
    }
    data.train_mask = answer_mask(&data.train, query);
    data.val_mask = answer_mask(&data.val, query);
    let answers = data.train_mask.iter().filter(|&&m| m).count();
    eprintln!(
        "{} recall sequences of {} tokens (k ≤ {}, {} facts per context): {} training tokens ({answers} answers), {} validation tokens",
        r.sequences, f.seq_len, r.max_k, r.facts, data.train.len(), data.val.len()
    );
    Ok((tok_path, data))
}

/// A `--train-stream` file's token ids (u16 or u32 by its extension), checked against the
/// vocabulary, and its fingerprint.
fn read_train_stream(path: &std::path::Path, vocab: usize) -> Result<(Vec<u32>, String)> {
    let width = match path.extension().and_then(|e| e.to_str()) {
        Some("u16") => 2,
        Some("u32") => 4,
        _ => bail!(
            "--train-stream {}: name the id width in the extension, .u16 or .u32 (little-endian token ids)",
            path.display()
        ),
    };
    let bytes = std::fs::read(path).with_context(|| format!("reading --train-stream {}", path.display()))?;
    if bytes.len() % width != 0 {
        bail!(
            "--train-stream {}: {} bytes is not a whole number of {width}-byte ids; is it a .u{} file?",
            path.display(),
            bytes.len(),
            8 * width
        );
    }
    let ids: Vec<u32> = if width == 2 {
        bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect()
    } else {
        bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        bail!(
            "--train-stream {}: token {i} is id {id}, outside the tokenizer's {vocab} entries; make the stream with the run's tokenizer (--tokenizer)",
            path.display()
        );
    }
    Ok((ids, format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes))))
}

/// The token streams cached under `key`, if the file holds them.
fn read_token_cache(path: &std::path::Path, key: &str) -> Option<TokenData> {
    let bytes = std::fs::read(path).ok()?;
    let header_len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..8 + header_len)?).ok()?;
    if header["key"] != key {
        return None;
    }
    let body = bytes.get(8 + header_len..)?;
    let ids: Vec<u32> = body.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let mut at = 0;
    let mut take = |n: usize| -> Option<Vec<u32>> {
        let v = ids.get(at..at + n)?.to_vec();
        at += n;
        Some(v)
    };
    let train = take(header["train"].as_u64()? as usize)?;
    let val = take(header["val"].as_u64()? as usize)?;
    let mut pairs = Vec::new();
    for p in header["pairs"].as_array()? {
        let n = |i: usize| p.get(i).and_then(|v| v.as_u64()).map(|v| v as usize);
        pairs.push(picaso_train::pretrain::ContextPair {
            previous: take(n(0)?)?,
            random: take(n(1)?)?,
            query: take(n(2)?)?,
            continuation: take(n(3)?)?,
        });
    }
    Some(TokenData { train, val, pairs, ..Default::default() })
}

/// Writes the token streams under `key` (aside, then renamed).
fn write_token_cache(path: &std::path::Path, key: &str, data: &TokenData) -> Result<()> {
    let pairs: Vec<[usize; 4]> =
        data.pairs.iter().map(|p| [p.previous.len(), p.random.len(), p.query.len(), p.continuation.len()]).collect();
    let header = serde_json::to_vec(&serde_json::json!({
        "key": key, "train": data.train.len(), "val": data.val.len(), "pairs": pairs,
    }))?;
    let mut out = Vec::with_capacity(8 + header.len() + 4 * (data.train.len() + data.val.len()));
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    let all = data.train.iter().chain(&data.val).chain(
        data.pairs.iter().flat_map(|p| p.previous.iter().chain(&p.random).chain(&p.query).chain(&p.continuation)),
    );
    for id in all {
        out.extend_from_slice(&id.to_le_bytes());
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, &out).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Up to `n` held-out paragraph pairs (consecutive paragraphs of one held-out document, the
/// second of at least 16 tokens), spread evenly, each with a paragraph of another held-out
/// document as the control. Paragraphs are tokenized as they appear in the stream, followed
/// by their blank line.
fn context_pairs(
    tokenizer: &picaso_model::TextTokenizer,
    docs: &[String],
    held_out: &[usize],
    n: usize,
    seed: u64,
) -> Result<Vec<picaso_train::pretrain::ContextPair>> {
    use rand::{Rng, SeedableRng};
    if n == 0 {
        return Ok(Vec::new());
    }
    let encode = |p: &str| -> Result<Vec<u32>> {
        Ok(tokenizer
            .inner()
            .encode(format!("{p}\n\n"), false)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
            .get_ids()
            .to_vec())
    };
    let paragraphs: Vec<Vec<&str>> =
        held_out.iter().map(|&i| picaso_train::corpus::prose_paragraphs(&docs[i])).collect();
    let mut candidates = Vec::new();
    for (d, ps) in paragraphs.iter().enumerate() {
        for j in 1..ps.len() {
            candidates.push((d, j));
        }
    }
    let with_text: Vec<usize> = (0..paragraphs.len()).filter(|&d| !paragraphs[d].is_empty()).collect();
    if with_text.len() < 2 || candidates.is_empty() {
        return Ok(Vec::new());
    }
    let stride = (candidates.len() as f64 / n as f64).max(1.0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xc0de);
    let mut pairs = Vec::new();
    let mut at = 0.0;
    while (at as usize) < candidates.len() && pairs.len() < n {
        let (d, j) = candidates[at as usize];
        at += stride;
        let cur = encode(paragraphs[d][j])?;
        if cur.len() < 16 {
            continue;
        }
        let other = loop {
            let o = with_text[rng.random_range(0..with_text.len())];
            if o != d {
                break o;
            }
        };
        let random = encode(paragraphs[other][rng.random_range(0..paragraphs[other].len())])?;
        let half = cur.len() / 2;
        pairs.push(picaso_train::pretrain::ContextPair {
            previous: encode(paragraphs[d][j - 1])?,
            random,
            query: cur[..half].to_vec(),
            continuation: cur[half..].to_vec(),
        });
    }
    Ok(pairs)
}

/// A loss chart: `rows` as (x, training loss, validation loss), the training loss averaged
/// over `windows` equal runs of rows (single batches are noisy), validation points as they are.
/// A row without a training loss (a validation when a run was stopped) adds only its point.
fn loss_chart(
    path: &std::path::Path,
    chart: &picaso_eval::plot::Chart<'_>,
    names: [&str; 2],
    rows: &[(f64, Option<f64>, Option<f64>)],
    windows: usize,
) -> Result<()> {
    use picaso_eval::plot::{line_chart, Series};
    let trained: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.1.map(|l| (r.0, l))).collect();
    let window = (trained.len() / windows).max(1);
    let train: Vec<(f64, f64)> = trained
        .chunks(window)
        .map(|c| (c.last().expect("chunks are non-empty").0, c.iter().map(|r| r.1).sum::<f64>() / c.len() as f64))
        .collect();
    let val: Vec<(f64, f64)> = rows.iter().filter_map(|r| r.2.map(|v| (r.0, v))).collect();
    let mut series = vec![Series::line(names[0], train)];
    if !val.is_empty() {
        series.push(Series::line(names[1], val));
    }
    line_chart(path, chart, &series).with_context(|| format!("drawing {}", path.display()))
}

fn plot_cmd(a: PlotArgs) -> Result<()> {
    #[derive(Deserialize)]
    struct Row {
        tokens: u64,
        loss: Option<f64>,
        val_loss: Option<f64>,
    }
    let text = std::fs::read_to_string(&a.log).with_context(|| format!("reading --log {}", a.log.display()))?;
    let rows: Vec<(f64, Option<f64>, Option<f64>)> =
        json_lines::<Row>(&text, &a.log, "an object with tokens, loss and val_loss")?
            .into_iter()
            .map(|r| (r.tokens as f64 / 1e6, r.loss, r.val_loss))
            .collect();
    if !rows.iter().any(|r| r.1.is_some()) {
        bail!("--log {}: no rows with a training loss", a.log.display());
    }
    draw_pretrain_loss(&a.out, &rows)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// The objects of a JSON-lines `--log` (blank lines skipped); a line that is not `want` is an
/// error naming the file and line.
fn json_lines<T: serde::de::DeserializeOwned>(text: &str, file: &std::path::Path, want: &str) -> Result<Vec<T>> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).with_context(|| format!("--log {} line {}: want {want}", file.display(), i + 1))
        })
        .collect()
}

/// One logged context-use check: tokens seen and the three mean losses.
struct ContextPoint {
    tokens: u64,
    none: f64,
    previous: f64,
    random: f64,
}

/// The context-use rows of a training log: the JSON lines `scripts/train_gpu.py` writes
/// (`context_use`), or the `progress.json` that `picaso train pretrain` writes into its model
/// folder (`history` rows with `context`); a folder is read through whichever of the two it
/// holds. Rows without a check (most steps) are skipped.
fn read_context_points(path: &std::path::Path) -> Result<Vec<ContextPoint>> {
    #[derive(Deserialize)]
    struct Losses {
        none: f64,
        previous: f64,
        random: f64,
    }
    #[derive(Deserialize)]
    struct Row {
        tokens: u64,
        #[serde(alias = "context_use")]
        context: Option<Losses>,
    }
    #[derive(Deserialize)]
    struct Progress {
        history: Vec<Row>,
    }
    let file =
        if path.is_dir() {
            ["train-log.jsonl", "progress.json"].iter().map(|f| path.join(f)).find(|f| f.is_file()).with_context(
                || format!("--log {}: a folder without train-log.jsonl or progress.json", path.display()),
            )?
        } else {
            path.to_path_buf()
        };
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading --log {}", file.display()))?;
    let rows = match serde_json::from_str::<Progress>(&text) {
        Ok(p) => p.history,
        Err(_) => json_lines::<Row>(
            &text,
            &file,
            "an object with tokens and optionally context_use {none, previous, random} (or a progress.json \
             with a history)",
        )?,
    };
    let points: Vec<ContextPoint> = rows
        .into_iter()
        .filter_map(|r| {
            r.context.map(|c| ContextPoint { tokens: r.tokens, none: c.none, previous: c.previous, random: c.random })
        })
        .collect();
    if points.is_empty() {
        bail!(
            "--log {}: no row has a context-use check (the trainers log one at each validation step \
             when the corpus keeps paragraphs)",
            file.display()
        );
    }
    Ok(points)
}

fn plot_context_cmd(a: PlotContextArgs) -> Result<()> {
    use picaso_eval::plot::{line_chart, Chart, Series};
    // Every log is read and the chart drawn before the table starts, so a bad input leaves no
    // half-printed table.
    let logs = a
        .logs
        .iter()
        .map(|(name, path)| Ok((name, read_context_points(std::path::Path::new(path))?)))
        .collect::<Result<Vec<_>>>()?;
    let mut series = Vec::new();
    for (name, points) in &logs {
        let curve = |f: &dyn Fn(&ContextPoint) -> f64| -> Vec<(f64, f64)> {
            points.iter().map(|p| (p.tokens as f64 / 1e6, f(p))).collect()
        };
        series.push(Series::line(format!("{name}: previous paragraph"), curve(&|p| p.none - p.previous)));
        series.push(Series::line(format!("{name}: random paragraph"), curve(&|p| p.none - p.random)));
    }
    let chart = Chart {
        title: "Loss drop from a paragraph before the query, during training",
        x: "tokens (millions)",
        y: "none − with it (nats/token)",
        log_x: false,
        whole_x: false,
    };
    line_chart(&a.out, &chart, &series).with_context(|| format!("drawing {}", a.out.display()))?;
    println!("| run | tokens (M) | none | previous − none | previous gain | random − none |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, points) in &logs {
        for p in points {
            println!(
                "| {name} | {:.1} | {:.4} | {:+.4} | {:.2}% | {:+.4} |",
                p.tokens as f64 / 1e6,
                p.none,
                p.previous - p.none,
                100.0 * (p.none - p.previous) / p.none,
                p.random - p.none
            );
        }
    }
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// Training loss (mean over windows of 1% of the run) and validation loss against tokens seen.
fn write_loss_png(path: &std::path::Path, history: &[picaso_train::pretrain::LogRow]) -> Result<()> {
    let rows: Vec<(f64, Option<f64>, Option<f64>)> =
        history.iter().map(|r| (r.tokens as f64 / 1e6, Some(r.loss), r.val_loss)).collect();
    draw_pretrain_loss(path, &rows)
}

/// The pretraining chart of (million tokens, training loss, validation loss) rows.
fn draw_pretrain_loss(path: &std::path::Path, rows: &[(f64, Option<f64>, Option<f64>)]) -> Result<()> {
    let chart = picaso_eval::plot::Chart {
        title: "Pretraining loss",
        x: "tokens (millions)",
        y: "loss (nats/token)",
        log_x: false,
        whole_x: false,
    };
    loss_chart(path, &chart, ["train", "validation"], rows, 100)
}

fn compose_cmd(a: ComposeArgs) -> Result<()> {
    let text =
        std::fs::read_to_string(&a.config).with_context(|| format!("reading --config {}", a.config.display()))?;
    let f: ComposeFile = serde_json::from_str(&text).with_context(|| format!("--config {}", a.config.display()))?;
    let model = crate::args::load_model(&a.model, true)?;
    let config = compose_config(&a, &f, &model)?;
    // Checked before the examples are gathered (retrieval over a whole store).
    config.validate().with_context(|| format!("--config {}", a.config.display()))?;
    let data = match (&f.recall, &a.db) {
        (Some(r), None) => recall_examples(&model, &f, r)?,
        (None, Some(db)) => {
            store_examples(&model, &crate::args::DbArgs { db: db.clone(), states: a.states.clone() }, &f, a.restate)?
        }
        (Some(_), Some(_)) => bail!("--config has a \"recall\" section, which generates its examples: drop --db"),
        (None, None) => bail!(
            "give --db (a store of passages ingested with --segment halves), or a config with a \"recall\" section"
        ),
    };
    fit_compose(&a, &config, &model, &data)
}

/// The fine-tuning run's config: the file's settings for `model`'s architecture.
fn compose_config(
    a: &ComposeArgs,
    f: &ComposeFile,
    model: &picaso_model::Model,
) -> Result<picaso_train::compose::ComposeConfig> {
    let mut adamw = picaso_train::optim::AdamWConfig::default();
    if let Some(wd) = f.weight_decay {
        adamw.weight_decay = wd;
    }
    let mamba2 = model.config().as_mamba2().with_context(|| {
        format!("{}: fine-tuning supports Mamba-2 models; this one is Mamba-1", model.dir().display())
    })?;
    Ok(picaso_train::compose::ComposeConfig {
        model: mamba2.clone(),
        objective: a.objective,
        batch: f.batch,
        steps: f.steps,
        warmup: f.warmup,
        lr: f.lr,
        min_lr: f.min_lr,
        clip: f.clip,
        adamw,
        max_k: f.max_k,
        min_k: f.min_k,
        seed: f.seed,
        val_every: f.val_every,
        val_k: f.val_k,
        checkpoint_every: f.checkpoint_every,
        chunk: f.chunk,
    })
}

/// Recall examples: episode i of max_k contexts (generated with the config's seed), asking
/// for one fact of its first context — "most relevant first", as retrieval would rank it.
fn recall_examples(
    model: &picaso_model::Model,
    f: &ComposeFile,
    r: &RecallEpisodes,
) -> Result<picaso_train::compose::Dataset> {
    use picaso_eval::recall::Task;
    use picaso_train::compose::{ContextItem, ContextState, Dataset, Example};
    let tok = model.tokenizer()?;
    let task = Task::synthetic_from_vocab(&tok.inner().get_vocab(true), r.facts)?;
    let source = format!("{} recall episodes of {} facts per context", r.episodes, r.facts);
    let mut data = Dataset { source, contexts: Vec::new(), train: Vec::new(), val: Vec::new() };
    let bar = indicatif::ProgressBar::new((r.episodes + f.val_passages) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} recall episodes · ETA {eta}")
            .expect("valid template"),
    );
    for i in 0..r.episodes + f.val_passages {
        // Validation episodes come from another seed than any training one.
        let seed = if i < r.episodes { f.seed } else { f.seed ^ 0x7a1d_a7e0 };
        let ep = task.episode(seed, i, f.max_k.max(1), 1)?;
        let (c, fact) = ep.queries[0];
        let mut contexts = Vec::with_capacity(ep.contexts.len());
        for j in std::iter::once(c).chain((0..ep.contexts.len()).filter(|&j| j != c)) {
            let tokens = tok.encode(&task.context_text(&ep.contexts[j]))?;
            let state = ContextState::Held(Box::new(model.prefill(&tokens, &model.zero_state())?));
            contexts.push(data.contexts.len());
            data.contexts.push(ContextItem { tokens, state });
        }
        let fact = ep.contexts[c][fact];
        let example = Example {
            contexts,
            query: tok.encode(&task.query_text(fact.key))?,
            continuation: tok.encode(&task.answer_text(fact.value))?,
        };
        if i < r.episodes {
            data.train.push(example)
        } else {
            data.val.push(example)
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    eprintln!(
        "{} training and {} validation recall episodes of {} contexts",
        data.train.len(),
        data.val.len(),
        f.max_k
    );
    Ok(data)
}

/// Examples from a store of halves: every passage with its retrieved contexts; every n-th
/// passage held out.
fn store_examples(
    model: &picaso_model::Model,
    db: &crate::args::DbArgs,
    f: &ComposeFile,
    restate: bool,
) -> Result<picaso_train::compose::Dataset> {
    use picaso_train::compose::{ContextItem, ContextState, Dataset, Example};
    let store = std::rc::Rc::new(picaso_store::Store::open(db.location()?)?);
    if store.info().fingerprint != model.fingerprint() && !restate {
        bail!(
            "--db {}: its states were made by model {}, not by the model being fine-tuned ({}); ingest the passages with this model, or pass --restate to recompute them",
            store.location(),
            store.info().fingerprint,
            model.fingerprint()
        );
    }

    // Examples: every passage with its retrieved contexts. Validation holds out every n-th
    // *document* whole: a held-out paragraph of an article the model trains on shares its
    // names and facts, so its loss rewards memorising the training articles (on WikiText-2
    // train such paragraphs improved 1.2% while the test split's unseen articles got 2.2%
    // worse). A store of fewer documents than that holds out every n-th passage instead.
    let passages = picaso_store::passages(&store)?;
    let every = (passages.len() / f.val_passages.max(1)).max(2);
    let held_out = held_out_documents(&passages, every);
    let mut slot: std::collections::HashMap<i64, usize> = std::collections::HashMap::new();
    let restated = if restate { " (states recomputed, --restate)" } else { "" };
    let source = format!("store {}{restated}", store.location());
    let mut data = Dataset { source, contexts: Vec::new(), train: Vec::new(), val: Vec::new() };
    let bar = indicatif::ProgressBar::new(passages.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} passages retrieved · ETA {eta}")
            .expect("valid template"),
    );
    for (i, p) in passages.iter().enumerate() {
        let mut contexts = Vec::with_capacity(f.max_k);
        for (id, _) in picaso_store::retrieve(&store, p, f.max_k)? {
            let next = data.contexts.len();
            let at = *slot.entry(id).or_insert(next);
            if at == next {
                let tokens = store.get(id)?.tokens;
                let state = if restate {
                    ContextState::Held(Box::new(model.prefill(&tokens, &model.zero_state())?))
                } else {
                    let store = store.clone();
                    ContextState::Read(std::rc::Rc::new(move || {
                        store
                            .load_state(id)
                            .map_err(|e| candle_core::Error::Msg(format!("reading a context's state: {e}")))
                    }))
                };
                data.contexts.push(ContextItem { tokens, state });
            }
            contexts.push(at);
        }
        let example =
            Example { contexts, query: store.get(p.query)?.tokens, continuation: store.get(p.continuation)?.tokens };
        match &held_out {
            Some(docs) if docs.contains(p.doc.as_str()) => {
                // Beyond the cap a held-out article's passages are used for nothing.
                if data.val.len() < f.val_passages {
                    data.val.push(example)
                }
            }
            None if i % every == every - 1 && data.val.len() < f.val_passages => data.val.push(example),
            _ => data.train.push(example),
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    eprintln!(
        "{} training and {} validation passages, {} distinct contexts",
        data.train.len(),
        data.val.len(),
        data.contexts.len()
    );
    Ok(data)
}

/// Every `every`-th document of `passages` (in store order), or `None` when there are fewer
/// than `2 · every` documents to choose from.
fn held_out_documents(passages: &[picaso_store::Passage], every: usize) -> Option<std::collections::HashSet<&str>> {
    let mut seen = std::collections::HashSet::new();
    let docs: Vec<&str> = passages.iter().map(|p| p.doc.as_str()).filter(|d| seen.insert(*d)).collect();
    (docs.len() >= 2 * every).then(|| docs.into_iter().skip(every - 1).step_by(every).collect())
}

/// Fine-tunes `model` on `data` as `config` says; writes OUT's log, chart and model.
fn fit_compose(
    a: &ComposeArgs,
    config: &picaso_train::compose::ComposeConfig,
    model: &picaso_model::Model,
    data: &picaso_train::compose::Dataset,
) -> Result<()> {
    let weights = picaso_model::Mamba2Weights::load(model.dir(), &config.model)?;
    let bar = indicatif::ProgressBar::new(config.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} step {pos}/{len} · {msg} · ETA {eta}")
            .expect("valid template"),
    );
    let plain = bar.is_hidden();
    let micro = a.micro_batch.map_or(config.batch, |m| m as usize);
    let history = picaso_train::compose::finetune(
        config,
        &weights,
        &model.dir().display().to_string(),
        data,
        &a.out,
        a.stop_after,
        micro,
        |r| {
            bar.set_position(r.step);
            let val = r.val_loss.map(|v| format!(" · val {v:.3}")).unwrap_or_default();
            let msg = format!("k {} · loss {:.3}{val} · {:.2} s/step", r.k, r.loss, r.step_seconds);
            if plain && (r.step % 10 == 0 || r.val_loss.is_some()) {
                eprintln!("step {}/{} · {msg}", r.step, config.steps);
            }
            bar.set_message(msg);
        },
    )?;
    bar.finish();

    let csv_path = a.out.join("finetune.csv");
    let mut csv = std::fs::File::create(&csv_path).with_context(|| format!("writing {}", csv_path.display()))?;
    writeln!(csv, "step,k,seconds,step_seconds,lr,grad_norm,train_loss,val_loss")?;
    for r in &history {
        let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
        writeln!(
            csv,
            "{},{},{:.3},{:.4},{:e},{:.4},{:.6},{val}",
            r.step, r.k, r.seconds, r.step_seconds, r.lr, r.grad_norm, r.loss
        )?;
    }
    let rows: Vec<(f64, Option<f64>, Option<f64>)> =
        history.iter().map(|r| (r.step as f64, Some(r.loss), r.val_loss)).collect();
    let title = format!("Composition fine-tuning ({})", config.objective.name());
    let chart = picaso_eval::plot::Chart {
        title: &title,
        x: "step",
        y: "continuation loss (nats/token)",
        log_x: false,
        whole_x: true,
    };
    let val_name = format!("validation (PICASO-R, k = {})", config.val_k);
    loss_chart(&a.out.join("loss.png"), &chart, ["train (k drawn 0..max_k)", &val_name], &rows, 50)?;
    let model_dir = a.out.join("model");
    let w = picaso_model::Mamba2Weights::load(&a.out.join("checkpoint"), &config.model)?;
    w.save_pretrained(&model_dir, &config.model)?;
    let tok = model.dir().join("tokenizer.json");
    if tok.is_file() {
        std::fs::copy(&tok, model_dir.join("tokenizer.json"))?;
    }
    let steps: Vec<f64> = history.iter().map(|r| r.step_seconds).collect();
    let mean_step = steps.iter().sum::<f64>() / steps.len().max(1) as f64;
    println!(
        "{}",
        serde_json::json!({
            "objective": config.objective, "step": history.last().map(|r| r.step), "steps": config.steps,
            "val_loss": history.iter().rev().find_map(|r| r.val_loss),
            "first_val_loss": history.iter().find_map(|r| r.val_loss),
            "mean_step_seconds": mean_step, "seconds": history.last().map(|r| r.seconds),
            "model": model_dir.to_string_lossy(), "log_csv": csv_path.to_string_lossy(),
        })
    );
    Ok(())
}

/// MemAvailable from /proc/meminfo (Linux), if readable.
fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::held_out_documents;
    use picaso_store::Passage;

    fn passages(docs: usize, per_doc: u32) -> Vec<Passage> {
        let mut out = Vec::new();
        for d in 0..docs {
            for paragraph in 0..per_doc {
                let id = out.len() as i64 * 2;
                out.push(Passage {
                    doc: format!("doc {d}"),
                    paragraph,
                    query: id,
                    continuation: id + 1,
                    previous: None,
                });
            }
        }
        out
    }

    #[test]
    fn validation_holds_out_whole_documents() {
        let all = passages(100, 3);
        let held = held_out_documents(&all, 10).expect("enough documents");
        let expected: std::collections::HashSet<String> = (0..10).map(|i| format!("doc {}", 10 * i + 9)).collect();
        assert_eq!(held.iter().map(|d| d.to_string()).collect::<std::collections::HashSet<_>>(), expected);
    }

    #[test]
    fn too_few_documents_fall_back_to_passages() {
        assert!(held_out_documents(&passages(19, 30), 10).is_none());
        assert!(held_out_documents(&passages(20, 30), 10).is_some());
    }
}
