//! The device-generic engine: Mamba-2 written with candle tensor ops, so it runs wherever candle
//! does (CUDA with the `cuda` feature, Metal, CPU). It is an independent implementation of the
//! same equations as [`crate::cpu`], and the tests hold the two (and HF transformers) equal.
//!
//! The scan is the plain recurrence, one token at a time: simple and exact, but launch-bound on
//! long prompts; on the CPU the hand-written engine is the fast path.

use candle_core::{DType, Device, Tensor, D};

use super::{Mamba2Config, Mamba2Weights};
use crate::error::Result;
use crate::state::{LayerState, State};

/// One block's weights on the device.
#[derive(Debug)]
struct Layer {
    norm: Tensor,
    in_proj: Tensor,
    in_proj_bias: Option<Tensor>,
    /// (C, K)
    conv_w: Tensor,
    conv_b: Option<Tensor>,
    dt_bias: Tensor,
    /// A = -exp(A_log), (H)
    a: Tensor,
    d: Tensor,
    gated_norm: Tensor,
    out_proj: Tensor,
    out_proj_bias: Option<Tensor>,
}

/// A Mamba-2 model on a candle device.
#[derive(Debug)]
pub struct CandleMamba2 {
    config: Mamba2Config,
    device: Device,
    dtype: DType,
    embedding: Tensor,
    layers: Vec<Layer>,
    norm_f: Tensor,
    lm_head: Option<Tensor>,
}

impl CandleMamba2 {
    /// The config.
    pub fn config(&self) -> &Mamba2Config {
        &self.config
    }

    /// Uploads `weights` to `device` in `dtype` (f32 everywhere; bf16/f16 where the device's
    /// matmul supports it, e.g. CUDA).
    pub fn new(config: &Mamba2Config, weights: &Mamba2Weights, device: &Device, dtype: DType) -> Result<Self> {
        let t = |v: &[f32], shape: &[usize]| -> Result<Tensor> {
            Ok(Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
        };
        let c = config;
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    norm: t(&l.norm, &[c.d_model])?,
                    in_proj: t(&l.in_proj, &[c.d_in_proj(), c.d_model])?,
                    in_proj_bias: l.in_proj_bias.as_deref().map(|b| t(b, &[c.d_in_proj()])).transpose()?,
                    conv_w: t(&l.conv_weight, &[c.conv_dim(), c.d_conv])?,
                    conv_b: l.conv_bias.as_deref().map(|b| t(b, &[c.conv_dim()])).transpose()?,
                    dt_bias: t(&l.dt_bias, &[c.nheads])?,
                    a: t(&l.a_log.iter().map(|v| -v.exp()).collect::<Vec<_>>(), &[c.nheads])?,
                    d: t(&l.d, &[c.nheads])?,
                    gated_norm: t(&l.gated_norm, &[c.d_inner()])?,
                    out_proj: t(&l.out_proj, &[c.d_model, c.d_inner()])?,
                    out_proj_bias: l.out_proj_bias.as_deref().map(|b| t(b, &[c.d_model])).transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            device: device.clone(),
            dtype,
            embedding: t(&weights.embedding, &[c.vocab_size, c.d_model])?,
            layers,
            norm_f: t(&weights.norm_f, &[c.d_model])?,
            lm_head: weights.lm_head.as_deref().map(|h| t(h, &[c.vocab_size, c.d_model])).transpose()?,
        })
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Runs `tokens` from `state` (updated in place) and returns the final-normed hidden states
    /// (T × d_model) on the host.
    pub fn forward(&self, tokens: &[u32], state: &mut State) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
        let mut h = self.embedding.index_select(&ids, 0)?;
        for (layer, ls) in self.layers.iter().zip(&mut state.layers) {
            h = self.layer(layer, ls, &h)?;
        }
        let out = rmsnorm(&h, &self.norm_f, self.config.norm_eps)?;
        state.advance(tokens.len());
        Ok(out.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }

    fn host(&self, v: &[f32], shape: &[usize]) -> Result<Tensor> {
        Ok(Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    fn layer(&self, w: &Layer, ls: &mut LayerState, h: &Tensor) -> Result<Tensor> {
        let c = &self.config;
        let t = h.dim(0)?;
        let (di, cd, k, nh, p, n, g) =
            (c.d_inner(), c.conv_dim(), c.d_conv, c.nheads, c.headdim, c.d_state, c.n_groups);

        let xn = rmsnorm(h, &w.norm, c.norm_eps)?;
        let mut zxbcdt = xn.matmul(&w.in_proj.t()?)?; // (T, width)
        if let Some(b) = &w.in_proj_bias {
            zxbcdt = zxbcdt.broadcast_add(b)?;
        }
        let z = zxbcdt.narrow(1, 0, di)?;
        let xbc_in = zxbcdt.narrow(1, di, cd)?;
        let dt_raw = zxbcdt.narrow(1, di + cd, nh)?;

        // Causal depthwise conv over [tail; input] → (T, C), then SiLU.
        let tail = self.host(&ls.conv, &[cd, k - 1])?;
        let xbc = causal_conv_silu(&xbc_in, &tail, &w.conv_w, w.conv_b.as_ref(), &mut ls.conv)?;

        // dt, decays and the accumulated log-decay.
        let (lo, hi) = c.time_step_limit;
        let dt = softplus(&dt_raw.broadcast_add(&w.dt_bias)?)?.clamp(lo, hi)?; // (T, H)
        let dt_a = dt.broadcast_mul(&w.a)?; // (T, H)
        let decay = dt_a.exp()?;
        let added: Vec<f32> = dt_a.to_dtype(DType::F32)?.sum(0)?.to_vec1()?;
        for (v, a) in ls.log_decay.iter_mut().zip(added) {
            *v += a;
        }

        // Heads: x (T, H, P); B and C expanded from groups to heads (T, H, N).
        let x = xbc.narrow(1, 0, di)?.reshape((t, nh, p))?;
        let per_group = nh / g;
        let expand = |m: Tensor| -> Result<Tensor> {
            Ok(m.reshape((t, g, 1, n))?.broadcast_as((t, g, per_group, n))?.reshape((t, nh, n))?)
        };
        let b = expand(xbc.narrow(1, di, g * n)?)?;
        let cm = expand(xbc.narrow(1, di + g * n, g * n)?)?;
        let xdt = x.broadcast_mul(&dt.unsqueeze(2)?)?; // (T, H, P)

        // The recurrence s ← a·s + (dt·x) ⊗ B, y = s·C, one token at a time.
        let mut s = self.host(&ls.ssm, &[nh, p, n])?;
        let mut ys = Vec::with_capacity(t);
        for ti in 0..t {
            let a = decay.get(ti)?.reshape((nh, 1, 1))?;
            let outer = xdt.get(ti)?.unsqueeze(2)?.broadcast_mul(&b.get(ti)?.unsqueeze(1)?)?; // (H, P, N)
            s = s.broadcast_mul(&a)?.add(&outer)?;
            ys.push(s.matmul(&cm.get(ti)?.unsqueeze(2)?)?.squeeze(2)?); // (H, P)
        }
        ls.ssm = s.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let y = Tensor::stack(&ys, 0)?.add(&x.broadcast_mul(&w.d.reshape((1, nh, 1))?)?)?; // (T, H, P)

        // Gated RMSNorm by groups, out_proj, residual.
        let v = y.reshape((t, di))?.mul(&candle_nn::ops::silu(&z)?)?;
        let vg = v.reshape((t, g, di / g))?;
        let ms = vg.sqr()?.mean_keepdim(D::Minus1)?;
        let normed =
            vg.broadcast_div(&(ms + c.gated_norm_eps)?.sqrt()?)?.reshape((t, di))?.broadcast_mul(&w.gated_norm)?;
        let mut out = normed.matmul(&w.out_proj.t()?)?;
        if let Some(bias) = &w.out_proj_bias {
            out = out.broadcast_add(bias)?;
        }
        Ok((h + out)?)
    }

    /// Logits (rows × vocab) of final hidden states given on the host.
    pub fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        let d = self.config.d_model;
        let rows = hidden.len() / d;
        let h = self.host(hidden, &[rows, d])?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        Ok(h.matmul(&head.t()?)?.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    }
}

/// The causal depthwise convolution + bias + SiLU of `input` (T, C), continuing from the conv
/// tail `tail` (C, K-1) on the device; `host_tail` (the state's copy) gets the last K-1 inputs.
pub(crate) fn causal_conv_silu(
    input: &Tensor,
    tail: &Tensor,
    conv_w: &Tensor,
    conv_b: Option<&Tensor>,
    host_tail: &mut Vec<f32>,
) -> Result<Tensor> {
    let (t, c) = input.dims2()?;
    let k = conv_w.dim(1)?;
    let seq = Tensor::cat(&[&tail.t()?, input], 0)?; // (K-1+T, C)
    let mut conv = match conv_b {
        Some(b) => b.unsqueeze(0)?.broadcast_as((t, c))?.contiguous()?,
        None => Tensor::zeros((t, c), input.dtype(), input.device())?,
    };
    for j in 0..k {
        let tap = conv_w.narrow(1, j, 1)?.t()?; // (1, C)
        conv = (conv + seq.narrow(0, j, t)?.broadcast_mul(&tap)?)?;
    }
    if k > 1 {
        let new_tail = seq.narrow(0, t, k - 1)?.t()?.contiguous()?; // (C, K-1)
        *host_tail = new_tail.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    }
    Ok(candle_nn::ops::silu(&conv)?)
}

pub(crate) fn rmsnorm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// softplus(x) = log(1 + e^x) to f32 precision for every x, differentiable (the trainer's
/// candle network uses it too): max(x, 0) + log1p(e^−|x|). Candle has no log1p, and
/// `log(1 + y)` loses y below ~1e-7 (dt = 0 for x < −17, which real heads reach), so log1p
/// is its series in z = y / (2 + y) ≤ 1/3: log1p(y) = 2 Σ z^(2n+1) / (2n+1), eight terms
/// (the rest below 1.5e-9 relative).
pub fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    let y = x.abs()?.neg()?.exp()?;
    let z = (&y / (&y + 2.0)?)?;
    let z2 = z.sqr()?;
    let mut series = z2.affine(1.0 / 15.0, 1.0 / 13.0)?;
    for n in (0..6).rev() {
        series = (series * &z2)?.affine(1.0, 1.0 / (2 * n + 1) as f64)?;
    }
    x.relu()? + (z * series)?.affine(2.0, 0.0)?
}

#[cfg(test)]
mod tests {
    /// Every input, including the very negative ones long-memory heads give dt, keeps f32
    /// precision (the f64 reference is `ln_1p`); the CPU kernel agrees.
    #[test]
    fn softplus_keeps_f32_precision_everywhere() {
        let xs: Vec<f32> = (-400..=400).map(|i| i as f32 * 0.1).chain([-80.0, -60.0, -17.84, 1e-8, 50.0]).collect();
        let t = candle_core::Tensor::new(xs.as_slice(), &candle_core::Device::Cpu).unwrap();
        let got: Vec<f32> = super::softplus(&t).unwrap().to_vec1().unwrap();
        for (&x, &g) in xs.iter().zip(&got) {
            let x64 = x as f64;
            let want = x64.max(0.0) + (-x64.abs()).exp().ln_1p();
            let rel = ((g as f64 - want) / want).abs();
            assert!(rel < 4e-7, "softplus({x}) = {g}, want {want} (relative error {rel:.1e})");
            let cpu = crate::cpu::activations::softplus(x) as f64;
            assert!(((cpu - want) / want).abs() < 4e-7, "cpu softplus({x}) = {cpu}");
        }
    }
}
