//! Embeds the texts of a JSON list with a sentence-transformers folder and prints
//! `{"fingerprint", "dim", "max_tokens", "embeddings": [[...]]}` — what
//! `scripts/check_mpnet.py` compares with sentence-transformers.
//!
//! `cargo run --release -p picaso-embed --example embed_json -- MODEL_DIR TEXTS.json`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, model, texts] = &args[..] else {
        return Err("usage: embed_json MODEL_DIR TEXTS.json".into());
    };
    let texts: Vec<String> = serde_json::from_str(&std::fs::read_to_string(texts)?)?;
    let embedder = picaso_embed::Embedder::load(model.as_ref(), &candle_core::Device::Cpu)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let t0 = std::time::Instant::now();
    let embeddings = embedder.embed(&refs)?;
    let out = serde_json::json!({
        "fingerprint": embedder.fingerprint(),
        "dim": embedder.dim(),
        "max_tokens": embedder.max_tokens(),
        "seconds": t0.elapsed().as_secs_f64(),
        "embeddings": embeddings,
    });
    println!("{out}");
    Ok(())
}
