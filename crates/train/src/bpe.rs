//! A small byte-level BPE tokenizer trained on the pretraining corpus with the `tokenizers`
//! crate: for a model of a few million parameters, a 50k-entry vocabulary (GPT-NeoX) would put
//! most parameters in the embedding; a corpus-fitted vocabulary of a few thousand keeps them in
//! the layers. Saved as a standard `tokenizer.json`.

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// The end-of-text token (id 0), placed between documents.
pub const EOS: &str = "<|endoftext|>";

/// Trains a byte-level BPE of `vocab_size` entries (EOS included) on `docs`.
pub fn train_bpe(docs: &[String], vocab_size: usize) -> Result<Tokenizer, String> {
    if vocab_size < 300 {
        return Err(format!(
            "vocabulary of {vocab_size}: a byte-level BPE needs at least 300 entries (256 bytes + merges)"
        ));
    }
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(EOS, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer.train(&mut trainer, docs.iter()).map_err(|e| format!("training the tokenizer: {e}"))?;
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trains_a_round_tripping_vocabulary_with_eos_first() {
        let docs: Vec<String> = (0..200)
            .map(|i| format!("The river {i} runs to the sea, and the sea runs to the river. Café ünïcode {i}"))
            .collect();
        let tok = train_bpe(&docs, 400).unwrap();
        assert_eq!(tok.token_to_id(EOS), Some(0));
        assert!(tok.get_vocab_size(true) <= 400);
        let text = "The river runs to the café: ünïcode 42 ✓";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() < text.len(), "merges compress");
        assert_eq!(tok.decode(&ids, true).unwrap(), text, "byte-level BPE round-trips any text");
        assert!(train_bpe(&docs, 100).is_err());
    }
}
