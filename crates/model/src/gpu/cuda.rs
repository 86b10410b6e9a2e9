//! A [`Gpu`] on an NVIDIA device through cudarc: the CUDA driver, NVRTC and cuBLAS are loaded
//! at run time (a build needs none of them), the kernels compiled once per process for the
//! device's architecture. Every call binds the context to the calling thread and queues on the
//! engine's one stream (a created stream, not the legacy default one, which CUDA cannot
//! capture into a graph), so launches, products and copies run in call order; a download
//! waits for the stream.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{result as driver, sys as driver_sys, CudaContext, CudaFunction, CudaGraph, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::kernels::KERNELS;
use super::{CaptureGate, DevicePtr, Gemm, Gpu, Graph, MatrixDtype, KERNEL_SOURCE};
use crate::error::{Error, Result};

/// Where a user gets the libraries (the driver comes with the GPU's driver install).
const LIBRARY_HINT: &str = "install the CUDA 12 runtime libraries (e.g. `pip install nvidia-cuda-nvrtc-cu12 nvidia-cublas-cu12`) and put their lib folders on LD_LIBRARY_PATH";

/// cuBLAS's workspace, set once so that a product allocates nothing while a graph is being
/// captured (32 MiB: cuBLAS's recommendation for Hopper, more than enough before it).
const BLAS_WORKSPACE: usize = 32 << 20;

/// An NVIDIA GPU with the engine's kernels loaded.
pub struct CudaGpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
    blas_workspace: DevicePtr,
    /// Other threads wait while one records a graph: their work would join it.
    gate: CaptureGate,
    name: String,
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            let _ = self.stream.synchronize();
            // SAFETY: allocated in `new`, used only by this handle's products, all finished.
            let _ = unsafe { driver::free_sync(self.blas_workspace) };
        }
    }
}

/// A captured CUDA graph.
struct CudaReplay(CudaGraph);

// SAFETY: a CUDA graph may be launched from any thread with its context bound (`launch` binds
// it), as long as calls on it are serialised: the engine replays under its pass lock, and a
// `Graph` is replayed through `&self` by one owner at a time (it is `Send`, not `Sync`).
unsafe impl Send for CudaReplay {}

impl Graph for CudaReplay {
    fn replay(&self) -> Result<()> {
        self.0.launch().map_err(gpu_err("replaying a CUDA graph"))
    }
}

impl std::fmt::Debug for CudaGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGpu").field("name", &self.name).finish_non_exhaustive()
    }
}

fn gpu_err(what: &str) -> impl Fn(driver::DriverError) -> Error + '_ {
    move |e| Error::Gpu(format!("{what}: {e}"))
}

/// Checks that the driver, NVRTC and cuBLAS can be loaded (cudarc panics on a missing one).
fn check_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries.
    let (driver, nvrtc, cublas) = unsafe {
        (driver_sys::is_culib_present(), cudarc::nvrtc::sys::is_culib_present(), blas_sys::is_culib_present())
    };
    if !driver {
        return Err(Error::Gpu(
            "no CUDA driver found (libcuda.so): this machine has no NVIDIA driver or GPU; use --device cpu".into(),
        ));
    }
    for (found, lib) in [(nvrtc, "NVRTC (libnvrtc.so)"), (cublas, "cuBLAS (libcublas.so)")] {
        if !found {
            return Err(Error::Gpu(format!("{lib} not found: {LIBRARY_HINT}")));
        }
    }
    Ok(())
}

/// The kernels compiled to PTX for compute capability `major.minor` (no GPU needed: NVRTC only).
pub fn compile_kernels(major: i32, minor: i32) -> Result<Ptx> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Gpu(format!("NVRTC (libnvrtc.so) not found: {LIBRARY_HINT}")));
    }
    let options = CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}"), "--std=c++17".into()],
        fmad: Some(true),
        ..Default::default()
    };
    compile_ptx_with_opts(KERNEL_SOURCE, options).map_err(|e| Error::Gpu(format!("compiling the kernels: {e:?}")))
}

impl CudaGpu {
    /// Opens GPU `ordinal`, compiles and loads the kernels, and creates a cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Self> {
        check_libraries()?;
        let count = CudaContext::device_count().map_err(gpu_err("counting GPUs"))?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::Gpu(match count {
                0 => "the CUDA driver sees no GPU; use --device cpu".into(),
                n => format!("no GPU {ordinal}: this machine has {n} (cuda:0 … cuda:{})", n - 1),
            }));
        }
        let ctx = CudaContext::new(ordinal).map_err(gpu_err("opening the GPU"))?;
        let (major, minor) = ctx.compute_capability().map_err(gpu_err("reading the compute capability"))?;
        if major < 8 {
            return Err(Error::Gpu(format!(
                "compute capability {major}.{minor}: the GPU engine's bf16 products need 8.0 or newer (A100, H100, …); use --device cpu"
            )));
        }
        let module = ctx.load_module(compile_kernels(major, minor)?).map_err(|e| {
            let hint = match e.0 {
                driver_sys::cudaError_enum::CUDA_ERROR_UNSUPPORTED_PTX_VERSION => {
                    "; NVRTC is newer than the driver: install the nvidia-cuda-nvrtc-cu12 release that matches the CUDA version nvidia-smi shows"
                }
                _ => "",
            };
            Error::Gpu(format!("loading the kernels: {e}{hint}"))
        })?;
        let functions = KERNELS
            .iter()
            .map(|&k| Ok((k, module.load_function(k).map_err(gpu_err(k))?)))
            .collect::<Result<HashMap<_, _>>>()?;
        let stream = ctx.new_stream().map_err(gpu_err("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| Error::Gpu(format!("starting cuBLAS: {e:?}")))?;
        // SAFETY: a fresh allocation handed to cuBLAS for this handle's products only.
        let blas_workspace = unsafe {
            let p = driver::malloc_sync(BLAS_WORKSPACE).map_err(gpu_err("allocating cuBLAS's workspace"))?;
            let status = blas_sys::cublasSetWorkspace_v2(*blas.handle(), p as *mut c_void, BLAS_WORKSPACE);
            if status != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                let _ = driver::free_sync(p);
                return Err(Error::Gpu(format!("setting cuBLAS's workspace: {status:?}")));
            }
            p
        };
        let name =
            format!("{} (cuda:{ordinal}, compute {major}.{minor})", ctx.name().unwrap_or_else(|_| "NVIDIA GPU".into()));
        Ok(Self { ctx, stream, functions, blas, blas_workspace, gate: CaptureGate::default(), name })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(gpu_err("binding the context"))
    }
}

impl Gpu for CudaGpu {
    fn name(&self) -> String {
        self.name.clone()
    }
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr> {
        let _gate = self.gate.enter();
        self.bind()?;
        // SAFETY: a fresh allocation, zeroed on the stream before any later use of it there.
        unsafe {
            let p = driver::malloc_sync(bytes).map_err(|e| Error::Gpu(format!("allocating {bytes} bytes: {e}")))?;
            driver::memset_d8_async(p, 0, bytes, self.stream.cu_stream()).map_err(gpu_err("zeroing memory"))?;
            Ok(p)
        }
    }
    unsafe fn free(&self, ptr: DevicePtr) {
        let _gate = self.gate.enter();
        if self.bind().is_ok() {
            // Queued kernels may still read the buffer: wait for them first. A failure here (a
            // context already torn down) leaves nothing to do.
            let _ = self.stream.synchronize();
            let _ = driver::free_sync(ptr);
        }
    }
    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let _gate = self.gate.enter();
        self.bind()?;
        // SAFETY: `dst` is an allocation of at least `src.len()` bytes (DeviceBuf checks). From
        // pageable memory the call returns once `src` is staged, so `src` may go right after.
        unsafe { driver::memcpy_htod_async(dst, src, self.stream.cu_stream()) }.map_err(gpu_err("copying to the GPU"))
    }
    fn download(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let _gate = self.gate.enter();
        self.bind()?;
        // SAFETY: `src` holds at least `dst.len()` bytes; the copy is queued after the work that
        // writes them, and `dst` is read only after the stream has finished.
        unsafe { driver::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(gpu_err("copying from the GPU"))?;
        self.stream.synchronize().map_err(gpu_err("waiting for the GPU"))
    }
    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        let _gate = self.gate.enter();
        self.bind()?;
        // SAFETY: both are allocations of at least `bytes` bytes (the caller's buffers).
        unsafe { driver::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(gpu_err("copying on the GPU"))
    }
    fn launch(&self, name: &'static str, grid: [u32; 3], block: [u32; 3], args: &[u8]) -> Result<()> {
        let _gate = self.gate.enter();
        self.bind()?;
        let f = self.functions.get(name).ok_or_else(|| Error::Gpu(format!("no kernel {name:?}")))?;
        let mut params = [args.as_ptr() as *mut c_void];
        // SAFETY: `args` is the kernel's one argument struct, laid out as the kernel reads it.
        unsafe {
            driver::launch_kernel(
                f.cu_function(),
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(|e| Error::Gpu(format!("launching {name}: {e}")))
    }
    fn gemm(&self, g: &Gemm) -> Result<()> {
        let _gate = self.gate.enter();
        self.bind()?;
        // Row-major out (rows × n) = a (rows × k) · wᵀ is, column-major, outᵀ (n × rows) =
        // op(W) · A with W read as a k × n column-major matrix, transposed.
        let ty = match g.dtype {
            MatrixDtype::F32 => blas_sys::cudaDataType::CUDA_R_32F,
            MatrixDtype::Bf16 => blas_sys::cudaDataType::CUDA_R_16BF,
        };
        let (alpha, beta) = (g.alpha, if g.accumulate { 1.0f32 } else { 0.0 });
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| Error::Gpu(format!("a product dimension of {v} exceeds i32")));
        let (n, rows, k) = (dim(g.n)?, dim(g.rows)?, dim(g.k)?);
        // SAFETY: the pointers hold rows × k, n × k and rows × n elements of their types.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                n,
                rows,
                k,
                (&alpha as *const f32).cast(),
                g.w as *const c_void,
                ty,
                k,
                g.a as *const c_void,
                ty,
                k,
                (&beta as *const f32).cast(),
                g.out as *mut c_void,
                blas_sys::cudaDataType::CUDA_R_32F,
                n,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Gpu(format!("matrix product ({} × {} · {} × {}): {e:?}", g.rows, g.k, g.n, g.k)))
    }
    fn begin_capture(&self) -> Result<()> {
        if self.gate.recording() {
            return Err(Error::Gpu("internal: a graph is already being recorded".into()));
        }
        self.bind()?;
        self.gate.begin();
        // Thread-local mode: a call on this thread that a capture cannot hold (an allocation,
        // a synchronous copy) fails instead of silently breaking the graph.
        let begun = self
            .stream
            .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(gpu_err("starting a CUDA graph capture"));
        if begun.is_err() {
            self.gate.end();
        }
        begun
    }
    fn end_capture(&self) -> Result<Box<dyn Graph>> {
        if !self.gate.recording() {
            return Err(Error::Gpu("internal: this thread records no graph".into()));
        }
        let graph = self.bind().and_then(|()| {
            self.stream
                .end_capture(driver_sys::CUgraphInstantiate_flags(0))
                .map_err(gpu_err("ending a CUDA graph capture"))?
                .ok_or_else(|| Error::Gpu("a CUDA graph capture recorded nothing".into()))
        });
        self.gate.end();
        Ok(Box::new(CudaReplay(graph?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC compiles every kernel for the GPUs the engine targets. Needs only libnvrtc (the
    /// `nvidia-cuda-nvrtc-cu12` wheel; CI installs it), no GPU.
    #[test]
    fn nvrtc_compiles_every_kernel() {
        for (major, minor) in [(8, 0), (9, 0)] {
            let ptx = compile_kernels(major, minor).unwrap().to_src();
            for k in KERNELS {
                assert!(ptx.contains(&format!(".entry {k}(")), "compute {major}.{minor}: no entry {k}");
            }
        }
    }

    /// Without a GPU the engine says so instead of panicking.
    #[test]
    fn no_gpu_is_a_clear_error() {
        // SAFETY: only tries to dlopen the driver.
        if unsafe { driver_sys::is_culib_present() } {
            return; // a machine with a driver: nothing to check here (gpu_bench.sh runs the GPU)
        }
        let err = CudaGpu::new(0).unwrap_err().to_string();
        assert!(err.contains("no CUDA driver") && err.contains("--device cpu"), "{err}");
    }
}
