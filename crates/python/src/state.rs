//! `State`: a model's state after some tokens, its arrays as numpy arrays, and states built from
//! arrays (the transformers interop moves states through these).

use std::path::PathBuf;

use numpy::ndarray::{ArrayView, IxDyn};
use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use picaso_model::{Arch, LayerState, StateDtype, StateShape};

use crate::errors::{model_err, raise, Kind};

/// The state of a model after some tokens: per layer the SSM state, the conv tail and the log
/// of the accumulated decay. Immutable; its arrays are read-only numpy views of its memory.
#[pyclass(frozen, module = "picaso")]
pub(crate) struct State {
    pub(crate) inner: picaso_model::State,
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

    /// Writes the state (atomically); `dtype` "f32", "bf16" (half the bytes), "int8" or "int4"
    /// (a scale per 32 values; 3.8x and 7.1x smaller); log-decays stay f32.
    #[pyo3(signature = (path, dtype="f32"))]
    fn save(&self, py: Python<'_>, path: PathBuf, dtype: &str) -> PyResult<()> {
        let dtype = dtype.parse::<StateDtype>().map_err(|e| raise(Kind::Invalid, e.to_string()))?;
        py.detach(|| self.inner.save(&path, dtype)).map_err(model_err)
    }

    /// Builds a state from arrays, one tuple per layer of the model: a Mamba layer's
    /// (ssm, conv, log_decay) — Mamba-2 ssm (heads, headdim, d_state), conv (conv_dim,
    /// d_conv - 1), log_decay (heads); Mamba-1 ssm (d_inner, d_state), conv (d_inner,
    /// d_conv - 1), log_decay (d_inner, d_state) — or, in a hybrid, an attention layer's
    /// (keys, values), each (kv_heads, tokens, head_dim), or a Falcon-H1 layer's
    /// (ssm, conv, log_decay, keys, values). The fingerprint names the model it
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
        if let Some((i, l)) = layers.iter().enumerate().find(|(_, l)| ![2, 3, 5].contains(&l.len())) {
            return Err(invalid(format!(
                "layer {i} has {} arrays: a Mamba layer takes (ssm, conv, log_decay), an attention layer (keys, values), \
                 a layer with both (Falcon-H1) (ssm, conv, log_decay, keys, values)",
                l.len()
            )));
        }
        // A layer's Mamba arrays come first, its keys and values last.
        let mamba: Vec<(usize, &[PyReadonlyArrayDyn<'_, f32>])> =
            layers.iter().enumerate().filter(|(_, l)| l.len() != 2).map(|(i, l)| (i, &l[..3])).collect();
        let attention: Vec<(usize, &[PyReadonlyArrayDyn<'_, f32>])> =
            layers.iter().enumerate().filter(|(_, l)| l.len() != 3).map(|(i, l)| (i, &l[l.len() - 2..])).collect();
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
                    ssm: mamba.iter().map(|(i, _)| *i).collect(),
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

    /// "mamba", "attention" or "hybrid" (both, side by side: Falcon-H1) per layer of the model
    /// (as the hub's `layer_types`).
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
    /// "log_decay"} (read-only views), an attention layer's {"keys", "values"} (copies), a
    /// Falcon-H1 layer's all five.
    #[getter]
    fn layers<'py>(this: &Bound<'py, Self>) -> PyResult<Bound<'py, PyList>> {
        let py = this.py();
        let list = PyList::empty(py);
        let types = this.get().layer_types();
        for (i, kind) in types.into_iter().enumerate() {
            let d = PyDict::new(py);
            if kind != "attention" {
                d.set_item("ssm", Self::ssm(this, i)?)?;
                d.set_item("conv", Self::conv(this, i)?)?;
                d.set_item("log_decay", Self::log_decay(this, i)?)?;
            }
            if kind != "mamba" {
                d.set_item("keys", this.get().keys(py, i)?)?;
                d.set_item("values", this.get().values(py, i)?)?;
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
            Some(a) if a.layers.contains(&i) && !a.ssm.contains(&i) => {
                return Err(raise(
                    Kind::Invalid,
                    format!("layer {i} is an attention layer: read its keys({i}) and values({i})"),
                ))
            }
            Some(a) => a.ssm.iter().position(|&l| l == i),
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
