//! Writing results: `results.json` (everything), a CSV and a Markdown table, each with the
//! exact command, git revision, machine and wall time that produced it.
//!
//! Each experiment's writer lives beside the experiment (`wikitext::write_wikitext`,
//! `openbookqa::write_openbookqa`, `recall::write_recall`, …); this module holds what they all
//! share — the run's provenance ([`RunInfo`], [`set_revision`]), writing files, table cells and
//! line charts — and re-exports every writer under `report::`, where the CLI calls them.

pub(crate) mod charts;
pub(crate) mod files;
pub(crate) mod run;
pub(crate) mod tables;

pub use run::{set_revision, RunInfo};

pub use crate::attribution::write_attribution;
pub use crate::context_use::{write_context_use, write_context_use_comparisons};
pub use crate::fidelity::write_fidelity;
pub use crate::finetuned::{write_finetuned, ModelResults};
pub use crate::openbookqa::write_openbookqa;
pub use crate::order::write_order;
pub use crate::recall::{write_recall, RecallRun};
pub use crate::wikitext::{picaso_r_share, rewrite_wikitext, write_wikitext};
