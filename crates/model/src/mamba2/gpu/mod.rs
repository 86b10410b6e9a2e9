//! The Mamba-2 GPU engine: the weights on the device once, each forward pass a fixed sequence of
//! kernels (`gpu/kernels.cu`) and matrix products per layer, with the chunked scan
//! (state-space duality) for prompts and the token-by-token scan for decode steps, both from
//! any state. It runs on any [`Gpu`]: a CUDA device, or the CPU emulator that holds it to the
//! CPU engine in the tests.
//!
//! Through the `Engine` calls that take host states, the states cross to the device and back
//! once per forward pass (not per layer or token); a session (`GpuStates`, what `generate`
//! and `Model::session_composed` use) keeps them on the device across steps, and only logits
//! come back. A session's decode steps run as one recorded graph ([`crate::gpu::Graph`], a
//! CUDA graph): recorded at its first step of a batch size, replayed at the next ones while the
//! buffers stay the same (`PICASO_CUDA_GRAPHS=0` launches every kernel instead). Sequences
//! join and leave a session (a server's running batch) by a copy of their own state only.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rayon::prelude::*;

use super::{Mamba2Config, Mamba2Weights};
use crate::error::{Error, Result};
use crate::gpu::graphs::{replay_step, DecodeGraph};
use crate::gpu::kernels::{launch, WeightedSumArgs};
use crate::gpu::plan::{blocks, Batch, BLOCK};
use crate::gpu::token_io::GpuTokenIo;
use crate::gpu::{forward_by_kind, i32_bytes, DeviceBuf, Gpu, MatrixDtype};
use crate::state::State;
use mixer::{GpuMixer, MixerIo, MixerScratch, MixerStates};

pub(crate) mod mixer;

/// One block: its pre-norm (f32) and its mixer.
#[derive(Debug)]
struct Layer {
    norm: DeviceBuf,
    mixer: GpuMixer,
}

/// A Mamba-2 model on a GPU.
#[derive(Debug)]
pub struct GpuMamba2 {
    config: Mamba2Config,
    gpu: Arc<dyn Gpu>,
    dtype: MatrixDtype,
    io: GpuTokenIo,
    layers: Vec<Layer>,
    /// The last pass's buffers, reused while they are big enough; the lock also makes passes
    /// run one at a time (one stream).
    scratch: Mutex<Option<Pass>>,
    /// The id the next new [`Pass`] gets.
    next_pass: AtomicU64,
    /// Whether sessions record their decode steps as graphs (off after a failed capture).
    graphs: AtomicBool,
}

/// Device buffers of a forward pass, sized for up to `rows` rows of `seqs` sequences.
#[derive(Debug)]
struct Pass {
    /// Which allocation this is: a graph recorded on one pass replays only on it.
    id: u64,
    rows: usize,
    seqs: usize,
    ids: DeviceBuf,
    starts: DeviceBuf,
    lens: DeviceBuf,
    h: DeviceBuf,
    xn: DeviceBuf,
    mixer: MixerScratch,
}

/// States of a batch held in device memory across forward passes: a decode loop uploads them
/// once and brings them back once, however many tokens it runs.
pub(crate) struct GpuStates<'e> {
    engine: &'e GpuMamba2,
    /// One entry per layer, each with room for `capacity` sequences (the first `host.len()`
    /// in use, packed).
    layers: Vec<MixerStates>,
    capacity: usize,
    /// The states as given (their values stale until [`crate::engine::Resident::states`]),
    /// with positions kept current.
    host: Vec<State>,
    /// The logits of one step of every sequence (capacity × vocab).
    logits: DeviceBuf,
    /// The decode steps recorded on these buffers, by number of sequences
    /// ([`GpuMamba2::decode_logits`]): a batch that shrinks and grows again replays its graphs.
    steps: HashMap<usize, DecodeGraph>,
}

impl crate::engine::Resident for GpuStates<'_> {
    fn forward_logits(&mut self, tokens: &[u32], lens: &[usize]) -> Result<Vec<f32>> {
        if lens.len() != self.host.len() || lens.iter().sum::<usize>() != tokens.len() {
            return Err(Error::Input(format!(
                "internal: {} lengths adding up to {} for {} resident states and {} tokens",
                lens.len(),
                lens.iter().sum::<usize>(),
                self.host.len(),
                tokens.len()
            )));
        }
        let batch = Batch::new(lens);
        let logits = match lens.iter().all(|&l| l == 1) && self.engine.graphs.load(Ordering::Relaxed) {
            true => self.engine.decode_logits(tokens, &batch, &self.layers, &self.logits, &mut self.steps)?,
            false => self.engine.run_logits(tokens, &batch, &self.layers, &self.logits)?,
        };
        for (s, &t) in self.host.iter_mut().zip(lens) {
            s.advance(t);
        }
        Ok(logits)
    }
    fn states(&self) -> Result<Vec<State>> {
        let mut out = self.host.clone();
        for (l, ls) in self.layers.iter().enumerate() {
            ls.download(&self.engine.config, out.iter_mut(), l)?;
        }
        Ok(out)
    }
    fn push(&mut self, state: State) -> Result<()> {
        if self.host.len() == self.capacity {
            self.grow((2 * self.capacity).max(4))?;
        }
        let i = self.host.len();
        for (ls, layer) in self.layers.iter().zip(&state.layers) {
            ls.write(&self.engine.config, i, layer)?;
        }
        self.host.push(state);
        Ok(())
    }
    fn swap_remove(&mut self, i: usize) -> Result<()> {
        let n = self.host.len();
        if i >= n {
            return Err(Error::Input(format!("internal: removing sequence {i} of {n}")));
        }
        if i + 1 < n {
            for ls in &self.layers {
                ls.copy_seq(&*self.engine.gpu, &self.engine.config, i, n - 1)?;
            }
        }
        self.host.swap_remove(i);
        Ok(())
    }
}

impl GpuStates<'_> {
    /// Room for `capacity` sequences: new buffers, the sequences copied over on the device.
    /// The recorded steps go (they hold the old addresses).
    fn grow(&mut self, capacity: usize) -> Result<()> {
        // The recorded steps go first, whatever happens below; the new buffers are all made
        // before the old ones go, so a failed allocation leaves the session as it was.
        self.steps.clear();
        let (gpu, n) = (&self.engine.gpu, self.host.len());
        let layers =
            self.layers.iter().map(|ls| ls.grown(gpu, &self.engine.config, n, capacity)).collect::<Result<Vec<_>>>()?;
        self.logits = DeviceBuf::zeroed(gpu, capacity * self.engine.config.vocab_size * 4)?;
        (self.layers, self.capacity) = (layers, capacity);
        Ok(())
    }
}

impl GpuMamba2 {
    /// Uploads `weights` to `gpu`, the large matrices as `dtype`.
    pub fn new(config: &Mamba2Config, weights: &Mamba2Weights, gpu: Arc<dyn Gpu>, dtype: MatrixDtype) -> Result<Self> {
        let c = config;
        mixer::check_shapes(c)?;
        let f32buf = |v: &[f32]| DeviceBuf::from_f32(&gpu, v);
        let layers = weights
            .layers
            .iter()
            .map(|l| Ok(Layer { norm: f32buf(&l.norm)?, mixer: GpuMixer::upload(c, l, &gpu, dtype, 1.0)? }))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            config: c.clone(),
            io: GpuTokenIo::new(
                &gpu,
                dtype,
                (c.d_model, c.vocab_size),
                c.norm_eps,
                1.0,
                &weights.embedding,
                weights.lm_head.as_deref(),
                &weights.norm_f,
            )?,
            layers,
            gpu,
            dtype,
            scratch: Mutex::new(None),
            next_pass: AtomicU64::new(0),
            graphs: AtomicBool::new(std::env::var("PICASO_CUDA_GRAPHS").map_or(true, |v| v != "0")),
        })
    }

    /// Turns the recording of decode steps as graphs on or off (on unless `PICASO_CUDA_GRAPHS=0`).
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, Ordering::Relaxed);
    }

    /// The config.
    pub fn config(&self) -> &Mamba2Config {
        &self.config
    }

    /// The device's name.
    pub fn device_name(&self) -> String {
        self.gpu.name()
    }

    /// Runs several sequences (`lens[i]` tokens continue `states[i]`, updated in place) and
    /// returns the final-normed hidden rows. Single tokens and longer sequences run as
    /// separate passes, as on the CPU, so a decode step's result never depends on its batch's
    /// longer prompts.
    pub fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        forward_by_kind(self.config.d_model, tokens, lens, states, |t, l, s| self.forward_one_kind(t, l, s))
    }

    fn forward_one_kind(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        let on_device = {
            let refs: Vec<&State> = states.iter().map(|s| &**s).collect();
            (0..self.layers.len())
                .map(|l| MixerStates::upload(&self.gpu, &self.config, &refs, l, true))
                .collect::<Result<Vec<_>>>()?
        };
        let hidden = self.run(tokens, &Batch::new(lens), &on_device)?;
        for (l, ls) in on_device.iter().enumerate() {
            ls.download(&self.config, states.iter_mut().map(|s| &mut **s), l)?;
        }
        for (s, &t) in states.iter_mut().zip(lens) {
            s.advance(t);
        }
        Ok(hidden)
    }

    /// Keeps `states` in device memory for a run of forward passes ([`GpuStates`]).
    pub(crate) fn resident(&self, states: Vec<State>) -> Result<GpuStates<'_>> {
        self.resident_with(states, true)
    }

    /// [`GpuMamba2::resident`]; with `upload_ssm` false the SSM states start as zeros on the
    /// device instead of being copied (a composition writes them there).
    fn resident_with(&self, states: Vec<State>, upload_ssm: bool) -> Result<GpuStates<'_>> {
        let refs: Vec<&State> = states.iter().collect();
        let layers = (0..self.layers.len())
            .map(|l| MixerStates::upload(&self.gpu, &self.config, &refs, l, upload_ssm))
            .collect::<Result<Vec<_>>>()?;
        let logits = DeviceBuf::zeroed(&self.gpu, states.len() * self.config.vocab_size * 4)?;
        Ok(GpuStates { engine: self, layers, capacity: states.len(), host: states, logits, steps: HashMap::new() })
    }

    /// Composes `states` on the device ([`crate::compose`]'s arithmetic: the weights and the
    /// small parts on the host, the weighted sum of the SSM states — nearly all the bytes — by
    /// the `weighted_sum` kernel) and keeps the result there for generation.
    pub(crate) fn compose_resident(
        &self,
        method: picaso_compose::Composition,
        states: &[&State],
        order: Option<&[usize]>,
    ) -> Result<GpuStates<'_>> {
        let crate::composition::SsmSumLeft { composed, weights, parts } =
            crate::composition::compose_all_but_ssm(method, states, order)?;
        let c = &self.config;
        let (len, block) = (c.nheads * c.headdim * c.d_state, c.headdim * c.d_state);
        let resident = self.resident_with(vec![composed], false)?;
        for (l, (w, out)) in weights.iter().zip(&resident.layers).enumerate() {
            let inputs = DeviceBuf::zeroed(&self.gpu, parts.len() * len * 4)?;
            for (i, part) in parts.iter().enumerate() {
                let ssm = &part.layers[l].ssm;
                if let Some(v) = ssm.par_chunks(1 << 16).find_map_any(|c| c.iter().copied().find(|v| !v.is_finite())) {
                    return Err(Error::state(format!("a part of the composition holds {v} in layers.{l}.ssm")));
                }
                inputs.write_f32(i * len, ssm)?;
            }
            let w = DeviceBuf::from_f32(&self.gpu, w)?;
            let args = WeightedSumArgs {
                inputs: inputs.ptr(),
                weights: w.ptr(),
                out: out.ssm.ptr(),
                n: len as i64,
                count: parts.len() as i32,
                block: block as i32,
            };
            launch(&*self.gpu, "weighted_sum", [blocks(len), 1, 1], [BLOCK, 1, 1], &args)?;
        }
        Ok(resident)
    }

    /// The kernels of one forward pass over `batch`, from and into the device states `states`
    /// (one entry per layer); returns the final-normed hidden rows.
    fn run(&self, tokens: &[u32], batch: &Batch, states: &[MixerStates]) -> Result<Vec<f32>> {
        let d = self.config.d_model;
        self.run_then(tokens, batch, states, |pass| {
            self.io.final_norm(pass.h.ptr(), pass.mixer.y.ptr(), batch.rows, false)?;
            pass.mixer.y.read_f32(0, batch.rows * d)
        })
    }

    /// [`GpuMamba2::run`] that returns every row's logits, computed on the device from its
    /// hidden rows (only the logits cross to the host).
    fn run_logits(&self, tokens: &[u32], batch: &Batch, states: &[MixerStates], out: &DeviceBuf) -> Result<Vec<f32>> {
        self.run_then(tokens, batch, states, |pass| {
            self.io.logits_of_stream(pass.h.ptr(), pass.xn.ptr(), batch.rows, out)
        })
    }

    /// Embeds `tokens`, runs every layer, and hands the pass (the residual stream in `h`) to
    /// `finish`. An empty batch runs nothing and gives `T::default()`.
    fn run_then<T: Default>(
        &self,
        tokens: &[u32],
        batch: &Batch,
        states: &[MixerStates],
        finish: impl FnOnce(&Pass) -> Result<T>,
    ) -> Result<T> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if batch.rows == 0 {
            return Ok(T::default());
        }
        batch.check_grid()?;
        let pass = self.pass(&mut scratch, tokens, batch)?;
        self.layers_on(pass, batch, states)?;
        finish(pass)
    }

    /// The embedding and every layer over the tokens already in `pass`: launches only, so
    /// they can be recorded.
    fn layers_on(&self, pass: &Pass, batch: &Batch, states: &[MixerStates]) -> Result<()> {
        self.io.embed(pass.ids.ptr(), pass.h.ptr(), batch.rows)?;
        for (layer, ls) in self.layers.iter().zip(states) {
            self.layer(layer, ls, pass, batch)?;
        }
        Ok(())
    }

    /// A decode step (one token per sequence) of a session into `out` (sequences × vocab),
    /// replayed from a graph recorded once per batch size and pass ([`replay_step`]).
    fn decode_logits(
        &self,
        tokens: &[u32],
        batch: &Batch,
        states: &[MixerStates],
        out: &DeviceBuf,
        steps: &mut HashMap<usize, DecodeGraph>,
    ) -> Result<Vec<f32>> {
        let n = batch.rows * self.config.vocab_size;
        if batch.rows == 0 || out.bytes() < 4 * n {
            return self.run_logits(tokens, batch, states, out);
        }
        batch.check_grid()?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let pass = self.pass(&mut scratch, tokens, batch)?;
        replay_step(&*self.gpu, steps, (batch.seqs(), pass.id), &self.graphs, || {
            self.layers_on(pass, batch, states)?;
            self.io.final_norm(pass.h.ptr(), pass.xn.ptr(), batch.rows, true)?;
            self.io.lm_head_into(pass.xn.ptr(), batch.rows, out.ptr())
        })?;
        out.read_f32(0, n)
    }

    /// The pass buffers for `batch`: the last pass's if big enough, else new ones (with room
    /// to grow); uploads the token ids and the batch layout.
    fn pass<'s>(&self, scratch: &'s mut Option<Pass>, tokens: &[u32], batch: &Batch) -> Result<&'s Pass> {
        let c = &self.config;
        let fits =
            scratch.as_ref().is_some_and(|p| p.rows >= batch.rows && p.seqs >= batch.seqs() && p.mixer.fits(c, batch));
        if !fits {
            // Never smaller than before (a pass rebuilt for its chunk buffer keeps its rows).
            let (old_rows, old_seqs) = scratch.as_ref().map_or((0, 0), |p| (p.rows, p.seqs));
            *scratch = None; // free the old buffers first
            let rows = batch.rows.next_power_of_two().max(old_rows);
            let seqs = batch.seqs().next_power_of_two().max(old_seqs);
            *scratch = Some(Pass {
                id: self.next_pass.fetch_add(1, Ordering::Relaxed),
                rows,
                seqs,
                ids: DeviceBuf::zeroed(&self.gpu, rows * 4)?,
                starts: DeviceBuf::zeroed(&self.gpu, seqs * 4)?,
                lens: DeviceBuf::zeroed(&self.gpu, seqs * 4)?,
                h: DeviceBuf::zeroed(&self.gpu, rows * c.d_model * 4)?,
                xn: DeviceBuf::zeroed(&self.gpu, rows * c.d_model * self.dtype.size())?,
                // `y` is also the final norm's output (rows × d_model).
                mixer: MixerScratch::new(&self.gpu, c, self.dtype, rows, c.d_model, batch)?,
            });
        }
        let pass = scratch.as_ref().expect("set above");
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        self.gpu.upload(pass.ids.ptr(), &i32_bytes(&ids))?;
        self.gpu.upload(pass.starts.ptr(), &i32_bytes(&batch.starts))?;
        self.gpu.upload(pass.lens.ptr(), &i32_bytes(&batch.lens))?;
        Ok(pass)
    }

    /// One block, residual included: h += out_proj(mixer(rmsnorm(h))).
    fn layer(&self, w: &Layer, ls: &MixerStates, pass: &Pass, batch: &Batch) -> Result<()> {
        self.io.rmsnorm(pass.h.ptr(), w.norm.ptr(), pass.xn.ptr(), batch.rows, true)?;
        let io = MixerIo { xn: pass.xn.ptr(), h: pass.h.ptr(), starts: pass.starts.ptr(), lens: pass.lens.ptr() };
        w.mixer.run(&*self.gpu, self.dtype, &self.config, ls, &pass.mixer, io, batch)
    }

    /// Logits (rows × vocab) of final hidden rows.
    pub fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        self.io.logits(hidden)
    }

    /// `log p(targets[i] | hidden row i)`: only one float per row crosses back.
    pub fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        self.io.logprobs(hidden, targets)
    }
}

#[cfg(test)]
mod tests {
    //! The GPU engine's host code and kernels against the CPU engine: on the CPU emulator here
    //! and in CI, on a GPU with `PICASO_TEST_GPU=cuda`.
    use super::*;
    use crate::cpu::WeightDtype;
    use crate::gpu::testing::{assert_states_close, rel_diff, test_gpu, tokens};
    use crate::mamba2::CpuMamba2;
    use crate::state::StateShape;

    /// Two configurations: the tiny one (2 groups, conv bias) and one with projection biases,
    /// wider heads and a clamped dt.
    fn configs() -> Vec<Mamba2Config> {
        let wide = Mamba2Config {
            d_model: 48,
            headdim: 16,
            nheads: 6,
            d_state: 16,
            n_groups: 1,
            use_bias: true,
            time_step_limit: (0.01, 0.5),
            ..Mamba2Config::tiny(2, 4)
        };
        vec![Mamba2Config::tiny(2, 4), wide]
    }

    /// Every kernel exists in the compiled library and takes the argument struct laid out as
    /// the C++ compiler lays out its C twin.
    #[test]
    fn every_argument_struct_has_the_c_compilers_layout() {
        use crate::gpu::kernels::{ARG_SIZES, KERNELS};
        let of = |name: &str| ARG_SIZES.iter().find(|(n, _)| *n == name).expect("a struct of kernels.rs").1;
        for &kernel in KERNELS {
            let args = match kernel {
                "embed" => "EmbedArgs",
                "rmsnorm" => "RmsnormArgs",
                "convert" => "ConvertArgs",
                "add_bias" => "AddBiasArgs",
                "logprob_at" => "LogprobArgs",
                "conv_silu" | "conv_tail" | "conv_step" => "ConvArgs",
                "dt_values" | "log_decay_sum" => "DtArgs",
                "scan_steps" => "ScanArgs",
                "ssd_chunk_state" | "ssd_state_pass" | "ssd_chunk_scan" => "ChunkArgs",
                "gated_rmsnorm" => "GatedNormArgs",
                "weighted_sum" => "WeightedSumArgs",
                "scale" => "ScaleArgs",
                "rope_append" => "RopeAppendArgs",
                "attend" => "AttendArgs",
                "glu" => "GluArgs",
                "gather_rows" => "GatherArgs",
                "scatter_add_rows" => "ScatterAddArgs",
                other => panic!("kernel {other} has no argument struct in this test"),
            };
            assert_eq!(crate::gpu::emulator::c_args_size(kernel).unwrap(), of(args), "{kernel}({args})");
        }
    }

    /// Prompts of several chunks (a partial last one) and decode steps, from the zero state
    /// and from a state carried over, match the CPU engine in f32: hidden rows, states,
    /// logits and log-probs.
    #[test]
    fn the_gpu_engine_matches_the_cpu_engine_in_f32() {
        for c in configs() {
            let w = Mamba2Weights::random(&c, 5);
            let gpu = GpuMamba2::new(&c, &w, test_gpu(), MatrixDtype::F32).unwrap();
            let cpu = CpuMamba2::new(c.clone(), w, WeightDtype::F32);
            let zero = State::zeros(StateShape::of(&c), "test");
            let (mut sg, mut sc) = (zero.clone(), zero.clone());
            // 150 tokens: chunks of 64, 64, 22; then 5 tokens (the step scan); then single steps.
            for (i, n) in [150usize, 5, 1, 1, 70].into_iter().enumerate() {
                let t = tokens(n, c.vocab_size, i as u32);
                let hg = gpu.forward_batch(&t, &[n], &mut [&mut sg]).unwrap();
                let hc = cpu.forward(&t, &mut sc);
                let at = format!("d_model {} step {i} ({n} tokens)", c.d_model);
                let d = rel_diff(&hg, &hc);
                assert!(d < 2e-5, "{at}: hidden rows differ by {d:e}");
                assert_states_close(&sg, &sc, 2e-5, &at);
                let targets = tokens(n, c.vocab_size, 99);
                let (lg, lc) = (gpu.logprobs(&hc, &targets).unwrap(), cpu.logprobs(&hc, &targets));
                assert!(rel_diff(&lg, &lc) < 1e-5, "{at}: log-probs differ by {:e}", rel_diff(&lg, &lc));
                let (xg, xc) = (gpu.logits(&hc).unwrap(), cpu.logits(&hc, crate::cpu::Rows::of(&[n])));
                assert!(rel_diff(&xg, &xc) < 1e-5, "{at}: logits differ");
            }
        }
    }

    /// The head shapes of the real checkpoints (headdim 64, d_state 128: every thread of a block
    /// loops over several state entries, four threads share a row in the step scan), on one
    /// small layer: a prompt of two chunks, then decode steps.
    #[test]
    fn real_head_shapes_match_the_cpu_engine() {
        let c = Mamba2Config {
            d_model: 128,
            nheads: 4,
            headdim: 64,
            d_state: 128,
            n_groups: 1,
            vocab_size: 97,
            ..Mamba2Config::tiny(1, 4)
        };
        let w = Mamba2Weights::random(&c, 3);
        let gpu = GpuMamba2::new(&c, &w, test_gpu(), MatrixDtype::F32).unwrap();
        let cpu = CpuMamba2::new(c.clone(), w, WeightDtype::F32);
        let zero = State::zeros(StateShape::of(&c), "test");
        let (mut sg, mut sc) = (zero.clone(), zero);
        for (i, n) in [100usize, 1, 1, 3].into_iter().enumerate() {
            let t = tokens(n, c.vocab_size, 40 + i as u32);
            let hg = gpu.forward_batch(&t, &[n], &mut [&mut sg]).unwrap();
            let hc = cpu.forward(&t, &mut sc);
            let d = rel_diff(&hg, &hc);
            assert!(d < 2e-5, "step {i} ({n} tokens): hidden rows differ by {d:e}");
            assert_states_close(&sg, &sc, 2e-5, &format!("step {i}"));
        }
    }

    /// A batch mixing decode steps and prompts gives each sequence what it gets alone.
    #[test]
    fn a_mixed_batch_gives_each_sequence_its_lone_result() {
        let c = &configs()[1];
        let gpu = GpuMamba2::new(c, &Mamba2Weights::random(c, 8), test_gpu(), MatrixDtype::F32).unwrap();
        let zero = State::zeros(StateShape::of(c), "test");
        let mut warm = zero.clone();
        gpu.forward_batch(&tokens(9, c.vocab_size, 3), &[9], &mut [&mut warm]).unwrap();
        let lens = [1usize, 70, 3, 1];
        let starts = [warm.clone(), zero.clone(), warm.clone(), zero.clone()];
        let all: Vec<u32> =
            lens.iter().enumerate().flat_map(|(i, &n)| tokens(n, c.vocab_size, 10 + i as u32)).collect();
        let mut batched = starts.clone();
        let mut refs: Vec<&mut State> = batched.iter_mut().collect();
        let hidden = gpu.forward_batch(&all, &lens, &mut refs).unwrap();
        let (mut at, d) = (0, c.d_model);
        for (i, &n) in lens.iter().enumerate() {
            let mut alone = starts[i].clone();
            let h = gpu.forward_batch(&all[at..at + n], &[n], &mut [&mut alone]).unwrap();
            // cuBLAS picks its kernels by the number of rows, so on a GPU a row's rounding may
            // depend on its batch; the emulator's product does not.
            let tol = if std::env::var("PICASO_TEST_GPU").as_deref() == Ok("cuda") { 1e-5 } else { 1e-6 };
            let diff = rel_diff(&hidden[at * d..(at + n) * d], &h);
            assert!(diff < tol, "sequence {i}: {diff:e}");
            assert_states_close(&batched[i], &alone, tol, &format!("sequence {i}"));
            at += n;
        }
    }

    /// bf16 matrices: the products read bf16 weights and activations and accumulate in f32, as
    /// the CPU engine's bf16 path does, so the two agree far more closely than either with f32.
    #[test]
    fn bf16_matrices_match_the_cpu_engines_bf16_path() {
        let c = &configs()[0];
        let w = Mamba2Weights::random(c, 21);
        let gpu = GpuMamba2::new(c, &w, test_gpu(), MatrixDtype::Bf16).unwrap();
        let cpu16 = CpuMamba2::new(c.clone(), w.clone(), WeightDtype::Bf16);
        let cpu32 = CpuMamba2::new(c.clone(), w, WeightDtype::F32);
        let zero = State::zeros(StateShape::of(c), "test");
        let t = tokens(100, c.vocab_size, 4);
        let run = |f: &dyn Fn(&mut State) -> Vec<f32>| {
            let mut s = zero.clone();
            f(&mut s)
        };
        let hg = run(&|s| gpu.forward_batch(&t[..99], &[99], &mut [s]).unwrap());
        let h16 = run(&|s| cpu16.forward(&t[..99], s));
        let h32 = run(&|s| cpu32.forward(&t[..99], s));
        let lg = gpu.logprobs(&hg, &t[1..]).unwrap();
        let (l16, l32) = (cpu16.logprobs(&h16, &t[1..]), cpu32.logprobs(&h32, &t[1..]));
        let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        let (to16, to32, cpu_gap) = (worst(&lg, &l16), worst(&lg, &l32), worst(&l16, &l32));
        eprintln!("bf16 log-probs: gpu vs cpu bf16 {to16:e}, gpu vs f32 {to32:e}, cpu bf16 vs f32 {cpu_gap:e}");
        assert!(to16 < 1e-3, "the GPU's bf16 path is {to16} nats from the CPU's");
        assert!(cpu_gap > 10.0 * to16, "bf16 should move log-probs by more than the engines differ");
    }

    /// Decode steps with the states kept on the device give the CPU engine's logits, greedy
    /// tokens and final states; the model-level session and `step` agree.
    #[test]
    fn a_session_keeps_states_on_the_device_and_matches_the_cpu_engine() {
        use crate::model::{Backend, Model};
        let c = configs()[0].clone();
        let w = Mamba2Weights::random(&c, 13);
        let on =
            |backend: &Backend| Model::from_weights_on(c.clone(), w.clone(), None, backend, WeightDtype::F32).unwrap();
        let (gpu, cpu) = (on(&Backend::Gpu(test_gpu())), on(&Backend::Cpu));
        let prompt = tokens(40, c.vocab_size, 2);
        let mut states = Vec::new();
        for m in [&gpu, &cpu] {
            let (mut logits, s) = m.prefill_last_logits(&prompt, &m.zero_state()).unwrap();
            let mut session = m.session(vec![s.clone(), s]).unwrap();
            let mut greedy = Vec::new();
            for i in 0..12 {
                let next = [crate::generate::argmax(&logits) as u32, (i * 7) as u32 % c.vocab_size as u32];
                greedy.push(next[0]);
                let both = session.step(&next).unwrap();
                logits = both[..c.vocab_size].to_vec();
            }
            states.push((greedy, logits, session.states().unwrap()));
        }
        let ((g_tokens, g_logits, g_states), (c_tokens, c_logits, c_states)) = (&states[0], &states[1]);
        assert_eq!(g_tokens, c_tokens, "greedy tokens");
        assert!(rel_diff(g_logits, c_logits) < 1e-5, "last logits differ by {:e}", rel_diff(g_logits, c_logits));
        for (i, (g, c)) in g_states.iter().zip(c_states).enumerate() {
            assert_states_close(g, c, 2e-5, &format!("sequence {i} after the session"));
        }
    }

    /// A session's decode steps replayed from the recorded graph give what launching their
    /// kernels gives, step for step; a longer pass between two steps (new pass buffers) makes
    /// the session record its step again rather than replay one on freed buffers.
    #[test]
    fn decode_steps_replayed_from_a_graph_equal_launched_ones() {
        use crate::engine::Resident;
        let c = configs()[1].clone();
        let w = Mamba2Weights::random(&c, 21);
        let gpu = test_gpu();
        let engine = |graphs: bool| {
            let e = GpuMamba2::new(&c, &w, gpu.clone(), MatrixDtype::F32).unwrap();
            e.set_graphs(graphs);
            e
        };
        let (graphed, launched) = (engine(true), engine(false));
        let start = {
            let mut s = State::zeros(StateShape::of(&c), "test");
            graphed.forward_batch(&tokens(30, c.vocab_size, 5), &[30], &mut [&mut s]).unwrap();
            s
        };
        let mut runs = Vec::new();
        for e in [&graphed, &launched] {
            let mut session =
                e.resident(vec![start.clone(), start.clone(), State::zeros(StateShape::of(&c), "test")]).unwrap();
            let (mut logits, mut passes) = (Vec::new(), Vec::new());
            for i in 0..8u32 {
                if i == 4 {
                    // A prompt of 200 tokens on the same engine outgrows the decode pass.
                    let mut other = State::zeros(StateShape::of(&c), "test");
                    e.forward_batch(&tokens(200, c.vocab_size, 9), &[200], &mut [&mut other]).unwrap();
                }
                let next = [i % c.vocab_size as u32, (i * 7 + 3) % c.vocab_size as u32, 5];
                logits.push(session.forward_logits(&next, &[1, 1, 1]).unwrap());
                passes.push(session.steps.get(&3).map(|g| g.pass));
            }
            runs.push((logits, passes, session.states().unwrap()));
        }
        let ((g_logits, g_passes, g_states), (l_logits, l_passes, l_states)) = (&runs[0], &runs[1]);
        assert!(graphed.graphs.load(Ordering::Relaxed), "recording a decode step failed on {}", gpu.name());
        assert!(l_passes.iter().all(Option::is_none), "graphs off, yet a step was recorded");
        assert!(g_passes.iter().all(Option::is_some), "a step ran without a recorded graph");
        assert_eq!(g_passes[..4], [g_passes[0]; 4], "the first four steps replay one graph");
        assert_ne!(g_passes[4], g_passes[3], "after the longer pass the step is recorded again");
        assert_eq!(g_passes[4..], [g_passes[4]; 4], "and then replayed");
        for (i, (g, l)) in g_logits.iter().zip(l_logits).enumerate() {
            assert!(rel_diff(g, l) < 1e-6, "step {i}: logits differ by {:e}", rel_diff(g, l));
        }
        for (i, (g, l)) in g_states.iter().zip(l_states).enumerate() {
            assert_states_close(g, l, 1e-6, &format!("sequence {i} after the steps"));
        }
    }

    /// Sequences join and leave a session on the device as a server's batch does (growing
    /// past its room, the last taking a leaver's place, batch sizes recurring so that recorded
    /// steps replay), and every step gives each sequence what the CPU engine's session gives.
    #[test]
    fn sequences_join_and_leave_a_session_as_on_the_cpu() {
        use crate::model::{Backend, Model};
        let c = configs()[0].clone();
        let w = Mamba2Weights::random(&c, 17);
        let on =
            |backend: &Backend| Model::from_weights_on(c.clone(), w.clone(), None, backend, WeightDtype::F32).unwrap();
        let (gpu, cpu) = (on(&Backend::Gpu(test_gpu())), on(&Backend::Cpu));
        let joiner =
            |m: &Model, seed: u32| m.prefill(&tokens(9 + seed as usize, c.vocab_size, seed), &m.zero_state()).unwrap();
        // (sequences joining, index leaving) before each step.
        let plan: [(&[u32], Option<usize>); 9] = [
            (&[1, 2], None),
            (&[], None),
            (&[3], None),
            (&[], Some(0)),
            (&[4, 5, 6], None), // five sequences: past the first room of four
            (&[], Some(4)),
            (&[], Some(1)),
            (&[7], None), // back to four: that size's step replays, if still valid
            (&[], None),
        ];
        let mut runs = Vec::new();
        for m in [&gpu, &cpu] {
            let mut session = m.session(Vec::new()).unwrap();
            let mut logits = Vec::new();
            for (step, (joining, leaving)) in plan.iter().enumerate() {
                for &seed in *joining {
                    session.push(joiner(m, seed)).unwrap();
                }
                if let Some(i) = leaving {
                    session.swap_remove(*i).unwrap();
                }
                let next: Vec<u32> =
                    (0..session.len() as u32).map(|i| (i * 5 + step as u32) % c.vocab_size as u32).collect();
                logits.push(session.step(&next).unwrap());
            }
            assert!(session.swap_remove(session.len()).is_err(), "a sequence past the end");
            runs.push((logits, session.states().unwrap()));
        }
        let ((g_logits, g_states), (c_logits, c_states)) = (&runs[0], &runs[1]);
        for (i, (g, c)) in g_logits.iter().zip(c_logits).enumerate() {
            assert_eq!(g.len(), c.len(), "step {i}: batch sizes differ");
            assert!(rel_diff(g, c) < 1e-5, "step {i}: logits differ by {:e}", rel_diff(g, c));
        }
        assert_eq!(g_states.len(), 4);
        for (i, (g, c)) in g_states.iter().zip(c_states).enumerate() {
            assert_states_close(g, c, 2e-5, &format!("sequence {i} at the end"));
        }
    }

    /// Every composition method computed on the device equals the host's, and generation
    /// continues from it as from the host's composed state.
    #[test]
    fn composition_on_the_device_equals_the_hosts() {
        use crate::model::{Backend, Model};
        use picaso_compose::Composition;
        let c = configs()[1].clone();
        let w = Mamba2Weights::random(&c, 17);
        let gpu =
            Model::from_weights_on(c.clone(), w.clone(), None, &Backend::Gpu(test_gpu()), WeightDtype::F32).unwrap();
        let cpu = Model::from_weights_on(c.clone(), w, None, &Backend::Cpu, WeightDtype::F32).unwrap();
        let parts: Vec<State> = (0..4)
            .map(|i| cpu.prefill(&tokens(20 + 9 * i, c.vocab_size, i as u32), &cpu.zero_state()).unwrap())
            .collect();
        let refs: Vec<&State> = parts.iter().collect();
        let order = [2usize, 0, 3, 1];
        for method in Composition::ALL {
            let host = crate::composition::compose(method, &refs, Some(&order)).unwrap();
            let mut on_device = gpu.session_composed(method, &refs, Some(&order)).unwrap();
            let composed = on_device.states().unwrap().pop().unwrap();
            assert_states_close(&composed, &host, 1e-6, method.name());
            let mut from_host = cpu.session(vec![host]).unwrap();
            let next = [5u32];
            let (a, b) = (on_device.step(&next).unwrap(), from_host.step(&next).unwrap());
            assert!(
                rel_diff(&a, &b) < 1e-5,
                "{}: logits after the composed state differ by {:e}",
                method.name(),
                rel_diff(&a, &b)
            );
        }
        let bad = State { fingerprint: "another model".into(), ..parts[0].clone() };
        assert!(gpu.session_composed(Composition::Soup, &[&parts[1], &bad], None).is_err());
    }

    #[test]
    fn the_engine_refuses_shapes_its_kernels_cannot_run() {
        let c = Mamba2Config { d_conv: 20, ..Mamba2Config::tiny(1, 4) };
        let err = GpuMamba2::new(&c, &Mamba2Weights::random(&c, 1), test_gpu(), MatrixDtype::F32).unwrap_err();
        assert!(err.to_string().contains("d_conv"), "{err}");
    }
}
