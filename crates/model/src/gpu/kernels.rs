//! The kernels' argument structs, field for field the structs of `kernels.cu` (pointers first,
//! then 4-byte fields, no implicit padding; the emulator's tests compare the sizes with the C
//! compiler's), and the one generic launch.

use super::{DevicePtr, Gpu};
use crate::error::Result;

/// Every kernel of `kernels.cu`, as loaded from the compiled module.
#[cfg(any(test, feature = "cuda"))]
pub(crate) const KERNELS: &[&str] = &[
    "embed",
    "rmsnorm",
    "convert",
    "add_bias",
    "logprob_at",
    "conv_silu",
    "conv_tail",
    "conv_step",
    "dt_values",
    "log_decay_sum",
    "scan_steps",
    "ssd_chunk_state",
    "ssd_state_pass",
    "ssd_chunk_scan",
    "gated_rmsnorm",
    "weighted_sum",
    "scale",
    "rope_append",
    "attend",
    "glu",
    "gather_rows",
    "scatter_add_rows",
];

/// An argument struct that can cross to a kernel as raw bytes.
///
/// # Safety
/// The type is `#[repr(C)]`, `Copy`, and has no padding bytes.
pub(crate) unsafe trait KernelArgs: Copy {}

/// Launches kernel `name` with `args`.
pub(crate) fn launch<A: KernelArgs>(
    gpu: &dyn Gpu,
    name: &'static str,
    grid: [u32; 3],
    block: [u32; 3],
    args: &A,
) -> Result<()> {
    // SAFETY: `KernelArgs` types are plain data without padding.
    let bytes = unsafe { std::slice::from_raw_parts((args as *const A).cast::<u8>(), std::mem::size_of::<A>()) };
    gpu.launch(name, grid, block, bytes)
}

macro_rules! kernel_args {
    ($($(#[$doc:meta])* pub struct $name:ident { $($field:ident: $ty:ty,)* })*) => {
        $(
            $(#[$doc])*
            #[repr(C)]
            #[derive(Debug, Clone, Copy)]
            pub(crate) struct $name { $(pub $field: $ty,)* }
            // SAFETY: repr(C), Copy, fields ordered 8-byte then 4-byte with an even count of the
            // latter (the sizes are checked against the C compiler's in the emulator's tests).
            unsafe impl KernelArgs for $name {}
        )*
        /// Each kernel-argument struct's name and size, for the layout test.
        #[cfg(test)]
        pub(crate) const ARG_SIZES: &[(&str, usize)] = &[$((stringify!($name), std::mem::size_of::<$name>()),)*];
    };
}

kernel_args! {
    /// `embed`: rows of the embedding table.
    pub struct EmbedArgs { table: DevicePtr, ids: DevicePtr, out: DevicePtr, d: i32, table_bf16: i32, }
    /// `rmsnorm`.
    pub struct RmsnormArgs { x: DevicePtr, w: DevicePtr, out: DevicePtr, d: i32, out_bf16: i32, eps: f32, pad: i32, }
    /// `convert`: f32 to the matrices' type.
    pub struct ConvertArgs { x: DevicePtr, out: DevicePtr, n: i64, out_bf16: i32, pad: i32, }
    /// `add_bias`.
    pub struct AddBiasArgs { x: DevicePtr, b: DevicePtr, cols: i32, pad: i32, }
    /// `logprob_at`.
    pub struct LogprobArgs { logits: DevicePtr, targets: DevicePtr, out: DevicePtr, vocab: i32, pad: i32, }
    /// `conv_silu`, `conv_tail` and `conv_step`.
    pub struct ConvArgs {
        zx: DevicePtr, tails: DevicePtr, w: DevicePtr, bias: DevicePtr, out: DevicePtr, starts: DevicePtr, lens: DevicePtr,
        width: i32, offset: i32, channels: i32, k: i32,
    }
    /// `dt_values` and `log_decay_sum`.
    pub struct DtArgs {
        zx: DevicePtr, dt_bias: DevicePtr, a_neg: DevicePtr, dt: DevicePtr, log_decay: DevicePtr, starts: DevicePtr, lens: DevicePtr,
        width: i32, offset: i32, heads: i32, lo: f32, hi: f32, rows: i32,
    }
    /// Where a head's x, B and C sit in a conv-output row.
    pub struct ScanShape { heads: i32, headdim: i32, d_state: i32, groups: i32, conv_dim: i32, pad: i32, }
    /// `scan_steps` (which computes dt itself).
    pub struct ScanArgs {
        xbc: DevicePtr, zx: DevicePtr, dt_bias: DevicePtr, a_neg: DevicePtr, d: DevicePtr, ssm: DevicePtr, log_decay: DevicePtr,
        y: DevicePtr, starts: DevicePtr, lens: DevicePtr,
        shape: ScanShape, width: i32, dt_offset: i32, lo: f32, hi: f32, threads_per_row: i32, pad: i32,
    }
    /// `ssd_chunk_state`, `ssd_state_pass`, `ssd_chunk_scan`.
    pub struct ChunkArgs {
        xbc: DevicePtr, dt: DevicePtr, a_neg: DevicePtr, d: DevicePtr, ssm: DevicePtr, chunks: DevicePtr, y: DevicePtr,
        starts: DevicePtr, lens: DevicePtr,
        shape: ScanShape, chunk: i32, max_chunks: i32,
    }
    /// `weighted_sum`.
    pub struct WeightedSumArgs { inputs: DevicePtr, weights: DevicePtr, out: DevicePtr, n: i64, count: i32, block: i32, }
    /// `gated_rmsnorm`.
    pub struct GatedNormArgs {
        y: DevicePtr, zx: DevicePtr, w: DevicePtr, out: DevicePtr,
        width: i32, d_inner: i32, group: i32, out_bf16: i32, eps: f32, mode: i32,
    }
    /// `scale`.
    pub struct ScaleArgs { x: DevicePtr, n: i64, s: f32, pad: i32, }
    /// `rope_append`: RoPE on a pass's queries and keys, its keys and values appended to the cache.
    pub struct RopeAppendArgs {
        qkv: DevicePtr, keys: DevicePtr, values: DevicePtr, inv_freq: DevicePtr,
        starts: DevicePtr, lens: DevicePtr, prev: DevicePtr, pos: DevicePtr, off: DevicePtr,
        heads: i32, kv_heads: i32, head_dim: i32, rotary: i32,
    }
    /// `attend`.
    pub struct AttendArgs {
        qkv: DevicePtr, keys: DevicePtr, values: DevicePtr, out: DevicePtr, starts: DevicePtr, lens: DevicePtr, prev: DevicePtr,
        off: DevicePtr,
        heads: i32, kv_heads: i32, head_dim: i32, scale: f32, out_bf16: i32, pad: i32,
    }
    /// `glu`: SwiGLU or relu² of the MLP's inner rows.
    pub struct GluArgs { x: DevicePtr, out: DevicePtr, inner: i32, relu2: i32, out_bf16: i32, pad: i32, }
    /// `gather_rows`: the rows routed to one expert.
    pub struct GatherArgs { src: DevicePtr, idx: DevicePtr, out: DevicePtr, width: i32, out_bf16: i32, }
    /// `scatter_add_rows`: one expert's weighted outputs added back to their rows.
    pub struct ScatterAddArgs { src: DevicePtr, idx: DevicePtr, weights: DevicePtr, out: DevicePtr, width: i32, pad: i32, }
}
