//! Metadata: a JSON object kept with each context (a document's title, URL, date, language),
//! returned with it and matched by [filters](crate::filter). A document's metadata is given
//! once and held by every one of its contexts, so a context found by a search carries what it
//! needs to be cited.

use serde_json::Value;

use crate::error::{Error, Result};

/// A context's metadata: a JSON object.
pub type Metadata = serde_json::Map<String, Value>;

/// The most bytes a context's metadata may take as JSON: it is read with every record.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

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
    fn metadata_over_the_limit_or_with_nul_is_refused() {
        assert!(check_metadata(&obj(json!({"url": "https://example.org"})), "d").is_ok());
        let big = obj(json!({"x": "y".repeat(MAX_METADATA_BYTES)}));
        assert!(check_metadata(&big, "d").unwrap_err().to_string().contains("more than"));
        assert!(check_metadata(&obj(json!({"x": "a\u{0}b"})), "d").unwrap_err().to_string().contains("NUL"));
    }
}
