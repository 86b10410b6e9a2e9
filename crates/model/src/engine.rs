//! The one interface every engine sits behind: run tokens from states, turn hidden rows into
//! logits. A [`crate::Model`] holds a `Box<dyn Engine>`; adding an architecture or a device is
//! an implementation of this trait and one arm in [`build`], not arms in every method.

use crate::config::ModelConfig;
use crate::cpu::{Rows, WeightDtype};
use crate::error::{Error, Result};
use crate::gpu::{Gpu, MatrixDtype};
use crate::granite_hybrid::{CpuGraniteHybrid, GpuGraniteHybrid, GraniteHybridWeights};
use crate::jamba::{CpuJamba, JambaWeights};
use crate::mamba1::{CandleMamba1, CpuMamba1, Mamba1Weights};
use crate::mamba2::{CandleMamba2, CpuMamba2, GateNorm, GpuMamba2, Mamba2Weights};
use crate::state::State;

/// Which engine runs the model.
#[derive(Debug, Clone, Default)]
pub enum Backend {
    /// The hand-written multi-threaded CPU engine (fast path).
    #[default]
    Cpu,
    /// The GPU engine ([`crate::gpu`]) on a device: CUDA (`cuda`, `cuda:N`, built with the
    /// `cuda` feature), or the CPU emulator in the tests.
    Gpu(std::sync::Arc<dyn Gpu>),
    /// The device-generic candle engine: CUDA or Metal when built with their feature, or the
    /// CPU (a cross-check of the fast path).
    Candle {
        /// Where the weights live and the math runs.
        device: candle_core::Device,
        /// Compute precision (f32 on CPU; bf16/f16 on GPUs).
        dtype: candle_core::DType,
    },
}

impl std::str::FromStr for Backend {
    type Err = Error;
    /// `cpu`, `cuda`, `cuda:N` (the GPU engine), `candle-cpu`, `candle-cuda[:N]` or `metal` (candle).
    fn from_str(s: &str) -> Result<Self> {
        let candle = |device| Ok(Backend::Candle { device, dtype: candle_core::DType::F32 });
        let ordinal = |rest: &str, name: &str| -> Result<usize> {
            match rest {
                "" => Ok(0),
                _ => rest.strip_prefix(':').and_then(|n| n.parse().ok()).ok_or_else(|| {
                    Error::Input(format!(
                        "device {s:?}: use {name} or {name}:N (N the GPU's ordinal, as nvidia-smi lists it)"
                    ))
                }),
            }
        };
        if s == "cpu" {
            Ok(Backend::Cpu)
        } else if s == "candle-cpu" {
            candle(candle_core::Device::Cpu)
        } else if s == "metal" {
            candle(candle_core::Device::new_metal(0)?)
        } else if let Some(rest) = s.strip_prefix("candle-cuda") {
            candle(candle_core::Device::new_cuda(ordinal(rest, "candle-cuda")?)?)
        } else if let Some(rest) = s.strip_prefix("cuda") {
            cuda(ordinal(rest, "cuda")?)
        } else {
            Err(Error::Input(format!(
                "unknown device {s:?}: use cpu, cuda[:N] (the GPU engine), candle-cpu, candle-cuda[:N] or metal"
            )))
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda(ordinal: usize) -> Result<Backend> {
    Ok(Backend::Gpu(std::sync::Arc::new(crate::gpu::cuda::CudaGpu::new(ordinal)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda(_ordinal: usize) -> Result<Backend> {
    Err(Error::Input(
        "this picaso was built without the GPU engine: build it with `cargo build --release --features cuda` (no CUDA toolkit needed to build; a driver and GPU to run), or use --device cpu".into(),
    ))
}

/// An engine: a model's weights laid out for one device and its kernels.
pub(crate) trait Engine: Send + Sync + std::fmt::Debug {
    /// Runs several sequences at once (`lens[i]` tokens continue `states[i]`, updated in
    /// place) and returns every row's hidden state, ready for the LM head.
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>>;
    /// The same with f16 SSM values ([`crate::SsmValue`]); engines that keep f32 states refuse.
    fn forward_batch_f16(
        &self,
        _tokens: &[u32],
        _lens: &[usize],
        _states: &mut [&mut State<half::f16>],
    ) -> Result<Vec<f32>> {
        Err(Error::Input(
            "f16 decode states run on the cpu engine of a Mamba-2 or hybrid model only; use f32 states".into(),
        ))
    }
    /// Logits (rows × vocab) of hidden rows.
    fn logits(&self, hidden: &[f32], kind: Rows) -> Result<Vec<f32>>;
    /// `log p(targets[i] | hidden row i)`.
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>>;
    /// Whether a batched forward pass gives each sequence its lone result to the bit.
    fn batch_invariant(&self) -> bool {
        false
    }
    /// Whether [`Engine::forward_batch_f16`] runs.
    fn runs_f16_states(&self) -> bool {
        false
    }
    /// Whether [`Engine::resident`] keeps states away from the host (in a GPU's memory), so
    /// that a decode loop should hold its states there rather than pass host states per step.
    fn states_on_device(&self) -> bool {
        false
    }
    /// Keeps `states` where this engine computes for a run of forward passes (a decode loop):
    /// the GPU engine holds them in device memory, so they cross to the host once, not per
    /// token. Engines that compute on the host keep them as they are.
    fn resident<'e>(&'e self, states: Vec<State>) -> Result<Box<dyn Resident + 'e>> {
        Ok(Box::new(HostStates { engine: self, states }))
    }
    /// The composition of `states` ([`crate::compose`]), held as [`Engine::resident`] holds a
    /// state: the GPU engine computes it on the device, where generation then starts from it.
    fn resident_composed<'e>(
        &'e self,
        method: picaso_compose::Composition,
        states: &[&State],
        order: Option<&[usize]>,
    ) -> Result<Box<dyn Resident + 'e>> {
        self.resident(vec![crate::composition::compose(method, states, order)?])
    }
}

/// States held by an engine across forward passes ([`Engine::resident`]).
pub(crate) trait Resident: Send {
    /// Runs `lens[i]` tokens on sequence i (every sequence, in order; a length may be 0) and
    /// returns every row's next-token logits (rows × vocab).
    fn forward_logits(&mut self, tokens: &[u32], lens: &[usize]) -> Result<Vec<f32>>;
    /// The states as they stand, on the host.
    fn states(&self) -> Result<Vec<State>>;
    /// The states, on the host, ending the residency (host engines hand them back uncopied).
    fn into_states(self: Box<Self>) -> Result<Vec<State>> {
        self.states()
    }
    /// Adds a sequence that continues from `state`, after the others.
    fn push(&mut self, state: State) -> Result<()>;
    /// Drops sequence `i`; the last sequence takes its place (as [`Vec::swap_remove`]).
    fn swap_remove(&mut self, i: usize) -> Result<()>;
}

/// [`Resident`] for engines that compute on the host: the states stay in host memory.
struct HostStates<'e, E: ?Sized> {
    engine: &'e E,
    states: Vec<State>,
}

impl<E: Engine + ?Sized> Resident for HostStates<'_, E> {
    fn forward_logits(&mut self, tokens: &[u32], lens: &[usize]) -> Result<Vec<f32>> {
        let mut refs: Vec<&mut State> = self.states.iter_mut().collect();
        let hidden = self.engine.forward_batch(tokens, lens, &mut refs)?;
        self.engine.logits(&hidden, Rows::of(lens))
    }
    fn states(&self) -> Result<Vec<State>> {
        Ok(self.states.clone())
    }
    fn into_states(self: Box<Self>) -> Result<Vec<State>> {
        Ok(self.states)
    }
    fn push(&mut self, state: State) -> Result<()> {
        self.states.push(state);
        Ok(())
    }
    fn swap_remove(&mut self, i: usize) -> Result<()> {
        self.states.swap_remove(i);
        Ok(())
    }
}

/// Weights of any architecture, as read from a checkpoint.
pub(crate) enum Weights {
    Mamba1(Mamba1Weights),
    Mamba2(Mamba2Weights),
    GraniteHybrid(GraniteHybridWeights),
    Jamba(JambaWeights),
}

impl Weights {
    pub(crate) fn load(dir: &std::path::Path, config: &ModelConfig) -> Result<Self> {
        Ok(match config {
            ModelConfig::Mamba1(c) => Weights::Mamba1(Mamba1Weights::load(dir, c)?),
            ModelConfig::Mamba2(c) => Weights::Mamba2(Mamba2Weights::load(dir, c)?),
            ModelConfig::GraniteHybrid(c) => Weights::GraniteHybrid(GraniteHybridWeights::load(dir, c)?),
            ModelConfig::Jamba(c) => Weights::Jamba(JambaWeights::load(dir, c)?),
        })
    }
    pub(crate) fn fingerprint(&self, config: &ModelConfig) -> String {
        match (self, config) {
            (Weights::Mamba1(w), ModelConfig::Mamba1(c)) => w.fingerprint(c),
            (Weights::Mamba2(w), ModelConfig::Mamba2(c)) => w.fingerprint(c),
            (Weights::GraniteHybrid(w), ModelConfig::GraniteHybrid(c)) => w.fingerprint(c),
            (Weights::Jamba(w), ModelConfig::Jamba(c)) => w.fingerprint(c),
            _ => unreachable!("weights are loaded for their config"),
        }
    }
    pub(crate) fn n_params(&self, config: &ModelConfig) -> usize {
        match (self, config) {
            (Weights::Mamba1(w), _) => w.n_params(),
            (Weights::Mamba2(w), _) => w.n_params(),
            (Weights::GraniteHybrid(w), ModelConfig::GraniteHybrid(c)) => w.n_params(c),
            (Weights::Jamba(w), ModelConfig::Jamba(c)) => w.n_params(c),
            _ => unreachable!("weights are loaded for their config"),
        }
    }
}

/// The engine for `config` on `backend`.
pub(crate) fn build(
    config: ModelConfig,
    weights: Weights,
    backend: &Backend,
    dtype: WeightDtype,
) -> Result<Box<dyn Engine>> {
    if let (ModelConfig::Mamba2(c), Backend::Candle { .. }) = (&config, backend) {
        if c.gate_norm != GateNorm::NormGated {
            return Err(Error::Input(format!(
                "the mixer's gate and norm are {:?}; the candle engine does not run that: use --device cpu or cuda",
                c.gate_norm
            )));
        }
    }
    Ok(match (config, weights, backend) {
        (ModelConfig::Mamba2(c), Weights::Mamba2(w), Backend::Cpu) => Box::new(CpuMamba2::new(c, w, dtype)),
        (ModelConfig::Mamba2(c), Weights::Mamba2(w), Backend::Candle { device, dtype }) => {
            Box::new(CandleMamba2::new(&c, &w, device, *dtype)?)
        }
        (ModelConfig::Mamba2(c), Weights::Mamba2(w), Backend::Gpu(gpu)) => {
            Box::new(GpuMamba2::new(&c, &w, gpu.clone(), matrix_dtype(dtype))?)
        }
        (ModelConfig::GraniteHybrid(c), Weights::GraniteHybrid(w), Backend::Gpu(gpu)) => {
            Box::new(GpuGraniteHybrid::new(c, w, gpu.clone(), matrix_dtype(dtype))?)
        }
        (ModelConfig::Mamba1(_), _, Backend::Gpu(_)) => {
            return Err(Error::Input(
                "the GPU engine runs Mamba-2 and hybrid models; run Mamba-1 models with --device cpu or candle-cuda".into(),
            ))
        }
        (ModelConfig::Mamba1(c), Weights::Mamba1(w), Backend::Cpu) => Box::new(CpuMamba1::new(c, w, dtype)),
        (ModelConfig::Mamba1(c), Weights::Mamba1(w), Backend::Candle { device, dtype }) => {
            Box::new(CandleMamba1::new(&c, &w, device, *dtype)?)
        }
        (ModelConfig::GraniteHybrid(c), Weights::GraniteHybrid(w), Backend::Cpu) => {
            Box::new(CpuGraniteHybrid::new(c, w, dtype))
        }
        (ModelConfig::Jamba(c), Weights::Jamba(w), Backend::Cpu) => Box::new(CpuJamba::new(c, w, dtype)),
        (ModelConfig::Jamba(_), _, Backend::Gpu(_) | Backend::Candle { .. }) => {
            return Err(Error::Input(
                "Jamba models run on the cpu engine only for now (the GPU engine runs Mamba-2 mixers): drop --device or use --device cpu".into(),
            ))
        }
        (ModelConfig::GraniteHybrid(_), _, Backend::Candle { .. }) => {
            return Err(Error::Input(
                "hybrid (Granite 4.0 H, Bamba, Nemotron-H, Falcon-H1) models run on the cpu engine only for now; drop --device".into(),
            ))
        }
        _ => unreachable!("weights are loaded for their config"),
    })
}

/// The GPU engine's storage type of the matrices for the weights' `dtype`.
fn matrix_dtype(dtype: WeightDtype) -> MatrixDtype {
    match dtype {
        WeightDtype::F32 => MatrixDtype::F32,
        WeightDtype::Bf16 => MatrixDtype::Bf16,
    }
}

/// log p(targets[i]) from the logits' row i (rows of `vocab`).
fn log_softmax_rows_at(logits: &[f32], vocab: usize, targets: &[u32]) -> Vec<f32> {
    logits
        .chunks_exact(vocab)
        .zip(targets)
        .map(|(row, &t)| crate::cpu::softmax::log_softmax_at(row, t as usize))
        .collect()
}

/// Runs each sequence alone, one after another (engines without a batched pass).
fn one_by_one(
    tokens: &[u32],
    lens: &[usize],
    states: &mut [&mut State],
    forward: impl Fn(&[u32], &mut State) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let mut hidden = Vec::new();
    let mut rest = tokens;
    for (state, &t) in states.iter_mut().zip(lens) {
        let (seq, tail) = rest.split_at(t);
        rest = tail;
        hidden.extend(forward(seq, state)?);
    }
    Ok(hidden)
}

impl Engine for CpuMamba2 {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        Ok(CpuMamba2::forward_batch(self, tokens, lens, states))
    }
    fn forward_batch_f16(
        &self,
        tokens: &[u32],
        lens: &[usize],
        states: &mut [&mut State<half::f16>],
    ) -> Result<Vec<f32>> {
        Ok(CpuMamba2::forward_batch(self, tokens, lens, states))
    }
    fn logits(&self, hidden: &[f32], kind: Rows) -> Result<Vec<f32>> {
        Ok(CpuMamba2::logits(self, hidden, kind))
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        Ok(CpuMamba2::logprobs(self, hidden, targets))
    }
    fn batch_invariant(&self) -> bool {
        CpuMamba2::batch_invariant(self)
    }
    fn runs_f16_states(&self) -> bool {
        true
    }
}

impl Engine for CpuMamba1 {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        Ok(CpuMamba1::forward_batch(self, tokens, lens, states))
    }
    fn logits(&self, hidden: &[f32], kind: Rows) -> Result<Vec<f32>> {
        Ok(CpuMamba1::logits(self, hidden, kind))
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        Ok(CpuMamba1::logprobs(self, hidden, targets))
    }
}

impl Engine for CpuGraniteHybrid {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        Ok(CpuGraniteHybrid::forward_batch(self, tokens, lens, states))
    }
    fn forward_batch_f16(
        &self,
        tokens: &[u32],
        lens: &[usize],
        states: &mut [&mut State<half::f16>],
    ) -> Result<Vec<f32>> {
        Ok(CpuGraniteHybrid::forward_batch(self, tokens, lens, states))
    }
    fn logits(&self, hidden: &[f32], kind: Rows) -> Result<Vec<f32>> {
        Ok(CpuGraniteHybrid::logits(self, hidden, kind))
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        Ok(CpuGraniteHybrid::logprobs(self, hidden, targets))
    }
    fn runs_f16_states(&self) -> bool {
        true
    }
}

impl Engine for CpuJamba {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        Ok(CpuJamba::forward_batch(self, tokens, lens, states))
    }
    fn logits(&self, hidden: &[f32], kind: Rows) -> Result<Vec<f32>> {
        Ok(CpuJamba::logits(self, hidden, kind))
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        Ok(CpuJamba::logprobs(self, hidden, targets))
    }
}

impl Engine for GpuMamba2 {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        GpuMamba2::forward_batch(self, tokens, lens, states)
    }
    fn states_on_device(&self) -> bool {
        true
    }
    fn resident<'e>(&'e self, states: Vec<State>) -> Result<Box<dyn Resident + 'e>> {
        Ok(Box::new(GpuMamba2::resident(self, states)?))
    }
    fn resident_composed<'e>(
        &'e self,
        method: picaso_compose::Composition,
        states: &[&State],
        order: Option<&[usize]>,
    ) -> Result<Box<dyn Resident + 'e>> {
        Ok(Box::new(GpuMamba2::compose_resident(self, method, states, order)?))
    }
    fn logits(&self, hidden: &[f32], _: Rows) -> Result<Vec<f32>> {
        GpuMamba2::logits(self, hidden)
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        GpuMamba2::logprobs(self, hidden, targets)
    }
}

impl Engine for GpuGraniteHybrid {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        GpuGraniteHybrid::forward_batch(self, tokens, lens, states)
    }
    fn states_on_device(&self) -> bool {
        true
    }
    fn resident<'e>(&'e self, states: Vec<State>) -> Result<Box<dyn Resident + 'e>> {
        Ok(Box::new(GpuGraniteHybrid::resident(self, states)?))
    }
    fn logits(&self, hidden: &[f32], _: Rows) -> Result<Vec<f32>> {
        GpuGraniteHybrid::logits(self, hidden)
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        GpuGraniteHybrid::logprobs(self, hidden, targets)
    }
}

impl Engine for CandleMamba2 {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        one_by_one(tokens, lens, states, |t, s| self.forward(t, s))
    }
    fn logits(&self, hidden: &[f32], _: Rows) -> Result<Vec<f32>> {
        CandleMamba2::logits(self, hidden)
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        Ok(log_softmax_rows_at(&CandleMamba2::logits(self, hidden)?, self.config().vocab_size, targets))
    }
    fn batch_invariant(&self) -> bool {
        true
    }
}

impl Engine for CandleMamba1 {
    fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        one_by_one(tokens, lens, states, |t, s| self.forward(t, s))
    }
    fn logits(&self, hidden: &[f32], _: Rows) -> Result<Vec<f32>> {
        CandleMamba1::logits(self, hidden)
    }
    fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        Ok(log_softmax_rows_at(&CandleMamba1::logits(self, hidden)?, self.config().vocab_size, targets))
    }
    fn batch_invariant(&self) -> bool {
        true
    }
}
