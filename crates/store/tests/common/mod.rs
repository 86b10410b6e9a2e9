//! What the store's integration tests share: a tiny random model and contexts whose states
//! and embeddings are known.
#![allow(dead_code)] // each test file uses some of them

use picaso_model::{Mamba2Config, Mamba2Weights, Model};
use picaso_store::{NewContext, Store, StoreInfo};

pub const DIM: usize = 4;

pub fn model() -> &'static Model {
    static MODEL: std::sync::OnceLock<Model> = std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let c = Mamba2Config::tiny(2, 4);
        Model::from_weights(c.clone(), Mamba2Weights::random(&c, 3), None)
    })
}

pub fn info() -> StoreInfo {
    StoreInfo { fingerprint: model().fingerprint().to_string(), dim: DIM, state_dtype: Default::default() }
}

/// Context `seg` of `doc`, whose state depends only on `text_of`.
pub fn context(doc: &str, seg: u32, text_of: u32) -> NewContext {
    let m = model();
    let tokens: Vec<u32> = (0..3 + text_of).map(|t| (t * 7 + text_of) % 50).collect();
    let mut e = [0.1f32; DIM];
    e[text_of as usize % DIM] = 1.0;
    let norm = e.iter().map(|v| v * v).sum::<f32>().sqrt();
    NewContext {
        doc: doc.to_string(),
        seg,
        text: format!("text {text_of}"),
        state: m.prefill(&tokens, &m.zero_state()).unwrap(),
        tokens,
        embedding: e.iter().map(|v| v / norm).collect(),
        metadata: Default::default(),
    }
}

pub fn insert(store: &Store, items: &[NewContext]) -> Vec<i64> {
    store.insert(items).unwrap().into_iter().map(|id| id.expect("inserted")).collect()
}
