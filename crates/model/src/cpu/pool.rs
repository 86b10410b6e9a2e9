//! Running a forward pass on rayon's pool with its other threads awake.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Runs `f` on a thread of rayon's pool, the pool's other threads polling for its work until it
/// returns. Called from outside the pool, every parallel region of a forward pass would hand
/// its work to the pool and put the caller to sleep until it is done: ~150 such round trips per
/// decoded token. From inside, a region that does not split runs in place and one that does is
/// shared by work stealing; the caller waits once. Between regions rayon's idle threads go to
/// sleep after a few dozen yields, and waking one (a futex, on a VM an interrupt to a halted
/// vCPU) takes longer than a decode step's short regions last, so they are kept polling.
pub fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let done = &AtomicBool::new(false);
    rayon::scope(|s| {
        let caller = rayon::current_thread_index();
        for _ in 1..rayon::current_num_threads() {
            s.spawn(move |_| poll_for_work(done, caller));
        }
        let out = f();
        done.store(true, Ordering::Release);
        out
    })
}

/// Runs the pool's pending work until `done`, or until none has come for [`POLL_IDLE`]. The
/// limit bounds the polling where it does not pay, and breaks the one cycle polling could
/// close: a thread that, waiting inside a nested parallel region, picked up this job would
/// otherwise wait here for work that waits for it.
fn poll_for_work(done: &AtomicBool, caller: Option<usize>) {
    if rayon::current_thread_index() == caller {
        return; // the caller took its own job back while it waited: nothing to help with
    }
    let mut idle_since = Instant::now();
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = Instant::now();
        } else if idle_since.elapsed() > POLL_IDLE {
            return;
        } else {
            // Give the core to any other thread that is ready (a server's I/O, its clients):
            // polling must not take it from them; with none, this returns at once.
            std::thread::yield_now();
        }
    }
}

/// How long a helper polls without finding work before it leaves to rayon's own idling; far
/// longer than the gaps between a decode step's parallel regions (microseconds).
const POLL_IDLE: Duration = Duration::from_millis(2);

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
    }

    /// Many short parallel regions, as a decode step runs, give the sums they must.
    #[test]
    fn regions_under_polling_give_their_results() {
        for threads in [1, 2, 4] {
            let sums: Vec<u64> = pool(threads).install(|| {
                on_pool(|| (0..200u64).map(|i| (0..1000u64).into_par_iter().map(|j| i * j).sum()).collect())
            });
            assert!(sums.iter().enumerate().all(|(i, &s)| s == i as u64 * 499_500), "{threads} threads");
        }
    }

    /// Passes started from inside parallel work, and inside each other, each with its own
    /// helpers, all finish with their sums.
    #[test]
    fn nested_passes_finish() {
        let sums: Vec<u64> = pool(4).install(|| {
            (0..64u64)
                .into_par_iter()
                .map(|i| {
                    on_pool(|| {
                        (0..64u64)
                            .into_par_iter()
                            .map(|j| on_pool(|| (0..100u64).into_par_iter().map(|k| i + j + k).sum::<u64>()))
                            .sum()
                    })
                })
                .collect()
        });
        for (i, s) in sums.into_iter().enumerate() {
            let i = i as u64;
            assert_eq!(s, (0..64u64).map(|j| (0..100u64).map(|k| i + j + k).sum::<u64>()).sum::<u64>());
        }
    }
}
