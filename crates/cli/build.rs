//! Records the source revision this binary is built from (`git describe --always --dirty` of
//! the checkout), so that every result names the code that made it, wherever it is run from.

use std::path::Path;
use std::process::Command;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    // Rerun when a commit, checkout or staged change moves the revision, or any source changes
    // (which makes it `-dirty`).
    for watched in [".git/HEAD", ".git/index", ".git/refs/heads", "crates"] {
        println!("cargo:rerun-if-changed={}", root.join(watched).display());
    }
    let revision = Command::new("git")
        .arg("-C")
        .arg(&root)
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=PICASO_GIT_REVISION={revision}");
}
