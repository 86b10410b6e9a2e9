//! Scalar activations written so that loops calling them vectorise.

/// exp(x) for f32 to ~2 ulp, branch-free so that loops calling it vectorise (Cephes expf).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.336_55, 88.376_26);
    let k = (x * LOG2E + 0.5).floor();
    let r = x - k * LN2_HI - k * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    y * pow2(k)
}

/// 2^k for an integer-valued k in [-126, 127], by building the exponent bits. Adding 2^23 puts
/// the integer k + 127 in the low mantissa bits, whence a shift moves it into the exponent
/// field: no float-to-int conversion, which LLVM does not vectorise for Rust's saturating `as`
/// (it ran lane by lane, 16 scalar conversions per vector, in every loop calling [`exp`]).
#[inline(always)]
fn pow2(k: f32) -> f32 {
    f32::from_bits((k + (127.0 + 8_388_608.0)).to_bits() << 23)
}

/// SiLU x·σ(x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// softplus as torch computes it: x above 20, else log(1 + e^x).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let rel = ((exp(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
            x += 0.0137;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(-1000.0), exp(-87.336_55));
        assert!(exp(1000.0).is_finite());
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn pow2_builds_the_exponent_of_every_integer_in_range() {
        for k in -126..=127 {
            assert_eq!(pow2(k as f32), f32::from_bits(((k + 127) as u32) << 23), "2^{k}");
            assert_eq!(pow2(k as f32) as f64, 2f64.powi(k), "2^{k}");
        }
    }
}
