//! Python values to and from the store's: context records and metadata as dicts, filters and
//! documents from dicts.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::errors::{raise, store_err, Kind};

pub(crate) fn record_dict<'py>(
    py: Python<'py>,
    r: &picaso_store::ContextRecord,
    score: Option<f32>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", r.id)?;
    d.set_item("score", score)?;
    d.set_item("doc", &r.doc)?;
    d.set_item("segment", r.seg)?;
    d.set_item("text", &r.text)?;
    d.set_item("metadata", metadata_to_py(py, &r.metadata)?)?;
    Ok(d)
}

/// Metadata as a Python dict (through JSON: the values are JSON's).
pub(crate) fn metadata_to_py<'py>(py: Python<'py>, metadata: &picaso_store::Metadata) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::Value::Object(metadata.clone()).to_string();
    py.import("json")?.call_method1("loads", (text,))
}

/// A Python dict of JSON values as metadata (`what` names it in errors).
pub(crate) fn metadata_from_py(value: &Bound<'_, PyAny>, what: &str) -> PyResult<picaso_store::Metadata> {
    if !value.is_instance_of::<PyDict>() {
        return Err(PyTypeError::new_err(format!("{what} must be a dict of JSON values")));
    }
    let text: String = value
        .py()
        .import("json")?
        .call_method1("dumps", (value,))
        .map_err(|e| {
            PyTypeError::new_err(format!(
                "{what} must hold JSON values (str, int, float, bool, None, lists, dicts): {e}"
            ))
        })?
        .extract()?;
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        _ => Err(raise(Kind::Invalid, format!("{what} is not a JSON object (NaN and infinities are not JSON)"))),
    }
}

/// A retrieval's metadata filter from a Python dict (None: no filter).
pub(crate) fn filter_from_py(filter: Option<&Bound<'_, PyAny>>) -> PyResult<Option<picaso_store::Filter>> {
    let Some(f) = filter else { return Ok(None) };
    picaso_store::Filter::new(&metadata_from_py(f, "filter")?).map(Some).map_err(store_err)
}

/// Documents from a list of strings or of {"id", "text"} dicts.
pub(crate) fn documents_of(list: &Bound<'_, PyList>) -> PyResult<Vec<picaso_store::Document>> {
    let mut docs = Vec::with_capacity(list.len());
    let mut texts_seen = std::collections::HashSet::new();
    for (i, item) in list.iter().enumerate() {
        let mut metadata = picaso_store::Metadata::new();
        let (id, text) = if item.is_instance_of::<pyo3::types::PyString>() {
            // (A str that is not valid Unicode, a lone surrogate, raises UnicodeEncodeError here.)
            let text = item.extract::<String>()?;
            // Named by its text: the same text again (in this list too) is the same document.
            let id = format!("text/{}", picaso_store::checksum(text.as_bytes()));
            if !texts_seen.insert(id.clone()) {
                continue;
            }
            (id, text)
        } else if let Ok(d) = item.cast::<PyDict>() {
            let get = |k: &str| -> PyResult<String> {
                d.get_item(k)?
                    .ok_or_else(|| raise(Kind::Invalid, format!("document {i}: no {k:?} key")))?
                    .extract::<String>()
                    .map_err(|_| raise(Kind::Invalid, format!("document {i}: {k:?} must be a string")))
            };
            for key in d.keys() {
                let key: String = key.extract().unwrap_or_default();
                if !["id", "text", "metadata"].contains(&key.as_str()) {
                    return Err(raise(
                        Kind::Invalid,
                        format!("document {i}: unknown key {key:?}; a document is {{\"id\", \"text\", \"metadata\"}} (put fields such as {key:?} in \"metadata\")"),
                    ));
                }
            }
            if let Some(m) = d.get_item("metadata")?.filter(|m| !m.is_none()) {
                metadata = metadata_from_py(&m, &format!("document {i}: \"metadata\""))?;
            }
            (get("id")?, get("text")?)
        } else {
            return Err(PyTypeError::new_err(format!(
                "document {i}: expected a str or a dict with \"id\" and \"text\""
            )));
        };
        // Cut as `picaso ingest --text-dir` and `POST /v1/documents` cut a file.
        let paragraphs = picaso_store::sources::paragraphs(&text);
        if paragraphs.is_empty() {
            return Err(raise(Kind::Invalid, format!("document {i} ({id:?}) has no text")));
        }
        docs.push(picaso_store::Document { id, paragraphs, metadata });
    }
    Ok(docs)
}
