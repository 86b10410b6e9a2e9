//! Means with confidence intervals.

/// Mean and the half-width of its 95% normal confidence interval (1.96 standard errors).
///
/// The interval is `None` for fewer than two values: one value has no spread to estimate it
/// from, and reports show it as "n/a" (JSON: null) rather than a number. The mean of no
/// values is NaN.
pub fn mean_ci95(xs: &[f64]) -> (f64, Option<f64>) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (f64::NAN, None);
    }
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, None);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, Some(1.96 * (var / n).sqrt()))
}

/// Mean and 95% half-width of the per-item differences `a − b` of two measurements of the
/// same items: the paired interval, far narrower than either mean's own when the items'
/// difficulty moves both (`None` for fewer than two items, as [`mean_ci95`]).
pub fn paired_ci95(a: &[f64], b: &[f64]) -> (f64, Option<f64>) {
    let diffs: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    mean_ci95(&diffs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_interval_of_differences() {
        let (d, h) = paired_ci95(&[2.0, 6.0, 4.0], &[1.0, 5.0, 3.0]);
        assert_eq!((d, h), (1.0, Some(0.0)));
        assert!(paired_ci95(&[], &[]).0.is_nan());
    }

    #[test]
    fn mean_and_interval() {
        let (m, h) = mean_ci95(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m, 2.5);
        // sd = √(5/3); se = sd/2.
        assert!((h.unwrap() - 1.96 * (5.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12);
        assert!(mean_ci95(&[]).0.is_nan());
        // One value: a mean, but no interval.
        assert_eq!(mean_ci95(&[3.0]), (3.0, None));
    }
}
