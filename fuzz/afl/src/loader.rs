//! AFL++ target: the model loader. The first input byte picks the file the rest replaces in a
//! valid tiny Mamba-2 checkpoint: even, `config.json`; odd, `model.safetensors`. Loading must
//! return a model or an error, never panic or allocate from an absurd size; a model that loads
//! must score tokens.

use picaso_model::{LoadOptions, Mamba2Config, Mamba2Weights, Model};

fn main() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let c = Mamba2Config::tiny(2, 4);
    Mamba2Weights::random(&c, 1).save_pretrained(dir.path(), &c).expect("the tiny checkpoint is written");
    let config = std::fs::read(dir.path().join("config.json")).unwrap();
    let weights = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let options = LoadOptions { skip_tokenizer: true, ..LoadOptions::default() };
    afl::fuzz!(|input: &[u8]| {
        let Some((&pick, rest)) = input.split_first() else { return };
        let (c, w) = if pick % 2 == 0 { (rest, &weights[..]) } else { (&config[..], rest) };
        std::fs::write(dir.path().join("config.json"), c).unwrap();
        std::fs::write(dir.path().join("model.safetensors"), w).unwrap();
        if let Ok(model) = Model::load(dir.path(), &options) {
            let vocab = model.config().vocab_size() as u32;
            let tokens: Vec<u32> = (0..4).map(|t| t % vocab.max(1)).collect();
            let _ = model.score(&tokens, &model.zero_state());
        }
    });
}
