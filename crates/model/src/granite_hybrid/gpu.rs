//! The hybrids' GPU engine (Granite 4.0 H, Bamba, Nemotron-H, Falcon-H1, routed experts
//! included): the Mamba-2 layers run the Mamba-2 engine's mixer (`mamba2::gpu::mixer`), the attention
//! layers keep each sequence's keys and values in device memory, and a layer is the same
//! sequence of steps as on the CPU ([`super::cpu`]). It runs on any [`Gpu`]: a CUDA device, or
//! the CPU emulator that holds it to the CPU engine in the tests.
//!
//! Multipliers: the residual multiplier scales every output projection's product (cuBLAS's
//! alpha, in f32 after the sums, as the CPU engine scales the branch; the weights stay as
//! read, so bf16 rounds the same weights on both), `1 / logits_scaling` is folded into the
//! final norm's weight, and Falcon-H1's µP multipliers into the projections they scale (as the
//! CPU engine folds them into its own copy). The embedding multiplier is a kernel (the
//! embedding may be the LM head). Routed experts are routed on the host between a layer's
//! kernels, so a model with experts launches its decode steps rather than replaying them.
//!
//! A session (`GpuHybridStates`) keeps its sequences' states on the device across steps:
//! the SSM states packed per layer, the keys and values in a pool per layer where each
//! sequence has a region that it leaves for one twice as large when it outgrows it
//! (`gpu::kv_cache`). Its decode steps run as recorded graphs (`gpu::graphs`): the
//! kernels read each sequence's key count, position and region from device memory, uploaded
//! before each step, so one recording serves every step until the pools move or the batch's
//! room grows.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::config::{GraniteHybridConfig, MlpKind};
use super::weights::{AttentionWeights, GraniteHybridWeights, MlpWeights, MoeWeights};
use crate::error::{Error, Result};
use crate::gpu::graphs::{replay_step, DecodeGraph};
use crate::gpu::kernels::{launch, AttendArgs, ConvertArgs, GatherArgs, GluArgs, RopeAppendArgs, ScatterAddArgs};
use crate::gpu::kv_cache::KvCache;
use crate::gpu::plan::{blocks, Batch, BLOCK};
use crate::gpu::token_io::GpuTokenIo;
use crate::gpu::{forward_by_kind, i32_bytes, DeviceBuf, Gemm, Gpu, MatrixDtype};
use crate::mamba2::gpu::mixer::{self, GpuMixer, MixerIo, MixerScratch, MixerStates};
use crate::state::{KvState, State};

/// A hybrid model on a GPU.
#[derive(Debug)]
pub struct GpuGraniteHybrid {
    config: GraniteHybridConfig,
    gpu: Arc<dyn Gpu>,
    dtype: MatrixDtype,
    io: GpuTokenIo,
    layers: Vec<Layer>,
    /// RoPE's inverse frequencies (f64), when the model rotates.
    inv_freq: Option<DeviceBuf>,
    /// The last pass's buffers, reused while they are big enough; the lock also makes passes
    /// run one at a time (one stream).
    scratch: Mutex<Option<Pass>>,
    /// The id the next new [`Pass`] gets.
    next_pass: AtomicU64,
    /// Whether sessions record their decode steps as graphs (off after a failed capture).
    graphs: AtomicBool,
}

/// One layer on the device: as the CPU engine's.
#[derive(Debug)]
struct Layer {
    input_norm: DeviceBuf,
    /// The `slot`-th Mamba mixer.
    mamba: Option<(usize, GpuMixer)>,
    /// The `slot`-th attention.
    attention: Option<(usize, Attention)>,
    mlp: Option<Mlp>,
    moe: Option<Moe>,
}

/// Routed experts: the router on the device (f32, as the CPU engine keeps it, so routing does
/// not move with the matrices' type), its correction bias on the host where the routing runs.
#[derive(Debug)]
struct Moe {
    router: DeviceBuf,
    bias: Option<Vec<f32>>,
    /// Per expert: gate and up (or up alone), and down.
    experts: Vec<(DeviceBuf, DeviceBuf)>,
    /// Latent experts' projections down and back up.
    latent: Option<(DeviceBuf, DeviceBuf)>,
}

/// Grouped-query attention's projections: q, k and v stacked into one matrix (one product),
/// and o.
#[derive(Debug)]
struct Attention {
    qkv: DeviceBuf,
    o: DeviceBuf,
}

#[derive(Debug)]
struct Mlp {
    norm: DeviceBuf,
    inner: usize,
    /// SwiGLU: gate and up (2·inner × d_model); relu²: up (inner × d_model).
    input: DeviceBuf,
    /// Down (d_model × inner).
    output: DeviceBuf,
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
    /// Keys each sequence holds before the pass.
    prev: DeviceBuf,
    /// The position of each sequence's first new token.
    pos: DeviceBuf,
    /// Each sequence's first token in the key and value pools.
    off: DeviceBuf,
    /// The residual stream (f32).
    h: DeviceBuf,
    /// Normed rows, in the matrix type.
    xn: DeviceBuf,
    /// The final norm's f32 output.
    out: DeviceBuf,
    /// The Mamba mixers' buffers (models with Mamba layers).
    mixer: Option<MixerScratch>,
    /// q | k | v per row (f32).
    qkv: DeviceBuf,
    /// Attention's output, in the matrix type.
    att: DeviceBuf,
    /// The MLP's (or an expert's) inner rows before (f32) and after (matrix type) the activation.
    mid: DeviceBuf,
    act: DeviceBuf,
    /// Experts: router logits (rows × experts); the rows in the experts' width (f32, latent
    /// experts), gathered for one expert (matrix type), one expert's output, and the latent
    /// experts' sum (f32); each route's row and weight (rows × top_k).
    router: DeviceBuf,
    xe: DeviceBuf,
    xg: DeviceBuf,
    ey: DeviceBuf,
    esum: DeviceBuf,
    idx: DeviceBuf,
    wts: DeviceBuf,
}

/// A batch's states on the device: each Mamba mixer's, packed with room for `seq_cap`
/// sequences, and the keys and values (`gpu::kv_cache`).
struct DeviceStates {
    mamba: Vec<MixerStates>,
    kv: KvCache,
    seq_cap: usize,
}

impl GpuGraniteHybrid {
    /// Uploads `weights` to `gpu`, the large matrices as `dtype` (Falcon-H1's µP multipliers
    /// folded in first, `1 / logits_scaling` into the final norm's weight).
    pub fn new(
        config: GraniteHybridConfig,
        mut weights: GraniteHybridWeights,
        gpu: Arc<dyn Gpu>,
        dtype: MatrixDtype,
    ) -> Result<Self> {
        let c = &config;
        if !c.attention_layers().is_empty()
            && (c.head_dim > 256 || c.n_kv_heads == 0 || !c.n_heads.is_multiple_of(c.n_kv_heads))
        {
            return Err(Error::Input(format!(
                "the GPU engine's attention runs heads of at most 256 channels, query heads a multiple of the key \
                 heads (this model: {} channels, {} query and {} key heads); use --device cpu",
                c.head_dim, c.n_heads, c.n_kv_heads
            )));
        }
        if c.n_mamba() > 0 {
            mixer::check_shapes(&c.mamba)?;
        }
        if let Some(mup) = &c.mup {
            mup.fold(c, &mut weights);
        }
        let d = c.d_model;
        let rm = c.residual_multiplier as f32;
        let f32buf = |v: &[f32]| DeviceBuf::from_f32(&gpu, v);
        let matrix = |v: &[f32]| DeviceBuf::from_bytes(&gpu, &dtype.encode(v));
        let (mut n_mamba, mut n_attention) = (0, 0);
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (i, l) in weights.layers.iter().enumerate() {
            let (mamba_weights, attention_weights) = (l.mixer.mamba(), l.mixer.attention());
            let mamba = match mamba_weights {
                Some(w) => {
                    n_mamba += 1;
                    Some((n_mamba - 1, GpuMixer::upload(&c.mamba, w, &gpu, dtype, rm)?))
                }
                None => None,
            };
            let attention = match attention_weights {
                Some(AttentionWeights { q, k, v, o }) => {
                    n_attention += 1;
                    let qkv: Vec<f32> = [q, k, v].into_iter().flatten().copied().collect();
                    debug_assert_eq!(qkv.len(), (c.n_heads + 2 * c.n_kv_heads) * c.head_dim * d);
                    Some((n_attention - 1, Attention { qkv: matrix(&qkv)?, o: matrix(o)? }))
                }
                None => None,
            };
            let mlp = match &l.mlp {
                Some(MlpWeights { norm, input, output }) => Some(Mlp {
                    norm: f32buf(norm)?,
                    inner: c.mlp_inner(i),
                    input: matrix(input)?,
                    output: matrix(output)?,
                }),
                None => None,
            };
            let moe = match &l.moe {
                Some(MoeWeights { router, bias, gate_up, down, latent }) => {
                    let (ei, w) = (c.expert_intermediate, c.expert_width());
                    let gates = c.mlp_kind.projections();
                    let experts = (0..c.n_experts)
                        .map(|x| {
                            let gu = &gate_up[x * gates * ei * w..(x + 1) * gates * ei * w];
                            Ok((matrix(gu)?, matrix(&down[x * w * ei..(x + 1) * w * ei])?))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    let latent = match latent {
                        Some((down, up)) => Some((matrix(down)?, matrix(up)?)),
                        None => None,
                    };
                    Some(Moe { router: f32buf(router)?, bias: bias.clone(), experts, latent })
                }
                None => None,
            };
            layers.push(Layer { input_norm: f32buf(&l.input_norm)?, mamba, attention, mlp, moe });
        }
        let inv = (1.0 / c.logits_scaling) as f32;
        let norm_f: Vec<f32> = weights.norm_f.iter().map(|w| if inv == 1.0 { *w } else { w * inv }).collect();
        let io = GpuTokenIo::new(
            &gpu,
            dtype,
            (d, c.vocab_size),
            c.norm_eps,
            c.embedding_multiplier as f32,
            &weights.embedding,
            weights.lm_head.as_deref(),
            &norm_f,
        )?;
        let inv_freq = match c.rope_theta {
            Some(theta) if c.rotary_dim() >= 2 => {
                let rotary = c.rotary_dim();
                // As the CPU engine's `rope` computes them.
                let inv: Vec<f64> = (0..rotary / 2).map(|i| theta.powf(-((2 * i) as f64) / rotary as f64)).collect();
                Some(DeviceBuf::from_bytes(&gpu, bytemuck::cast_slice(&inv))?)
            }
            _ => None,
        };
        let n_experts = config.n_experts;
        Ok(Self {
            config,
            gpu,
            dtype,
            io,
            layers,
            inv_freq,
            scratch: Mutex::new(None),
            next_pass: AtomicU64::new(0),
            // Experts are routed on the host between a layer's kernels, which a recording
            // cannot hold: such a model's decode steps launch their kernels.
            graphs: AtomicBool::new(n_experts == 0 && std::env::var("PICASO_CUDA_GRAPHS").map_or(true, |v| v != "0")),
        })
    }

    /// The config.
    pub fn config(&self) -> &GraniteHybridConfig {
        &self.config
    }

    /// Turns the recording of decode steps as graphs on or off (on unless `PICASO_CUDA_GRAPHS=0`).
    /// A model with experts keeps them off (its steps route on the host between kernels).
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on && self.config.n_experts == 0, Ordering::Relaxed);
    }

    /// Floats of one token's keys (or values) in one attention layer.
    fn kv_width(&self) -> usize {
        self.config.n_kv_heads * self.config.head_dim
    }

    /// Runs several sequences (`lens[i]` tokens continue `states[i]`, updated in place) and
    /// returns the hidden rows ready for the LM head (final-normed, divided by
    /// `logits_scaling`), as the CPU engine's `forward_batch`.
    pub fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        forward_by_kind(self.config.d_model, tokens, lens, states, |t, l, s| self.forward_one_kind(t, l, s))
    }

    fn forward_one_kind(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Result<Vec<f32>> {
        let mut device = {
            let refs: Vec<&State> = states.iter().map(|s| &**s).collect();
            self.upload(&refs, lens, refs.len())?
        };
        let positions: Vec<u64> = states.iter().map(|s| s.position).collect();
        let batch = Batch::new(lens);
        let d = self.config.d_model;
        let hidden = self.run_then(tokens, &batch, &device, &positions, |pass| {
            self.io.final_norm(pass.h.ptr(), pass.out.ptr(), batch.rows, false)?;
            pass.out.read_f32(0, batch.rows * d)
        })?;
        device.kv.advance(lens);
        self.download(&device, states.iter_mut().map(|s| &mut **s))?;
        for (s, &t) in states.iter_mut().zip(lens) {
            s.advance(t);
        }
        Ok(hidden)
    }

    /// Keys held by `state` (the same in every attention layer, or the state is refused).
    fn kv_tokens(&self, state: &State) -> Result<usize> {
        let w = self.kv_width();
        let n = state.attention.first().map_or(0, |kv| kv.tokens(w));
        for (slot, kv) in state.attention.iter().enumerate() {
            if kv.keys.len() != n * w || kv.values.len() != n * w {
                return Err(Error::state(format!(
                    "attention layer {slot} holds {} keys and {} values of {w} floats where the first holds {n} \
                     tokens; every attention layer of a state holds the same tokens",
                    kv.keys.len() as f64 / w as f64,
                    kv.values.len() as f64 / w as f64,
                )));
            }
        }
        Ok(n)
    }

    /// `states` on the device, with room for `seq_cap` sequences and for `extra[i]` more keys
    /// in sequence i.
    fn upload(&self, states: &[&State], extra: &[usize], seq_cap: usize) -> Result<DeviceStates> {
        let c = &self.config;
        let mamba = (0..c.n_mamba())
            .map(|slot| MixerStates::upload(&self.gpu, &c.mamba, states, slot, true))
            .collect::<Result<Vec<_>>>()?;
        let held = states.iter().map(|s| self.kv_tokens(s)).collect::<Result<Vec<_>>>()?;
        let kv = KvCache::new(&self.gpu, self.kv_width(), c.attention_layers().len(), &held, extra)?;
        for (i, s) in states.iter().enumerate() {
            for (l, a) in s.attention.iter().enumerate() {
                kv.write(i, l, &a.keys, &a.values)?;
            }
        }
        Ok(DeviceStates { mamba, kv, seq_cap: seq_cap.max(states.len()) })
    }

    /// Copies the device states back into `states` (the first `states` of `device`).
    fn download<'s>(&self, device: &DeviceStates, states: impl Iterator<Item = &'s mut State>) -> Result<()> {
        let c = &self.config;
        let mut states: Vec<&mut State> = states.collect();
        for (slot, ms) in device.mamba.iter().enumerate() {
            ms.download(&c.mamba, states.iter_mut().map(|s| &mut **s), slot)?;
        }
        for (i, s) in states.iter_mut().enumerate() {
            for (l, a) in s.attention.iter_mut().enumerate() {
                let (keys, values) = device.kv.read(i, l)?;
                *a = KvState { keys, values };
            }
        }
        Ok(())
    }

    /// Keeps `states` in device memory for a run of forward passes ([`GpuHybridStates`]).
    pub(crate) fn resident(&self, states: Vec<State>) -> Result<GpuHybridStates<'_>> {
        let refs: Vec<&State> = states.iter().collect();
        let device = self.upload(&refs, &vec![0; refs.len()], states.len())?;
        let logits = DeviceBuf::zeroed(&self.gpu, device.seq_cap * self.config.vocab_size * 4)?;
        Ok(GpuHybridStates { engine: self, device, host: states, logits, steps: HashMap::new() })
    }

    /// Embeds `tokens`, runs every layer from and into `device`, and hands the pass (the
    /// residual stream in `h`) to `finish`. An empty batch runs nothing.
    fn run_then<T: Default>(
        &self,
        tokens: &[u32],
        batch: &Batch,
        device: &DeviceStates,
        positions: &[u64],
        finish: impl FnOnce(&Pass) -> Result<T>,
    ) -> Result<T> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if batch.rows == 0 {
            return Ok(T::default());
        }
        batch.check_grid()?;
        let pass = self.pass(&mut scratch, tokens, batch, device, positions)?;
        self.layers_on(pass, batch, device)?;
        finish(pass)
    }

    /// Every row's logits of a pass over `device` (only the logits cross to the host).
    fn run_logits(
        &self,
        tokens: &[u32],
        batch: &Batch,
        device: &DeviceStates,
        positions: &[u64],
        out: &DeviceBuf,
    ) -> Result<Vec<f32>> {
        self.run_then(tokens, batch, device, positions, |pass| {
            self.io.logits_of_stream(pass.h.ptr(), pass.xn.ptr(), batch.rows, out)
        })
    }

    /// A decode step (one token per sequence) of a session into `out` (sequences × vocab),
    /// replayed from a graph recorded once per batch size, pass and cache ([`replay_step`]).
    fn decode_logits(
        &self,
        tokens: &[u32],
        batch: &Batch,
        device: &DeviceStates,
        positions: &[u64],
        out: &DeviceBuf,
        steps: &mut HashMap<usize, DecodeGraph>,
    ) -> Result<Vec<f32>> {
        let n = batch.rows * self.config.vocab_size;
        if batch.rows == 0 || out.bytes() < 4 * n {
            return self.run_logits(tokens, batch, device, positions, out);
        }
        batch.check_grid()?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let pass = self.pass(&mut scratch, tokens, batch, device, positions)?;
        replay_step(&*self.gpu, steps, (batch.seqs(), pass.id), &self.graphs, || {
            self.layers_on(pass, batch, device)?;
            self.io.final_norm(pass.h.ptr(), pass.xn.ptr(), batch.rows, true)?;
            self.io.lm_head_into(pass.xn.ptr(), batch.rows, out.ptr())
        })?;
        out.read_f32(0, n)
    }

    /// The pass buffers for `batch`: the last pass's if big enough, else new ones (with room
    /// to grow); uploads the token ids, the batch layout, and each sequence's key count and
    /// position.
    fn pass<'s>(
        &self,
        scratch: &'s mut Option<Pass>,
        tokens: &[u32],
        batch: &Batch,
        device: &DeviceStates,
        positions: &[u64],
    ) -> Result<&'s Pass> {
        let c = &self.config;
        let fits = scratch.as_ref().is_some_and(|p| {
            p.rows >= batch.rows && p.seqs >= batch.seqs() && p.mixer.as_ref().is_none_or(|m| m.fits(&c.mamba, batch))
        });
        if !fits {
            let (old_rows, old_seqs) = scratch.as_ref().map_or((0, 0), |p| (p.rows, p.seqs));
            *scratch = None; // free the old buffers first
            let rows = batch.rows.next_power_of_two().max(old_rows);
            let seqs = batch.seqs().next_power_of_two().max(old_seqs);
            let (d, m) = (c.d_model, self.dtype.size());
            let zeroed = |bytes: usize| DeviceBuf::zeroed(&self.gpu, bytes);
            let shared = (0..c.n_layer()).filter(|&i| c.has_mlp(i)).map(|i| c.mlp_inner(i)).max().unwrap_or(0);
            let inner = shared.max(c.expert_intermediate);
            let (e, ew) = (c.n_experts, if c.n_experts > 0 { c.expert_width() } else { 0 });
            let (qw, kvw) = (c.n_heads * c.head_dim, self.kv_width());
            let attends = !c.attention_layers().is_empty();
            *scratch = Some(Pass {
                id: self.next_pass.fetch_add(1, Ordering::Relaxed),
                rows,
                seqs,
                ids: zeroed(rows * 4)?,
                starts: zeroed(seqs * 4)?,
                lens: zeroed(seqs * 4)?,
                prev: zeroed(seqs * 4)?,
                pos: zeroed(seqs * 4)?,
                off: zeroed(seqs * 4)?,
                h: zeroed(rows * d * 4)?,
                xn: zeroed(rows * d * m)?,
                out: zeroed(rows * d * 4)?,
                mixer: match c.n_mamba() > 0 {
                    true => Some(MixerScratch::new(&self.gpu, &c.mamba, self.dtype, rows, 0, batch)?),
                    false => None,
                },
                qkv: zeroed(if attends { rows * (qw + 2 * kvw) * 4 } else { 0 })?,
                att: zeroed(if attends { rows * qw * m } else { 0 })?,
                mid: zeroed(rows * c.mlp_kind.projections() * inner * 4)?,
                act: zeroed(rows * inner * m)?,
                router: zeroed(rows * e * 4)?,
                xe: zeroed(if c.moe_latent > 0 { rows * ew * 4 } else { 0 })?,
                xg: zeroed(rows * ew * m)?,
                ey: zeroed(rows * ew * 4)?,
                esum: zeroed(if c.moe_latent > 0 { rows * ew * 4 } else { 0 })?,
                idx: zeroed(rows * c.top_k * 4)?,
                wts: zeroed(rows * c.top_k * 4)?,
            });
        }
        let pass = scratch.as_ref().expect("set above");
        let to_i32 = |what: &str, v: u64| {
            i32::try_from(v).map_err(|_| {
                Error::Input(format!("a sequence's {what} is {v}: the GPU engine runs sequences of up to 2^31 tokens"))
            })
        };
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let prev = device.kv.lens().iter().map(|&n| to_i32("key count", n as u64)).collect::<Result<Vec<_>>>()?;
        let pos = positions.iter().map(|&p| to_i32("position", p)).collect::<Result<Vec<_>>>()?;
        let off = device.kv.offsets()?;
        self.gpu.upload(pass.ids.ptr(), &i32_bytes(&ids))?;
        self.gpu.upload(pass.starts.ptr(), &i32_bytes(&batch.starts))?;
        self.gpu.upload(pass.lens.ptr(), &i32_bytes(&batch.lens))?;
        self.gpu.upload(pass.prev.ptr(), &i32_bytes(&prev[..batch.seqs()]))?;
        self.gpu.upload(pass.pos.ptr(), &i32_bytes(&pos[..batch.seqs()]))?;
        self.gpu.upload(pass.off.ptr(), &i32_bytes(&off[..batch.seqs()]))?;
        Ok(pass)
    }

    /// The embedding and every layer over the tokens already in `pass`: launches only, so
    /// they can be recorded.
    fn layers_on(&self, pass: &Pass, batch: &Batch, device: &DeviceStates) -> Result<()> {
        let c = &self.config;
        let rows = batch.rows;
        self.io.embed(pass.ids.ptr(), pass.h.ptr(), rows)?;
        for layer in &self.layers {
            self.io.rmsnorm(pass.h.ptr(), layer.input_norm.ptr(), pass.xn.ptr(), rows, true)?;
            if let Some((slot, m)) = &layer.mamba {
                let io =
                    MixerIo { xn: pass.xn.ptr(), h: pass.h.ptr(), starts: pass.starts.ptr(), lens: pass.lens.ptr() };
                let scratch = pass.mixer.as_ref().expect("a pass of a model with Mamba layers has their buffers");
                m.run(&*self.gpu, self.dtype, &c.mamba, &device.mamba[*slot], scratch, io, batch)?;
            }
            if let Some((slot, a)) = &layer.attention {
                self.attention(a, device.kv.layer(*slot), pass, batch)?;
            }
            if let Some(mlp) = &layer.mlp {
                self.io.rmsnorm(pass.h.ptr(), mlp.norm.ptr(), pass.xn.ptr(), rows, true)?;
                if layer.moe.is_some() {
                    // The experts route (and, unless latent, run) on the f32 normed rows.
                    self.io.rmsnorm(pass.h.ptr(), mlp.norm.ptr(), pass.out.ptr(), rows, false)?;
                }
                self.mlp(mlp, pass, rows)?;
                if let Some(moe) = &layer.moe {
                    self.experts(moe, pass, rows)?;
                }
            }
        }
        Ok(())
    }

    fn gemm(
        &self,
        rows: usize,
        a: u64,
        w: &DeviceBuf,
        out: u64,
        (n, k): (usize, usize),
        accumulate: bool,
    ) -> Result<()> {
        self.gpu.gemm(&Gemm { dtype: self.dtype, rows, n, k, a, w: w.ptr(), out, accumulate, alpha: 1.0 })
    }

    /// `h += residual_multiplier · a · wᵀ`: a branch's output projection into the stream.
    fn gemm_into_stream(&self, rows: usize, a: u64, w: &DeviceBuf, h: u64, (n, k): (usize, usize)) -> Result<()> {
        let alpha = self.config.residual_multiplier as f32;
        self.gpu.gemm(&Gemm { dtype: self.dtype, rows, n, k, a, w: w.ptr(), out: h, accumulate: true, alpha })
    }

    /// `h += o(attention(qkv(xn)))` over the keys and values in the pools `(keys, values)`,
    /// the new tokens' appended first.
    fn attention(
        &self,
        a: &Attention,
        (keys, values): &(DeviceBuf, DeviceBuf),
        pass: &Pass,
        batch: &Batch,
    ) -> Result<()> {
        let c = &self.config;
        let (d, rows, seqs) = (c.d_model, batch.rows, batch.seqs() as u32);
        let (qw, kvw) = (c.n_heads * c.head_dim, self.kv_width());
        self.gemm(rows, pass.xn.ptr(), &a.qkv, pass.qkv.ptr(), (qw + 2 * kvw, d), false)?;
        let rope = RopeAppendArgs {
            qkv: pass.qkv.ptr(),
            keys: keys.ptr(),
            values: values.ptr(),
            inv_freq: self.inv_freq.as_ref().map_or(0, DeviceBuf::ptr),
            starts: pass.starts.ptr(),
            lens: pass.lens.ptr(),
            prev: pass.prev.ptr(),
            pos: pass.pos.ptr(),
            off: pass.off.ptr(),
            heads: c.n_heads as i32,
            kv_heads: c.n_kv_heads as i32,
            head_dim: c.head_dim as i32,
            rotary: if self.inv_freq.is_some() { c.rotary_dim() as i32 } else { 0 },
        };
        launch(&*self.gpu, "rope_append", [batch.max_len as u32, seqs, 1], [BLOCK, 1, 1], &rope)?;
        let attend = AttendArgs {
            qkv: pass.qkv.ptr(),
            keys: keys.ptr(),
            values: values.ptr(),
            out: pass.att.ptr(),
            starts: pass.starts.ptr(),
            lens: pass.lens.ptr(),
            prev: pass.prev.ptr(),
            off: pass.off.ptr(),
            heads: c.n_heads as i32,
            kv_heads: c.n_kv_heads as i32,
            head_dim: c.head_dim as i32,
            scale: c.attention_multiplier as f32,
            out_bf16: self.dtype.flag(),
            pad: 0,
        };
        // A thread per output channel (and per key of a tile): a head's width, rounded up to a
        // power of two, at least a warp.
        let block = c.head_dim.next_power_of_two().clamp(32, 256) as u32;
        launch(&*self.gpu, "attend", [batch.max_len as u32, c.n_heads as u32, seqs], [block, 1, 1], &attend)?;
        self.gemm_into_stream(rows, pass.att.ptr(), &a.o, pass.h.ptr(), (d, qw))
    }

    /// `h += down(act(input(xn)))`.
    fn mlp(&self, mlp: &Mlp, pass: &Pass, rows: usize) -> Result<()> {
        let c = &self.config;
        let gates = c.mlp_kind.projections();
        self.gemm(rows, pass.xn.ptr(), &mlp.input, pass.mid.ptr(), (gates * mlp.inner, c.d_model), false)?;
        self.activate(pass, rows, mlp.inner)?;
        self.gemm_into_stream(rows, pass.act.ptr(), &mlp.output, pass.h.ptr(), (c.d_model, mlp.inner))
    }

    /// `h += Σ weight · expert(x)` over each row's routed experts, x the normed rows (in `out`
    /// and `xn`) or, for latent experts, their projection down, whose weighted sum is projected
    /// back up. The routing runs on the host (`cpu::route`, on f32 router logits); each expert
    /// then multiplies only its rows, gathered, and adds them back.
    fn experts(&self, moe: &Moe, pass: &Pass, rows: usize) -> Result<()> {
        let c = &self.config;
        let (d, e, ei, w) = (c.d_model, c.n_experts, c.expert_intermediate, c.expert_width());
        let f32_gemm = Gemm {
            dtype: MatrixDtype::F32,
            rows,
            n: e,
            k: d,
            a: pass.out.ptr(),
            w: moe.router.ptr(),
            out: pass.router.ptr(),
            accumulate: false,
            alpha: 1.0,
        };
        self.gpu.gemm(&f32_gemm)?;
        let logits = pass.router.read_f32(0, rows * e)?;
        let mut by_expert: Vec<super::cpu::Route> = vec![Vec::new(); e];
        for (r, l) in logits.chunks_exact(e).enumerate() {
            for (j, weight) in super::cpu::route(l, moe.bias.as_deref(), c.top_k, c.routing) {
                by_expert[j].push((r, weight));
            }
        }
        // Dense experts add into the stream: their weights take the residual multiplier
        // (latent experts' sum takes it in the projection back up).
        let scale = if moe.latent.is_some() { 1.0 } else { c.residual_multiplier as f32 };
        let (idx, wts): (Vec<i32>, Vec<f32>) =
            by_expert.iter().flatten().map(|&(r, wt)| (r as i32, if scale == 1.0 { wt } else { scale * wt })).unzip();
        self.gpu.upload(pass.idx.ptr(), &i32_bytes(&idx))?;
        self.gpu.upload(pass.wts.ptr(), bytemuck::cast_slice(&wts))?;
        let (src, sum) = match &moe.latent {
            Some((down, _)) => {
                self.gemm(rows, pass.xn.ptr(), down, pass.xe.ptr(), (w, d), false)?;
                self.gpu.upload(pass.esum.ptr(), bytemuck::cast_slice(&vec![0f32; rows * w]))?;
                (pass.xe.ptr(), pass.esum.ptr())
            }
            None => (pass.out.ptr(), pass.h.ptr()),
        };
        let gates = c.mlp_kind.projections();
        let mut at = 0u64;
        for ((gate_up, down), picked) in moe.experts.iter().zip(&by_expert) {
            let n = picked.len();
            if n == 0 {
                continue;
            }
            let (idx, weights) = (pass.idx.ptr() + 4 * at, pass.wts.ptr() + 4 * at);
            at += n as u64;
            let gather = GatherArgs { src, idx, out: pass.xg.ptr(), width: w as i32, out_bf16: self.dtype.flag() };
            launch(&*self.gpu, "gather_rows", [n as u32, 1, 1], [BLOCK, 1, 1], &gather)?;
            self.gemm(n, pass.xg.ptr(), gate_up, pass.mid.ptr(), (gates * ei, w), false)?;
            self.activate(pass, n, ei)?;
            self.gemm(n, pass.act.ptr(), down, pass.ey.ptr(), (w, ei), false)?;
            let add = ScatterAddArgs { src: pass.ey.ptr(), idx, weights, out: sum, width: w as i32, pad: 0 };
            launch(&*self.gpu, "scatter_add_rows", [n as u32, 1, 1], [BLOCK, 1, 1], &add)?;
        }
        if let Some((_, up)) = &moe.latent {
            let n = (rows * w) as i64;
            let convert =
                ConvertArgs { x: pass.esum.ptr(), out: pass.xg.ptr(), n, out_bf16: self.dtype.flag(), pad: 0 };
            launch(&*self.gpu, "convert", [blocks(rows * w), 1, 1], [BLOCK, 1, 1], &convert)?;
            self.gemm_into_stream(rows, pass.xg.ptr(), up, pass.h.ptr(), (d, w))?;
        }
        Ok(())
    }

    /// The MLP's activation of `rows` rows of `mid` into `act` (`inner` wide).
    fn activate(&self, pass: &Pass, rows: usize, inner: usize) -> Result<()> {
        let glu = GluArgs {
            x: pass.mid.ptr(),
            out: pass.act.ptr(),
            inner: inner as i32,
            relu2: i32::from(self.config.mlp_kind == MlpKind::Relu2),
            out_bf16: self.dtype.flag(),
            pad: 0,
        };
        launch(&*self.gpu, "glu", [rows.max(1) as u32, 1, 1], [BLOCK, 1, 1], &glu)
    }

    /// Logits (rows × vocab) of hidden rows from [`GpuGraniteHybrid::forward_batch`].
    pub fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        self.io.logits(hidden)
    }

    /// `log p(targets[i] | hidden row i)`: only one float per row crosses back.
    pub fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        self.io.logprobs(hidden, targets)
    }
}

/// States of a batch held in device memory across forward passes: a decode loop uploads them
/// once and brings them back once, however many tokens it runs.
pub(crate) struct GpuHybridStates<'e> {
    engine: &'e GpuGraniteHybrid,
    device: DeviceStates,
    /// The states as given (their values stale until [`crate::engine::Resident::states`]),
    /// with positions kept current.
    host: Vec<State>,
    /// The logits of one step of every sequence (seq_cap × vocab).
    logits: DeviceBuf,
    /// The decode steps recorded on these buffers, by number of sequences.
    steps: HashMap<usize, DecodeGraph>,
}

impl GpuHybridStates<'_> {
    /// Room for `seq_cap` sequences' Mamba states and logits: new buffers, the sequences copied
    /// over on the device. The recorded steps go first (they hold the old addresses), and the
    /// new buffers are all made before the old ones go, so a failed allocation leaves the
    /// session as it was.
    fn regrow(&mut self, seq_cap: usize) -> Result<()> {
        self.steps.clear();
        let e = self.engine;
        let (gpu, n) = (&e.gpu, self.host.len());
        let mamba = self
            .device
            .mamba
            .iter()
            .map(|ms| ms.grown(gpu, &e.config.mamba, n, seq_cap))
            .collect::<Result<Vec<_>>>()?;
        self.logits = DeviceBuf::zeroed(gpu, seq_cap * e.config.vocab_size * 4)?;
        (self.device.mamba, self.device.seq_cap) = (mamba, seq_cap);
        Ok(())
    }
}

impl crate::engine::Resident for GpuHybridStates<'_> {
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
        if self.device.kv.reserve(lens)? {
            self.steps.clear();
        }
        let e = self.engine;
        let batch = Batch::new(lens);
        let positions: Vec<u64> = self.host.iter().map(|s| s.position).collect();
        let logits = match lens.iter().all(|&l| l == 1) && e.graphs.load(Ordering::Relaxed) {
            true => e.decode_logits(tokens, &batch, &self.device, &positions, &self.logits, &mut self.steps)?,
            false => e.run_logits(tokens, &batch, &self.device, &positions, &self.logits)?,
        };
        self.device.kv.advance(lens);
        for (s, &t) in self.host.iter_mut().zip(lens) {
            s.advance(t);
        }
        Ok(logits)
    }
    fn states(&self) -> Result<Vec<State>> {
        let mut out = self.host.clone();
        self.engine.download(&self.device, out.iter_mut())?;
        Ok(out)
    }
    fn push(&mut self, state: State) -> Result<()> {
        let e = self.engine;
        let n = e.kv_tokens(&state)?;
        let i = self.host.len();
        if i == self.device.seq_cap {
            self.regrow((2 * i).max(4))?;
        }
        if self.device.kv.push(n)? {
            self.steps.clear();
        }
        for (slot, ms) in self.device.mamba.iter().enumerate() {
            ms.write(&e.config.mamba, i, &state.layers[slot])?;
        }
        for (l, a) in state.attention.iter().enumerate() {
            self.device.kv.write(i, l, &a.keys, &a.values)?;
        }
        self.host.push(state);
        Ok(())
    }
    fn swap_remove(&mut self, i: usize) -> Result<()> {
        let n = self.host.len();
        if i >= n {
            return Err(Error::Input(format!("internal: removing sequence {i} of {n}")));
        }
        let e = self.engine;
        if i + 1 < n {
            for ms in &self.device.mamba {
                ms.copy_seq(&*e.gpu, &e.config.mamba, i, n - 1)?;
            }
        }
        self.device.kv.swap_remove(i);
        self.host.swap_remove(i);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The hybrid GPU engine against the CPU engine on the transformers fixtures of every dense
    //! family (`testdata/granite`): on the CPU emulator here and in CI, on a GPU with
    //! `PICASO_TEST_GPU=cuda`.
    use super::*;
    use crate::cpu::WeightDtype;
    use crate::gpu::testing::{assert_states_close, rel_diff, test_gpu, tokens};
    use crate::model::{Backend, LoadOptions, Model};

    /// Every hybrid fixture: NoPE Granite with every multiplier, Granite with RoPE and routed
    /// experts, Bamba's partial RoPE, Nemotron-H's relu² and MLP-less mixers, Nemotron 3's
    /// grouped sigmoid routing and latent experts, Falcon-H1's parallel mixers and µP (gate
    /// only, and the norm before the gate).
    const CASES: [&str; 8] = [
        "dense-nope-g1",
        "moe-rope-g2",
        "bamba-rope-g2",
        "nemotron-h-g2",
        "nemotron-h-moe-g2",
        "nemotron-h-latent-g2",
        "falcon-h1-g2",
        "falcon-h1-norm-g2",
    ];

    fn fixture(case: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/granite").join(case).join("hf")
    }

    fn load(case: &str, backend: Backend, weight_dtype: WeightDtype) -> Result<Model> {
        let opts = LoadOptions { backend, weight_dtype, tokenizer: None, skip_tokenizer: true };
        Model::load(&fixture(case), &opts)
    }

    fn pair(case: &str) -> (Model, Model) {
        (
            load(case, Backend::Gpu(test_gpu()), WeightDtype::F32).unwrap(),
            load(case, Backend::Cpu, WeightDtype::F32).unwrap(),
        )
    }

    fn vocab(m: &Model) -> usize {
        match m.config() {
            crate::config::ModelConfig::GraniteHybrid(c) => c.vocab_size,
            _ => unreachable!("a hybrid fixture"),
        }
    }

    /// A prompt of two chunks (the chunked scan, attention over tiles of keys), three tokens
    /// (the step scan), a single step, and a prompt again, each from the state the last left:
    /// log-probs and every state part as the CPU engine's.
    #[test]
    fn every_family_matches_the_cpu_engine() {
        for case in CASES {
            let (gpu, cpu) = pair(case);
            let v = vocab(&gpu);
            let (mut sg, mut sc) = (gpu.zero_state(), cpu.zero_state());
            let mut worst = 0.0f32;
            for (i, n) in [66usize, 3, 1, 12].into_iter().enumerate() {
                let t = tokens(n + 1, v, i as u32);
                let (a, b) = (gpu.score(&t, &sg).unwrap(), cpu.score(&t, &sc).unwrap());
                let at = format!("{case}, step {i} ({n} tokens)");
                let d = rel_diff(&a.logprobs, &b.logprobs);
                assert!(d < 2e-5, "{at}: log-probs differ by {d:e}");
                assert_states_close(&a.state, &b.state, 2e-5, &at);
                worst = worst.max(d);
                (sg, sc) = (a.state, b.state);
            }
            eprintln!("{case}: log-probs within {worst:.1e} of the CPU engine's");
        }
    }

    /// A batch mixing decode steps and prompts, from states with different numbers of keys,
    /// gives each sequence what it gets alone (a Granite 4.0 H with RoPE and routed experts:
    /// each expert's rows gathered from several sequences).
    #[test]
    fn a_mixed_batch_gives_each_sequence_its_lone_result() {
        let gpu = load("moe-rope-g2", Backend::Gpu(test_gpu()), WeightDtype::F32).unwrap();
        let v = vocab(&gpu);
        let warm = gpu.prefill(&tokens(9, v, 3), &gpu.zero_state()).unwrap();
        let longer = gpu.prefill(&tokens(30, v, 4), &gpu.zero_state()).unwrap();
        let starts = [warm.clone(), gpu.zero_state(), longer, warm];
        let seqs: Vec<Vec<u32>> =
            [1usize, 40, 3, 1].iter().enumerate().map(|(i, &n)| tokens(n, v, 10 + i as u32)).collect();
        let refs: Vec<&[u32]> = seqs.iter().map(|s| &s[..]).collect();
        let batched = gpu.prefill_batch(&refs, &starts.iter().collect::<Vec<_>>()).unwrap();
        // A short sequence batched with a long one runs the chunked scan instead of the step
        // scan (and on a GPU, cuBLAS picks its kernels by the number of rows): the same sums in
        // another order.
        let tol = if std::env::var("PICASO_TEST_GPU").as_deref() == Ok("cuda") { 2e-5 } else { 1e-5 };
        for (i, ((logits, state), seq)) in batched.iter().zip(&seqs).enumerate() {
            let (alone_logits, alone) = gpu.prefill_last_logits(seq, &starts[i]).unwrap();
            let d = rel_diff(logits, &alone_logits);
            assert!(d < tol, "sequence {i}: logits differ by {d:e}");
            assert_states_close(state, &alone, tol, &format!("sequence {i}"));
        }
    }

    /// bf16 matrices: the GPU's bf16 path agrees with the CPU engine's far more closely than
    /// either with f32, with a residual multiplier (Granite's, applied to the products, not
    /// folded into the weights bf16 rounds) and with µP multipliers (folded on both).
    #[test]
    fn bf16_matrices_match_the_cpu_engines_bf16_path() {
        for case in ["dense-nope-g1", "falcon-h1-g2"] {
            let gpu = load(case, Backend::Gpu(test_gpu()), WeightDtype::Bf16).unwrap();
            let cpu16 = load(case, Backend::Cpu, WeightDtype::Bf16).unwrap();
            let cpu32 = load(case, Backend::Cpu, WeightDtype::F32).unwrap();
            let t = tokens(60, vocab(&gpu), 4);
            let score = |m: &Model| m.score(&t, &m.zero_state()).unwrap().logprobs;
            let (lg, l16, l32) = (score(&gpu), score(&cpu16), score(&cpu32));
            let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            let (to16, cpu_gap) = (worst(&lg, &l16), worst(&l16, &l32));
            eprintln!("{case}: bf16 log-probs: gpu vs cpu bf16 {to16:e}, cpu bf16 vs f32 {cpu_gap:e}");
            // The paths round the same weights, but activations whose f32 values differ in the
            // last bits (sums in another order) can round to neighbouring bf16 values.
            assert!(to16 < 2e-3, "{case}: the GPU's bf16 path is {to16} nats from the CPU's");
            assert!(cpu_gap > 10.0 * to16, "{case}: bf16 should move log-probs by more than the engines differ");
        }
    }

    /// Sequences join and leave a session on the device as a server's batch does (past the
    /// room for sequences and for keys, the last taking a leaver's place, batch sizes recurring
    /// so recorded steps replay), and every step gives what the CPU engine's session gives;
    /// the same session with graphs off gives the same logits.
    #[test]
    fn a_session_keeps_keys_on_the_device_as_sequences_join_and_leave() {
        {
            let case = "bamba-rope-g2";
            let (gpu, cpu) = pair(case);
            let v = vocab(&gpu) as u32;
            let joiner = |m: &Model, seed: u32| {
                m.prefill(&tokens(5 + 3 * seed as usize, v as usize, seed), &m.zero_state()).unwrap()
            };
            // (sequences joining, index leaving) before each step; the one of 20 tokens joins
            // past the first room for keys (16).
            let plan: [(&[u32], Option<usize>); 9] = [
                (&[1, 2], None),
                (&[], None),
                (&[3], None),
                (&[], Some(0)),
                (&[4, 5, 6], None),
                (&[], Some(4)),
                (&[], Some(1)),
                (&[7], None),
                (&[], None),
            ];
            let run = |m: &Model| {
                let mut session = m.session(Vec::new()).unwrap();
                let mut logits = Vec::new();
                for (step, (joining, leaving)) in plan.iter().enumerate() {
                    for &seed in *joining {
                        session.push(joiner(m, seed)).unwrap();
                    }
                    if let Some(i) = leaving {
                        session.swap_remove(*i).unwrap();
                    }
                    let next: Vec<u32> = (0..session.len() as u32).map(|i| (i * 5 + step as u32) % v).collect();
                    logits.push(session.step(&next).unwrap());
                }
                (logits, session.states().unwrap())
            };
            let ((g_logits, g_states), (c_logits, c_states)) = (run(&gpu), run(&cpu));
            for (i, (g, c)) in g_logits.iter().zip(&c_logits).enumerate() {
                assert!(rel_diff(g, c) < 3e-5, "{case} step {i}: logits differ by {:e}", rel_diff(g, c));
            }
            for (i, (g, c)) in g_states.iter().zip(&c_states).enumerate() {
                assert_states_close(g, c, 2e-5, &format!("{case}: sequence {i} at the end"));
            }
        }
    }

    /// The engine itself, from a fixture.
    fn engine(case: &str) -> GpuGraniteHybrid {
        let dir = fixture(case);
        let crate::config::ModelConfig::GraniteHybrid(c) =
            crate::config::ModelConfig::from_file(&dir.join("config.json")).unwrap()
        else {
            unreachable!("a hybrid fixture")
        };
        let w = GraniteHybridWeights::load(&dir, &c).unwrap();
        GpuGraniteHybrid::new(c, w, test_gpu(), MatrixDtype::F32).unwrap()
    }

    /// A session's decode steps replayed from recorded graphs give what launching their
    /// kernels gives, step for step, across a longer pass between two steps (new pass buffers)
    /// and a cache that outgrows its room (new key buffers): both make the session record its
    /// step again rather than replay one on freed buffers.
    #[test]
    fn decode_steps_replayed_from_a_graph_equal_launched_ones() {
        use crate::engine::Resident;
        let case = "bamba-rope-g2";
        let (graphed, launched) = (engine(case), engine(case));
        launched.set_graphs(false);
        let v = graphed.config().vocab_size;
        let zero = || State::zeros(graphed.config().state_shape(), "test");
        let mut start = zero();
        graphed.forward_batch(&tokens(13, v, 5), &[13], &mut [&mut start]).unwrap();
        let mut runs = Vec::new();
        for e in [&graphed, &launched] {
            let mut session = e.resident(vec![start.clone(), start.clone(), zero()]).unwrap();
            let (mut logits, mut recorded) = (Vec::new(), Vec::new());
            for i in 0..8u32 {
                if i == 2 {
                    let mut other = zero();
                    e.forward_batch(&tokens(100, v, 9), &[100], &mut [&mut other]).unwrap();
                }
                let next = [i % v as u32, (i * 7 + 3) % v as u32, 5];
                logits.push(session.forward_logits(&next, &[1, 1, 1]).unwrap());
                recorded.push((session.steps.get(&3).map(|g| g.pass), session.device.kv.pool()));
            }
            runs.push((logits, recorded, session.states().unwrap()));
        }
        let ((g_logits, g_rec, g_states), (l_logits, l_rec, l_states)) = (&runs[0], &runs[1]);
        assert!(graphed.graphs.load(Ordering::Relaxed), "recording a decode step failed");
        assert!(l_rec.iter().all(|(p, _)| p.is_none()), "graphs off, yet a step was recorded");
        assert!(g_rec.iter().all(|(p, _)| p.is_some()), "a step ran without a recorded graph");
        assert_ne!(g_rec[2].0, g_rec[1].0, "after the longer pass the step is recorded again");
        // Two sequences of 13 keys and one of none: regions of 16 each, then the first two
        // outgrow theirs at their fourth step and the pools are repacked, twice as large.
        assert_eq!((g_rec[0].1, g_rec[7].1), (48, 96), "the key pools grew during the steps");
        for (i, (g, l)) in g_logits.iter().zip(l_logits).enumerate() {
            assert!(rel_diff(g, l) < 1e-6, "step {i}: logits differ by {:e}", rel_diff(g, l));
        }
        for (i, (g, l)) in g_states.iter().zip(l_states).enumerate() {
            assert_states_close(g, l, 1e-6, &format!("sequence {i} after the steps"));
        }
    }

    /// A composed state (PICASO-R on the Mamba layers, the union of keys and values) continues
    /// on the device as on the CPU.
    #[test]
    fn a_composed_state_continues_as_on_the_cpu() {
        use picaso_compose::Composition;
        let (gpu, cpu) = pair("bamba-rope-g2");
        let v = vocab(&gpu);
        let parts: Vec<State> =
            (0..3).map(|i| cpu.prefill(&tokens(12 + 7 * i, v, i as u32), &cpu.zero_state()).unwrap()).collect();
        let refs: Vec<&State> = parts.iter().collect();
        for method in [Composition::PicasoR, Composition::Soup] {
            let (mut a, mut b) = (
                gpu.session_composed(method, &refs, None).unwrap(),
                cpu.session_composed(method, &refs, None).unwrap(),
            );
            for next in [[5u32], [9]] {
                let (x, y) = (a.step(&next).unwrap(), b.step(&next).unwrap());
                assert!(rel_diff(&x, &y) < 1e-5, "{}: logits differ by {:e}", method.name(), rel_diff(&x, &y));
            }
        }
    }
}
