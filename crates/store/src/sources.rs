//! Reading documents to ingest and cutting them into contexts.
//!
//! Sources: a folder of `.txt` files (one document each), a JSON-lines file (`{"text": ..,
//! "id": ..}` per line), or a WikiText file (articles start at ` = Title = ` lines).
//! Segmentation: `paragraph` (blank-line separated blocks; for WikiText each line),
//! `tokens:N` (consecutive runs of N tokens of the whole document), or `halves[:MIN]` (each
//! paragraph of at least MIN tokens cut into two halves of equal tokens: the query and
//! continuation pairs of the paper's WikiText experiment).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::metadata::Metadata;

/// A source document: an id and its paragraphs.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    /// Stable id (file name, JSON id, article title): ingest skips (id, segment) pairs it has.
    pub id: String,
    /// Paragraphs in order.
    pub paragraphs: Vec<String>,
    /// Metadata every one of its contexts carries (a JSON line's other fields; none for files
    /// and articles).
    pub metadata: Metadata,
}

impl Document {
    /// A document without metadata.
    pub fn new(id: impl Into<String>, paragraphs: Vec<String>) -> Self {
        Self { id: id.into(), paragraphs, metadata: Metadata::new() }
    }
}

/// How documents become contexts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segmentation {
    /// One context per paragraph.
    Paragraph,
    /// Runs of this many tokens (up to three fewer where a cut would split a character).
    Tokens(usize),
    /// Paragraph `p` of at least this many tokens → segments `2p` (first half) and `2p + 1`
    /// (second half, the longer one when odd), cut at the middle token or, where that would
    /// split a character, at the nearest token that starts one.
    Halves(usize),
}

/// Shortest paragraph `halves` keeps by default (tokens).
pub const HALVES_MIN_TOKENS: usize = 16;

impl std::fmt::Display for Segmentation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Paragraph => f.write_str("paragraph"),
            Self::Tokens(n) => write!(f, "tokens:{n}"),
            Self::Halves(n) => write!(f, "halves:{n}"),
        }
    }
}

impl std::str::FromStr for Segmentation {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "paragraph" {
            return Ok(Self::Paragraph);
        }
        if s == "halves" {
            return Ok(Self::Halves(HALVES_MIN_TOKENS));
        }
        let bad = || format!("segmentation {s:?}: use `paragraph`, `tokens:N` or `halves:MIN` with N > 0 and MIN > 1");
        if let Some(n) = s.strip_prefix("tokens:") {
            return match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(Self::Tokens(n)),
                _ => Err(bad()),
            };
        }
        match s.strip_prefix("halves:").map(str::parse::<usize>) {
            Some(Ok(n)) if n > 1 => Ok(Self::Halves(n)),
            _ => Err(bad()),
        }
    }
}

/// Splits text into blank-line separated paragraphs, trimmed, empty ones dropped.
pub fn paragraphs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Vec<&str> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !current.is_empty() {
                out.push(current.join("\n"));
                current.clear();
            }
        } else {
            current.push(line.trim_end());
        }
    }
    if !current.is_empty() {
        out.push(current.join("\n"));
    }
    out.into_iter().map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect()
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Io { path: path.to_path_buf(), source: e })
}

/// Every `.txt` file under `dir` (sorted, recursively), one document each, id = relative path.
/// Symlinked folders are followed once: a link back up the tree (a loop) or to a folder already
/// read is skipped, so no file is read twice under two names.
pub fn read_text_dir(dir: &Path) -> Result<Vec<Document>> {
    let mut files = Vec::new();
    let real = |p: &Path| std::fs::canonicalize(p).map_err(|e| Error::Io { path: p.to_path_buf(), source: e });
    let mut seen = std::collections::HashSet::from([real(dir)?]);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| Error::Io { path: d.clone(), source: e })?;
        let mut paths = entries
            .map(|entry| entry.map(|e| e.path()).map_err(|e| Error::Io { path: d.clone(), source: e }))
            .collect::<Result<Vec<_>>>()?;
        // Sorted, and pushed in reverse: folders are read in name order, so which of two links
        // to one folder names its files does not depend on the file system's order.
        paths.sort();
        let mut folders = Vec::new();
        for p in paths {
            if p.is_dir() {
                if seen.insert(real(&p)?) {
                    folders.push(p);
                }
            } else if p.extension().is_some_and(|e| e == "txt") {
                files.push(p);
            }
        }
        stack.extend(folders.into_iter().rev());
    }
    files.sort();
    if files.is_empty() {
        return Err(Error::Input(format!("{}: no .txt files found", dir.display())));
    }
    files
        .into_iter()
        .map(|p: PathBuf| {
            let id = p.strip_prefix(dir).unwrap_or(&p).to_string_lossy().into_owned();
            Ok(Document::new(id, paragraphs(&read(&p)?)))
        })
        .collect()
}

/// One document per line of a JSON-lines file: `{"text": "...", "id": "..."}` (`title` is
/// accepted as an id too). Without one a line is named `FILE:LINE` (`facts.jsonl:3`): by its
/// file, so that two files' lines never take each other's place in a store. Every other field
/// (`title`, `url`, `date`, ...) is the document's metadata.
pub fn read_jsonl(path: &Path) -> Result<Vec<Document>> {
    let text = read(path)?;
    let file = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    let mut docs = Vec::new();
    let mut first_line_of: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| Error::Input(format!("{}: not JSON: {e}", at())))?;
        let body = v
            .get("text")
            .and_then(|t| t.as_str())
            .ok_or_else(|| Error::Input(format!("{}: expected an object with a string field \"text\"", at())))?;
        let id = match v.get("id").or_else(|| v.get("title")) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => format!("{file}:{}", i + 1),
        };
        if let Some(first) = first_line_of.insert(id.clone(), i + 1) {
            return Err(Error::Input(format!(
                "{}: id {id:?} is also the id of line {first}; give every document its own id \
                 (ingest keeps one context per id and paragraph)",
                at()
            )));
        }
        let mut metadata = v.as_object().cloned().unwrap_or_default();
        metadata.remove("text");
        metadata.remove("id");
        docs.push(Document { id, paragraphs: paragraphs(body), metadata });
    }
    Ok(docs)
}

/// WikiText's spacing undone, as lm-evaluation-harness does for `wikitext-2-raw-v1`
/// (`wikitext_detokenizer`): ` @-@ ` → `-`, ` , ` → `, `, `( x )` → `(x)`, ` 's` → `'s`, …, so a
/// model trained on ordinary prose reads ordinary prose. `<unk>` (tokenized splits only) stays.
pub fn detokenize_wikitext(text: &str) -> String {
    use std::sync::OnceLock;
    static PATTERNS: OnceLock<Vec<(regex::Regex, &'static str)>> = OnceLock::new();
    let patterns = PATTERNS.get_or_init(|| {
        [
            (r"/' [0-9]/", r"/'[0-9]/"),
            (r"\(\s*([^\)]*?)\s*\)", "($1)"),
            (r"\[\s*([^\]]*?)\s*\]", "[$1]"),
            (r"\{\s*([^}]*?)\s*\}", "{$1}"),
            (r#""\s*([^"]*?)\s*""#, "\"$1\""),
            (r"'\s*([^']*?)\s*'", "'$1'"),
        ]
        .into_iter()
        .map(|(p, r)| (regex::Regex::new(p).expect("valid pattern"), r))
        .collect()
    });
    let mut s = text.replace("s '", "s'");
    s = patterns[0].0.replace_all(&s, patterns[0].1).into_owned();
    for (from, to) in [
        (" @-@ ", "-"),
        (" @,@ ", ","),
        (" @.@ ", "."),
        (" : ", ": "),
        (" ; ", "; "),
        (" . ", ". "),
        (" ! ", "! "),
        (" ? ", "? "),
        (" , ", ", "),
    ] {
        s = s.replace(from, to);
    }
    for (re, to) in &patterns[1..] {
        s = re.replace_all(&s, *to).into_owned();
    }
    for (from, to) in [
        ("= = = =", "===="),
        ("= = =", "==="),
        ("= =", "=="),
        (" \u{b0} ", "\u{b0}"),
        (" \n", "\n"),
        ("\n ", "\n"),
        (" N ", " 1 "),
        (" 's", "'s"),
    ] {
        s = s.replace(from, to);
    }
    s
}

/// Articles of a WikiText file (the tokenized `wiki.*.tokens` or the raw `wiki.*.raw`, LF or
/// CRLF). A line ` = Title = ` starts an article; ` = = Section = = ` lines are headings,
/// skipped; every other non-empty line is a paragraph, detokenized ([`detokenize_wikitext`]).
pub fn read_wikitext(path: &Path) -> Result<Vec<Document>> {
    let text = read(path)?;
    let mut docs: Vec<Document> = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for raw in text.lines() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if line.starts_with("= ") && line.ends_with(" =") {
            let inner = line.trim_matches('=').trim();
            let is_title = !line.starts_with("= =");
            if is_title {
                let title = detokenize_wikitext(&format!(" {inner} ")).trim().to_string();
                // Titles repeat in WikiText; keep ids unique and stable: "T", "T #2", "T #3", …
                let mut id = title.clone();
                let mut n = 1;
                while !ids.insert(id.clone()) {
                    n += 1;
                    id = format!("{title} #{n}");
                }
                docs.push(Document::new(id, Vec::new()));
            }
            continue;
        }
        if docs.is_empty() {
            ids.insert("preamble".to_string());
            docs.push(Document::new("preamble", Vec::new()));
        }
        // Detokenized with the spaces the file has around each line, as the harness sees them.
        let text = detokenize_wikitext(&format!(" {line} "));
        docs.last_mut().expect("a document exists").paragraphs.push(text.trim().to_string());
    }
    docs.retain(|d| !d.paragraphs.is_empty());
    Ok(docs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paragraphs_split_on_blank_lines() {
        assert_eq!(paragraphs("a\nb\n\n\n c \n\n"), vec!["a\nb".to_string(), "c".to_string()]);
        assert!(paragraphs("\n \n").is_empty());
    }

    #[test]
    fn wikitext_is_detokenized_like_the_harness() {
        let line = " The 2 @,@ 000 @-@ strong army , led by \" The Duke \" ( 1805 – 1852 ) , won . It 's 3 @.@ 5 km . ";
        assert_eq!(
            detokenize_wikitext(line).trim(),
            "The 2,000-strong army, led by \"The Duke\" (1805 – 1852), won. It's 3.5 km."
        );
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("wiki.test.raw");
        std::fs::write(&f, " = Big Cat = \r\n Cats are big . \r\n = = Size = = \r\n They weigh 1 @,@ 000 kg . \r\n")
            .unwrap();
        let docs = read_wikitext(&f).unwrap();
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].id, "Big Cat");
        assert_eq!(docs[0].paragraphs, vec!["Cats are big.", "They weigh 1,000 kg."]);
    }

    #[test]
    fn segmentation_parses() {
        assert_eq!("paragraph".parse(), Ok(Segmentation::Paragraph));
        assert_eq!("tokens:64".parse(), Ok(Segmentation::Tokens(64)));
        assert!("tokens:0".parse::<Segmentation>().is_err());
        assert_eq!("halves".parse(), Ok(Segmentation::Halves(HALVES_MIN_TOKENS)));
        assert_eq!("halves:40".parse(), Ok(Segmentation::Halves(40)));
        assert!("halves:1".parse::<Segmentation>().is_err());
        for s in [Segmentation::Paragraph, Segmentation::Tokens(7), Segmentation::Halves(20)] {
            assert_eq!(s.to_string().parse(), Ok(s));
        }
        assert!("lines".parse::<Segmentation>().is_err());
    }
}
