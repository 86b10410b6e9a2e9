//! # picaso-python
//!
//! The `picaso._picaso` extension module behind the `picaso` Python package: the engine
//! (`Model`), states as numpy arrays (`State`), composition (`compose`, `weights`) and the
//! store (`Store`). The package's `__init__.py` re-exports these and adds the exception classes
//! and the transformers interop (pure Python).
//!
//! Design: a thin shell. Every call goes straight to the Rust crates the CLI uses, so the same
//! inputs give the same numbers and the same error messages; model and store work runs with the
//! GIL released (`Python::detach`), so Python threads can serve several requests at once.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use numpy::ndarray::{ArrayView, IxDyn};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

use picaso_model::{
    Arch, Composition, GenerateOptions, LayerState, LoadOptions, Method, StateDtype, StateShape, WeightDtype,
};

/// The bundled model, where this extension was built from a picaso checkout.
const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/picaso-mamba2");

/// The kinds of error the package raises; their classes live in `picaso/_errors.py` so that each
/// can derive from both `picaso.Error` and the built-in it means (ValueError, FileNotFoundError).
enum Kind {
    /// Bad argument values (ValueError).
    Invalid,
    /// A missing file or folder (FileNotFoundError).
    NotFound,
    /// A state that does not fit the model (ValueError).
    StateMismatch,
    /// Anything else (picaso.Error).
    Other,
}

fn raise(kind: Kind, message: impl Into<String>) -> PyErr {
    let name = match kind {
        Kind::Invalid => "InvalidArgument",
        Kind::NotFound => "NotFound",
        Kind::StateMismatch => "StateMismatch",
        Kind::Other => "Error",
    };
    let message = message.into();
    Python::attach(|py| {
        match py.import("picaso._errors").and_then(|m| m.getattr(name)) {
            Ok(class) => match class.call1((message.clone(),)) {
                Ok(instance) => PyErr::from_value(instance),
                Err(e) => e,
            },
            // Used without the package around it (a bare `_picaso` import): plain built-ins.
            Err(_) => match kind {
                Kind::NotFound => pyo3::exceptions::PyFileNotFoundError::new_err(message),
                Kind::Other => pyo3::exceptions::PyRuntimeError::new_err(message),
                _ => pyo3::exceptions::PyValueError::new_err(message),
            },
        }
    })
}

fn model_err(e: picaso_model::Error) -> PyErr {
    use picaso_model::Error as E;
    let kind = match &e {
        E::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Kind::NotFound,
        E::Input(_) | E::Compose(_) => Kind::Invalid,
        E::State { .. } => Kind::StateMismatch,
        _ => Kind::Other,
    };
    raise(kind, e.to_string())
}

fn store_err(e: picaso_store::Error) -> PyErr {
    use picaso_store::Error as E;
    match e {
        E::Model(m) => model_err(m),
        E::WrongModel { .. } => raise(Kind::StateMismatch, e.to_string()),
        E::NotFound(_) | E::Input(_) => raise(Kind::Invalid, e.to_string()),
        E::Io { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            raise(Kind::NotFound, e.to_string())
        }
        other => raise(Kind::Other, other.to_string()),
    }
}

fn embed_err(e: picaso_embed::Error) -> PyErr {
    raise(Kind::Other, e.to_string())
}

fn composition_of(name: &str) -> PyResult<Composition> {
    name.parse::<Composition>().map_err(|e| raise(Kind::Invalid, e.to_string()))
}

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
struct Model {
    inner: Arc<picaso_model::Model>,
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

/// What `generate` and `Store.query` return.
#[pyclass(frozen, module = "picaso")]
struct Generation {
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
    fn from(model: &picaso_model::Model, g: picaso_model::Generation, contexts: Vec<Py<PyDict>>) -> Self {
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

/// The state of a model after some tokens: per layer the SSM state, the conv tail and the log
/// of the accumulated decay. Immutable; its arrays are read-only numpy views of its memory.
#[pyclass(frozen, module = "picaso")]
struct State {
    inner: picaso_model::State,
}

fn view<'py>(this: &Bound<'py, State>, shape: &[usize], data: &[f32]) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let view = ArrayView::from_shape(IxDyn(shape), data).map_err(|e| raise(Kind::Other, e.to_string()))?;
    // SAFETY: the State is frozen, so `data` is never written or reallocated while the array
    // (which keeps `this` alive as its base object) exists.
    let array = unsafe { PyArrayDyn::borrow_from_array(&view, this.clone().into_any()) };
    array.readwrite().make_nonwriteable();
    Ok(array)
}

#[pymethods]
impl State {
    /// Reads a state file (safetensors, checksum-verified).
    #[staticmethod]
    fn load(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| picaso_model::State::load(&path)).map_err(model_err)?;
        Ok(Self { inner })
    }

    /// Writes the state (atomically); `dtype` "f32" or "bf16" (ssm and conv halved; log-decay stays f32).
    #[pyo3(signature = (path, dtype="f32"))]
    fn save(&self, py: Python<'_>, path: PathBuf, dtype: &str) -> PyResult<()> {
        let dtype = dtype.parse::<StateDtype>().map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        py.detach(|| self.inner.save(&path, dtype)).map_err(model_err)
    }

    /// Builds a state from arrays, one tuple per layer of the model: a Mamba layer's
    /// (ssm, conv, log_decay) — Mamba-2 ssm (heads, headdim, d_state), conv (conv_dim,
    /// d_conv - 1), log_decay (heads); Mamba-1 ssm (d_inner, d_state), conv (d_inner,
    /// d_conv - 1), log_decay (d_inner, d_state) — or, in a hybrid, an attention layer's
    /// (keys, values), each (kv_heads, tokens, head_dim). The fingerprint names the model it
    /// belongs to (`Model.fingerprint`); `position` is where the next token goes (default
    /// `n_tokens`; a composed hybrid state's is its longest part's).
    #[staticmethod]
    #[pyo3(signature = (layers, *, fingerprint, n_tokens, position=None))]
    fn from_arrays(
        layers: Vec<Vec<PyReadonlyArrayDyn<'_, f32>>>,
        fingerprint: String,
        n_tokens: u64,
        position: Option<u64>,
    ) -> PyResult<Self> {
        let invalid = |m: String| raise(Kind::Invalid, m);
        let mamba: Vec<(usize, &Vec<PyReadonlyArrayDyn<'_, f32>>)> =
            layers.iter().enumerate().filter(|(_, l)| l.len() != 2).collect();
        let attention: Vec<(usize, &Vec<PyReadonlyArrayDyn<'_, f32>>)> =
            layers.iter().enumerate().filter(|(_, l)| l.len() == 2).collect();
        if let Some((i, l)) = mamba.iter().find(|(_, l)| l.len() != 3) {
            return Err(invalid(format!(
                "layer {i} has {} arrays: a Mamba layer takes (ssm, conv, log_decay), an attention layer (keys, values)",
                l.len()
            )));
        }
        let Some((_, first)) = mamba.first() else {
            return Err(invalid("a state needs at least one Mamba layer (ssm, conv, log_decay)".into()));
        };
        let arch = match first[0].ndim() {
            3 => Arch::Mamba2,
            2 => Arch::Mamba1,
            n => return Err(invalid(format!("layer 0: ssm has {n} axes; Mamba-2 has 3, Mamba-1 2"))),
        };
        let flat = |a: &PyReadonlyArrayDyn<'_, f32>| a.as_array().iter().copied().collect::<Vec<f32>>();
        let (attention_shape, kv) = match attention.first() {
            None => (None, Vec::new()),
            Some((_, l0)) => {
                let want = l0[0].shape().to_vec();
                if want.len() != 3 {
                    return Err(invalid(format!(
                        "attention keys have {} axes; expected (kv_heads, tokens, head_dim)",
                        want.len()
                    )));
                }
                let mut kv = Vec::with_capacity(attention.len());
                for (i, l) in &attention {
                    for (name, a) in [("keys", &l[0]), ("values", &l[1])] {
                        if a.shape() != want.as_slice() {
                            return Err(invalid(format!(
                                "layer {i}: {name} have shape {:?}, the first attention layer's keys {want:?} (every attention layer holds the same tokens)",
                                a.shape()
                            )));
                        }
                    }
                    // (kv_heads, T, head_dim) head-major, as transformers keeps them -> token-major rows.
                    let token_major = |a: &PyReadonlyArrayDyn<'_, f32>| {
                        a.as_array().permuted_axes(IxDyn(&[1, 0, 2])).iter().copied().collect::<Vec<f32>>()
                    };
                    kv.push(picaso_model::KvState { keys: token_major(&l[0]), values: token_major(&l[1]) });
                }
                let shape = picaso_model::AttentionShape {
                    layers: attention.iter().map(|(i, _)| *i).collect(),
                    n_layers: layers.len(),
                    kv_heads: want[0],
                    head_dim: want[2],
                };
                (Some(shape), kv)
            }
        };
        let shape = StateShape {
            arch,
            n_layer: mamba.len(),
            ssm: first[0].shape().to_vec(),
            conv: first[1].shape().to_vec(),
            log_decay: first[2].shape().to_vec(),
            attention: attention_shape,
        };
        shape.check().map_err(|e| invalid(e.to_string()))?;
        let mut out = Vec::with_capacity(mamba.len());
        for (i, l) in &mamba {
            for (name, a, want) in
                [("ssm", &l[0], &shape.ssm), ("conv", &l[1], &shape.conv), ("log_decay", &l[2], &shape.log_decay)]
            {
                if a.shape() != want.as_slice() {
                    return Err(invalid(format!(
                        "layer {i}: {name} has shape {:?}, the first Mamba layer's is {want:?}",
                        a.shape()
                    )));
                }
            }
            out.push(LayerState { ssm: flat(&l[0]), conv: flat(&l[1]), log_decay: flat(&l[2]) });
        }
        let inner = picaso_model::State {
            fingerprint,
            n_tokens,
            shape,
            layers: out,
            attention: kv,
            position: position.unwrap_or(n_tokens),
        };
        inner.check_values().map_err(model_err)?;
        Ok(Self { inner })
    }

    /// Tokens the state summarises (for a composed state, the sum over its parts).
    #[getter]
    fn n_tokens(&self) -> u64 {
        self.inner.n_tokens
    }

    /// Fingerprint of the model that made it.
    #[getter]
    fn fingerprint(&self) -> &str {
        &self.inner.fingerprint
    }

    /// "mamba2" or "mamba1" (a hybrid's Mamba layers are Mamba-2).
    #[getter]
    fn arch(&self) -> &'static str {
        self.inner.shape.arch.name()
    }

    /// Number of layers of the model, Mamba and attention.
    #[getter]
    fn n_layers(&self) -> usize {
        self.inner.shape.attention.as_ref().map_or(self.inner.layers.len(), |a| a.n_layers)
    }

    /// "mamba" or "attention" per layer of the model (as the hub's `layer_types`).
    #[getter]
    fn layer_types(&self) -> Vec<&'static str> {
        match &self.inner.shape.attention {
            Some(a) => a.layer_types(),
            None => vec!["mamba"; self.inner.layers.len()],
        }
    }

    /// The position the next token takes: the tokens seen, or a composed hybrid state's longest part's.
    #[getter]
    fn position(&self) -> u64 {
        self.inner.position
    }

    /// Bytes of the state in f32.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes_f32()
    }

    /// Layer `i`'s SSM state: Mamba-2 (heads, headdim, d_state), Mamba-1 (d_inner, d_state).
    /// `i` counts every layer of the model, so in a hybrid it is a Mamba layer's own index.
    fn ssm<'py>(this: &Bound<'py, Self>, i: usize) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let s = this.get();
        view(this, &s.inner.shape.ssm, &s.layer(i)?.ssm)
    }

    /// Layer `i`'s conv tail (conv_dim, d_conv - 1): the last inputs of the convolution, oldest first.
    fn conv<'py>(this: &Bound<'py, Self>, i: usize) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let s = this.get();
        view(this, &s.inner.shape.conv, &s.layer(i)?.conv)
    }

    /// Layer `i`'s log of the accumulated decay: Mamba-2 (heads), Mamba-1 (d_inner, d_state).
    fn log_decay<'py>(this: &Bound<'py, Self>, i: usize) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let s = this.get();
        view(this, &s.inner.shape.log_decay, &s.layer(i)?.log_decay)
    }

    /// Attention layer `i`'s keys, (kv_heads, tokens, head_dim) as transformers keeps them
    /// (RoPE, if the model has it, applied). A copy: picaso holds them token by token.
    fn keys<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let (kv, shape) = self.kv(i)?;
        head_major(py, &kv.keys, shape)
    }

    /// Attention layer `i`'s values, (kv_heads, tokens, head_dim). A copy.
    fn values<'py>(&self, py: Python<'py>, i: usize) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
        let (kv, shape) = self.kv(i)?;
        head_major(py, &kv.values, shape)
    }

    /// Every layer of the model as a dict of arrays: a Mamba layer's {"ssm", "conv",
    /// "log_decay"} (read-only views), an attention layer's {"keys", "values"} (copies).
    #[getter]
    fn layers<'py>(this: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = this.py();
        let list = PyList::empty(py);
        let types = this.get().layer_types();
        for (i, kind) in types.into_iter().enumerate() {
            let d = PyDict::new(py);
            if kind == "attention" {
                d.set_item("keys", this.get().keys(py, i)?)?;
                d.set_item("values", this.get().values(py, i)?)?;
            } else {
                d.set_item("ssm", Self::ssm(this, i)?)?;
                d.set_item("conv", Self::conv(this, i)?)?;
                d.set_item("log_decay", Self::log_decay(this, i)?)?;
            }
            list.append(d)?;
        }
        Ok(list)
    }

    fn __repr__(&self) -> String {
        format!(
            "State(arch={:?}, layers={}{}, n_tokens={}, fingerprint={:?})",
            self.arch(),
            self.n_layers(),
            match &self.inner.shape.attention {
                Some(a) => format!(" ({} attention)", a.layers.len()),
                None => String::new(),
            },
            self.inner.n_tokens,
            self.inner.fingerprint
        )
    }
}

impl State {
    /// The Mamba layer at the model's layer index `i`.
    fn layer(&self, i: usize) -> PyResult<&LayerState> {
        let index = match &self.inner.shape.attention {
            None => Some(i),
            Some(a) if a.layers.contains(&i) => {
                return Err(raise(
                    Kind::Invalid,
                    format!("layer {i} is an attention layer: read its keys({i}) and values({i})"),
                ))
            }
            Some(a) => a.ssm_layers().iter().position(|&l| l == i),
        };
        index.and_then(|k| self.inner.layers.get(k)).ok_or_else(|| {
            pyo3::exceptions::PyIndexError::new_err(format!(
                "layer {i} out of range: the model has {}",
                self.n_layers()
            ))
        })
    }

    /// The keys and values of the attention layer at the model's layer index `i`.
    fn kv(&self, i: usize) -> PyResult<(&picaso_model::KvState, [usize; 3])> {
        let Some(a) = &self.inner.shape.attention else {
            return Err(raise(Kind::Invalid, "this state has no attention layers (a pure SSM model's)".to_string()));
        };
        let Some(k) = a.layers.iter().position(|&l| l == i) else {
            return Err(raise(
                Kind::Invalid,
                format!("layer {i} is not an attention layer; the attention layers are {:?}", a.layers),
            ));
        };
        let kv = &self.inner.attention[k];
        Ok((kv, [a.kv_heads, kv.tokens(a.token_len()), a.head_dim]))
    }
}

/// Token-major rows (T, kv_heads, head_dim) as a new (kv_heads, T, head_dim) array.
fn head_major<'py>(
    py: Python<'py>,
    rows: &[f32],
    [heads, tokens, dim]: [usize; 3],
) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let view =
        ArrayView::from_shape(IxDyn(&[tokens, heads, dim]), rows).map_err(|e| raise(Kind::Other, e.to_string()))?;
    Ok(PyArrayDyn::from_owned_array(py, view.permuted_axes(IxDyn(&[1, 0, 2])).as_standard_layout().into_owned()))
}

/// Composes states of one model into one: "soup" (mean), "caso", "picaso-s" (exact average of
/// CASO over all orders) or "picaso-r" (average over rotations). The last state is nearest the
/// prompt; `order` (a permutation of range(len(states))) reorders them first.
#[pyfunction]
#[pyo3(signature = (states, method="picaso-r", order=None))]
fn compose(py: Python<'_>, states: Vec<PyRef<'_, State>>, method: &str, order: Option<Vec<usize>>) -> PyResult<State> {
    let method = composition_of(method)?;
    let refs: Vec<&picaso_model::State> = states.iter().map(|s| &s.inner).collect();
    let inner = py.detach(|| picaso_model::compose(method, &refs, order.as_deref())).map_err(model_err)?;
    Ok(State { inner })
}

/// Benchmark hook: seconds of each of `calls` compositions of `states` timed inside Rust (the
/// result allocated and freed within the timing), to compare with the same call made from
/// Python in the same process (scripts/bench_python_compose.py).
#[pyfunction]
fn _compose_seconds(py: Python<'_>, states: Vec<PyRef<'_, State>>, method: &str, calls: usize) -> PyResult<Vec<f64>> {
    let method = composition_of(method)?;
    let refs: Vec<&picaso_model::State> = states.iter().map(|s| &s.inner).collect();
    py.detach(|| {
        (0..calls)
            .map(|_| {
                let t = std::time::Instant::now();
                drop(picaso_model::compose(method, &refs, None)?);
                Ok(t.elapsed().as_secs_f64())
            })
            .collect::<picaso_model::Result<Vec<f64>>>()
    })
    .map_err(model_err)
}

/// The weights a method gives n contexts whose log-decays (log A(u_i), each <= 0) are given:
/// composed x = Σ_i w_i x_i for one decay channel.
#[pyfunction]
#[pyo3(signature = (log_decays, method="picaso-r"))]
fn weights(log_decays: Vec<f64>, method: &str) -> PyResult<Vec<f64>> {
    picaso_compose::weights(composition_of(method)?, &log_decays).map_err(|e| raise(Kind::Invalid, e.to_string()))
}

/// A database of states: contexts processed once, retrieved by meaning, composed at query time.
/// A folder, or postgres:// metadata with states in a folder or s3://.
#[pyclass(frozen, module = "picaso")]
struct Store {
    inner: Arc<picaso_store::Store>,
    model: Option<Arc<picaso_model::Model>>,
    /// Loaded when first needed (ingest, search, query), so a store opens for reading even
    /// where its embedder is not at hand.
    embedder: std::sync::OnceLock<picaso_embed::Embedder>,
    /// The embedder folder given to `open`, if any.
    embedder_dir: Option<PathBuf>,
}

fn location(url: &str, states: Option<&str>) -> PyResult<picaso_store::Location> {
    picaso_store::Location::parse(url, states).map_err(store_err)
}

/// The embedder ([`picaso_store::find_embedder`]: the folder given, `$PICASO_EMBEDDER`, the
/// store's own, the hub, the shared data folder).
fn embedder_for(given: Option<PathBuf>, store: Option<&picaso_store::Store>) -> PyResult<picaso_embed::Embedder> {
    use picaso_store::EmbedderError as E;
    picaso_store::find_embedder(given.as_deref(), store).map_err(|e| match e {
        E::Store(e) => store_err(e),
        E::NotFound(_) => raise(Kind::NotFound, e.to_string()),
        E::Mismatch { .. } => raise(Kind::StateMismatch, e.to_string()),
        E::Missing(_) => raise(Kind::Invalid, e.to_string()),
        E::Load { .. } => raise(Kind::Other, e.to_string()),
    })
}

fn record_dict<'py>(
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
fn metadata_to_py<'py>(py: Python<'py>, metadata: &picaso_store::Metadata) -> PyResult<Bound<'py, PyAny>> {
    let text = serde_json::Value::Object(metadata.clone()).to_string();
    py.import("json")?.call_method1("loads", (text,))
}

/// A Python dict of JSON values as metadata (`what` names it in errors).
fn metadata_from_py(value: &Bound<'_, PyAny>, what: &str) -> PyResult<picaso_store::Metadata> {
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
fn filter_from_py(filter: Option<&Bound<'_, PyAny>>) -> PyResult<Option<picaso_store::Filter>> {
    let Some(f) = filter else { return Ok(None) };
    picaso_store::Filter::new(&metadata_from_py(f, "filter")?).map(Some).map_err(store_err)
}

#[pymethods]
impl Store {
    /// Opens an existing store. `model` is needed to ingest and query; `embedder` (an
    /// all-MiniLM-L6-v2 folder, loaded when first needed) defaults to $PICASO_EMBEDDER, the one
    /// the store recorded, the Hugging Face hub, then ../shared/data (the CLI's order).
    #[staticmethod]
    #[pyo3(signature = (url, *, model=None, embedder=None))]
    fn open(py: Python<'_>, url: &str, model: Option<&Model>, embedder: Option<PathBuf>) -> PyResult<Self> {
        let loc = location(url, None)?;
        let missing_folder = matches!(&loc.catalog, picaso_store::CatalogUrl::Sqlite(dir) if !picaso_store::catalog::SqliteCatalog::exists_at(dir));
        // A folder that holds no store is a store not found (NotFound, a FileNotFoundError).
        let store = py.detach(|| picaso_store::Store::open(loc)).map_err(|e| match missing_folder {
            true => raise(Kind::NotFound, e.to_string()),
            false => store_err(e),
        })?;
        let store = Self::new(store, model, embedder)?;
        if store.embedder_dir.is_some() {
            store.embedder()?; // an embedder named explicitly is checked at once
        }
        Ok(store)
    }

    /// Creates a store for `model` (or opens it if it exists, checking that it was made with
    /// this model). `states` places state files elsewhere (a folder or s3://bucket/prefix) when
    /// `url` is postgres://; `state_dtype` "f32" (the default for a new store) or "bf16" (an
    /// existing store keeps its own; naming another is an error).
    #[staticmethod]
    #[pyo3(signature = (url, model, *, embedder=None, states=None, state_dtype=None))]
    fn create(
        py: Python<'_>,
        url: &str,
        model: &Model,
        embedder: Option<PathBuf>,
        states: Option<&str>,
        state_dtype: Option<&str>,
    ) -> PyResult<Self> {
        let loc = location(url, states)?;
        let want = state_dtype
            .map(|d| d.parse::<StateDtype>().map_err(|e| raise(Kind::Invalid, e.to_string())))
            .transpose()?;
        let embedder = embedder_for(embedder, None)?;
        let info = picaso_store::StoreInfo {
            fingerprint: model.inner.fingerprint().to_string(),
            dim: embedder.dim(),
            state_dtype: want.unwrap_or_default(),
        };
        let store = py.detach(|| picaso_store::Store::open_or_create(loc, &info)).map_err(store_err)?;
        if let Some(want) = want.filter(|&w| w != store.info().state_dtype) {
            return Err(raise(
                Kind::Invalid,
                format!(
                    "store {} keeps its states in {}; state_dtype={:?} would mix precisions in one store \
                     (leave it out, or create a new store)",
                    store.location(),
                    format!("{:?}", store.info().state_dtype).to_lowercase(),
                    format!("{want:?}").to_lowercase()
                ),
            ));
        }
        // Recorded now, so that `Store.open` finds it even before the first ingest.
        store.bind_embedder(embedder.fingerprint(), &embedder.dir().display().to_string()).map_err(store_err)?;
        let store = Self::new(store, Some(model), None)?;
        let _ = store.embedder.set(embedder);
        Ok(store)
    }

    /// Adds documents: a list of strings (one document each, paragraphs split at blank lines,
    /// its id "text/" + a hash of the text) or of dicts {"id": str, "text": str, "metadata":
    /// dict (optional: title, URL, ...; every context of the document carries it)}. One context
    /// per paragraph by default; `segment` "tokens:N" cuts runs of N tokens. Segments already
    /// stored with the same text are skipped; a document given again with other text is
    /// brought up to date (changed segments replaced, segments it no longer has removed), and a
    /// stored segment whose state file is missing is processed again ("repaired").
    /// `progress(done, total)` is called as contexts are stored; an exception it raises stops
    /// the ingest after the batch in flight (the batches stored stay: ingesting again carries on).
    /// Returns {"added", "replaced", "repaired", "removed", "skipped", "relabelled" (skipped
    /// segments that took their document's new metadata), "tokens", "seconds"}.
    #[pyo3(signature = (documents, *, segment="paragraph", batch=8, progress=None))]
    fn ingest<'py>(
        &self,
        py: Python<'py>,
        documents: &Bound<'py, PyList>,
        segment: &str,
        batch: usize,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let model = self.need_model()?;
        let docs = documents_of(documents)?;
        let segmentation = segment.parse::<picaso_store::Segmentation>().map_err(|e| raise(Kind::Invalid, e))?;
        if batch == 0 {
            return Err(raise(Kind::Invalid, "batch must be at least 1"));
        }
        if let Some(f) = &progress {
            if !f.bind(py).is_callable() {
                return Err(PyTypeError::new_err("progress must be callable: progress(done, total)"));
            }
        }
        let (store, embedder) = (&self.inner, self.embedder()?);
        let mut callback_error = None;
        // A callback that raises stops the ingest after the batch in flight (those committed
        // stay; ingesting again carries on) and its exception is raised.
        let report = py
            .detach(|| {
                picaso_store::ingest_while(store, model, embedder, &docs, segmentation, batch, |p| {
                    let Some(f) = &progress else { return true };
                    match Python::attach(|py| f.call1(py, (p.done, p.total))) {
                        Ok(_) => true,
                        Err(e) => {
                            callback_error = Some(e);
                            false
                        }
                    }
                })
            })
            .map_err(store_err)?;
        if let Some(e) = callback_error {
            return Err(e);
        }
        let d = PyDict::new(py);
        d.set_item("added", report.added())?;
        d.set_item("replaced", report.replaced)?;
        d.set_item("repaired", report.repaired)?;
        d.set_item("removed", report.removed)?;
        d.set_item("skipped", report.skipped)?;
        d.set_item("relabelled", report.relabelled)?;
        d.set_item("tokens", report.tokens)?;
        d.set_item("seconds", report.seconds)?;
        Ok(d)
    }

    /// The `k` contexts nearest to `query` by meaning, best first: dicts {id, score, doc, segment,
    /// text, metadata}. `documents` (names, as `documents()` lists them) limits the search to
    /// their contexts; `filter` (a dict) to contexts whose metadata passes it: each key's value
    /// is a scalar to equal, or operators ({"$gte": 2020, "$lt": 2025}; also $eq, $ne, $gt,
    /// $lte, $in, $nin, $exists, $contains, $prefix, $regex, $elemMatch, $not), all of which
    /// must hold, and keys within the object there ({"author": {"name": "Ann"}}); "$or", "$and"
    /// and "$nor" in place of a key combine filters. `retriever` ranks by "dense" (the
    /// default: cosine of sentence embeddings), "bm25" (the contexts' text) or "hybrid"
    /// (reciprocal-rank fusion of both, the dense ranking weighted `hybrid_weight`, 0.5 unless
    /// given); a score is then a cosine, a BM25 score or a fused reciprocal rank.
    #[pyo3(signature = (query, k=4, *, documents=None, filter=None, retriever="dense", hybrid_weight=None))]
    #[allow(clippy::too_many_arguments)]
    fn search<'py>(
        &self,
        py: Python<'py>,
        query: &str,
        k: usize,
        documents: Option<Vec<String>>,
        filter: Option<&Bound<'py, PyAny>>,
        retriever: &str,
        hybrid_weight: Option<f32>,
    ) -> PyResult<Bound<'py, PyList>> {
        let filter = filter_from_py(filter)?;
        let retriever = picaso_store::Retriever::parse(retriever, hybrid_weight).map_err(store_err)?;
        let store = &self.inner;
        let embedder = if retriever.needs_embedding() { Some(self.embedder()?) } else { None };
        let hits = py.detach(|| -> PyResult<_> {
            let q = match embedder {
                Some(e) => Some(e.embed_one(query).map_err(embed_err)?),
                None => None,
            };
            let scope = picaso_store::Scope { documents: documents.as_deref(), filter: filter.as_ref() };
            let query = picaso_store::Query {
                text: Some(query),
                embedding: q.as_deref(),
                encoder: embedder.map(|e| e.fingerprint()),
            };
            store.retrieve_records(&query, retriever, k, scope).map_err(store_err)
        })?;
        let list = PyList::empty(py);
        for (r, score) in &hits {
            list.append(record_dict(py, r, Some(*score))?)?;
        }
        Ok(list)
    }

    /// The state of the contexts with these ids, composed by `method` (picaso-r, picaso-s, caso,
    /// soup; concat processes their tokens; naive is the zero state). The last id is nearest the prompt.
    #[pyo3(signature = (ids, method="picaso-r"))]
    fn state(&self, py: Python<'_>, ids: Vec<i64>, method: &str) -> PyResult<State> {
        let model = self.need_model()?;
        let method = Method::parse_among(method, &Method::QUERY).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        let store = &self.inner;
        let prepared = py.detach(|| picaso_store::prepare(store, model, &ids, method, None)).map_err(store_err)?;
        Ok(State { inner: prepared.state })
    }

    /// Retrieves the `k` contexts nearest to `prompt`, composes their states by `method` and
    /// continues the prompt from the composed state. Returns a Generation whose `contexts` are
    /// the retrieved ones, best first. `documents` (names) retrieves only from their contexts,
    /// `filter` (a dict, as for `search`) only from contexts whose metadata passes it;
    /// `retriever` and `hybrid_weight` choose the ranking, as for `search`.
    #[pyo3(signature = (prompt, k=4, method="picaso-r", *, max_tokens=64, temperature=0.0, top_p=1.0, seed=0, stop=None, documents=None, filter=None, retriever="dense", hybrid_weight=None))]
    #[allow(clippy::too_many_arguments)]
    fn query<'py>(
        &self,
        py: Python<'py>,
        prompt: &str,
        k: usize,
        method: &str,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        seed: u64,
        stop: Option<Vec<String>>,
        documents: Option<Vec<String>>,
        filter: Option<&Bound<'py, PyAny>>,
        retriever: &str,
        hybrid_weight: Option<f32>,
    ) -> PyResult<Generation> {
        let model = self.need_model()?;
        let retriever = picaso_store::Retriever::parse(retriever, hybrid_weight).map_err(store_err)?;
        let method = Method::parse_among(method, &Method::QUERY).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        if method == Method::Naive && (documents.is_some() || filter.is_some()) {
            return Err(raise(
                Kind::Invalid,
                "method \"naive\" retrieves nothing: drop `documents` and `filter`, or pick another method",
            ));
        }
        let filter = filter_from_py(filter)?;
        let tokens = model.tokenizer().and_then(|t| t.encode(prompt)).map_err(model_err)?;
        if tokens.is_empty() {
            return Err(raise(Kind::Invalid, "the prompt must contain at least one token"));
        }
        let opts =
            GenerateOptions { max_tokens, temperature, top_p, seed, stop: stop.unwrap_or_default(), ignore_eos: false };
        opts.validate().map_err(model_err)?;
        let store = &self.inner;
        let retrieves = method != Method::Naive;
        let embedder = if retrieves && retriever.needs_embedding() { Some(self.embedder()?) } else { None };
        let (hits, g) = py.detach(|| -> PyResult<_> {
            let q = match embedder {
                Some(e) => e.embed_one(prompt).map_err(embed_err)?,
                None => Vec::new(),
            };
            let contexts = match retrieves {
                false => picaso_store::Contexts::Nothing,
                true => {
                    let mut what = picaso_store::Retrieval::new(&q, k)
                        .within(documents.as_deref())
                        .matching(filter.as_ref())
                        .by(retriever, Some(prompt));
                    if let Some(e) = embedder {
                        what = what.embedded_by(e.fingerprint());
                    }
                    picaso_store::Contexts::Retrieved(what)
                }
            };
            let (hits, prepared) =
                picaso_store::gather(store, contexts, |ids| picaso_store::prepare(store, model, ids, method, None))
                    .map_err(store_err)?;
            let g = picaso_model::generate(model, &tokens, &prepared.state, &opts, |_| true).map_err(model_err)?;
            Ok((hits, g))
        })?;
        // Composition wants the most relevant last; callers read best first.
        let mut contexts = Vec::with_capacity(hits.len());
        for (id, score) in hits.iter().rev() {
            let r = store.get(*id).map_err(store_err)?;
            contexts.push(record_dict(py, &r, *score)?.unbind());
        }
        Ok(Generation::from(model, g, contexts))
    }

    /// Which of the contexts does `answer` (continuing `prompt`) owe most to? Each context is
    /// left out in turn, the others are combined again by `method` and the answer is scored.
    /// The contexts are `ids` (the last nearest the prompt) or else the `k` retrieved for the
    /// prompt (from `documents`' contexts only, and those whose metadata matches `filter`, when
    /// given). Returns {"method", "answer_tokens",
    /// "loglik" (nats with every context), "contexts"}: each context's record with
    /// "loglik_without" and "drop" (what the answer loses without it), the one it owes most to
    /// first.
    #[pyo3(signature = (prompt, answer, ids=None, k=4, method="picaso-r", *, documents=None, filter=None, retriever="dense", hybrid_weight=None))]
    #[allow(clippy::too_many_arguments)]
    fn attribute<'py>(
        &self,
        py: Python<'py>,
        prompt: &str,
        answer: &str,
        ids: Option<Vec<i64>>,
        k: usize,
        method: &str,
        documents: Option<Vec<String>>,
        filter: Option<&Bound<'py, PyAny>>,
        retriever: &str,
        hybrid_weight: Option<f32>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let model = self.need_model()?;
        let retriever = picaso_store::Retriever::parse(retriever, hybrid_weight).map_err(store_err)?;
        let method = Method::parse_among(method, &Method::QUERY).map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        if ids.is_some() && (documents.is_some() || filter.is_some()) {
            return Err(raise(
                Kind::Invalid,
                "`documents` and `filter` limit retrieval; with `ids` nothing is retrieved: give one or the other",
            ));
        }
        let filter = filter_from_py(filter)?;
        let tokenizer = model.tokenizer().map_err(model_err)?;
        let (prompt_ids, answer_ids) =
            (tokenizer.encode(prompt).map_err(model_err)?, tokenizer.encode(answer).map_err(model_err)?);
        let store = &self.inner;
        let attribute =
            |ids: &[i64]| picaso_store::attribute(store, model, ids, method, &prompt_ids, &answer_ids, None);
        let (hits, at): (Vec<(i64, Option<f32>)>, _) = match ids {
            Some(ids) => {
                let at = py.detach(|| attribute(&ids)).map_err(store_err)?;
                (ids.into_iter().map(|id| (id, None)).collect(), at)
            }
            None => {
                let embedder = if retriever.needs_embedding() { Some(self.embedder()?) } else { None };
                let q = match embedder {
                    Some(e) => py.detach(|| e.embed_one(prompt)).map_err(embed_err)?,
                    None => Vec::new(),
                };
                let mut what = picaso_store::Retrieval::new(&q, k)
                    .within(documents.as_deref())
                    .matching(filter.as_ref())
                    .by(retriever, Some(prompt));
                if let Some(e) = embedder {
                    what = what.embedded_by(e.fingerprint());
                }
                let (hits, at) =
                    py.detach(|| picaso_store::retrieve_then(store, what, attribute)).map_err(store_err)?;
                (hits.into_iter().map(|(id, score)| (id, Some(score))).collect(), at)
            }
        };
        let contexts = PyList::empty(py);
        for i in at.ranking() {
            let r = store.get(hits[i].0).map_err(store_err)?;
            let d = record_dict(py, &r, hits[i].1)?;
            d.set_item("loglik_without", at.without[i])?;
            d.set_item("drop", at.drop(i))?;
            contexts.append(d)?;
        }
        let out = PyDict::new(py);
        out.set_item("method", method.name())?;
        out.set_item("answer_tokens", at.answer_tokens)?;
        out.set_item("loglik", at.loglik)?;
        out.set_item("contexts", contexts)?;
        Ok(out)
    }

    /// The context with this id: {id, score (None), doc, segment, text}.
    fn get<'py>(&self, py: Python<'py>, id: i64) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.get(id).map_err(store_err)?;
        record_dict(py, &r, None)
    }

    /// The contexts of document `doc`, in segment order: [{id, score (None), doc, segment,
    /// text}]; empty for a document the store does not hold.
    fn document<'py>(&self, py: Python<'py>, doc: &str) -> PyResult<Bound<'py, PyList>> {
        let records = self.inner.document(doc).map_err(store_err)?;
        let list = PyList::empty(py);
        for r in &records {
            list.append(record_dict(py, r, None)?)?;
        }
        Ok(list)
    }

    /// Removes the context with this id (and its stored state unless another context shares it).
    fn delete(&self, py: Python<'_>, id: i64) -> PyResult<()> {
        let store = &self.inner;
        py.detach(|| {
            let _writer = store.lock_writes()?;
            store.delete(id)
        })
        .map_err(store_err)
    }

    /// Removes every context of document `doc`; returns how many (0 if it holds none).
    fn delete_document(&self, py: Python<'_>, doc: &str) -> PyResult<usize> {
        let store = &self.inner;
        py.detach(|| {
            let _writer = store.lock_writes()?;
            store.delete_document(doc).map(|ids| ids.len())
        })
        .map_err(store_err)
    }

    /// Removes every context whose metadata passes `filter` (as for `search`), all at once;
    /// returns their ids, ascending (empty when none passes).
    fn delete_matching(&self, py: Python<'_>, filter: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
        let filter = picaso_store::Filter::new(&metadata_from_py(filter, "filter")?).map_err(store_err)?;
        let store = &self.inner;
        py.detach(|| {
            let _writer = store.lock_writes()?;
            store.delete_many(&store.matching(&filter)?)
        })
        .map_err(store_err)
    }

    /// The stored state of one context.
    fn load_state(&self, py: Python<'_>, id: i64) -> PyResult<State> {
        let store = &self.inner;
        let inner = py.detach(|| store.load_state(id)).map_err(store_err)?;
        Ok(State { inner })
    }

    /// Reads every context's state object back and verifies it (present, checksum, a state of
    /// the store's model over the context's tokens, finite values), and lists the state objects
    /// no context names; `quick=True` reads none and finds only missing ones (one listing).
    /// With `repair=True` (needs the store's model), recomputes each broken state from the
    /// token ids in its row and removes the unnamed objects. Returns what `picaso check
    /// --json` prints: {"read", "contexts", "sound", "state_bytes", "problems": [{"id",
    /// "doc", "seg", "kind", "detail"}], "unreferenced": [{"key", "bytes"}],
    /// "unreferenced_bytes", "seconds", "repair": None or {"rewritten", "restated", "gone",
    /// "removed_objects", "removed_bytes", "left", "seconds"}}.
    #[pyo3(signature = (*, repair=false, quick=false))]
    fn check<'py>(&self, py: Python<'py>, repair: bool, quick: bool) -> PyResult<Bound<'py, PyAny>> {
        let model = if repair { Some(self.need_model()?) } else { None };
        let store = &self.inner;
        let report = py.detach(|| -> picaso_store::Result<serde_json::Value> {
            let found = picaso_store::check(store, quick, |_, _| {})?;
            let repaired = match &model {
                Some(m) => Some(picaso_store::repair(store, m, &found, |_, _| {})?),
                None => None,
            };
            Ok(picaso_store::report_json(&found, repaired.as_ref()))
        });
        let text = report.map_err(store_err)?.to_string();
        py.import("json")?.call_method1("loads", (text,))
    }

    /// {"contexts", "documents", "tokens", "state_bytes", "model", "catalog", "states"}.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats().map_err(store_err)?;
        let d = PyDict::new(py);
        d.set_item("contexts", s.contexts)?;
        d.set_item("documents", s.documents)?;
        d.set_item("tokens", s.tokens)?;
        d.set_item("state_bytes", s.state_bytes)?;
        d.set_item("model", s.model)?;
        d.set_item("catalog", s.catalog)?;
        d.set_item("states", s.states)?;
        Ok(d)
    }

    /// Every document, in name order: [{id, contexts, tokens, metadata}] (the metadata of its
    /// first context).
    fn documents<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let all = self.inner.all_documents().map_err(store_err)?;
        let list = PyList::empty(py);
        for d in all {
            let item = PyDict::new(py);
            item.set_item("metadata", metadata_to_py(py, &d.metadata)?)?;
            item.set_item("id", d.id)?;
            item.set_item("contexts", d.contexts)?;
            item.set_item("tokens", d.tokens)?;
            list.append(item)?;
        }
        Ok(list)
    }

    /// The ids of every context, or of those whose metadata passes `filter` (as for `search`),
    /// ascending (read one with `get`).
    #[pyo3(signature = (*, filter=None))]
    fn ids(&self, py: Python<'_>, filter: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<i64>> {
        let filter = filter_from_py(filter)?;
        py.detach(|| match &filter {
            None => self.inner.ids(),
            Some(f) => self.inner.matching(f),
        })
        .map_err(store_err)
    }

    /// Why no context passes `filter` (as for `search`), as far as counting tells, one line
    /// each (empty when it tells nothing): how many contexts each of its keys passes alone,
    /// when it has several; each key tested within objects that holds lists, with the
    /// `$elemMatch` that tests their elements. For when `ids(filter=...)` is empty.
    fn why_none_match(&self, py: Python<'_>, filter: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
        let filter = picaso_store::Filter::new(&metadata_from_py(filter, "filter")?).map_err(store_err)?;
        py.detach(|| self.inner.why_none_match(&filter)).map_err(store_err)
    }

    fn __len__(&self) -> PyResult<usize> {
        self.inner.len().map_err(store_err)
    }

    fn __repr__(&self) -> String {
        format!("Store({:?})", self.inner.location().to_string())
    }
}

impl Store {
    fn new(store: picaso_store::Store, model: Option<&Model>, embedder_dir: Option<PathBuf>) -> PyResult<Self> {
        if let Some(m) = model {
            store.require_model(&m.inner).map_err(store_err)?;
        }
        Ok(Self {
            inner: Arc::new(store),
            model: model.map(|m| m.inner.clone()),
            embedder: std::sync::OnceLock::new(),
            embedder_dir,
        })
    }

    /// The embedder, loaded on first use (see `embedder_for`).
    fn embedder(&self) -> PyResult<&picaso_embed::Embedder> {
        if let Some(e) = self.embedder.get() {
            return Ok(e);
        }
        let e = embedder_for(self.embedder_dir.clone(), Some(&self.inner))?;
        Ok(self.embedder.get_or_init(|| e))
    }

    fn need_model(&self) -> PyResult<&picaso_model::Model> {
        self.model
            .as_deref()
            .ok_or_else(|| raise(Kind::Invalid, "this store was opened without a model: pass model= to Store.open"))
    }
}

/// Documents from a list of strings or of {"id", "text"} dicts.
fn documents_of(list: &Bound<'_, PyList>) -> PyResult<Vec<picaso_store::Document>> {
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

/// The extension module.
#[pymodule]
fn _picaso(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_class::<State>()?;
    m.add_class::<Generation>()?;
    m.add_class::<Store>()?;
    m.add_function(wrap_pyfunction!(compose, m)?)?;
    m.add_function(wrap_pyfunction!(weights, m)?)?;
    m.add_function(wrap_pyfunction!(_compose_seconds, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
