//! Fused CPU kernels, with their backward passes, for the layers whose composite candle form is
//! slow to differentiate: the depthwise causal conv and RMSNorm.
//!
//! candle differentiates a broadcast by summing the gradient over the broadcast dimensions, and
//! its CPU sum over leading dimensions runs one element at a time; a per-channel weight applied
//! to (batch × time × channels) activations pays that on every step. These kernels compute the
//! weight gradients as parallel row sums instead, and read each activation once. Other devices
//! and dtypes fall back to the composite form, which computes the same function.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::Result;

fn fused(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == DType::F32
}

fn slice<'a>(storage: &'a CpuStorage, layout: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(all) = storage else { candle_core::bail!("{what}: f32 expected") };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("{what}: contiguous input expected"),
    }
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.contiguous()?.flatten_all()?.to_vec1::<f32>()
}

/// Sums `f` over `rows` in parallel, in an order independent of the thread count
/// ([`crate::cpu::ops::row_sums`]), rounded to f32.
fn par_row_sums(rows: usize, width: usize, f: impl Fn(usize, &mut [f64]) + Sync) -> Vec<f32> {
    crate::cpu::ops::row_sums(rows, width, f).into_iter().map(|x| x as f32).collect()
}

// ---------------------------------------------------------------------------------------------
// Depthwise causal conv

/// `out[b, t, c] = Σ_j seq[b, t + j, c] · w[c, j] + bias[c]` for `seq` (B, T + K − 1, C) — the
/// conv tail followed by the inputs — and `w` (C, K): (B, T, C).
pub fn causal_conv(seq: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (_, tk, c) = seq.dims3()?;
    let k = w.dim(1)?;
    let t = tk + 1 - k;
    if fused(seq) {
        let zeros;
        let bias = match bias {
            Some(b) => b,
            None => {
                zeros = Tensor::zeros(c, DType::F32, seq.device())?;
                &zeros
            }
        };
        return seq.contiguous()?.apply_op3(&w.contiguous()?, &bias.contiguous()?, CausalConv);
    }
    let mut out = seq.narrow(1, 0, t)?.broadcast_mul(&w.narrow(1, 0, 1)?.reshape((1, 1, c))?)?;
    for j in 1..k {
        out = (out + seq.narrow(1, j, t)?.broadcast_mul(&w.narrow(1, j, 1)?.reshape((1, 1, c))?)?)?;
    }
    match bias {
        Some(b) => out.broadcast_add(&b.reshape((1, 1, c))?),
        None => Ok(out),
    }
}

struct CausalConv;

impl CustomOp3 for CausalConv {
    fn name(&self) -> &'static str {
        "causal-conv"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, tk, c) = l1.shape().dims3()?;
        let k = l2.dims()[1];
        let t = tk + 1 - k;
        let (seq, w, bias) = (slice(s1, l1, "conv")?, slice(s2, l2, "conv")?, slice(s3, l3, "conv")?);
        let wt: Vec<f32> = (0..k * c).map(|i| w[(i % c) * k + i / c]).collect(); // (K, C)
        let mut out = vec![0f32; b * t * c];
        out.par_chunks_mut(c).enumerate().for_each(|(row, o)| {
            let (bi, ti) = (row / t, row % t);
            o.copy_from_slice(bias);
            for j in 0..k {
                let s = &seq[(bi * tk + ti + j) * c..][..c];
                for ((o, &x), &wj) in o.iter_mut().zip(s).zip(&wt[j * c..(j + 1) * c]) {
                    *o += x * wj;
                }
            }
        });
        Ok((CpuStorage::F32(out), Shape::from((b, t, c))))
    }

    fn bwd(
        &self,
        seq: &Tensor,
        w: &Tensor,
        _bias: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, tk, c) = seq.dims3()?;
        let k = w.dim(1)?;
        let t = tk + 1 - k;
        let (s, wv, g) = (host(seq)?, host(w)?, host(grad)?);
        // d seq[b, p, c] = Σ_j g[b, p − j, c] · w[c, j] over the valid t = p − j.
        let mut gs = vec![0f32; b * tk * c];
        gs.par_chunks_mut(c).enumerate().for_each(|(row, o)| {
            let (bi, p) = (row / tk, row % tk);
            for j in 0..k {
                if p < j || p - j >= t {
                    continue;
                }
                let gr = &g[(bi * t + p - j) * c..][..c];
                for (ci, (o, &gv)) in o.iter_mut().zip(gr).enumerate() {
                    *o += gv * wv[ci * k + j];
                }
            }
        });
        // d w[c, j] = Σ_{b,t} g[b, t, c] · seq[b, t + j, c];  d bias[c] = Σ_{b,t} g[b, t, c].
        let sums = par_row_sums(b * t, c * (k + 1), |row, acc| {
            let (bi, ti) = (row / t, row % t);
            let gr = &g[row * c..][..c];
            for j in 0..k {
                let sr = &seq_row(&s, bi, ti + j, tk, c);
                for ci in 0..c {
                    acc[ci * k + j] += f64::from(gr[ci] * sr[ci]);
                }
            }
            for ci in 0..c {
                acc[c * k + ci] += f64::from(gr[ci]);
            }
        });
        let dev = seq.device();
        Ok((
            Some(Tensor::from_vec(gs, (b, tk, c), dev)?),
            Some(Tensor::from_slice(&sums[..c * k], (c, k), dev)?),
            Some(Tensor::from_slice(&sums[c * k..], c, dev)?),
        ))
    }
}

fn seq_row(s: &[f32], b: usize, p: usize, tk: usize, c: usize) -> &[f32] {
    &s[(b * tk + p) * c..][..c]
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

/// RMSNorm of `x` (…, D) over `groups` equal groups of its last dimension, scaled by `w` (D):
/// `x / √(mean_group(x²) + eps) · w`.
pub fn rms_norm(x: &Tensor, w: &Tensor, groups: usize, eps: f64) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let d = *dims.last().expect("rms_norm of a scalar");
    if fused(x) {
        let rows = x.elem_count() / d;
        let op = RmsNorm { groups, eps };
        return x.contiguous()?.reshape((rows, d))?.apply_op2(&w.contiguous()?, op)?.reshape(dims);
    }
    let mut gdims = dims.clone();
    *gdims.last_mut().expect("nonempty") = groups;
    gdims.push(d / groups);
    let xg = x.reshape(gdims)?;
    let ms = xg.sqr()?.mean_keepdim(D::Minus1)?;
    xg.broadcast_div(&(ms + eps)?.sqrt()?)?.reshape(dims)?.broadcast_mul(w)
}

struct RmsNorm {
    groups: usize,
    eps: f64,
}

impl RmsNorm {
    /// 1/√(mean(x²) + eps) of one group.
    fn inv_rms(&self, x: &[f32]) -> f64 {
        let ms = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / x.len() as f64;
        1.0 / (ms + self.eps).sqrt()
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (slice(s1, l1, "rms_norm")?, slice(s2, l2, "rms_norm")?);
        let gw = w.len() / self.groups;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(gw).zip(x.par_chunks(gw)).enumerate().for_each(|(i, (o, xg))| {
            let r = self.inv_rms(xg) as f32;
            let wg = &w[(i % self.groups) * gw..][..gw];
            for ((o, &v), &wv) in o.iter_mut().zip(xg).zip(wg) {
                *o = v * r * wv;
            }
        });
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (rows, d) = x.dims2()?;
        let (xv, wv, g) = (host(x)?, host(w)?, host(grad)?);
        let gw = d / self.groups;
        // With x̂ = x·r: d x = r · (g·w − x̂ · mean(g·w·x̂)),  d w = Σ_rows g·x̂.
        let mut gx = vec![0f32; xv.len()];
        gx.par_chunks_mut(gw).zip(xv.par_chunks(gw)).enumerate().for_each(|(i, (o, xg))| {
            let r = self.inv_rms(xg);
            let wg = &wv[(i % self.groups) * gw..][..gw];
            let gg = &g[i * gw..][..gw];
            let dot: f64 =
                xg.iter().zip(gg).zip(wg).map(|((&v, &gv), &wk)| f64::from(gv * wk) * f64::from(v) * r).sum::<f64>()
                    / gw as f64;
            for (((o, &v), &gv), &wk) in o.iter_mut().zip(xg).zip(gg).zip(wg) {
                *o = (r * (f64::from(gv * wk) - f64::from(v) * r * dot)) as f32;
            }
        });
        let gwt = par_row_sums(rows, d, |row, acc| {
            let xr = &xv[row * d..][..d];
            let gr = &g[row * d..][..d];
            for grp in 0..self.groups {
                let r = self.inv_rms(&xr[grp * gw..][..gw]);
                for i in grp * gw..(grp + 1) * gw {
                    acc[i] += f64::from(gr[i]) * f64::from(xr[i]) * r;
                }
            }
        });
        let dev = x.device();
        Ok((Some(Tensor::from_vec(gx, (rows, d), dev)?), Some(Tensor::from_vec(gwt, d, dev)?)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn wave(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32 / 131.0).sin()).collect()
    }

    /// Runs `f` on f32 (fused) and f64 (composite) copies of `inputs`; compares the outputs and
    /// the gradients of Σ out·probe w.r.t. every input.
    fn agree(shapes: &[&[usize]], f: impl Fn(&[Tensor]) -> Result<Tensor>) -> Result<()> {
        let dev = Device::Cpu;
        let mk = |dtype: DType| -> Result<Vec<Var>> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let n = s.iter().product();
                    Var::from_tensor(&Tensor::from_vec(wave(n, i + 1), *s, &dev)?.to_dtype(dtype)?)
                })
                .collect()
        };
        let (a, b) = (mk(DType::F32)?, mk(DType::F64)?);
        let ta: Vec<Tensor> = a.iter().map(|v| v.as_tensor().clone()).collect();
        let tb: Vec<Tensor> = b.iter().map(|v| v.as_tensor().clone()).collect();
        let (oa, ob) = (f(&ta)?, f(&tb)?);
        let probe = Tensor::from_vec(wave(oa.elem_count(), 99), oa.shape(), &dev)?;
        let (ga, gb) =
            (oa.mul(&probe)?.sum_all()?.backward()?, ob.mul(&probe.to_dtype(DType::F64)?)?.sum_all()?.backward()?);
        let close = |x: &Tensor, y: &Tensor, what: &str| -> Result<()> {
            let (x, y) = (x.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?, y.flatten_all()?.to_vec1::<f64>()?);
            let scale = y.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
            let worst = x.iter().zip(&y).map(|(p, q)| (p - q).abs()).fold(0f64, f64::max);
            assert!(worst < 2e-5 * scale, "{what}: differs by {worst} (scale {scale})");
            Ok(())
        };
        close(&oa, &ob, "output")?;
        for (i, (va, vb)) in a.iter().zip(&b).enumerate() {
            close(ga.get(va).expect("grad"), gb.get(vb).expect("grad"), &format!("gradient of input {i}"))?;
        }
        Ok(())
    }

    #[test]
    fn conv_matches_composite() -> Result<()> {
        agree(&[&[3, 9 + 3, 5], &[5, 4], &[5]], |t| causal_conv(&t[0], &t[1], Some(&t[2])))?;
        agree(&[&[2, 1 + 3, 7], &[7, 4]], |t| causal_conv(&t[0], &t[1], None))
    }

    #[test]
    fn rms_norm_matches_composite() -> Result<()> {
        agree(&[&[2, 5, 12], &[12]], |t| rms_norm(&t[0], &t[1], 1, 1e-5))?;
        agree(&[&[4, 12], &[12]], |t| rms_norm(&t[0], &t[1], 3, 1e-5))
    }
}
