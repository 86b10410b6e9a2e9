//! A BERT encoder (HF `BertModel` layout) in candle: absolute position and token-type
//! embeddings, post-norm transformer layers, no pooler. Written for inference only: query, key
//! and value projections are fused into one matrix at load time and attention uses an additive
//! mask over padded keys.

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::error::{Error, Result};
use crate::hf_config::HfConfig;
use crate::layers::{padding_mask, read_safetensors, run_layers, Activation, Layer, Norm, Weights};

/// The fields of a HF BERT `config.json` that the encoder uses.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Rows of the word-embedding matrix.
    pub vocab_size: usize,
    /// Width of the hidden states (the embedding dimension, 384 for MiniLM-L6).
    pub hidden_size: usize,
    /// Number of transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// Feed-forward activation: `gelu` (erf, the default), `gelu_new`/`gelu_pytorch_tanh`
    /// (tanh) or `relu`.
    pub hidden_act: String,
    /// Rows of the position-embedding matrix: the longest input the model can take.
    pub max_position_embeddings: usize,
    /// Rows of the token-type embedding matrix. Default 2.
    pub type_vocab_size: usize,
    /// Epsilon of every layer norm. Default 1e-12.
    pub layer_norm_eps: f64,
    /// Only `absolute` (the default) is supported.
    pub position_embedding_type: String,
}

impl BertConfig {
    /// Reads and validates `config.json`; errors name the field at fault.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_hf(&HfConfig::read(path)?)
    }

    pub(crate) fn from_hf(c: &HfConfig) -> Result<Self> {
        let config = BertConfig {
            vocab_size: c.uint("vocab_size", None)?,
            hidden_size: c.uint("hidden_size", None)?,
            num_hidden_layers: c.uint("num_hidden_layers", None)?,
            num_attention_heads: c.uint("num_attention_heads", None)?,
            intermediate_size: c.uint("intermediate_size", None)?,
            hidden_act: c.string("hidden_act", "gelu")?,
            max_position_embeddings: c.uint("max_position_embeddings", None)?,
            type_vocab_size: c.uint("type_vocab_size", Some(2))?,
            layer_norm_eps: c.float("layer_norm_eps", 1e-12)?,
            position_embedding_type: c.string("position_embedding_type", "absolute")?,
        };
        c.require_positive(&[
            ("vocab_size", config.vocab_size),
            ("hidden_size", config.hidden_size),
            ("num_attention_heads", config.num_attention_heads),
            ("intermediate_size", config.intermediate_size),
            ("max_position_embeddings", config.max_position_embeddings),
            ("type_vocab_size", config.type_vocab_size),
        ])?;
        c.require_heads(config.hidden_size, config.num_attention_heads)?;
        if config.position_embedding_type != "absolute" {
            return Err(c.bad(format!(
                "field `position_embedding_type` is {:?}; only \"absolute\" is supported",
                config.position_embedding_type
            )));
        }
        c.require_eps(config.layer_norm_eps)?;
        Activation::parse(&config.hidden_act).map_err(|m| c.bad(m))?;
        Ok(config)
    }
}

/// A loaded BERT encoder: token ids in, last hidden states out.
#[derive(Debug, Clone)]
pub struct BertModel {
    config: BertConfig,
    activation: Activation,
    word: Tensor,
    position: Tensor,
    token_type0: Tensor,
    emb_norm: Norm,
    layers: Vec<Layer>,
    device: Device,
}

impl BertModel {
    /// Loads the weights of `config` from a safetensors file (HF `BertModel` names, with or
    /// without a `bert.` prefix; f32, f16 or bf16, computed in f32).
    pub fn load(path: &Path, config: BertConfig, device: &Device) -> Result<Self> {
        let tensors = read_safetensors(path, device)?;
        let prefix = if !tensors.contains_key("embeddings.word_embeddings.weight")
            && tensors.contains_key("bert.embeddings.word_embeddings.weight")
        {
            "bert."
        } else {
            ""
        };
        let w = Weights { path: path.to_path_buf(), prefix, tensors };
        let (h, inter, heads) = (config.hidden_size, config.intermediate_size, config.num_attention_heads);
        let word = w.get("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.get("embeddings.position_embeddings.weight", &[config.max_position_embeddings, h])?;
        let token_type0 = w.get("embeddings.token_type_embeddings.weight", &[config.type_vocab_size, h])?.get(0)?;
        let emb_norm = w.norm("embeddings.LayerNorm", h)?;
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            layers.push(Layer {
                qkv: w.fused_qkv(["query", "key", "value"].map(|n| format!("{p}.attention.self.{n}")), h, heads)?,
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h)?,
                ff_in: w.linear(&format!("{p}.intermediate.dense"), inter, h)?,
                ff_out: w.linear(&format!("{p}.output.dense"), h, inter)?,
                ff_norm: w.norm(&format!("{p}.output.LayerNorm"), h)?,
            });
        }
        let activation = Activation::parse(&config.hidden_act)
            .map_err(|message| Error::Config { path: path.to_path_buf(), message })?;
        Ok(Self { config, activation, word, position, token_type0, emb_norm, layers, device: device.clone() })
    }

    /// The configuration the model was loaded with.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Last hidden states, shape (batch, seq, hidden), of right-padded `ids` (batch, seq, u32)
    /// where row `b` has `lens[b]` real tokens. Padded positions never influence real ones;
    /// their own outputs are meaningless. Token types are all 0 (single sentences).
    pub fn forward(&self, ids: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let (b, s) = ids.dims2()?;
        let h = self.config.hidden_size;
        let eps = self.config.layer_norm_eps as f32;
        let mask = padding_mask(lens, s, &self.device)?;
        let x = self.word.index_select(&ids.flatten_all()?, 0)?.reshape((b, s, h))?;
        let x = x.broadcast_add(&self.position.narrow(0, 0, s)?)?.broadcast_add(&self.token_type0)?;
        let x = self.emb_norm.forward(&x, eps)?;
        run_layers(x, &self.layers, mask.as_ref(), self.config.num_attention_heads, eps, self.activation)
    }
}
