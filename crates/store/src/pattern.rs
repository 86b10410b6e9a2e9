//! `$regex` patterns of metadata filters: Rust's regex syntax (<https://docs.rs/regex>), answered
//! alike by both catalogs. The folder store matches with the `regex` crate; PostgreSQL gets the
//! pattern rewritten from its parsed form into its own dialect (ARE) with the same meaning, never
//! the user's text: every character as a code point escape, classes as explicit code point
//! ranges (case-insensitivity already expanded), no capturing groups, `^`/`$` as `\A`/`\Z`. A
//! construct the two engines would answer differently (word boundaries, CRLF mode, repetition
//! counts over 255) is refused, on every backend, so a filter means one thing everywhere.

use regex_syntax::hir::{Class, Hir, HirKind, Literal, Look};

use crate::error::{Error, Result};

/// The longest pattern a filter may give, in bytes.
pub const MAX_PATTERN_LEN: usize = 1024;

/// The largest repetition count (PostgreSQL's `DUPMAX`).
const MAX_REPEAT: u32 = 255;

/// The longest PostgreSQL rewrite a pattern may have (Unicode classes such as `\w` are long).
const MAX_SQL_LEN: usize = 64 * 1024;

/// A checked `$regex` pattern: matches a string anywhere unless anchored.
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    regex: regex::Regex,
    sql: String,
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Pattern {
    /// Checks `source` for the filter key `key` (named in errors).
    pub fn new(key: &str, source: &str) -> Result<Self> {
        let refuse = |why: String| Error::Input(format!("metadata filter {key:?}: $regex {source:?}: {why}"));
        if source.len() > MAX_PATTERN_LEN {
            return Err(refuse(format!("{} bytes; at most {MAX_PATTERN_LEN}", source.len())));
        }
        if source.contains('\0') {
            return Err(refuse("holds a NUL character".into()));
        }
        let hir = regex_syntax::ParserBuilder::new()
            .build()
            .parse(source)
            .map_err(|e| refuse(format!("not a valid pattern (Rust's regex syntax):\n{e}")))?;
        let mut sql = String::new();
        postgres(&hir, &mut sql).map_err(refuse)?;
        if sql.len() > MAX_SQL_LEN {
            return Err(refuse(
                "its character classes are too large for PostgreSQL; for ASCII classes write (?-u:\\w), [0-9] or \
                 [a-zA-Z]"
                    .into(),
            ));
        }
        let regex = regex::Regex::new(source).map_err(|e| refuse(format!("not a valid pattern:\n{e}")))?;
        Ok(Self { source: source.to_string(), regex, sql })
    }

    /// The pattern as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether it matches somewhere in `text`.
    pub fn is_match(&self, text: &str) -> bool {
        self.regex.is_match(text)
    }

    /// The same pattern in PostgreSQL's dialect, for `text ~ pattern`.
    pub fn sql(&self) -> &str {
        &self.sql
    }
}

/// An ARE that matches no text: only NUL is outside its range, and text holds no NUL
/// (PostgreSQL's cannot, metadata may not), so NUL in a pattern is this too.
const NOTHING: &str = "[^\\U00000001-\\U0010FFFF]";

/// Writes `hir` in PostgreSQL's advanced regular expressions (ARE), or says what it cannot.
fn postgres(hir: &Hir, out: &mut String) -> std::result::Result<(), String> {
    match hir.kind() {
        HirKind::Empty => {}
        HirKind::Literal(Literal(bytes)) => {
            let text = std::str::from_utf8(bytes).map_err(|_| "matches bytes that are not text".to_string())?;
            if text.contains('\0') {
                out.push_str(NOTHING);
            } else {
                text.chars().for_each(|c| code_point(c as u32, out));
            }
        }
        HirKind::Class(class) => {
            let ranges: Vec<(u32, u32)> = match class {
                Class::Unicode(c) => c.ranges().iter().map(|r| (r.start() as u32, r.end() as u32)).collect(),
                Class::Bytes(c) if c.is_ascii() => {
                    c.ranges().iter().map(|r| (r.start() as u32, r.end() as u32)).collect()
                }
                Class::Bytes(_) => return Err("matches bytes that are not text".into()),
            };
            let ranges: Vec<(u32, u32)> =
                ranges.into_iter().filter(|&(_, b)| b > 0).map(|(a, b)| (a.max(1), b)).collect();
            if ranges.is_empty() {
                out.push_str(NOTHING);
                return Ok(());
            }
            out.push('[');
            for (a, b) in ranges {
                code_point(a, out);
                if b > a {
                    out.push('-');
                    code_point(b, out);
                }
            }
            out.push(']');
        }
        HirKind::Look(look) => out.push_str(match look {
            Look::Start => "\\A",
            Look::End => "\\Z",
            Look::StartLF => "(?:\\A|(?<=\\n))",
            Look::EndLF => "(?:\\Z|(?=\\n))",
            Look::StartCRLF | Look::EndCRLF => return Err("CRLF mode (?R) is not supported".into()),
            _ => {
                return Err("word boundaries (\\b, \\B, \\<, \\>) are not supported; match the characters around \
                            the word instead, e.g. (^|[^a-z])word([^a-z]|$)"
                    .into())
            }
        }),
        HirKind::Repetition(rep) => {
            if rep.min > MAX_REPEAT || rep.max.is_some_and(|m| m > MAX_REPEAT) {
                return Err(format!("repeats more than {MAX_REPEAT} times (PostgreSQL's limit of {{m,n}})"));
            }
            out.push_str("(?:");
            postgres(&rep.sub, out)?;
            out.push(')');
            match (rep.min, rep.max) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (min, None) => out.push_str(&format!("{{{min},}}")),
                (min, Some(max)) if min == max => out.push_str(&format!("{{{min}}}")),
                (min, Some(max)) => out.push_str(&format!("{{{min},{max}}}")),
            }
        }
        // Alternations group themselves and repetitions their operand, so a group needs no
        // parentheses of its own.
        HirKind::Capture(capture) => postgres(&capture.sub, out)?,
        HirKind::Concat(subs) => {
            for sub in subs {
                postgres(sub, out)?;
            }
        }
        HirKind::Alternation(subs) => {
            out.push_str("(?:");
            for (i, sub) in subs.iter().enumerate() {
                if i > 0 {
                    out.push('|');
                }
                postgres(sub, out)?;
            }
            out.push(')');
        }
    }
    Ok(())
}

/// One character: ASCII letters and digits as themselves, any other as a code point escape
/// (which means the character itself everywhere in an ARE, in brackets too).
fn code_point(c: u32, out: &mut String) {
    match char::from_u32(c) {
        Some(ch) if ch.is_ascii_alphanumeric() => out.push(ch),
        _ if c <= 0xFFFF => out.push_str(&format!("\\u{c:04X}")),
        _ => out.push_str(&format!("\\U{c:08X}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_as_rust_regexes_do() {
        let p = Pattern::new("k", "(?i)^pla").unwrap();
        assert!(p.is_match("Plants") && !p.is_match("a plant"));
        assert!(Pattern::new("k", "").unwrap().is_match(""));
        assert!(Pattern::new("k", "[^a]").unwrap().is_match("é"));
    }

    #[test]
    fn the_postgres_rewrite_spells_out_every_character() {
        let sql = |p: &str| Pattern::new("k", p).unwrap().sql;
        assert_eq!(sql("^a.b$"), "\\Aa[\\u0001-\\u0009\\u000B-\\U0010FFFF]b\\Z");
        assert_eq!(sql("(?i)k"), "[Kk\\u212A]");
        assert_eq!(sql("(a|bc)+x{2,3}"), "(?:(?:a|bc))+(?:x){2,3}");
        assert_eq!(sql("a\\.\\]é😀"), "a\\u002E\\u005D\\u00E9\\U0001F600");
        assert_eq!(sql("(?m)^x$"), "(?:\\A|(?<=\\n))x(?:\\Z|(?=\\n))");
        assert_eq!(sql("a{0,}?b{0,1}"), "(?:a)*(?:b)?");
    }

    #[test]
    fn patterns_the_engines_answer_differently_are_refused() {
        for (p, want) in [
            ("\\bword", "word boundaries"),
            ("(?-u:\\b)x", "word boundaries"),
            ("(?mR)^x", "CRLF"),
            ("a{256}", "more than 255"),
            ("(", "not a valid pattern"),
            ("(?-u:\\xFF)", "not a valid pattern"),
            ("a\0", "NUL"),
        ] {
            let e = Pattern::new("k", p).unwrap_err().to_string();
            assert!(e.contains(want) && e.starts_with("metadata filter \"k\": $regex"), "{p}: {e}");
        }
        assert!(Pattern::new("k", &"a".repeat(MAX_PATTERN_LEN + 1)).unwrap_err().to_string().contains("at most"));
    }
}
