//! EleutherAI's lm-evaluation-harness (PyPI `lm-eval`) against `picaso serve`, as a user runs
//! it: the bundled model, the harness's default settings (its tokenizer found through the
//! server's `/tokenizer_info`, requests as token ids), offline, on tiny tasks this test writes:
//! a `multiple_choice` task, a `loglikelihood_rolling` task and a `generate_until` task at
//! `--batch_size 1` and `8`, and `local-chat-completions` with a chat template. Every
//! log-likelihood the harness records must equal `picaso score`'s to 1e-4, and every generation
//! `picaso generate`'s. Needs `PICASO_TEST_LM_EVAL_PYTHON`, a Python with `lm-eval[api]` (CI
//! makes one; without it, skipped here and a failure under CI).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

mod common;
use common::{ok, ok_s, shared, Server};

/// The bundled model.
fn bundled() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/picaso-mamba2")
}

/// Multiple-choice questions: context, choices, the right one.
const MC: &[(&str, &[&str], usize)] = &[
    ("The capital of France is", &[" Paris", " Berlin", " a small dog"], 0),
    ("Water freezes at zero degrees", &[" Celsius", " of the moon", " tomorrow"], 0),
    ("The sun rises in the", &[" east", " west", " kitchen", " sea"], 0),
    ("Cats are small", &[" carnivorous mammals", " rocks", " numbers"], 0),
    ("The Eiffel Tower was finished in", &[" 1889", " 2020", " the rain"], 0),
    ("A state space model keeps a", &[" state", " horse", " secret"], 0),
    ("Two plus two is", &[" four", " seven", " blue"], 0),
    ("The river flows into the", &[" sea", " sky", " library"], 0),
    ("In the morning, people often drink", &[" coffee", " sand", " paint"], 0),
    ("The history of the city begins", &[" in the Middle Ages", " with a spoon", " never"], 0),
];

/// Documents for the rolling (perplexity) task.
const DOCS: &[&str] = &[
    "The Eiffel Tower is a wrought-iron lattice tower in Paris. It was finished in 1889.",
    "Mamba is a state space model. It processes a sequence one token at a time and keeps a fixed-size state.",
    "Cats are small carnivorous mammals. They were domesticated thousands of years ago.",
    "The river flows through the valley and into the sea, past farms and small towns.",
];

/// Questions for the generation task.
const GEN: &[(&str, &str)] = &[
    ("Question: What is the capital of France?\nAnswer:", "Paris"),
    ("Question: What do cats eat?\nAnswer:", "fish"),
    ("The history of the city", "begins"),
];

/// Writes the data files and task YAMLs into `dir`; returns the task names.
fn write_tasks(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let lines = |rows: Vec<Value>| rows.iter().map(|r| format!("{r}\n")).collect::<String>();
    let mc = MC.iter().map(|(q, c, a)| json!({"question": q, "choices": c, "answer": a})).collect();
    std::fs::write(dir.join("mc.jsonl"), lines(mc)).unwrap();
    std::fs::write(dir.join("docs.jsonl"), lines(DOCS.iter().map(|d| json!({"text": d})).collect())).unwrap();
    std::fs::write(
        dir.join("gen.jsonl"),
        lines(GEN.iter().map(|(q, a)| json!({"question": q, "answer": a})).collect()),
    )
    .unwrap();
    let data = |file: &str| {
        format!(
            "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n",
            dir.join(file).display()
        )
    };
    let tasks = [
        (
            "picaso_mc",
            format!(
                "task: picaso_mc\n{}output_type: multiple_choice\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_choice: \"{{{{choices}}}}\"\ndoc_to_target: \"{{{{answer}}}}\"\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n",
                data("mc.jsonl")
            ),
        ),
        (
            "picaso_rolling",
            format!(
                "task: picaso_rolling\n{}output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{{{text}}}}\"\nmetric_list:\n  - metric: word_perplexity\n",
                data("docs.jsonl")
            ),
        ),
        (
            "picaso_gen",
            format!(
                "task: picaso_gen\n{}output_type: generate_until\ndoc_to_text: \"{{{{question}}}}\"\ndoc_to_target: \"{{{{answer}}}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n",
                data("gen.jsonl")
            ),
        ),
    ];
    for (name, yaml) in tasks {
        std::fs::write(dir.join(format!("{name}.yaml")), yaml).unwrap();
    }
}

/// Runs lm-eval; returns each task's logged samples.
fn lm_eval(python: &str, args: &[&str], out: &Path) -> std::collections::HashMap<String, Vec<Value>> {
    let run = std::process::Command::new(python)
        .args(["-m", "lm_eval"])
        .args(args)
        .args(["--log_samples", "--output_path", out.to_str().unwrap()])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_DATASETS_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .env("HF_HOME", out.join("hf-home"))
        .env("TOKENIZERS_PARALLELISM", "false")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "lm-eval {args:?} failed:\n{}\n{stderr}", String::from_utf8_lossy(&run.stdout));
    let mut samples = std::collections::HashMap::new();
    for entry in walk(out) {
        let name = entry.file_name().unwrap().to_string_lossy().into_owned();
        let Some(task) = name.strip_prefix("samples_").and_then(|n| n.rsplit_once('_')).map(|(t, _)| t.to_string())
        else {
            continue;
        };
        let text = std::fs::read_to_string(&entry).unwrap();
        let rows: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        samples.insert(task, rows);
    }
    samples
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// `picaso score` of `text`: its token ids and each later token's log-probability.
fn score(model: &str, text: &str) -> (Vec<u64>, Vec<f64>) {
    let v = ok(&["score", "--model", model, "--text", text, "--json"]);
    let ids = v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    let lps = v["logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    (ids, lps)
}

/// log p(continuation | context) as `picaso score` gives it, the pair split as the harness
/// splits it (the context's trailing spaces go to the continuation; the context's tokens are
/// those of the context alone).
fn loglikelihood(model: &str, context: &str, continuation: &str) -> f64 {
    let trimmed = context.trim_end();
    let continuation = format!("{}{continuation}", &context[trimmed.len()..]);
    let (context_ids, _) = score(model, trimmed);
    let (_, lps) = score(model, &format!("{trimmed}{continuation}"));
    lps[context_ids.len() - 1..].iter().sum()
}

/// `picaso generate`'s greedy text for `prompt`, cut at the first `until`.
fn generate(model: &str, prompt: &str, max_tokens: usize, until: &str) -> String {
    let v = ok(&[
        "generate",
        "--model",
        model,
        "--prompt",
        prompt,
        "--max-tokens",
        &max_tokens.to_string(),
        "--stop",
        until,
        "--json",
    ]);
    v["text"].as_str().unwrap().to_string()
}

/// A number as the harness logs it: JSON number or its Python repr in a string.
fn number(v: &Value) -> Option<f64> {
    v.as_f64().or_else(|| v.as_str()?.parse().ok())
}

/// The log-likelihoods of a task's samples as the harness recorded them.
fn recorded(rows: &[Value]) -> Vec<(Value, Vec<f64>)> {
    rows.iter()
        .map(|r| {
            let lls = r["resps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|resp| {
                    let first = &resp[0];
                    number(first).or_else(|| number(&first[0])).unwrap_or_else(|| panic!("{resp}"))
                })
                .collect();
            (r["arguments"].clone(), lls)
        })
        .collect()
}

#[test]
fn lm_eval_scores_picaso_serve_as_picaso_score_does() {
    let Ok(python) = std::env::var("PICASO_TEST_LM_EVAL_PYTHON") else {
        assert!(std::env::var("CI").is_err(), "CI must set PICASO_TEST_LM_EVAL_PYTHON (a Python with lm-eval[api])");
        eprintln!("note: PICASO_TEST_LM_EVAL_PYTHON not set; skipped");
        return;
    };
    let Some(embedder) = shared("all-MiniLM-L6-v2") else { return };
    let model = bundled();
    let m = model.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    common::write_docs(&docs);
    let db = tmp.path().join("db");
    let (db, e) = (db.to_str().unwrap(), embedder.to_str().unwrap());
    ok_s(&common::args(
        &["ingest"],
        &common::TestDb { db: db.to_string(), states: None },
        &["--model", m, "--embedder", e, "--text-dir", docs.to_str().unwrap(), "--json"],
    ));
    let chat_template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_tokenizer_config.json");
    let server =
        Server::start(&["--db", db, "--model", m, "--embedder", e, "--chat-template", chat_template.to_str().unwrap()]);
    // The tokenizer endpoints: the template is served, and messages tokenize as their rendering.
    let (_, info) = server.call("GET", "/tokenizer_info", None);
    assert_eq!((info["eos_token"].as_str(), info["eos_token_id"].as_u64()), (Some("<|endoftext|>"), Some(0)));
    assert!(info["chat_template"].as_str().unwrap().contains("add_generation_prompt"), "{info}");
    let body = json!({"messages": [{"role": "user", "content": " Hi "}]}).to_string();
    let (_, by_messages) = server.call("POST", "/tokenize", Some(&body));
    let body = json!({"prompt": "<|user|>\nHi\n<|assistant|>\n", "return_token_strs": true}).to_string();
    let (_, by_text) = server.call("POST", "/tokenize", Some(&body));
    assert_eq!(by_messages["tokens"], by_text["tokens"], "{by_messages} vs {by_text}");
    let body = json!({"tokens": by_text["tokens"]}).to_string();
    assert_eq!(server.call("POST", "/detokenize", Some(&body)).1["prompt"], "<|user|>\nHi\n<|assistant|>\n");
    let tasks = tmp.path().join("tasks");
    write_tasks(&tasks);
    let completions = format!("base_url={}/v1/completions,model=picaso-mamba2", server.url);

    // The expected numbers, from the CLI alone.
    let mc_want: Vec<Vec<f64>> =
        MC.iter().map(|(q, choices, _)| choices.iter().map(|c| loglikelihood(m, q, c)).collect()).collect();
    let rolling_want: Vec<f64> = DOCS
        .iter()
        .map(|d| {
            // The harness scores a document after its prefix token (the end-of-text token).
            let (_, lps) = score(m, &format!("<|endoftext|>{d}"));
            lps.iter().sum()
        })
        .collect();
    let gen_want: Vec<String> = GEN.iter().map(|(q, _)| generate(m, q, 12, "\n")).collect();

    let mut worst: f64 = 0.0;
    for batch in ["1", "8"] {
        let out = tmp.path().join(format!("out-{batch}"));
        let samples = lm_eval(
            &python,
            &[
                "--model",
                "local-completions",
                "--model_args",
                &completions,
                "--tasks",
                "picaso_mc,picaso_rolling,picaso_gen",
                "--include_path",
                tasks.to_str().unwrap(),
                "--batch_size",
                batch,
            ],
            &out,
        );
        // Multiple choice: one log-likelihood per choice.
        let mc = recorded(&samples["picaso_mc"]);
        assert_eq!(mc.len(), MC.len(), "batch {batch}");
        for (row, (args, got)) in samples["picaso_mc"].iter().zip(&mc) {
            let doc = row["doc_id"].as_u64().unwrap() as usize;
            let want = &mc_want[doc];
            assert_eq!(got.len(), want.len(), "batch {batch} doc {doc}: {args}");
            for (g, w) in got.iter().zip(want) {
                worst = worst.max((g - w).abs());
                assert!((g - w).abs() < 1e-4, "batch {batch} doc {doc}: lm-eval {g} vs picaso score {w} ({args})");
            }
        }
        // Rolling: one log-likelihood per document.
        for row in &samples["picaso_rolling"] {
            let doc = row["doc_id"].as_u64().unwrap() as usize;
            let (_, got) = &recorded(std::slice::from_ref(row))[0];
            let w = rolling_want[doc];
            worst = worst.max((got[0] - w).abs());
            assert!((got[0] - w).abs() < 1e-4, "batch {batch} doc {doc}: lm-eval {} vs picaso score {w}", got[0]);
        }
        assert_eq!(samples["picaso_rolling"].len(), DOCS.len());
        // Generation: picaso generate's greedy text.
        for row in &samples["picaso_gen"] {
            let doc = row["doc_id"].as_u64().unwrap() as usize;
            assert_eq!(row["resps"][0][0].as_str().unwrap(), gen_want[doc], "batch {batch} doc {doc}");
        }
        assert_eq!(samples["picaso_gen"].len(), GEN.len());
    }
    eprintln!("lm-eval vs picaso score: max |difference| {worst:.2e} nats");

    // Chat: lm-eval's local-chat-completions renders nothing itself; the server applies the
    // fixture's template, and answers as picaso generate does on the rendered prompt.
    let out = tmp.path().join("out-chat");
    let chat = format!("base_url={}/v1/chat/completions,model=picaso-mamba2", server.url);
    let samples = lm_eval(
        &python,
        &[
            "--model",
            "local-chat-completions",
            "--model_args",
            &chat,
            "--tasks",
            "picaso_gen",
            "--include_path",
            tasks.to_str().unwrap(),
            "--apply_chat_template",
        ],
        &out,
    );
    let rows = &samples["picaso_gen"];
    assert_eq!(rows.len(), GEN.len());
    for row in rows {
        let doc = row["doc_id"].as_u64().unwrap() as usize;
        let rendered = format!("<|user|>\n{}\n<|assistant|>\n", GEN[doc].0);
        let want = generate(m, &rendered, 12, "\n");
        assert_eq!(row["resps"][0][0].as_str().unwrap(), want, "chat doc {doc}: {row}");
    }
}
