//! The memory guard: the server reads its own resident memory and, above a limit, answers new
//! work with 503 and Retry-After instead of growing until the kernel's OOM killer ends it and
//! every request in flight. Requests already running finish; reads (GET), deletes, `/health`
//! and `/metrics` always answer.

use crate::error::ApiError;

/// The limit on the server's resident memory.
#[derive(Debug, Clone, Copy)]
pub struct MemoryGuard {
    limit_bytes: u64,
}

impl MemoryGuard {
    /// A guard at `limit_bytes` of resident memory.
    pub fn new(limit_bytes: u64) -> Self {
        Self { limit_bytes }
    }

    /// The default limit: 90% of the memory this process may use (the machine's, or its cgroup's
    /// when lower), but never under the model's weights plus 1 GiB, which a server needs to
    /// answer at all. None where the machine's memory cannot be read (not Linux).
    pub fn default_limit(model_bytes: u64) -> Option<u64> {
        let machine = available_memory()?;
        Some((machine / 10 * 9).max(model_bytes + (1 << 30)))
    }

    /// The limit, bytes.
    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }

    /// Ok while the server's resident memory is under the limit (or cannot be read); else the
    /// 503 that new work gets.
    pub fn check(&self) -> Result<(), ApiError> {
        match resident_bytes() {
            Some(rss) if rss > self.limit_bytes => Err(ApiError::busy(
                format!(
                    "the server holds {} MiB, over its limit of {} MiB (--max-memory-mb); it takes new work again \
                     once the requests in flight finish",
                    rss >> 20,
                    self.limit_bytes >> 20
                ),
                1,
            )),
            _ => Ok(()),
        }
    }
}

/// This process's resident memory, bytes (Linux: `/proc/self/statm`; a few microseconds).
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

#[cfg(unix)]
fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system constant.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as u64
    } else {
        4096
    }
}

#[cfg(not(unix))]
fn page_size() -> u64 {
    4096
}

/// The memory this process may use: the machine's (`MemTotal`), or its cgroup's limit when
/// lower (v2 `memory.max`, v1 `memory.limit_in_bytes`).
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total_kib: u64 =
        meminfo.lines().find(|l| l.starts_with("MemTotal:"))?.split_whitespace().nth(1)?.parse().ok()?;
    let total = total_kib * 1024;
    let cgroup = ["/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"]
        .iter()
        .filter_map(|p| std::fs::read_to_string(p).ok()?.trim().parse::<u64>().ok())
        .min();
    Some(cgroup.map_or(total, |c| c.min(total)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The process's own memory reads as something plausible, and a limit under it refuses
    /// with 503 and Retry-After while one above it lets work through.
    #[test]
    fn the_guard_refuses_above_its_limit() {
        let Some(rss) = resident_bytes() else { return };
        assert!(rss > 1 << 20 && rss < 1 << 40, "{rss}");
        let refused = MemoryGuard::new(1 << 20).check().unwrap_err();
        assert_eq!(refused.status.as_u16(), 503);
        assert_eq!(refused.retry_after, Some(1));
        assert!(refused.message.contains("--max-memory-mb"), "{}", refused.message);
        assert!(MemoryGuard::new(1 << 50).check().is_ok());
        let machine = available_memory().unwrap();
        assert!(MemoryGuard::default_limit(0).unwrap() <= machine);
        assert!(MemoryGuard::default_limit(machine * 2).unwrap() > machine * 2);
    }
}
