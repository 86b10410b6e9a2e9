//! Composition read straight from compressed states equals composition of the same states
//! dequantized first (within 1e-6 of the result's scale), for every codec, method and layout:
//! blocks that are and are not whole groups, tails shorter than a group, per-value decays.

use picaso_compose::codec::{encode, Encoded};
use picaso_compose::{
    compose_per_value, compose_per_value_values, mean_values, weighted_sum_blocks, weighted_sum_values, Codec,
    Composition, Values,
};
use proptest::prelude::*;

/// f32 bytes in a 4-byte aligned buffer (a state file maps them aligned).
fn aligned(e: &Encoded) -> Vec<f32> {
    let mut v = vec![0.0f32; e.values.len().div_ceil(4)];
    // SAFETY: copying e.values.len() bytes into a buffer at least that long.
    unsafe { std::ptr::copy_nonoverlapping(e.values.as_ptr(), v.as_mut_ptr().cast::<u8>(), e.values.len()) };
    v
}

fn view<'a>(codec: Codec, e: &'a Encoded, f32s: &'a [f32], len: usize) -> Values<'a> {
    let bytes = match codec {
        // SAFETY: the Vec<f32>'s own bytes, borrowed with it.
        Codec::F32 => unsafe { std::slice::from_raw_parts(f32s.as_ptr().cast::<u8>(), 4 * len) },
        _ => &e.values[..],
    };
    Values::from_bytes(codec, bytes, &e.scales, len).expect("sizes fit")
}

fn close(got: &[f32], want: &[f32]) -> Result<(), TestCaseError> {
    let scale = want.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        prop_assert!((g - w).abs() <= 1e-6 * scale, "value {i}: {g} against {w} (scale {scale})");
    }
    Ok(())
}

fn states(n: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut s = seed.wrapping_add(1);
    (0..n)
        .map(|_| {
            (0..len)
                .map(|i| {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 10f32.powi((i / 7 % 5) as i32 - 2)
                })
                .collect()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn block_weighted_sums_of_compressed_states_equal_those_of_their_dequantized_values(
        n in 1usize..6, blocks in 1usize..9, block in prop::sample::select(vec![1usize, 5, 16, 32, 48, 64, 96, 2048]),
        seed in any::<u64>(), codec in prop::sample::select(Codec::ALL.to_vec()),
    ) {
        let len = blocks * block;
        let xs = states(n, len, seed);
        let encoded: Vec<Encoded> = xs.iter().map(|x| encode(x, codec).unwrap()).collect();
        let f32s: Vec<Vec<f32>> = encoded.iter().map(aligned).collect();
        let views: Vec<Values<'_>> = encoded.iter().zip(&f32s).map(|(e, f)| view(codec, e, f, len)).collect();
        let dequantized: Vec<Vec<f32>> = views.iter().map(Values::to_vec).collect();
        let w: Vec<f32> = (0..blocks * n).map(|i| ((i * 37 % 11) as f32 + 1.0) / 11.0).collect();
        let mut got = vec![0.0; len];
        weighted_sum_values(&views, &w, block, &mut got).unwrap();
        let mut want = vec![0.0; len];
        let refs: Vec<&[f32]> = dequantized.iter().map(|v| &v[..]).collect();
        weighted_sum_blocks(&refs, &w, block, &mut want).unwrap();
        close(&got, &want)?;
        let mut mean = vec![0.0; len];
        mean_values(&views, &mut mean).unwrap();
        let mut want_mean = vec![0.0; len];
        weighted_sum_blocks(&refs, &vec![1.0 / n as f32; n], len, &mut want_mean).unwrap();
        close(&mean, &want_mean)?;
    }

    #[test]
    fn per_value_composition_of_compressed_states_equals_that_of_their_dequantized_values(
        n in 1usize..6, len in 1usize..300, seed in any::<u64>(),
        codec in prop::sample::select(Codec::ALL.to_vec()),
        method in prop::sample::select(vec![Composition::Soup, Composition::Caso, Composition::PicasoS, Composition::PicasoR]),
    ) {
        let xs = states(n, len, seed);
        let ld: Vec<Vec<f32>> = states(n, len, seed ^ 1).into_iter().map(|v| v.iter().map(|x| -x.abs()).collect()).collect();
        let lds: Vec<&[f32]> = ld.iter().map(|v| &v[..]).collect();
        let encoded: Vec<Encoded> = xs.iter().map(|x| encode(x, codec).unwrap()).collect();
        let f32s: Vec<Vec<f32>> = encoded.iter().map(aligned).collect();
        let views: Vec<Values<'_>> = encoded.iter().zip(&f32s).map(|(e, f)| view(codec, e, f, len)).collect();
        let dequantized: Vec<Vec<f32>> = views.iter().map(Values::to_vec).collect();
        let refs: Vec<&[f32]> = dequantized.iter().map(|v| &v[..]).collect();
        let (mut got, mut got_ld) = (vec![0.0; len], vec![0.0; len]);
        compose_per_value_values(method, &lds, &views, &mut got, &mut got_ld).unwrap();
        let (mut want, mut want_ld) = (vec![0.0; len], vec![0.0; len]);
        compose_per_value(method, &lds, &refs, &mut want, &mut want_ld).unwrap();
        close(&got, &want)?;
        prop_assert_eq!(got_ld, want_ld);
    }
}

#[test]
fn a_compressed_input_of_the_wrong_length_is_refused() {
    let e = encode(&[1.0; 40], Codec::Int8).unwrap();
    let v = Values::from_bytes(Codec::Int8, &e.values, &e.scales, 40).unwrap();
    let mut out = vec![0.0; 32];
    let err = weighted_sum_values(&[v], &[1.0], 32, &mut out).unwrap_err();
    assert!(err.to_string().contains("40 values"), "{err}");
}

#[test]
fn a_non_finite_scale_is_found() {
    let mut e = encode(&[1.0; 32], Codec::Int4).unwrap();
    e.scales = vec![0x80, 0x7f]; // bf16 +inf
    let v = Values::from_bytes(Codec::Int4, &e.values, &e.scales, 32).unwrap();
    assert_eq!(v.first_non_finite(), Some(0));
    let mut out = vec![0.0; 32];
    assert!(weighted_sum_values(&[v], &[1.0], 32, &mut out).is_err());
}
