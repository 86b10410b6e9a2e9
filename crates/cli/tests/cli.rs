//! The `picaso` command end to end: exact output formats, state files across commands, and a
//! clear one-line error with a non-zero exit (never a panic) for each kind of bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use picaso_model::weights::read_tensors;
use serde_json::Value;

mod common;

fn fixture(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/mamba2").join(case)
}

fn picaso(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_picaso")).args(args).output().expect("picaso runs")
}

fn ok_json(args: &[&str]) -> Value {
    let out = picaso(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "picaso {args:?} failed: {stderr}");
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// Asserts a clean failure: non-zero exit, an `error:` line naming `needle`, no panic.
fn fails_with(args: &[&str], needle: &str) {
    let out = picaso(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "picaso {args:?} should fail");
    assert!(!stderr.contains("panicked"), "picaso {args:?} panicked: {stderr}");
    assert!(stderr.contains(needle), "picaso {args:?}: expected {needle:?} in: {stderr}");
}

fn expected_logprobs(case: &str) -> (Vec<u32>, Vec<f32>) {
    let t = read_tensors_file(&fixture(case).join("expected.safetensors"));
    (t.0, t.1)
}

fn read_tensors_file(path: &Path) -> (Vec<u32>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let tokens = st
        .tensor("tokens")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    let lp = st
        .tensor("logprobs")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (tokens, lp)
}

fn ids(tokens: &[u32]) -> String {
    tokens.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

#[test]
fn score_json_matches_the_reference() {
    let (tokens, want) = expected_logprobs("g2");
    let model = fixture("g2").join("hf");
    let v = ok_json(&["score", "--model", model.to_str().unwrap(), "--token-ids", &ids(&tokens), "--json"]);
    let got: Vec<f64> = v["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(v["token_ids"].as_array().unwrap().len(), tokens.len());
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - *w as f64).abs() < 1e-4);
    }
    let mean = -want.iter().map(|&x| x as f64).sum::<f64>() / want.len() as f64;
    assert!((v["mean_nll"].as_f64().unwrap() - mean).abs() < 1e-4);
}

#[test]
fn state_then_score_from_state_continues_exactly() {
    let (tokens, want) = expected_logprobs("g1");
    let model = fixture("g1").join("state-spaces");
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("a.safetensors");
    let s = state.to_str().unwrap();
    let v = ok_json(&["state", "--model", m, "--token-ids", &ids(&tokens[..10]), "--out", s, "--json"]);
    assert_eq!(v["n_tokens"], 10);
    let v = ok_json(&["score", "--model", m, "--token-ids", &ids(&tokens[10..]), "--state", s, "--json"]);
    let got: Vec<f64> = v["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    for (g, w) in got.iter().zip(&want[10..]) {
        assert!((g - *w as f64).abs() < 1e-4);
    }
    // bf16 on disk is half the bytes of the state tensors.
    let s16 = dir.path().join("a16.safetensors");
    ok_json(&[
        "state",
        "--model",
        m,
        "--token-ids",
        &ids(&tokens[..10]),
        "--out",
        s16.to_str().unwrap(),
        "--dtype",
        "bf16",
        "--json",
    ]);
    let (b32, b16) = (std::fs::metadata(&state).unwrap().len(), std::fs::metadata(&s16).unwrap().len());
    assert!(b16 < b32 * 6 / 10, "{b16} vs {b32}");
}

#[test]
fn weights_json_has_the_documented_form() {
    let v = ok_json(&["weights", "--method", "caso", "--log-decays", "-0.69,-0.1,-1.2", "--json"]);
    assert_eq!(v["method"], "caso");
    let w: Vec<f64> = v["weights"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert!((w[0] - (-1.3f64).exp()).abs() < 1e-12 && (w[1] - (-1.2f64).exp()).abs() < 1e-12 && w[2] == 1.0);
    let v = ok_json(&["weights", "--method", "picaso-s", "--log-decays", "-10000,-10000,0", "--json"]);
    assert!(v["weights"].as_array().unwrap().iter().all(|x| x.as_f64().unwrap().is_finite()));
    fails_with(&["weights", "--method", "caso", "--log-decays", "0.5", "--json"], "<= 0");
    fails_with(&["weights", "--method", "mean", "--log-decays", "-1"], "picaso-r");
}

#[test]
fn compose_writes_a_state_that_scores() {
    let (tokens, _) = expected_logprobs("g2");
    let m = fixture("g2").join("hf");
    let m = m.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    ok_json(&["state", "--model", m, "--token-ids", &ids(&tokens[..8]), "--out", &p("a"), "--json"]);
    ok_json(&["state", "--model", m, "--token-ids", &ids(&tokens[8..20]), "--out", &p("b"), "--json"]);
    for method in ["soup", "caso", "picaso-s", "picaso-r"] {
        let v = ok_json(&[
            "compose",
            "--method",
            method,
            "--state-files",
            &p("a"),
            &p("b"),
            "--order",
            "1,0",
            "--out",
            &p("c"),
            "--json",
        ]);
        assert_eq!(v["n_tokens"], 20);
        let v = ok_json(&["score", "--model", m, "--token-ids", &ids(&tokens[20..]), "--state", &p("c"), "--json"]);
        assert!(v["mean_nll"].as_f64().unwrap().is_finite());
    }
    fails_with(
        &["compose", "--method", "caso", "--state-files", &p("a"), &p("b"), "--order", "0,0", "--out", &p("d")],
        "permutation",
    );
    fails_with(
        &["compose", "--method", "caso", "--state-files", &p("a"), "/nonexistent/x", "--out", &p("d")],
        "/nonexistent/x",
    );
    // A state of another model.
    let other = fixture("g1").join("hf");
    ok_json(&["state", "--model", other.to_str().unwrap(), "--token-ids", "1,2,3", "--out", &p("o"), "--json"]);
    fails_with(&["compose", "--method", "soup", "--state-files", &p("a"), &p("o"), "--out", &p("d")], "made by model");
    fails_with(&["score", "--model", m, "--token-ids", "1,2,3", "--state", &p("o")], "another model");
    // Garbage in a state file.
    std::fs::write(p("junk"), b"not a state").unwrap();
    fails_with(&["score", "--model", m, "--token-ids", "1,2", "--state", &p("junk")], "junk");
}

/// Copies the g1 HF model into a temp folder, letting `edit` change its tensors or config.
fn broken_model(
    edit: impl FnOnce(&Path, &mut std::collections::HashMap<String, picaso_model::HostTensor>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = fixture("g1").join("hf");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let mut tensors = read_tensors(&src).unwrap();
    edit(dir.path(), &mut tensors);
    let bufs: Vec<(String, Vec<usize>, Vec<u8>)> =
        tensors.into_iter().map(|(n, t)| (n, t.shape, t.data.iter().flat_map(|v| v.to_le_bytes()).collect())).collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bufs
        .iter()
        .map(|(n, s, b)| {
            (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap())
        })
        .collect();
    std::fs::write(dir.path().join("model.safetensors"), safetensors::tensor::serialize(views, None).unwrap()).unwrap();
    dir
}

#[test]
fn bad_models_and_inputs_fail_cleanly() {
    let score = |dir: &Path, needle: &str| {
        fails_with(&["score", "--model", dir.to_str().unwrap(), "--token-ids", "1,2,3"], needle)
    };
    fails_with(&["score", "--model", "/no/such/model", "--token-ids", "1"], "/no/such/model");
    // Without --model: $PICASO_MODEL (then the bundled model).
    let with_env = |model: &Path| {
        Command::new(env!("CARGO_BIN_EXE_picaso"))
            .args(["score", "--token-ids", "1,2,3", "--json"])
            .env("PICASO_MODEL", model)
            .output()
            .unwrap()
    };
    let out = with_env(&fixture("g1").join("hf"));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = with_env(Path::new("/no/such/env-model"));
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("/no/such/env-model"));
    let d = broken_model(|_, t| {
        t.remove("backbone.layers.1.mixer.A_log");
    });
    score(d.path(), "backbone.layers.1.mixer.A_log");
    let d = broken_model(|_, t| {
        t.get_mut("backbone.layers.0.mixer.out_proj.weight").unwrap().shape = vec![64, 32];
    });
    score(d.path(), "out_proj.weight");
    let d = broken_model(|_, t| {
        t.get_mut("backbone.layers.0.mixer.D").unwrap().data[1] = f32::NAN;
    });
    score(d.path(), "non-finite");
    let d = broken_model(|p, _| std::fs::write(p.join("config.json"), "{ not json").unwrap());
    score(d.path(), "config.json");
    let d = broken_model(|p, _| {
        std::fs::write(p.join("config.json"), r#"{"hidden_size": 32, "model_type": "mamba2"}"#).unwrap()
    });
    score(d.path(), "num_hidden_layers");
    let d = broken_model(|p, _| {
        std::fs::write(p.join("config.json"), r#"{"hidden_size": 32, "num_hidden_layers": "two", "vocab_size": 97}"#)
            .unwrap()
    });
    score(d.path(), "num_hidden_layers");
    let d = broken_model(|p, _| std::fs::remove_file(p.join("config.json")).unwrap());
    score(d.path(), "config.json");
    let g1 = fixture("g1").join("hf");
    fails_with(&["score", "--model", g1.to_str().unwrap(), "--token-ids", "1,97,3"], "outside the vocabulary");
    fails_with(&["score", "--model", g1.to_str().unwrap(), "--token-ids", "1,x"], "invalid");
    fails_with(&["score", "--model", g1.to_str().unwrap(), "--text", "hello"], "tokenizer");
    fails_with(&["generate", "--model", g1.to_str().unwrap(), "--prompt", "hello"], "tokenizer");
}

#[test]
fn text_commands_generate_and_score() {
    let Some(dir) = common::text_model(3) else { return };
    let m = dir.path().to_str().unwrap();
    let info = ok_json(&["info", "--model", m, "--json"]);
    assert_eq!(info["config"]["hidden_size"], 16);
    assert_eq!(info["tokenizer"], 50277);
    let v = ok_json(&["score", "--model", m, "--text", "The cat sat on the mat.", "--json"]);
    assert_eq!(v["token_ids"].as_array().unwrap().len(), v["logprobs"].as_array().unwrap().len() + 1);
    fails_with(&["score", "--model", m, "--text", ""], "nothing to score");
    let a = ok_json(&["generate", "--model", m, "--prompt", "Once upon a time", "--max-tokens", "8", "--json"]);
    let b = ok_json(&["generate", "--model", m, "--prompt", "Once upon a time", "--max-tokens", "8", "--json"]);
    assert_eq!(a["token_ids"], b["token_ids"], "greedy is deterministic");
    assert!(a["token_ids"].as_array().unwrap().len() <= 8);
    let sampled = [
        "generate",
        "--model",
        m,
        "--prompt",
        "Once",
        "--temperature",
        "1.0",
        "--top-p",
        "0.9",
        "--seed",
        "5",
        "--json",
    ];
    let (s1, s2) = (ok_json(&sampled), ok_json(&sampled));
    assert_eq!(s1["token_ids"], s2["token_ids"], "a seed fixes the sample");
    // The incrementally decoded text is the decoding of all generated tokens (a long random
    // sample hits multi-byte characters split over tokens).
    let long = ok_json(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "Once",
        "--temperature",
        "1.5",
        "--max-tokens",
        "300",
        "--json",
    ]);
    let ids: Vec<u32> = long["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let tok = picaso_model::TextTokenizer::from_file(&dir.path().join("tokenizer.json")).unwrap();
    let full = tok.decode(&ids).unwrap();
    let full = full.trim_end_matches('\u{FFFD}');
    assert_eq!(long["text"].as_str().unwrap(), full);
    // Generation from a saved state equals generation from the concatenated prompt (greedy).
    let st = dir.path().join("ctx.safetensors");
    ok_json(&["state", "--model", m, "--text", "Once upon", "--out", st.to_str().unwrap(), "--json"]);
    let from_state = ok_json(&[
        "generate",
        "--model",
        m,
        "--prompt",
        " a time",
        "--state",
        st.to_str().unwrap(),
        "--max-tokens",
        "8",
        "--json",
    ]);
    assert_eq!(from_state["token_ids"], a["token_ids"]);
    // A stop string cuts the text before it and ends generation.
    let text = a["text"].as_str().unwrap().to_string();
    let cut = text.char_indices().nth(text.chars().count() / 2).map(|(i, _)| i).unwrap_or(0);
    if cut > 0 {
        let stop = &text[cut..text.len().min(cut + 3)];
        let s = ok_json(&[
            "generate",
            "--model",
            m,
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "8",
            "--stop",
            stop,
            "--json",
        ]);
        assert_eq!(s["stop_reason"], "stop");
        assert!(text.starts_with(s["text"].as_str().unwrap()) && !s["text"].as_str().unwrap().contains(stop));
    }
    fails_with(&["generate", "--model", m, "--prompt", "x", "--temperature", "-1"], "temperature");
    fails_with(&["generate", "--model", m, "--prompt", "", "--max-tokens", "3"], "at least one token");
}

/// `random-model` writes a loadable folder of a known shape, refuses to overwrite, and leaves
/// nothing behind for an unknown shape.
#[test]
fn random_model_writes_a_loadable_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tiny");
    let o = out.to_str().unwrap();
    let done = picaso(&["random-model", "--shape", "tiny", "--seed", "3", "--out", o]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let info = ok_json(&["info", "--model", o, "--json"]);
    assert_eq!(info["config"]["num_hidden_layers"], 2, "{info}");
    fails_with(&["random-model", "--shape", "tiny", "--out", o], "exists");
    let bad = tmp.path().join("bad");
    fails_with(&["random-model", "--shape", "huge", "--out", bad.to_str().unwrap()], "--shape");
    assert!(!bad.exists(), "a refused shape leaves no folder");
    // A hybrid: written in Granite 4.0 H's spelling, read back, and scored.
    let hybrid = tmp.path().join("granite");
    let h = hybrid.to_str().unwrap();
    let done = picaso(&["random-model", "--shape", "granite-tiny", "--out", h]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let info = ok_json(&["info", "--model", h, "--json"]);
    assert_eq!(info["config"]["layer_types"][1], "attention", "{info}");
    let scored = ok_json(&["score", "--model", h, "--token-ids", "1,2,3,4,5", "--json"]);
    assert!(scored["logprobs"].as_array().is_some_and(|l| l.len() == 4), "{scored}");
    // A Jamba hybrid: written in the hub's spelling, read back, scored; other engines refused.
    let jamba = tmp.path().join("jamba");
    let j = jamba.to_str().unwrap();
    let done = picaso(&["random-model", "--shape", "jamba-tiny", "--out", j]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let info = ok_json(&["info", "--model", j, "--json"]);
    assert_eq!(info["config"]["attn_layer_period"], 3, "{info}");
    let scored = ok_json(&["score", "--model", j, "--token-ids", "1,2,3,4,5", "--json"]);
    assert!(scored["logprobs"].as_array().is_some_and(|l| l.len() == 4), "{scored}");
    fails_with(&["score", "--model", j, "--token-ids", "1,2,3", "--device", "candle-cpu"], "Jamba");
}

/// `bench` reports every measurement it was asked for (single and batched decode, the
/// composition against the read) as positive, finite rates, and skips what was set to 0.
#[test]
fn bench_measures_single_and_batched_decode() {
    let args = ["bench", "--random", "tiny", "--prompt-tokens", "8", "--decode-tokens", "4", "--repeats", "1"];
    let r = ok_json(&[&args[..], &["--compose-n", "3", "--decode-batch", "3", "--json"]].concat());
    for key in [
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "batched_decode_tokens_per_s",
        "batched_decode_f16_state_tokens_per_s",
        "read_states_ms",
    ] {
        let v = r[key].as_f64().unwrap_or_else(|| panic!("{key} missing: {r}"));
        assert!(v.is_finite() && v > 0.0, "{key} = {v}");
    }
    assert_eq!(r["decode_batch"], 3);
    // A hybrid's keys and values join the states that are decoded and composed.
    let h = ok_json(&[
        "bench",
        "--random",
        "granite-tiny",
        "--prompt-tokens",
        "8",
        "--decode-tokens",
        "4",
        "--repeats",
        "1",
        "--compose-n",
        "2",
        "--decode-batch",
        "2",
        "--json",
    ]);
    assert!(h["batched_decode_tokens_per_s"].as_f64().is_some_and(|v| v > 0.0), "{h}");
    assert_eq!(r["compose_ms"].as_array().map(Vec::len), Some(picaso_compose::Composition::ALL.len()), "{r}");
    let skipped = ok_json(&[&args[..], &["--compose-n", "0", "--decode-batch", "0", "--json"]].concat());
    assert!(
        skipped["batched_decode_tokens_per_s"].is_null()
            && skipped["batched_decode_f16_state_tokens_per_s"].is_null()
            && skipped["compose_ms"] == serde_json::json!([]),
        "{skipped}"
    );
    // Any engine: the candle one measured the same way; bf16 storage is the cpu and GPU engines'.
    let candle = ok_json(&[&args[..], &["--device", "candle-cpu", "--compose-n", "0", "--json"]].concat());
    assert!(candle["decode_tokens_per_s"].as_f64().is_some_and(|v| v > 0.0), "{candle}");
    fails_with(&[&args[..], &["--device", "candle-cpu", "--weights", "bf16"]].concat(), "cpu and GPU engines' storage");
    // Without the `cuda` feature the GPU engine says how to get it.
    #[cfg(not(feature = "cuda"))]
    fails_with(&[&args[..], &["--device", "cuda"]].concat(), "--features cuda");
}

/// Output into a pipe whose reader is gone (`picaso info | head`) ends the command without a
/// panic.
#[test]
fn a_closed_stdout_ends_the_command_without_a_panic() {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let model = fixture("g1").join("hf");
    let out = Command::new(env!("CARGO_BIN_EXE_picaso"))
        .args(["info", "--model", model.to_str().unwrap(), "--json"])
        .stdout(writer)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// The demo with the bundled models (the Mamba-2, and the hybrid beside it): for every prompt
/// and model, leave-one-out over the composed state names the retrieved paragraph that holds
/// the true answer.
#[test]
fn the_demo_attributes_each_answer_to_the_paragraph_that_holds_it() {
    let Some(embedder) = common::shared("all-MiniLM-L6-v2") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("demo-db");
    let out = picaso(&["demo", "--embedder", embedder.to_str().unwrap(), "--db", db.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let store = picaso_store::Store::open(picaso_store::Location::from(db.as_path())).unwrap();
    let (mut answer, mut checked) = (None, 0);
    for line in stdout.lines().map(str::trim) {
        if let Some(a) = line.strip_prefix("true answer: ") {
            answer = Some(a.split(',').next().unwrap().trim_end_matches('.').to_string());
        }
        if let Some(rest) = line.strip_prefix("the true answer owes most to ") {
            let (source, _) = rest.split_once(':').unwrap();
            let (doc, seg) = source.rsplit_once(" #").unwrap();
            let context = (1..=store.len().unwrap() as i64)
                .map(|id| store.get(id).unwrap())
                .find(|c| c.doc == doc && c.seg.to_string() == seg)
                .unwrap_or_else(|| panic!("no context {source}"));
            let text = context.text;
            let answer = answer.clone().expect("the true answer comes first");
            assert!(text.contains(&answer), "{source} does not hold {answer:?}: {text}");
            checked += 1;
        }
    }
    let models = stdout.lines().filter(|l| l.starts_with("store ")).count();
    assert_eq!(models, 2, "the Mamba-2 and the hybrid: {stdout}");
    assert!(stdout.contains("  picaso-hybrid:") && stdout.contains("  picaso-mamba2:"), "{stdout}");
    assert_eq!(checked, 4 * models, "{stdout}");
}
