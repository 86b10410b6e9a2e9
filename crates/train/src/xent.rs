//! Cross-entropy over a large vocabulary as one fused CPU kernel.
//!
//! The composite form (log_softmax, gather, mean) walks the (tokens × vocab) logits a dozen
//! times and allocates as many tensors of that size, forward and backward; at 2048 tokens ×
//! 8192 entries that is most of a small model's step. The fused op reads the logits once
//! forward (max, log-sum-exp, picked logit per row) and writes the gradient once backward
//! (softmax − one-hot). Other devices and dtypes use the composite form.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};
use rayon::prelude::*;

use crate::Result;

/// Target id meaning "this position does not count".
pub const IGNORE: u32 = u32::MAX;

/// Mean cross-entropy (nats) of `targets` under `logits` (rows × vocab), over the rows whose
/// target is not [`IGNORE`]. A scalar tensor, differentiable w.r.t. `logits`.
pub fn cross_entropy(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    if targets.len() != rows {
        candle_core::bail!("cross_entropy: {} targets for {rows} rows of logits", targets.len());
    }
    if let Some(&bad) = targets.iter().find(|&&t| t != IGNORE && t as usize >= vocab) {
        candle_core::bail!("cross_entropy: target {bad} outside the vocabulary of {vocab}");
    }
    let counted = targets.iter().filter(|&&t| t != IGNORE).count();
    if counted == 0 {
        candle_core::bail!("cross_entropy: every target is ignored, the mean is undefined");
    }
    if logits.device().is_cpu() && logits.dtype() == DType::F32 {
        let op = CrossEntropy { targets: targets.to_vec(), counted };
        return logits.apply_op1(op)?.reshape(());
    }
    composite(logits, targets, counted)
}

fn composite(logits: &Tensor, targets: &[u32], counted: usize) -> Result<Tensor> {
    let logp = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let keep: Vec<f32> = targets.iter().map(|&t| if t == IGNORE { 0.0 } else { 1.0 }).collect();
    let ids: Vec<u32> = targets.iter().map(|&t| if t == IGNORE { 0 } else { t }).collect();
    let dev = logits.device();
    let picked = logp.gather(&Tensor::new(ids.as_slice(), dev)?.unsqueeze(1)?, 1)?.squeeze(1)?;
    let keep = Tensor::new(keep.as_slice(), dev)?.to_dtype(logits.dtype())?;
    (picked.mul(&keep)?.sum_all()? / counted as f64)?.neg()
}

struct CrossEntropy {
    targets: Vec<u32>,
    counted: usize,
}

fn f32_rows<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    let CpuStorage::F32(all) = storage else { candle_core::bail!("cross_entropy: f32 logits expected") };
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("cross_entropy: contiguous logits expected"),
    }
}

/// The cross-entropy of each row of `logits` (rows × `vocab`) at its target, 0 where the
/// target is [`IGNORE`].
pub(crate) fn row_losses(logits: &[f32], vocab: usize, targets: &[u32]) -> Vec<f64> {
    logits
        .par_chunks(vocab)
        .zip(targets.par_iter())
        .map(|(row, &t)| {
            if t == IGNORE {
                return 0.0;
            }
            let (max, lse) = log_sum_exp(row);
            f64::from(max + lse - row[t as usize])
        })
        .collect()
}

/// (max, log Σ exp(x − max)) of one row.
fn log_sum_exp(row: &[f32]) -> (f32, f32) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    (max, sum.ln() as f32)
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let vocab = layout.dims()[1];
        let logits = f32_rows(storage, layout)?;
        // Per-row losses in parallel, summed in row order: deterministic.
        let total: f64 = row_losses(logits, vocab, &self.targets).iter().sum();
        Ok((CpuStorage::F32(vec![(total / self.counted as f64) as f32]), Shape::from(1)))
    }

    fn bwd(&self, logits: &Tensor, _loss: &Tensor, grad_loss: &Tensor) -> Result<Option<Tensor>> {
        let scale = grad_loss.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?[0] / self.counted as f32;
        let grad = logits.contiguous()?.apply_op1_no_bwd(&CrossEntropyGrad { targets: &self.targets, scale })?;
        Ok(Some(grad))
    }
}

/// scale · (softmax(row) − one-hot(target)) per counted row, zeros for ignored rows.
struct CrossEntropyGrad<'a> {
    targets: &'a [u32],
    scale: f32,
}

impl CustomOp1 for CrossEntropyGrad<'_> {
    fn name(&self) -> &'static str {
        "cross-entropy-grad"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let vocab = layout.dims()[1];
        let logits = f32_rows(storage, layout)?;
        let mut grad = vec![0f32; logits.len()];
        grad.par_chunks_mut(vocab).zip(logits.par_chunks(vocab)).zip(self.targets.par_iter()).for_each(
            |((g, row), &t)| {
                if t == IGNORE {
                    return;
                }
                let (max, lse) = log_sum_exp(row);
                let shift = max + lse;
                for (gi, &x) in g.iter_mut().zip(row) {
                    *gi = self.scale * (x - shift).exp();
                }
                g[t as usize] -= self.scale;
            },
        );
        Ok((CpuStorage::F32(grad), layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// The fused kernel and the composite form agree on the loss and its gradient,
    /// ignored rows included.
    #[test]
    fn fused_equals_composite() -> Result<()> {
        let dev = Device::Cpu;
        let (rows, vocab) = (37, 301);
        let data: Vec<f32> = (0..rows * vocab).map(|i| ((i * 7919 % 1013) as f32 / 97.0).sin() * 6.0).collect();
        let targets: Vec<u32> = (0..rows).map(|r| if r % 5 == 3 { IGNORE } else { (r * 131 % vocab) as u32 }).collect();
        let counted = targets.iter().filter(|&&t| t != IGNORE).count();
        let x = Var::from_tensor(&Tensor::from_vec(data, (rows, vocab), &dev)?)?;
        let fused = cross_entropy(x.as_tensor(), &targets)?;
        let reference = composite(x.as_tensor(), &targets, counted)?;
        let (f, r) = (fused.to_scalar::<f32>()?, reference.to_scalar::<f32>()?);
        assert!((f - r).abs() < 1e-5 * r.abs(), "{f} vs {r}");
        let gf = (fused * 3.0)?.backward()?.get(&x).expect("grad").flatten_all()?.to_vec1::<f32>()?;
        let gr = (reference * 3.0)?.backward()?.get(&x).expect("grad").flatten_all()?.to_vec1::<f32>()?;
        let worst = gf.iter().zip(&gr).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-6, "gradient differs by {worst}");
        assert!(gf[3 * vocab..4 * vocab].iter().all(|&g| g == 0.0), "an ignored row has a gradient");
        Ok(())
    }

    #[test]
    fn bad_targets_are_errors() -> Result<()> {
        let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
        assert!(cross_entropy(&x, &[0]).is_err());
        assert!(cross_entropy(&x, &[0, 4]).is_err());
        assert!(cross_entropy(&x, &[IGNORE, IGNORE]).is_err());
        Ok(())
    }
}
