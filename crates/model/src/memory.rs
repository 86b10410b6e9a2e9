//! Large buffers for weights: backed by 2 MiB pages where the OS allows it.
//!
//! Decoding streams every weight once per token; with 4 KiB pages that is one TLB miss per
//! 4 KiB (≈130k per token for a 130M model). Transparent huge pages cut that 512-fold. Linux
//! often enables them only on request (`madvise` mode), so we ask before the first write.

/// A zeroed f32 buffer of `n` values, on huge pages when available.
pub fn big_vec(n: usize) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    advise_huge(v.as_mut_ptr().cast(), n * std::mem::size_of::<f32>());
    v.resize(n, 0.0);
    v
}

#[cfg(target_os = "linux")]
fn advise_huge(ptr: *mut u8, bytes: usize) {
    const HUGE: usize = 2 << 20;
    if bytes < 2 * HUGE {
        return;
    }
    let start = (ptr as usize).div_ceil(HUGE) * HUGE;
    let end = (ptr as usize + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside an allocation we own and have not yet written; madvise
        // only changes how the kernel backs it. Failure is harmless (we keep 4 KiB pages).
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_ptr: *mut u8, _bytes: usize) {}
