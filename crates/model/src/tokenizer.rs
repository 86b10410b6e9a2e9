//! Text ↔ token ids through a HF `tokenizer.json` (GPT-NeoX for state-spaces Mamba models).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A loaded `tokenizer.json`.
#[derive(Debug, Clone)]
pub struct TextTokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    eos: Option<u32>,
    /// `get_vocab_size(true)`, counted once: it builds the whole vocabulary as a map each call
    /// (3% of a 16-client server's time when every request asked).
    vocab_size: usize,
}

impl TextTokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        if !path.is_file() {
            return Err(Error::Tokenizer { path: path.to_path_buf(), message: "file not found".into() });
        }
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::Tokenizer { path: path.to_path_buf(), message: e.to_string() })?;
        let eos = ["<|endoftext|>", "</s>", "<eos>"].iter().find_map(|t| inner.token_to_id(t));
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self { path: path.to_path_buf(), inner, eos, vocab_size })
    }

    /// Token ids of `text`, without special tokens (Mamba models use no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer { path: self.path.clone(), message: e.to_string() })
    }

    /// Text of `ids`, skipping special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| Error::Tokenizer { path: self.path.clone(), message: e.to_string() })
    }

    /// The end-of-text token, if the vocabulary has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Number of ids the tokenizer can produce (the model may pad its embedding beyond it).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The underlying tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
