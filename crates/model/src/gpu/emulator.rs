//! A [`Gpu`] on the CPU for the tests: `kernels.cu` compiled by the system's C++ compiler with
//! `emulator.h` (blocks run one after another, each with its threads as OS threads), host
//! memory for device memory, and a plain triple loop for the matrix product. The engine's
//! host code and kernels then run, unchanged, on machines without a GPU.

use std::ffi::{c_void, CString};
use std::sync::{Mutex, OnceLock};

use super::{CaptureGate, DevicePtr, Gemm, Gpu, Graph, MatrixDtype, KERNEL_SOURCE};
use crate::error::{Error, Result};

/// The compiled kernels, loaded once per process.
struct Library {
    handle: *mut c_void,
}

// SAFETY: the handle is only used to look up symbols, which dlsym allows from any thread.
unsafe impl Send for Library {}
unsafe impl Sync for Library {}

static LIBRARY: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
/// One launch at a time: the emulator keeps the launch shape in globals.
static LAUNCH: Mutex<()> = Mutex::new(());

fn library() -> Result<&'static Library> {
    LIBRARY.get_or_init(build).as_ref().map_err(|e| Error::Input(e.clone()))
}

/// Compiles the kernels into a shared library under the temporary folder (named by a hash of
/// the sources, so concurrent test processes share one build) and loads it.
fn build() -> std::result::Result<Library, String> {
    let header = include_str!("emulator.h");
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{header}{KERNEL_SOURCE}").as_bytes());
    let dir = std::env::temp_dir().join(format!("picaso-gpu-emulator-{hash:016x}"));
    let lib = dir.join("libkernels.so");
    if !lib.exists() {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let src = dir.join(format!("kernels-{}.cpp", std::process::id()));
        std::fs::write(&src, format!("{header}\n{KERNEL_SOURCE}")).map_err(|e| format!("{}: {e}", src.display()))?;
        let tmp = dir.join(format!("libkernels-{}.so", std::process::id()));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let out = std::process::Command::new(&cxx)
            .args(["-std=c++17", "-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror", "-o"])
            .arg(&tmp)
            .arg(&src)
            .output()
            .map_err(|e| format!("the GPU emulator needs a C++ compiler ({cxx}: {e}); install g++ or set CXX"))?;
        if !out.status.success() {
            return Err(format!(
                "compiling the kernels for the emulator failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::fs::rename(&tmp, &lib).map_err(|e| format!("{}: {e}", lib.display()))?;
    }
    let path = CString::new(lib.to_string_lossy().as_bytes()).expect("a path without NUL");
    // SAFETY: dlopen of a library this function just built.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!("loading {} failed", lib.display()));
    }
    Ok(Library { handle })
}

impl Library {
    fn symbol(&self, name: &str) -> Result<*mut c_void> {
        let c = CString::new(name).expect("a symbol without NUL");
        // SAFETY: a lookup in a loaded library.
        let f = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        if f.is_null() {
            return Err(Error::Input(format!("the emulator has no kernel {name:?}")));
        }
        Ok(f)
    }
}

/// The size of a kernel's argument struct as the C++ compiler lays it out.
pub(crate) fn c_args_size(kernel: &str) -> Result<usize> {
    let f = library()?.symbol(&format!("{kernel}_args_size"))?;
    // SAFETY: the symbol is `extern "C" unsigned long name_args_size()`.
    let f: extern "C" fn() -> libc::c_ulong = unsafe { std::mem::transmute(f) };
    Ok(f() as usize)
}

/// The CPU emulator of a GPU.
#[derive(Debug, Default)]
pub(crate) struct Emulator {
    /// While recording ([`Gpu::begin_capture`]): the work so far, kept instead of run.
    recording: Mutex<Option<Vec<Op>>>,
    /// Other threads wait while one records, as on a CUDA stream.
    gate: CaptureGate,
}

/// One recorded piece of work.
#[derive(Debug, Clone)]
enum Op {
    Launch { name: &'static str, grid: [u32; 3], block: [u32; 3], args: Vec<u8> },
    Gemm(Gemm),
}

impl Emulator {
    /// Builds (once per process) and loads the emulated kernels.
    pub(crate) fn new() -> Result<Self> {
        library()?;
        Ok(Self::default())
    }

    /// Keeps `op` if recording; otherwise hands it back to be run.
    fn record(&self, op: Op) -> Option<Op> {
        match self.recording.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            Some(ops) => {
                ops.push(op);
                None
            }
            None => Some(op),
        }
    }

    /// Refuses what a CUDA stream capture refuses: memory calls while recording.
    fn not_recording(&self, what: &str) -> Result<()> {
        match self.recording.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
            true => Err(Error::Gpu(format!("internal: {what} while recording a graph"))),
            false => Ok(()),
        }
    }
}

/// Work recorded by the emulator, run again on replay.
struct EmulatedGraph {
    ops: Vec<Op>,
}

impl Graph for EmulatedGraph {
    fn replay(&self) -> Result<()> {
        self.ops.iter().try_for_each(run)
    }
}

fn run(op: &Op) -> Result<()> {
    match op {
        Op::Launch { name, grid, block, args } => run_launch(name, *grid, *block, args),
        Op::Gemm(g) => {
            run_gemm(g);
            Ok(())
        }
    }
}

fn run_launch(name: &str, grid: [u32; 3], block: [u32; 3], args: &[u8]) -> Result<()> {
    let lib = library()?;
    let config = lib.symbol("emu_config")?;
    let kernel = lib.symbol(name)?;
    let _one = LAUNCH.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: the symbols are `emu_config(unsigned × 6)` and `name(const void*)`; `args` is the
    // kernel's argument struct (its size is tested against the C compiler's).
    unsafe {
        let config: extern "C" fn(u32, u32, u32, u32, u32, u32) = std::mem::transmute(config);
        let kernel: extern "C" fn(*const c_void) = std::mem::transmute(kernel);
        config(grid[0], grid[1], grid[2], block[0], block[1], block[2]);
        kernel(args.as_ptr().cast());
    }
    Ok(())
}

fn run_gemm(g: &Gemm) {
    let a = read_matrix(g.a, g.rows * g.k, g.dtype);
    let w = read_matrix(g.w, g.n * g.k, g.dtype);
    // SAFETY: `out` is an emulated allocation of rows × n f32.
    let out = unsafe { std::slice::from_raw_parts_mut(g.out as *mut f32, g.rows * g.n) };
    for r in 0..g.rows {
        for j in 0..g.n {
            let dot: f32 = a[r * g.k..(r + 1) * g.k].iter().zip(&w[j * g.k..(j + 1) * g.k]).map(|(x, y)| x * y).sum();
            let dot = if g.alpha == 1.0 { dot } else { g.alpha * dot };
            let o = &mut out[r * g.n + j];
            *o = if g.accumulate { *o + dot } else { dot };
        }
    }
}

fn read_matrix(ptr: DevicePtr, count: usize, dtype: MatrixDtype) -> Vec<f32> {
    // SAFETY: emulated device pointers are host allocations of at least `count` elements.
    unsafe {
        match dtype {
            MatrixDtype::F32 => std::slice::from_raw_parts(ptr as *const f32, count).to_vec(),
            MatrixDtype::Bf16 => {
                std::slice::from_raw_parts(ptr as *const half::bf16, count).iter().map(|v| v.to_f32()).collect()
            }
        }
    }
}

impl Gpu for Emulator {
    fn name(&self) -> String {
        "CPU emulator".into()
    }
    fn alloc_zeroed(&self, bytes: usize) -> Result<DevicePtr> {
        let _gate = self.gate.enter();
        self.not_recording("allocating")?;
        // SAFETY: calloc; null checked.
        let p = unsafe { libc::calloc(bytes.max(1), 1) };
        if p.is_null() {
            return Err(Error::Input(format!("the emulator could not allocate {bytes} bytes")));
        }
        Ok(p as DevicePtr)
    }
    unsafe fn free(&self, ptr: DevicePtr) {
        let _gate = self.gate.enter();
        libc::free(ptr as *mut c_void)
    }
    fn upload(&self, dst: DevicePtr, src: &[u8]) -> Result<()> {
        let _gate = self.gate.enter();
        self.not_recording("uploading")?;
        // SAFETY: `dst` is an emulated allocation of at least `src.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
    fn download(&self, src: DevicePtr, dst: &mut [u8]) -> Result<()> {
        let _gate = self.gate.enter();
        self.not_recording("downloading")?;
        // SAFETY: as `upload`.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
    fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        let _gate = self.gate.enter();
        self.not_recording("copying")?;
        // SAFETY: both are emulated allocations of at least `bytes` bytes, not overlapping.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }
    fn launch(&self, name: &'static str, grid: [u32; 3], block: [u32; 3], args: &[u8]) -> Result<()> {
        let _gate = self.gate.enter();
        match self.record(Op::Launch { name, grid, block, args: args.to_vec() }) {
            Some(op) => run(&op),
            None => Ok(()),
        }
    }
    fn gemm(&self, g: &Gemm) -> Result<()> {
        let _gate = self.gate.enter();
        match self.record(Op::Gemm(*g)) {
            Some(op) => run(&op),
            None => Ok(()),
        }
    }
    fn begin_capture(&self) -> Result<()> {
        if self.gate.recording() {
            return Err(Error::Gpu("internal: a graph is already being recorded".into()));
        }
        self.gate.begin();
        *self.recording.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
        Ok(())
    }
    fn end_capture(&self) -> Result<Box<dyn Graph>> {
        if !self.gate.recording() {
            return Err(Error::Gpu("internal: this thread records no graph".into()));
        }
        let ops = self.recording.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default();
        self.gate.end();
        Ok(Box::new(EmulatedGraph { ops }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// While one thread records, another thread's device work waits for the recording to end
    /// (on a CUDA stream it would join the graph instead of running), and the recording holds
    /// only the recording thread's work.
    #[test]
    fn other_threads_wait_while_one_records() {
        let emu = Arc::new(Emulator::new().unwrap());
        let buf = emu.alloc_zeroed(4).unwrap();
        let gemm = Gemm {
            dtype: MatrixDtype::F32,
            rows: 1,
            n: 1,
            k: 1,
            a: buf,
            w: buf,
            out: buf,
            accumulate: true,
            alpha: 1.0,
        };
        emu.begin_capture().unwrap();
        emu.gemm(&gemm).unwrap();
        let uploaded = Arc::new(AtomicBool::new(false));
        let other = {
            let (emu, uploaded) = (emu.clone(), uploaded.clone());
            std::thread::spawn(move || {
                emu.upload(buf, &2f32.to_le_bytes()).unwrap();
                uploaded.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert!(!uploaded.load(Ordering::SeqCst), "another thread's upload ran during the recording");
        assert!(emu.upload(buf, &[0; 4]).is_err(), "the recording thread may not upload");
        let graph = emu.end_capture().unwrap();
        other.join().unwrap();
        assert!(uploaded.load(Ordering::SeqCst));
        // The graph holds the one product (2 · 2 added to 2), not the upload.
        graph.replay().unwrap();
        let mut out = [0u8; 4];
        emu.download(buf, &mut out).unwrap();
        assert_eq!(f32::from_le_bytes(out), 6.0);
        assert!(emu.end_capture().is_err(), "no recording to end");
        unsafe { emu.free(buf) };
    }
}
