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

use candle_core::{DType, Device, Tensor, Var, D};
use picaso_model::{Mamba2Config, Mamba2Weights, State};

use crate::kernels::{causal_conv, rms_norm};
use crate::Result;

/// One block's parameters.
struct Layer {
    norm: Var,
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

/// A batch of states as tensors: per layer the SSM state (B, H, P, N), the conv tail
/// (B, C, K-1), oldest input first, and the accumulated log-decay (B, H).
#[derive(Debug, Clone)]
pub struct TrainState {
    /// SSM states.
    pub ssm: Vec<Tensor>,
    /// Conv tails.
    pub conv: Vec<Tensor>,
    /// Log-decays.
    pub log_decay: Vec<Tensor>,
}

impl TrainState {
    /// The zero state for a batch of `b`.
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
        })
    }

    /// Stacks inference states (one per batch row) into tensors.
    pub fn from_states(states: &[&State], dtype: DType, device: &Device) -> Result<Self> {
        let first = states.first().ok_or_else(|| candle_core::Error::Msg("no states to stack".into()))?;
        let sh = &first.shape;
        let b = states.len();
        let stack = |get: &dyn Fn(&State, usize) -> Vec<f32>, layer: usize, dims: &[usize]| -> Result<Tensor> {
            let flat: Vec<f32> = states.iter().flat_map(|s| get(s, layer)).collect();
            let mut shape = vec![b];
            shape.extend_from_slice(dims);
            Tensor::from_vec(flat, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)
        };
        let mut out = Self { ssm: Vec::new(), conv: Vec::new(), log_decay: Vec::new() };
        for l in 0..sh.n_layer {
            out.ssm.push(stack(&|s, l| s.layers[l].ssm.clone(), l, &sh.ssm)?);
            out.conv.push(stack(&|s, l| s.layers[l].conv.clone(), l, &sh.conv)?);
            out.log_decay.push(stack(&|s, l| s.layers[l].log_decay.clone(), l, &sh.log_decay)?);
        }
        Ok(out)
    }

    /// Row `i` of the batch as an inference state of `model_fingerprint`.
    pub fn to_state(&self, i: usize, template: &State) -> Result<State> {
        let mut s = template.clone();
        for (l, layer) in s.layers.iter_mut().enumerate() {
            let row = |t: &Tensor| -> Result<Vec<f32>> { t.get(i)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
            layer.ssm = row(&self.ssm[l])?;
            layer.conv = row(&self.conv[l])?;
            layer.log_decay = row(&self.log_decay[l])?;
        }
        Ok(s)
    }
}

/// A trainable Mamba-2 language model.
pub struct TrainMamba2 {
    config: Mamba2Config,
    dtype: DType,
    device: Device,
    embedding: Var,
    layers: Vec<Layer>,
    norm_f: Var,
    lm_head: Option<Var>,
    /// Tokens per chunk of the scan.
    chunk: usize,
}

impl TrainMamba2 {
    /// Parameters initialised from `weights` (f32 on the host) in `dtype` on `device`.
    pub fn from_weights(config: &Mamba2Config, weights: &Mamba2Weights, dtype: DType, device: &Device) -> Result<Self> {
        let var = |v: &[f32], shape: &[usize]| -> Result<Var> {
            Var::from_tensor(&Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
        };
        let c = config;
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
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
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            dtype,
            device: device.clone(),
            embedding: var(&weights.embedding, &[c.vocab_size, c.d_model])?,
            layers,
            norm_f: var(&weights.norm_f, &[c.d_model])?,
            lm_head: weights.lm_head.as_deref().map(|h| var(h, &[c.vocab_size, c.d_model])).transpose()?,
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

    /// The dtype of parameters and activations.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Every parameter, in a fixed order (for optimisers and checkpoints).
    pub fn vars(&self) -> Vec<Var> {
        let mut v = vec![self.embedding.clone()];
        for l in &self.layers {
            v.extend(
                [&l.norm, &l.in_proj, &l.conv_w, &l.dt_bias, &l.a_log, &l.d, &l.gated_norm, &l.out_proj]
                    .map(Var::clone),
            );
            v.extend([&l.in_proj_bias, &l.conv_b, &l.out_proj_bias].into_iter().flatten().cloned());
        }
        v.push(self.norm_f.clone());
        v.extend(self.lm_head.clone());
        v
    }

    /// The parameters as host weights (f32), for saving and for the inference engines.
    pub fn to_weights(&self) -> Result<Mamba2Weights> {
        let host = |v: &Var| -> Result<Vec<f32>> { v.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let opt = |v: &Option<Var>| v.as_ref().map(host).transpose();
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(picaso_model::mamba2::LayerWeights {
                    norm: host(&l.norm)?,
                    in_proj: host(&l.in_proj)?,
                    in_proj_bias: opt(&l.in_proj_bias)?,
                    conv_weight: host(&l.conv_w)?,
                    conv_bias: opt(&l.conv_b)?,
                    dt_bias: host(&l.dt_bias)?,
                    a_log: host(&l.a_log)?,
                    d: host(&l.d)?,
                    gated_norm: host(&l.gated_norm)?,
                    out_proj: host(&l.out_proj)?,
                    out_proj_bias: opt(&l.out_proj_bias)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Mamba2Weights {
            embedding: host(&self.embedding)?,
            layers,
            norm_f: host(&self.norm_f)?,
            lm_head: opt(&self.lm_head)?,
        })
    }

    /// Runs `tokens` (B, T) from `init` (zeros if `None`): the final-normed hidden states
    /// (B, T, d_model) and the state after the last token.
    pub fn forward_hidden(&self, tokens: &Tensor, init: Option<&TrainState>) -> Result<(Tensor, TrainState)> {
        self.forward_hidden_masked(tokens, init, None)
    }

    /// [`forward_hidden`](Self::forward_hidden) where positions whose `mask` (B, T) is 0 leave
    /// the state untouched: their conv input and their dt are zeroed, so nothing is added and
    /// nothing decays. With left padding from the zero state this gives each row exactly the
    /// state of its own tokens (the conv tail of a row shorter than d_conv − 1 holds zeros, as
    /// a fresh start does).
    pub fn forward_hidden_masked(
        &self,
        tokens: &Tensor,
        init: Option<&TrainState>,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, TrainState)> {
        let (b, _t) = tokens.dims2()?;
        let zeros;
        let init = match init {
            Some(s) => s,
            None => {
                zeros = TrainState::zeros(&self.config, b, self.dtype, &self.device)?;
                &zeros
            }
        };
        let mut h =
            self.embedding.as_tensor().embedding(&tokens.flatten_all()?)?.reshape((b, (), self.config.d_model))?;
        let mut next = TrainState { ssm: Vec::new(), conv: Vec::new(), log_decay: Vec::new() };
        for (l, layer) in self.layers.iter().enumerate() {
            let (out, ssm, conv, ld) = self.layer(layer, &h, &init.ssm[l], &init.conv[l], &init.log_decay[l], mask)?;
            h = out;
            next.ssm.push(ssm);
            next.conv.push(conv);
            next.log_decay.push(ld);
        }
        Ok((rms_norm(&h, self.norm_f.as_tensor(), 1, self.config.norm_eps)?, next))
    }

    /// The state after each token list, from the zero state, as one batch (row i = list i).
    /// Lists are processed in groups of `group` similar lengths, left-padded and masked, so
    /// padding costs little and changes nothing.
    pub fn context_states(&self, lists: &[&[u32]], group: usize) -> Result<TrainState> {
        if lists.is_empty() || lists.iter().any(|l| l.is_empty()) {
            candle_core::bail!("context_states: every context needs at least one token");
        }
        let mut by_len: Vec<usize> = (0..lists.len()).collect();
        by_len.sort_by_key(|&i| lists[i].len());
        let mut parts: Vec<TrainState> = Vec::new();
        for rows in by_len.chunks(group.max(1)) {
            let t = rows.iter().map(|&i| lists[i].len()).max().expect("non-empty chunk");
            let (mut toks, mut mask) = (Vec::with_capacity(rows.len() * t), Vec::with_capacity(rows.len() * t));
            for &i in rows {
                let pad = t - lists[i].len();
                toks.extend(std::iter::repeat_n(0u32, pad).chain(lists[i].iter().copied()));
                mask.extend(std::iter::repeat_n(0f32, pad).chain(std::iter::repeat_n(1f32, lists[i].len())));
            }
            let toks = Tensor::from_vec(toks, (rows.len(), t), &self.device)?;
            let mask = Tensor::from_vec(mask, (rows.len(), t), &self.device)?;
            parts.push(self.forward_hidden_masked(&toks, None, Some(&mask))?.1);
        }
        // Back to the callers' order.
        let mut position = vec![0u32; lists.len()];
        for (sorted, &i) in by_len.iter().enumerate() {
            position[i] = sorted as u32;
        }
        let index = Tensor::from_vec(position, lists.len(), &self.device)?;
        let gather = |get: &dyn Fn(&TrainState) -> &Vec<Tensor>| -> Result<Vec<Tensor>> {
            (0..self.config.n_layer)
                .map(|l| {
                    let all: Vec<&Tensor> = parts.iter().map(|p| &get(p)[l]).collect();
                    Tensor::cat(&all, 0)?.index_select(&index, 0)
                })
                .collect()
        };
        Ok(TrainState { ssm: gather(&|p| &p.ssm)?, conv: gather(&|p| &p.conv)?, log_decay: gather(&|p| &p.log_decay)? })
    }

    /// Next-token logits (B, T, vocab) and the final state.
    pub fn forward(&self, tokens: &Tensor, init: Option<&TrainState>) -> Result<(Tensor, TrainState)> {
        let (hidden, state) = self.forward_hidden(tokens, init)?;
        let (b, t, d) = hidden.dims3()?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        let logits = hidden.reshape((b * t, d))?.matmul(&head.as_tensor().t()?)?;
        Ok((logits.reshape((b, t, ()))?, state))
    }

    /// Mean cross-entropy of `targets` (B·T, row-major) under the logits of `tokens` (B, T) from
    /// `init`; positions whose target is [`crate::xent::IGNORE`] do not count.
    pub fn loss(&self, tokens: &Tensor, targets: &[u32], init: Option<&TrainState>) -> Result<(Tensor, TrainState)> {
        let (logits, state) = self.forward(tokens, init)?;
        let v = logits.dim(D::Minus1)?;
        Ok((crate::xent::cross_entropy(&logits.reshape(((), v))?, targets)?, state))
    }

    #[allow(clippy::type_complexity)]
    fn layer(
        &self,
        w: &Layer,
        h: &Tensor,
        ssm0: &Tensor,
        conv0: &Tensor,
        ld0: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let (b, t, dm) = h.dims3()?;
        let (di, cd, k, nh, p, n, g) =
            (c.d_inner(), c.conv_dim(), c.d_conv, c.nheads, c.headdim, c.d_state, c.n_groups);

        // in_proj as three products on row blocks of the weight: slicing the (small) weight is
        // cheap in backward, slicing the (B, T, ·) activations is not.
        let xn = rms_norm(h, w.norm.as_tensor(), 1, c.norm_eps)?.reshape((b * t, dm))?;
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
        let mask = mask.map(|m| m.to_dtype(self.dtype)?.unsqueeze(2)).transpose()?; // (B, T, 1)
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

        let (y, s) = self.scan(&la, &xdt, &bm, &cm, ssm0)?;
        let ld_next = (ld0 + la.sum(2)?)?;
        let y = y.transpose(1, 2)?; // (B, T, H, P)
        let y = y.broadcast_add(&x.broadcast_mul(&w.d.as_tensor().reshape((1, 1, nh, 1))?)?)?;

        // Gated RMSNorm by groups, out_proj, residual.
        let v = y.reshape((b, t, di))?.mul(&candle_nn::ops::silu(&z)?)?;
        let normed = rms_norm(&v, w.gated_norm.as_tensor(), g, c.gated_norm_eps)?;
        let mut out = normed.reshape((b * t, di))?.matmul(&w.out_proj.as_tensor().t()?)?;
        if let Some(bias) = &w.out_proj_bias {
            out = out.broadcast_add(bias.as_tensor())?;
        }
        Ok(((h + out.reshape((b, t, dm))?)?, s, conv_next, ld_next))
    }

    /// The chunked scan, all chunks at once: log-decays `la` (B, H, T), inputs `xdt` (B, H, T, P),
    /// `bm`, `cm` (B, H, T, N), initial state `s0` (B, H, P, N) → outputs (B, H, T, P) and the
    /// final state. Within a chunk the outputs are a masked decay-weighted product; between
    /// chunks a (chunks+1)² decay matrix carries the initial state and each chunk's
    /// contribution forward. No per-chunk slicing: slices cost a full-size copy in backward.
    fn scan(&self, la: &Tensor, xdt: &Tensor, bm: &Tensor, cm: &Tensor, s0: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, h, t, p) = xdt.dims4()?;
        let n = bm.dim(3)?;
        let l = self.chunk.min(t).max(1);
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
        let decay = seg.broadcast_add(&causal_mask(l, self.dtype, &self.device)?)?.exp()?; // (BH, C, L, L)
        let scores = cm.matmul(&bm.transpose(2, 3)?.contiguous()?)?.mul(&decay)?;
        let y_in = scores.matmul(&xdt)?; // (BH, C, L, P)

        // Each chunk's own contribution to the state at its end.
        let total = cum.narrow(2, l - 1, 1)?; // (BH, C, 1)
        let to_end = total.broadcast_sub(&cum)?.exp()?;
        let own = xdt.broadcast_mul(&to_end.unsqueeze(3)?)?.transpose(2, 3)?.contiguous()?.matmul(&bm)?; // (BH, C, P, N)

        // Items [s0, own_0, …, own_{C−1}] end at log-times E = [0, Σ≤0, …, Σ≤C−1]; the state after
        // item i is Σ_{k≤i} exp(E_i − E_k)·item_k. Row c < C is the state entering chunk c.
        let ends =
            Tensor::cat(&[&Tensor::zeros((bh, 1), self.dtype, &self.device)?, &total.squeeze(2)?.cumsum(1)?], 1)?;
        let between = ends.unsqueeze(2)?.broadcast_sub(&ends.unsqueeze(1)?)?;
        let carry = between.broadcast_add(&causal_mask(nc + 1, self.dtype, &self.device)?)?.exp()?; // (BH, C+1, C+1)
        let items = Tensor::cat(&[&s0.reshape((bh, 1, p * n))?, &own.reshape((bh, nc, p * n))?], 1)?;
        let states = carry.matmul(&items)?; // (BH, C+1, P·N)
        let entering = states.narrow(1, 0, nc)?.reshape((bh, nc, p, n))?;
        let last = states.narrow(1, nc, 1)?.reshape((b, h, p, n))?;

        let y_past = cm.matmul(&entering.transpose(2, 3)?.contiguous()?)?.broadcast_mul(&cum.exp()?.unsqueeze(3)?)?;
        let y = (y_in + y_past)?.reshape((b, h, tp, p))?;
        let y = if tp == t { y } else { y.narrow(2, 0, t)? };
        Ok((y, last))
    }
}

/// (L, L): 0 on and below the diagonal, −∞ above.
fn causal_mask(l: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..l * l).map(|i| if i % l <= i / l { 0.0 } else { f32::NEG_INFINITY }).collect();
    Tensor::from_vec(v, (l, l), device)?.to_dtype(dtype)
}
