//! Exact agreement with HF transformers (fixtures from scripts/make_mamba2_fixtures.py,
//! computed in float64): log-probs within 1e-4, states within 1e-5 of their scale, for both
//! checkpoint layouts.

mod common;

use common::*;

const FORMATS: [&str; 2] = ["hf", "state-spaces"];

#[test]
fn logprobs_match_transformers() {
    for case in CASES {
        let exp = expected(case);
        for format in FORMATS {
            let model = load(case, format);
            let scored = model.score(&exp.tokens, &model.zero_state()).unwrap();
            let err = max_abs_diff(&scored.logprobs, exp.get("logprobs"));
            eprintln!("{case}/{format}: max logprob error {err:.2e}");
            assert!(err < 1e-4, "{case}/{format}: logprobs differ by {err}");
        }
    }
}

#[test]
fn states_match_transformers() {
    for case in CASES {
        let exp = expected(case);
        for format in FORMATS {
            let model = load(case, format);
            for (prefix, len) in [
                ("short", 2usize),
                ("prefix", 13),
                ("full", exp.tokens.len()),
            ] {
                let state = model
                    .prefill(&exp.tokens[..len], &model.zero_state())
                    .unwrap();
                assert_eq!(state.n_tokens, len as u64);
                for (i, layer) in state.layers.iter().enumerate() {
                    for (name, got) in [
                        ("ssm", &layer.ssm),
                        ("conv", &layer.conv),
                        ("log_decay", &layer.log_decay),
                    ] {
                        let key = format!("{prefix}.layers.{i}.{name}");
                        let err = rel_err(got, exp.get(&key));
                        assert!(
                            err < 1e-5,
                            "{case}/{format}: {key} differs by {err} (relative)"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn both_layouts_give_the_same_fingerprint() {
    for case in CASES {
        let a = load(case, "hf");
        let b = load(case, "state-spaces");
        assert_eq!(a.fingerprint(), b.fingerprint(), "{case}");
        assert_eq!(a.config().vocab_size, b.config().vocab_size);
    }
    assert_ne!(
        load("g1", "hf").fingerprint(),
        load("g2", "hf").fingerprint()
    );
}
