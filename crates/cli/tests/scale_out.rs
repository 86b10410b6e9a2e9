//! Stores on shared backends: `picaso migrate` between a folder and S3 + PostgreSQL (verified
//! both ways), two servers over one shared store, and backend outages during a load run (fail
//! fast with 503, nothing half-written, recovery without restart).
//!
//! The S3 + PostgreSQL parts need `PICASO_TEST_POSTGRES` and `PICASO_TEST_S3` (CI starts both
//! services with `.ci/services`); outages are made by a TCP proxy between the server and each
//! service that stops answering, cuts its open connections, and later resumes.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::{args, ok, ok_s, run, shared, shared_backend, text_model, write_docs, Server, TestDb};

/// Contexts 1..=4 of `write_docs` in a new store at `db`; returns (model, embedder) paths.
fn ingested(db: &TestDb, model: &tempfile::TempDir, embedder: &std::path::Path, docs: &std::path::Path) {
    let (m, e, d) = (model.path().to_str().unwrap(), embedder.to_str().unwrap(), docs.to_str().unwrap());
    let v = ok_s(&args(&["ingest"], db, &["--model", m, "--embedder", e, "--text-dir", d, "--json"]));
    assert_eq!(v["added"], 4);
}

/// Folder → S3 + PostgreSQL → folder: every context arrives with its id, row, embedding and
/// state bytes; queries answer the same; re-running skips; bad targets are refused.
#[test]
fn migrate_between_backends_and_verify() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    let folder = TestDb { db: tmp.path().join("a").to_str().unwrap().into(), states: None };
    ingested(&folder, &model, &embedder, &docs);
    let m = model.path().to_str().unwrap();
    let query = |db: &str| {
        ok(&[
            "query",
            "--db",
            db,
            "--model",
            m,
            "--ids",
            "3,1",
            "--max-tokens",
            "6",
            "--temperature",
            "0",
            "--json",
            "The tower",
        ])["text"]
            .clone()
    };
    let want = query(&folder.db);
    // Metadata travels with the contexts.
    let cited = serde_json::json!({"url": "https://example.org/eiffel", "year": 1889});
    let cited = cited.as_object().unwrap().clone();
    picaso_store::Store::open(folder.location()).unwrap().set_metadata(&[1, 3], &cited).unwrap();

    // Through the shared backends when configured, else folder → folder.
    let middle = shared_backend("migrate")
        .unwrap_or_else(|| TestDb { db: tmp.path().join("b").to_str().unwrap().into(), states: None });
    let mut to_args = vec!["migrate", "--from", folder.db.as_str(), "--to", middle.db.as_str(), "--json"];
    if let Some(s) = &middle.states {
        to_args.extend(["--to-states", s.as_str()]);
    }
    let r = ok(&to_args);
    assert_eq!((r["report"]["copied"].as_u64(), r["report"]["verified"].as_u64()), (Some(4), Some(4)), "{r}");
    assert_eq!(query(&middle.db), want, "the migrated store answers the same");
    let again = ok(&to_args);
    assert_eq!((again["report"]["copied"].as_u64(), again["report"]["skipped"].as_u64()), (Some(0), Some(4)));

    // Ids are never reused: a context added after migrating, deleted, then the migration run
    // again (which copies ids in) must not hand the deleted id to the next new context (a
    // server's cache keyed by id would serve the deleted context's state for it).
    let (m, e) = (model.path().to_str().unwrap(), embedder.to_str().unwrap());
    let add = |name: &str, text: &str| -> i64 {
        let dir = tmp.path().join(format!("add-{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("{name}.txt")), text).unwrap();
        let d = dir.to_str().unwrap();
        ok_s(&args(&["ingest"], &middle, &["--model", m, "--embedder", e, "--text-dir", d]));
        let store = picaso_store::Store::open(middle.location()).unwrap();
        store.segments_of(&format!("{name}.txt")).unwrap()[&0]
    };
    let lion = add("lion", "Lions live in prides.\n");
    assert_eq!(lion, 5);
    picaso_store::Store::open(middle.location()).unwrap().delete(lion).unwrap();
    ok(&to_args);
    let otter = add("otter", "Otters hold hands while they sleep.\n");
    assert_eq!(otter, 6, "the deleted context's id 5 was handed out again");
    picaso_store::Store::open(middle.location()).unwrap().delete(otter).unwrap();

    // Ids survive (a deleted id stays a gap), and the copy back is identical.
    let store = picaso_store::Store::open(middle.location()).unwrap();
    assert_eq!(store.ids().unwrap(), vec![1, 2, 3, 4]);
    store.delete(2).unwrap();
    let back = tmp.path().join("c");
    let r = ok(&["migrate", "--from", middle.db.as_str(), "--to", back.to_str().unwrap(), "--json"]);
    assert_eq!(r["report"]["verified"].as_u64(), Some(3));
    let copy = picaso_store::Store::open(back.as_path()).unwrap();
    assert_eq!(copy.ids().unwrap(), vec![1, 3, 4]);
    for id in [1, 3, 4] {
        let (a, b) = (store.get(id).unwrap(), copy.get(id).unwrap());
        assert_eq!((a.doc, a.seg, a.text, a.checksum), (b.doc, b.seg, b.text, b.checksum));
        assert_eq!(a.metadata, b.metadata);
        assert_eq!(b.metadata.is_empty(), id == 4, "context {id}'s metadata came through both migrations");
        assert_eq!(store.embedding(id).unwrap(), copy.embedding(id).unwrap());
        assert_eq!(store.map_state(id).unwrap().bytes(), copy.map_state(id).unwrap().bytes());
    }
    assert_eq!(query(back.to_str().unwrap()), want, "contexts 3 and 1 came back unchanged");
    // A new context after migrating gets a fresh id, never a copied one.
    let more = tmp.path().join("more");
    std::fs::create_dir_all(&more).unwrap();
    std::fs::write(more.join("zebra.txt"), "Zebras have stripes.\n").unwrap();
    let e = embedder.to_str().unwrap();
    ok(&[
        "ingest",
        "--db",
        back.to_str().unwrap(),
        "--model",
        m,
        "--embedder",
        e,
        "--text-dir",
        more.to_str().unwrap(),
    ]);
    assert_eq!(copy_ids(back.as_path()), vec![1, 3, 4, 5]);

    // Bad input: a target holding other contexts, a source that is not a store, a bad URL.
    let (success, _, stderr) = run(&["migrate", "--from", folder.db.as_str(), "--to", back.to_str().unwrap()]);
    assert!(
        !success && stderr.contains("already holds context 5") && stderr.contains("migrate into an empty store"),
        "{stderr}"
    );
    assert_eq!(copy_ids(back.as_path()), vec![1, 3, 4, 5], "refused before copying anything (context 2 stays out)");
    let (success, _, stderr) = run(&["migrate", "--from", docs.to_str().unwrap(), "--to", back.to_str().unwrap()]);
    assert!(!success && stderr.contains("not a picaso store"), "{stderr}");
    let (success, _, stderr) = run(&["migrate", "--from", folder.db.as_str(), "--to", "mysql://x/y"]);
    assert!(!success && stderr.contains("unknown scheme"), "{stderr}");
    let (success, _, stderr) =
        run(&["migrate", "--from", folder.db.as_str(), "--to", "postgres://u@127.0.0.1:1/x", "--to-states", "s3://b"]);
    assert!(!success && stderr.contains("unavailable"), "an unreachable database is named: {stderr}");
}

/// A PostgreSQL store is created whole or not at all: refused for lack of a states location,
/// it leaves no tables behind (they made a store that every later command refused).
#[test]
fn a_refused_creation_leaves_no_store() {
    let Some(db) = shared_backend("refused") else { return };
    let info = picaso_store::StoreInfo { fingerprint: "f".into(), dim: 4, state_dtype: Default::default() };
    let without_states = picaso_store::Location::parse(&db.db, None).unwrap();
    let e = picaso_store::Store::open_or_create(without_states, &info).unwrap_err().to_string();
    assert!(e.contains("needs a states location"), "{e}");
    let catalog = picaso_store::catalog::PostgresCatalog::connect(&db.db).unwrap();
    assert!(!catalog.exists().unwrap(), "the refused creation left tables");
    let (success, _, stderr) = run(&["stats", "--db", &db.db]);
    assert!(!success && stderr.contains("holds no picaso store"), "{stderr}");
    // With states, the store is created with all its metadata at once.
    let store = picaso_store::Store::open_or_create(db.location(), &info).unwrap();
    assert_eq!(store.info(), &info);
}

fn copy_ids(dir: &std::path::Path) -> Vec<i64> {
    picaso_store::Store::open(dir).unwrap().ids().unwrap()
}

/// Two servers over one S3 + PostgreSQL store: a context added through A is retrieved and used
/// by B at once, and answers agree.
#[test]
fn two_servers_share_one_store() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let Some(db) = shared_backend("two_servers") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    ingested(&db, &model, &embedder, &docs);
    let serve_args =
        args(&[], &db, &["--model", model.path().to_str().unwrap(), "--embedder", embedder.to_str().unwrap()]);
    let serve_args: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    let (a, b) = (Server::start(&serve_args), Server::start(&serve_args));
    let (status, added) = a.call_json("POST", "/v1/contexts", Some(json!({"text": "Bananas are rich in potassium."})));
    assert_eq!(status, 201, "{added}");
    let id = added["id"].as_i64().unwrap();
    let (status, rec) = b.call_json("GET", &format!("/v1/contexts/{id}"), None);
    assert_eq!((status, rec["text"].as_str()), (200, Some("Bananas are rich in potassium.")));
    let (_, found) = b.call_json("POST", "/v1/search", Some(json!({"query": "Which fruit has potassium?", "k": 1})));
    assert_eq!(found["results"][0]["id"].as_i64(), Some(id), "B retrieves A's context: {found}");
    let body = json!({"prompt": "Bananas", "max_tokens": 6, "temperature": 0, "contexts": [id, 2]});
    let (sa, va) = a.call_json("POST", "/v1/completions", Some(body.clone()));
    let (sb, vb) = b.call_json("POST", "/v1/completions", Some(body));
    assert_eq!((sa, sb), (200, 200), "{vb}");
    assert_eq!(va["choices"][0]["text"], vb["choices"][0]["text"], "both servers compose the same states");
    let (_, hb) = b.call_json("GET", "/health", None);
    assert_eq!(hb["contexts"], 5);
    // Deleted through B: gone for A.
    assert_eq!(b.call_json("DELETE", &format!("/v1/contexts/{id}"), None).0, 200);
    assert_eq!(a.call_json("GET", &format!("/v1/contexts/{id}"), None).0, 404);
    let (status, v) =
        a.call_json("POST", "/v1/completions", Some(json!({"prompt": "Bananas", "max_tokens": 2, "contexts": [id]})));
    assert_eq!(status, 404, "A's cached state of a context deleted through B is not used: {v}");
}

/// A TCP proxy that can stop answering: new connections are closed at once, open ones are cut.
struct Proxy {
    addr: SocketAddr,
    up: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let open = Arc::new(Mutex::new(Vec::<TcpStream>::new()));
        let (up2, open2) = (up.clone(), open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if !up2.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream) else { continue };
                let mut list = open2.lock().unwrap();
                list.push(client.try_clone().unwrap());
                list.push(server.try_clone().unwrap());
                drop(list);
                for (mut from, mut to) in [(client.try_clone().unwrap(), server.try_clone().unwrap()), (server, client)]
                {
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(Shutdown::Both);
                    });
                }
            }
        });
        Proxy { addr, up, open }
    }

    fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn resume(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

/// `host:port` of a URL's authority.
fn authority(url: &str) -> String {
    let rest = url.split_once("://").map(|x| x.1).unwrap_or(url);
    let rest = rest.rsplit_once('@').map(|x| x.1).unwrap_or(rest);
    rest.split(['/', '?']).next().unwrap().to_string()
}

/// While clients keep calling, PostgreSQL and then S3 go down and come back. Requests that
/// need the missing service fail fast with 503 and a JSON error; nothing half-written appears;
/// the same server process serves again once the service is back.
#[test]
fn backend_outages_fail_fast_and_recover() {
    let (Some(model), Some(embedder)) = (text_model(1), shared("all-MiniLM-L6-v2")) else { return };
    let Some(db) = shared_backend("outage") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let docs = tmp.path().join("docs");
    write_docs(&docs);
    ingested(&db, &model, &embedder, &docs);

    let pg = authority(&db.db);
    let s3_endpoint = std::env::var("AWS_ENDPOINT_URL").expect("the S3 test service sets AWS_ENDPOINT_URL");
    let pg_proxy = Proxy::start(pg.parse().unwrap());
    let s3_proxy = Proxy::start(authority(&s3_endpoint).parse().unwrap());
    let proxied = TestDb { db: db.db.replacen(&pg, &pg_proxy.addr.to_string(), 1), states: None };
    let env = [
        ("AWS_ENDPOINT_URL", format!("http://{}", s3_proxy.addr)),
        ("PICASO_BACKEND_RETRY_MS", "1000".to_string()),
        ("PICASO_BACKEND_TIMEOUT_MS", "2000".to_string()),
    ];
    let serve_args = args(
        &[],
        &proxied,
        &["--model", model.path().to_str().unwrap(), "--embedder", embedder.to_str().unwrap(), "--cache-mb", "0"],
    );
    let serve_args: Vec<&str> = serve_args.iter().map(String::as_str).collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let server = Server::start_with(&serve_args, &env);
    let complete = json!({"prompt": "The tower", "max_tokens": 2, "temperature": 0, "contexts": [3, 2]});
    assert_eq!(server.call_json("POST", "/v1/completions", Some(complete.clone())).0, 200);

    // A load run in the background for the whole test: every answer is 200 or 503.
    let stop = Arc::new(AtomicBool::new(false));
    let statuses = Arc::new(Mutex::new(Vec::new()));
    let load = {
        let (stop, statuses, url, body) = (stop.clone(), statuses.clone(), server.url.clone(), complete.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let r = ureq::post(&format!("{url}/v1/completions")).send_string(&body.to_string());
                let status = match r {
                    Ok(r) => r.status(),
                    Err(ureq::Error::Status(s, _)) => s,
                    Err(e) => panic!("the server stopped answering: {e}"),
                };
                statuses.lock().unwrap().push(status);
            }
        })
    };

    let expect_503 = |method: &str, path: &str, body: Option<Value>| {
        let t0 = Instant::now();
        let (status, v) = server.call_json(method, path, body);
        let took = t0.elapsed();
        assert_eq!(status, 503, "{method} {path} while a backend is down: {v}");
        assert_eq!(v["error"]["type"], "unavailable_error", "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("unavailable"), "{v}");
        assert!(took < Duration::from_secs(8), "{method} {path} took {took:?}: not fast");
    };
    let recovers = |what: &str| {
        let t0 = Instant::now();
        loop {
            let (status, v) = server.call_json("POST", "/v1/completions", Some(complete.clone()));
            if status == 200 {
                break;
            }
            assert_eq!(status, 503, "{v}");
            assert!(t0.elapsed() < Duration::from_secs(30), "no recovery after {what} came back");
            std::thread::sleep(Duration::from_millis(200));
        }
    };

    // PostgreSQL down.
    pg_proxy.down();
    expect_503("POST", "/v1/completions", Some(complete.clone()));
    expect_503("POST", "/v1/contexts", Some(json!({"text": "Written while the database is down."})));
    expect_503("GET", "/health", None);
    pg_proxy.resume();
    recovers("PostgreSQL");

    // S3 down: states cannot be read (no cache) or written.
    s3_proxy.down();
    expect_503("POST", "/v1/completions", Some(complete.clone()));
    expect_503("POST", "/v1/contexts", Some(json!({"text": "Written while the object store is down."})));
    assert_eq!(server.call_json("GET", "/health", None).0, 200, "the catalog still answers");
    s3_proxy.resume();
    recovers("S3");
    let (status, v) = server.call_json("POST", "/v1/contexts", Some(json!({"text": "Written after recovery."})));
    assert_eq!(status, 201, "{v}");

    // The load run is served again after recovery. On a busy machine its requests may all have
    // met an outage so far, so wait for one answered from now on.
    let recovered_at = statuses.lock().unwrap().len();
    let t0 = Instant::now();
    while !statuses.lock().unwrap()[recovered_at..].contains(&200) {
        assert!(t0.elapsed() < Duration::from_secs(60), "the load run was not served after recovery");
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    load.join().unwrap();
    let statuses = statuses.lock().unwrap();
    assert!(statuses.iter().all(|s| *s == 200 || *s == 503), "only 200 or 503 under outages: {statuses:?}");

    // Nothing half-written: the contexts are the 4 ingested and the one added after recovery,
    // and every state reads back with its checksum.
    let store = picaso_store::Store::open(db.location()).unwrap();
    let texts: Vec<String> = store.ids().unwrap().iter().map(|&id| store.get(id).unwrap().text).collect();
    assert_eq!(texts.len(), 5, "{texts:?}");
    assert!(!texts.iter().any(|t| t.contains("is down")), "{texts:?}");
    store.map_states(&store.ids().unwrap()).unwrap();
}
