//! # picaso-model
//!
//! A language model whose state is a first-class value: Mamba-2, Mamba-1, or a hybrid (Granite
//! 4.0 H, Bamba, Nemotron-H: attention among Mamba-2 layers; Falcon-H1: attention beside a
//! Mamba-2 mixer in every layer; Jamba: attention among Mamba-1 layers), detected from
//! `config.json`. [`Model::prefill`] turns
//! any token sequence, started from any [`State`], into the state after it; [`Model::score`] also
//! returns the log-probabilities; [`generate()`] continues from a state. States save to and load
//! from safetensors files ([`State::save`], [`State::load`]) and carry the fingerprint of the
//! model that made them, so they are never applied to another model.
//!
//! Layout: one folder per architecture ([`mamba2`], [`mamba1`], [`granite_hybrid`], [`jamba`]: config,
//! weights, CPU engine, and where there is one a GPU engine and a candle engine); the CPU kernels by operation in [`cpu`], the GPU's
//! device layer and kernels in [`gpu`]; one engine
//! interface (`engine.rs`) that [`Model`] holds as a `Box<dyn Engine>`. Weights are read once
//! into host memory from either checkpoint layout (HF transformers or state-spaces), validated,
//! and handed to an engine. Prefill and decode run through the same code, so the Markov
//! property — scoring `a+b` equals scoring `b` from the state of `a` — holds by construction and
//! is tested.
//!
//! ```no_run
//! use picaso_model::{LoadOptions, Model};
//! let model = Model::load("models/picaso-mamba2".as_ref(), &LoadOptions::default())?;
//! let tokens = model.tokenizer()?.encode("The cat sat on the mat.")?;
//! let state = model.prefill(&tokens[..3], &model.zero_state())?;
//! let scored = model.score(&tokens[2..], &state)?; // continues exactly where `state` stopped
//! println!("{:?}", scored.logprobs);
//! # Ok::<(), picaso_model::Error>(())
//! ```
#![deny(missing_docs)]

pub mod bench;
pub mod composition;
pub mod config;
pub mod cpu;
mod engine;
pub mod error;
pub mod generate;
pub mod gpu;
pub mod granite_hybrid;
pub mod hub;
pub mod jamba;
pub mod mamba1;
pub mod mamba2;
mod memory;
pub use memory::reuse_freed_buffers;
pub mod model;
pub mod state;
pub mod tokenizer;
pub mod weights;
pub mod wording;

pub use composition::{compose, compose_into, compose_views, compose_views_into};
pub use config::{CheckpointFormat, ModelConfig};
pub use cpu::WeightDtype;
pub use error::{Error, Result};
pub use generate::{generate, Decoder, GenerateOptions, Generation, Next, StopReason};
pub use granite_hybrid::{GraniteHybridConfig, GraniteHybridWeights};
pub use jamba::{JambaConfig, JambaWeights};
pub use mamba1::{Mamba1Config, Mamba1Weights};
pub use mamba2::{Mamba2Config, Mamba2Weights};
pub use model::{Backend, LoadOptions, Model, Scored, Session};
/// The run-time instruction-set dispatch of the CPU kernels (defined in picaso-compose).
pub use picaso_compose::simd_fn;
pub use picaso_compose::{Composition, Method, UnknownMethod};
pub use state::{
    Arch, AttentionShape, KvState, KvView, LayerState, LayerView, MappedState, SsmValue, State, StateDtype, StateShape,
    StateView,
};
pub use tokenizer::TextTokenizer;
pub use weights::HostTensor;
pub use wording::counted;
