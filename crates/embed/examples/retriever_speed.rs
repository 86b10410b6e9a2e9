//! Time per query of each retriever at 100k contexts: embedding the query (MiniLM, mpnet) plus
//! searching (exact dense top-k over 100k vectors, BM25 over 100k texts, and their fusion).
//!
//! The 100k texts are WikiText-2 test paragraphs cut into 60-word windows, each with a few
//! words dropped at random so that no two are equal; the vectors are random unit vectors
//! (embedding 100k texts with mpnet would take hours here, and search time does not depend on
//! the values). Queries are 50 other windows.
//!
//! `cargo run --release -p picaso-embed --example retriever_speed -- WIKITEXT MINILM_DIR [MPNET_DIR] [N]`

use std::time::Instant;

use picaso_embed::{reciprocal_rank_fusion, Bm25Index, Embedder, FlatIndex, VectorIndex};
use rand::{Rng, SeedableRng};

const QUERIES: usize = 50;
const K: usize = 10;
const DEPTH: usize = 50;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        return Err("usage: retriever_speed WIKITEXT MINILM_DIR [MPNET_DIR] [N]".into());
    }
    let n: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(100_000);
    let words: Vec<String> = std::fs::read_to_string(&args[1])?.split_whitespace().map(str::to_string).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let window = |rng: &mut rand::rngs::StdRng| -> String {
        let start = rng.random_range(0..words.len() - 60);
        words[start..start + 60].iter().filter(|_| rng.random::<f32>() > 0.1).cloned().collect::<Vec<_>>().join(" ")
    };
    let texts: Vec<String> = (0..n).map(|_| window(&mut rng)).collect();
    let queries: Vec<String> = (0..QUERIES).map(|_| window(&mut rng)).collect();

    let t0 = Instant::now();
    let mut bm25 = Bm25Index::new();
    for (i, t) in texts.iter().enumerate() {
        bm25.add(i as i64, t);
    }
    let build = t0.elapsed().as_secs_f64();
    let bm25_ms = per_query(&queries, |q| {
        std::hint::black_box(bm25.search(q, DEPTH, None));
    });

    let mut out = serde_json::json!({
        "contexts": n, "queries": QUERIES, "k": K, "fusion_depth": DEPTH,
        "bm25": {"build_seconds": build, "search_ms": bm25_ms, "embed_ms": 0.0, "total_ms": bm25_ms},
    });
    let encoders: Vec<(&str, &String)> =
        [("minilm", args.get(2)), ("mpnet", args.get(3))].into_iter().filter_map(|(n, d)| d.map(|d| (n, d))).collect();
    for (name, dir) in encoders {
        let embedder = Embedder::load(dir.as_ref(), &candle_core::Device::Cpu)?;
        let dim = embedder.dim();
        let mut flat = Vec::with_capacity(n * dim);
        for _ in 0..n {
            let mut v: Vec<f32> = (0..dim).map(|_| rng.random::<f32>() - 0.5).collect();
            picaso_embed::l2_normalize(&mut v);
            flat.extend(v);
        }
        let index = FlatIndex::from_flat(dim, flat)?;
        embedder.embed_one("warm up")?;
        let vectors: Vec<Vec<f32>> = queries.iter().map(|q| embedder.embed_one(q)).collect::<Result<_, _>>()?;
        let embed_ms = per_query(&queries, |q| {
            std::hint::black_box(embedder.embed_one(q).unwrap());
        });
        let mut i = 0;
        let dense_ms = per_query(&queries, |_| {
            std::hint::black_box(index.search(&vectors[i % QUERIES], K).unwrap());
            i += 1;
        });
        let mut i = 0;
        let fuse_ms = per_query(&queries, |q| {
            let dense: Vec<(i64, f32)> =
                index.search(&vectors[i % QUERIES], DEPTH).unwrap().into_iter().map(|(r, s)| (r as i64, s)).collect();
            let lexical = bm25.search(q, DEPTH, None);
            std::hint::black_box(reciprocal_rank_fusion(&[(&dense, 0.5), (&lexical, 0.5)], K));
            i += 1;
        });
        out[name] = serde_json::json!({
            "dim": dim,
            "embed_ms": embed_ms,
            "dense_search_ms": dense_ms,
            "dense_total_ms": embed_ms + dense_ms,
            "hybrid_search_ms": fuse_ms,
            "hybrid_total_ms": embed_ms + fuse_ms,
        });
        eprintln!("{name}: embed {embed_ms:.1} ms, dense search {dense_ms:.2} ms, hybrid search {fuse_ms:.2} ms");
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// Mean milliseconds of `f` over the queries (each run once, after one untimed run).
fn per_query(queries: &[String], mut f: impl FnMut(&str)) -> f64 {
    f(&queries[0]);
    let t0 = Instant::now();
    for q in queries {
        f(q);
    }
    1e3 * t0.elapsed().as_secs_f64() / queries.len() as f64
}
