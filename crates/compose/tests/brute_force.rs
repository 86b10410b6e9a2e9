//! The closed forms against their definitions: PICASO-S is the mean of CASO over all n!
//! orders, PICASO-R over the n rotations (to 1e-12 in f64), with invariances and edge cases,
//! and finite, exact results for decays that underflow and n up to 64.

use picaso_compose::{compose_per_value, weighted_sum_blocks, weights, weights_per_element, Composition};
use proptest::prelude::*;

/// CASO weights straight from the definition: product of the decays after each context.
fn caso_brute(a: &[f64]) -> Vec<f64> {
    (0..a.len()).map(|k| a[k + 1..].iter().product()).collect()
}

fn permutations(n: usize) -> Vec<Vec<usize>> {
    if n == 0 {
        return vec![vec![]];
    }
    let mut out = Vec::new();
    for p in permutations(n - 1) {
        for pos in 0..n {
            let mut q = p.clone();
            q.insert(pos, n - 1);
            out.push(q);
        }
    }
    out
}

/// Mean over the given orders of the CASO weight each context receives.
fn mean_caso_over(orders: &[Vec<usize>], a: &[f64]) -> Vec<f64> {
    let mut w = vec![0.0; a.len()];
    for order in orders {
        let decays: Vec<f64> = order.iter().map(|&i| a[i]).collect();
        for (pos, wk) in caso_brute(&decays).into_iter().enumerate() {
            w[order[pos]] += wk / orders.len() as f64;
        }
    }
    w
}

fn rotations(n: usize) -> Vec<Vec<usize>> {
    (0..n).map(|r| (0..n).map(|i| (i + r) % n).collect()).collect()
}

fn log_decays(max_n: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(prop_oneof![Just(0.0), -5.0..0.0f64, -40.0..-5.0f64], 1..=max_n)
}

fn close(a: &[f64], b: &[f64], tol: f64) -> bool {
    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

proptest! {
    #[test]
    fn picaso_s_is_the_mean_of_caso_over_all_orders(ld in log_decays(6)) {
        let a: Vec<f64> = ld.iter().map(|v| v.exp()).collect();
        let want = mean_caso_over(&permutations(a.len()), &a);
        let got = weights(Composition::PicasoS, &ld).unwrap();
        prop_assert!(close(&got, &want, 1e-12), "{got:?} vs {want:?}");
    }

    #[test]
    fn picaso_r_is_the_mean_of_caso_over_rotations(ld in log_decays(8)) {
        let a: Vec<f64> = ld.iter().map(|v| v.exp()).collect();
        let want = mean_caso_over(&rotations(a.len()), &a);
        let got = weights(Composition::PicasoR, &ld).unwrap();
        prop_assert!(close(&got, &want, 1e-12), "{got:?} vs {want:?}");
    }

    #[test]
    fn caso_matches_the_product_of_later_decays(ld in log_decays(10)) {
        let a: Vec<f64> = ld.iter().map(|v| v.exp()).collect();
        prop_assert!(close(&weights(Composition::Caso, &ld).unwrap(), &caso_brute(&a), 1e-12));
    }

    #[test]
    fn picaso_s_ignores_order_and_picaso_r_ignores_rotation(ld in log_decays(9), seed in 0usize..1000) {
        let n = ld.len();
        let w = weights(Composition::PicasoS, &ld).unwrap();
        // A pseudo-random permutation from the seed.
        let mut perm: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() { perm.swap(i, (seed * 7919 + i * 31) % (i + 1)); }
        let permuted: Vec<f64> = perm.iter().map(|&i| ld[i]).collect();
        let wp = weights(Composition::PicasoS, &permuted).unwrap();
        for (pos, &i) in perm.iter().enumerate() {
            prop_assert!((wp[pos] - w[i]).abs() <= 1e-12 * (1.0 + w[i]));
        }
        let r = seed % n;
        let rotated: Vec<f64> = (0..n).map(|i| ld[(i + r) % n]).collect();
        let wr = weights(Composition::PicasoR, &rotated).unwrap();
        let w0 = weights(Composition::PicasoR, &ld).unwrap();
        for i in 0..n {
            prop_assert!((wr[i] - w0[(i + r) % n]).abs() <= 1e-12 * (1.0 + w0[i]));
        }
    }

    #[test]
    fn extreme_decays_give_finite_exact_weights(ld in prop::collection::vec(prop_oneof![Just(0.0), Just(-1e4), -1e4..0.0f64, -1.0..0.0f64], 1..=64)) {
        let n = ld.len() as f64;
        for m in Composition::ALL {
            let w = weights(m, &ld).unwrap();
            prop_assert!(w.iter().all(|v| v.is_finite() && *v >= 0.0 && *v <= 1.0 + 1e-12), "{m}: {w:?}");
            // Every method gives the last (or every) context at least the weight 1/n of its own term.
            prop_assert!(w.iter().all(|v| *v >= 1.0 / n - 1e-15) || m == Composition::Caso);
        }
        let a: Vec<f64> = ld.iter().map(|v| v.exp()).collect();
        // PICASO-R against the O(n²) definition in log space.
        let want_r: Vec<f64> = (0..ld.len()).map(|k| {
            let mut s = 0.0; let mut acc = 0.0f64;
            for m in 0..ld.len() { if m > 0 { acc += ld[(k + m) % ld.len()]; } s += acc.exp(); }
            s / n
        }).collect();
        prop_assert!(close(&weights(Composition::PicasoR, &ld).unwrap(), &want_r, 1e-12));
        // PICASO-S against the O(n³) product of prefix and suffix polynomials.
        prop_assert!(close(&weights(Composition::PicasoS, &ld).unwrap(), &picaso_s_cubic(&a), 1e-11));
    }
}

/// PICASO-S by multiplying the leave-one-out polynomial Π_{j≠k}(1 + A_j t) out explicitly.
fn picaso_s_cubic(a: &[f64]) -> Vec<f64> {
    let n = a.len();
    (0..n)
        .map(|k| {
            let mut e = vec![1.0f64];
            for (j, &aj) in a.iter().enumerate() {
                if j == k {
                    continue;
                }
                let mut next = vec![0.0; e.len() + 1];
                for (i, &c) in e.iter().enumerate() {
                    next[i] += c;
                    next[i + 1] += aj * c;
                }
                e = next;
            }
            let mut binom = 1.0f64;
            let mut s = 0.0;
            for (m, &em) in e.iter().enumerate() {
                if m > 0 {
                    binom = binom * (n - m) as f64 / m as f64;
                }
                s += em / binom;
            }
            s / n as f64
        })
        .collect()
}

#[test]
fn one_context_gets_weight_one_and_soup_is_uniform() {
    for m in Composition::ALL {
        assert_eq!(weights(m, &[-3.5]).unwrap(), vec![1.0]);
    }
    assert_eq!(weights(Composition::Soup, &[-1.0, 0.0, -2.0, -9.0]).unwrap(), vec![0.25; 4]);
}

#[test]
fn the_paper_example_by_hand() {
    // Two contexts, decays 0.5 and 0.25: CASO (1 then 2) = [0.25, 1]; all orders = [(0.25+1)/2, (1+0.5)/2].
    let ld = [0.5f64.ln(), 0.25f64.ln()];
    assert!(close(&weights(Composition::Caso, &ld).unwrap(), &[0.25, 1.0], 1e-15));
    assert!(close(&weights(Composition::PicasoS, &ld).unwrap(), &[0.625, 0.75], 1e-15));
    assert!(close(&weights(Composition::PicasoR, &ld).unwrap(), &[0.625, 0.75], 1e-15));
}

#[test]
fn bad_input_is_refused() {
    assert!(weights(Composition::Soup, &[]).unwrap_err().to_string().contains("at least one"));
    assert!(weights(Composition::Caso, &[-1.0, 0.5]).unwrap_err().to_string().contains("<= 0"));
    assert!(weights(Composition::Caso, &[f64::NAN]).is_err());
    assert!("picaso-x".parse::<Composition>().unwrap_err().to_string().contains("picaso-s"));
    let a = [1.0f32; 4];
    assert!(weighted_sum_blocks(&[&a, &a[..3]], &[0.5; 2], 4, &mut [0.0; 4]).is_err());
    assert!(weights_per_element(Composition::Soup, &[&[0.0f32, -1.0][..], &[0.0f32][..]]).is_err());
}

#[test]
fn weighted_sum_applies_each_blocks_weights() {
    let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let y: Vec<f32> = (0..12).map(|i| 100.0 + i as f32).collect();
    // Three blocks of four; weights (block-major) [x, y].
    let w = [1.0, 0.0, 0.5, 0.5, 0.0, 2.0];
    let mut out = vec![0.0; 12];
    weighted_sum_blocks(&[&x, &y], &w, 4, &mut out).unwrap();
    for i in 0..12 {
        let (wx, wy) = (w[2 * (i / 4)], w[2 * (i / 4) + 1]);
        assert_eq!(out[i], wx * x[i] + wy * y[i]);
    }
}

/// Per-value weights (block 1, Mamba-1's per-element decays) over several tasks' worth of
/// values: each output is its own weighted sum, in input order, and a non-finite input is
/// reported.
#[test]
fn weighted_sum_with_a_weight_per_value() {
    let len = 40_000; // more than two 16 Ki-value tasks, and a partial one
    let inputs: Vec<Vec<f32>> =
        (0..3).map(|k| (0..len).map(|i| ((i * (k + 2)) % 97) as f32 - 48.0).collect()).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let w: Vec<f32> = (0..len * 3).map(|j| ((j % 11) as f32) / 7.0).collect();
    let mut out = vec![0.0f32; len];
    weighted_sum_blocks(&refs, &w, 1, &mut out).unwrap();
    for e in (0..len).step_by(997) {
        let want = w[3 * e] * inputs[0][e] + w[3 * e + 1] * inputs[1][e] + w[3 * e + 2] * inputs[2][e];
        assert_eq!(out[e], want, "value {e}");
    }
    let mut bad = inputs[2].clone();
    bad[33_000] = f32::INFINITY;
    let refs = [refs[0], refs[1], &bad[..]];
    assert!(weighted_sum_blocks(&refs, &w, 1, &mut out).unwrap_err().to_string().contains("finite"));
}

/// The fused per-value composition (weights computed in lanes and applied at once) against the
/// two-step path (every weight stored, then summed), for every method, over lengths that end
/// mid-lane and cross tasks; the composed log-decay is the sum of the parts'.
#[test]
fn per_value_composition_equals_stored_weights_then_sum() {
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 40) as f32 / (1u64 << 24) as f32
    };
    for (n, len) in [(1usize, 5usize), (2, 8), (3, 4_101), (10, 9_000)] {
        let ssm: Vec<Vec<f32>> = (0..n).map(|_| (0..len).map(|_| next() * 4.0 - 2.0).collect()).collect();
        // Decays from ~1 to underflow, some exactly 1.
        let ld: Vec<Vec<f32>> = (0..n)
            .map(|_| {
                (0..len)
                    .map(|_| match (next() * 5.0) as u32 {
                        0 => 0.0,
                        1 => -next() * 1e4,
                        _ => -next() * 2.0,
                    })
                    .collect()
            })
            .collect();
        let (ssm, ld): (Vec<&[f32]>, Vec<&[f32]>) =
            (ssm.iter().map(Vec::as_slice).collect(), ld.iter().map(Vec::as_slice).collect());
        for method in [Composition::Soup, Composition::Caso, Composition::PicasoS, Composition::PicasoR] {
            let w = weights_per_element(method, &ld).unwrap();
            let mut want = vec![0.0f32; len];
            weighted_sum_blocks(&ssm, &w, 1, &mut want).unwrap();
            let (mut got, mut got_ld) = (vec![0.0f32; len], vec![0.0f32; len]);
            compose_per_value(method, &ld, &ssm, &mut got, &mut got_ld).unwrap();
            for e in 0..len {
                let scale: f32 = (0..n).map(|i| w[e * n + i].abs() * ssm[i][e].abs()).sum();
                assert!((got[e] - want[e]).abs() <= 4.0 * f32::EPSILON * scale, "{method:?} n={n} value {e}");
                let sum = ld.iter().map(|l| l[e] as f64).sum::<f64>() as f32;
                assert_eq!(got_ld[e], sum, "log-decay of value {e}");
            }
        }
    }
}

/// Bad input to the per-value composition: a positive or NaN log-decay names its context, a
/// non-finite state value is reported, mismatched lengths are refused.
#[test]
fn per_value_composition_refuses_bad_input() {
    let (x, ld) = (vec![1.0f32; 20], vec![-0.5f32; 20]);
    let mut bad_ld = ld.clone();
    bad_ld[13] = 0.25;
    let (mut out, mut out_ld) = (vec![0.0; 20], vec![0.0; 20]);
    let e = compose_per_value(Composition::PicasoR, &[&ld, &bad_ld], &[&x, &x], &mut out, &mut out_ld).unwrap_err();
    assert!(matches!(e, picaso_compose::Error::BadLogDecay { context: 1, .. }), "{e}");
    bad_ld[13] = f32::NAN;
    assert!(compose_per_value(Composition::Soup, &[&bad_ld], &[&x], &mut out, &mut out_ld).is_err());
    let mut bad_x = x.clone();
    bad_x[19] = f32::NAN;
    let e = compose_per_value(Composition::Caso, &[&ld, &ld], &[&x, &bad_x], &mut out, &mut out_ld).unwrap_err();
    assert!(e.to_string().contains("finite"), "{e}");
    assert!(compose_per_value(Composition::Caso, &[&ld], &[&x[..19]], &mut out, &mut out_ld).is_err());
    assert!(compose_per_value(Composition::Caso, &[], &[], &mut out, &mut out_ld).is_err());
}

/// Many contexts: PICASO-S's sums of n! orders stay finite and exact where closed forms exist
/// (its polynomial coefficients once left f64's range from n ≈ 1,030 and f32's far earlier).
/// Equal decays a: every order gives context k the weight a^(position from the end), so both
/// PICASO-S and PICASO-R give (1/n) Σ_{m<n} aᵐ; decays 0 and 1 give 1/n and 1.
#[test]
fn many_contexts_keep_exact_finite_weights() {
    for n in [2, 100, 1037, 1038, 2500] {
        for a in [0.0f64, 0.3, 0.9, 0.999, 1.0] {
            let ld = vec![a.ln(); n];
            let want = if a == 1.0 { 1.0 } else { (1.0 - a.powi(n as i32)) / ((1.0 - a) * n as f64) };
            for m in [Composition::PicasoS, Composition::PicasoR] {
                let w = weights(m, &ld).unwrap();
                let worst = w.iter().map(|v| (v - want).abs() / want).fold(0.0, f64::max);
                assert!(worst < 1e-9, "{m} n={n} a={a}: {worst:e} off {want}");
            }
        }
        // Mixed decays: PICASO-S between the extremes of CASO's weights, summing to Σ_k E[weight].
        let ld: Vec<f64> = (0..n).map(|i| -(((i * 7919) % 13) as f64) * 0.01).collect();
        let w = weights(Composition::PicasoS, &ld).unwrap();
        assert!(w.iter().all(|v| v.is_finite() && *v >= 1.0 / n as f64 - 1e-12 && *v <= 1.0), "n={n}");
    }
    // The per-value (f32) path agrees with the f64 weights at a size where f32 binomials overflow.
    let n = 300;
    let ld: Vec<Vec<f32>> = (0..n).map(|i| (0..16).map(|e| -(((i + 3 * e) % 11) as f32) * 0.02).collect()).collect();
    let x: Vec<Vec<f32>> = (0..n).map(|i| (0..16).map(|e| ((i * 31 + e * 7) % 17) as f32 - 8.0).collect()).collect();
    let (ldr, xr): (Vec<&[f32]>, Vec<&[f32]>) =
        (ld.iter().map(|v| &v[..]).collect(), x.iter().map(|v| &v[..]).collect());
    let (mut out, mut ld_out) = (vec![0.0f32; 16], vec![0.0f32; 16]);
    compose_per_value(Composition::PicasoS, &ldr, &xr, &mut out, &mut ld_out).unwrap();
    for e in 0..16 {
        let w = weights(Composition::PicasoS, &ld.iter().map(|v| v[e] as f64).collect::<Vec<_>>()).unwrap();
        let want: f64 = (0..n).map(|i| w[i] * x[i][e] as f64).sum();
        let scale: f64 = (0..n).map(|i| (w[i] * x[i][e] as f64).abs()).sum();
        assert!((out[e] as f64 - want).abs() <= 1e-4 * scale, "value {e}: {} vs {want}", out[e]);
    }
}
