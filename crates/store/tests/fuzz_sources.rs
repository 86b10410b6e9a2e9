//! Structured fuzzing of the document readers (`--wikitext`, `--jsonl`, `--docs`): text built
//! from the pieces real files have (titles, headings, WikiText spacing, `<unk>`, CRLF, quotes,
//! non-ASCII) and from arbitrary bytes. A reader never panics; what it returns keeps its
//! promises (ids unique, paragraphs trimmed and non-empty, nothing dropped or invented), and a
//! file it cannot read is an error naming the file (and line).
//!
//! More cases: `PROPTEST_CASES=50000 cargo test --release -p picaso-store --test fuzz_sources`
//! (or `scripts/fuzz.sh sources SECONDS`).

use std::collections::HashSet;
use std::path::Path;

use picaso_store::{read_jsonl, read_text_dir, read_wikitext, Document};
use proptest::prelude::*;
use serde_json::{json, Value};

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000)
}

/// Words and marks that WikiText and prose files are made of.
fn word() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "the", "Tower", "@-@", "@,@", "@.@", "<unk>", ",", ".", "'s", "s '", "(", ")", "\"", "'", "[", "]", "{",
            "}", "=", "= =", ":", ";", "!", "?", "N", "°", "é", "北京", "\u{200b}", "\t", "#2", "#", "\\", "\u{feff}",
        ])
        .prop_map(str::to_string),
        "[a-zA-Z0-9]{1,8}",
        any::<char>().prop_map(|c| c.to_string()),
    ]
}

fn words(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(word(), 0..max).prop_map(|w| w.join(" "))
}

/// One line of a WikiText file.
fn wikitext_line() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => words(4).prop_map(|t| format!(" = {t} = ")),
        1 => prop::sample::select(vec!["A", "B", "A #2", "preamble"]).prop_map(|t| format!(" = {t} = ")),
        2 => words(4).prop_map(|t| format!(" = = {t} = = ")),
        6 => words(20).prop_map(|t| format!(" {t} ")),
        2 => Just(String::new()),
        1 => Just(" ".to_string()),
    ]
}

/// A WikiText file: lines joined with LF or CRLF.
fn wikitext_file() -> impl Strategy<Value = (Vec<String>, bool)> {
    (prop::collection::vec(wikitext_line(), 0..40), any::<bool>())
}

fn is_heading(line: &str) -> bool {
    let t = line.trim();
    t.starts_with("= ") && t.ends_with(" =")
}

fn check_paragraphs(docs: &[Document]) -> Result<(), TestCaseError> {
    let mut ids = HashSet::new();
    for d in docs {
        prop_assert!(ids.insert(d.id.clone()), "id {:?} repeats", d.id);
        prop_assert!(!d.paragraphs.is_empty(), "document {:?} has no paragraphs", d.id);
        for p in &d.paragraphs {
            prop_assert!(!p.is_empty() && p.trim() == p, "paragraph {p:?} of {:?} is empty or untrimmed", d.id);
        }
    }
    Ok(())
}

/// A JSON-lines line: a document object with fields of any type, or something that is not one.
fn jsonl_line() -> impl Strategy<Value = String> {
    let field = prop_oneof![
        words(12).prop_map(Value::String),
        any::<i64>().prop_map(|v| json!(v)),
        Just(Value::Null),
        Just(json!([1, 2])),
        Just(json!({"a": 1})),
        any::<bool>().prop_map(Value::Bool),
    ];
    let id = prop_oneof![
        Just(None),
        prop::sample::select(vec!["a", "b", "1", "docs.jsonl:3"]).prop_map(|s| Some(json!(s))),
        (0i64..4).prop_map(|v| Some(json!(v))),
        words(2).prop_map(|s| Some(json!(s))),
    ];
    prop_oneof![
        8 => (words(30), id.clone()).prop_map(|(text, id)| {
            let mut o = json!({"text": text});
            if let Some(id) = id { o["id"] = id; }
            o.to_string()
        }),
        1 => (field, id).prop_map(|(text, id)| json!({"text": text, "title": id}).to_string()),
        1 => prop::sample::select(vec!["", "   ", "[1,2]", "\"text\"", "{\"text\": \"unterminated", "{}", "null", "{\"text\": \"a\"} trailing"])
            .prop_map(str::to_string),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// A WikiText file: every non-heading line becomes one paragraph of the article it is in;
    /// ids are unique; nothing panics.
    #[test]
    fn wikitext_files_keep_every_paragraph_once((lines, crlf) in wikitext_file()) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("wiki.txt");
        let text = lines.join(if crlf { "\r\n" } else { "\n" });
        std::fs::write(&path, &text).unwrap();
        let docs = read_wikitext(&path).unwrap();
        check_paragraphs(&docs)?;
        let body_lines = text.lines().filter(|l| !l.trim().is_empty() && !is_heading(l)).count();
        let paragraphs: usize = docs.iter().map(|d| d.paragraphs.len()).sum();
        prop_assert_eq!(paragraphs, body_lines);
    }

    /// A JSON-lines file: read in full, one document per non-empty line, or refused with the
    /// line that is wrong; ids are unique.
    #[test]
    fn jsonl_files_are_read_in_full_or_refused_with_the_line(lines in prop::collection::vec(jsonl_line(), 0..30)) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("docs.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        match read_jsonl(&path) {
            Ok(docs) => {
                prop_assert_eq!(docs.len(), lines.iter().filter(|l| !l.trim().is_empty()).count());
                let mut ids = HashSet::new();
                for d in &docs {
                    prop_assert!(ids.insert(d.id.clone()), "id {:?} repeats", d.id);
                    for p in &d.paragraphs {
                        prop_assert!(!p.is_empty() && p.trim() == p);
                    }
                }
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.contains("docs.jsonl:"), "the error names no line: {msg}");
            }
        }
    }

    /// Arbitrary bytes: every reader answers (documents or an error naming the file), never panics.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("input.txt");
        std::fs::write(&path, &bytes).unwrap();
        for read in [read_wikitext as fn(&Path) -> _, read_jsonl, read_text_dir] {
            match std::panic::catch_unwind(|| read(&path)) {
                Err(_) => prop_assert!(false, "a reader panicked on {bytes:?}"),
                Ok(Ok(docs)) => {
                    let mut ids = HashSet::new();
                    prop_assert!(docs.iter().all(|d| ids.insert(d.id.clone())), "ids repeat");
                }
                Ok(Err(e)) => prop_assert!(e.to_string().contains("input.txt"), "{e}"),
            }
        }
    }

    /// A folder of files, nested, some not `.txt`, some not UTF-8: one document per `.txt`
    /// file in sorted order, or an error naming the unreadable file.
    #[test]
    fn text_folders_give_one_document_per_txt_file(
        files in prop::collection::vec(("[a-c]{1,2}(/[a-c]{1,2})?", prop::sample::select(vec!["txt", "md", "TXT"]), words(20), any::<bool>()), 0..8),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("docs");
        std::fs::create_dir_all(&root).unwrap();
        let mut written = std::collections::BTreeMap::new();
        for (name, ext, text, valid) in &files {
            let rel = format!("{name}.{ext}");
            let path = root.join(&rel);
            // Skip names that clash with a folder or a file already there.
            if path.is_dir() || path.ancestors().skip(1).take_while(|p| *p != root).any(|p| p.is_file()) {
                continue;
            }
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let bytes = if *valid { text.clone().into_bytes() } else { vec![b'a', 0xff, 0xfe] };
            std::fs::write(&path, &bytes).unwrap();
            if *ext == "txt" {
                written.insert(rel, *valid);
            }
        }
        let bad_utf8 = written.values().any(|valid| !valid);
        match read_text_dir(&root) {
            Ok(docs) => {
                prop_assert!(!bad_utf8, "a file that is not UTF-8 was read");
                let ids: Vec<&str> = docs.iter().map(|d| d.id.as_str()).collect();
                // Sorted as paths (component by component), as the reader sorts them.
                let mut want: Vec<&str> = written.keys().map(String::as_str).collect();
                want.sort_by(|a, b| Path::new(a).cmp(Path::new(b)));
                prop_assert_eq!(ids, want);
            }
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(bad_utf8 || written.is_empty(), "refused a readable folder: {msg}");
                prop_assert!(msg.contains("docs"), "{msg}");
            }
        }
    }
}

/// Repeated titles stay unique even when one looks like a numbered repeat (found while writing
/// this harness: "A #2", "A", "A" gave two documents with the id "A #2").
#[test]
fn repeated_titles_get_unique_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("wiki.txt");
    std::fs::write(&path, " = A #2 = \n x \n = A = \n y \n = A = \n z \n").unwrap();
    let ids: Vec<String> = read_wikitext(&path).unwrap().into_iter().map(|d| d.id).collect();
    assert_eq!(ids, ["A #2", "A", "A #3"]);
}

/// Two JSON-lines documents with one id would be stored as one: refused, with both lines.
#[test]
fn repeated_jsonl_ids_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("docs.jsonl");
    std::fs::write(&path, "{\"text\": \"a\", \"id\": \"x\"}\n{\"text\": \"b\"}\n{\"text\": \"c\", \"id\": \"x\"}\n")
        .unwrap();
    let e = read_jsonl(&path).unwrap_err().to_string();
    assert!(e.contains("docs.jsonl:3") && e.contains("line 1"), "{e}");
}

/// A symlink back up the tree (a loop) and a second link to a folder: every file is read once,
/// under the name of its first path in name order.
#[cfg(unix)]
#[test]
fn linked_folders_are_read_once() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("docs");
    std::fs::create_dir_all(root.join("b")).unwrap();
    std::fs::write(root.join("a.txt"), "Alpha.").unwrap();
    std::fs::write(root.join("b/c.txt"), "Gamma.").unwrap();
    std::os::unix::fs::symlink(".", root.join("loop")).unwrap();
    std::os::unix::fs::symlink(root.join("b"), root.join("z-link")).unwrap();
    let ids: Vec<String> = read_text_dir(&root).unwrap().into_iter().map(|d| d.id).collect();
    assert_eq!(ids, ["a.txt", "b/c.txt"]);
}
