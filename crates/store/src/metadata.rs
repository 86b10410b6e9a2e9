//! Metadata: a JSON object kept with each context (a document's title, URL, date, language),
//! returned with it and matched by filters. A document's metadata is given once and held by
//! every one of its contexts, so a context found by a search carries what it needs to be cited.
//!
//! A filter is an object of scalar values; a context matches when its metadata holds every one
//! of its keys with an equal value: strings and booleans exactly, numbers by value (`1` equals
//! `1.0`), `null` only a `null` (not a missing key). Both catalogs answer filters with these
//! rules (PostgreSQL's `jsonb @>` on scalars, SQLite's JSON functions), and [`matches()`] states them
//! in Rust for the tests.

use serde_json::Value;

use crate::error::{Error, Result};

/// A context's metadata: a JSON object.
pub type Metadata = serde_json::Map<String, Value>;

/// The most bytes a context's metadata may take as JSON: it is read with every record.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// The most keys a filter may hold.
pub const MAX_FILTER_KEYS: usize = 32;

/// Which contexts a search may return: every context, those of some documents, those whose
/// metadata matches a filter, or both at once.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scope<'a> {
    /// Only these documents' contexts (`None`: every document's).
    pub documents: Option<&'a [String]>,
    /// Only contexts whose metadata matches this filter (`None`: any metadata).
    pub filter: Option<&'a Metadata>,
}

impl<'a> Scope<'a> {
    /// Every context.
    pub fn all() -> Self {
        Self::default()
    }

    /// The contexts of `documents`.
    pub fn within(documents: &'a [String]) -> Self {
        Self { documents: Some(documents), filter: None }
    }

    /// The contexts whose metadata matches `filter`.
    pub fn matching(filter: &'a Metadata) -> Self {
        Self { documents: None, filter: Some(filter) }
    }

    /// Whether it names neither documents nor a filter.
    pub fn is_all(&self) -> bool {
        self.documents.is_none() && self.filter.is_none()
    }
}

/// Refuses metadata a catalog could not hold or that would weigh on every read: over
/// [`MAX_METADATA_BYTES`] as JSON, or with a NUL character (PostgreSQL's text cannot hold one).
/// `whose` names the document, as the error says.
pub fn check_metadata(metadata: &Metadata, whose: &str) -> Result<()> {
    let json = Value::Object(metadata.clone()).to_string();
    if json.len() > MAX_METADATA_BYTES {
        return Err(Error::Input(format!(
            "the metadata of {whose} takes {} bytes as JSON, more than the {MAX_METADATA_BYTES} a context may \
             carry; keep long text in the document itself",
            json.len()
        )));
    }
    if json.contains("\\u0000") {
        return Err(Error::Input(format!(
            "the metadata of {whose} holds a NUL character (\\u0000), which a catalog cannot store; remove it"
        )));
    }
    Ok(())
}

/// Refuses a filter that could match nothing by construction or mean something else than
/// equality: empty, over [`MAX_FILTER_KEYS`] keys, or with an object or array value.
pub fn check_filter(filter: &Metadata) -> Result<()> {
    if filter.is_empty() {
        return Err(Error::Input(
            "an empty metadata filter: give at least one key and value, or no filter to search every context".into(),
        ));
    }
    if filter.len() > MAX_FILTER_KEYS {
        return Err(Error::Input(format!("a metadata filter of {} keys; at most {MAX_FILTER_KEYS}", filter.len())));
    }
    for (key, value) in filter {
        if matches!(value, Value::Object(_) | Value::Array(_)) {
            return Err(Error::Input(format!(
                "metadata filter {key:?}: {value} is not a string, number, boolean or null; a filter matches \
                 single values"
            )));
        }
        if key.contains('\0') || value.as_str().is_some_and(|s| s.contains('\0')) {
            return Err(Error::Input(format!("metadata filter {key:?} holds a NUL character")));
        }
    }
    Ok(())
}

/// Whether `metadata` matches `filter` (the rules of the module's documentation).
pub fn matches(metadata: &Metadata, filter: &Metadata) -> bool {
    filter.iter().all(|(key, want)| metadata.get(key).is_some_and(|have| scalar_eq(have, want)))
}

fn scalar_eq(have: &Value, want: &Value) -> bool {
    match (have, want) {
        (Value::String(a), Value::String(b)) => a == b,
        (Value::Bool(a), Value::Bool(b)) => a == b,
        (Value::Null, Value::Null) => true,
        (Value::Number(a), Value::Number(b)) => match (a.as_i64(), b.as_i64()) {
            (Some(a), Some(b)) => a == b,
            _ => a.as_f64() == b.as_f64(),
        },
        _ => false,
    }
}

/// A filter from `KEY=VALUE` pairs (the command line's `--filter`): VALUE is read as JSON when it
/// is a JSON number, boolean, null or string (`year=2024`, `draft=false`, `year="2024"`), else as
/// the text it is (`lang=en`). A key given twice is refused.
pub fn filter_from_pairs<S: AsRef<str>>(pairs: &[S]) -> Result<Metadata> {
    let mut filter = Metadata::new();
    for pair in pairs {
        let pair = pair.as_ref();
        let (key, raw) = pair.split_once('=').ok_or_else(|| {
            Error::Input(format!("--filter {pair:?}: expected KEY=VALUE (e.g. --filter lang=en --filter year=2024)"))
        })?;
        if key.is_empty() {
            return Err(Error::Input(format!("--filter {pair:?}: the key is empty")));
        }
        let value = match serde_json::from_str::<Value>(raw) {
            Ok(v @ (Value::Number(_) | Value::Bool(_) | Value::Null | Value::String(_))) => v,
            _ => Value::String(raw.to_string()),
        };
        if filter.insert(key.to_string(), value).is_some() {
            return Err(Error::Input(format!("--filter: key {key:?} is given twice; a context has one value per key")));
        }
    }
    check_filter(&filter)?;
    Ok(filter)
}

/// Metadata as stored: its JSON text.
pub(crate) fn to_json(metadata: &Metadata) -> String {
    Value::Object(metadata.clone()).to_string()
}

/// Metadata read back from its JSON text (`{}` for an empty column).
pub(crate) fn from_json(json: &str) -> Result<Metadata> {
    match serde_json::from_str::<Value>(json) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(Error::Input(format!("stored metadata is not a JSON object: {json:.80}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Metadata {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn filters_match_by_value_and_type() {
        let m = obj(json!({"lang": "en", "year": 2024, "score": 0.5, "draft": false, "note": null, "tags": ["a"]}));
        assert!(matches(&m, &obj(json!({"lang": "en"}))));
        assert!(matches(&m, &obj(json!({"lang": "en", "year": 2024.0}))));
        assert!(matches(&m, &obj(json!({"score": 0.5, "draft": false, "note": null}))));
        assert!(!matches(&m, &obj(json!({"year": "2024"}))));
        assert!(!matches(&m, &obj(json!({"draft": 0}))));
        assert!(!matches(&m, &obj(json!({"missing": null}))));
        assert!(!matches(&m, &obj(json!({"tags": "a"}))));
        assert!(!matches(&m, &obj(json!({"lang": "EN"}))));
    }

    #[test]
    fn where_pairs_read_json_scalars_else_text() {
        let f = filter_from_pairs(&["lang=en", "year=2024", "draft=false", "id=\"7\"", "q=a=b", "n=null"]).unwrap();
        assert_eq!(
            Value::Object(f),
            json!({"lang": "en", "year": 2024, "draft": false, "id": "7", "q": "a=b", "n": null})
        );
        assert_eq!(filter_from_pairs(&["tags=[1]"]).unwrap()["tags"], json!("[1]"));
        for bad in [&["lang"][..], &["=en"], &["a=1", "a=2"], &[]] {
            let e = filter_from_pairs(bad).unwrap_err().to_string();
            assert!(e.contains("--filter") || e.contains("empty metadata filter"), "{e}");
        }
    }

    #[test]
    fn metadata_over_the_limit_or_with_nul_is_refused() {
        assert!(check_metadata(&obj(json!({"url": "https://example.org"})), "d").is_ok());
        let big = obj(json!({"x": "y".repeat(MAX_METADATA_BYTES)}));
        assert!(check_metadata(&big, "d").unwrap_err().to_string().contains("more than"));
        assert!(check_metadata(&obj(json!({"x": "a\u{0}b"})), "d").unwrap_err().to_string().contains("NUL"));
        assert!(check_filter(&obj(json!({"x": {"y": 1}}))).is_err());
        assert!(check_filter(&Metadata::new()).is_err());
    }
}
