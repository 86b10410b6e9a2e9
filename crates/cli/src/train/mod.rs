//! `picaso train`: the training commands; the work is the training crate's.

use anyhow::Result;
use clap::Subcommand;

mod compose;
mod plot;
mod pretrain;

use compose::ComposeArgs;
use plot::{PlotArgs, PlotContextArgs};
use pretrain::PretrainArgs;

#[derive(Subcommand)]
pub enum TrainCommand {
    /// Pretrain a Mamba-2 from text corpora (resumes OUT/checkpoint if present).
    Pretrain(PretrainArgs),
    /// Fine-tune a model to use composed states (BPTC or BP2C) on a store of WikiText halves
    /// (resumes OUT/checkpoint if present).
    Compose(ComposeArgs),
    /// Draw a training log (JSON lines with tokens, loss and optional val_loss, as
    /// `scripts/train_gpu.py` writes) as a loss chart.
    Plot(PlotArgs),
    /// Draw what the context-use check logged during training (the loss drop a held-out
    /// paragraph's continuation gets from its previous paragraph, and from a random one, in
    /// nats/token) for one or more training logs, and print it as a table.
    PlotContext(PlotContextArgs),
}

pub fn run(cmd: TrainCommand) -> Result<()> {
    match cmd {
        TrainCommand::Pretrain(a) => pretrain::pretrain_cmd(a),
        TrainCommand::Compose(a) => compose::compose_cmd(a),
        TrainCommand::Plot(a) => plot::plot_cmd(a),
        TrainCommand::PlotContext(a) => plot::plot_context_cmd(a),
    }
}

/// MemAvailable from /proc/meminfo (Linux), if readable.
pub(crate) fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
