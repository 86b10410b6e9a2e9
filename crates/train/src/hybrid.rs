//! A differentiable Granite 4.0 H or Nemotron-H hybrid on candle autograd: Mamba-2 mixers (the
//! same `MambaLayer` as [`crate::TrainMamba2`]) and grouped-query attention without positional
//! encoding (NoPE), each followed by its MLP (Granite's SwiGLU; Nemotron-H's relu², or none),
//! every branch added to the residual scaled by `residual_multiplier` — what the inference
//! engine in `picaso_model::granite_hybrid` runs.
//!
//! Attention continues from the keys and values of a [`TrainState`], so a composed state (the
//! union of its contexts' keys and values) is read exactly as at inference. Padded key
//! positions get a score of −10⁹, which is 0 after the softmax in f32 and f64 while keeping a
//! row whose keys are all padding finite (such a row is itself padding and reaches nothing).

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use picaso_model::granite_hybrid::weights::{AttentionWeights, GraniteLayerWeights, MixerWeights, MlpWeights};
use picaso_model::granite_hybrid::{HybridFamily, LayerKind, MlpKind};
use picaso_model::{GraniteHybridConfig, GraniteHybridWeights};

use crate::kernels::rms_norm;
use crate::mamba::{host, var, MambaLayer};
use crate::net::Net;
use crate::{Result, TrainState};

/// The score of a key a query may not see.
const HIDDEN: f64 = -1e9;

enum Mixer {
    /// Its `norm` is the block's input norm.
    Mamba(MambaLayer),
    Attention {
        input_norm: Var,
        q: Var,
        k: Var,
        v: Var,
        o: Var,
    },
}

struct Block {
    mixer: Mixer,
    /// Absent after a Nemotron-H mixer block no `mlp` block follows.
    mlp: Option<Mlp>,
}

struct Mlp {
    norm: Var,
    /// SwiGLU: the gate rows, then the up rows (2·inner, d_model); relu²: up (inner, d_model).
    input: Var,
    /// (d_model, inner).
    output: Var,
}

/// A trainable dense NoPE Granite 4.0 H or Nemotron-H hybrid.
pub struct TrainGraniteHybrid {
    config: GraniteHybridConfig,
    dtype: DType,
    device: Device,
    embedding: Var,
    blocks: Vec<Block>,
    norm_f: Var,
    lm_head: Option<Var>,
    chunk: usize,
}

impl TrainGraniteHybrid {
    /// Parameters initialised from `weights` in `dtype` on `device`. Models with routed
    /// experts or rotary positions, and other families, are refused: training covers the dense
    /// NoPE Granite 4.0 H and Nemotron-H hybrids.
    pub fn from_weights(
        config: &GraniteHybridConfig,
        weights: &GraniteHybridWeights,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let c = config;
        if !matches!(c.family, HybridFamily::Granite | HybridFamily::NemotronH) {
            candle_core::bail!(
                "training supports Granite 4.0 H and Nemotron-H hybrids (one mixer per layer, NoPE); this is a {} model",
                c.family.name()
            );
        }
        if c.n_experts > 0 {
            candle_core::bail!(
                "training supports dense Granite 4.0 H and Nemotron-H hybrids; this one routes to {} experts",
                c.n_experts
            );
        }
        if let Some(theta) = c.rope_theta {
            candle_core::bail!(
                "training supports hybrids without positional encoding (NoPE); this one uses rotary positions (rope_theta {theta})"
            );
        }
        let var = |v: &[f32], shape: &[usize]| var(v, shape, dtype, device);
        let (d, qw, kvw) = (c.d_model, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let blocks = weights
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let mixer = match &l.mixer {
                    MixerWeights::Mamba(w) => Mixer::Mamba(MambaLayer::new(&c.mamba, w, dtype, device)?),
                    MixerWeights::Parallel(..) => {
                        candle_core::bail!("training runs one mixer per layer (Granite 4.0 H's or Nemotron-H's)")
                    }
                    MixerWeights::Attention(AttentionWeights { q, k, v, o }) => Mixer::Attention {
                        input_norm: var(&l.input_norm, &[d])?,
                        q: var(q, &[qw, d])?,
                        k: var(k, &[kvw, d])?,
                        v: var(v, &[kvw, d])?,
                        o: var(o, &[d, qw])?,
                    },
                };
                let inner = c.mlp_inner(i);
                let mlp = l
                    .mlp
                    .as_ref()
                    .map(|m| -> Result<Mlp> {
                        Ok(Mlp {
                            norm: var(&m.norm, &[d])?,
                            input: var(&m.input, &[c.mlp_kind.projections() * inner, d])?,
                            output: var(&m.output, &[d, inner])?,
                        })
                    })
                    .transpose()?;
                Ok(Block { mixer, mlp })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            dtype,
            device: device.clone(),
            embedding: var(&weights.embedding, &[c.vocab_size, d])?,
            blocks,
            norm_f: var(&weights.norm_f, &[d])?,
            lm_head: weights.lm_head.as_deref().map(|h| var(h, &[c.vocab_size, d])).transpose()?,
            chunk: 64,
        })
    }

    /// The config.
    pub fn config(&self) -> &GraniteHybridConfig {
        &self.config
    }

    /// The parameters as host weights (f32).
    pub fn to_weights(&self) -> Result<GraniteHybridWeights> {
        let layers = self
            .blocks
            .iter()
            .map(|b| {
                let (input_norm, mixer) = match &b.mixer {
                    Mixer::Mamba(m) => (host(&m.norm)?, MixerWeights::Mamba(m.to_weights()?)),
                    Mixer::Attention { input_norm, q, k, v, o } => (
                        host(input_norm)?,
                        MixerWeights::Attention(AttentionWeights {
                            q: host(q)?,
                            k: host(k)?,
                            v: host(v)?,
                            o: host(o)?,
                        }),
                    ),
                };
                Ok(GraniteLayerWeights {
                    input_norm,
                    mixer,
                    mlp: b
                        .mlp
                        .as_ref()
                        .map(|m| -> Result<MlpWeights> {
                            Ok(MlpWeights { norm: host(&m.norm)?, input: host(&m.input)?, output: host(&m.output)? })
                        })
                        .transpose()?,
                    moe: None,
                })
            })
            .collect::<Result<_>>()?;
        Ok(GraniteHybridWeights {
            embedding: host(&self.embedding)?,
            layers,
            norm_f: host(&self.norm_f)?,
            lm_head: self.lm_head.as_ref().map(host).transpose()?,
        })
    }

    /// Grouped-query attention of the normed rows `xn` (B, T, d_model) over the keys and
    /// values `past` (B, Tp, kv_heads, head_dim, with `past_mask` (B, Tp); or none) and their
    /// own, causally: the output (B, T, d_model, before the residual), and all keys and values
    /// (B, Tp + T, ·, ·). `bias` (B, T, Tp + T) holds 0 for a key a row may see, −10⁹ else.
    fn attention(
        &self,
        [wq, wk, wv, wo]: [&Var; 4],
        xn: &Tensor,
        past: Option<(&Tensor, &Tensor)>,
        bias: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (b, t, d) = xn.dims3()?;
        let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
        let g = nh / nkv;
        let rows = xn.reshape((b * t, d))?;
        let q = rows.matmul(&wq.as_tensor().t()?)?;
        let k = rows.matmul(&wk.as_tensor().t()?)?.reshape((b, t, nkv, hd))?;
        let v = rows.matmul(&wv.as_tensor().t()?)?.reshape((b, t, nkv, hd))?;
        let (keys, values) = match past {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k], 1)?, Tensor::cat(&[pv, &v], 1)?),
            None => (k, v),
        };
        let tk = keys.dim(1)?;
        // Query heads h = a·g + j read key head a: (B·kv_heads, g·T, hd) against (B·kv_heads, Tk, hd).
        let q = q.reshape((b, t, nkv, g, hd))?.permute((0, 2, 3, 1, 4))?.reshape((b * nkv, g * t, hd))?;
        let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous()?.reshape((b * nkv, tk, hd));
        let scores = (q.matmul(&heads(&keys)?.t()?)? * c.attention_multiplier)?
            .reshape((b, nkv, g, t, tk))?
            .broadcast_add(&bias.reshape((b, 1, 1, t, tk))?)?;
        let p = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?.reshape((b * nkv, g * t, tk))?;
        let y = p.matmul(&heads(&values)?)?.reshape((b, nkv, g, t, hd))?.permute((0, 3, 1, 2, 4))?;
        let out = y.reshape((b * t, nh * hd))?.matmul(&wo.as_tensor().t()?)?.reshape((b, t, d))?;
        Ok((out, keys, values))
    }

    /// The MLP of the normed rows `xn` (B, T, d_model): SwiGLU, with the weight's row blocks
    /// sliced rather than the activations (cheaper in backward), or relu².
    fn mlp(&self, mlp: &Mlp, xn: &Tensor) -> Result<Tensor> {
        let (b, t, d) = xn.dims3()?;
        let rows = xn.reshape((b * t, d))?;
        let w = mlp.input.as_tensor();
        let act = match self.config.mlp_kind {
            MlpKind::SwiGlu => {
                let i = w.dim(0)? / 2;
                let gate = rows.matmul(&w.narrow(0, 0, i)?.t()?)?;
                let up = rows.matmul(&w.narrow(0, i, i)?.t()?)?;
                (candle_nn::ops::silu(&gate)? * up)?
            }
            MlpKind::Relu2 => rows.matmul(&w.t()?)?.relu()?.sqr()?,
        };
        act.matmul(&mlp.output.as_tensor().t()?)?.reshape((b, t, d))
    }

    /// The attention bias (B, T, Tp + T) of `t` new rows after `tp` past keys: past keys count
    /// where `past_mask` says so; new keys causally, where `mask` says so.
    fn bias(&self, b: usize, t: usize, tp: usize, past_mask: Option<&Tensor>, mask: Option<&Tensor>) -> Result<Tensor> {
        let hidden = |m: &Tensor| -> Result<Tensor> { (m.to_dtype(self.dtype)? - 1.0)? * -HIDDEN };
        let causal: Vec<f32> = (0..t * t).map(|i| if i % t <= i / t { 0.0 } else { HIDDEN as f32 }).collect();
        let mut new =
            Tensor::from_vec(causal, (1, t, t), &self.device)?.to_dtype(self.dtype)?.broadcast_as((b, t, t))?;
        if let Some(m) = mask {
            new = new.broadcast_add(&hidden(m)?.unsqueeze(1)?)?;
        }
        if tp == 0 {
            return new.contiguous();
        }
        let old = match past_mask {
            Some(m) => hidden(m)?.unsqueeze(1)?.broadcast_as((b, t, tp))?,
            None => Tensor::zeros((b, t, tp), self.dtype, &self.device)?,
        };
        Tensor::cat(&[&old, &new], 2)
    }
}

impl Net for TrainGraniteHybrid {
    type Config = GraniteHybridConfig;
    type Weights = GraniteHybridWeights;

    fn build(
        config: &GraniteHybridConfig,
        weights: &GraniteHybridWeights,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_weights(config, weights, dtype, device)
    }

    fn load_weights(dir: &Path, config: &GraniteHybridConfig) -> Result<GraniteHybridWeights> {
        GraniteHybridWeights::load(dir, config).map_err(|e| crate::io(e, dir))
    }

    fn save_weights(weights: &GraniteHybridWeights, config: &GraniteHybridConfig, dir: &Path) -> Result<()> {
        weights.save_pretrained(dir, config).map_err(|e| crate::io(e, dir))
    }

    fn fingerprint(weights: &GraniteHybridWeights, config: &GraniteHybridConfig) -> String {
        weights.fingerprint(config)
    }

    fn with_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(1);
        self
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.embedding.clone()];
        for b in &self.blocks {
            match &b.mixer {
                Mixer::Mamba(m) => v.extend(m.vars()),
                Mixer::Attention { input_norm, q, k, v: vw, o } => v.extend([input_norm, q, k, vw, o].map(Var::clone)),
            }
            if let Some(m) = &b.mlp {
                v.extend([&m.norm, &m.input, &m.output].map(Var::clone));
            }
        }
        v.push(self.norm_f.clone());
        v.extend(self.lm_head.clone());
        v
    }

    fn save_pretrained(&self, dir: &Path) -> Result<()> {
        Self::save_weights(&self.to_weights()?, &self.config, dir)
    }

    fn head(&self) -> &Var {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    fn forward_hidden_masked(
        &self,
        tokens: &Tensor,
        init: Option<&TrainState>,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, TrainState)> {
        let c = &self.config;
        let (b, t) = tokens.dims2()?;
        let init = TrainState::or_zeros(init, &c.mamba, b, self.dtype, &self.device)?;
        let tp = match init.keys.first() {
            Some(k) => k.dim(1)?,
            None => 0,
        };
        let bias = self.bias(b, t, tp, init.kv_mask.as_ref(), mask)?;
        let mut h = self.embedding.as_tensor().embedding(&tokens.flatten_all()?)?.reshape((b, t, c.d_model))?;
        if c.embedding_multiplier != 1.0 {
            h = (h * c.embedding_multiplier)?;
        }
        let rm = c.residual_multiplier;
        let mut next = TrainState::default();
        let (mut m, mut a) = (0, 0);
        for (block, kind) in self.blocks.iter().zip(&c.layers) {
            let out = match (&block.mixer, kind) {
                (Mixer::Mamba(w), LayerKind::Mamba) => {
                    let xn = rms_norm(&h, w.norm.as_tensor(), 1, c.norm_eps)?;
                    let from = (&init.ssm[m], &init.conv[m], &init.log_decay[m]);
                    let (out, ssm, conv, ld) = w.mix(&c.mamba, self.chunk, &xn, from, mask)?;
                    next.ssm.push(ssm);
                    next.conv.push(conv);
                    next.log_decay.push(ld);
                    m += 1;
                    out
                }
                (Mixer::Attention { input_norm, q, k, v, o }, LayerKind::Attention) => {
                    let xn = rms_norm(&h, input_norm.as_tensor(), 1, c.norm_eps)?;
                    let past = (tp > 0).then(|| (&init.keys[a], &init.values[a]));
                    let (out, keys, values) = self.attention([q, k, v, o], &xn, past, &bias)?;
                    next.keys.push(keys);
                    next.values.push(values);
                    a += 1;
                    out
                }
                _ => unreachable!("blocks are built from the config's layer kinds"),
            };
            h = (h + (out * rm)?)?;
            if let Some(mlp) = &block.mlp {
                let xn = rms_norm(&h, mlp.norm.as_tensor(), 1, c.norm_eps)?;
                h = (h + (self.mlp(mlp, &xn)? * rm)?)?;
            }
        }
        // Which key positions hold tokens: the past's, then the new rows'.
        if !next.keys.is_empty() && (init.kv_mask.is_some() || mask.is_some()) {
            let ones = |n: usize| Tensor::ones((b, n), self.dtype, &self.device);
            let old = match (&init.kv_mask, tp) {
                (_, 0) => None,
                (Some(pm), _) => Some(pm.to_dtype(self.dtype)?),
                (None, _) => Some(ones(tp)?),
            };
            let new = match mask {
                Some(m) => m.to_dtype(self.dtype)?,
                None => ones(t)?,
            };
            next.kv_mask = Some(match old {
                Some(old) => Tensor::cat(&[&old, &new], 1)?,
                None => new,
            });
        }
        let mut out = rms_norm(&h, self.norm_f.as_tensor(), 1, c.norm_eps)?;
        if c.logits_scaling != 1.0 {
            out = (out / c.logits_scaling)?;
        }
        Ok((out, next))
    }
}
