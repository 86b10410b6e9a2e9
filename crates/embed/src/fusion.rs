//! Hybrid retrieval: reciprocal-rank fusion (Cormack et al., 2009) of ranked lists, e.g. dense
//! and BM25. Each list gives a context `weight / (RRF_K + rank)` (rank from 1); contexts are
//! ranked by the sum. Ranks, not scores, are fused: cosines and BM25 scores live on scales that
//! cannot be added.

/// The constant of reciprocal-rank fusion (60 in the original paper and most engines).
pub const RRF_K: f32 = 60.0;

/// Fuses `lists` (each best first, with its weight) into the best `k`, best first, equal fused
/// scores by lower id. A context absent from a list gets nothing from it.
pub fn reciprocal_rank_fusion(lists: &[(&[(i64, f32)], f32)], k: usize) -> Vec<(i64, f32)> {
    let mut fused: std::collections::HashMap<i64, f32> = std::collections::HashMap::new();
    for (list, weight) in lists {
        for (rank, (id, _)) in list.iter().enumerate() {
            *fused.entry(*id).or_default() += weight / (RRF_K + rank as f32 + 1.0);
        }
    }
    let mut hits: Vec<(i64, f32)> = fused.into_iter().filter(|(_, s)| *s > 0.0).collect();
    hits.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    hits.truncate(k);
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fusion_ranks_by_weighted_reciprocal_ranks() {
        let dense = [(1, 0.9), (2, 0.8), (3, 0.7)];
        let lexical = [(3, 12.0), (4, 9.0)];
        // Equal weights: 3 is in both lists, so it wins; 1 (rank 1 once) beats 4 (rank 2 once).
        let both = reciprocal_rank_fusion(&[(&dense, 0.5), (&lexical, 0.5)], 10);
        assert_eq!(both.iter().map(|h| h.0).collect::<Vec<_>>(), [3, 1, 2, 4]);
        let want3 = 0.5 / 63.0 + 0.5 / 61.0;
        assert!((both[0].1 - want3).abs() < 1e-7);
        // All weight on one list: its order, the other list's contexts dropped.
        let dense_only = reciprocal_rank_fusion(&[(&dense, 1.0), (&lexical, 0.0)], 10);
        assert_eq!(dense_only.iter().map(|h| h.0).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(reciprocal_rank_fusion(&[(&dense, 0.5), (&lexical, 0.5)], 2).len(), 2);
        // Ties by lower id.
        let tie = reciprocal_rank_fusion(&[(&[(7, 1.0)], 0.5), (&[(5, 1.0)], 0.5)], 2);
        assert_eq!(tie.iter().map(|h| h.0).collect::<Vec<_>>(), [5, 7]);
    }
}
