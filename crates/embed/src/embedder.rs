//! Sentence embeddings: the sentence-transformers pipeline of a model folder — tokenization,
//! a BERT or MPNet encoder, pooling over the real tokens, L2 normalisation — as
//! all-MiniLM-L6-v2 and all-mpnet-base-v2 run it.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use crate::encoder::{Encoder, EncoderConfig};
use crate::error::{Error, Result};
use crate::modules::Pipeline;
use crate::pooling::Pooling;

/// Token limit when the model folder has no `sentence_bert_config.json` (all-MiniLM-L6-v2's).
pub const DEFAULT_MAX_TOKENS: usize = 256;
/// Default most sentences per encoder call.
pub const DEFAULT_BATCH_SIZE: usize = 32;
/// Default most (padded) tokens per encoder call; bounds the attention matrices' memory.
pub const DEFAULT_BATCH_TOKENS: usize = 8192;

/// A sentence-transformers embedder: BERT or MPNet, then the folder's pooling and
/// normalisation (`modules.json`, `1_Pooling/config.json`).
///
/// ```no_run
/// use picaso_embed::Embedder;
/// let embedder = Embedder::load("models/all-MiniLM-L6-v2".as_ref(), &candle_core::Device::Cpu)?;
/// let vectors = embedder.embed(&["The Eiffel Tower is in Paris.", "It was finished in 1889."])?;
/// assert_eq!(vectors[0].len(), embedder.dim());
/// # Ok::<(), picaso_embed::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Embedder {
    model: Encoder,
    pooling: Pooling,
    normalize: bool,
    tokenizer: Tokenizer,
    tokenizer_path: PathBuf,
    max_tokens: usize,
    batch_size: usize,
    batch_tokens: usize,
    fingerprint: String,
    dir: PathBuf,
}

/// The pipeline every store made before pipelines were read has (BERT, mean pooling,
/// normalised): its fingerprint stays the hash of the three files, so those stores still open.
const LEGACY_PIPELINE: &str = "bert;mean;normalize";

/// xxh3-128 over the files that define an embedder (config, tokenizer, weights) and, unless it
/// is [`LEGACY_PIPELINE`], the pipeline's description, as 32 hex digits: two folders with the
/// same fingerprint embed identically.
fn fingerprint_files(dir: &Path, pipeline: &str) -> Result<String> {
    use std::io::Read;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    for name in ["config.json", "tokenizer.json", "model.safetensors"] {
        let path = dir.join(name);
        let mut f = std::fs::File::open(&path).map_err(|source| Error::Io { path: path.clone(), source })?;
        h.update(name.as_bytes());
        loop {
            let n = f.read(&mut buf).map_err(|source| Error::Io { path: path.clone(), source })?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    if pipeline != LEGACY_PIPELINE {
        h.update(b"pipeline");
        h.update(pipeline.as_bytes());
    }
    Ok(format!("{:032x}", h.digest128()))
}

impl Embedder {
    /// Loads a sentence-transformers folder: `modules.json` (Transformer, Pooling, optional
    /// Normalize; without it, mean pooling and normalisation), the transformer's
    /// `config.json` (BERT or MPNet), `model.safetensors` and `tokenizer.json`, the pooling's
    /// `1_Pooling/config.json`, and the token limit from `sentence_bert_config.json`
    /// (`max_seq_length`) when present, else 256; the limit never exceeds what the model's
    /// position embeddings allow.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let pipeline = Pipeline::read(dir)?;
        let dir = pipeline.transformer_dir.as_path();
        // The tokenizer is checked before the weights are read (hundreds of MB for mpnet).
        let config = EncoderConfig::read(dir)?;
        let max_tokens = read_max_tokens(dir)?.min(config.max_tokens());

        let tokenizer_path = dir.join("tokenizer.json");
        let tok_err = |message: String| Error::Tokenizer { path: tokenizer_path.clone(), message };
        if !tokenizer_path.is_file() {
            return Err(Error::Io {
                path: tokenizer_path.clone(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "file not found"),
            });
        }
        let mut tokenizer = Tokenizer::from_file(&tokenizer_path).map_err(|e| tok_err(e.to_string()))?;
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| tok_err(format!("cannot truncate to {max_tokens} tokens: {e}")))?;
        // Padding is done per batch here; the file's fixed padding (128) would be wrong.
        tokenizer.with_padding(None);
        let vocab = tokenizer.get_vocab_size(true);
        let vocab_size = config.vocab_size();
        if vocab > vocab_size {
            return Err(tok_err(format!(
                "has {vocab} tokens but the model's `vocab_size` in config.json is {vocab_size}"
            )));
        }

        let model = Encoder::from_config(config, &dir.join("model.safetensors"), device)?;
        let description = format!(
            "{};{};{}",
            model.family(),
            pipeline.pooling.describe(),
            if pipeline.normalize { "normalize" } else { "raw" }
        );
        Ok(Self {
            fingerprint: fingerprint_files(dir, &description)?,
            model,
            pooling: pipeline.pooling,
            normalize: pipeline.normalize,
            tokenizer,
            tokenizer_path,
            max_tokens,
            batch_size: DEFAULT_BATCH_SIZE,
            batch_tokens: DEFAULT_BATCH_TOKENS,
            dir: std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf()),
        })
    }

    /// The folder it was loaded from (absolute when it could be resolved).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fingerprint of the embedder's files (config, tokenizer, weights): a store records it
    /// at ingest and refuses queries embedded by anything else.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Sets the most sentences per encoder call (at least 1). Results do not depend on it.
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// Sets the most padded tokens per encoder call (a batch always holds at least one
    /// sentence). Results do not depend on it.
    pub fn with_batch_tokens(mut self, batch_tokens: usize) -> Self {
        self.batch_tokens = batch_tokens.max(1);
        self
    }

    /// Embedding dimension (384 for all-MiniLM-L6-v2, 768 for all-mpnet-base-v2).
    pub fn dim(&self) -> usize {
        self.pooling.dim(self.model.hidden_size())
    }

    /// The pooling applied to the token states.
    pub fn pooling(&self) -> &Pooling {
        &self.pooling
    }

    /// Whether embeddings are L2-normalised (the folder has a `Normalize` module).
    pub fn normalizes(&self) -> bool {
        self.normalize
    }

    /// Most tokens per text, special tokens included; longer texts are truncated.
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// The encoder.
    pub fn model(&self) -> &Encoder {
        &self.model
    }

    /// Token ids the encoder sees for each text: `[CLS] … [SEP]` (`<s> … </s>` for MPNet), truncated to
    /// [`max_tokens`](Self::max_tokens).
    pub fn tokenize(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let encodings = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| Error::Tokenizer { path: self.tokenizer_path.clone(), message: e.to_string() })?;
        Ok(encodings.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// Embeddings of `texts` (L2-normalised when the pipeline says so), in order. An empty list gives an empty result; an
    /// empty string is embedded like any text (as `[CLS] [SEP]`).
    ///
    /// Texts are sorted by length and encoded in padded batches of similar lengths, so little
    /// work goes to padding; each result equals the text's embedding on its own up to float
    /// rounding.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let ids = self.tokenize(texts)?;
        self.embed_tokens(&ids)
    }

    /// The embedding of one text.
    pub fn embed_one(&self, text: &str) -> Result<Vec<f32>> {
        Ok(self.embed(&[text])?.pop().unwrap_or_default())
    }

    /// Embeddings of already tokenized texts (as [`tokenize`](Self::tokenize) returns them:
    /// with special tokens, at most `max_tokens` each, ids below the vocabulary size).
    pub fn embed_tokens(&self, ids: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.model.vocab_size();
        for (i, row) in ids.iter().enumerate() {
            if row.is_empty() || row.len() > self.max_tokens {
                return Err(Error::Input(format!(
                    "token sequence {i} has {} tokens; expected 1 to {}",
                    row.len(),
                    self.max_tokens
                )));
            }
            if let Some(&bad) = row.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::Input(format!(
                    "token sequence {i} has id {bad}, outside the vocabulary of {vocab}"
                )));
            }
        }
        // Longest first, so each batch is padded to its first row's length.
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(ids[i].len()));
        let mut out = vec![Vec::new(); ids.len()];
        let mut start = 0;
        while start < order.len() {
            let width = ids[order[start]].len();
            let rows = (self.batch_tokens / width).clamp(1, self.batch_size).min(order.len() - start);
            let batch = &order[start..start + rows];
            let mut flat = vec![self.model.pad_id(); rows * width];
            let mut lens = Vec::with_capacity(rows);
            for (dst, &i) in flat.chunks_exact_mut(width).zip(batch) {
                dst[..ids[i].len()].copy_from_slice(&ids[i]);
                lens.push(ids[i].len());
            }
            let tensor = Tensor::from_vec(flat, (rows, width), self.model.device())?;
            let hidden = self.model.forward(&tensor, &lens)?;
            for (mut v, &i) in self.pooling.pool(&hidden, &lens)?.into_iter().zip(batch) {
                if self.normalize {
                    l2_normalize(&mut v);
                }
                out[i] = v;
            }
            start += rows;
        }
        Ok(out)
    }
}

/// Divides `v` by its L2 norm (by 1e-12 if smaller), as `torch.nn.functional.normalize`.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt().max(1e-12);
    for x in v {
        *x = (*x as f64 / norm) as f32;
    }
}

/// The token limit of a transformer folder: `max_seq_length` of `sentence_bert_config.json`
/// (sentence-transformers before 6), else `model_max_length` of `tokenizer_config.json` (where
/// sentence-transformers 6 keeps it; HF writes a huge number there for "no limit", ignored),
/// else [`DEFAULT_MAX_TOKENS`].
fn read_max_tokens(dir: &Path) -> Result<usize> {
    let read = |name: &str, key: &str| -> Result<Option<usize>> {
        let path = dir.join(name);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(Error::Io { path, source }),
        };
        let bad = |message: String| Error::Config { path: path.clone(), message };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        match value.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(n) if n >= 1e6 => Ok(None),
                Some(n) if n >= 2.0 && n.fract() == 0.0 => Ok(Some(n as usize)),
                _ => Err(bad(format!("field `{key}` must be an integer of at least 2, got {v}"))),
            },
        }
    };
    Ok(match read("sentence_bert_config.json", "max_seq_length")? {
        Some(n) => n,
        None => read("tokenizer_config.json", "model_max_length")?.unwrap_or(DEFAULT_MAX_TOKENS),
    })
}
