//! Decode steps recorded once and replayed ([`Gpu::begin_capture`]): a step is a few kernels
//! and products per layer, and on a GPU launching them one by one takes longer than running
//! them. Shared by the engines' sessions.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Gpu, Graph};
use crate::error::Result;

/// A decode step of every sequence of a session, recorded with the addresses of the session's
/// states and logits and of one pass's buffers.
pub(crate) struct DecodeGraph {
    /// The id of the pass buffers it was recorded on.
    pub(crate) pass: u64,
    graph: Box<dyn Graph>,
}

/// Runs `kernels` (a decode step of `seqs` sequences on the pass buffers `pass`) from the graph
/// recorded in `steps`, recording it first where there is none for this batch size or it was
/// recorded on other buffers. Where the device cannot record, `graphs` is turned off (for the
/// engine) and the step runs as launches.
pub(crate) fn replay_step(
    gpu: &dyn Gpu,
    steps: &mut HashMap<usize, DecodeGraph>,
    (seqs, pass): (usize, u64),
    graphs: &AtomicBool,
    kernels: impl Fn() -> Result<()>,
) -> Result<()> {
    let step = match steps.entry(seqs) {
        Entry::Occupied(recorded) if recorded.get().pass == pass => recorded.into_mut(),
        stale_or_none => {
            let graph = gpu.begin_capture().and_then(|()| {
                let recorded = kernels();
                let graph = gpu.end_capture(); // also after a failed recording
                recorded.and(graph)
            });
            match graph {
                Ok(graph) => stale_or_none.insert_entry(DecodeGraph { pass, graph }).into_mut(),
                Err(e) => {
                    graphs.store(false, Ordering::Relaxed);
                    eprintln!(
                        "warning: recording a decode step as a graph failed ({e}); launching its kernels one by one"
                    );
                    return kernels();
                }
            }
        }
    };
    step.graph.replay()
}
