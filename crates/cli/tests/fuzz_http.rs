//! Structured fuzzing of `picaso serve`'s request bodies and paths: every endpoint gets JSON
//! whose fields are missing, retyped, extreme or unknown, bodies that are not JSON, wrong
//! content types, and ids of every shape. Every answer must be a client error (4xx) with the
//! documented JSON error body, or a success; never a 5xx, never a dropped connection, never a
//! malformed stream. Afterwards the server is healthy and holds no request in flight.
//!
//! More cases: `PROPTEST_CASES=20000 cargo test --release -p picaso --test fuzz_http`
//! (or `scripts/fuzz.sh http SECONDS`).

use std::io::{BufRead, BufReader};

use proptest::prelude::*;
use serde_json::{json, Map, Value};

mod common;
use common::{ok, shared, text_model, write_docs, Server};

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

/// A server over a tiny model and a small store, with low limits so that limits are hit; the
/// folders it needs live as long as it does.
fn start_server() -> Option<(Server, tempfile::TempDir, tempfile::TempDir)> {
    let (model, embedder) = (text_model(1)?, shared("all-MiniLM-L6-v2")?);
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let db = tmp.path().join("db");
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), db.to_str().unwrap());
    ok(&["ingest", "--db", d, "--model", m, "--embedder", e, "--text-dir", docs.to_str().unwrap(), "--json"]);
    let server = Server::start(&[
        "--db",
        d,
        "--model",
        m,
        "--embedder",
        e,
        "--max-prompt-tokens",
        "64",
        "--max-tokens-limit",
        "32",
    ]);
    Some((server, model, tmp))
}

/// Values that break naive handling: wrong types, extremes, empties, nesting.
fn hostile() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        prop::sample::select(vec![
            json!(null),
            json!(true),
            json!(0),
            json!(1),
            json!(-1),
            json!(2),
            json!(33),
            json!(u32::MAX),
            json!(u64::MAX),
            json!(i64::MIN),
            json!(0.5),
            json!(-0.0),
            json!(1e308),
            json!(-1e308),
            json!(""),
            json!(" "),
            json!("picaso-r"),
            json!("concat"),
            json!("\u{0}"),
            json!("\u{fffd}\u{10ffff}"),
            json!("The tower"),
        ]),
        any::<i64>().prop_map(|v| json!(v)),
        any::<f32>().prop_map(|v| if v.is_finite() { json!(v) } else { json!(0.25) }),
        ".{0,40}".prop_map(Value::String),
    ];
    leaf.prop_recursive(2, 24, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,10}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A field of a request: usually a plausible value, sometimes a hostile one.
fn field(plausible: Vec<Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => Just(None),
        4 => prop::sample::select(plausible).prop_map(Some),
        3 => hostile().prop_map(Some),
    ]
}

fn object(fields: Vec<(&'static str, Option<Value>)>, extra: Option<(String, Value)>) -> Value {
    let mut m: Map<String, Value> = fields.into_iter().filter_map(|(k, v)| Some((k.to_string(), v?))).collect();
    if let Some((k, v)) = extra {
        m.insert(k, v);
    }
    Value::Object(m)
}

fn extra() -> impl Strategy<Value = Option<(String, Value)>> {
    prop_oneof![4 => Just(None), 1 => ("[a-z_]{1,12}", hostile()).prop_map(Some)]
}

fn completion() -> impl Strategy<Value = Value> {
    (
        (
            field(vec![json!("The tower"), json!(["a", "b"]), json!([1, 2, 3]), json!(""), json!([])]),
            field(vec![json!(0), json!(1), json!(4), json!(32), json!(33)]),
            field(vec![json!(0), json!(0.7), json!(1), json!(-1), json!(100)]),
            field(vec![json!(1), json!(0.9), json!(0), json!(1.5)]),
            field(vec![json!(1), json!(42)]),
            field(vec![json!("."), json!(["\n", "the"]), json!(""), json!([])]),
            field(vec![json!(true), json!(false)]),
        ),
        (
            field(vec![json!([1, 2]), json!([4]), json!([]), json!([1, 1]), json!([999]), json!([-1])]),
            field(vec![json!(0), json!(1), json!(3), json!(1000)]),
            field(vec![
                json!("picaso-r"),
                json!("picaso-s"),
                json!("caso"),
                json!("soup"),
                json!("concat"),
                json!("naive"),
                json!("piconcat-r"),
                json!("PICASO-R"),
            ]),
            field(vec![json!("picaso"), json!("gpt-3.5-turbo-instruct")]),
            field(vec![json!(1), json!(2)]),
            field(vec![json!({"50256": -100}), json!({})]),
            extra(),
        ),
    )
        .prop_map(
            |(
                (prompt, max_tokens, temperature, top_p, seed, stop, stream),
                (contexts, retrieve, composition, model, n, logit_bias, extra),
            )| {
                object(
                    vec![
                        ("prompt", prompt),
                        ("max_tokens", max_tokens),
                        ("temperature", temperature),
                        ("top_p", top_p),
                        ("seed", seed),
                        ("stop", stop),
                        ("stream", stream),
                        ("contexts", contexts),
                        ("retrieve", retrieve),
                        ("composition", composition),
                        ("model", model),
                        ("n", n),
                        ("logit_bias", logit_bias),
                    ],
                    extra,
                )
            },
        )
}

fn add_context() -> impl Strategy<Value = Value> {
    (
        field(vec![
            json!("A new paragraph about towers."),
            json!("Another paragraph, about bridges."),
            json!(""),
            json!("x".repeat(300)),
        ]),
        field(vec![json!("fuzz"), json!(""), json!("eiffel.txt")]),
        field(vec![json!(0), json!(1), json!(-1), json!(u32::MAX), json!(u64::MAX)]),
        extra(),
    )
        .prop_map(|(text, doc, segment, extra)| object(vec![("text", text), ("doc", doc), ("segment", segment)], extra))
}

fn add_document() -> impl Strategy<Value = Value> {
    (
        field(vec![json!("fuzz-doc"), json!("a/b"), json!(""), json!("eiffel.txt")]),
        field(vec![
            json!("Towers.\n\nBridges."),
            json!("Towers, rewritten."),
            json!("\n\n"),
            json!("x".repeat(300)),
            json!("a\r\n\r\nb"),
        ]),
        extra(),
    )
        .prop_map(|(id, text, extra)| object(vec![("id", id), ("text", text)], extra))
}

fn search() -> impl Strategy<Value = Value> {
    (field(vec![json!("towers"), json!("")]), field(vec![json!(0), json!(1), json!(5), json!(1_000_000)]), extra())
        .prop_map(|(query, k, extra)| object(vec![("query", query), ("k", k)], extra))
}

fn attribute() -> impl Strategy<Value = Value> {
    (
        field(vec![json!("The tower"), json!(""), json!(["a"]), json!("word ".repeat(70))]),
        field(vec![json!(" is in Paris."), json!(""), json!(3), json!("x".repeat(300))]),
        field(vec![json!([1, 2]), json!([4]), json!([]), json!([1, 1]), json!([999]), json!([-1])]),
        field(vec![json!(0), json!(1), json!(3), json!(1000)]),
        field(vec![json!("picaso-r"), json!("concat"), json!("naive"), json!("soup"), json!("PICASO-R")]),
        extra(),
    )
        .prop_map(|(prompt, answer, contexts, retrieve, composition, extra)| {
            object(
                vec![
                    ("prompt", prompt),
                    ("answer", answer),
                    ("contexts", contexts),
                    ("retrieve", retrieve),
                    ("composition", composition),
                ],
                extra,
            )
        })
}

#[derive(Debug, Clone)]
enum Body {
    Json(Value),
    /// Bytes that are probably not JSON (or truncated JSON).
    Raw(Vec<u8>),
}

#[derive(Debug, Clone)]
struct Call {
    method: &'static str,
    path: String,
    content_type: Option<&'static str>,
    body: Option<Body>,
}

fn content_type() -> impl Strategy<Value = Option<&'static str>> {
    prop_oneof![
        8 => Just(Some("application/json")),
        1 => prop::sample::select(vec![
            None,
            Some("application/json; charset=utf-8"),
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
            Some("multipart/form-data; boundary=x"),
            Some("application/xml"),
            Some("*/*"),
        ]),
    ]
}

fn body(json_body: impl Strategy<Value = Value> + 'static) -> impl Strategy<Value = Body> {
    let json_body = json_body.boxed();
    prop_oneof![
        8 => json_body.clone().prop_map(Body::Json),
        1 => (json_body, any::<prop::sample::Index>()).prop_map(|(v, cut)| {
            let text = v.to_string();
            Body::Raw(text.as_bytes()[..cut.index(text.len() + 1)].to_vec())
        }),
        1 => prop::collection::vec(any::<u8>(), 0..200).prop_map(Body::Raw),
        1 => hostile().prop_map(Body::Json),
    ]
}

fn context_id() -> impl Strategy<Value = String> {
    prop_oneof![
        (0i64..8).prop_map(|v| v.to_string()),
        prop::sample::select(vec![
            "-1",
            "0",
            "9223372036854775807",
            "9223372036854775808",
            "1.5",
            "abc",
            "%ff",
            "%00",
            "1%2F2",
            "",
            "1;2"
        ])
        .prop_map(str::to_string),
    ]
}

/// A query string for `GET /v1/contexts` or `/v1/documents`: plausible, wrong and hostile
/// parameters.
fn list_query() -> impl Strategy<Value = String> {
    let part = prop::sample::select(vec![
        "doc=fuzz",
        "after=2",
        "after=-9223372036854775808",
        "after=x",
        "after=eiffel.txt",
        "after=%ff",
        "limit=1",
        "limit=1000",
        "limit=1001",
        "limit=0",
        "limit=-1",
        "limit=18446744073709551616",
        "page=2",
        "doc=a&doc=b",
        "%zz",
        "&&",
        "filter=%7B%22lang%22%3A%22fuzz%22%7D",
        "filter=%7B%22year%22%3A%7B%22%24gte%22%3A2000%7D%7D",
        "filter=%7B%7D",
        "filter=lang",
        "filter=%7B%22a%22%3A%7B%22%24gt%22%3Anull%7D%7D",
    ]);
    prop::collection::vec(part, 0..3).prop_map(|parts| parts.join("&"))
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        6 => (content_type(), body(completion())).prop_map(|(ct, b)| Call { method: "POST", path: "/v1/completions".into(), content_type: ct, body: Some(b) }),
        2 => (content_type(), body(add_context())).prop_map(|(ct, b)| Call { method: "POST", path: "/v1/contexts".into(), content_type: ct, body: Some(b) }),
        2 => (content_type(), body(search())).prop_map(|(ct, b)| Call { method: "POST", path: "/v1/search".into(), content_type: ct, body: Some(b) }),
        2 => (content_type(), body(attribute())).prop_map(|(ct, b)| Call { method: "POST", path: "/v1/attribute".into(), content_type: ct, body: Some(b) }),
        1 => (content_type(), body(add_document())).prop_map(|(ct, b)| Call { method: "POST", path: "/v1/documents".into(), content_type: ct, body: Some(b) }),
        1 => (prop::sample::select(vec!["GET", "DELETE", "PUT"]), prop::sample::select(vec!["fuzz-doc", "a/b", "a%2Fb", "eiffel.txt", "%ff", "", "x/../y"]))
            .prop_map(|(method, id)| Call { method, path: format!("/v1/documents/{id}"), content_type: None, body: None }),
        1 => (prop::sample::select(vec!["GET", "DELETE"]), prop::sample::select(vec!["contexts", "documents"]), list_query())
            .prop_map(|(method, what, q)| Call { method, path: format!("/v1/{what}?{q}"), content_type: None, body: None }),
        2 => (prop::sample::select(vec!["GET", "DELETE", "POST", "PUT"]), context_id())
            .prop_map(|(method, id)| Call { method, path: format!("/v1/contexts/{id}"), content_type: None, body: None }),
        1 => prop::sample::select(vec![
            ("GET", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/picaso"), ("GET", "/v1/models/x%ff"),
            ("POST", "/health"), ("GET", "/nowhere"), ("PATCH", "/v1/search"), ("GET", "/metrics"), ("GET", "/v1/attribute"),
        ])
        .prop_map(|(method, path)| Call { method, path: path.into(), content_type: None, body: None }),
    ]
}

/// Sends `c`; checks the answer's shape and returns its status. Err(why) for a broken promise.
fn check(server: &Server, c: &Call) -> Result<u16, String> {
    let mut req =
        ureq::request(c.method, &format!("{}{}", server.url, c.path)).timeout(std::time::Duration::from_secs(60));
    if let Some(ct) = c.content_type {
        req = req.set("content-type", ct);
    }
    let streaming = matches!(&c.body, Some(Body::Json(v)) if v.get("stream") == Some(&json!(true)));
    let resp = match &c.body {
        None => req.call(),
        Some(Body::Json(v)) => req.send_bytes(v.to_string().as_bytes()),
        Some(Body::Raw(b)) => req.send_bytes(b),
    };
    let resp = match resp {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Err(format!("no answer: {e}")),
    };
    let status = resp.status();
    if status >= 500 {
        return Err(format!("status {status}: {}", resp.into_string().unwrap_or_default()));
    }
    let is_sse = resp.header("content-type") == Some("text/event-stream");
    if is_sse {
        if status != 200 || !streaming {
            return Err(format!("an event stream with status {status} for a request that asked none"));
        }
        let mut done = false;
        for line in BufReader::new(resp.into_reader()).lines() {
            let line = line.map_err(|e| format!("the stream broke: {e}"))?;
            let Some(data) = line.strip_prefix("data: ") else { continue };
            if done {
                return Err(format!("data after [DONE]: {data}"));
            }
            if data == "[DONE]" {
                done = true;
            } else {
                serde_json::from_str::<Value>(data).map_err(|e| format!("an event that is not JSON ({e}): {data}"))?;
            }
        }
        return if done { Ok(status) } else { Err("the stream ended without [DONE]".into()) };
    }
    let text = resp.into_string().map_err(|e| format!("unreadable body: {e}"))?;
    if c.path == "/metrics" && status == 200 {
        return Ok(status);
    }
    let v: Value =
        serde_json::from_str(&text).map_err(|e| format!("status {status}, body not JSON ({e}): {text:?}"))?;
    if status >= 400 {
        let message = v["error"]["message"].as_str().unwrap_or_default();
        if message.trim().is_empty() || !v["error"]["type"].is_string() {
            return Err(format!("status {status}: not the documented error shape: {v}"));
        }
    }
    Ok(status)
}

/// Every case, then the server's health: nothing left in flight (the one `/metrics` request
/// that asks is counted while it runs), and `/health` answers.
#[test]
fn every_request_gets_a_client_error_or_an_answer() {
    let Some((server, _model, _dir)) = start_server() else { return };
    let server = &server;
    let config = ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() };
    let mut runner = proptest::test_runner::TestRunner::new(config);
    let statuses = std::sync::Mutex::new(std::collections::BTreeMap::<u16, usize>::new());
    let outcome = runner.run(&call(), |c| {
        let status = check(server, &c).map_err(|why| {
            TestCaseError::fail(format!("{} {} ({:?}) {:?}: {why}", c.method, c.path, c.content_type, c.body))
        })?;
        *statuses.lock().unwrap().entry(status).or_default() += 1;
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    eprintln!("answers by status: {:?}", statuses.into_inner().unwrap());
    let in_flight = server.metric("picaso_requests_in_flight");
    assert!(in_flight <= 1.0, "{in_flight} requests in flight on an idle server");
    let (status, health) = server.call("GET", "/health", None);
    assert_eq!((status, health["status"].as_str()), (200, Some("ok")));
}
