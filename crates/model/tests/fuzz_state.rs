//! Structured fuzzing of the state-file reader: valid files (f32 and bf16) damaged by random
//! bit flips, overwritten bytes, truncation, insertion and removal. The reader must never
//! panic, and every damaged file is refused: the checksum covers every byte but its own.
//!
//! More cases: `PROPTEST_CASES=100000 cargo test --release -p picaso-model --test fuzz_state`.

use picaso_model::{Mamba2Config, Mamba2Weights, Model, State, StateDtype};
use proptest::prelude::*;

/// States after some tokens (a Mamba-2 model's; a Granite 4.0 H hybrid's, Mamba and attention
/// layers apart; a Falcon-H1 hybrid's, both in each layer), their file bytes in both dtypes, and
/// what each file decodes to.
fn originals() -> Vec<(Vec<u8>, State)> {
    let c = Mamba2Config::tiny(2, 4);
    let mamba = Model::from_weights(c.clone(), Mamba2Weights::random(&c, 9), None);
    let hybrid = |case: &str| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/granite").join(case).join("hf");
        Model::load(&dir, &picaso_model::LoadOptions { skip_tokenizer: true, ..Default::default() }).unwrap()
    };
    let tokens = [3, 1, 4, 1, 5, 9, 2, 6];
    [mamba, hybrid("dense-nope-g1"), hybrid("falcon-h1-norm-g2")]
        .iter()
        .map(|m| m.prefill(&tokens, &m.zero_state()).unwrap())
        .flat_map(|s| {
            [StateDtype::F32, StateDtype::Bf16].map(|d| {
                let bytes = s.to_bytes(d).unwrap();
                let decoded = State::from_bytes(&bytes).unwrap();
                (bytes, decoded)
            })
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Damage {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Remove { at: usize, len: usize },
}

fn damage() -> impl Strategy<Value = Damage> {
    // Positions are fractions of the file, so one strategy serves files of any length.
    let at = 0usize..1_000_000;
    prop_oneof![
        (at.clone(), 0u8..8).prop_map(|(at, bit)| Damage::Flip { at, bit }),
        (at.clone(), any::<u8>()).prop_map(|(at, byte)| Damage::Set { at, byte }),
        at.clone().prop_map(|at| Damage::Truncate { at }),
        (at.clone(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(at, bytes)| Damage::Insert { at, bytes }),
        (at, 1usize..16).prop_map(|(at, len)| Damage::Remove { at, len }),
    ]
}

/// Applies `d`.
fn apply(bytes: &mut Vec<u8>, d: &Damage) {
    let pos = |at: usize, n: usize| at * n.max(1) / 1_000_000;
    match d {
        Damage::Flip { at, bit } => {
            let i = pos(*at, bytes.len());
            bytes[i] ^= 1 << bit;
        }
        Damage::Set { at, byte } => {
            let i = pos(*at, bytes.len());
            bytes[i] = *byte;
        }
        Damage::Truncate { at } => bytes.truncate(pos(*at, bytes.len())),
        Damage::Insert { at, bytes: b } => {
            let i = pos(*at, bytes.len() + 1);
            bytes.splice(i..i, b.iter().copied());
        }
        Damage::Remove { at, len } => {
            let i = pos(*at, bytes.len());
            let j = (i + len).min(bytes.len());
            bytes.drain(i..j);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2000),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Any damage: no panic, and the damaged file is refused with an error.
    #[test]
    fn damaged_state_files_are_refused(
        which in 0usize..2,
        damages in prop::collection::vec(damage(), 1..4),
    ) {
        let originals = originals();
        let (original, decoded) = &originals[which];
        let mut bytes = original.clone();
        for d in &damages {
            if bytes.is_empty() {
                break;
            }
            apply(&mut bytes, d);
        }
        let result = std::panic::catch_unwind(|| State::from_bytes(&bytes));
        prop_assert!(result.is_ok(), "the reader panicked on {damages:?}");
        match result.unwrap() {
            Err(e) => prop_assert!(!e.to_string().is_empty()),
            Ok(s) => {
                prop_assert!(bytes == *original, "a damaged file was accepted: {damages:?}");
                prop_assert_eq!(&s, decoded);
            }
        }
    }
}

/// The AFL++ corpus (fuzz/afl: seeds and the inputs a coverage-guided run kept) replayed under
/// the AFL target's property: no panic, and a file that is read holds finite values and
/// survives a round trip in both dtypes.
#[test]
fn afl_corpus_is_read_or_refused() {
    let files = afl_inputs("state");
    assert!(!files.is_empty(), "no AFL++ inputs found under fuzz/afl");
    for path in files {
        let bytes = std::fs::read(&path).unwrap();
        let read = std::panic::catch_unwind(|| State::from_bytes(&bytes));
        let Ok(state) = read.unwrap_or_else(|_| panic!("the reader panicked on {}", path.display())) else {
            continue;
        };
        if state.check_values().is_err() {
            continue;
        }
        for dtype in [StateDtype::F32, StateDtype::Bf16] {
            let again = state.to_bytes(dtype).unwrap();
            let back = State::from_bytes(&again).unwrap();
            assert_eq!((back.n_tokens, &back.fingerprint), (state.n_tokens, &state.fingerprint), "{}", path.display());
        }
    }
}

/// Every file of fuzz/afl/seeds/TARGET and fuzz/afl/corpus/TARGET.
fn afl_inputs(target: &str) -> Vec<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/afl");
    let mut files: Vec<_> = ["seeds", "corpus"]
        .iter()
        .filter_map(|d| std::fs::read_dir(root.join(d).join(target)).ok())
        .flatten()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    files
}
