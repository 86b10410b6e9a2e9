//! The GPU engine's device layer: memory, kernel launches and matrix products behind one small
//! trait, [`Gpu`], so the engine's host code (`mamba2::gpu`) is written once and runs on a
//! CUDA device (`cuda`, with the `cuda` feature: cudarc, kernels compiled at run time by
//! NVRTC, cuBLAS) or on the CPU emulator of the tests (`emulator`: the same kernel source
//! compiled by the system's C++ compiler), which holds it to the CPU engine on machines
//! without a GPU.
//!
//! Device memory is addressed by raw 64-bit pointers ([`DevicePtr`]) owned by [`DeviceBuf`]s;
//! kernels take one `#[repr(C)]` argument struct each (`kernels.rs`).

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(test)]
pub(crate) mod emulator;
pub(crate) mod graphs;
pub(crate) mod kernels;
pub(crate) mod kv_cache;
pub(crate) mod plan;
#[cfg(test)]
pub(crate) mod testing;
pub(crate) mod token_io;

use std::sync::Arc;

use crate::error::{Error, Result};

/// A device address.
pub type DevicePtr = u64;

/// The CUDA C source of every kernel (NVRTC compiles it at run time).
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");

/// How the large matrices (embedding, projections, LM head) are stored on the device: the
/// products read them in this type and accumulate in f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatrixDtype {
    /// f32 (exact against the CPU engine's f32 path to rounding).
    F32,
    /// bf16 (half the bytes; the usual choice on a GPU).
    Bf16,
}

impl MatrixDtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            MatrixDtype::F32 => 4,
            MatrixDtype::Bf16 => 2,
        }
    }
    /// The kernels' flag (`*_bf16` arguments).
    pub(crate) fn flag(self) -> i32 {
        i32::from(self == MatrixDtype::Bf16)
    }
    /// `v` as this type's bytes (bf16 rounds to nearest even).
    pub(crate) fn encode(self, v: &[f32]) -> Vec<u8> {
        match self {
            MatrixDtype::F32 => f32_bytes(v).to_vec(),
            MatrixDtype::Bf16 => {
                use rayon::prelude::*;
                let bits: Vec<u16> = v.par_iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
                bytemuck::cast_slice(&bits).to_vec()
            }
        }
    }
}

/// `out (rows × n) [+]= alpha · a (rows × k) · w (n × k)ᵀ`: activations times a weight matrix
/// stored row-major as (out features, in features), both in `dtype`, `out` in f32.
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    /// Storage type of `a` and `w`.
    pub dtype: MatrixDtype,
    /// Rows of `a` and `out`.
    pub rows: usize,
    /// Output features (rows of `w`).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// Activations.
    pub a: DevicePtr,
    /// Weights.
    pub w: DevicePtr,
    /// f32 output.
    pub out: DevicePtr,
    /// Add to `out` instead of overwriting it (the residual stream).
    pub accumulate: bool,
    /// The products' scale, applied in f32 after the sums (a hybrid's residual multiplier: the
    /// weights stay as stored, as on the CPU engine).
    pub alpha: f32,
}

/// What the engine needs of a device.
pub trait Gpu: Send + Sync + std::fmt::Debug {
    /// A human-readable name ("NVIDIA H200 (cuda:0)", "CPU emulator").
    fn name(&self) -> String;
    /// `bytes` of zeroed device memory.
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr>;
    /// Frees memory from [`Gpu::alloc_zeroed`].
    ///
    /// # Safety
    /// `ptr` came from this device's `alloc_zeroed` and is not used afterwards.
    unsafe fn free(&self, ptr: DevicePtr);
    /// Copies host bytes to `dst`.
    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()>;
    /// Copies device bytes at `src` to the host (waits for the work queued before it).
    fn download(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()>;
    /// Copies `bytes` from `src` to `dst` on the device (the ranges do not overlap).
    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()>;
    /// Runs kernel `name` over `grid` blocks of `block` threads with its argument struct.
    fn launch(&self, name: &'static str, grid: [u32; 3], block: [u32; 3], args: &[u8]) -> Result<()>;
    /// A matrix product ([`Gemm`]).
    fn gemm(&self, g: &Gemm) -> Result<()>;
    /// Starts recording: the launches and products that follow are kept, not run, until
    /// [`Gpu::end_capture`]. Nothing may be allocated, freed, uploaded or downloaded meanwhile.
    fn begin_capture(&self) -> Result<()>;
    /// Stops recording and returns what was recorded, to [`Graph::replay`] (a CUDA graph on a
    /// GPU). Also called after a failed recording, to leave the device as it was.
    fn end_capture(&self) -> Result<Box<dyn Graph>>;
}

/// Launches and products recorded once ([`Gpu::begin_capture`]) and replayed with one call: a
/// decode step is six kernels and products per layer, and on a GPU launching them one by one
/// takes longer than running them.
pub trait Graph: Send {
    /// Runs the recorded work again, in order, with the arguments it was recorded with (the
    /// same device addresses: the caller keeps those buffers, and refreshes their contents).
    fn replay(&self) -> Result<()>;
}

/// Keeps other threads off the device's stream while one thread records a graph: work queued
/// on a stream that is being captured joins the graph instead of running, so a state upload
/// from a server's ingest thread would otherwise vanish into the batcher's decode graph. Every
/// device call passes through [`CaptureGate::enter`]; the recording thread's own calls go on.
#[cfg(any(feature = "cuda", test))]
#[derive(Debug, Default)]
pub(crate) struct CaptureGate {
    /// The thread recording, if any.
    owner: std::sync::Mutex<Option<std::thread::ThreadId>>,
    ended: std::sync::Condvar,
}

#[cfg(any(feature = "cuda", test))]
impl CaptureGate {
    /// Waits until no other thread is recording; the guard keeps it so while the caller queues
    /// its work.
    pub(crate) fn enter(&self) -> std::sync::MutexGuard<'_, Option<std::thread::ThreadId>> {
        let me = std::thread::current().id();
        let owner = self.owner.lock().unwrap_or_else(|e| e.into_inner());
        self.ended.wait_while(owner, |o| o.is_some_and(|t| t != me)).unwrap_or_else(|e| e.into_inner())
    }
    /// Makes the calling thread the recording one (after any other's recording ends).
    pub(crate) fn begin(&self) {
        let mut owner = self.enter();
        *owner = Some(std::thread::current().id());
    }
    /// Ends the calling thread's recording and lets the others on.
    pub(crate) fn end(&self) {
        *self.owner.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.ended.notify_all();
    }
    /// Whether the calling thread is recording.
    pub(crate) fn recording(&self) -> bool {
        self.owner.lock().unwrap_or_else(|e| e.into_inner()).is_some_and(|t| t == std::thread::current().id())
    }
}

/// [`crate::cpu::layers::by_kind`] for a fallible pass: single tokens and longer sequences
/// run as separate passes, so a decode step's result never depends on its batch's longer
/// prompts; the first error of either pass is returned.
pub(crate) fn forward_by_kind(
    d: usize,
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut crate::state::State],
    run: impl Fn(&[u32], &[usize], &mut [&mut crate::state::State]) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let failure = std::cell::RefCell::new(None);
    let hidden = crate::cpu::layers::by_kind(d, tokens, lens, states, |tokens, lens, states| {
        run(tokens, lens, states).unwrap_or_else(|e| {
            failure.borrow_mut().get_or_insert(e);
            vec![0.0; tokens.len() * d]
        })
    });
    match failure.into_inner() {
        Some(e) => Err(e),
        None => Ok(hidden),
    }
}

/// `v` as the little-endian bytes the kernels read.
pub(crate) fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `v`'s bytes as they lie in memory, without a copy: what the kernels read on the
/// little-endian hosts CUDA runs on (a state of the 2.7B shapes is 168 MB; a byte-wise
/// encoding took longer than its upload).
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    const { assert!(cfg!(target_endian = "little"), "the GPU engine uploads f32 in host byte order") };
    bytemuck::cast_slice(v)
}

/// Device memory owned by the host: freed when dropped.
#[derive(Debug)]
pub struct DeviceBuf {
    gpu: Arc<dyn Gpu>,
    ptr: DevicePtr,
    bytes: usize,
}

impl DeviceBuf {
    /// `bytes` of zeroed memory (at least 1 byte is allocated, so the pointer is valid).
    pub fn zeroed(gpu: &Arc<dyn Gpu>, bytes: usize) -> Result<Self> {
        let ptr = gpu.alloc_zeroed(bytes.max(4))?;
        Ok(Self { gpu: gpu.clone(), ptr, bytes })
    }
    /// A copy of `data` on the device.
    pub fn from_bytes(gpu: &Arc<dyn Gpu>, data: &[u8]) -> Result<Self> {
        let buf = Self::zeroed(gpu, data.len())?;
        gpu.upload(buf.ptr, data)?;
        Ok(buf)
    }
    /// A copy of `v` on the device, as f32.
    pub fn from_f32(gpu: &Arc<dyn Gpu>, v: &[f32]) -> Result<Self> {
        Self::from_bytes(gpu, f32_bytes(v))
    }
    /// A copy of `v` on the device, as i32.
    pub fn from_i32(gpu: &Arc<dyn Gpu>, v: &[i32]) -> Result<Self> {
        Self::from_bytes(gpu, &i32_bytes(v))
    }
    /// The device address.
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// The address `offset` bytes in.
    pub fn at(&self, offset: usize) -> DevicePtr {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The contents as f32.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.read_f32(0, self.bytes / 4)
    }
    /// Writes `v` (f32) from `offset_floats` on.
    pub fn write_f32(&self, offset_floats: usize, v: &[f32]) -> Result<()> {
        if (offset_floats + v.len()) * 4 > self.bytes {
            return Err(Error::Input(format!(
                "internal: writing {} floats at {offset_floats} into a device buffer of {} bytes",
                v.len(),
                self.bytes
            )));
        }
        self.gpu.upload(self.at(offset_floats * 4), f32_bytes(v))
    }
    /// `count` floats from `offset_floats` on.
    pub fn read_f32(&self, offset_floats: usize, count: usize) -> Result<Vec<f32>> {
        let mut raw = vec![0u8; count * 4];
        self.gpu.download(self.at(offset_floats * 4), &mut raw)?;
        Ok(raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

impl Drop for DeviceBuf {
    fn drop(&mut self) {
        // SAFETY: the pointer came from this device and the buffer owns it.
        unsafe { self.gpu.free(self.ptr) }
    }
}
