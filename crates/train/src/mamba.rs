//! A differentiable Mamba-2 on candle autograd, batched, starting from any state.
//!
//! The scan is the chunked "state space duality" form: within a chunk of L tokens the outputs
//! are a masked, decay-weighted attention-like product (three matmuls); between chunks one
//! (P × N) state per head carries the past. This is the same recurrence as the inference
//! engines — `s ← exp(dt·A)·s + dt·x ⊗ B`, `y = s·C + D·x` — computed in T/L sequential steps
//! instead of T, which is what makes backpropagation through long sequences affordable.
//!
//! Every parameter is a candle `Var`; [`TrainMamba2::to_weights`] turns them back into
//! [`Mamba2Weights`], which `save_pretrained` writes in the HF layout the loaders read.

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use picaso_model::mamba2::LayerWeights;
use picaso_model::{Mamba2Config, Mamba2Weights, State};

use crate::kernels::{causal_conv, rms_norm};
use crate::net::Net;
use crate::Result;

/// One Mamba-2 mixer's parameters, with the RMSNorm before it (the block's input norm).
pub(crate) struct MambaLayer {
    pub(crate) norm: Var,
    in_proj: Var,
    in_proj_bias: Option<Var>,
    /// (C, K)
    conv_w: Var,
    conv_b: Option<Var>,
    dt_bias: Var,
    a_log: Var,
    d: Var,
    gated_norm: Var,
    out_proj: Var,
    out_proj_bias: Option<Var>,
}

/// A parameter from host values, in `dtype` on `device`.
pub(crate) fn var(v: &[f32], shape: &[usize], dtype: DType, device: &Device) -> Result<Var> {
    Var::from_tensor(&Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
}

/// A parameter's values on the host (f32).
pub(crate) fn host(v: &Var) -> Result<Vec<f32>> {
    v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

impl MambaLayer {
    pub(crate) fn new(c: &Mamba2Config, l: &LayerWeights, dtype: DType, device: &Device) -> Result<Self> {
        let var = |v: &[f32], shape: &[usize]| var(v, shape, dtype, device);
        Ok(Self {
            norm: var(&l.norm, &[c.d_model])?,
            in_proj: var(&l.in_proj, &[c.d_in_proj(), c.d_model])?,
            in_proj_bias: l.in_proj_bias.as_deref().map(|b| var(b, &[c.d_in_proj()])).transpose()?,
            conv_w: var(&l.conv_weight, &[c.conv_dim(), c.d_conv])?,
            conv_b: l.conv_bias.as_deref().map(|b| var(b, &[c.conv_dim()])).transpose()?,
            dt_bias: var(&l.dt_bias, &[c.nheads])?,
            a_log: var(&l.a_log, &[c.nheads])?,
            d: var(&l.d, &[c.nheads])?,
            gated_norm: var(&l.gated_norm, &[c.d_inner()])?,
            out_proj: var(&l.out_proj, &[c.d_model, c.d_inner()])?,
            out_proj_bias: l.out_proj_bias.as_deref().map(|b| var(b, &[c.d_model])).transpose()?,
        })
    }

    /// Every parameter, in a fixed order.
    pub(crate) fn vars(&self) -> Vec<Var> {
        let mut v: Vec<Var> = [
            &self.norm,
            &self.in_proj,
            &self.conv_w,
            &self.dt_bias,
            &self.a_log,
            &self.d,
            &self.gated_norm,
            &self.out_proj,
        ]
        .map(Var::clone)
        .into();
        v.extend([&self.in_proj_bias, &self.conv_b, &self.out_proj_bias].into_iter().flatten().cloned());
        v
    }

    pub(crate) fn to_weights(&self) -> Result<LayerWeights> {
        let opt = |v: &Option<Var>| v.as_ref().map(host).transpose();
        Ok(LayerWeights {
            norm: host(&self.norm)?,
            in_proj: host(&self.in_proj)?,
            in_proj_bias: opt(&self.in_proj_bias)?,
            conv_weight: host(&self.conv_w)?,
            conv_bias: opt(&self.conv_b)?,
            dt_bias: host(&self.dt_bias)?,
            a_log: host(&self.a_log)?,
            d: host(&self.d)?,
            gated_norm: host(&self.gated_norm)?,
            out_proj: host(&self.out_proj)?,
            out_proj_bias: opt(&self.out_proj_bias)?,
        })
    }

    /// The mixer on normed rows `xn` (B, T, d_model) from the state `(ssm0, conv0, ld0)`: its
    /// output (before the residual) and the state after. Positions whose `mask` (B, T) is 0
    /// leave the state untouched.
    #[allow(clippy::type_complexity)]
    pub(crate) fn mix(
        &self,
        c: &Mamba2Config,
        chunk: usize,
        xn: &Tensor,
        (ssm0, conv0, ld0): (&Tensor, &Tensor, &Tensor),
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let w = self;
        let (b, t, dm) = xn.dims3()?;
        let (di, cd, k, nh, p, n, g) =
            (c.d_inner(), c.conv_dim(), c.d_conv, c.nheads, c.headdim, c.d_state, c.n_groups);
        let dtype = xn.dtype();

        // in_proj as three products on row blocks of the weight: slicing the (small) weight is
        // cheap in backward, slicing the (B, T, ·) activations is not.
        let xn = xn.reshape((b * t, dm))?;
        let project = |start: usize, len: usize| -> Result<Tensor> {
            let mut out = xn.matmul(&w.in_proj.as_tensor().narrow(0, start, len)?.t()?)?;
            if let Some(bias) = &w.in_proj_bias {
                out = out.broadcast_add(&bias.as_tensor().narrow(0, start, len)?)?;
            }
            out.reshape((b, t, len))
        };
        let z = project(0, di)?;
        let mut xbc_in = project(di, cd)?;
        let dt_raw = project(di + cd, nh)?;
        let mask = mask.map(|m| m.to_dtype(dtype)?.unsqueeze(2)).transpose()?; // (B, T, 1)
        if let Some(m) = &mask {
            xbc_in = xbc_in.broadcast_mul(m)?;
        }

        // Causal depthwise conv over [tail; input] → (B, T, C), then SiLU.
        let seq = Tensor::cat(&[&conv0.transpose(1, 2)?, &xbc_in], 1)?; // (B, K-1+T, C)
        let conv = causal_conv(&seq, w.conv_w.as_tensor(), w.conv_b.as_ref().map(Var::as_tensor))?;
        let xbc = candle_nn::ops::silu(&conv)?;
        let conv_next = seq.narrow(1, t, k - 1)?.transpose(1, 2)?.contiguous()?; // (B, C, K-1)

        // dt (B, T, H) and the per-token log-decays a = dt·A.
        let (lo, hi) = c.time_step_limit;
        let mut dt = picaso_model::mamba2::candle::softplus(
            &dt_raw.broadcast_add(&w.dt_bias.as_tensor().reshape((1, 1, nh))?)?,
        )?;
        if lo > 0.0 || hi.is_finite() {
            dt = dt.clamp(lo, hi)?;
        }
        if let Some(m) = &mask {
            dt = dt.broadcast_mul(m)?;
        }
        let a = w.a_log.as_tensor().exp()?.neg()?; // (H)
        let la = dt.broadcast_mul(&a.reshape((1, 1, nh))?)?.transpose(1, 2)?.contiguous()?; // (B, H, T)

        // Heads: x̄ = dt·x (B, H, T, P); B, C expanded from groups to heads (B, H, T, N).
        let x = xbc.narrow(2, 0, di)?.reshape((b, t, nh, p))?;
        let xdt = x.broadcast_mul(&dt.unsqueeze(3)?)?.transpose(1, 2)?.contiguous()?;
        let per_group = nh / g;
        let heads = |m: Tensor| -> Result<Tensor> {
            m.reshape((b, t, g, 1, n))?
                .broadcast_as((b, t, g, per_group, n))?
                .reshape((b, t, nh, n))?
                .transpose(1, 2)?
                .contiguous()
        };
        let bm = heads(xbc.narrow(2, di, g * n)?)?;
        let cm = heads(xbc.narrow(2, di + g * n, g * n)?)?;

        let (y, s) = scan(chunk, &la, &xdt, &bm, &cm, ssm0)?;
        let ld_next = (ld0 + la.sum(2)?)?;
        let y = y.transpose(1, 2)?; // (B, T, H, P)
        let y = y.broadcast_add(&x.broadcast_mul(&w.d.as_tensor().reshape((1, 1, nh, 1))?)?)?;

        // Gated RMSNorm by groups, out_proj.
        let v = y.reshape((b, t, di))?.mul(&candle_nn::ops::silu(&z)?)?;
        let normed = rms_norm(&v, w.gated_norm.as_tensor(), g, c.gated_norm_eps)?;
        let mut out = normed.reshape((b * t, di))?.matmul(&w.out_proj.as_tensor().t()?)?;
        if let Some(bias) = &w.out_proj_bias {
            out = out.broadcast_add(bias.as_tensor())?;
        }
        Ok((out.reshape((b, t, dm))?, s, conv_next, ld_next))
    }
}

/// A batch of states as tensors: per Mamba layer the SSM state (B, H, P, N), the conv tail
/// (B, C, K-1), oldest input first, and the accumulated log-decay (B, H); per attention layer of
/// a hybrid the keys and values (B, T, kv_heads, head_dim), and which of those T positions hold
/// a token (rows of different lengths are padded).
#[derive(Debug, Clone, Default)]
pub struct TrainState {
    /// SSM states.
    pub ssm: Vec<Tensor>,
    /// Conv tails.
    pub conv: Vec<Tensor>,
    /// Log-decays.
    pub log_decay: Vec<Tensor>,
    /// Keys per attention layer (empty: no attention layers, or no tokens yet).
    pub keys: Vec<Tensor>,
    /// Values per attention layer.
    pub values: Vec<Tensor>,
    /// (B, T) of the keys: 1 where a position holds a token, 0 where it is padding; `None`
    /// when every position holds one. The same for every attention layer.
    pub kv_mask: Option<Tensor>,
}

impl TrainState {
    /// The zero state of `n` Mamba layers of `config`'s shapes for a batch of `b` (no keys).
    pub fn zeros(config: &Mamba2Config, b: usize, dtype: DType, device: &Device) -> Result<Self> {
        let c = config;
        let n = c.n_layer;
        Ok(Self {
            ssm: (0..n)
                .map(|_| Tensor::zeros((b, c.nheads, c.headdim, c.d_state), dtype, device))
                .collect::<Result<_>>()?,
            conv: (0..n)
                .map(|_| Tensor::zeros((b, c.conv_dim(), c.d_conv - 1), dtype, device))
                .collect::<Result<_>>()?,
            log_decay: (0..n).map(|_| Tensor::zeros((b, c.nheads), dtype, device)).collect::<Result<_>>()?,
            ..Self::default()
        })
    }

    /// `init`, or the zero state of `config`'s Mamba layers for a batch of `b`.
    pub(crate) fn or_zeros<'a>(
        init: Option<&'a TrainState>,
        config: &Mamba2Config,
        b: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<std::borrow::Cow<'a, TrainState>> {
        Ok(match init {
            Some(s) => std::borrow::Cow::Borrowed(s),
            None => std::borrow::Cow::Owned(Self::zeros(config, b, dtype, device)?),
        })
    }

    /// Stacks inference states (one per batch row) into tensors. Keys and values of rows with
    /// fewer tokens are padded at the end and masked.
    pub fn from_states(states: &[&State], dtype: DType, device: &Device) -> Result<Self> {
        let first = states.first().ok_or_else(|| candle_core::Error::Msg("no states to stack".into()))?;
        let sh = &first.shape;
        let b = states.len();
        let to = |flat: Vec<f32>, shape: Vec<usize>| -> Result<Tensor> {
            Tensor::from_vec(flat, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)
        };
        let stack = |get: &dyn Fn(&State, usize) -> Vec<f32>, layer: usize, dims: &[usize]| -> Result<Tensor> {
            let flat: Vec<f32> = states.iter().flat_map(|s| get(s, layer)).collect();
            to(flat, [&[b][..], dims].concat())
        };
        let mut out = Self::default();
        for l in 0..sh.n_layer {
            out.ssm.push(stack(&|s, l| s.layers[l].ssm.clone(), l, &sh.ssm)?);
            out.conv.push(stack(&|s, l| s.layers[l].conv.clone(), l, &sh.conv)?);
            out.log_decay.push(stack(&|s, l| s.layers[l].log_decay.clone(), l, &sh.log_decay)?);
        }
        let Some(att) = &sh.attention else { return Ok(out) };
        let width = att.kv_heads * att.head_dim;
        let lens: Vec<usize> = states.iter().map(|s| s.attention.first().map_or(0, |kv| kv.tokens(width))).collect();
        let t = lens.iter().copied().max().unwrap_or(0);
        if t == 0 {
            return Ok(out);
        }
        for l in 0..att.layers.len() {
            let padded = |get: &dyn Fn(&picaso_model::KvState) -> &Vec<f32>| -> Result<Tensor> {
                let mut flat = Vec::with_capacity(b * t * width);
                for s in states {
                    let rows = get(&s.attention[l]);
                    flat.extend_from_slice(rows);
                    flat.resize(flat.len() + t * width - rows.len(), 0.0);
                }
                to(flat, vec![b, t, att.kv_heads, att.head_dim])
            };
            out.keys.push(padded(&|kv| &kv.keys)?);
            out.values.push(padded(&|kv| &kv.values)?);
        }
        if lens.iter().any(|&n| n < t) {
            let mask = lens.iter().flat_map(|&n| (0..t).map(move |i| if i < n { 1.0f32 } else { 0.0 })).collect();
            out.kv_mask = Some(to(mask, vec![b, t])?);
        }
        Ok(out)
    }

    /// Row `i` of the batch as an inference state, in the shapes of `template` (a state of
    /// the same model): padded key positions are dropped.
    pub fn to_state(&self, i: usize, template: &State) -> Result<State> {
        let mut s = template.clone();
        let row = |t: &Tensor| -> Result<Vec<f32>> { t.get(i)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        for (l, layer) in s.layers.iter_mut().enumerate() {
            layer.ssm = row(&self.ssm[l])?;
            layer.conv = row(&self.conv[l])?;
            layer.log_decay = row(&self.log_decay[l])?;
        }
        let keep: Option<Vec<bool>> = match &self.kv_mask {
            Some(m) => Some(row(m)?.iter().map(|&v| v > 0.5).collect()),
            None => None,
        };
        for (l, kv) in s.attention.iter_mut().enumerate() {
            let (Some(k), Some(v)) = (self.keys.get(l), self.values.get(l)) else {
                kv.keys.clear();
                kv.values.clear();
                continue;
            };
            let width = k.dim(2)? * k.dim(3)?;
            let held = |t: &Tensor| -> Result<Vec<f32>> {
                let all = row(t)?;
                Ok(match &keep {
                    None => all,
                    Some(keep) => {
                        all.chunks(width).zip(keep).filter(|(_, &k)| k).flat_map(|(r, _)| r.to_vec()).collect()
                    }
                })
            };
            kv.keys = held(k)?;
            kv.values = held(v)?;
        }
        Ok(s)
    }

    /// The rows of `parts` one after another (as one batch), then reordered by `index` (row i
    /// of the result is row `index[i]` of the concatenation). Keys of different lengths are
    /// padded at the end and masked.
    pub(crate) fn cat_select(parts: &[TrainState], index: &Tensor) -> Result<Self> {
        let layers = |get: &dyn Fn(&TrainState) -> &Vec<Tensor>| -> Result<Vec<Tensor>> {
            (0..get(&parts[0]).len())
                .map(|l| Tensor::cat(&parts.iter().map(|p| &get(p)[l]).collect::<Vec<_>>(), 0)?.index_select(index, 0))
                .collect()
        };
        let mut out = Self {
            ssm: layers(&|p| &p.ssm)?,
            conv: layers(&|p| &p.conv)?,
            log_decay: layers(&|p| &p.log_decay)?,
            ..Self::default()
        };
        if parts[0].keys.is_empty() {
            return Ok(out);
        }
        let t = parts.iter().map(|p| p.keys[0].dim(1)).collect::<Result<Vec<_>>>()?.into_iter().max().unwrap_or(0);
        let pad_to = |x: &Tensor| -> Result<Tensor> {
            let have = x.dim(1)?;
            if have == t {
                return Ok(x.clone());
            }
            let mut shape = x.dims().to_vec();
            shape[1] = t - have;
            Tensor::cat(&[x, &Tensor::zeros(shape, x.dtype(), x.device())?], 1)
        };
        for l in 0..parts[0].keys.len() {
            for (get, dst) in [(0, &mut out.keys), (1, &mut out.values)] {
                let rows: Vec<Tensor> = parts
                    .iter()
                    .map(|p| pad_to(if get == 0 { &p.keys[l] } else { &p.values[l] }))
                    .collect::<Result<_>>()?;
                dst.push(Tensor::cat(&rows, 0)?.index_select(index, 0)?);
            }
        }
        let masks: Vec<Tensor> = parts
            .iter()
            .map(|p| {
                let (b, have) = (p.keys[0].dim(0)?, p.keys[0].dim(1)?);
                let m = match &p.kv_mask {
                    Some(m) => m.clone(),
                    None => Tensor::ones((b, have), p.keys[0].dtype(), p.keys[0].device())?,
                };
                pad_to(&m)
            })
            .collect::<Result<_>>()?;
        let mask = Tensor::cat(&masks, 0)?.index_select(index, 0)?;
        let full = mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()? == mask.elem_count() as f64;
        out.kv_mask = (!full).then_some(mask);
        Ok(out)
    }
}

/// A trainable Mamba-2 language model.
pub struct TrainMamba2 {
    config: Mamba2Config,
    dtype: DType,
    device: Device,
    embedding: Var,
    layers: Vec<MambaLayer>,
    norm_f: Var,
    lm_head: Option<Var>,
    /// Tokens per chunk of the scan.
    chunk: usize,
}

impl TrainMamba2 {
    /// Parameters initialised from `weights` (f32 on the host) in `dtype` on `device`.
    pub fn from_weights(config: &Mamba2Config, weights: &Mamba2Weights, dtype: DType, device: &Device) -> Result<Self> {
        let c = config;
        let layers = weights.layers.iter().map(|l| MambaLayer::new(c, l, dtype, device)).collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            dtype,
            device: device.clone(),
            embedding: var(&weights.embedding, &[c.vocab_size, c.d_model], dtype, device)?,
            layers,
            norm_f: var(&weights.norm_f, &[c.d_model], dtype, device)?,
            lm_head: weights
                .lm_head
                .as_deref()
                .map(|h| var(h, &[c.vocab_size, c.d_model], dtype, device))
                .transpose()?,
            chunk: 64,
        })
    }

    /// Sets the scan's chunk length (any length gives the same result up to rounding).
    pub fn with_chunk(mut self, chunk: usize) -> Self {
        self.chunk = chunk.max(1);
        self
    }

    /// The config.
    pub fn config(&self) -> &Mamba2Config {
        &self.config
    }

    /// The parameters as host weights (f32), for saving and for the inference engines.
    pub fn to_weights(&self) -> Result<Mamba2Weights> {
        Ok(Mamba2Weights {
            embedding: host(&self.embedding)?,
            layers: self.layers.iter().map(MambaLayer::to_weights).collect::<Result<_>>()?,
            norm_f: host(&self.norm_f)?,
            lm_head: self.lm_head.as_ref().map(host).transpose()?,
        })
    }

    /// Runs `tokens` (B, T) from `init` (zeros if `None`): the final-normed hidden states
    /// (B, T, d_model) and the state after the last token.
    pub fn forward_hidden(&self, tokens: &Tensor, init: Option<&TrainState>) -> Result<(Tensor, TrainState)> {
        self.forward_hidden_masked(tokens, init, None)
    }
}

impl Net for TrainMamba2 {
    type Config = Mamba2Config;
    type Weights = Mamba2Weights;

    fn build(config: &Mamba2Config, weights: &Mamba2Weights, dtype: DType, device: &Device) -> Result<Self> {
        Self::from_weights(config, weights, dtype, device)
    }

    fn load_weights(dir: &Path, config: &Mamba2Config) -> Result<Mamba2Weights> {
        Mamba2Weights::load(dir, config).map_err(|e| crate::io(e, dir))
    }

    fn save_weights(weights: &Mamba2Weights, config: &Mamba2Config, dir: &Path) -> Result<()> {
        weights.save_pretrained(dir, config).map_err(|e| crate::io(e, dir))
    }

    fn fingerprint(weights: &Mamba2Weights, config: &Mamba2Config) -> String {
        weights.fingerprint(config)
    }

    fn with_chunk(self, chunk: usize) -> Self {
        TrainMamba2::with_chunk(self, chunk)
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.embedding.clone()];
        for l in &self.layers {
            v.extend(l.vars());
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
        let (b, _t) = tokens.dims2()?;
        let c = &self.config;
        let init = TrainState::or_zeros(init, c, b, self.dtype, &self.device)?;
        let mut h = self.embedding.as_tensor().embedding(&tokens.flatten_all()?)?.reshape((b, (), c.d_model))?;
        let mut next = TrainState::default();
        for (l, layer) in self.layers.iter().enumerate() {
            let xn = rms_norm(&h, layer.norm.as_tensor(), 1, c.norm_eps)?;
            let from = (&init.ssm[l], &init.conv[l], &init.log_decay[l]);
            let (out, ssm, conv, ld) = layer.mix(c, self.chunk, &xn, from, mask)?;
            h = (h + out)?;
            next.ssm.push(ssm);
            next.conv.push(conv);
            next.log_decay.push(ld);
        }
        Ok((rms_norm(&h, self.norm_f.as_tensor(), 1, c.norm_eps)?, next))
    }
}

/// The chunked scan, all chunks at once: log-decays `la` (B, H, T), inputs `xdt` (B, H, T, P),
/// `bm`, `cm` (B, H, T, N), initial state `s0` (B, H, P, N) → outputs (B, H, T, P) and the
/// final state. Within a chunk the outputs are a masked decay-weighted product; between
/// chunks a (chunks+1)² decay matrix carries the initial state and each chunk's
/// contribution forward. No per-chunk slicing: slices cost a full-size copy in backward.
fn scan(chunk: usize, la: &Tensor, xdt: &Tensor, bm: &Tensor, cm: &Tensor, s0: &Tensor) -> Result<(Tensor, Tensor)> {
    let (b, h, t, p) = xdt.dims4()?;
    let n = bm.dim(3)?;
    let l = chunk.min(t).max(1);
    let nc = t.div_ceil(l);
    let tp = nc * l;
    // Zero padding is neutral: no input and no decay (exp(0) = 1) past the end.
    let pad = |m: &Tensor| -> Result<Tensor> {
        if tp == t {
            return Ok(m.clone());
        }
        let mut shape = m.dims().to_vec();
        shape[2] = tp - t;
        Tensor::cat(&[m, &Tensor::zeros(shape, m.dtype(), m.device())?], 2)
    };
    // Batch and heads merge into one dimension (candle's matmul takes at most two batch dims).
    let bh = b * h;
    let la = pad(la)?.reshape((bh, nc, l))?;
    let xdt = pad(xdt)?.reshape((bh, nc, l, p))?;
    let bm = pad(bm)?.reshape((bh, nc, l, n))?;
    let cm = pad(cm)?.reshape((bh, nc, l, n))?;

    let cum = la.cumsum(2)?; // (BH, C, L)
                             // decay[i, j] = exp(cum_i − cum_j) for j ≤ i, else 0 (−∞ before the exp keeps it finite).
    let seg = cum.unsqueeze(3)?.broadcast_sub(&cum.unsqueeze(2)?)?;
    let decay = seg.broadcast_add(&causal_mask(l, la.dtype(), la.device())?)?.exp()?; // (BH, C, L, L)
    let scores = cm.matmul(&bm.transpose(2, 3)?.contiguous()?)?.mul(&decay)?;
    let y_in = scores.matmul(&xdt)?; // (BH, C, L, P)

    // Each chunk's own contribution to the state at its end.
    let total = cum.narrow(2, l - 1, 1)?; // (BH, C, 1)
    let to_end = total.broadcast_sub(&cum)?.exp()?;
    let own = xdt.broadcast_mul(&to_end.unsqueeze(3)?)?.transpose(2, 3)?.contiguous()?.matmul(&bm)?; // (BH, C, P, N)

    // Items [s0, own_0, …, own_{C−1}] end at log-times E = [0, Σ≤0, …, Σ≤C−1]; the state after
    // item i is Σ_{k≤i} exp(E_i − E_k)·item_k. Row c < C is the state entering chunk c.
    let ends = Tensor::cat(&[&Tensor::zeros((bh, 1), la.dtype(), la.device())?, &total.squeeze(2)?.cumsum(1)?], 1)?;
    let between = ends.unsqueeze(2)?.broadcast_sub(&ends.unsqueeze(1)?)?;
    let carry = between.broadcast_add(&causal_mask(nc + 1, la.dtype(), la.device())?)?.exp()?; // (BH, C+1, C+1)
    let items = Tensor::cat(&[&s0.reshape((bh, 1, p * n))?, &own.reshape((bh, nc, p * n))?], 1)?;
    let states = carry.matmul(&items)?; // (BH, C+1, P·N)
    let entering = states.narrow(1, 0, nc)?.reshape((bh, nc, p, n))?;
    let last = states.narrow(1, nc, 1)?.reshape((b, h, p, n))?;

    let y_past = cm.matmul(&entering.transpose(2, 3)?.contiguous()?)?.broadcast_mul(&cum.exp()?.unsqueeze(3)?)?;
    let y = (y_in + y_past)?.reshape((b, h, tp, p))?;
    let y = if tp == t { y } else { y.narrow(2, 0, t)? };
    Ok((y, last))
}

/// (L, L): 0 on and below the diagonal, −∞ above.
fn causal_mask(l: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..l * l).map(|i| if i % l <= i / l { 0.0 } else { f32::NEG_INFINITY }).collect();
    Tensor::from_vec(v, (l, l), device)?.to_dtype(dtype)
}
