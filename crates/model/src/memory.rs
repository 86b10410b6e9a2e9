//! Large buffers (weights, zero states): written on creation, and backed by 2 MiB pages where
//! the OS allows it.
//!
//! Decoding streams every weight once per token; with 4 KiB pages that is one TLB miss per
//! 4 KiB (≈130k per token for a 130M model). Transparent huge pages cut that 512-fold. Linux
//! often enables them only on request (`madvise` mode), so we ask before the first write.

/// A buffer of `n` copies of `fill`, on huge pages when available. Every element is written, so
/// each page is faulted in once here, never mapped to the shared zero page as calloc's are.
pub fn big_vec<T: Clone>(n: usize, fill: T) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_mut_ptr().cast(), n * std::mem::size_of::<T>());
    v.resize(n, fill);
    v
}

/// Makes glibc's malloc keep freed working buffers for reuse instead of handing them back to
/// the OS. A forward pass allocates ~20 MiB of activations per layer (512 tokens of
/// mamba2-130m); each fresh mapping is zeroed page by page by the kernel on first touch, which
/// was 9% of a prefill's time in `perf`. With this, buffers below 64 MiB come from the heap and
/// up to 256 MiB of free heap is kept. The `picaso` binary calls it first thing; elsewhere (and
/// off glibc) it does nothing unless called.
pub fn reuse_freed_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes malloc's thresholds; it is safe to call at any time.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

/// Whether `bytes` read once per decode step (a batch's states) will come from memory rather
/// than from cache: more than half the largest cache this CPU reports, which the step's weights
/// and activations pass through as well. (With a 260 MiB L3, 16 f32 states of mamba2-130m,
/// 302 MB, do; 4, 76 MB, do not: BENCHMARKS.md measures both.)
pub(crate) fn outgrows_cache(bytes: usize) -> bool {
    bytes > last_level_cache_bytes() / 2
}

/// The size of the largest cache this CPU reports (Linux's sysfs), read once; 32 MiB where
/// none is reported.
fn last_level_cache_bytes() -> usize {
    static BYTES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BYTES.get_or_init(|| {
        let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").into_iter().flatten().flatten();
        caches
            .filter_map(|dir| std::fs::read_to_string(dir.path().join("size")).ok())
            .filter_map(|size| parse_cache_size(&size))
            .max()
            .unwrap_or(32 << 20)
    })
}

/// A sysfs cache size ("48K", "266240K", "32M") in bytes.
fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = text.split_at(text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len()));
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    digits.parse::<usize>().ok().map(|n| n * scale)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("48K\n"), Some(48 << 10));
        assert_eq!(parse_cache_size("266240K"), Some(266_240 << 10));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("512"), Some(512));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
        assert!(last_level_cache_bytes() >= 1 << 10);
    }
}
