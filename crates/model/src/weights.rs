//! Reading a Mamba-2 checkpoint into host memory: `model.safetensors`, a sharded
//! `model.safetensors.index.json`, or a torch `pytorch_model.bin`, in either naming
//! (HF transformers `backbone.embeddings.weight`, state-spaces `backbone.embedding.weight`).
//!
//! Every tensor is checked for presence, shape and finiteness here, so the engines can trust
//! their inputs; the fingerprint that ties states to this exact model is computed here too.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::config::{CheckpointFormat, Mamba2Config};
use crate::error::{Error, Result};

/// A dense row-major tensor in host memory (f32).
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<usize>,
    /// Values, row-major.
    pub data: Vec<f32>,
}

impl HostTensor {
    /// A tensor of the given shape; `data.len()` must equal the product of `shape`.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }
}

/// The weights of one Mamba-2 block, named as in the checkpoint's `backbone.layers.{i}`.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// Pre-norm RMSNorm weight (d_model).
    pub norm: Vec<f32>,
    /// in_proj (d_in_proj, d_model): rows [z | xBC | dt].
    pub in_proj: Vec<f32>,
    /// in_proj bias (d_in_proj), when the config has `use_bias`.
    pub in_proj_bias: Option<Vec<f32>>,
    /// Depthwise conv weight (conv_dim, d_conv).
    pub conv_weight: Vec<f32>,
    /// Conv bias (conv_dim), when the config has `use_conv_bias`.
    pub conv_bias: Option<Vec<f32>>,
    /// dt bias (nheads).
    pub dt_bias: Vec<f32>,
    /// A = -exp(A_log) (nheads).
    pub a_log: Vec<f32>,
    /// Skip connection D (nheads).
    pub d: Vec<f32>,
    /// Gated RMSNorm weight (d_inner).
    pub gated_norm: Vec<f32>,
    /// out_proj (d_model, d_inner).
    pub out_proj: Vec<f32>,
    /// out_proj bias (d_model), when the config has `use_bias`.
    pub out_proj_bias: Option<Vec<f32>>,
}

/// All weights of a Mamba-2 language model, validated against its config.
#[derive(Debug, Clone)]
pub struct Mamba2Weights {
    /// Token embeddings (vocab_size, d_model).
    pub embedding: Vec<f32>,
    /// One entry per block.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight (d_model).
    pub norm_f: Vec<f32>,
    /// Untied LM head (vocab_size, d_model); `None` when tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

/// The files a checkpoint folder offers, in order of preference.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::weights(&index, format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::weights(&index, "missing object `weight_map`"))?;
        let mut files: Vec<PathBuf> = Vec::new();
        for file in map.values() {
            let name = file.as_str().ok_or_else(|| Error::weights(&index, "weight_map values must be file names"))?;
            let path = dir.join(name);
            if !files.contains(&path) {
                files.push(path);
            }
        }
        return Ok(files);
    }
    for name in ["pytorch_model.bin", "model.bin"] {
        let p = dir.join(name);
        if p.is_file() {
            return Ok(vec![p]);
        }
    }
    Err(Error::weights(
        dir,
        "no weights found: expected model.safetensors, model.safetensors.index.json or pytorch_model.bin",
    ))
}

fn to_f32(path: &Path, name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>> {
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        Dtype::F64 => 8,
        other => {
            return Err(Error::weights(
                path,
                format!("tensor {name}: unsupported dtype {other:?} (want f32, f16, bf16 or f64)"),
            ))
        }
    };
    let mut out = crate::memory::big_vec(bytes.len() / width, 0.0f32);
    let chunks = bytes.chunks_exact(width);
    match dtype {
        Dtype::F32 => out.iter_mut().zip(chunks).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::BF16 => {
            out.iter_mut().zip(chunks).for_each(|(o, b)| *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        Dtype::F16 => {
            out.iter_mut().zip(chunks).for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32())
        }
        _ => {
            out.iter_mut().zip(chunks).for_each(|(o, b)| *o = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
        }
    }
    Ok(out)
}

/// Reads every tensor of the checkpoint into host f32 tensors, keyed by name.
pub fn read_tensors(dir: &Path) -> Result<HashMap<String, HostTensor>> {
    let mut out = HashMap::new();
    for file in weight_files(dir)? {
        let is_pickle = file.extension().is_some_and(|e| e == "bin");
        if is_pickle {
            read_pickle(&file, &mut out)?;
        } else {
            read_safetensors(&file, &mut out)?;
        }
    }
    Ok(out)
}

fn read_safetensors(file: &Path, out: &mut HashMap<String, HostTensor>) -> Result<()> {
    let f = std::fs::File::open(file).map_err(|e| Error::io(file, e))?;
    // SAFETY: the mapping is read-only and dropped before this function returns; a concurrent
    // writer truncating the file is outside what we can defend against (as for every mmap reader).
    let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(file, e))?;
    let st =
        SafeTensors::deserialize(&mmap).map_err(|e| Error::weights(file, format!("not a safetensors file: {e}")))?;
    for (name, view) in st.tensors() {
        let data = to_f32(file, &name, view.dtype(), view.data())?;
        out.insert(name, HostTensor::new(view.shape().to_vec(), data));
    }
    Ok(())
}

fn read_pickle(file: &Path, out: &mut HashMap<String, HostTensor>) -> Result<()> {
    let tensors = candle_core::pickle::read_all(file)
        .map_err(|e| Error::weights(file, format!("not a readable torch checkpoint: {e}")))?;
    for (name, t) in tensors {
        let shape = t.dims().to_vec();
        let data = t
            .to_dtype(candle_core::DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| Error::weights(file, format!("tensor {name}: {e}")))?;
        out.insert(name, HostTensor::new(shape, data));
    }
    Ok(())
}

/// Takes tensors out of a name map, checking shapes and values.
pub(crate) struct Take<'a> {
    pub(crate) dir: &'a Path,
    pub(crate) map: HashMap<String, HostTensor>,
}

impl Take<'_> {
    pub(crate) fn get(&mut self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self
            .map
            .remove(name)
            .ok_or_else(|| Error::weights(self.dir, format!("missing tensor `{name}` (expected shape {shape:?})")))?;
        // Checkpoints store some vectors as (n, 1) or (n, 1, k); compare element layouts.
        let squeeze = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if squeeze(&t.shape) != squeeze(shape) {
            return Err(Error::weights(
                self.dir,
                format!("tensor `{name}` has shape {:?}, expected {shape:?} from config.json", t.shape),
            ));
        }
        if let Some(i) = t.data.iter().position(|v| !v.is_finite()) {
            return Err(Error::weights(
                self.dir,
                format!("tensor `{name}` holds a non-finite value ({}) at flat index {i}", t.data[i]),
            ));
        }
        Ok(t.data)
    }
    pub(crate) fn opt(&mut self, name: &str, shape: &[usize], wanted: bool) -> Result<Option<Vec<f32>>> {
        if wanted {
            self.get(name, shape).map(Some)
        } else {
            self.map.remove(name);
            Ok(None)
        }
    }
}

impl Mamba2Weights {
    /// Loads and validates the weights in `dir` for `config`.
    pub fn load(dir: &Path, config: &Mamba2Config) -> Result<Self> {
        let map = read_tensors(dir)?;
        Self::from_tensors(dir, config, map)
    }

    /// Validates a name → tensor map (either naming) against `config`.
    pub fn from_tensors(dir: &Path, c: &Mamba2Config, map: HashMap<String, HostTensor>) -> Result<Self> {
        let mut t = Take { dir, map };
        let (d, v) = (c.d_model, c.vocab_size);
        // Either spelling is accepted whatever the config looked like; the error names the one
        // the config's format expects.
        let expected = match c.format {
            CheckpointFormat::HfTransformers => "backbone.embeddings.weight",
            CheckpointFormat::StateSpaces => "backbone.embedding.weight",
        };
        let embedding_name = ["backbone.embeddings.weight", "backbone.embedding.weight"]
            .into_iter()
            .find(|n| t.map.contains_key(*n))
            .unwrap_or(expected);
        let embedding = t.get(embedding_name, &[v, d])?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let p = format!("backbone.layers.{i}");
            let m = format!("{p}.mixer");
            layers.push(LayerWeights {
                norm: t.get(&format!("{p}.norm.weight"), &[d])?,
                in_proj: t.get(&format!("{m}.in_proj.weight"), &[c.d_in_proj(), d])?,
                in_proj_bias: t.opt(&format!("{m}.in_proj.bias"), &[c.d_in_proj()], c.use_bias)?,
                conv_weight: t.get(&format!("{m}.conv1d.weight"), &[c.conv_dim(), 1, c.d_conv])?,
                conv_bias: t.opt(&format!("{m}.conv1d.bias"), &[c.conv_dim()], c.use_conv_bias)?,
                dt_bias: t.get(&format!("{m}.dt_bias"), &[c.nheads])?,
                a_log: t.get(&format!("{m}.A_log"), &[c.nheads])?,
                d: t.get(&format!("{m}.D"), &[c.nheads])?,
                gated_norm: t.get(&format!("{m}.norm.weight"), &[c.d_inner()])?,
                out_proj: t.get(&format!("{m}.out_proj.weight"), &[d, c.d_inner()])?,
                out_proj_bias: t.opt(&format!("{m}.out_proj.bias"), &[d], c.use_bias)?,
            });
        }
        let norm_f = t.get("backbone.norm_f.weight", &[d])?;
        let lm_head = if c.tie_embeddings {
            t.map.remove("lm_head.weight");
            None
        } else {
            Some(t.get("lm_head.weight", &[v, d])?)
        };
        Ok(Self { embedding, layers, norm_f, lm_head })
    }

    /// Visits every tensor under its canonical (HF) name, in a fixed order.
    pub fn for_each(&self, mut f: impl FnMut(&str, &[f32])) {
        f("backbone.embeddings.weight", &self.embedding);
        for (i, l) in self.layers.iter().enumerate() {
            let m = format!("backbone.layers.{i}.mixer");
            f(&format!("backbone.layers.{i}.norm.weight"), &l.norm);
            f(&format!("{m}.in_proj.weight"), &l.in_proj);
            if let Some(b) = &l.in_proj_bias {
                f(&format!("{m}.in_proj.bias"), b);
            }
            f(&format!("{m}.conv1d.weight"), &l.conv_weight);
            if let Some(b) = &l.conv_bias {
                f(&format!("{m}.conv1d.bias"), b);
            }
            f(&format!("{m}.dt_bias"), &l.dt_bias);
            f(&format!("{m}.A_log"), &l.a_log);
            f(&format!("{m}.D"), &l.d);
            f(&format!("{m}.norm.weight"), &l.gated_norm);
            f(&format!("{m}.out_proj.weight"), &l.out_proj);
            if let Some(b) = &l.out_proj_bias {
                f(&format!("{m}.out_proj.bias"), b);
            }
        }
        f("backbone.norm_f.weight", &self.norm_f);
        if let Some(h) = &self.lm_head {
            f("lm_head.weight", h);
        }
    }

    /// Number of parameters (tied heads counted once).
    pub fn n_params(&self) -> usize {
        let mut n = 0;
        self.for_each(|_, t| n += t.len());
        n
    }

    /// A 128-bit fingerprint of the config's shape-relevant fields and every weight value.
    /// Independent of the file format, so the same model read from either layout matches.
    pub fn fingerprint(&self, config: &Mamba2Config) -> String {
        fingerprint("mamba2", config.to_hf_json(), |f| self.for_each(|name, data| f(name, data)))
    }
}

impl Mamba2Weights {
    /// Random weights for `config` (seeded): what tests and benchmarks use when no trained
    /// checkpoint is at hand. Scales keep activations O(1) and dt within [1e-3, 1e-1], like
    /// the Mamba-2 initialisation.
    pub fn random(config: &Mamba2Config, seed: u64) -> Self {
        let mut normal = normal_sampler(seed);
        let c = config;
        let (d, di, v) = (c.d_model, c.d_inner(), c.vocab_size);
        let mut layers = Vec::with_capacity(c.n_layer);
        for _ in 0..c.n_layer {
            let uniform01 = normal(c.nheads, 1.0).iter().map(|z| 0.5 * (1.0 + (z / 2.0).tanh())).collect::<Vec<_>>();
            // dt = exp(U[ln 1e-3, ln 1e-1]); dt_bias = softplus⁻¹(dt).
            let dt_bias = uniform01
                .iter()
                .map(|u| {
                    let dt = (1e-3f32.ln() + u * (1e-1f32.ln() - 1e-3f32.ln())).exp();
                    dt + (-(-dt).exp_m1()).ln()
                })
                .collect();
            layers.push(LayerWeights {
                norm: normal(d, 0.1).iter().map(|x| 1.0 + x).collect(),
                in_proj: normal(c.d_in_proj() * d, 1.0 / (d as f32).sqrt()),
                in_proj_bias: c.use_bias.then(|| normal(c.d_in_proj(), 0.1)),
                conv_weight: normal(c.conv_dim() * c.d_conv, 1.0 / (c.d_conv as f32).sqrt()),
                conv_bias: c.use_conv_bias.then(|| normal(c.conv_dim(), 0.1)),
                dt_bias,
                a_log: (0..c.nheads).map(|h| (1.0 + 15.0 * h as f32 / c.nheads.max(2) as f32).ln()).collect(),
                d: normal(c.nheads, 0.1).iter().map(|x| 1.0 + x).collect(),
                gated_norm: normal(di, 0.1).iter().map(|x| 1.0 + x).collect(),
                out_proj: normal(d * di, 1.0 / (di as f32).sqrt() / (2.0 * c.n_layer as f32).sqrt()),
                out_proj_bias: c.use_bias.then(|| normal(d, 0.1)),
            });
        }
        Self {
            embedding: normal(v * d, 1.0),
            layers,
            norm_f: normal(d, 0.1).iter().map(|x| 1.0 + x).collect(),
            lm_head: (!c.tie_embeddings).then(|| normal(v * d, 1.0 / (d as f32).sqrt())),
        }
    }
}

impl Mamba2Weights {
    /// Writes `config.json` (HF transformers spelling) and `model.safetensors` (f32) into `dir`,
    /// a folder [`crate::Model::load`] and HF transformers both read.
    pub fn save_pretrained(&self, dir: &Path, config: &Mamba2Config) -> Result<()> {
        let shapes = tensor_shapes(config);
        write_checkpoint(dir, &config.to_hf_json(), &shapes, |f| self.for_each(|name, data| f(name, data)))
    }
}

/// Writes `config.json` (`hf_json`) and `model.safetensors` (f32, tensors as `for_each` visits
/// them, shaped by `shapes` or 1-D) into `dir`, atomically file by file.
pub(crate) fn write_checkpoint(
    dir: &Path,
    hf_json: &serde_json::Value,
    shapes: &HashMap<String, Vec<usize>>,
    for_each: impl FnOnce(&mut dyn FnMut(&str, &[f32])),
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for_each(&mut |name: &str, data: &[f32]| {
        let shape = shapes.get(name).cloned().unwrap_or_else(|| vec![data.len()]);
        named.push((name.to_string(), shape, data.iter().flat_map(|v| v.to_le_bytes()).collect()));
    });
    let views = named
        .iter()
        .map(|(n, s, b)| safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::weights(dir, e.to_string()))?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let bytes = safetensors::tensor::serialize(views, Some(meta)).map_err(|e| Error::weights(dir, e.to_string()))?;
    crate::state::write_atomic(&dir.join("model.safetensors"), &bytes)?;
    let cfg = serde_json::to_string_pretty(hf_json).expect("config serialises");
    crate::state::write_atomic(&dir.join("config.json"), cfg.as_bytes())
}

/// `{prefix}-{xxh3-128}` of a config (its HF JSON without `architectures`) and every tensor
/// visited by `for_each` (name, length, f32 bytes): equal for the same model in any layout.
pub(crate) fn fingerprint(
    prefix: &str,
    mut config: serde_json::Value,
    for_each: impl FnOnce(&mut dyn FnMut(&str, &[f32])),
) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    if let Some(o) = config.as_object_mut() {
        o.remove("architectures");
    }
    h.update(config.to_string().as_bytes());
    for_each(&mut |name: &str, data: &[f32]| {
        h.update(name.as_bytes());
        h.update(&(data.len() as u64).to_le_bytes());
        // SAFETY: f32 has no padding and any byte pattern of it is a valid u8 sequence.
        let bytes = unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) };
        h.update(bytes);
    });
    format!("{prefix}-{:032x}", h.digest128())
}

/// Seeded standard-normal draws (Box-Muller) scaled by `std`, for random test weights.
pub(crate) fn normal_sampler(seed: u64) -> impl FnMut(usize, f32) -> Vec<f32> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    let mut rng = StdRng::seed_from_u64(seed);
    move |n: usize, std: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-12), rng.random());
                std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect()
    }
}

/// Checkpoint shapes of the tensors that are not plain vectors.
fn tensor_shapes(c: &Mamba2Config) -> HashMap<String, Vec<usize>> {
    let mut m = HashMap::new();
    m.insert("backbone.embeddings.weight".to_string(), vec![c.vocab_size, c.d_model]);
    m.insert("lm_head.weight".to_string(), vec![c.vocab_size, c.d_model]);
    for i in 0..c.n_layer {
        let p = format!("backbone.layers.{i}.mixer");
        m.insert(format!("{p}.in_proj.weight"), vec![c.d_in_proj(), c.d_model]);
        m.insert(format!("{p}.conv1d.weight"), vec![c.conv_dim(), 1, c.d_conv]);
        m.insert(format!("{p}.out_proj.weight"), vec![c.d_model, c.d_inner()]);
    }
    m
}
