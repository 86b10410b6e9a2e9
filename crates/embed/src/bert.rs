//! A BERT encoder (HF `BertModel` layout) in candle: embeddings, post-norm transformer layers,
//! no pooler. Written for inference only: query, key and value projections are fused into one
//! matrix at load time and attention uses an additive mask over padded keys.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;

use crate::error::{Error, Result};

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

/// Feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Activation {
    GeluErf,
    GeluTanh,
    Relu,
}

impl BertConfig {
    /// Reads and validates `config.json`; errors name the field at fault.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let bad = |message: String| Error::Config { path: path.to_path_buf(), message };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let field = |name: &str| json.get(name).filter(|v| !v.is_null());
        let uint = |name: &str, default: Option<usize>| -> Result<usize> {
            match (field(name), default) {
                (None, Some(d)) => Ok(d),
                (None, None) => Err(bad(format!("missing field `{name}`"))),
                (Some(v), _) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| bad(format!("field `{name}` must be a non-negative integer, got {v}"))),
            }
        };
        let string = |name: &str, default: &str| -> Result<String> {
            match field(name) {
                None => Ok(default.to_string()),
                Some(v) => v
                    .as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(format!("field `{name}` must be a string, got {v}"))),
            }
        };
        let layer_norm_eps = match field("layer_norm_eps") {
            None => 1e-12,
            Some(v) => v.as_f64().ok_or_else(|| bad(format!("field `layer_norm_eps` must be a number, got {v}")))?,
        };
        let config = BertConfig {
            vocab_size: uint("vocab_size", None)?,
            hidden_size: uint("hidden_size", None)?,
            num_hidden_layers: uint("num_hidden_layers", None)?,
            num_attention_heads: uint("num_attention_heads", None)?,
            intermediate_size: uint("intermediate_size", None)?,
            hidden_act: string("hidden_act", "gelu")?,
            max_position_embeddings: uint("max_position_embeddings", None)?,
            type_vocab_size: uint("type_vocab_size", Some(2))?,
            layer_norm_eps,
            position_embedding_type: string("position_embedding_type", "absolute")?,
        };
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |message: String| Err(Error::Config { path: path.to_path_buf(), message });
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            if value == 0 {
                return bad(format!("field `{name}` must be positive"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(format!(
                "field `hidden_size` ({}) is not divisible by `num_attention_heads` ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.position_embedding_type != "absolute" {
            return bad(format!(
                "field `position_embedding_type` is {:?}; only \"absolute\" is supported",
                self.position_embedding_type
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return bad(format!("field `layer_norm_eps` must be a positive number, got {}", self.layer_norm_eps));
        }
        self.activation().map_err(|m| Error::Config { path: path.to_path_buf(), message: m })?;
        Ok(())
    }

    fn activation(&self) -> std::result::Result<Activation, String> {
        match self.hidden_act.as_str() {
            "gelu" => Ok(Activation::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Activation::GeluTanh),
            "relu" => Ok(Activation::Relu),
            other => {
                Err(format!("field `hidden_act` is {other:?}; supported: gelu, gelu_new, gelu_pytorch_tanh, relu"))
            }
        }
    }
}

/// Weight tensors by name, with checks that name the tensor and file at fault.
struct Weights {
    path: PathBuf,
    prefix: &'static str,
    tensors: HashMap<String, Tensor>,
}

impl Weights {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let full = format!("{}{name}", self.prefix);
        let t = self
            .tensors
            .get(&full)
            .ok_or_else(|| Error::Weights { path: self.path.clone(), message: format!("missing tensor `{full}`") })?;
        if t.dims() != shape {
            return Err(Error::Weights {
                path: self.path.clone(),
                message: format!("tensor `{full}` has shape {:?}, expected {shape:?}", t.dims()),
            });
        }
        Ok(t.to_dtype(DType::F32)?)
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        Ok(Linear::new(
            self.get(&format!("{name}.weight"), &[out, inp])?,
            Some(self.get(&format!("{name}.bias"), &[out])?),
        ))
    }

    fn norm(&self, name: &str, dim: usize) -> Result<Norm> {
        Ok(Norm {
            weight: self.get(&format!("{name}.weight"), &[dim])?,
            bias: self.get(&format!("{name}.bias"), &[dim])?,
        })
    }
}

/// Affine layer norm over the last dimension.
#[derive(Debug, Clone)]
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn forward(&self, x: &Tensor, eps: f32) -> Result<Tensor> {
        Ok(candle_nn::ops::layer_norm(&x.contiguous()?, &self.weight, &self.bias, eps)?)
    }
}

#[derive(Debug, Clone)]
struct Layer {
    qkv: Linear,
    attn_out: Linear,
    attn_norm: Norm,
    ff_in: Linear,
    ff_out: Linear,
    ff_norm: Norm,
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
        let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let tensors = candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| Error::Weights {
            path: path.to_path_buf(),
            message: format!("not a readable safetensors file: {e}"),
        })?;
        drop(bytes);
        let prefix = if !tensors.contains_key("embeddings.word_embeddings.weight")
            && tensors.contains_key("bert.embeddings.word_embeddings.weight")
        {
            "bert."
        } else {
            ""
        };
        let w = Weights { path: path.to_path_buf(), prefix, tensors };
        let (h, inter) = (config.hidden_size, config.intermediate_size);
        let word = w.get("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.get("embeddings.position_embeddings.weight", &[config.max_position_embeddings, h])?;
        let token_type0 = w.get("embeddings.token_type_embeddings.weight", &[config.type_vocab_size, h])?.get(0)?;
        let emb_norm = w.norm("embeddings.LayerNorm", h)?;
        let mut layers = Vec::new();
        for i in 0..config.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            // One (3h, h) projection instead of three: one matrix product per layer.
            let names = ["query", "key", "value"].map(|n| format!("{p}.attention.self.{n}"));
            let mut ws = names.iter().map(|n| w.get(&format!("{n}.weight"), &[h, h])).collect::<Result<Vec<_>>>()?;
            let mut bs = names.iter().map(|n| w.get(&format!("{n}.bias"), &[h])).collect::<Result<Vec<_>>>()?;
            // The attention scale 1/√head_dim is folded into the query projection.
            let scale = 1.0 / ((h / config.num_attention_heads) as f64).sqrt();
            ws[0] = (&ws[0] * scale)?;
            bs[0] = (&bs[0] * scale)?;
            let qkv_w = Tensor::cat(&ws, 0)?;
            let qkv_b = Tensor::cat(&bs, 0)?;
            layers.push(Layer {
                qkv: Linear::new(qkv_w, Some(qkv_b)),
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h)?,
                ff_in: w.linear(&format!("{p}.intermediate.dense"), inter, h)?,
                ff_out: w.linear(&format!("{p}.output.dense"), h, inter)?,
                ff_norm: w.norm(&format!("{p}.output.LayerNorm"), h)?,
            });
        }
        let activation = config.activation().map_err(|message| Error::Config { path: path.to_path_buf(), message })?;
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
        let nh = self.config.num_attention_heads;
        let hd = h / nh;
        let eps = self.config.layer_norm_eps as f32;

        // Additive attention mask over keys: 0 for real tokens, a huge negative for padding
        // (finite, so a row can never become NaN; exp underflows to exactly 0). Not needed
        // when no row is padded.
        let mask = if lens.iter().all(|&len| len >= s) {
            None
        } else {
            let mut mask = vec![0f32; b * s];
            for (row, &len) in mask.chunks_mut(s).zip(lens) {
                row[len.min(s)..].fill(f32::MIN);
            }
            Some(Tensor::from_vec(mask, (b, 1, 1, s), &self.device)?)
        };

        let x = self.word.index_select(&ids.flatten_all()?, 0)?.reshape((b, s, h))?;
        let x = x.broadcast_add(&self.position.narrow(0, 0, s)?)?.broadcast_add(&self.token_type0)?;
        let mut x = self.emb_norm.forward(&x, eps)?;

        for layer in &self.layers {
            // (b, s, 3·h) → (3, b, heads, s, head_dim) in one copy; q is pre-scaled.
            let qkv = layer.qkv.forward(&x)?.reshape((b, s, 3, nh, hd))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
            let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
            let mut scores = q.matmul(&k.t()?)?;
            if let Some(mask) = &mask {
                scores = scores.broadcast_add(mask)?;
            }
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let ctx = probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, s, h))?;
            let x1 = layer.attn_norm.forward(&(layer.attn_out.forward(&ctx)? + &x)?, eps)?;
            let ff = layer.ff_in.forward(&x1)?;
            let ff = match self.activation {
                Activation::GeluErf => ff.gelu_erf()?,
                Activation::GeluTanh => ff.gelu()?,
                Activation::Relu => ff.relu()?,
            };
            x = layer.ff_norm.forward(&(layer.ff_out.forward(&ff)? + &x1)?, eps)?;
        }
        Ok(x)
    }
}

/// Sums a (batch, seq, hidden) f32 tensor over the first `lens[b]` positions of each row and
/// divides by the count: mean pooling over the attention mask, computed in f64.
pub(crate) fn mean_pool(hidden: &Tensor, lens: &[usize]) -> Result<Vec<Vec<f32>>> {
    let (b, s, h) = hidden.dims3()?;
    let data = hidden.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = Vec::with_capacity(b);
    for (row, &len) in data.chunks_exact(s * h).zip(lens) {
        let len = len.min(s);
        let mut acc = vec![0f64; h];
        for tok in row.chunks_exact(h).take(len) {
            for (a, &v) in acc.iter_mut().zip(tok) {
                *a += v as f64;
            }
        }
        let denom = (len as f64).max(1e-9);
        out.push(acc.iter().map(|&a| (a / denom) as f32).collect());
    }
    Ok(out)
}
