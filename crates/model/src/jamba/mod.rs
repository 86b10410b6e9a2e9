//! AI21's Jamba (`JambaForCausalLM`): Mamba-1 mixers with RMSNorms on the time step, B and C,
//! NoPE attention on every few layers, SwiGLU MLPs or routed experts after each mixer. Its
//! states are a Mamba-1 model's SSM states plus the attention layers' keys and values, so they
//! compose as a hybrid's do. Runs on the CPU engine; the GPU and candle engines refuse it.

pub mod config;
pub mod cpu;
pub mod weights;

pub use config::JambaConfig;
pub use cpu::CpuJamba;
pub use weights::{JambaFeedForward, JambaLayerWeights, JambaMixerWeights, JambaWeights};
