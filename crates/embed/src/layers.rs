//! What BERT and MPNet share: weight lookup with checks that name the tensor at fault, layer
//! norms, and the post-norm transformer layer (fused QKV projection, additive attention bias,
//! feed-forward). The two encoders differ only in their embeddings and attention bias.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;

use crate::error::{Error, Result};

/// Feed-forward activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activation {
    GeluErf,
    GeluTanh,
    Relu,
}

impl Activation {
    /// The activation a HF `hidden_act` names.
    pub(crate) fn parse(name: &str) -> std::result::Result<Self, String> {
        match name {
            "gelu" => Ok(Self::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Self::GeluTanh),
            "relu" => Ok(Self::Relu),
            other => {
                Err(format!("field `hidden_act` is {other:?}; supported: gelu, gelu_new, gelu_pytorch_tanh, relu"))
            }
        }
    }
}

/// Reads a safetensors file into tensors on `device`, naming the file if it cannot.
pub(crate) fn read_safetensors(path: &Path, device: &Device) -> Result<HashMap<String, Tensor>> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    candle_core::safetensors::load_buffer(&bytes, device).map_err(|e| Error::Weights {
        path: path.to_path_buf(),
        message: format!("not a readable safetensors file: {e}"),
    })
}

/// Weight tensors by name, with checks that name the tensor and file at fault.
pub(crate) struct Weights {
    pub(crate) path: PathBuf,
    pub(crate) prefix: &'static str,
    pub(crate) tensors: HashMap<String, Tensor>,
}

impl Weights {
    /// The tensor `name` (after the prefix), checked to have `shape`, as f32.
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
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

    pub(crate) fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        Ok(Linear::new(
            self.get(&format!("{name}.weight"), &[out, inp])?,
            Some(self.get(&format!("{name}.bias"), &[out])?),
        ))
    }

    pub(crate) fn norm(&self, name: &str, dim: usize) -> Result<Norm> {
        Ok(Norm {
            weight: self.get(&format!("{name}.weight"), &[dim])?,
            bias: self.get(&format!("{name}.bias"), &[dim])?,
        })
    }

    /// One (3h, h) projection from three (h, h) ones named `names` (query, key, value): one
    /// matrix product per layer. The attention scale 1/√head_dim is folded into the query.
    pub(crate) fn fused_qkv(&self, names: [String; 3], h: usize, heads: usize) -> Result<Linear> {
        let mut ws = names.iter().map(|n| self.get(&format!("{n}.weight"), &[h, h])).collect::<Result<Vec<_>>>()?;
        let mut bs = names.iter().map(|n| self.get(&format!("{n}.bias"), &[h])).collect::<Result<Vec<_>>>()?;
        let scale = 1.0 / ((h / heads) as f64).sqrt();
        ws[0] = (&ws[0] * scale)?;
        bs[0] = (&bs[0] * scale)?;
        Ok(Linear::new(Tensor::cat(&ws, 0)?, Some(Tensor::cat(&bs, 0)?)))
    }
}

/// Affine layer norm over the last dimension.
#[derive(Debug, Clone)]
pub(crate) struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    pub(crate) fn forward(&self, x: &Tensor, eps: f32) -> Result<Tensor> {
        Ok(candle_nn::ops::layer_norm(&x.contiguous()?, &self.weight, &self.bias, eps)?)
    }
}

/// One post-norm transformer layer.
#[derive(Debug, Clone)]
pub(crate) struct Layer {
    pub(crate) qkv: Linear,
    pub(crate) attn_out: Linear,
    pub(crate) attn_norm: Norm,
    pub(crate) ff_in: Linear,
    pub(crate) ff_out: Linear,
    pub(crate) ff_norm: Norm,
}

/// The additive attention mask over keys, shape (b, 1, 1, s): 0 for real tokens, a huge
/// negative for padding (finite, so a row can never become NaN; exp underflows to exactly 0).
/// `None` when no row is padded.
pub(crate) fn padding_mask(lens: &[usize], s: usize, device: &Device) -> Result<Option<Tensor>> {
    if lens.iter().all(|&len| len >= s) {
        return Ok(None);
    }
    let mut mask = vec![0f32; lens.len() * s];
    for (row, &len) in mask.chunks_mut(s).zip(lens) {
        row[len.min(s)..].fill(f32::MIN);
    }
    Ok(Some(Tensor::from_vec(mask, (lens.len(), 1, 1, s), device)?))
}

/// Runs `layers` over `x` (b, s, h). `bias` is added to every layer's attention scores before
/// softmax (the padding mask, plus MPNet's relative position bias), broadcast to (b, heads, s, s).
pub(crate) fn run_layers(
    mut x: Tensor,
    layers: &[Layer],
    bias: Option<&Tensor>,
    heads: usize,
    eps: f32,
    activation: Activation,
) -> Result<Tensor> {
    let (b, s, h) = x.dims3()?;
    let hd = h / heads;
    for layer in layers {
        // (b, s, 3·h) → (3, b, heads, s, head_dim) in one copy; q is pre-scaled.
        let qkv = layer.qkv.forward(&x)?.reshape((b, s, 3, heads, hd))?.permute((2, 0, 3, 1, 4))?.contiguous()?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let mut scores = q.matmul(&k.t()?)?;
        if let Some(bias) = bias {
            scores = scores.broadcast_add(bias)?;
        }
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let ctx = probs.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, s, h))?;
        let x1 = layer.attn_norm.forward(&(layer.attn_out.forward(&ctx)? + &x)?, eps)?;
        let ff = layer.ff_in.forward(&x1)?;
        let ff = match activation {
            Activation::GeluErf => ff.gelu_erf()?,
            Activation::GeluTanh => ff.gelu()?,
            Activation::Relu => ff.relu()?,
        };
        x = layer.ff_norm.forward(&(layer.ff_out.forward(&ff)? + &x1)?, eps)?;
    }
    Ok(x)
}
