//! Embedding throughput on CPU: 64 short sentences per call, and one sentence alone.
//!
//! `cargo run --release -p picaso-embed --example embed_speed -- [MODEL_DIR]`
//! (default: the shared all-MiniLM-L6-v2 folder beside the checkout).

use std::path::PathBuf;
use std::time::Instant;

use candle_core::Device;
use picaso_embed::Embedder;

const SUBJECTS: [&str; 8] = [
    "The cat",
    "A young engineer",
    "The old bridge",
    "My neighbour",
    "The state-space model",
    "A small boat",
    "The committee",
    "Every student",
];
const PREDICATES: [&str; 8] = [
    "sat quietly on the warm mat.",
    "fixed the bug before lunch.",
    "was finished in 1889.",
    "plays the violin every evening.",
    "reads a long document only once.",
    "drifted slowly towards the harbour.",
    "approved the new budget on Friday.",
    "asked a difficult question about Paris.",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/all-MiniLM-L6-v2"));
    let t = Instant::now();
    let embedder = Embedder::load(&dir, &Device::Cpu)?;
    println!("loaded {} in {:.2} s", dir.display(), t.elapsed().as_secs_f64());

    let sentences: Vec<String> =
        SUBJECTS.iter().flat_map(|s| PREDICATES.iter().map(move |p| format!("{s} {p}"))).collect();
    let texts: Vec<&str> = sentences.iter().map(String::as_str).collect();
    let tokens: usize = embedder.tokenize(&texts)?.iter().map(Vec::len).sum();
    embedder.embed(&texts)?; // warm-up

    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(embedder.embed(&texts)?);
    }
    let secs = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{} sentences ({:.1} tokens each with [CLS]/[SEP]): {:.1} ms per call, {:.0} sentences/s, {} threads",
        texts.len(),
        tokens as f64 / texts.len() as f64,
        secs * 1e3,
        texts.len() as f64 / secs,
        rayon::current_num_threads()
    );

    let t = Instant::now();
    for s in texts.iter().take(16) {
        std::hint::black_box(embedder.embed_one(s)?);
    }
    println!("one sentence alone: {:.2} ms", t.elapsed().as_secs_f64() / 16.0 * 1e3);
    Ok(())
}
