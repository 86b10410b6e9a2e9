//! Reading a checkpoint into host memory: `model.safetensors`, a sharded
//! `model.safetensors.index.json`, or a torch `pytorch_model.bin`; writing one; and the
//! fingerprint that ties states to one exact model. Each architecture names and checks its own
//! tensors (`crate::mamba2::weights`, ...).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

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
