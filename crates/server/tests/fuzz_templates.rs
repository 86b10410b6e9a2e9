//! Structured fuzzing of the template renderer: arbitrary templates (built from Jinja's
//! constructs, nested at random: loops, conditions, namespaces, macros, filters, string and
//! list arithmetic, and raw bytes) × arbitrary messages (any role, any JSON content), each
//! rendered in the sandbox child that renders a request's template. Nothing may panic, and
//! every render ends within its budget: the child answers (a render or a refusal) or stops at
//! its memory or CPU limit, always before the wall-clock deadline.
//!
//! More cases: `PROPTEST_CASES=20000 cargo test --release -p picaso-server --test fuzz_templates`
//! (or `scripts/fuzz.sh templates SECONDS`).

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use picaso_server::render::{Budget, Job, RenderError, SandboxLimits};
use proptest::prelude::*;
use serde_json::{json, Value};

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(200)
}

/// An expression: variables, literals, arithmetic that grows, and filters.
fn expression() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        Just("messages".to_string()),
        Just("messages[0].content".to_string()),
        Just("messages[-1]['role']".to_string()),
        Just("m.content".to_string()),
        Just("ns.x".to_string()),
        Just("loop.index".to_string()),
        Just("bos_token".to_string()),
        Just("undefined_thing".to_string()),
        (0i64..100_000).prop_map(|n| n.to_string()),
        "[a-z <>|{}%#'\"\\\\]{0,12}".prop_map(|s| format!("{s:?}")),
        Just("range(100000)".to_string()),
        Just("[1, 2, 3]".to_string()),
        Just("{'a': messages}".to_string()),
    ];
    leaf.prop_recursive(4, 24, 3, |inner| {
        let filter = prop_oneof![
            Just("upper"),
            Just("trim"),
            Just("tojson"),
            Just("length"),
            Just("join(',')"),
            Just("replace('a', 'aaaa')"),
            Just("list"),
            Just("reverse"),
            Just("first"),
            Just("default('', true)"),
            Just("string"),
            Just("items"),
        ];
        prop_oneof![
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} ~ {b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} + {b})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("({a} * {b})")),
            (inner.clone(), filter).prop_map(|(a, f)| format!("({a} | {f})")),
            (inner.clone(), inner.clone()).prop_map(|(a, b)| format!("{a}[{b}]")),
            inner.clone().prop_map(|a| format!("{a}.strip()")),
            inner.clone().prop_map(|a| format!("{a}.split(' ')")),
            (inner.clone(), inner).prop_map(|(a, b)| format!("({a} if {b} else '')")),
        ]
    })
}

/// A template body: text, output, control flow nested at random, and damaged syntax.
fn body() -> impl Strategy<Value = String> {
    let leaf = prop_oneof![
        "[a-zA-Z <>|\n]{0,10}",
        expression().prop_map(|e| format!("{{{{ {e} }}}}")),
        expression().prop_map(|e| format!("{{% set ns.x = {e} %}}")),
        expression().prop_map(|e| format!("{{{{ raise_exception({e}) }}}}")),
        Just("{{ f(1) }}".to_string()),
        Just("{% break %}".to_string()),
        Just("{% endfor %}".to_string()),
        "[{}%#]{1,6}",
    ];
    leaf.prop_recursive(4, 32, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 1..4).prop_map(|v| v.concat()),
            (expression(), inner.clone()).prop_map(|(e, b)| format!("{{% for m in {e} %}}{b}{{% endfor %}}")),
            (0u32..100_000, inner.clone()).prop_map(|(n, b)| format!("{{% for i in range({n}) %}}{b}{{% endfor %}}")),
            (expression(), inner.clone(), inner.clone())
                .prop_map(|(e, a, b)| format!("{{% if {e} %}}{a}{{% else %}}{b}{{% endif %}}")),
            inner.clone().prop_map(|b| format!("{{% macro f(n) %}}{b}{{{{ f(n + 1) }}}}{{% endmacro %}}{b}")),
            inner.prop_map(|b| format!("{{% filter upper %}}{b}{{% endfilter %}}")),
        ]
    })
    .prop_map(|b| format!("{{% set ns = namespace(x='ab') %}}{b}"))
}

/// A template: a generated body, or bytes of anything.
fn template() -> impl Strategy<Value = String> {
    prop_oneof![8 => body(), 1 => ".{0,200}"]
}

/// Messages of any shape the server could pass on (it checks only that each has a role).
fn messages() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        ".{0,40}".prop_map(Value::from),
        Just(Value::Null),
        any::<i64>().prop_map(Value::from),
        Just(json!({"nested": [1, {"deeper": "x"}]})),
        Just(json!([{"type": "text", "text": "part"}])),
    ];
    let message = ("(user|assistant|system|tool|[a-z]{0,6})", content)
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    prop::collection::vec(message, 0..6).prop_map(Value::from)
}

/// Renders in the sandbox child: its exit status, its stdout and stderr, and how long it took.
fn sandboxed(source: &str, messages: &Value, limits: SandboxLimits) -> (Option<i32>, Vec<u8>, String, Duration) {
    let job = Job {
        source: source.to_string(),
        budget: Budget::default(),
        limits,
        contexts: vec![json!({"messages": messages, "add_generation_prompt": true, "tools": [{"name": "t"}]})],
    };
    let started = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_picaso-render-template"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&serde_json::to_vec(&job).unwrap()).unwrap();
    // Read as it writes (a pipe holds 64 KiB).
    let read = |mut pipe: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            bytes
        })
    };
    let stdout = read(Box::new(child.stdout.take().unwrap()));
    let stderr = read(Box::new(child.stderr.take().unwrap()));
    // The server kills a child at the wall limit; here one that outlives it (with margin for
    // a loaded machine) is a failure, so it is killed and reported.
    let deadline = Duration::from_millis(limits.wall_ms) * 3;
    loop {
        if child.try_wait().unwrap().is_some() || started.elapsed() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = child.kill();
    let status = child.wait().unwrap();
    let took = started.elapsed();
    let (stdout, stderr) = (stdout.join().unwrap(), stderr.join().unwrap());
    (status.code(), stdout, String::from_utf8_lossy(&stderr).into_owned(), took)
}

#[test]
fn arbitrary_templates_end_within_their_budget_without_panics() {
    let limits = SandboxLimits { memory_bytes: 256 << 20, cpu_seconds: 1, wall_ms: 1000 };
    let config = ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let counts = std::cell::Cell::new((0u32, 0u32, 0u32)); // rendered, refused, stopped at a limit
    runner
        .run(&(template(), messages()), |(source, messages)| {
            let (code, stdout, stderr, took) = sandboxed(&source, &messages, limits);
            prop_assert!(!stderr.contains("panicked"), "a panic on {source:?}: {stderr}");
            prop_assert!(took < Duration::from_millis(limits.wall_ms) * 3, "{source:?} ran {took:?}");
            match code {
                Some(0) => {
                    let results: Vec<Result<String, RenderError>> = serde_json::from_slice(&stdout).unwrap();
                    prop_assert_eq!(results.len(), 1);
                    match &results[0] {
                        Ok(text) => {
                            prop_assert!(text.len() <= Budget::MAX_BYTES);
                            counts.set((counts.get().0 + 1, counts.get().1, counts.get().2));
                        }
                        Err(_) => counts.set((counts.get().0, counts.get().1 + 1, counts.get().2)),
                    }
                }
                // Killed at its limits: out of memory (abort on a failed allocation) or CPU.
                _ => {
                    let at_limit = stderr.contains("memory allocation of") || code.is_none();
                    prop_assert!(at_limit, "{source:?} exited {code:?}: {stderr}");
                    counts.set((counts.get().0, counts.get().1, counts.get().2 + 1));
                }
            }
            Ok(())
        })
        .unwrap();
    let (rendered, refused, limited) = counts.get();
    println!("{rendered} rendered, {refused} refused, {limited} stopped at a limit");
    assert!(rendered > 0 && refused > 0, "the generator should reach both outcomes");
}
