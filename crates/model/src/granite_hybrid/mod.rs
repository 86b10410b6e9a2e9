//! IBM Granite 4.0 H (`GraniteMoeHybridForCausalLM`): attention layers among Mamba-2 layers,
//! each followed by a SwiGLU MLP and optionally routed experts; and IBM's Bamba
//! (`BambaForCausalLM`), the same blocks without multipliers or experts, with partial RoPE
//! (one engine: [`HybridFamily`] only names the checkpoint's keys and tensors); NVIDIA's
//! Nemotron-H, whose mixer and MLP blocks stand apart; and TII's Falcon-H1, whose layers run a
//! Mamba-2 mixer and attention side by side ([`falcon_h1`]).
//!
//! A hybrid's state is its Mamba layers' states (as a Mamba-2 model's) plus each attention
//! layer's keys and values ([`crate::state::KvState`]); composition unions the keys and values
//! ([`crate::composition`]).

pub mod config;
pub mod cpu;
pub mod falcon_h1;
pub mod gpu;
pub mod weights;

pub use config::{GraniteHybridConfig, HybridFamily, LayerKind, MlpKind, Mup, Routing};
pub use cpu::CpuGraniteHybrid;
pub use gpu::GpuGraniteHybrid;
pub use weights::GraniteHybridWeights;
