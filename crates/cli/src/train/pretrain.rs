//! `picaso train pretrain`: corpora → tokenizer → packed token streams → a trained Mamba-2
//! folder (`OUT/model`, loadable with `--model`), resumable from `OUT/checkpoint`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use picaso_model::counted;
use picaso_train::corpus::{read_corpus, CorpusSpec};
use picaso_train::pretrain::{pretrain, PretrainArch, PretrainConfig, TokenData};
use picaso_train::run_file::{Arch, PretrainFile, RecallData};
use picaso_train::token_data::{context_pairs, read_token_cache, read_train_stream, write_token_cache};

use super::available_memory_bytes;
use super::plot::write_loss_png;

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

pub(super) fn pretrain_cmd(a: PretrainArgs) -> Result<()> {
    let text =
        std::fs::read_to_string(&a.config).with_context(|| format!("reading --config {}", a.config.display()))?;
    let f: PretrainFile = serde_json::from_str(&text).with_context(|| format!("--config {}", a.config.display()))?;
    f.check().map_err(|e| anyhow::anyhow!("--config: {e}"))?;
    match f.arch {
        Arch::Mamba2 => run(&a, &f, f.run_config()),
        Arch::GraniteHybrid => run(&a, &f, f.run_config_of(f.hybrid_config())),
    }
}

/// Pretrains the architecture of `config` (its vocabulary still unset) as `f` says.
fn run<C: PretrainArch>(a: &PretrainArgs, f: &PretrainFile, mut config: PretrainConfig<C>) -> Result<()> {
    // Checked before the corpora are read and tokenized (minutes for a large one); the
    // vocabulary is the tokenizer's, set below.
    config.validate().with_context(|| format!("--config {}", a.config.display()))?;
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;

    let (tok_path, mut data) = match &f.recall {
        Some(r) => recall_data(a, f, r)?,
        None => text_data(a, f)?,
    };
    let tokenizer = picaso_model::TextTokenizer::from_file(&tok_path)?;
    let train_stream = match &a.train_stream {
        Some(_) if f.recall.is_some() => {
            bail!("--train-stream replaces a corpus's training text; a config with a \"recall\" section generates its own")
        }
        Some(path) => {
            let (ids, fingerprint) =
                read_train_stream(path, tokenizer.vocab_size()).map_err(|e| anyhow::anyhow!("--train-stream {e}"))?;
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
    config.model.set_vocab(tokenizer.vocab_size().div_ceil(8) * 8);
    config.train_stream = train_stream;
    let need = C::peak_bytes(&config);
    if let Some(avail) = available_memory_bytes() {
        if need > avail {
            bail!(
                "--config: this run needs about {:.1} GiB of memory (batch·seq_len = {} tokens, vocab {}), but {:.1} GiB is available; lower batch or seq_len",
                need as f64 / 1073741824.0,
                config.batch * config.seq_len,
                tokenizer.vocab_size().div_ceil(8) * 8,
                avail as f64 / 1073741824.0
            );
        }
    }
    let n_params = config.model.n_params();
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
    config.model.export(&ckpt, &model_dir)?;
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
fn text_data(a: &PretrainArgs, f: &PretrainFile) -> Result<(PathBuf, TokenData)> {
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
            write_token_cache(&cache, &key, &data).with_context(|| format!("writing {}", cache.display()))?;
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
fn recall_data(a: &PretrainArgs, f: &PretrainFile, r: &RecallData) -> Result<(PathBuf, TokenData)> {
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
