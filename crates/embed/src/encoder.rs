//! The transformer of a sentence-transformers model, chosen by `config.json`'s `model_type`:
//! BERT (all-MiniLM-L6-v2 and most small encoders) or MPNet (all-mpnet-base-v2).

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::bert::{BertConfig, BertModel};
use crate::error::Result;
use crate::hf_config::HfConfig;
use crate::mpnet::{MpnetConfig, MpnetModel};

/// A loaded encoder: token ids in, last hidden states out.
#[derive(Debug, Clone)]
pub enum Encoder {
    /// A BERT encoder.
    Bert(BertModel),
    /// An MPNet encoder.
    Mpnet(MpnetModel),
}

/// The configuration of an [`Encoder`], read before its weights.
#[derive(Debug, Clone, PartialEq)]
pub enum EncoderConfig {
    /// A BERT `config.json`.
    Bert(BertConfig),
    /// An MPNet `config.json`.
    Mpnet(MpnetConfig),
}

impl EncoderConfig {
    /// Reads `dir/config.json`. A `model_type` other than `bert` (the default when absent, as
    /// in older BERT configs) or `mpnet` is refused.
    pub fn read(dir: &Path) -> Result<Self> {
        let config = HfConfig::read(&dir.join("config.json"))?;
        match config.string("model_type", "bert")?.as_str() {
            "bert" => Ok(Self::Bert(BertConfig::from_hf(&config)?)),
            "mpnet" => Ok(Self::Mpnet(MpnetConfig::from_hf(&config)?)),
            other => Err(config.bad(format!(
                "field `model_type` is {other:?}; picaso's embedder reads BERT (\"bert\") and MPNet (\"mpnet\") encoders"
            ))),
        }
    }

    /// Rows of the word-embedding matrix.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Bert(c) => c.vocab_size,
            Self::Mpnet(c) => c.vocab_size,
        }
    }

    /// The longest input the position embeddings allow.
    pub fn max_tokens(&self) -> usize {
        match self {
            Self::Bert(c) => c.max_position_embeddings,
            Self::Mpnet(c) => c.max_tokens(),
        }
    }
}

impl Encoder {
    /// Loads `config.json` and `model.safetensors` from `dir` (see [`EncoderConfig::read`]).
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        Self::from_config(EncoderConfig::read(dir)?, &dir.join("model.safetensors"), device)
    }

    /// Loads the weights of `config` from the safetensors file `weights`.
    pub fn from_config(config: EncoderConfig, weights: &Path, device: &Device) -> Result<Self> {
        match config {
            EncoderConfig::Bert(c) => Ok(Self::Bert(BertModel::load(weights, c, device)?)),
            EncoderConfig::Mpnet(c) => Ok(Self::Mpnet(MpnetModel::load(weights, c, device)?)),
        }
    }

    /// `bert` or `mpnet`.
    pub fn family(&self) -> &'static str {
        match self {
            Self::Bert(_) => "bert",
            Self::Mpnet(_) => "mpnet",
        }
    }

    /// Width of the hidden states.
    pub fn hidden_size(&self) -> usize {
        match self {
            Self::Bert(m) => m.config().hidden_size,
            Self::Mpnet(m) => m.config().hidden_size,
        }
    }

    /// Rows of the word-embedding matrix: every token id must be below it.
    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Bert(m) => m.config().vocab_size,
            Self::Mpnet(m) => m.config().vocab_size,
        }
    }

    /// The longest input the position embeddings allow.
    pub fn max_tokens(&self) -> usize {
        match self {
            Self::Bert(m) => m.config().max_position_embeddings,
            Self::Mpnet(m) => m.config().max_tokens(),
        }
    }

    /// The id that fills a batch's padding.
    pub fn pad_id(&self) -> u32 {
        match self {
            Self::Bert(_) => 0,
            Self::Mpnet(m) => m.config().pad_token_id as u32,
        }
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        match self {
            Self::Bert(m) => m.device(),
            Self::Mpnet(m) => m.device(),
        }
    }

    /// Last hidden states (batch, seq, hidden) of right-padded `ids` (batch, seq) whose row `b`
    /// has `lens[b]` real tokens.
    pub fn forward(&self, ids: &Tensor, lens: &[usize]) -> Result<Tensor> {
        match self {
            Self::Bert(m) => m.forward(ids, lens),
            Self::Mpnet(m) => m.forward(ids, lens),
        }
    }
}
