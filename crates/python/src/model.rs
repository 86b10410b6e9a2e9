//! `Model`: loading (a folder, a hub id, $PICASO_MODEL or the bundled model), tokens, scoring,
//! states and generation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use numpy::PyArray1;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyString;

use picaso_model::{GenerateOptions, LoadOptions, WeightDtype};

use crate::errors::{model_err, raise, Kind};
use crate::generation::Generation;
use crate::state::State;

/// The bundled model, where this extension was built from a picaso checkout.
const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/picaso-mamba2");

/// Text or token ids, as callers pass them.
fn tokens_of(model: &picaso_model::Model, input: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let tokens = if let Ok(text) = input.cast::<PyString>() {
        {
            let text = text.to_cow()?;
            model.tokenizer().and_then(|t| t.encode(&text)).map_err(model_err)?
        }
    } else if let Ok(ids) = input.extract::<Vec<i64>>() {
        ids.into_iter()
            .map(|i| {
                u32::try_from(i).map_err(|_| raise(Kind::Invalid, format!("token id {i} is negative or too large")))
            })
            .collect::<PyResult<_>>()?
    } else {
        return Err(PyTypeError::new_err("expected text (str) or token ids (a sequence of int)"));
    };
    model.check_tokens(&tokens).map_err(model_err)?;
    Ok(tokens)
}

/// A local folder, else a Hugging Face hub id (`owner/name`), else $PICASO_MODEL, else the
/// bundled model of the checkout this extension was built in.
fn resolve_model(path: Option<&str>) -> PyResult<PathBuf> {
    let given = path.map(str::to_string).or_else(|| std::env::var("PICASO_MODEL").ok());
    let Some(given) = given else {
        let bundled = PathBuf::from(BUNDLED_MODEL);
        return if bundled.join("config.json").is_file() {
            Ok(bundled)
        } else {
            Err(raise(Kind::Invalid, "no model given: pass a model folder or a hub id, or set PICASO_MODEL"))
        };
    };
    let p = Path::new(&given);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let looks_like_repo = given.split('/').count() == 2 && !given.starts_with('.') && !given.starts_with('/');
    if looks_like_repo {
        return picaso_model::hub::download(&given).map_err(model_err);
    }
    Err(raise(Kind::NotFound, format!("{given}: model folder not found")))
}

/// A Mamba language model (Mamba-2 or Mamba-1) ready to score, continue states and generate.
#[pyclass(frozen, module = "picaso")]
pub(crate) struct Model {
    pub(crate) inner: Arc<picaso_model::Model>,
}

#[pymethods]
impl Model {
    /// Loads a model folder (config.json, weights, tokenizer.json) or a Hugging Face hub id.
    ///
    /// `weights`: "f32" (exact) or "bf16" (half the memory, faster decode; log-probs move by a few hundredths of a nat).
    /// With no path: $PICASO_MODEL, else the bundled model of a picaso checkout.
    #[staticmethod]
    #[pyo3(signature = (path=None, *, weights="f32", tokenizer=None))]
    fn load(py: Python<'_>, path: Option<PathBuf>, weights: &str, tokenizer: Option<PathBuf>) -> PyResult<Self> {
        let dir = resolve_model(path.as_deref().map(|p| p.to_str().unwrap_or_default()))?;
        let weight_dtype = weights.parse::<WeightDtype>().map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        let opts = LoadOptions { weight_dtype, tokenizer, ..LoadOptions::default() };
        let model = py.detach(|| picaso_model::Model::load(&dir, &opts)).map_err(model_err)?;
        Ok(Self { inner: Arc::new(model) })
    }

    /// The model's fingerprint: states carry it and continue only on this model.
    #[getter]
    fn fingerprint(&self) -> &str {
        self.inner.fingerprint()
    }

    /// "mamba2" or "mamba1".
    #[getter]
    fn arch(&self) -> &'static str {
        self.inner.state_shape().arch.name()
    }

    /// Number of parameters.
    #[getter]
    fn n_params(&self) -> usize {
        self.inner.n_params()
    }

    /// The folder the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.dir().to_path_buf()
    }

    /// Token ids of `text` (the model's tokenizer).
    fn encode(&self, text: &str) -> PyResult<Vec<u32>> {
        self.inner.tokenizer().and_then(|t| t.encode(text)).map_err(model_err)
    }

    /// Text of token ids.
    fn decode(&self, ids: Vec<u32>) -> PyResult<String> {
        // Ids outside the model's vocabulary are an error, as for scoring (the tokenizer would
        // drop them silently).
        self.inner.check_tokens(&ids).map_err(model_err)?;
        self.inner.tokenizer().and_then(|t| t.decode(&ids)).map_err(model_err)
    }

    /// The state before any token (all zeros).
    fn zero_state(&self) -> State {
        State { inner: self.inner.zero_state() }
    }

    /// Log-probabilities of `input` (text or token ids) continued from `state` (default: the zero
    /// state): `out[i] = log p(token[i+1] | state, token[..=i])`; the first token is context.
    #[pyo3(signature = (input, state=None))]
    fn score<'py>(
        &self,
        py: Python<'py>,
        input: &Bound<'py, PyAny>,
        state: Option<&State>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let logprobs = self.run(py, input, state, |m, tokens, from| Ok(m.score(tokens, from)?.logprobs))?;
        Ok(PyArray1::from_vec(py, logprobs))
    }

    /// The logits of the token after `input` (text or token ids) continued from `state`
    /// (default: zero): a float32 array of the vocabulary's size.
    #[pyo3(signature = (input, state=None))]
    fn next_logits<'py>(
        &self,
        py: Python<'py>,
        input: &Bound<'py, PyAny>,
        state: Option<&State>,
    ) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let logits = self.run(py, input, state, |m, tokens, from| {
            if tokens.is_empty() {
                return Err(picaso_model::Error::Input("next_logits needs at least one token".into()));
            }
            Ok(m.prefill_last_logits(tokens, from)?.0)
        })?;
        Ok(PyArray1::from_vec(py, logits))
    }

    /// The state after `input` (text or token ids), continued from `start` (default: zero).
    #[pyo3(signature = (input, start=None))]
    fn state(&self, py: Python<'_>, input: &Bound<'_, PyAny>, start: Option<&State>) -> PyResult<State> {
        Ok(State { inner: self.run(py, input, start, |m, tokens, from| m.prefill(tokens, from))? })
    }

    /// Continues `prompt` (text or token ids) from `state` (default: zero) and returns a
    /// Generation (text, token ids, stop reason, final state). temperature 0 is greedy.
    #[pyo3(signature = (prompt, state=None, *, max_tokens=64, temperature=0.0, top_p=1.0, seed=0, stop=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        state: Option<&State>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        seed: u64,
        stop: Option<Vec<String>>,
    ) -> PyResult<Generation> {
        let opts =
            GenerateOptions { max_tokens, temperature, top_p, seed, stop: stop.unwrap_or_default(), ignore_eos: false };
        opts.validate().map_err(model_err)?;
        let g = self.run(py, prompt, state, |m, tokens, from| {
            if tokens.is_empty() {
                return Err(picaso_model::Error::Input("the prompt must contain at least one token".into()));
            }
            picaso_model::generate(m, tokens, from, &opts, |_| true)
        })?;
        Ok(Generation::from(&self.inner, g, Vec::new()))
    }

    fn __repr__(&self) -> String {
        format!(
            "Model(path={:?}, arch={:?}, params={}, fingerprint={:?})",
            self.inner.dir().display().to_string(),
            self.arch(),
            self.inner.n_params(),
            self.inner.fingerprint()
        )
    }
}

impl Model {
    /// `work` on the tokens of `input`, from `state` (checked against the model; the zero state
    /// when None), with the GIL released.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        input: &Bound<'_, PyAny>,
        state: Option<&State>,
        work: impl FnOnce(&picaso_model::Model, &[u32], &picaso_model::State) -> picaso_model::Result<T> + Send,
    ) -> PyResult<T> {
        let tokens = tokens_of(&self.inner, input)?;
        let model = &*self.inner;
        let zero;
        let from = match state {
            Some(s) => {
                model.check_state(&s.inner).map_err(model_err)?;
                &s.inner
            }
            None => {
                zero = model.zero_state();
                &zero
            }
        };
        py.detach(|| work(model, &tokens, from)).map_err(model_err)
    }
}
