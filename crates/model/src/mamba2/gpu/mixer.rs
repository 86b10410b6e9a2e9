//! The Mamba-2 mixer on a GPU, shared by the Mamba-2 engine and the hybrids' (`granite_hybrid::
//! gpu`): its weights on the device ([`GpuMixer`]), its states of a batch packed per layer
//! ([`MixerStates`]), the buffers of one pass ([`MixerScratch`]), and the kernels that take
//! normed rows to `h += out_proj(mixer(rows))`.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::kernels::{launch, AddBiasArgs, ChunkArgs, ConvArgs, DtArgs, GatedNormArgs, ScanArgs, ScanShape};
use crate::gpu::plan::{blocks, scan_threads_per_row, Batch, BLOCK, CHUNK};
use crate::gpu::{DeviceBuf, DevicePtr, Gemm, Gpu, MatrixDtype};
use crate::mamba2::{GateNorm, LayerWeights, Mamba2Config};
use crate::state::{LayerState, State};

/// Refuses a mixer the kernels cannot run.
pub(crate) fn check_shapes(c: &Mamba2Config) -> Result<()> {
    if c.headdim > 1024 || c.d_conv < 1 || c.d_conv > 17 {
        return Err(Error::Input(format!(
            "the GPU engine runs headdim ≤ 1024 and d_conv 1..=17 (this model: headdim {}, d_conv {}); use --device cpu",
            c.headdim, c.d_conv
        )));
    }
    Ok(())
}

/// One mixer's weights on the device (small vectors in f32, the projections in the matrix type).
#[derive(Debug)]
pub(crate) struct GpuMixer {
    in_proj: DeviceBuf,
    in_proj_bias: Option<DeviceBuf>,
    /// (C, K)
    conv_w: DeviceBuf,
    /// (C); zeros when the checkpoint has none.
    conv_b: DeviceBuf,
    dt_bias: DeviceBuf,
    /// A = -exp(A_log), (H)
    a_neg: DeviceBuf,
    d: DeviceBuf,
    gated_norm: DeviceBuf,
    out_proj: DeviceBuf,
    out_proj_bias: Option<DeviceBuf>,
    /// The output's scale (a hybrid's residual multiplier; the bias is stored scaled).
    out_scale: f32,
}

/// Device addresses one mixer pass reads and writes besides its scratch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MixerIo {
    /// The normed rows, in the matrix type (rows × d_model).
    pub xn: DevicePtr,
    /// The residual stream the output is added to (rows × d_model, f32).
    pub h: DevicePtr,
    /// Each sequence's first row and its length (i32).
    pub starts: DevicePtr,
    pub lens: DevicePtr,
}

impl GpuMixer {
    /// Uploads `l`'s mixer, whose output is to be multiplied by `out_scale` (a hybrid's residual
    /// multiplier: applied to the product in f32, the projection stored as read, the bias
    /// scaled in f32).
    pub(crate) fn upload(
        c: &Mamba2Config,
        l: &LayerWeights,
        gpu: &Arc<dyn Gpu>,
        dtype: MatrixDtype,
        out_scale: f32,
    ) -> Result<Self> {
        let f32buf = |v: &[f32]| DeviceBuf::from_f32(gpu, v);
        let matrix = |v: &[f32]| DeviceBuf::from_bytes(gpu, &dtype.encode(v));
        let scaled = |v: &[f32]| -> Vec<f32> {
            match out_scale == 1.0 {
                true => v.to_vec(),
                false => v.iter().map(|x| x * out_scale).collect(),
            }
        };
        Ok(Self {
            in_proj: matrix(&l.in_proj)?,
            in_proj_bias: l.in_proj_bias.as_deref().map(f32buf).transpose()?,
            conv_w: f32buf(&l.conv_weight)?,
            conv_b: f32buf(l.conv_bias.as_deref().unwrap_or(&vec![0.0; c.conv_dim()]))?,
            dt_bias: f32buf(&l.dt_bias)?,
            a_neg: f32buf(&l.a_log.iter().map(|v| -v.exp()).collect::<Vec<_>>())?,
            d: f32buf(&l.d)?,
            gated_norm: f32buf(&l.gated_norm)?,
            out_proj: matrix(&l.out_proj)?,
            out_proj_bias: l.out_proj_bias.as_deref().map(|b| f32buf(&scaled(b))).transpose()?,
            out_scale,
        })
    }

    /// The mixer of `batch`'s normed rows from and into the states `ls`, its output added to
    /// the residual stream: launches only, so they can be recorded.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        gpu: &dyn Gpu,
        dtype: MatrixDtype,
        c: &Mamba2Config,
        ls: &MixerStates,
        s: &MixerScratch,
        io: MixerIo,
        batch: &Batch,
    ) -> Result<()> {
        let (rows, seqs) = (batch.rows, batch.seqs() as u32);
        let (width, di, cd) = (c.d_in_proj(), c.d_inner(), c.conv_dim());
        let gemm = |a, w: &DeviceBuf, out, n, k, accumulate, alpha| {
            gpu.gemm(&Gemm { dtype, rows, n, k, a, w: w.ptr(), out, accumulate, alpha })
        };
        gemm(io.xn, &self.in_proj, s.zx.ptr(), width, c.d_model, false, 1.0)?;
        add_bias(gpu, s.zx.ptr(), self.in_proj_bias.as_ref(), rows, width)?;

        let (starts, lens) = (io.starts, io.lens);
        let conv = ConvArgs {
            zx: s.zx.ptr(),
            tails: ls.tails.ptr(),
            w: self.conv_w.ptr(),
            bias: self.conv_b.ptr(),
            out: s.xbc.ptr(),
            starts,
            lens,
            width: width as i32,
            offset: di as i32,
            channels: cd as i32,
            k: c.d_conv as i32,
        };
        let shape = ScanShape {
            heads: c.nheads as i32,
            headdim: c.headdim as i32,
            d_state: c.d_state as i32,
            groups: c.n_groups as i32,
            conv_dim: cd as i32,
            pad: 0,
        };
        let heads = c.nheads as u32;
        let (lo, hi) = c.time_step_limit;
        if batch.step_scan() {
            // Decode steps and short prompts: three launches (conv and tail, dt and scan).
            launch(gpu, "conv_step", [blocks(cd), seqs, 1], [BLOCK, 1, 1], &conv)?;
            let tpr = scan_threads_per_row(c.headdim, c.d_state);
            let args = ScanArgs {
                xbc: s.xbc.ptr(),
                zx: s.zx.ptr(),
                dt_bias: self.dt_bias.ptr(),
                a_neg: self.a_neg.ptr(),
                d: self.d.ptr(),
                ssm: ls.ssm.ptr(),
                log_decay: ls.log_decay.ptr(),
                y: s.y.ptr(),
                starts,
                lens,
                shape,
                width: width as i32,
                dt_offset: (di + cd) as i32,
                lo: lo as f32,
                hi: hi as f32,
                threads_per_row: tpr as i32,
                pad: 0,
            };
            launch(gpu, "scan_steps", [heads, seqs, 1], [(c.headdim * tpr) as u32, 1, 1], &args)?;
        } else {
            // Prompts: the conv in parallel over tokens, then the chunked scan.
            launch(gpu, "conv_silu", [blocks(batch.max_len * cd), seqs, 1], [BLOCK, 1, 1], &conv)?;
            launch(gpu, "conv_tail", [blocks(cd), seqs, 1], [BLOCK, 1, 1], &conv)?;
            let dt = DtArgs {
                zx: s.zx.ptr(),
                dt_bias: self.dt_bias.ptr(),
                a_neg: self.a_neg.ptr(),
                dt: s.dt.ptr(),
                log_decay: ls.log_decay.ptr(),
                starts,
                lens,
                width: width as i32,
                offset: (di + cd) as i32,
                heads: c.nheads as i32,
                lo: lo as f32,
                hi: hi as f32,
                rows: rows as i32,
            };
            launch(gpu, "dt_values", [blocks(rows * c.nheads), 1, 1], [BLOCK, 1, 1], &dt)?;
            launch(gpu, "log_decay_sum", [heads, seqs, 1], [BLOCK, 1, 1], &dt)?;
            let chunks = s.chunks.as_ref().expect("a pass for a chunked batch has chunk buffers");
            let args = ChunkArgs {
                xbc: s.xbc.ptr(),
                dt: s.dt.ptr(),
                a_neg: self.a_neg.ptr(),
                d: self.d.ptr(),
                ssm: ls.ssm.ptr(),
                chunks: chunks.ptr(),
                y: s.y.ptr(),
                starts,
                lens,
                shape,
                chunk: CHUNK as i32,
                max_chunks: batch.max_chunks() as i32,
            };
            let grid = [batch.max_chunks() as u32, heads, seqs];
            launch(gpu, "ssd_chunk_state", grid, [BLOCK, 1, 1], &args)?;
            launch(gpu, "ssd_state_pass", [heads, seqs, 1], [BLOCK, 1, 1], &args)?;
            launch(gpu, "ssd_chunk_scan", grid, [BLOCK, 1, 1], &args)?;
        }

        let group = di / c.n_groups;
        let norm = GatedNormArgs {
            y: s.y.ptr(),
            zx: s.zx.ptr(),
            w: self.gated_norm.ptr(),
            out: s.gated.ptr(),
            width: width as i32,
            d_inner: di as i32,
            group: group as i32,
            out_bf16: dtype.flag(),
            eps: c.gated_norm_eps as f32,
            mode: match c.gate_norm {
                GateNorm::NormGated => 0,
                GateNorm::NormThenGate => 1,
                GateNorm::GateOnly => 2,
            },
        };
        launch(gpu, "gated_rmsnorm", [rows as u32, c.n_groups as u32, 1], [BLOCK, 1, 1], &norm)?;
        gemm(s.gated.ptr(), &self.out_proj, io.h, c.d_model, di, true, self.out_scale)?;
        add_bias(gpu, io.h, self.out_proj_bias.as_ref(), rows, c.d_model)
    }
}

/// `x (rows × cols) += b` per row, when there is a bias.
pub(crate) fn add_bias(gpu: &dyn Gpu, x: DevicePtr, b: Option<&DeviceBuf>, rows: usize, cols: usize) -> Result<()> {
    let Some(b) = b else { return Ok(()) };
    let args = AddBiasArgs { x, b: b.ptr(), cols: cols as i32, pad: 0 };
    launch(gpu, "add_bias", [rows as u32, 1, 1], [BLOCK, 1, 1], &args)
}

/// One mixer's states of every sequence of a batch, packed: the SSM states, the conv tails and
/// the log-decays, each sequence's after the previous one's.
pub(crate) struct MixerStates {
    pub(crate) ssm: DeviceBuf,
    pub(crate) tails: DeviceBuf,
    pub(crate) log_decay: DeviceBuf,
}

impl MixerStates {
    /// Floats per sequence of the SSM state, the conv tail and the log-decay.
    pub(crate) fn floats(c: &Mamba2Config) -> [usize; 3] {
        [c.nheads * c.headdim * c.d_state, c.conv_dim() * (c.d_conv - 1), c.nheads]
    }

    /// The parts in the order of [`MixerStates::floats`].
    fn parts(&self) -> [&DeviceBuf; 3] {
        [&self.ssm, &self.tails, &self.log_decay]
    }

    /// The `slot`-th mixer's states of `states`, packed and uploaded; with `upload_ssm` false
    /// the SSM states start as zeros (a composition writes them there).
    pub(crate) fn upload(
        gpu: &Arc<dyn Gpu>,
        c: &Mamba2Config,
        states: &[&State],
        slot: usize,
        upload_ssm: bool,
    ) -> Result<Self> {
        // Each state's part straight from its buffer: no packed copy on the host.
        let pack = |part: &dyn Fn(&State) -> &[f32]| -> Result<DeviceBuf> {
            let n = states.first().map_or(0, |s| part(s).len());
            let buf = DeviceBuf::zeroed(gpu, states.len() * n * 4)?;
            for (i, s) in states.iter().enumerate() {
                buf.write_f32(i * n, part(s))?;
            }
            Ok(buf)
        };
        Ok(Self {
            ssm: match upload_ssm {
                true => pack(&|s| &s.layers[slot].ssm)?,
                false => DeviceBuf::zeroed(gpu, states.len() * Self::floats(c)[0] * 4)?,
            },
            tails: pack(&|s| &s.layers[slot].conv)?,
            log_decay: pack(&|s| &s.layers[slot].log_decay)?,
        })
    }

    /// Copies these states back into each state's `slot`-th layer.
    pub(crate) fn download<'s>(
        &self,
        c: &Mamba2Config,
        states: impl Iterator<Item = &'s mut State>,
        slot: usize,
    ) -> Result<()> {
        let (ssm, tails, decay) = (self.ssm.to_f32()?, self.tails.to_f32()?, self.log_decay.to_f32()?);
        let [n_ssm, n_tail, n_decay] = Self::floats(c);
        for (i, s) in states.enumerate() {
            let layer = &mut s.layers[slot];
            layer.ssm.copy_from_slice(&ssm[i * n_ssm..(i + 1) * n_ssm]);
            layer.conv.copy_from_slice(&tails[i * n_tail..(i + 1) * n_tail]);
            layer.log_decay.copy_from_slice(&decay[i * n_decay..(i + 1) * n_decay]);
        }
        Ok(())
    }

    /// Writes `layer` as sequence `i`'s state.
    pub(crate) fn write(&self, c: &Mamba2Config, i: usize, layer: &LayerState) -> Result<()> {
        for ((buf, floats), part) in
            self.parts().into_iter().zip(Self::floats(c)).zip([&layer.ssm, &layer.conv, &layer.log_decay])
        {
            buf.write_f32(i * floats, part)?;
        }
        Ok(())
    }

    /// Copies sequence `from`'s state over sequence `to`'s, on the device.
    pub(crate) fn copy_seq(&self, gpu: &dyn Gpu, c: &Mamba2Config, to: usize, from: usize) -> Result<()> {
        for (buf, floats) in self.parts().into_iter().zip(Self::floats(c)) {
            gpu.copy(buf.at(to * floats * 4), buf.at(from * floats * 4), floats * 4)?;
        }
        Ok(())
    }

    /// New buffers with room for `capacity` sequences, the first `n` copied over on the device.
    pub(crate) fn grown(&self, gpu: &Arc<dyn Gpu>, c: &Mamba2Config, n: usize, capacity: usize) -> Result<Self> {
        let [s, t, d] = Self::floats(c);
        let moved = |old: &DeviceBuf, floats: usize| -> Result<DeviceBuf> {
            let buf = DeviceBuf::zeroed(gpu, capacity * floats * 4)?;
            if n > 0 {
                gpu.copy(buf.ptr(), old.ptr(), n * floats * 4)?;
            }
            Ok(buf)
        };
        Ok(Self { ssm: moved(&self.ssm, s)?, tails: moved(&self.tails, t)?, log_decay: moved(&self.log_decay, d)? })
    }
}

/// A mixer pass's own buffers, sized for up to `rows` rows.
#[derive(Debug)]
pub(crate) struct MixerScratch {
    zx: DeviceBuf,
    xbc: DeviceBuf,
    dt: DeviceBuf,
    /// The scan's output; at least as wide as the caller asked (the Mamba-2 engine writes its
    /// final norm's f32 output here too).
    pub(crate) y: DeviceBuf,
    gated: DeviceBuf,
    /// The chunked scan's per-chunk states, when the pass was made for a chunked batch.
    chunks: Option<DeviceBuf>,
}

impl MixerScratch {
    /// Floats of the chunk buffer of `batch`.
    fn chunk_floats(c: &Mamba2Config, batch: &Batch) -> usize {
        batch.seqs() * batch.max_chunks() * c.nheads * c.headdim * c.d_state
    }

    /// Whether these buffers (made for at least `batch.rows` rows) also hold `batch`'s chunks.
    pub(crate) fn fits(&self, c: &Mamba2Config, batch: &Batch) -> bool {
        batch.step_scan() || self.chunks.as_ref().is_some_and(|b| b.bytes() >= 4 * Self::chunk_floats(c, batch))
    }

    /// Buffers for `rows` rows (`y` at least `y_width` floats per row) and `batch`'s chunks.
    pub(crate) fn new(
        gpu: &Arc<dyn Gpu>,
        c: &Mamba2Config,
        dtype: MatrixDtype,
        rows: usize,
        y_width: usize,
        batch: &Batch,
    ) -> Result<Self> {
        let f32s = |n: usize| DeviceBuf::zeroed(gpu, n * 4);
        Ok(Self {
            zx: f32s(rows * c.d_in_proj())?,
            xbc: f32s(rows * c.conv_dim())?,
            dt: f32s(rows * c.nheads)?,
            y: f32s(rows * c.d_inner().max(y_width))?,
            gated: DeviceBuf::zeroed(gpu, rows * c.d_inner() * dtype.size())?,
            chunks: match batch.step_scan() {
                true => None,
                false => Some(f32s(Self::chunk_floats(c, batch))?),
            },
        })
    }
}
