//! The device-generic Mamba-1 engine: the same equations as [`super::cpu`] written with candle
//! tensor ops, so Mamba-1 runs wherever candle does (CUDA with the `cuda` feature, Metal, CPU).
//! The scan is the plain recurrence over (d_inner, N) states, one token at a time: simple and
//! exact; on the CPU the hand-written engine is the fast path.

use candle_core::{DType, Device, Tensor};

use super::config::Mamba1Config;
use super::weights::Mamba1Weights;
use crate::error::Result;
use crate::mamba2::candle::{causal_conv_silu, rmsnorm, softplus};
use crate::state::{LayerState, State};

/// One block's weights on the device.
#[derive(Debug)]
struct Layer {
    norm: Tensor,
    in_proj: Tensor,
    in_proj_bias: Option<Tensor>,
    /// (D, K)
    conv_w: Tensor,
    conv_b: Option<Tensor>,
    x_proj: Tensor,
    dt_proj: Tensor,
    dt_proj_bias: Tensor,
    /// A = -exp(A_log), (D, N)
    a: Tensor,
    d: Tensor,
    out_proj: Tensor,
    out_proj_bias: Option<Tensor>,
}

/// A Mamba-1 model on a candle device.
#[derive(Debug)]
pub struct CandleMamba1 {
    config: Mamba1Config,
    device: Device,
    dtype: DType,
    embedding: Tensor,
    layers: Vec<Layer>,
    norm_f: Tensor,
    lm_head: Option<Tensor>,
}

impl CandleMamba1 {
    /// The config.
    pub fn config(&self) -> &Mamba1Config {
        &self.config
    }

    /// Uploads `weights` to `device` in `dtype`.
    pub fn new(config: &Mamba1Config, weights: &Mamba1Weights, device: &Device, dtype: DType) -> Result<Self> {
        let t = |v: &[f32], shape: &[usize]| -> Result<Tensor> {
            Ok(Tensor::from_slice(v, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
        };
        let c = config;
        let (d, di, n) = (c.d_model, c.d_inner(), c.d_state);
        let layers = weights
            .layers
            .iter()
            .map(|l| {
                Ok(Layer {
                    norm: t(&l.norm, &[d])?,
                    in_proj: t(&l.in_proj, &[2 * di, d])?,
                    in_proj_bias: l.in_proj_bias.as_deref().map(|b| t(b, &[2 * di])).transpose()?,
                    conv_w: t(&l.conv_weight, &[di, c.d_conv])?,
                    conv_b: l.conv_bias.as_deref().map(|b| t(b, &[di])).transpose()?,
                    x_proj: t(&l.x_proj, &[c.x_proj_dim(), di])?,
                    dt_proj: t(&l.dt_proj, &[di, c.dt_rank])?,
                    dt_proj_bias: t(&l.dt_proj_bias, &[di])?,
                    a: t(&l.a_log.iter().map(|v| -v.exp()).collect::<Vec<_>>(), &[di, n])?,
                    d: t(&l.d, &[di])?,
                    out_proj: t(&l.out_proj, &[d, di])?,
                    out_proj_bias: l.out_proj_bias.as_deref().map(|b| t(b, &[d])).transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: config.clone(),
            device: device.clone(),
            dtype,
            embedding: t(&weights.embedding, &[c.vocab_size, d])?,
            layers,
            norm_f: t(&weights.norm_f, &[d])?,
            lm_head: weights.lm_head.as_deref().map(|h| t(h, &[c.vocab_size, d])).transpose()?,
        })
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
        let (di, k, n, r) = (c.d_inner(), c.d_conv, c.d_state, c.dt_rank);

        let xn = rmsnorm(h, &w.norm, c.norm_eps)?;
        let mut xz = xn.matmul(&w.in_proj.t()?)?; // (T, 2D)
        if let Some(b) = &w.in_proj_bias {
            xz = xz.broadcast_add(b)?;
        }
        let x_in = xz.narrow(1, 0, di)?;
        let z = xz.narrow(1, di, di)?;

        // Causal depthwise conv over [tail; input] → (T, D), then SiLU.
        let tail = self.host(&ls.conv, &[di, k - 1])?;
        let x = causal_conv_silu(&x_in, &tail, &w.conv_w, w.conv_b.as_ref(), &mut ls.conv)?;

        // x_proj → [dt_low | B | C]; dt = softplus(dt_proj(dt_low) + bias), (T, D).
        let xdbl = x.matmul(&w.x_proj.t()?)?;
        // Contiguous copies: CUDA's matmul refuses a column slice (a row stride wider than its rows).
        let dt_low = xdbl.narrow(1, 0, r)?.contiguous()?;
        let b = xdbl.narrow(1, r, n)?.contiguous()?; // (T, N)
        let cm = xdbl.narrow(1, r + n, n)?.contiguous()?; // (T, N)
        let dt = softplus(&dt_low.matmul(&w.dt_proj.t()?)?.broadcast_add(&w.dt_proj_bias)?)?;

        // Per-element decays exp(dt·A), (T, D, N), and the accumulated log-decay.
        let dt_a = dt.unsqueeze(2)?.broadcast_mul(&w.a.unsqueeze(0)?)?;
        let decay = dt_a.exp()?;
        let added: Vec<f32> = dt_a.to_dtype(DType::F32)?.sum(0)?.flatten_all()?.to_vec1()?;
        for (v, a) in ls.log_decay.iter_mut().zip(added) {
            *v += a;
        }
        let dbx = dt.mul(&x)?.unsqueeze(2)?.broadcast_mul(&b.unsqueeze(1)?)?; // (T, D, N)

        // The recurrence s ← exp(dt·A)·s + dt·x·B, y = s·C, one token at a time.
        let mut s = self.host(&ls.ssm, &[di, n])?;
        let mut ys = Vec::with_capacity(t);
        for ti in 0..t {
            s = s.mul(&decay.get(ti)?)?.add(&dbx.get(ti)?)?;
            ys.push(s.matmul(&cm.get(ti)?.unsqueeze(1)?)?.squeeze(1)?); // (D)
        }
        ls.ssm = s.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        let y = Tensor::stack(&ys, 0)?.add(&x.broadcast_mul(&w.d.unsqueeze(0)?)?)?; // (T, D)

        let gated = y.mul(&candle_nn::ops::silu(&z)?)?;
        let mut out = gated.matmul(&w.out_proj.t()?)?;
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
