//! bf16 matrix products on AMX tiles (`tdpbf16ps`: Intel Sapphire Rapids and later). One
//! instruction multiplies a tile of 16 input rows × 16 pairs by a tile of 16 pairs × 16 outputs
//! — 8,192 multiply-adds, where one `vdpbf16ps` does 32 — so products of many rows (prefill,
//! scoring, ingest) stop being bound by arithmetic, and a batch of up to 16 decode steps costs
//! what one does: reading the weights once.
//!
//! A weight tile is exactly 16 consecutive pairs of one block of [`super::bf16_dot`]'s pair
//! layout (16 × 64 bytes, 64 bytes apart): the same matrix serves both kernels, and the
//! instruction adds each output's pairs in order into an f32 accumulator, as `vdpbf16ps` does
//! (in another order within a pair, so the two kernels' bits differ). An output's chain of
//! instructions does not depend on the tile's other rows, so a row gets the same bits alone
//! or in any batch.

#[cfg(target_arch = "x86_64")]
use std::arch::asm;

/// Rows and 4-byte columns of every tile used here (the architecture's maximum).
pub(super) const TILE: usize = 16;

/// Whether this CPU has AMX-BF16 and the OS has granted this process the tile registers
/// (checked once; Linux asks each process to request them).
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| cpu_has_amx_bf16() && super::bf16_dot::available() && request_tile_data())
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 7 is valid when leaf 0 reports it.
    let max_leaf = __cpuid_count(0, 0).eax;
    if max_leaf < 7 {
        return false;
    }
    let edx = __cpuid_count(7, 0).edx;
    const AMX_BF16: u32 = 1 << 22;
    const AMX_TILE: u32 = 1 << 24;
    edx & AMX_BF16 != 0 && edx & AMX_TILE != 0
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_amx_bf16() -> bool {
    false
}

/// Asks Linux for the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`);
/// without it the first tile instruction kills the process. The grant is process-wide.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tile_data() -> bool {
    false
}

/// The tile configuration every kernel here uses: palette 1, all eight tiles 16 rows × 64
/// bytes. tmm0–3 accumulate (2 × 2 tiles of 16 rows × 16 outputs), tmm4–5 hold inputs and
/// tmm6–7 weights.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    _reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    _reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Loads [`CONFIG`] on this thread, runs `f`, and releases the tiles (so a thread switch does
/// not save 8 KiB of tile data for a thread that no longer uses them).
///
/// # Safety
/// [`available`] must be true.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn with_tiles<R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the CPU has AMX and the process holds the permission (the caller's contract);
    // CONFIG is a valid 64-byte palette-1 configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) };
    let r = f();
    // SAFETY: as above.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    r
}

/// How many weight tiles (1 KiB each) ahead a streaming kernel prefetches each block: 8 with
/// `prefetcht1` measured best for a decode step of mamba2-130m shapes (10.1–12.6 ms for all its
/// products, against 11.8 ms on `vdpbf16ps`; 4 or 16 tiles, or `prefetcht0`/`t2`, 11.7–14.5 ms).
const PREFETCH_TILES: usize = 8;

/// The 16 `prefetcht1` (into L2) of one weight tile `PREFETCH_TILES` ahead of the register
/// named `$b`, one per 64-byte line.
macro_rules! prefetch_tile {
    ($b:literal) => {
        concat!(
            "prefetcht1 [{",
            $b,
            "} + {pf}]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 64]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 128]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 192]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 256]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 320]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 384]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 448]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 512]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 576]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 640]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 704]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 768]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 832]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 896]\n",
            "prefetcht1 [{",
            $b,
            "} + {pf} + 960]",
        )
    };
}

/// How a kernel meets its weights.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Weights {
    /// Read once, from memory (a decode step, a batch of them): prefetch ahead.
    Stream,
    /// Read again for several groups of rows, from cache (prefill): prefetching would only
    /// cost instructions (in_proj at 512 rows: 6.1 ms with it, 4.2 ms without).
    Cached,
}

/// 32 input rows × 32 outputs: `c` (4 tiles of 16 × 16 f32: rows 0–15 × block 0, rows 0–15 ×
/// block 1, rows 16–31 × block 0, rows 16–31 × block 1) = Σ over `steps` × 16 pairs of the
/// input rows at `x` (rows `x_stride` bytes apart; rows 16–31 start `16 · x_stride` on) times
/// the two weight blocks at `w0` and `w1` (16 pairs × 16 outputs per 1,024 bytes).
///
/// # Safety
/// Called inside [`with_tiles`]; `x` must hold 32 rows of `steps · 16` pairs, `w0` and `w1`
/// `steps · 16` pairs of 16 outputs each, and `steps` must be at least 1.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_2x2(
    x: *const u32,
    x_stride: usize,
    w0: *const u32,
    w1: *const u32,
    steps: usize,
    c: &mut [f32; 1024],
    weights: Weights,
) {
    debug_assert!(steps > 0);
    // One template, with or without the prefetches (an operand must appear in its template).
    macro_rules! run {
        ($($prefetch:expr),*; $($pf:tt)*) => {
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "2:",
                $($prefetch,)*
                "tileloadd tmm4, [{a0} + {xs}*1]",
                "tileloadd tmm6, [{b0} + {ws}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b1} + {ws}*1]",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm5, [{a1} + {xs}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a0}, 64",
                "add {a1}, 64",
                "add {b0}, 1024",
                "add {b1}, 1024",
                "dec {n}",
                "jnz 2b",
                "tilestored [{c} + {ws}*1], tmm0",
                "tilestored [{c} + {ws}*1 + 1024], tmm1",
                "tilestored [{c} + {ws}*1 + 2048], tmm2",
                "tilestored [{c} + {ws}*1 + 3072], tmm3",
                a0 = inout(reg) x => _,
                a1 = inout(reg) x.cast::<u8>().add(TILE * x_stride) => _,
                b0 = inout(reg) w0 => _,
                b1 = inout(reg) w1 => _,
                n = inout(reg) steps => _,
                xs = in(reg) x_stride,
                ws = in(reg) 64usize,
                c = in(reg) c.as_mut_ptr(),
                $($pf)*
                out("tmm0") _, out("tmm1") _, out("tmm2") _, out("tmm3") _,
                out("tmm4") _, out("tmm5") _, out("tmm6") _, out("tmm7") _,
                options(nostack),
            )
        };
    }
    // SAFETY: the caller's contract covers every address read (prefetches do not fault); `c`
    // holds the 4 KiB written.
    unsafe {
        match weights {
            Weights::Stream => run!(prefetch_tile!("b0"), prefetch_tile!("b1"); pf = const PREFETCH_TILES * 1024,),
            Weights::Cached => run!(;),
        }
    }
}

/// As [`tile_2x2`] for 16 input rows, weights streamed: `c`'s first two tiles (rows 0–15 ×
/// block 0, rows 0–15 × block 1). Each output is the same chain of instructions as in
/// [`tile_2x2`], so the same bits; half the instructions serve a decode step.
///
/// # Safety
/// As [`tile_2x2`], with 16 input rows.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn tile_1x2(
    x: *const u32,
    x_stride: usize,
    w0: *const u32,
    w1: *const u32,
    steps: usize,
    c: &mut [f32; 1024],
) {
    debug_assert!(steps > 0);
    // SAFETY: the caller's contract covers every address read (prefetches do not fault); `c`
    // holds the 2 KiB written.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "2:",
            prefetch_tile!("b0"),
            prefetch_tile!("b1"),
            "tileloadd tmm4, [{a0} + {xs}*1]",
            "tileloadd tmm6, [{b0} + {ws}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm7, [{b1} + {ws}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "add {a0}, 64",
            "add {b0}, 1024",
            "add {b1}, 1024",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c} + {ws}*1], tmm0",
            "tilestored [{c} + {ws}*1 + 1024], tmm1",
            a0 = inout(reg) x => _,
            b0 = inout(reg) w0 => _,
            b1 = inout(reg) w1 => _,
            n = inout(reg) steps => _,
            xs = in(reg) x_stride,
            ws = in(reg) 64usize,
            c = in(reg) c.as_mut_ptr(),
            pf = const PREFETCH_TILES * 1024,
            out("tmm0") _, out("tmm1") _, out("tmm4") _, out("tmm6") _, out("tmm7") _,
            options(nostack),
        );
    }
}
