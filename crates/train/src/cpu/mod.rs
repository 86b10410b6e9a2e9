//! The CPU fast path of pretraining: Mamba-2's forward and backward written by hand on f32
//! slices, from the zero state.
//!
//! candle's autograd runs every elementwise op of the graph on one thread and materialises a
//! tensor per op; on two cores that left a training step ~3× slower than its matrix products.
//! Here each layer is a few passes: gemm for the projections and the LM head (parallel), and
//! fused row kernels for the norms, the conv and the gate. The scan is the recurrence itself
//! (vectorised along d_state, parallel over sequences × heads); backward recomputes each
//! chunk's states from a checkpoint taken every `chunk` tokens, so activations stay O(T).
//! [`crate::mamba::TrainMamba2`] (candle, any device) computes the same function and is the
//! reference the tests hold this to.

pub mod ops;

use picaso_model::mamba2::LayerWeights;
use picaso_model::{Mamba2Config, Mamba2Weights};
use rayon::prelude::*;

use self::ops::{HeadGrads, HeadView, Matmul, Rows};
use crate::xent::IGNORE;

/// What the fast path cannot do, so the caller can use the candle trainer instead.
pub fn unsupported(c: &Mamba2Config) -> Option<&'static str> {
    if c.use_bias {
        return Some("in_proj/out_proj biases");
    }
    if c.n_groups == 0 || !c.nheads.is_multiple_of(c.n_groups) {
        return Some("heads not a multiple of groups");
    }
    None
}

/// Rows of logits computed at once: bounds the head's memory at ROWS × vocab.
const HEAD_ROWS: usize = 512;

/// One layer's saved activations.
struct Saved {
    h_in: Vec<f32>,
    inv: Vec<f32>,
    xn: Vec<f32>,
    zxbcdt: Vec<f32>,
    pre: Vec<f32>,
    xbc: Vec<f32>,
    dt: Vec<f32>,
    y: Vec<f32>,
    g_inv: Vec<f32>,
    normed: Vec<f32>,
    checkpoints: Vec<f32>,
}

/// Sizes used everywhere.
#[derive(Clone, Copy)]
struct Dims {
    d: usize,
    di: usize,
    cc: usize,
    dp: usize,
    h: usize,
    p: usize,
    n: usize,
    g: usize,
}

impl Dims {
    fn of(c: &Mamba2Config) -> Self {
        Self {
            d: c.d_model,
            di: c.d_inner(),
            cc: c.conv_dim(),
            dp: c.d_in_proj(),
            h: c.nheads,
            p: c.headdim,
            n: c.d_state,
            g: c.n_groups,
        }
    }

    fn head(&self, head: usize) -> HeadView {
        let group = head / (self.h / self.g);
        HeadView {
            ld: self.cc,
            x: head * self.p,
            b: self.di + group * self.n,
            c: self.di + self.g * self.n + group * self.n,
            p: self.p,
            n: self.n,
        }
    }
}

/// The hand-written trainer for one architecture.
pub struct CpuTrainer {
    config: Mamba2Config,
    chunk: usize,
    matmul: Matmul,
}

/// The mean loss of a batch and, when asked, the gradients.
pub struct Output {
    /// Mean cross-entropy over the counted targets (nats/token).
    pub loss: f64,
    /// Targets that counted.
    pub counted: usize,
}

impl CpuTrainer {
    /// A trainer for `config`; the scan checkpoints every `chunk` tokens.
    pub fn new(config: &Mamba2Config, chunk: usize) -> crate::Result<Self> {
        if let Some(what) = unsupported(config) {
            candle_core::bail!("the CPU fast path does not support {what}; use the candle trainer");
        }
        Ok(Self { config: config.clone(), chunk: chunk.max(1), matmul: Matmul::F32 })
    }

    /// Multiplies matrices in `matmul`'s precision (f32 by default).
    pub fn with_matmul(mut self, matmul: Matmul) -> Self {
        self.matmul = matmul;
        self
    }

    /// Zero gradients shaped like `w`.
    pub fn zero_grads(w: &Mamba2Weights) -> Mamba2Weights {
        let z = |v: &Vec<f32>| vec![0f32; v.len()];
        Mamba2Weights {
            embedding: z(&w.embedding),
            layers: w
                .layers
                .iter()
                .map(|l| LayerWeights {
                    norm: z(&l.norm),
                    in_proj: z(&l.in_proj),
                    in_proj_bias: l.in_proj_bias.as_ref().map(z),
                    conv_weight: z(&l.conv_weight),
                    conv_bias: l.conv_bias.as_ref().map(z),
                    dt_bias: z(&l.dt_bias),
                    a_log: z(&l.a_log),
                    d: z(&l.d),
                    gated_norm: z(&l.gated_norm),
                    out_proj: z(&l.out_proj),
                    out_proj_bias: l.out_proj_bias.as_ref().map(z),
                })
                .collect(),
            norm_f: z(&w.norm_f),
            lm_head: w.lm_head.as_ref().map(z),
        }
    }

    fn check(&self, tokens: &[u32], targets: &[u32], b: usize, t: usize) -> crate::Result<usize> {
        if tokens.len() != b * t || targets.len() != b * t || b == 0 || t == 0 {
            candle_core::bail!("a batch of {b}×{t} needs {} tokens and targets", b * t);
        }
        let v = self.config.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&x| x as usize >= v) {
            candle_core::bail!("token {bad} outside the vocabulary of {v}");
        }
        if let Some(&bad) = targets.iter().find(|&&x| x != IGNORE && x as usize >= v) {
            candle_core::bail!("target {bad} outside the vocabulary of {v}");
        }
        let counted = targets.iter().filter(|&&x| x != IGNORE).count();
        if counted == 0 {
            candle_core::bail!("every target is ignored, the mean is undefined");
        }
        Ok(counted)
    }

    /// The loss of every target (B·T; 0 where the target is [`IGNORE`]), no gradients.
    pub fn token_losses(
        &self,
        w: &Mamba2Weights,
        tokens: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
    ) -> crate::Result<Vec<f64>> {
        let counted = self.check(tokens, targets, b, t)?;
        let shape = Rows { b, t };
        let mut h = self.embed(w, tokens);
        for lw in &w.layers {
            h = self.layer_forward(lw, shape, h).0;
        }
        Ok(self.head(w, &h, targets, counted, None))
    }

    /// The mean loss and its gradients, added into `grads` (see [`CpuTrainer::zero_grads`]).
    pub fn loss_and_grads(
        &self,
        w: &Mamba2Weights,
        tokens: &[u32],
        targets: &[u32],
        b: usize,
        t: usize,
        grads: &mut Mamba2Weights,
    ) -> crate::Result<Output> {
        let counted = self.check(tokens, targets, b, t)?;
        let shape = Rows { b, t };
        let mut h = self.embed(w, tokens);
        let mut saved = Vec::with_capacity(w.layers.len());
        for lw in &w.layers {
            let (next, s) = self.layer_forward(lw, shape, h);
            saved.push(s);
            h = next;
        }
        let mut dh = vec![0f32; h.len()];
        let loss = self.head(w, &h, targets, counted, Some((grads, &mut dh))).iter().sum::<f64>() / counted as f64;
        drop(h);
        for (l, s) in saved.into_iter().enumerate().rev() {
            dh = self.layer_backward(&w.layers[l], shape, s, dh, &mut grads.layers[l]);
        }
        // Embedding rows: a serial scatter-add (tokens repeat), cheap next to the rest.
        let d = self.config.d_model;
        for (r, &tok) in tokens.iter().enumerate() {
            let dst = &mut grads.embedding[tok as usize * d..][..d];
            dst.iter_mut().zip(&dh[r * d..][..d]).for_each(|(g, v)| *g += v);
        }
        Ok(Output { loss, counted })
    }

    fn embed(&self, w: &Mamba2Weights, tokens: &[u32]) -> Vec<f32> {
        let d = self.config.d_model;
        let mut h = vec![0f32; tokens.len() * d];
        h.par_chunks_mut(d).zip(tokens.par_iter()).for_each(|(row, &tok)| {
            row.copy_from_slice(&w.embedding[tok as usize * d..][..d]);
        });
        h
    }

    /// Final norm, LM head and cross-entropy in blocks of rows: the loss of each row. With
    /// `back`, adds the head's gradients (of the mean over counted rows) and writes d h.
    fn head(
        &self,
        w: &Mamba2Weights,
        h: &[f32],
        targets: &[u32],
        counted: usize,
        mut back: Option<(&mut Mamba2Weights, &mut Vec<f32>)>,
    ) -> Vec<f64> {
        let c = &self.config;
        let (d, v) = (c.d_model, c.vocab_size);
        let rows = h.len() / d;
        let mut inv = vec![0f32; rows];
        let mut hf = vec![0f32; h.len()];
        ops::rmsnorm(h, &w.norm_f, 1, c.norm_eps as f32, &mut inv, &mut hf);
        let head = w.lm_head.as_deref().unwrap_or(&w.embedding);
        let scale = 1.0 / counted as f32;
        let mut dhf = back.as_ref().map(|_| vec![0f32; h.len()]);
        let mut logits = vec![0f32; HEAD_ROWS.min(rows) * v];
        let mut per_row = Vec::with_capacity(rows);
        for start in (0..rows).step_by(HEAD_ROWS) {
            let m = HEAD_ROWS.min(rows - start);
            let x = &hf[start * d..(start + m) * d];
            let lg = &mut logits[..m * v];
            ops::linear(self.matmul, x, m, d, head, v, lg);
            let want_grad = back.is_some();
            let losses: Vec<f64> = lg
                .par_chunks_mut(v)
                .zip(targets[start..start + m].par_iter())
                .map(|(row, &tgt)| {
                    if tgt == IGNORE {
                        row.fill(0.0);
                        return 0.0;
                    }
                    ops::xent_row(row, tgt as usize, want_grad.then_some(scale))
                })
                .collect();
            per_row.extend(losses);
            if let (Some((grads, _)), Some(dhf)) = (back.as_mut(), dhf.as_mut()) {
                let dhead = grads.lm_head.as_deref_mut().unwrap_or(&mut grads.embedding);
                ops::linear_backward(
                    self.matmul,
                    x,
                    m,
                    d,
                    head,
                    v,
                    lg,
                    Some(&mut dhf[start * d..(start + m) * d]),
                    dhead,
                );
            }
        }
        if let (Some((grads, dh)), Some(dhf)) = (back, dhf) {
            ops::rmsnorm_backward(h, &w.norm_f, 1, &inv, &dhf, dh, &mut grads.norm_f);
        }
        per_row
    }

    /// One block forward: the output residual stream and what backward needs.
    fn layer_forward(&self, lw: &LayerWeights, shape: Rows, h_in: Vec<f32>) -> (Vec<f32>, Saved) {
        let c = &self.config;
        let k = Dims::of(c);
        let rows = shape.n();
        let mut inv = vec![0f32; rows];
        let mut xn = vec![0f32; rows * k.d];
        ops::rmsnorm(&h_in, &lw.norm, 1, c.norm_eps as f32, &mut inv, &mut xn);
        let mut zxbcdt = vec![0f32; rows * k.dp];
        ops::linear(self.matmul, &xn, rows, k.d, &lw.in_proj, k.dp, &mut zxbcdt);

        let zeros;
        let bias = match &lw.conv_bias {
            Some(b) => b.as_slice(),
            None => {
                zeros = vec![0f32; k.cc];
                &zeros
            }
        };
        let mut pre = vec![0f32; rows * k.cc];
        let mut xbc = vec![0f32; rows * k.cc];
        ops::conv_forward(shape, &zxbcdt, k.dp, k.di, &lw.conv_weight, bias, &mut pre, &mut xbc);

        let (lo, hi) = c.time_step_limit;
        let mut dt = vec![0f32; rows * k.h];
        dt.par_chunks_mut(k.h).enumerate().for_each(|(r, o)| {
            let raw = &zxbcdt[r * k.dp + k.di + k.cc..][..k.h];
            for ((o, &x), &b) in o.iter_mut().zip(raw).zip(&lw.dt_bias) {
                *o = (picaso_model::cpu::activations::softplus(x + b) as f64).clamp(lo, hi) as f32;
            }
        });

        // The scan, one task per (sequence, head); outputs gathered into (B·T, d_inner).
        let a: Vec<f32> = lw.a_log.iter().map(|x| -x.exp()).collect();
        let chunks = shape.t.div_ceil(self.chunk);
        let pn = k.p * k.n;
        let mut checkpoints = vec![0f32; shape.b * k.h * chunks * pn];
        let per_task: Vec<Vec<f32>> = checkpoints
            .par_chunks_mut(chunks * pn)
            .enumerate()
            .map(|(task, ckpt)| {
                let (bi, hi) = (task / k.h, task % k.h);
                let seq = &xbc[bi * shape.t * k.cc..(bi + 1) * shape.t * k.cc];
                let dts: Vec<f32> = (0..shape.t).map(|t| dt[(bi * shape.t + t) * k.h + hi]).collect();
                let mut s = vec![0f32; pn];
                let mut y = vec![0f32; shape.t * k.p];
                ops::scan_forward(seq, k.head(hi), &dts, a[hi], lw.d[hi], self.chunk, &mut s, ckpt, &mut y);
                y
            })
            .collect();
        let mut y = vec![0f32; rows * k.di];
        y.par_chunks_mut(k.di).enumerate().for_each(|(r, row)| {
            let (bi, t) = (r / shape.t, r % shape.t);
            for hi in 0..k.h {
                row[hi * k.p..(hi + 1) * k.p].copy_from_slice(&per_task[bi * k.h + hi][t * k.p..(t + 1) * k.p]);
            }
        });

        let mut g_inv = vec![0f32; rows * k.g];
        let mut normed = vec![0f32; rows * k.di];
        let eps = c.gated_norm_eps as f32;
        normed.par_chunks_mut(k.di).zip(g_inv.par_chunks_mut(k.g)).enumerate().for_each(|(r, (o, gi))| {
            let z = &zxbcdt[r * k.dp..][..k.di];
            ops::gated_norm_row(&y[r * k.di..][..k.di], z, &lw.gated_norm, eps, gi, o);
        });
        let mut out = vec![0f32; rows * k.d];
        ops::linear(self.matmul, &normed, rows, k.di, &lw.out_proj, k.d, &mut out);
        out.par_iter_mut().zip(h_in.par_iter()).for_each(|(o, &x)| *o += x);
        (out, Saved { h_in, inv, xn, zxbcdt, pre, xbc, dt, y, g_inv, normed, checkpoints })
    }

    /// One block backward from d out; returns d h_in and adds the block's gradients.
    fn layer_backward(
        &self,
        lw: &LayerWeights,
        shape: Rows,
        s: Saved,
        dh_out: Vec<f32>,
        gw: &mut LayerWeights,
    ) -> Vec<f32> {
        let c = &self.config;
        let k = Dims::of(c);
        let rows = shape.n();

        // out = normed · out_projᵀ.
        let mut dnormed = vec![0f32; rows * k.di];
        ops::linear_backward(
            self.matmul,
            &s.normed,
            rows,
            k.di,
            &lw.out_proj,
            k.d,
            &dh_out,
            Some(&mut dnormed),
            &mut gw.out_proj,
        );
        drop(s.normed);

        // Gated norm → dy (into the scan) and dz (into dzxbcdt's first d_inner columns).
        let mut dzxbcdt = vec![0f32; rows * k.dp];
        let mut dy = vec![0f32; rows * k.di];
        let mut vhat = vec![0f32; rows * k.di];
        dzxbcdt.par_chunks_mut(k.dp).zip(dy.par_chunks_mut(k.di)).zip(vhat.par_chunks_mut(k.di)).enumerate().for_each(
            |(r, ((dz, dyr), vh))| {
                ops::gated_norm_row_backward(
                    &s.y[r * k.di..][..k.di],
                    &s.zxbcdt[r * k.dp..][..k.di],
                    &lw.gated_norm,
                    &s.g_inv[r * k.g..][..k.g],
                    &dnormed[r * k.di..][..k.di],
                    vh,
                    dyr,
                    &mut dz[..k.di],
                );
            },
        );
        let sums = ops::row_sums(rows, k.di, |r, acc| {
            let (g, v) = (&dnormed[r * k.di..][..k.di], &vhat[r * k.di..][..k.di]);
            acc.iter_mut().zip(g.iter().zip(v)).for_each(|(a, (&g, &v))| *a += f64::from(g * v));
        });
        ops::add_into(&mut gw.gated_norm, &sums);
        drop((dnormed, vhat));

        // The scan's backward per (sequence, head).
        let a: Vec<f32> = lw.a_log.iter().map(|x| -x.exp()).collect();
        let chunks = shape.t.div_ceil(self.chunk);
        let pn = k.p * k.n;
        struct TaskGrads {
            dx: Vec<f32>,
            db: Vec<f32>,
            dc: Vec<f32>,
            ddt: Vec<f32>,
            da: f64,
            dd: f64,
        }
        let tasks: Vec<TaskGrads> = (0..shape.b * k.h)
            .into_par_iter()
            .map(|task| {
                let (bi, hi) = (task / k.h, task % k.h);
                let t_len = shape.t;
                let seq = &s.xbc[bi * t_len * k.cc..(bi + 1) * t_len * k.cc];
                let dts: Vec<f32> = (0..t_len).map(|t| s.dt[(bi * t_len + t) * k.h + hi]).collect();
                let dyh: Vec<f32> =
                    (0..t_len).flat_map(|t| dy[(bi * t_len + t) * k.di + hi * k.p..][..k.p].iter().copied()).collect();
                let mut g = TaskGrads {
                    dx: vec![0f32; t_len * k.p],
                    db: vec![0f32; t_len * k.n],
                    dc: vec![0f32; t_len * k.n],
                    ddt: vec![0f32; t_len],
                    da: 0.0,
                    dd: 0.0,
                };
                let mut states = vec![0f32; (self.chunk + 1) * pn];
                let mut ds = vec![0f32; pn];
                let (da, dd) = ops::scan_backward(
                    seq,
                    k.head(hi),
                    &dts,
                    a[hi],
                    lw.d[hi],
                    self.chunk,
                    &s.checkpoints[task * chunks * pn..(task + 1) * chunks * pn],
                    &dyh,
                    &mut states,
                    &mut ds,
                    HeadGrads { dx: &mut g.dx, db: &mut g.db, dc: &mut g.dc, ddt: &mut g.ddt },
                );
                g.da = da;
                g.dd = dd;
                g
            })
            .collect();
        drop(dy);
        for hi in 0..k.h {
            let (mut da, mut dd) = (0f64, 0f64);
            for bi in 0..shape.b {
                da += tasks[bi * k.h + hi].da;
                dd += tasks[bi * k.h + hi].dd;
            }
            gw.a_log[hi] += (da * f64::from(a[hi])) as f32; // A = −exp(A_log): dA/dA_log = A
            gw.d[hi] += dd as f32;
        }

        // Gather d xbc (x per head; B, C summed over the heads of their group) and d dt_raw.
        let heads_per_group = k.h / k.g;
        let (lo, hi_lim) = c.time_step_limit;
        let mut dxbc = vec![0f32; rows * k.cc];
        dxbc.par_chunks_mut(k.cc).zip(dzxbcdt.par_chunks_mut(k.dp)).enumerate().for_each(|(r, (row, dz))| {
            let (bi, t) = (r / shape.t, r % shape.t);
            for hi in 0..k.h {
                let tg = &tasks[bi * k.h + hi];
                row[hi * k.p..(hi + 1) * k.p].copy_from_slice(&tg.dx[t * k.p..(t + 1) * k.p]);
                let grp = hi / heads_per_group;
                let bcol = k.di + grp * k.n;
                let ccol = k.di + k.g * k.n + grp * k.n;
                for j in 0..k.n {
                    row[bcol + j] += tg.db[t * k.n + j];
                    row[ccol + j] += tg.dc[t * k.n + j];
                }
                // dt = clamp(softplus(raw + bias)): d raw = d dt · σ(raw + bias) inside the clamp.
                let x = s.zxbcdt[r * k.dp + k.di + k.cc + hi] + lw.dt_bias[hi];
                let dtv = f64::from(s.dt[r * k.h + hi]);
                let inside = (dtv > lo || lo <= 0.0) && dtv < hi_lim;
                let sig = 1.0 / (1.0 + (-x).exp());
                dz[k.di + k.cc + hi] = if inside { tg.ddt[t] * sig } else { 0.0 };
            }
        });
        drop(tasks);
        let sums = ops::row_sums(rows, k.h, |r, acc| {
            for (a, &g) in acc.iter_mut().zip(&dzxbcdt[r * k.dp + k.di + k.cc..][..k.h]) {
                *a += f64::from(g);
            }
        });
        ops::add_into(&mut gw.dt_bias, &sums);

        // Through SiLU and the conv, into dzxbcdt's xBC columns.
        ops::silu_backward_rows(&s.pre, &mut dxbc, k.cc);
        drop(s.pre);
        ops::conv_backward(
            shape,
            &s.zxbcdt,
            k.dp,
            k.di,
            &lw.conv_weight,
            &dxbc,
            &mut dzxbcdt,
            &mut gw.conv_weight,
            gw.conv_bias.as_deref_mut(),
        );
        drop(dxbc);

        // in_proj, then the pre-norm.
        let mut dxn = vec![0f32; rows * k.d];
        ops::linear_backward(
            self.matmul,
            &s.xn,
            rows,
            k.d,
            &lw.in_proj,
            k.dp,
            &dzxbcdt,
            Some(&mut dxn),
            &mut gw.in_proj,
        );
        let mut dh = vec![0f32; rows * k.d];
        ops::rmsnorm_backward(&s.h_in, &lw.norm, 1, &s.inv, &dxn, &mut dh, &mut gw.norm);
        dh.par_iter_mut().zip(dh_out.par_iter()).for_each(|(g, &o)| *g += o);
        dh
    }
}

/// The parameters in the order of a [`crate::TrainMamba2`]'s [`crate::Net::vars`] (the order
/// optimiser checkpoints use), with their shapes.
pub fn param_shapes(c: &Mamba2Config, w: &Mamba2Weights) -> Vec<Vec<usize>> {
    let mut s = vec![vec![c.vocab_size, c.d_model]];
    for l in &w.layers {
        s.extend([
            vec![c.d_model],
            vec![c.d_in_proj(), c.d_model],
            vec![c.conv_dim(), c.d_conv],
            vec![c.nheads],
            vec![c.nheads],
            vec![c.nheads],
            vec![c.d_inner()],
            vec![c.d_model, c.d_inner()],
        ]);
        if l.in_proj_bias.is_some() {
            s.push(vec![c.d_in_proj()]);
        }
        if l.conv_bias.is_some() {
            s.push(vec![c.conv_dim()]);
        }
        if l.out_proj_bias.is_some() {
            s.push(vec![c.d_model]);
        }
    }
    s.push(vec![c.d_model]);
    if w.lm_head.is_some() {
        s.push(vec![c.vocab_size, c.d_model]);
    }
    s
}

/// The parameters as slices, in [`param_shapes`] order.
pub fn params(w: &Mamba2Weights) -> Vec<&[f32]> {
    let mut p: Vec<&[f32]> = vec![&w.embedding];
    for l in &w.layers {
        p.extend(
            [&l.norm, &l.in_proj, &l.conv_weight, &l.dt_bias, &l.a_log, &l.d, &l.gated_norm, &l.out_proj]
                .map(|v| v.as_slice()),
        );
        p.extend([&l.in_proj_bias, &l.conv_bias, &l.out_proj_bias].into_iter().flatten().map(|v| v.as_slice()));
    }
    p.push(&w.norm_f);
    p.extend(w.lm_head.as_deref());
    p
}

/// [`params`], mutable.
pub fn params_mut(w: &mut Mamba2Weights) -> Vec<&mut [f32]> {
    let mut p: Vec<&mut [f32]> = vec![&mut w.embedding];
    for l in &mut w.layers {
        p.push(&mut l.norm);
        p.push(&mut l.in_proj);
        p.push(&mut l.conv_weight);
        p.push(&mut l.dt_bias);
        p.push(&mut l.a_log);
        p.push(&mut l.d);
        p.push(&mut l.gated_norm);
        p.push(&mut l.out_proj);
        p.extend(
            [&mut l.in_proj_bias, &mut l.conv_bias, &mut l.out_proj_bias]
                .into_iter()
                .flatten()
                .map(|v| v.as_mut_slice()),
        );
    }
    p.push(&mut w.norm_f);
    if let Some(h) = &mut w.lm_head {
        p.push(h);
    }
    p
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::mamba::TrainMamba2;
    use crate::net::Net;
    use crate::pretrain::init_weights;

    /// The hand-written loss and every gradient equal candle autograd's on the f64 composite
    /// graph, with a chunk that does not divide the length and ignored targets; d_state 8 runs
    /// the general scan, 16 and 32 the register-held one.
    #[test]
    fn matches_candle_autograd() -> crate::Result<()> {
        for (tie, groups, d_state) in [(true, 2, 8), (false, 1, 16), (true, 1, 32)] {
            let mut c = Mamba2Config::tiny(2, 4);
            c.tie_embeddings = tie;
            c.n_groups = groups;
            c.d_state = d_state;
            let mut w = init_weights(&c, 3);
            // Larger dt than the init's so the decays matter over the sequence.
            for l in &mut w.layers {
                l.dt_bias.iter_mut().enumerate().for_each(|(i, b)| *b = -1.0 + 0.3 * i as f32);
                l.conv_bias.iter_mut().flatten().enumerate().for_each(|(i, b)| *b = 0.01 * (i % 7) as f32);
            }
            let (b, t) = (2, 37);
            let tokens: Vec<u32> = (0..b * t).map(|i| (i * 17 % c.vocab_size) as u32).collect();
            let targets: Vec<u32> =
                (0..b * t).map(|i| if i % 9 == 4 { IGNORE } else { (i * 29 % c.vocab_size) as u32 }).collect();

            let fast = CpuTrainer::new(&c, 5)?;
            let mut grads = CpuTrainer::zero_grads(&w);
            let out = fast.loss_and_grads(&w, &tokens, &targets, b, t, &mut grads)?;
            let rows = fast.token_losses(&w, &tokens, &targets, b, t)?;
            let only = rows.iter().sum::<f64>() / targets.iter().filter(|&&x| x != IGNORE).count() as f64;
            assert_eq!(out.loss, only);

            let net = TrainMamba2::from_weights(&c, &w, DType::F64, &Device::Cpu)?.with_chunk(8);
            let x = Tensor::from_vec(tokens.clone(), (b, t), &Device::Cpu)?;
            let (loss, _) = net.loss(&x, &targets, None)?;
            let want = loss.to_scalar::<f64>()?;
            assert!((out.loss - want).abs() < 1e-5 * want, "loss {} vs {want}", out.loss);
            let g = loss.backward()?;
            let vars = net.vars();
            let mine = params(&grads);
            assert_eq!(vars.len(), mine.len());
            for (i, (var, got)) in vars.iter().zip(mine).enumerate() {
                let want: Vec<f64> = g.get(var).expect("grad").flatten_all()?.to_vec1()?;
                let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
                let worst = want.iter().zip(got).map(|(w, g)| (w - f64::from(*g)).abs()).fold(0f64, f64::max);
                assert!(
                    worst < 2e-4 * scale,
                    "tie {tie} groups {groups} d_state {d_state} parameter {i}: off by {worst} (scale {scale})"
                );
            }
        }
        Ok(())
    }

    /// With bf16 matrix products the loss stays within a few thousandths and every gradient
    /// points the same way as the f32 one (cosine ≥ 0.999, norm within 2%; measured ≥ 0.9998 and
    /// ≤ 1.3%, the largest on the small a_log and D gradients): what lets a run
    /// use them. The loss curves of real runs are compared in BENCHMARKS.md.
    #[test]
    fn bf16_products_keep_the_loss_and_the_gradients() -> crate::Result<()> {
        if Matmul::Bf16.effective() != Matmul::Bf16 {
            eprintln!("skipped: this CPU has no AMX tiles");
            return Ok(());
        }
        let mut c = Mamba2Config::tiny(2, 4);
        c.d_model = 64;
        c.nheads = 8;
        c.headdim = 16;
        let w = init_weights(&c, 4);
        let (b, t) = (3, 41);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 17 % c.vocab_size) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 29 % c.vocab_size) as u32).collect();
        let run = |matmul| -> crate::Result<(f64, Mamba2Weights)> {
            let mut grads = CpuTrainer::zero_grads(&w);
            let out =
                CpuTrainer::new(&c, 8)?.with_matmul(matmul).loss_and_grads(&w, &tokens, &targets, b, t, &mut grads)?;
            Ok((out.loss, grads))
        };
        let ((l32, g32), (l16, g16)) = (run(Matmul::F32)?, run(Matmul::Bf16)?);
        assert!((l32 - l16).abs() < 5e-3 * l32, "loss {l16} vs {l32}");
        assert_ne!(l32, l16, "the bf16 step must really run in bf16");
        for (i, (a, b)) in params(&g32).into_iter().zip(params(&g16)).enumerate() {
            let dot: f64 = a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
            let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let (na, nb) = (norm(a), norm(b));
            assert!(dot / (na * nb).max(1e-30) >= 0.999, "parameter {i}: cosine {}", dot / (na * nb));
            assert!((na - nb).abs() <= 0.02 * na, "parameter {i}: norm {nb} vs {na}");
        }
        Ok(())
    }
}
