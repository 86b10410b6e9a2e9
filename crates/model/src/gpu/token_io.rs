//! Tokens in and logits out on a GPU, shared by the engines: the embedding table, the final
//! norm and the LM head on the device, and the RMSNorm every block runs.

use std::sync::Arc;

use super::kernels::{launch, ConvertArgs, EmbedArgs, LogprobArgs, RmsnormArgs, ScaleArgs};
use super::plan::{blocks, BLOCK};
use super::{DeviceBuf, DevicePtr, Gemm, Gpu, MatrixDtype};
use crate::error::Result;

/// The embedding, final norm and LM head of a model on a device.
#[derive(Debug)]
pub(crate) struct GpuTokenIo {
    gpu: Arc<dyn Gpu>,
    dtype: MatrixDtype,
    d_model: usize,
    vocab: usize,
    eps: f32,
    /// The embeddings' scale (a hybrid's `embedding_multiplier`), applied after the lookup.
    embed_scale: f32,
    embedding: DeviceBuf,
    lm_head: Option<DeviceBuf>,
    norm_f: DeviceBuf,
}

impl GpuTokenIo {
    /// Uploads the tables (in `dtype`) and the final norm's weight (f32). `lm_head` `None`:
    /// tied to the embedding.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        gpu: &Arc<dyn Gpu>,
        dtype: MatrixDtype,
        (d_model, vocab): (usize, usize),
        eps: f64,
        embed_scale: f32,
        embedding: &[f32],
        lm_head: Option<&[f32]>,
        norm_f: &[f32],
    ) -> Result<Self> {
        let matrix = |v: &[f32]| DeviceBuf::from_bytes(gpu, &dtype.encode(v));
        Ok(Self {
            gpu: gpu.clone(),
            dtype,
            d_model,
            vocab,
            eps: eps as f32,
            embed_scale,
            embedding: matrix(embedding)?,
            lm_head: lm_head.map(matrix).transpose()?,
            norm_f: DeviceBuf::from_f32(gpu, norm_f)?,
        })
    }

    /// Rows of the embedding table for the token ids at `ids` into `out` (rows × d_model, f32).
    pub(crate) fn embed(&self, ids: DevicePtr, out: DevicePtr, rows: usize) -> Result<()> {
        let d = self.d_model;
        let args = EmbedArgs { table: self.embedding.ptr(), ids, out, d: d as i32, table_bf16: self.dtype.flag() };
        launch(&*self.gpu, "embed", [rows as u32, 1, 1], [BLOCK, 1, 1], &args)?;
        if self.embed_scale != 1.0 {
            let args = ScaleArgs { x: out, n: (rows * d) as i64, s: self.embed_scale, pad: 0 };
            launch(&*self.gpu, "scale", [blocks(rows * d), 1, 1], [BLOCK, 1, 1], &args)?;
        }
        Ok(())
    }

    /// `out = rmsnorm(x)·w` of `rows` rows of d_model, `out` in the matrix type (`out_matrix`,
    /// for a product to read) or f32.
    pub(crate) fn rmsnorm(
        &self,
        x: DevicePtr,
        w: DevicePtr,
        out: DevicePtr,
        rows: usize,
        out_matrix: bool,
    ) -> Result<()> {
        let out_bf16 = if out_matrix { self.dtype.flag() } else { 0 };
        let args = RmsnormArgs { x, w, out, d: self.d_model as i32, out_bf16, eps: self.eps, pad: 0 };
        launch(&*self.gpu, "rmsnorm", [rows as u32, 1, 1], [BLOCK, 1, 1], &args)
    }

    /// The final norm of the residual stream `h`.
    pub(crate) fn final_norm(&self, h: DevicePtr, out: DevicePtr, rows: usize, out_matrix: bool) -> Result<()> {
        self.rmsnorm(h, self.norm_f.ptr(), out, rows, out_matrix)
    }

    /// Logits (rows × vocab) of final hidden rows.
    pub(crate) fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        self.logits_on_device(hidden)?.to_f32()
    }

    /// `log p(targets[i] | hidden row i)`: only one float per row crosses back.
    pub(crate) fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Result<Vec<f32>> {
        let rows = targets.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let logits = self.logits_on_device(hidden)?;
        let ids: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
        let targets = DeviceBuf::from_i32(&self.gpu, &ids)?;
        let out = DeviceBuf::zeroed(&self.gpu, rows * 4)?;
        let args = LogprobArgs {
            logits: logits.ptr(),
            targets: targets.ptr(),
            out: out.ptr(),
            vocab: self.vocab as i32,
            pad: 0,
        };
        launch(&*self.gpu, "logprob_at", [rows.max(1) as u32, 1, 1], [BLOCK, 1, 1], &args)?;
        out.read_f32(0, rows)
    }

    fn logits_on_device(&self, hidden: &[f32]) -> Result<DeviceBuf> {
        let rows = hidden.len() / self.d_model;
        let h = DeviceBuf::from_f32(&self.gpu, hidden)?;
        let a = DeviceBuf::zeroed(&self.gpu, hidden.len() * self.dtype.size())?;
        let convert =
            ConvertArgs { x: h.ptr(), out: a.ptr(), n: hidden.len() as i64, out_bf16: self.dtype.flag(), pad: 0 };
        launch(&*self.gpu, "convert", [blocks(hidden.len()), 1, 1], [BLOCK, 1, 1], &convert)?;
        self.lm_head(a.ptr(), rows)
    }

    /// Logits (rows × vocab, f32) of final-normed rows `a` stored in the matrices' type.
    pub(crate) fn lm_head(&self, a: DevicePtr, rows: usize) -> Result<DeviceBuf> {
        let logits = DeviceBuf::zeroed(&self.gpu, rows * self.vocab * 4)?;
        self.lm_head_into(a, rows, logits.ptr())?;
        Ok(logits)
    }

    /// [`GpuTokenIo::lm_head`] into `out` (at least rows × vocab f32).
    pub(crate) fn lm_head_into(&self, a: DevicePtr, rows: usize, out: DevicePtr) -> Result<()> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embedding);
        self.gpu.gemm(&Gemm {
            dtype: self.dtype,
            rows,
            n: self.vocab,
            k: self.d_model,
            a,
            w: head.ptr(),
            out,
            accumulate: false,
            alpha: 1.0,
        })
    }

    /// Into `out` (rows × vocab, f32) the logits of the residual stream `h`, finally normed
    /// into `xn` (rows × d_model in the matrix type) on the way; the logits come back.
    pub(crate) fn logits_of_stream(
        &self,
        h: DevicePtr,
        xn: DevicePtr,
        rows: usize,
        out: &DeviceBuf,
    ) -> Result<Vec<f32>> {
        let n = rows * self.vocab;
        self.final_norm(h, xn, rows, true)?;
        if out.bytes() >= 4 * n {
            self.lm_head_into(xn, rows, out.ptr())?;
            out.read_f32(0, n)
        } else {
            self.lm_head(xn, rows)?.read_f32(0, n)
        }
    }
}
