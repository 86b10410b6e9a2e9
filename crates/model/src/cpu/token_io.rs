//! What every model shares around its layers: the token embedding, the final RMSNorm and the
//! LM head (tied to the embedding or not), with scoring that never holds all logits at once.

use rayon::prelude::*;

use super::matmul::{self, Matrix};
use super::rows::{rows_par, Rows};
use super::{norm, on_pool, softmax, WeightDtype};

/// What every Mamba shares around its blocks: the token embedding, the final RMSNorm and the
/// LM head (tied to the embedding or not).
#[derive(Debug)]
pub(crate) struct TokenIo {
    embedding: Matrix,
    /// Untied LM head; `None` uses the embedding.
    lm_head: Option<Matrix>,
    norm_f: Vec<f32>,
    norm_eps: f32,
    pub(crate) d_model: usize,
    vocab: usize,
}

impl TokenIo {
    /// Stores the large matrices in `dtype`.
    pub(crate) fn new(
        embedding: Vec<f32>,
        lm_head: Option<Vec<f32>>,
        norm_f: Vec<f32>,
        norm_eps: f64,
        vocab: usize,
        dtype: WeightDtype,
    ) -> Self {
        let d_model = norm_f.len();
        Self {
            embedding: Matrix::new(embedding, d_model, dtype),
            lm_head: lm_head.map(|m| Matrix::new(m, d_model, dtype)),
            norm_f,
            norm_eps: norm_eps as f32,
            d_model,
            vocab,
        }
    }

    /// Embedding rows of `tokens` (T × d_model).
    pub(crate) fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        let d = self.d_model;
        let mut h = vec![0.0f32; tokens.len() * d];
        for (row, &tok) in h.chunks_exact_mut(d).zip(tokens) {
            self.embedding.row_into(tok as usize, row);
        }
        h
    }

    /// The final RMSNorm of every row.
    pub(crate) fn final_norm(&self, h: &[f32]) -> Vec<f32> {
        let d = self.d_model;
        let mut out = vec![0.0f32; h.len()];
        rows_par(h, &mut out, d, d, |x, o| norm::rmsnorm(x, &self.norm_f, self.norm_eps, o));
        out
    }

    /// The LM head matrix (vocab × d_model).
    fn head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embedding)
    }

    /// Logits (rows × vocab) of `rows` final hidden states. `Rows::Independent` computes
    /// each row exactly as it would be alone (a batch of decode steps).
    pub(crate) fn logits(&self, hidden: &[f32], kind: Rows) -> Vec<f32> {
        let (d, v) = (self.d_model, self.vocab);
        let rows = hidden.len() / d;
        let mut out = vec![0.0f32; rows * v];
        on_pool(|| kind.matmul_t(hidden, rows, d, self.head(), v, &mut out, false));
        out
    }

    /// log p(targets[i] | hidden row i) for each row, computed in blocks so the full
    /// (T × vocab) logits never exist at once.
    pub(crate) fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        on_pool(|| self.logprobs_on_pool(hidden, targets))
    }

    fn logprobs_on_pool(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        let (d, v) = (self.d_model, self.vocab);
        const BLOCK: usize = 128;
        let mut out = Vec::with_capacity(targets.len());
        let mut logits = vec![0.0f32; BLOCK * v];
        for (hb, tb) in hidden.chunks(BLOCK * d).zip(targets.chunks(BLOCK)) {
            let rows = tb.len();
            let lg = &mut logits[..rows * v];
            matmul::matmul_t(&hb[..rows * d], rows, d, self.head(), v, lg, false);
            let block: Vec<f32> = lg
                .par_chunks(v)
                .zip(tb.par_iter())
                .map(|(row, &tg)| softmax::log_softmax_at(row, tg as usize))
                .collect();
            out.extend(block);
        }
        out
    }
}
