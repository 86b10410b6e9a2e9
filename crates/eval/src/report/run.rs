//! Where and how a result was made: the command, the source revision, the machine, the wall time.

use std::time::Instant;

/// Where and how a result was made.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// The command line.
    pub command: String,
    /// The source revision of the binary that made it (`git describe --always --dirty` at build
    /// time), "unknown" when it was not built from a checkout.
    pub git_revision: String,
    /// CPU model and core count.
    pub machine: String,
    /// Seconds the run took.
    pub wall_seconds: f64,
}

/// The revision [`RunInfo::collect`] records: set once by the binary, from its build.
static REVISION: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Names the source revision this program was built from (the `picaso` binary passes its
/// build-time `git describe`): results then name the code that made them, not whatever
/// checkout the command happens to run in.
pub fn set_revision(revision: &str) {
    let _ = REVISION.set(revision.to_string());
}

impl RunInfo {
    /// Describes this process's run, started at `started`.
    pub fn collect(started: Instant) -> Self {
        // Arguments that are not UTF-8 (a path) are shown with U+FFFD, never a panic.
        let command = std::env::args_os().map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ");
        let git_revision = REVISION.get().cloned().unwrap_or_else(|| "unknown".into());
        let cpu = picaso_model::bench::cpu_model().unwrap_or_else(|| std::env::consts::ARCH.to_string());
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Self {
            command,
            git_revision,
            machine: format!("{cpu}, {cores} cores"),
            wall_seconds: started.elapsed().as_secs_f64(),
        }
    }

    /// The provenance line results.md ends with.
    pub(crate) fn markdown(&self) -> String {
        format!(
            "Command: `{}`  \nRevision: `{}` · machine: {} · wall time: {:.0} s\n",
            self.command, self.git_revision, self.machine, self.wall_seconds
        )
    }
}
