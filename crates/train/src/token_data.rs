//! The token streams pretraining reads besides the corpora's text: a cache of the tokenized
//! corpora (so a resumed run skips minutes of tokenizing), a given stream of ids
//! (`--train-stream`, e.g. in-context pretraining's reordered documents), and the held-out
//! paragraph pairs of the context-use check.

use std::path::Path;

use picaso_model::TextTokenizer;

use crate::pretrain::{ContextPair, TokenData};
use crate::Result;

macro_rules! msg {
    ($($t:tt)*) => {
        candle_core::Error::Msg(format!($($t)*))
    };
}

/// A `--train-stream` file's token ids (u16 or u32 by its extension), checked against the
/// vocabulary, and its fingerprint.
pub fn read_train_stream(path: &Path, vocab: usize) -> Result<(Vec<u32>, String)> {
    let width = match path.extension().and_then(|e| e.to_str()) {
        Some("u16") => 2,
        Some("u32") => 4,
        _ => {
            return Err(msg!(
                "{}: name the id width in the extension, .u16 or .u32 (little-endian token ids)",
                path.display()
            ))
        }
    };
    let bytes = std::fs::read(path).map_err(|e| msg!("reading {}: {e}", path.display()))?;
    if bytes.len() % width != 0 {
        return Err(msg!(
            "{}: {} bytes is not a whole number of {width}-byte ids; is it a .u{} file?",
            path.display(),
            bytes.len(),
            8 * width
        ));
    }
    let ids: Vec<u32> = if width == 2 {
        bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]) as u32).collect()
    } else {
        bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        return Err(msg!(
            "{}: token {i} is id {id}, outside the tokenizer's {vocab} entries; make the stream with the run's tokenizer (--tokenizer)",
            path.display()
        ));
    }
    Ok((ids, format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes))))
}

/// The token streams cached under `key`, if the file holds them.
pub fn read_token_cache(path: &Path, key: &str) -> Option<TokenData> {
    let bytes = std::fs::read(path).ok()?;
    let header_len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(bytes.get(8..8 + header_len)?).ok()?;
    if header["key"] != key {
        return None;
    }
    let body = bytes.get(8 + header_len..)?;
    let ids: Vec<u32> = body.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let mut at = 0;
    let mut take = |n: usize| -> Option<Vec<u32>> {
        let v = ids.get(at..at + n)?.to_vec();
        at += n;
        Some(v)
    };
    let train = take(header["train"].as_u64()? as usize)?;
    let val = take(header["val"].as_u64()? as usize)?;
    let mut pairs = Vec::new();
    for p in header["pairs"].as_array()? {
        let n = |i: usize| p.get(i).and_then(|v| v.as_u64()).map(|v| v as usize);
        pairs.push(ContextPair {
            previous: take(n(0)?)?,
            random: take(n(1)?)?,
            query: take(n(2)?)?,
            continuation: take(n(3)?)?,
        });
    }
    Some(TokenData { train, val, pairs, ..Default::default() })
}

/// Writes the token streams under `key` (aside, then renamed).
pub fn write_token_cache(path: &Path, key: &str, data: &TokenData) -> std::io::Result<()> {
    let pairs: Vec<[usize; 4]> =
        data.pairs.iter().map(|p| [p.previous.len(), p.random.len(), p.query.len(), p.continuation.len()]).collect();
    let header = serde_json::to_vec(&serde_json::json!({
        "key": key, "train": data.train.len(), "val": data.val.len(), "pairs": pairs,
    }))
    .map_err(std::io::Error::other)?;
    let mut out = Vec::with_capacity(8 + header.len() + 4 * (data.train.len() + data.val.len()));
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    let all = data.train.iter().chain(&data.val).chain(
        data.pairs.iter().flat_map(|p| p.previous.iter().chain(&p.random).chain(&p.query).chain(&p.continuation)),
    );
    for id in all {
        out.extend_from_slice(&id.to_le_bytes());
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, &out)?;
    std::fs::rename(&tmp, path)
}

/// Up to `n` held-out paragraph pairs (consecutive paragraphs of one held-out document, the
/// second of at least 16 tokens), spread evenly, each with a paragraph of another held-out
/// document as the control. Paragraphs are tokenized as they appear in the stream, followed
/// by their blank line.
pub fn context_pairs(
    tokenizer: &TextTokenizer,
    docs: &[String],
    held_out: &[usize],
    n: usize,
    seed: u64,
) -> Result<Vec<ContextPair>> {
    use rand::{Rng, SeedableRng};
    if n == 0 {
        return Ok(Vec::new());
    }
    let encode = |p: &str| -> Result<Vec<u32>> {
        Ok(tokenizer.inner().encode(format!("{p}\n\n"), false).map_err(|e| msg!("tokenizing: {e}"))?.get_ids().to_vec())
    };
    let paragraphs: Vec<Vec<&str>> = held_out.iter().map(|&i| crate::corpus::prose_paragraphs(&docs[i])).collect();
    let mut candidates = Vec::new();
    for (d, ps) in paragraphs.iter().enumerate() {
        for j in 1..ps.len() {
            candidates.push((d, j));
        }
    }
    let with_text: Vec<usize> = (0..paragraphs.len()).filter(|&d| !paragraphs[d].is_empty()).collect();
    if with_text.len() < 2 || candidates.is_empty() {
        return Ok(Vec::new());
    }
    let stride = (candidates.len() as f64 / n as f64).max(1.0);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xc0de);
    let mut pairs = Vec::new();
    let mut at = 0.0;
    while (at as usize) < candidates.len() && pairs.len() < n {
        let (d, j) = candidates[at as usize];
        at += stride;
        let cur = encode(paragraphs[d][j])?;
        if cur.len() < 16 {
            continue;
        }
        let other = loop {
            let o = with_text[rng.random_range(0..with_text.len())];
            if o != d {
                break o;
            }
        };
        let random = encode(paragraphs[other][rng.random_range(0..paragraphs[other].len())])?;
        let half = cur.len() / 2;
        pairs.push(ContextPair {
            previous: encode(paragraphs[d][j - 1])?,
            random,
            query: cur[..half].to_vec(),
            continuation: cur[half..].to_vec(),
        });
    }
    Ok(pairs)
}
