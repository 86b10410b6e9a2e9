//! RMSNorm and the gated RMSNorm of Mamba-2 mixers.

use picaso_compose::simd_fn;

use super::activations::silu;

simd_fn! {
    /// Per row of `x` (rows×d): out = x / sqrt(mean(x²) + eps) · w.
    pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let d = w.len();
        for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>();
            let scale = 1.0 / (ss / d as f32 + eps).sqrt();
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
                *o = v * scale * g;
            }
        }
    }
}

simd_fn! {
    /// Gated RMSNorm grouped by `group`: v = y·silu(z); out = v / sqrt(mean_group(v²) + eps) · w.
    /// `y`, `z` and `out` are one token's d_inner values.
    pub fn gated_rmsnorm(y: &[f32], z: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
        for (o, (&yv, &zv)) in out.iter_mut().zip(y.iter().zip(z)) {
            *o = yv * silu(zv);
        }
        for (og, wg) in out.chunks_exact_mut(group).zip(w.chunks_exact(group)) {
            let ss: f32 = og.iter().map(|v| v * v).sum();
            let scale = 1.0 / (ss / group as f32 + eps).sqrt();
            for (o, &g) in og.iter_mut().zip(wg) {
                *o = *o * scale * g;
            }
        }
    }
}

simd_fn! {
    /// RMSNorm grouped by `group`, then gated: out = y / sqrt(mean_group(y²) + eps) · w · silu(z)
    /// (Falcon-H1's `mamba_norm_before_gate`). `y`, `z` and `out` are one token's d_inner values.
    pub fn rmsnorm_then_gate(y: &[f32], z: &[f32], w: &[f32], group: usize, eps: f32, out: &mut [f32]) {
        for ((og, yg), (wg, zg)) in
            out.chunks_exact_mut(group).zip(y.chunks_exact(group)).zip(w.chunks_exact(group).zip(z.chunks_exact(group)))
        {
            let ss: f32 = yg.iter().map(|v| v * v).sum();
            let scale = 1.0 / (ss / group as f32 + eps).sqrt();
            for (o, ((&yv, &g), &zv)) in og.iter_mut().zip(yg.iter().zip(wg).zip(zg)) {
                *o = yv * scale * g * silu(zv);
            }
        }
    }
}
