//! `FlatIndex` against a brute-force full sort, on small random cases (proptest, with many
//! exact ties) and on indexes large enough to take the parallel path.

use picaso_embed::{dot, Error, FlatIndex, VectorIndex};
use proptest::prelude::*;

/// Every (id, score), sorted by score descending then id ascending, cut to k.
fn brute_force(data: &[f32], dim: usize, query: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut all: Vec<(usize, f32)> = data.chunks_exact(dim).map(|r| dot(r, query)).enumerate().collect();
    all.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
    all.truncate(k);
    all
}

/// Values from a small grid so that equal scores (ties) are common.
fn grid_matrix(rows: usize, dim: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..rows * dim)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 59) as f32 - 16.0) / 8.0
        })
        .collect()
}

fn case() -> impl Strategy<Value = (usize, Vec<f32>, Vec<f32>, usize)> {
    (1usize..40, 0usize..120, any::<bool>()).prop_flat_map(|(dim, n, coarse)| {
        let value = if coarse {
            prop_oneof![Just(-0.5f32), Just(0.0), Just(0.5), Just(1.0)].boxed()
        } else {
            (-1f32..1f32).boxed()
        };
        (Just(dim), prop::collection::vec(value.clone(), n * dim), prop::collection::vec(value, dim), 0usize..n + 5)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn search_equals_brute_force((dim, data, query, k) in case()) {
        let index = FlatIndex::from_flat(dim, data.clone()).unwrap();
        let got = index.search(&query, k).unwrap();
        prop_assert_eq!(&got, &brute_force(&data, dim, &query, k));
        for &(id, score) in &got {
            let naive: f64 = data[id * dim..(id + 1) * dim].iter().zip(&query).map(|(&a, &b)| a as f64 * b as f64).sum();
            prop_assert!((score as f64 - naive).abs() < 1e-4);
        }
        let batch = index.search_batch(&[query.clone(), query.clone()].concat(), k).unwrap();
        prop_assert_eq!(&batch[0], &got);
        prop_assert_eq!(&batch[1], &got);
    }

    /// A search among some ids is the full ranking with the others left out.
    #[test]
    fn search_among_is_the_full_ranking_of_those_ids((dim, data, query, k) in case(), pick in any::<u64>()) {
        let index = FlatIndex::from_flat(dim, data.clone()).unwrap();
        let n = data.len() / dim;
        let ids: Vec<usize> = (0..n).filter(|i| pick >> (i % 64) & 1 == 1).collect();
        let want: Vec<(usize, f32)> =
            brute_force(&data, dim, &query, n).into_iter().filter(|(id, _)| ids.contains(id)).take(k).collect();
        prop_assert_eq!(index.search_among(&query, k, &ids).unwrap(), want);
    }
}

#[test]
fn search_among_refuses_an_id_it_does_not_hold() {
    let index = FlatIndex::from_flat(2, vec![1.0, 0.0, 0.0, 1.0]).unwrap();
    assert_eq!(index.search_among(&[1.0, 0.5], 5, &[1]).unwrap(), vec![(1, 0.5)]);
    assert!(matches!(index.search_among(&[1.0, 0.5], 1, &[0, 2]), Err(Error::Input(_))));
    assert!(matches!(index.search_among(&[1.0], 1, &[0]), Err(Error::Input(_))), "a query of the wrong size");
}

#[test]
fn parallel_path_equals_brute_force() {
    for (rows, dim, seed) in [(10_000, 24, 1), (9_001, 33, 2), (4_096, 384, 3)] {
        let data = grid_matrix(rows, dim, seed);
        let index = FlatIndex::from_flat(dim, data.clone()).unwrap();
        let queries = grid_matrix(3, dim, seed + 100);
        let batch = index.search_batch(&queries, 50).unwrap();
        for (q, b) in queries.chunks_exact(dim).zip(&batch) {
            for k in [1, 7, 50, 1000] {
                let want = brute_force(&data, dim, q, k);
                assert_eq!(index.search(q, k).unwrap(), want, "rows {rows} dim {dim} k {k}");
                // Among two rows of three, in chunks on both threads, as a filter picks them.
                let among: Vec<usize> = (0..rows).filter(|i| i % 3 != 1).collect();
                let want_among: Vec<(usize, f32)> =
                    brute_force(&data, dim, q, rows).into_iter().filter(|(id, _)| id % 3 != 1).take(k).collect();
                assert_eq!(index.search_among(q, k, &among).unwrap(), want_among, "among, rows {rows} dim {dim} k {k}");
                if k == 50 {
                    assert_eq!(b, &want);
                }
            }
            // Ties are present, so the id order is really being tested.
            let want = brute_force(&data, dim, q, 1000);
            assert!(want.windows(2).any(|w| w[0].1 == w[1].1));
        }
    }
}

#[test]
fn add_len_and_vectors() {
    let mut index = FlatIndex::new(3).unwrap();
    assert!(index.is_empty());
    assert_eq!(index.search(&[1.0, 0.0, 0.0], 5).unwrap(), vec![]);
    assert_eq!(index.add(&[1.0, 0.0, 0.0]).unwrap(), 0);
    assert_eq!(index.add(&[0.0, 1.0, 0.0]).unwrap(), 1);
    assert_eq!(index.extend_from_flat(&[0.0, 0.0, 1.0, 0.6, 0.8, 0.0]).unwrap(), 2);
    assert_eq!(index.len(), 4);
    assert_eq!(index.vector(3), Some(&[0.6, 0.8, 0.0][..]));
    assert_eq!(index.vector(4), None);
    assert_eq!(index.search(&[0.0, 1.0, 0.0], 2).unwrap(), vec![(1, 1.0), (3, 0.8)]);
    assert_eq!(index.search(&[0.0, 1.0, 0.0], 0).unwrap(), vec![]);
    assert_eq!(index.search(&[0.0, 1.0, 0.0], 99).unwrap().len(), 4);
}

#[test]
fn bad_input_is_an_error() {
    assert!(matches!(FlatIndex::new(0), Err(Error::Input(_))));
    assert!(matches!(FlatIndex::from_flat(3, vec![0.0; 4]), Err(Error::Input(_))));
    let mut index = FlatIndex::new(2).unwrap();
    assert!(matches!(index.add(&[1.0]), Err(Error::Input(m)) if m.contains("length 1")));
    assert!(matches!(index.add(&[1.0, f32::NAN]), Err(Error::Input(m)) if m.contains("not finite")));
    assert!(
        matches!(index.extend_from_flat(&[1.0, 0.0, f32::INFINITY, 0.0]), Err(Error::Input(m)) if m.contains("row 1"))
    );
    assert!(index.is_empty(), "nothing added by a failed extend");
    index.add(&[1.0, 0.0]).unwrap();
    assert!(matches!(index.search(&[1.0, 0.0, 0.0], 1), Err(Error::Input(m)) if m.contains("dimension 2")));
    assert!(matches!(index.search(&[f32::NAN, 0.0], 1), Err(Error::Input(_))));
    assert!(matches!(index.search_batch(&[1.0, 0.0, 1.0], 1), Err(Error::Input(_))));
    assert!(index.search_batch(&[], 1).unwrap().is_empty());
}

#[test]
fn usable_as_a_trait_object() {
    let mut index: Box<dyn VectorIndex> = Box::new(FlatIndex::new(2).unwrap());
    index.add(&[0.0, 1.0]).unwrap();
    index.add(&[1.0, 0.0]).unwrap();
    assert_eq!(index.search(&[1.0, 0.0], 1).unwrap(), vec![(1, 1.0)]);
    assert_eq!(index.search_batch(&[1.0, 0.0, 0.0, 1.0], 1).unwrap(), vec![vec![(1, 1.0)], vec![(0, 1.0)]]);
}

#[test]
fn remove_rows_keeps_the_others_in_order() {
    let dim = 3;
    let data = grid_matrix(20, dim, 9);
    for rows in [vec![], vec![0], vec![19], vec![3, 4, 5, 11], vec![0, 2, 19], (0..20).collect::<Vec<_>>()] {
        let mut index = FlatIndex::from_flat(dim, data.clone()).unwrap();
        index.remove_rows(&rows).unwrap();
        let want: Vec<f32> = data
            .chunks_exact(dim)
            .enumerate()
            .filter(|(i, _)| !rows.contains(i))
            .flat_map(|(_, r)| r.to_vec())
            .collect();
        assert_eq!(index.as_flat(), &want[..], "{rows:?}");
    }
    let mut index = FlatIndex::from_flat(dim, data.clone()).unwrap();
    assert!(matches!(index.remove_rows(&[4, 4]), Err(Error::Input(_))));
    assert!(matches!(index.remove_rows(&[5, 2]), Err(Error::Input(_))));
    assert!(matches!(index.remove_rows(&[1, 20]), Err(Error::Input(_))));
    assert_eq!(index.as_flat(), &data[..], "a refused removal removes nothing");
}
