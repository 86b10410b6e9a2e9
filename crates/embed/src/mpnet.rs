//! An MPNet encoder (HF `MPNetModel` layout) in candle, the encoder of all-mpnet-base-v2.
//!
//! It differs from BERT in three ways, all reproduced here: positions start after the padding
//! id (RoBERTa style: a real token at index `i` gets position `i + pad + 1`); there are no
//! token-type embeddings; and every layer adds a learned relative position bias (T5-style
//! buckets: exact for distances below 8, logarithmic up to 128, 16 buckets per direction) to
//! its attention scores.

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::hf_config::HfConfig;
use crate::layers::{padding_mask, read_safetensors, run_layers, Activation, Layer, Norm, Weights};

/// Relative position buckets HF's MPNet uses (fixed in its code, whatever the config says).
pub const RELATIVE_BUCKETS: usize = 32;
/// Distance from which every relative position shares the last bucket of its direction.
const MAX_DISTANCE: f32 = 128.0;

/// The fields of a HF MPNet `config.json` that the encoder uses.
#[derive(Debug, Clone, PartialEq)]
pub struct MpnetConfig {
    /// Rows of the word-embedding matrix.
    pub vocab_size: usize,
    /// Width of the hidden states (768 for all-mpnet-base-v2).
    pub hidden_size: usize,
    /// Number of transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Feed-forward activation (as for BERT).
    pub hidden_act: String,
    /// Rows of the position-embedding matrix (positions start at `pad_token_id + 1`).
    pub max_position_embeddings: usize,
    /// Epsilon of every layer norm. Default 1e-5.
    pub layer_norm_eps: f64,
    /// The padding id (1): positions are counted from it.
    pub pad_token_id: usize,
}

impl MpnetConfig {
    /// Reads and validates `config.json`; errors name the field at fault.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_hf(&HfConfig::read(path)?)
    }

    pub(crate) fn from_hf(c: &HfConfig) -> Result<Self> {
        let config = MpnetConfig {
            vocab_size: c.uint("vocab_size", None)?,
            hidden_size: c.uint("hidden_size", None)?,
            num_hidden_layers: c.uint("num_hidden_layers", None)?,
            num_attention_heads: c.uint("num_attention_heads", None)?,
            intermediate_size: c.uint("intermediate_size", None)?,
            hidden_act: c.string("hidden_act", "gelu")?,
            max_position_embeddings: c.uint("max_position_embeddings", None)?,
            layer_norm_eps: c.float("layer_norm_eps", 1e-5)?,
            pad_token_id: c.uint("pad_token_id", Some(1))?,
        };
        c.require_positive(&[
            ("vocab_size", config.vocab_size),
            ("hidden_size", config.hidden_size),
            ("num_attention_heads", config.num_attention_heads),
            ("intermediate_size", config.intermediate_size),
        ])?;
        c.require_heads(config.hidden_size, config.num_attention_heads)?;
        c.require_eps(config.layer_norm_eps)?;
        Activation::parse(&config.hidden_act).map_err(|m| c.bad(m))?;
        let buckets = c.uint("relative_attention_num_buckets", Some(RELATIVE_BUCKETS))?;
        if buckets != RELATIVE_BUCKETS {
            return Err(c.bad(format!(
                "field `relative_attention_num_buckets` is {buckets}; MPNet's code always uses {RELATIVE_BUCKETS}"
            )));
        }
        if config.max_position_embeddings <= config.pad_token_id + 2 {
            return Err(c.bad(format!(
                "field `max_position_embeddings` ({}) leaves no position after the padding id {}",
                config.max_position_embeddings, config.pad_token_id
            )));
        }
        Ok(config)
    }

    /// The longest input: positions run from `pad + 1` to `max_position_embeddings − 1`.
    pub fn max_tokens(&self) -> usize {
        self.max_position_embeddings - self.pad_token_id - 1
    }
}

/// The bucket of a key `relative` positions after the query (negative: before), as HF's
/// `MPNetEncoder.relative_position_bucket` computes it (in f32, truncated).
pub fn relative_bucket(relative: i64) -> usize {
    let half = (RELATIVE_BUCKETS / 2) as i64;
    let n = -relative;
    let mut bucket = if n < 0 { half } else { 0 };
    let n = n.abs();
    let max_exact = half / 2;
    bucket += if n < max_exact {
        n
    } else {
        let scaled =
            (n as f32 / max_exact as f32).ln() / (MAX_DISTANCE / max_exact as f32).ln() * (half - max_exact) as f32;
        (max_exact + scaled as i64).min(half - 1)
    };
    bucket as usize
}

/// A loaded MPNet encoder: token ids in, last hidden states out.
#[derive(Debug, Clone)]
pub struct MpnetModel {
    config: MpnetConfig,
    activation: Activation,
    word: Tensor,
    position: Tensor,
    emb_norm: Norm,
    /// (buckets, heads).
    relative: Tensor,
    layers: Vec<Layer>,
    device: Device,
}

impl MpnetModel {
    /// Loads the weights of `config` from a safetensors file (HF `MPNetModel` names, with or
    /// without an `mpnet.` prefix; f32, f16 or bf16, computed in f32).
    pub fn load(path: &Path, config: MpnetConfig, device: &Device) -> Result<Self> {
        let tensors = read_safetensors(path, device)?;
        let prefix = if !tensors.contains_key("embeddings.word_embeddings.weight")
            && tensors.contains_key("mpnet.embeddings.word_embeddings.weight")
        {
            "mpnet."
        } else {
            ""
        };
        let w = Weights { path: path.to_path_buf(), prefix, tensors };
        let (h, inter, heads) = (config.hidden_size, config.intermediate_size, config.num_attention_heads);
        let word = w.get("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.get("embeddings.position_embeddings.weight", &[config.max_position_embeddings, h])?;
        let emb_norm = w.norm("embeddings.LayerNorm", h)?;
        let relative = w.get("encoder.relative_attention_bias.weight", &[RELATIVE_BUCKETS, heads])?;
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            layers.push(Layer {
                qkv: w.fused_qkv(["q", "k", "v"].map(|n| format!("{p}.attention.attn.{n}")), h, heads)?,
                attn_out: w.linear(&format!("{p}.attention.attn.o"), h, h)?,
                attn_norm: w.norm(&format!("{p}.attention.LayerNorm"), h)?,
                ff_in: w.linear(&format!("{p}.intermediate.dense"), inter, h)?,
                ff_out: w.linear(&format!("{p}.output.dense"), h, inter)?,
                ff_norm: w.norm(&format!("{p}.output.LayerNorm"), h)?,
            });
        }
        let activation = Activation::parse(&config.hidden_act)
            .map_err(|message| Error::Config { path: path.to_path_buf(), message })?;
        Ok(Self { config, activation, word, position, emb_norm, relative, layers, device: device.clone() })
    }

    /// The configuration the model was loaded with.
    pub fn config(&self) -> &MpnetConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The relative position bias of a length-`s` input, shape (1, heads, s, s).
    fn relative_bias(&self, s: usize) -> Result<Tensor> {
        let buckets: Vec<u32> =
            (0..s as i64).flat_map(|q| (0..s as i64).map(move |k| relative_bucket(k - q) as u32)).collect();
        let buckets = Tensor::from_vec(buckets, s * s, &self.device)?;
        let heads = self.config.num_attention_heads;
        Ok(self.relative.index_select(&buckets, 0)?.reshape((s, s, heads))?.permute((2, 0, 1))?.unsqueeze(0)?)
    }

    /// Last hidden states, shape (batch, seq, hidden), of right-padded `ids` (batch, seq, u32)
    /// where row `b` has `lens[b]` real tokens. Padded positions never influence real ones;
    /// their own outputs are meaningless. Rows must be at most
    /// [`MpnetConfig::max_tokens`] long.
    pub fn forward(&self, ids: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let (h, pad) = (self.config.hidden_size, self.config.pad_token_id);
        if s > self.config.max_tokens() {
            return Err(Error::Input(format!("{s} tokens; this MPNet takes at most {}", self.config.max_tokens())));
        }
        let eps = self.config.layer_norm_eps as f32;
        // Positions as HF counts them: each non-padding id takes the next position after
        // `pad`; a padding id takes `pad` itself.
        let flat = ids.flatten_all()?.to_vec1::<u32>()?;
        let mut positions = Vec::with_capacity(flat.len());
        for row in flat.chunks_exact(s) {
            let mut seen = 0;
            positions.extend(row.iter().map(|&id| {
                if id as usize == pad {
                    pad as u32
                } else {
                    seen += 1;
                    (pad + seen) as u32
                }
            }));
        }
        let positions = Tensor::from_vec(positions, b * s, &self.device)?;
        let x = self.word.index_select(&ids.flatten_all()?, 0)?.reshape((b, s, h))?;
        let x = (x + self.position.index_select(&positions, 0)?.reshape((b, s, h))?)?;
        let x = self.emb_norm.forward(&x, eps)?;
        let mut bias = self.relative_bias(s)?;
        if let Some(mask) = padding_mask(lens, s, &self.device)? {
            bias = bias.broadcast_add(&mask)?;
        }
        run_layers(x, &self.layers, Some(&bias), self.config.num_attention_heads, eps, self.activation)
    }
}
