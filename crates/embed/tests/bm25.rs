//! BM25: the formula on a hand-checked corpus, adds and removes (with compaction) agreeing with
//! an index built from scratch, and scoped search.

use picaso_embed::bm25::{terms, Bm25Index, B, K1};

#[test]
fn terms_lowercase_split_and_drop_stop_words() {
    assert_eq!(terms("The Eiffel Tower, in PARIS (1889)!"), ["eiffel", "tower", "paris", "1889"]);
    assert_eq!(terms("don't a 7 b C d3 Ünïcode-ok"), ["don", "7", "d3", "ünïcode", "ok"]);
    assert!(terms("").is_empty() && terms(" @-@ , . ").is_empty());
}

#[test]
fn scores_follow_lucene_bm25() {
    let docs = ["cat sat mat", "cat cat dog", "bird flew far away home"];
    let mut index = Bm25Index::new();
    for (i, d) in docs.iter().enumerate() {
        index.add(i as i64 + 10, d);
    }
    let hits = index.search("cat", 10, None);
    // By hand: N = 3, df(cat) = 2, avg length 11/3.
    let idf = (1.0f32 + (3.0 - 2.0 + 0.5) / (2.0 + 0.5)).ln();
    let avg = 11.0f32 / 3.0;
    let score = |tf: f32, len: f32| idf * tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * len / avg));
    assert_eq!(hits.len(), 2, "the bird text has no query term");
    assert_eq!(hits[0].0, 11);
    assert!((hits[0].1 - score(2.0, 3.0)).abs() < 1e-6);
    assert!((hits[1].1 - score(1.0, 3.0)).abs() < 1e-6);
    // Repeated query terms count once; stop words and unknown terms add nothing.
    assert_eq!(index.search("the cat cat zebra", 10, None), hits);
    assert!(index.search("the of", 10, None).is_empty());
    assert_eq!(index.search("cat", 1, None), hits[..1]);
    assert_eq!(index.search("cat", 10, Some(&[10, 12])), [hits[1]]);
}

#[test]
fn updates_equal_a_fresh_build() {
    let words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"];
    let text = |i: usize| (0..1 + i % 5).map(|j| words[(i * 7 + j * 3) % words.len()]).collect::<Vec<_>>().join(" ");
    let mut index = Bm25Index::new();
    for i in 0..3000 {
        index.add(i as i64, &text(i));
    }
    // Remove two thirds (compaction runs), re-add some with new text.
    for i in (0..3000).filter(|i| i % 3 != 0) {
        assert!(index.remove(i as i64));
    }
    assert!(!index.remove(1));
    for i in (1..300).step_by(3) {
        index.add(i as i64, "omega alpha");
    }
    let mut fresh = Bm25Index::new();
    for i in (0..3000).filter(|i| i % 3 == 0) {
        fresh.add(i as i64, &text(i));
    }
    for i in (1..300).step_by(3) {
        fresh.add(i as i64, "omega alpha");
    }
    assert_eq!(index.len(), fresh.len());
    for q in ["alpha", "beta gamma", "omega", "theta zeta eta", "nothing"] {
        let (a, b) = (index.search(q, 50, None), fresh.search(q, 50, None));
        assert_eq!(a.len(), b.len(), "{q}");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!(x.0, y.0, "{q}");
            assert!((x.1 - y.1).abs() < 1e-5, "{q}");
        }
    }
}
