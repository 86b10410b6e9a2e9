//! [`Net`]: what fine-tuning needs of a trainable model — a differentiable forward from any
//! batch of states, its parameters, and its weights saved as a model folder. A pure Mamba-2
//! ([`crate::TrainMamba2`]) and a Granite 4.0 H hybrid ([`crate::TrainGraniteHybrid`]) are both.

use std::path::Path;

use candle_core::{DType, Device, Tensor, Var, D};

use crate::{Result, TrainState};

/// A trainable language model whose forward starts from and returns a [`TrainState`].
pub trait Net: Sized {
    /// The architecture's config (kept in fine-tuning checkpoints).
    type Config: Clone + PartialEq + std::fmt::Debug + serde::Serialize + serde::de::DeserializeOwned;
    /// Its weights on the host.
    type Weights;

    /// Parameters initialised from `weights` in `dtype` on `device`.
    fn build(config: &Self::Config, weights: &Self::Weights, dtype: DType, device: &Device) -> Result<Self>;
    /// Reads the weights of a model folder.
    fn load_weights(dir: &Path, config: &Self::Config) -> Result<Self::Weights>;
    /// Writes `config.json` and `model.safetensors` of `weights` into `dir`.
    fn save_weights(weights: &Self::Weights, config: &Self::Config, dir: &Path) -> Result<()>;
    /// The fingerprint the inference engines give these weights.
    fn fingerprint(weights: &Self::Weights, config: &Self::Config) -> String;
    /// Sets the Mamba scan's chunk length (any length gives the same result up to rounding).
    fn with_chunk(self, chunk: usize) -> Self;
    /// The dtype of parameters and activations.
    fn dtype(&self) -> DType;
    /// The device.
    fn device(&self) -> &Device;
    /// Every parameter, in a fixed order (for optimisers and checkpoints).
    fn vars(&self) -> Vec<Var>;
    /// Writes `config.json` and `model.safetensors` of the current parameters into `dir`.
    fn save_pretrained(&self, dir: &Path) -> Result<()>;
    /// The LM head (the embedding when tied).
    fn head(&self) -> &Var;

    /// Runs `tokens` (B, T) from `init` (the zero state if `None`): the hidden states ready for
    /// the LM head (B, T, d_model) and the state after the last token. Positions whose `mask`
    /// (B, T) is 0 leave the state untouched: their Mamba input and dt are zeroed and their
    /// keys are masked. With left padding from the zero state this gives each row exactly the
    /// state of its own tokens.
    fn forward_hidden_masked(
        &self,
        tokens: &Tensor,
        init: Option<&TrainState>,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, TrainState)>;

    /// Next-token logits (B, T, vocab) and the final state.
    fn forward(&self, tokens: &Tensor, init: Option<&TrainState>) -> Result<(Tensor, TrainState)> {
        let (hidden, state) = self.forward_hidden_masked(tokens, init, None)?;
        let (b, t, d) = hidden.dims3()?;
        let logits = hidden.reshape((b * t, d))?.matmul(&self.head().as_tensor().t()?)?;
        Ok((logits.reshape((b, t, ()))?, state))
    }

    /// Mean cross-entropy of `targets` (B·T, row-major) under the logits of `tokens` (B, T)
    /// from `init`; positions whose target is [`crate::xent::IGNORE`] do not count.
    fn loss(&self, tokens: &Tensor, targets: &[u32], init: Option<&TrainState>) -> Result<(Tensor, TrainState)> {
        let (logits, state) = self.forward(tokens, init)?;
        let v = logits.dim(D::Minus1)?;
        Ok((crate::xent::cross_entropy(&logits.reshape(((), v))?, targets)?, state))
    }

    /// The state after each token list, from the zero state, as one batch (row i = list i).
    /// Lists are processed in groups of `group` similar lengths, left-padded and masked, so
    /// padding costs little and changes nothing.
    fn context_states(&self, lists: &[&[u32]], group: usize) -> Result<TrainState> {
        if lists.is_empty() || lists.iter().any(|l| l.is_empty()) {
            candle_core::bail!("context_states: every context needs at least one token");
        }
        let mut by_len: Vec<usize> = (0..lists.len()).collect();
        by_len.sort_by_key(|&i| lists[i].len());
        let mut parts: Vec<TrainState> = Vec::new();
        for rows in by_len.chunks(group.max(1)) {
            let t = rows.iter().map(|&i| lists[i].len()).max().expect("non-empty chunk");
            let (mut toks, mut mask) = (Vec::with_capacity(rows.len() * t), Vec::with_capacity(rows.len() * t));
            for &i in rows {
                let pad = t - lists[i].len();
                toks.extend(std::iter::repeat_n(0u32, pad).chain(lists[i].iter().copied()));
                mask.extend(std::iter::repeat_n(0f32, pad).chain(std::iter::repeat_n(1f32, lists[i].len())));
            }
            let toks = Tensor::from_vec(toks, (rows.len(), t), self.device())?;
            let mask = Tensor::from_vec(mask, (rows.len(), t), self.device())?;
            parts.push(self.forward_hidden_masked(&toks, None, Some(&mask))?.1);
        }
        // Back to the callers' order.
        let mut position = vec![0u32; lists.len()];
        for (sorted, &i) in by_len.iter().enumerate() {
            position[i] = sorted as u32;
        }
        TrainState::cat_select(&parts, &Tensor::from_vec(position, lists.len(), self.device())?)
    }

    /// Inference states (one per row) as a batch on this model's device and dtype.
    fn stack_states(&self, states: &[&picaso_model::State]) -> Result<TrainState> {
        TrainState::from_states(states, self.dtype(), self.device())
    }
}
