//! `Generation`: what `Model.generate` and `Store.query` return.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::state::State;

/// What `generate` and `Store.query` return.
#[pyclass(frozen, module = "picaso")]
pub(crate) struct Generation {
    /// The generated text (without a stop string that ended it); None when the model has no
    /// tokenizer (token ids in, token ids out).
    #[pyo3(get)]
    text: Option<String>,
    /// The generated token ids. When a stop string ended it they run to the end of the token
    /// where it begins (a stop string can start mid-token), as `state` does: `text` is cut
    /// before it, so `decode(token_ids)` may hold more than `text`.
    #[pyo3(get)]
    token_ids: Vec<u32>,
    /// "length", "eos", "stop" or "cancelled".
    #[pyo3(get)]
    stop_reason: String,
    /// The state after the prompt and the generated tokens.
    #[pyo3(get)]
    state: Py<State>,
    /// The contexts a store query composed (dicts: id, score, doc, text), best first; read
    /// through the `contexts` getter, which hands out copies (the object is immutable).
    contexts: Vec<Py<PyDict>>,
}

impl Generation {
    pub(crate) fn from(model: &picaso_model::Model, g: picaso_model::Generation, contexts: Vec<Py<PyDict>>) -> Self {
        let stop_reason = serde_json::to_value(g.stop_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_else(|| format!("{:?}", g.stop_reason).to_lowercase());
        let state = Python::attach(|py| Py::new(py, State { inner: g.state })).expect("a State object is created");
        let text = model.tokenizer().is_ok().then_some(g.text);
        Self { text, token_ids: g.tokens, stop_reason, state, contexts }
    }
}

#[pymethods]
impl Generation {
    /// The contexts a store query composed (dicts: id, score, doc, segment, text), best first;
    /// empty for `Model.generate`. Each read is a fresh copy.
    #[getter]
    fn contexts<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.contexts.iter().map(|d| d.bind(py).copy()).collect()
    }

    fn __repr__(&self) -> String {
        format!("Generation(text={:?}, stop_reason={:?}, tokens={})", self.text, self.stop_reason, self.token_ids.len())
    }
}
