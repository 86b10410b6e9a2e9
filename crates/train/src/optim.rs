//! AdamW with decoupled weight decay, global-norm gradient clipping and a warmup + cosine
//! schedule. Written here rather than taken from candle-nn because a resumable run must save
//! and restore the moment estimates, which candle-nn's optimiser keeps private.

use std::collections::HashMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use rayon::prelude::*;

use crate::Result;

/// Hyper-parameters.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    /// β₁.
    pub beta1: f64,
    /// β₂.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices (not to norms, biases or SSM scalars).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

/// Refuses a count (`batch`, `steps`, ...) of 0, naming it.
pub(crate) fn check_counts(counts: &[(&str, u64)]) -> Result<()> {
    match counts.iter().find(|(_, v)| *v == 0) {
        Some((name, v)) => candle_core::bail!("{name} = {v}: must be at least 1"),
        None => Ok(()),
    }
}

/// Refuses a warmup longer than the run: the rate would never reach its peak, which is never
/// what a config means (a shortened `steps` that forgot `warmup`).
pub(crate) fn check_warmup(warmup: u64, steps: u64) -> Result<()> {
    if warmup > steps {
        candle_core::bail!("warmup = {warmup}: must be at most steps ({steps}), or the learning rate never reaches lr");
    }
    Ok(())
}

/// Checks a run's learning rates, clipping norm and optimiser settings. Types allow values
/// that make training go backwards (a negative rate or decay) or stand still (a clipping norm
/// of 0 scales every gradient to nothing), and a run would otherwise take them and exit 0.
pub fn check_settings(lr: f64, min_lr: f64, clip: f64, adamw: &AdamWConfig) -> Result<()> {
    if !(lr.is_finite() && lr > 0.0) {
        candle_core::bail!("lr = {lr}: the peak learning rate must be a number above 0 (e.g. 3e-3)");
    }
    if !(min_lr.is_finite() && (0.0..=lr).contains(&min_lr)) {
        candle_core::bail!("min_lr = {min_lr}: the final learning rate must be from 0 to lr ({lr})");
    }
    if !(clip.is_finite() && clip > 0.0) {
        candle_core::bail!(
            "clip = {clip}: the gradient-norm limit must be a number above 0 (1.0 is usual; clipping cannot be turned off, and 0 would scale every step to nothing)"
        );
    }
    let wd = adamw.weight_decay;
    if !(wd.is_finite() && wd >= 0.0) {
        candle_core::bail!("weight_decay = {wd}: must be a number from 0 up (0.1 is usual)");
    }
    let betas_ok = [adamw.beta1, adamw.beta2].iter().all(|b| (0.0..1.0).contains(b));
    let eps_ok = adamw.eps.is_finite() && adamw.eps > 0.0;
    if !(betas_ok && eps_ok) {
        candle_core::bail!(
            "AdamW beta1 = {}, beta2 = {}, eps = {}: the betas must be in [0, 1) and eps above 0",
            adamw.beta1,
            adamw.beta2,
            adamw.eps
        );
    }
    Ok(())
}

/// The optimiser and its state.
pub struct AdamW {
    config: AdamWConfig,
    vars: Vec<Var>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Steps taken.
    pub t: u64,
}

impl AdamW {
    /// A fresh optimiser over `vars`.
    pub fn new(vars: Vec<Var>, config: AdamWConfig) -> Result<Self> {
        let m = vars.iter().map(|v| v.as_tensor().zeros_like()).collect::<Result<Vec<_>>>()?;
        let v = m.clone();
        Ok(Self { config, vars, m, v, t: 0 })
    }

    /// The global L2 norm of the gradients.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        let mut sq = 0.0;
        for var in &self.vars {
            if let Some(g) = grads.get(var) {
                sq += g.sqr()?.sum_all()?.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
            }
        }
        Ok(sq.sqrt())
    }

    /// One step at learning rate `lr`, gradients scaled by `grad_scale` (clipping).
    pub fn step(&mut self, grads: &GradStore, lr: f64, grad_scale: f64) -> Result<()> {
        self.t += 1;
        let c = &self.config;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.t as i32), 1.0 - c.beta2.powi(self.t as i32));
        for ((var, m), v) in self.vars.iter().zip(&mut self.m).zip(&mut self.v) {
            let Some(g) = grads.get(var) else { continue };
            let g = (g * grad_scale)?;
            *m = ((&*m * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            *v = ((&*v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let update = ((&*m / bc1)? / ((&*v / bc2)?.sqrt()? + c.eps)?)?;
            let w = var.as_tensor();
            let decay = if w.rank() >= 2 { c.weight_decay } else { 0.0 };
            let next = ((w * (1.0 - lr * decay))? - (update * lr)?)?;
            var.set(&next)?;
        }
        Ok(())
    }

    /// Saves the moments and the step count.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (i, (m, v)) in self.m.iter().zip(&self.v).enumerate() {
            map.insert(format!("m.{i}"), m.clone());
            map.insert(format!("v.{i}"), v.clone());
        }
        map.insert("t".into(), Tensor::new(&[self.t as i64], &Device::Cpu)?);
        candle_core::safetensors::save(&map, path)
    }

    /// Restores what [`AdamW::save`] wrote; the variables must be the same, in the same order.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let device = self.vars.first().map(|v| v.device().clone()).unwrap_or(Device::Cpu);
        let mut map = candle_core::safetensors::load(path, &device)?;
        let mut take = |k: String, like: &Tensor| -> Result<Tensor> {
            let t = map.remove(&k).ok_or_else(|| candle_core::Error::Msg(format!("optimizer state lacks {k}")))?;
            if t.shape() != like.shape() {
                return Err(candle_core::Error::Msg(format!(
                    "optimizer state {k} has shape {:?}, the model needs {:?}",
                    t.shape(),
                    like.shape()
                )));
            }
            t.to_dtype(like.dtype())
        };
        for i in 0..self.vars.len() {
            let like = self.vars[i].as_tensor().clone();
            self.m[i] = take(format!("m.{i}"), &like)?;
            self.v[i] = take(format!("v.{i}"), &like)?;
        }
        self.t = map.remove("t").map(|t| t.to_vec1::<i64>()).transpose()?.and_then(|v| v.first().copied()).unwrap_or(0)
            as u64;
        Ok(())
    }
}

/// AdamW over host slices, for the CPU fast path: the same update as [`AdamW`] and the same
/// checkpoint file (`m.{i}`, `v.{i}` shaped like the parameters, `t`), so a run can resume
/// with either trainer.
pub struct HostAdamW {
    config: AdamWConfig,
    shapes: Vec<Vec<usize>>,
    m: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// Steps taken.
    pub t: u64,
}

impl HostAdamW {
    /// A fresh optimiser for parameters of these shapes.
    pub fn new(shapes: Vec<Vec<usize>>, config: AdamWConfig) -> Self {
        let zeros: Vec<Vec<f32>> = shapes.iter().map(|s| vec![0f32; s.iter().product()]).collect();
        Self { config, shapes, m: zeros.clone(), v: zeros, t: 0 }
    }

    /// The global L2 norm of `grads`.
    pub fn grad_norm(grads: &[&[f32]]) -> f64 {
        grads
            .par_iter()
            .map(|g| g.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>())
            .collect::<Vec<f64>>()
            .iter()
            .sum::<f64>()
            .sqrt()
    }

    /// One step at learning rate `lr`, gradients scaled by `grad_scale` (clipping).
    pub fn step(&mut self, params: Vec<&mut [f32]>, grads: &[&[f32]], lr: f64, grad_scale: f64) -> Result<()> {
        if params.len() != self.shapes.len() || grads.len() != self.shapes.len() {
            candle_core::bail!(
                "HostAdamW: {} parameters and {} gradients for {} slots",
                params.len(),
                grads.len(),
                self.shapes.len()
            );
        }
        self.t += 1;
        let c = &self.config;
        let (bc1, bc2) = (1.0 - c.beta1.powi(self.t as i32), 1.0 - c.beta2.powi(self.t as i32));
        let (b1, b2, eps, scale) = (c.beta1 as f32, c.beta2 as f32, c.eps as f32, grad_scale as f32);
        let (ibc1, ibc2, lr32) = ((1.0 / bc1) as f32, (1.0 / bc2) as f32, lr as f32);
        for (i, (w, g)) in params.into_iter().zip(grads).enumerate() {
            let decay = if self.shapes[i].len() >= 2 { (1.0 - lr * c.weight_decay) as f32 } else { 1.0 };
            const BLOCK: usize = 4096;
            w.par_chunks_mut(BLOCK)
                .zip(g.par_chunks(BLOCK))
                .zip(self.m[i].par_chunks_mut(BLOCK).zip(self.v[i].par_chunks_mut(BLOCK)))
                .for_each(|((w, g), (m, v))| {
                    for (((w, &g), m), v) in w.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                        let g = g * scale;
                        *m = b1 * *m + (1.0 - b1) * g;
                        *v = b2 * *v + (1.0 - b2) * g * g;
                        let update = (*m * ibc1) / ((*v * ibc2).sqrt() + eps);
                        *w = *w * decay - update * lr32;
                    }
                });
        }
        Ok(())
    }

    /// Saves the moments and the step count ([`AdamW::save`]'s format).
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (i, ((m, v), s)) in self.m.iter().zip(&self.v).zip(&self.shapes).enumerate() {
            map.insert(format!("m.{i}"), Tensor::from_slice(m, s.as_slice(), &Device::Cpu)?);
            map.insert(format!("v.{i}"), Tensor::from_slice(v, s.as_slice(), &Device::Cpu)?);
        }
        map.insert("t".into(), Tensor::new(&[self.t as i64], &Device::Cpu)?);
        candle_core::safetensors::save(&map, path)
    }

    /// Restores what [`HostAdamW::save`] or [`AdamW::save`] wrote for the same parameters.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let mut map = candle_core::safetensors::load(path, &Device::Cpu)?;
        let mut take = |k: String, shape: &[usize]| -> Result<Vec<f32>> {
            let t = map.remove(&k).ok_or_else(|| candle_core::Error::Msg(format!("optimizer state lacks {k}")))?;
            if t.dims() != shape {
                candle_core::bail!("optimizer state {k} has shape {:?}, the model needs {shape:?}", t.dims());
            }
            t.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1()
        };
        for i in 0..self.shapes.len() {
            let shape = self.shapes[i].clone();
            self.m[i] = take(format!("m.{i}"), &shape)?;
            self.v[i] = take(format!("v.{i}"), &shape)?;
        }
        self.t = map.remove("t").map(|t| t.to_vec1::<i64>()).transpose()?.and_then(|v| v.first().copied()).unwrap_or(0)
            as u64;
        Ok(())
    }
}

/// Linear warmup to `peak` over `warmup` steps, then cosine decay to `floor` at `total`.
pub fn lr_at(step: u64, warmup: u64, total: u64, peak: f64, floor: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let progress = ((step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64).min(1.0);
    floor + 0.5 * (peak - floor) * (1.0 + (std::f64::consts::PI * progress).cos())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        assert!((lr_at(0, 10, 100, 1.0, 0.1) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 10, 100, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(10, 10, 100, 1.0, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(55, 10, 100, 1.0, 0.1) - 0.55).abs() < 1e-12);
        assert!((lr_at(100, 10, 100, 1.0, 0.1) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn minimises_a_quadratic_and_round_trips_its_state() {
        let w = Var::from_tensor(&Tensor::new(&[[3.0f64, -2.0]], &Device::Cpu).unwrap()).unwrap();
        let cfg = AdamWConfig { weight_decay: 0.0, ..Default::default() };
        let mut opt = AdamW::new(vec![w.clone()], cfg.clone()).unwrap();
        for _ in 0..300 {
            let loss = w.as_tensor().sqr().unwrap().sum_all().unwrap();
            let g = loss.backward().unwrap();
            opt.step(&g, 0.05, 1.0).unwrap();
        }
        let v: Vec<f64> = w.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.abs() < 0.05), "{v:?}");
        let tmp = tempfile::tempdir().unwrap();
        opt.save(&tmp.path().join("o.safetensors")).unwrap();
        let mut back = AdamW::new(vec![w.clone()], cfg).unwrap();
        back.load(&tmp.path().join("o.safetensors")).unwrap();
        assert_eq!(back.t, 300);
        let same = |a: &Tensor, b: &Tensor| {
            a.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
                == b.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap()
        };
        assert!(same(&back.m[0], &opt.m[0]) && same(&back.v[0], &opt.v[0]));
    }
}
