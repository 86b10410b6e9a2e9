//! Writes the seed corpus (fuzz/afl/seeds/): valid state files of a tiny random Mamba-2 in
//! both dtypes, and that model's checkpoint files prefixed with the loader target's selector
//! byte. The model is the one the loader target starts from, so each seed loads.
//!
//!   cargo run --release --bin seeds -- fuzz/afl/seeds

use std::path::PathBuf;

use picaso_model::{Mamba2Config, Mamba2Weights, Model, StateDtype};

fn main() {
    let out = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "seeds".into()));
    let c = Mamba2Config::tiny(2, 4);
    let weights = Mamba2Weights::random(&c, 1);
    let model = Model::from_weights(c.clone(), weights.clone(), None);
    let state = model.prefill(&[3, 1, 4, 1, 5], &model.zero_state()).unwrap();
    std::fs::create_dir_all(out.join("state")).unwrap();
    for (name, dtype) in [("f32", StateDtype::F32), ("bf16", StateDtype::Bf16)] {
        std::fs::write(out.join("state").join(format!("{name}.state")), state.to_bytes(dtype).unwrap()).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    weights.save_pretrained(dir.path(), &c).unwrap();
    std::fs::create_dir_all(out.join("loader")).unwrap();
    for (pick, file) in [(0u8, "config.json"), (1u8, "model.safetensors")] {
        let mut bytes = vec![pick];
        bytes.extend(std::fs::read(dir.path().join(file)).unwrap());
        std::fs::write(out.join("loader").join(file), bytes).unwrap();
    }
}
