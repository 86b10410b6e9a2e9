//! Composition when every state value has its own decay (Mamba-1: one decay per layer, channel
//! and state entry). There are as many weight vectors as state values, so storing them costs as
//! much memory traffic as the states themselves; here they are computed eight elements at a
//! time, in lanes, and applied at once. The arithmetic is [`crate::weights_into`]'s, lane by
//! lane, with a branch-free exp so that it vectorises.

use rayon::prelude::*;

use crate::{Error, Method, TINY_WEIGHT};

/// Elements whose weights are computed together (one AVX-512 register of f64, two of AVX2).
const L: usize = 8;
type Lanes = [f64; L];

/// exp(x) of each lane in f64 for x ≤ 0, to about 1 ulp, branch-free. Below −708 (where exp
/// leaves the normal range) it is 0: such weights are flushed anyway ([`crate::TINY_WEIGHT`] is
/// e^−69). Every step is a loop over the lanes, so that each becomes one vector instruction.
#[inline(always)]
fn exp(x: Lanes) -> Lanes {
    const LN2_HI: f64 = 6.931_471_803_691_238e-1; // ln 2 with its last 21 bits zero: k·LN2_HI is exact
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    const SHIFT: f64 = 6_755_399_441_055_744.0; // 1.5·2^52: adding it rounds to an integer
                                                // Taylor series to r^13 / 13! (|r| ≤ ln2 / 2): the next term is below 2^-57.
    const INV_FACTORIAL: [f64; 13] = [
        1.0 / 479_001_600.0,
        1.0 / 39_916_800.0,
        1.0 / 3_628_800.0,
        1.0 / 362_880.0,
        1.0 / 40_320.0,
        1.0 / 5_040.0,
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ];
    let (mut shifted, mut r, mut p, mut out) = ([0.0; L], [0.0; L], [1.0 / 6_227_020_800.0; L], [0.0; L]);
    for j in 0..L {
        let xc = if x[j] < -708.0 { -708.0 } else { x[j] };
        shifted[j] = xc * std::f64::consts::LOG2_E + SHIFT;
        let k = shifted[j] - SHIFT;
        r[j] = xc - k * LN2_HI - k * LN2_LO;
    }
    for c in INV_FACTORIAL {
        for j in 0..L {
            p[j] = p[j] * r[j] + c;
        }
    }
    for j in 0..L {
        // 2^k from the low bits of `shifted` (= 2^51 + k in its mantissa): k + 1023 in [1, 1023].
        let scale = f64::from_bits((shifted[j].to_bits().wrapping_add(1023)) << 52);
        out[j] = if x[j] < -708.0 { 0.0 } else { p[j] * scale };
    }
    out
}

/// Buffers of one task: per context, the lanes' log-decays, decays and weights.
#[derive(Default)]
pub struct Scratch {
    ld: Vec<Lanes>,
    a: Vec<Lanes>,
    w: Vec<Lanes>,
    prefix: Vec<Lanes>,
    suffix: Vec<Lanes>,
    coeff: Vec<f64>,
}

/// The weights of eight elements: `s.w[k][j]` for context k and element j, from `s.ld`.
/// Every inner loop runs over whole lanes of local copies, so that it vectorises.
#[inline(always)]
fn lane_weights(method: Method, s: &mut Scratch) {
    let n = s.ld.len();
    s.w.resize(n, [0.0; L]);
    match method {
        Method::Soup => s.w.fill([1.0 / n as f64; L]),
        Method::Caso => {
            // Suffix sums of the log-decays first, then one vectorised exp per weight.
            let mut suffix = [0.0; L];
            for k in (0..n).rev() {
                s.w[k] = suffix;
                let ld = s.ld[k];
                for j in 0..L {
                    suffix[j] += ld[j];
                }
            }
            for w in &mut s.w {
                *w = exp(*w);
            }
        }
        Method::PicasoR => {
            decays(s);
            let mut total = [-0.0; L];
            for ld in &s.ld {
                let ld = *ld;
                for j in 0..L {
                    total[j] += ld[j];
                }
            }
            let total = exp(total);
            let mut r = [1.0; L];
            for a in s.a[..n - 1].iter().rev() {
                let a = *a;
                for j in 0..L {
                    r[j] = 1.0 + a[j] * r[j];
                }
            }
            let inv = 1.0 / n as f64;
            let mut wk = [0.0; L];
            for j in 0..L {
                wk[j] = r[j] * inv;
            }
            s.w[n - 1] = wk;
            for k in (1..n).rev() {
                let a = s.a[k];
                for j in 0..L {
                    r[j] = (1.0 - total[j] + a[j] * r[j]).max(1.0);
                    wk[j] = r[j] * inv;
                }
                s.w[k - 1] = wk;
            }
        }
        Method::PicasoS => {
            decays(s);
            crate::picaso_s_coefficients(n, &mut s.coeff);
            // prefix: L_0..L_{n-1} as a triangle (L_k: k+1 entries from k(k+1)/2).
            s.prefix.clear();
            s.prefix.push([1.0; L]);
            for k in 1..n {
                let start = (k - 1) * k / 2;
                let a = s.a[k - 1];
                for i in 0..=k {
                    let prev = if i < k { s.prefix[start + i] } else { [0.0; L] };
                    let shifted = if i > 0 { s.prefix[start + i - 1] } else { [0.0; L] };
                    let mut v = [0.0; L];
                    for j in 0..L {
                        v[j] = prev[j] + a[j] * shifted[j];
                    }
                    s.prefix.push(v);
                }
            }
            s.suffix.clear();
            s.suffix.extend(s.coeff.iter().map(|&c| [c; L]));
            for k in (0..n).rev() {
                if k < n - 1 {
                    let a = s.a[k + 1];
                    for i in 0..=k {
                        let next = s.suffix[i + 1];
                        let mut v = s.suffix[i];
                        for j in 0..L {
                            v[j] += a[j] * next[j];
                        }
                        s.suffix[i] = v;
                    }
                }
                let mut w = [0.0; L];
                for (x, y) in s.prefix[k * (k + 1) / 2..k * (k + 1) / 2 + k + 1].iter().zip(&s.suffix) {
                    let (x, y) = (*x, *y);
                    for j in 0..L {
                        w[j] += x[j] * y[j];
                    }
                }
                s.w[k] = w;
            }
        }
    }
}

#[inline(always)]
fn decays(s: &mut Scratch) {
    s.a.resize(s.ld.len(), [0.0; L]);
    for (a, ld) in s.a.iter_mut().zip(&s.ld) {
        *a = exp(*ld);
    }
}

crate::simd_fn! {
    /// One task's elements `[from, from + ssm_out.len())`. Returns (every output is finite,
    /// every log-decay is finite and ≤ 0).
    pub fn compose_range(
        method: Method,
        log_decays: &[&[f32]],
        ssm: &[&[f32]],
        from: usize,
        ssm_out: &mut [f32],
        log_decay_out: &mut [f32],
        s: &mut Scratch,
    ) -> (bool, bool) {
        let n = log_decays.len();
        s.ld.resize(n, [0.0; L]);
        let (mut finite, mut decays_ok) = (true, true);
        for (c, (out, ld_out)) in ssm_out.chunks_mut(L).zip(log_decay_out.chunks_mut(L)).enumerate() {
            let e = from + c * L;
            let m = out.len();
            for (lanes, ld) in s.ld.iter_mut().zip(log_decays) {
                *lanes = [0.0; L];
                for (dst, src) in lanes.iter_mut().zip(&ld[e..e + m]) {
                    *dst = *src as f64;
                    decays_ok &= *dst <= 0.0 && *dst >= f32::MIN as f64;
                }
            }
            if !decays_ok {
                return (finite, false);
            }
            lane_weights(method, s);
            // Padded to whole lanes so that the loops below have a fixed width.
            let mut acc = [0.0f32; L];
            let mut sum = [-0.0f64; L];
            for (i, (x, (w, ld))) in ssm.iter().zip(s.w.iter().zip(&s.ld)).enumerate() {
                let mut xv = [0.0f32; L];
                xv[..m].copy_from_slice(&x[e..e + m]);
                for j in 0..L {
                    let wj = if w[j] < TINY_WEIGHT { 0.0 } else { w[j] as f32 };
                    acc[j] = if i == 0 { wj * xv[j] } else { acc[j] + wj * xv[j] };
                    sum[j] += ld[j];
                }
            }
            out.copy_from_slice(&acc[..m]);
            for (dst, v) in ld_out.iter_mut().zip(sum) {
                *dst = v as f32;
            }
            let mut lanes_finite = true;
            for v in acc {
                lanes_finite &= v.is_finite();
            }
            finite &= lanes_finite;
        }
        (finite, decays_ok)
    }
}

/// Composes states whose every value has its own decay, without storing the weights:
/// `ssm_out[e] = Σᵢ wᵢ(e) · ssm[i][e]` with w(e) the `method`'s weights of the log-decays
/// `log_decays[·][e]` (contexts in order), and `log_decay_out[e] = Σᵢ log_decays[i][e]`, the
/// composed state's decay. Equals [`crate::weights_per_element`] then
/// [`crate::weighted_sum_blocks`] with blocks of one value, to the last bit of f32 but for
/// weights within an ulp of a rounding boundary.
pub fn compose_per_value(
    method: Method,
    log_decays: &[&[f32]],
    ssm: &[&[f32]],
    ssm_out: &mut [f32],
    log_decay_out: &mut [f32],
) -> Result<(), Error> {
    let n = log_decays.len();
    if n == 0 {
        return Err(Error::Empty);
    }
    let len = ssm_out.len();
    if ssm.len() != n {
        return Err(Error::Shape(format!("{} states for {n} log-decay arrays", ssm.len())));
    }
    if log_decay_out.len() != len {
        return Err(Error::Shape(format!("{} output log-decays for {len} state values", log_decay_out.len())));
    }
    for (i, (x, ld)) in ssm.iter().zip(log_decays).enumerate() {
        if x.len() != len || ld.len() != len {
            return Err(Error::Shape(format!(
                "context {i} has {} state values and {} log-decays, expected {len} of each",
                x.len(),
                ld.len()
            )));
        }
    }
    // Tasks of 4096 values: ~16 KiB of output each, many per core.
    const TASK: usize = 4096;
    let checks = ssm_out
        .par_chunks_mut(TASK)
        .zip(log_decay_out.par_chunks_mut(TASK))
        .enumerate()
        .map_init(Scratch::default, |s, (t, (out, ld_out))| {
            compose_range(method, log_decays, ssm, t * TASK, out, ld_out, s)
        })
        .reduce(|| (true, true), |a, b| (a.0 && b.0, a.1 && b.1));
    match checks {
        (_, false) => {
            // Rare path: name the culprit (checked in lanes above, found here).
            for (context, ld) in log_decays.iter().enumerate() {
                if let Some(v) = ld.iter().find(|v| !(v.is_finite() && **v <= 0.0)) {
                    return Err(Error::BadLogDecay { context, value: *v as f64 });
                }
            }
            Err(Error::NonFinite) // (the two checks refuse the same values)
        }
        (false, true) => Err(Error::NonFinite),
        (true, true) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut x = 0.0f64;
        while x > -720.0 {
            let (got, want) = (exp([x; L])[0], x.exp());
            if x >= -708.0 {
                assert!((got - want).abs() <= 2.0 * f64::EPSILON * want, "exp({x}) = {got}, libm {want}");
            } else {
                assert!(got == 0.0 && want < 1e-307, "exp({x}) = {got}");
            }
            x -= 0.0137;
        }
        assert_eq!(exp([0.0; L]), [1.0; L]);
        assert_eq!(exp([-1e30; L]), [0.0; L]);
    }

    #[test]
    fn lane_weights_match_the_scalar_weights() {
        let mut rng = 12345u64;
        let mut next = || {
            rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (rng >> 11) as f64 / (1u64 << 53) as f64
        };
        for method in [Method::Soup, Method::Caso, Method::PicasoS, Method::PicasoR] {
            for n in [1usize, 2, 3, 7, 12] {
                let mut s = Scratch::default();
                // Log-decays from 0 to -1e4, including exact zeros.
                let ld: Vec<Lanes> = (0..n)
                    .map(|_| {
                        std::array::from_fn(|_| match (next() * 4.0) as u32 {
                            0 => 0.0,
                            1 => -next() * 1e4,
                            _ => -next() * 3.0,
                        })
                    })
                    .collect();
                s.ld = ld.clone();
                lane_weights(method, &mut s);
                for j in 0..L {
                    let column: Vec<f64> = ld.iter().map(|l| l[j]).collect();
                    let want = crate::weights(method, &column).unwrap();
                    for (k, (w, want)) in s.w.iter().zip(want).enumerate() {
                        let got = w[j];
                        assert!(
                            (got - want).abs() <= 1e-13 * want.max(1e-300) || (got - want).abs() < 1e-300,
                            "{method:?} n={n} k={k}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}
