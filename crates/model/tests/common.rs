//! Helpers shared by the model's integration tests: fixture paths and readers.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use picaso_model::{LoadOptions, Model};
use safetensors::{Dtype, SafeTensors};

/// The fixture cases written by scripts/make_mamba2_fixtures.py.
pub const CASES: [&str; 3] = ["g1", "g2", "g2-untied-bias"];

/// The fixture cases written by scripts/make_mamba1_fixtures.py.
pub const MAMBA1_CASES: [&str; 4] = ["a", "b", "c", "d"];

/// The device engine the `candle` tests hold to the reference: `candle-cpu` unless
/// `PICASO_TEST_CANDLE_DEVICE` names another — `candle-cuda[:N]` or `metal` (candle on a GPU), or
/// `cuda[:N]` (the GPU engine, Mamba-2 cases) — so the same tests check a GPU build on its GPU
/// (`PICASO_TEST_CANDLE_DEVICE=cuda cargo test -p picaso-model --features cuda --test reference`).
pub fn candle_backend() -> picaso_model::Backend {
    let device = std::env::var("PICASO_TEST_CANDLE_DEVICE").unwrap_or_else(|_| "candle-cpu".into());
    eprintln!("candle engine under test: {device}");
    device.parse().unwrap_or_else(|e| panic!("PICASO_TEST_CANDLE_DEVICE={device:?}: {e}"))
}

pub fn case_dir(case: &str) -> PathBuf {
    fixture_dir("mamba2", case)
}

/// `testdata/{family}/{case}`.
pub fn fixture_dir(family: &str, case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata").join(family).join(case)
}

pub fn load(case: &str, format: &str) -> Model {
    load_from(&case_dir(case).join(format))
}

/// A fixture model without tokenizer.
pub fn load_from(dir: &std::path::Path) -> Model {
    let opts = LoadOptions { skip_tokenizer: true, ..Default::default() };
    Model::load(dir, &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// The expected tensors of a case, as f32 (tokens as u32).
pub struct Expected {
    pub tokens: Vec<u32>,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

pub fn expected(case: &str) -> Expected {
    expected_in(&case_dir(case))
}

/// The expected tensors of the fixture in `dir`.
pub fn expected_in(dir: &std::path::Path) -> Expected {
    let bytes = std::fs::read(dir.join("expected.safetensors")).expect("fixture exists");
    let st = SafeTensors::deserialize(&bytes).expect("fixture parses");
    let mut tensors = HashMap::new();
    let mut tokens = Vec::new();
    for (name, v) in st.tensors() {
        match v.dtype() {
            Dtype::I64 => {
                tokens = v.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
            }
            Dtype::F32 => {
                let data = v.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
                tensors.insert(name, (v.shape().to_vec(), data));
            }
            other => panic!("unexpected dtype {other:?}"),
        }
    }
    Expected { tokens, tensors }
}

impl Expected {
    pub fn get(&self, name: &str) -> &[f32] {
        &self.tensors.get(name).unwrap_or_else(|| panic!("fixture lacks {name}")).1
    }
}

/// max |a - b| / max(max |b|, 1e-6): error relative to the tensor's scale.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs() as f64)).max(1e-6);
    let diff = a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
    diff / scale
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).fold(0.0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()))
}
