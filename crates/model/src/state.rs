//! The state of a Mamba model after some tokens: a plain value that can be saved, loaded,
//! composed and continued from exactly.
//!
//! Per layer of a Mamba-2 model (H heads, P = headdim, N = d_state, C = conv_dim, K = d_conv):
//! * `ssm` (H, P, N): the SSM state h.
//! * `conv` (C, K-1): the last K-1 pre-convolution xBC inputs, oldest first (zeros before the
//!   first token), so a continuation convolves exactly as if it had seen the whole prefix.
//! * `log_decay` (H): Σ_t dt_t·A_h over the processed tokens = log of the total decay A(u) that
//!   the composition methods need (CASO weights are products of these decays).
//!
//! A Mamba-1 layer (D = d_inner) decays every state element at its own rate: `ssm` (D, N),
//! `conv` (D, K-1) of the pre-convolution x inputs, and `log_decay` (D, N) = Σ_t dt_{t,d}·A_{d,n}.
//! Either way each log-decay entry covers a contiguous block of `ssm` (P·N values for Mamba-2,
//! one for Mamba-1), which is all composition needs to know.
//!
//! A hybrid model (attention layers among Mamba-2 layers, e.g. Granite 4.0 H, or among Mamba-1
//! layers, Jamba, or beside them in
//! every layer, Falcon-H1) adds, per layer that attends, its keys and values: (kv_heads, T,
//! head_dim) each on disk, token-major (T, kv_heads, head_dim) in memory so that tokens append
//! and contexts concatenate ([`KvState`]).
//!
//! On disk a state is one safetensors file with tensors `layers.{i}.ssm|conv|log_decay` (and
//! `layers.{i}.k|v` for a layer that attends; `i` is the model's own layer index, counting every
//! layer) and the model fingerprint, token count and a checksum in the metadata; a hybrid's
//! metadata also lists its `layer_types` (`mamba`, `attention`, or `hybrid` for both) and the
//! `position` its next token takes. The checksum (xxh3-128) covers
//! every byte of the file but its own 32 hex digits, which are zeros while hashing: a file
//! damaged after it was written — tensors, metadata or layout — is refused, not silently used.
//! Older files are still read: `picaso-state/2` (checksum of the tensor bytes only) and
//! `picaso-state/1` (no checksum); a file tagged `/1` that carries a checksum is a damaged newer
//! file and is refused. `ssm` and `conv` may be stored as bf16 to halve the size; `log_decay` is
//! always f32 because composition weights are exponentials of it.
//!
//! An int8 or int4 state (metadata `codec`) stores `ssm`, `conv`, `k` and `v` each as groups of
//! 32 values: `layers.{i}.ssm` is I8 (groups, 32) or U8 (groups, 16) and
//! `layers.{i}.ssm.scales` BF16 (groups), one scale per group ([`picaso_compose::codec`]). The
//! tensors' own shapes are in the metadata (`ssm_shape`, `conv_shape`, `kv_shape`), and every
//! log-decay comes first, so the f32 tensors lie 8-byte aligned and are read in place. The
//! checksum covers the scales as it covers every byte. Such a state is read where it lies:
//! composition dequantizes inside its sums ([`MappedState`], [`StateView`]).

use std::path::Path;

use safetensors::{Dtype, SafeTensors};

use crate::error::{Error, Result};
use crate::mamba2::Mamba2Config;
use crate::memory::big_vec;
use picaso_compose::codec::GROUP;
use picaso_compose::{Codec, Values};

/// Format tag written into every state file's metadata.
pub const STATE_FORMAT: &str = "picaso-state/3";
/// The second format, whose checksum covers only the tensor bytes: read, never written.
const STATE_FORMAT_V2: &str = "picaso-state/2";
/// The first format, without a checksum: read, never written.
const STATE_FORMAT_V1: &str = "picaso-state/1";

/// xxh3-128 as 32 hex digits.
fn checksum(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// What the checksum's digits are while the file is hashed.
const CHECKSUM_PLACEHOLDER: &str = "00000000000000000000000000000000";

/// Where the checksum's 32 hex digits sit in a file's header; None unless the key occurs
/// exactly once (JSON escapes quotes inside values, so the key cannot hide in a string).
fn checksum_digits(bytes: &[u8], header_end: usize) -> Option<std::ops::Range<usize>> {
    const KEY: &[u8] = b"\"checksum\":\"";
    let header = &bytes[8..header_end];
    let mut hits = header.windows(KEY.len()).enumerate().filter(|(_, w)| *w == KEY).map(|(i, _)| i);
    let first = hits.next()?;
    if hits.next().is_some() {
        return None;
    }
    let start = 8 + first + KEY.len();
    let end = start + CHECKSUM_PLACEHOLDER.len();
    (end < header_end && bytes[end] == b'"').then_some(start..end)
}

/// How a state file stores `ssm`, `conv` and a hybrid's keys and values: f32, bf16, or int8 /
/// int4 with a bf16 scale per group of 32 values ([`picaso_compose::codec`]). Log-decays are
/// always f32 (composition weights are exponentials of them).
pub type StateDtype = picaso_compose::Codec;

/// The model family a state belongs to; decides the ranks of its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Mamba-1: a decay per (channel, state) element.
    Mamba1,
    /// Mamba-2: a decay per head.
    Mamba2,
}

impl Arch {
    /// The name written into state files and configs.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Mamba1 => "mamba1",
            Arch::Mamba2 => "mamba2",
        }
    }

    /// Ranks of (ssm, conv, log_decay).
    fn ranks(self) -> [usize; 3] {
        match self {
            Arch::Mamba1 => [2, 2, 2],
            Arch::Mamba2 => [3, 2, 1],
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Shapes of one layer's state tensors, derived from the config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateShape {
    /// The model family.
    pub arch: Arch,
    /// Number of layers.
    pub n_layer: usize,
    /// Mamba-2 (H, P, N); Mamba-1 (D, N).
    pub ssm: Vec<usize>,
    /// (C, K-1).
    pub conv: Vec<usize>,
    /// Mamba-2 (H); Mamba-1 (D, N).
    pub log_decay: Vec<usize>,
    /// A hybrid model's layout: which layers hold keys and values, which SSM states; `None` for
    /// a pure SSM model. With it `n_layer` counts the SSM states only, and a state's `layers[j]`
    /// is the j-th layer with one in model order.
    pub attention: Option<AttentionShape>,
}

/// Where a hybrid model's attention and SSM layers are and how large their keys and values are.
/// A layer holds an SSM state, keys and values, or both (Falcon-H1 runs a Mamba mixer and
/// attention side by side in every layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionShape {
    /// The model's own index of each layer with keys and values, ascending.
    pub layers: Vec<usize>,
    /// The model's own index of each layer with an SSM state, ascending.
    pub ssm: Vec<usize>,
    /// Layers of the model.
    pub n_layers: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: usize,
}

impl AttentionShape {
    /// Floats per token of one layer's keys (or values).
    pub fn token_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// (holds an SSM state, holds keys and values) per layer of the model, in one pass over
    /// the lists (indices past the last layer are left out; [`StateShape::check`] refuses them).
    pub fn kinds(&self) -> Vec<(bool, bool)> {
        let mut kinds = vec![(false, false); self.n_layers];
        for &i in &self.ssm {
            if let Some(k) = kinds.get_mut(i) {
                k.0 = true;
            }
        }
        for &i in &self.layers {
            if let Some(k) = kinds.get_mut(i) {
                k.1 = true;
            }
        }
        kinds
    }
    /// The name of each layer's kind as written in a state's metadata: `mamba`, `attention`,
    /// or `hybrid` for both side by side (transformers' name for a Falcon-H1 layer).
    pub fn layer_types(&self) -> Vec<&'static str> {
        self.kinds()
            .into_iter()
            .map(|kind| match kind {
                (true, true) => "hybrid",
                (false, true) => "attention",
                _ => "mamba",
            })
            .collect()
    }
}

impl StateShape {
    /// The state shape of a Mamba-2 config.
    pub fn of(c: &Mamba2Config) -> Self {
        Self {
            arch: Arch::Mamba2,
            n_layer: c.n_layer,
            ssm: vec![c.nheads, c.headdim, c.d_state],
            conv: vec![c.conv_dim(), c.d_conv - 1],
            log_decay: vec![c.nheads],
            attention: None,
        }
    }
    /// The state shape of a Mamba-1 config.
    pub fn mamba1(c: &crate::mamba1::Mamba1Config) -> Self {
        Self {
            arch: Arch::Mamba1,
            n_layer: c.n_layer,
            ssm: vec![c.d_inner(), c.d_state],
            conv: vec![c.d_inner(), c.d_conv - 1],
            log_decay: vec![c.d_inner(), c.d_state],
            attention: None,
        }
    }
    /// The model's own index of each SSM layer (`layers[j]` of a state is layer `ssm_layers()[j]`).
    pub fn ssm_layers(&self) -> Vec<usize> {
        match &self.attention {
            Some(a) => a.ssm.clone(),
            None => (0..self.n_layer).collect(),
        }
    }
    /// The attention layers' model indices (none for a pure SSM model).
    pub fn attention_layers(&self) -> &[usize] {
        self.attention.as_ref().map_or(&[], |a| &a.layers)
    }
    /// Values of one layer's SSM state.
    pub fn ssm_len(&self) -> usize {
        self.ssm.iter().product()
    }
    /// Values of one layer's conv tail.
    pub fn conv_len(&self) -> usize {
        self.conv.iter().product()
    }
    /// Values of one layer's log-decay.
    pub fn log_decay_len(&self) -> usize {
        self.log_decay.iter().product()
    }

    /// Bytes of the tensors of a state after `tokens` context tokens, in `codec` (scales
    /// included, the header left out): SSM states do not grow with the context, a hybrid's keys
    /// and values do.
    pub fn nbytes(&self, codec: StateDtype, tokens: usize) -> usize {
        let ssm = codec.bytes(self.ssm_len()) + codec.bytes(self.conv_len()) + 4 * self.log_decay_len();
        let kv = self.attention.as_ref().map_or(0, |a| a.layers.len() * 2 * codec.bytes(a.token_len() * tokens));
        self.n_layer * ssm + kv
    }

    /// Whether the three tensors fit together as `arch`'s state: their ranks, one log-decay per
    /// head (Mamba-2) or per value (Mamba-1), and no empty axis. A state built from arrays
    /// that miss this would compose with decays applied to the wrong values.
    pub fn check(&self) -> Result<()> {
        let (ssm, conv, log_decay) = (&self.ssm, &self.conv, &self.log_decay);
        if [ssm.len(), conv.len(), log_decay.len()] != self.arch.ranks() {
            return Err(Error::state(match self.arch {
                Arch::Mamba2 => "tensor ranks are not ssm (H,P,N), conv (C,K-1), log_decay (H) of a mamba2 state",
                Arch::Mamba1 => "tensor ranks are not ssm (D,N), conv (D,K-1), log_decay (D,N) of a mamba1 state",
            }));
        }
        let blocks_fit = match self.arch {
            Arch::Mamba2 => log_decay[0] == ssm[0],
            Arch::Mamba1 => log_decay == ssm && conv[0] == ssm[0],
        };
        if !blocks_fit {
            return Err(Error::state(format!(
                "log_decay shape {log_decay:?} and conv shape {conv:?} do not fit ssm shape {ssm:?} of a {} state",
                self.arch
            )));
        }
        // (A conv tail of d_conv = 1 keeps no inputs: conv's second axis may be empty.)
        if ssm.contains(&0) || conv[0] == 0 || self.n_layer == 0 {
            return Err(Error::state(format!(
                "an empty axis: ssm {ssm:?}, conv {conv:?}, {} layers; every axis but the conv tail's needs at least one value",
                self.n_layer
            )));
        }
        if let Some(a) = &self.attention {
            let fits = |l: &[usize]| l.windows(2).all(|w| w[0] < w[1]) && l.last().is_none_or(|&i| i < a.n_layers);
            let covered = a.kinds().iter().all(|&(ssm, kv)| ssm || kv);
            if !fits(&a.layers) || !fits(&a.ssm) || !covered || a.ssm.len() != self.n_layer {
                return Err(Error::state(format!(
                    "attention layers {:?} and SSM layers {:?} ({} counted) do not make a model of {} layers",
                    a.layers, a.ssm, self.n_layer, a.n_layers
                )));
            }
            if a.kv_heads == 0 || a.head_dim == 0 {
                return Err(Error::state("attention keys and values need at least one head of one channel"));
            }
        }
        Ok(())
    }
}

/// One layer's state. Lengths follow [`StateShape`]; `S` stores the SSM values (see [`State`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerState<S = f32> {
    /// SSM state, (H, P, N) row-major.
    pub ssm: Vec<S>,
    /// Conv tail, (C, K-1) row-major, oldest input first.
    pub conv: Vec<f32>,
    /// Log of the accumulated decay per head, (H).
    pub log_decay: Vec<f32>,
}

/// The keys and values one attention layer holds: token-major (T, kv_heads, head_dim) rows, so
/// new tokens append and the union of contexts is their concatenation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvState {
    /// Keys, (T, kv_heads, head_dim) row-major (RoPE, if any, already applied).
    pub keys: Vec<f32>,
    /// Values, (T, kv_heads, head_dim) row-major.
    pub values: Vec<f32>,
}

impl KvState {
    /// Tokens held, for rows of `token_len` floats.
    pub fn tokens(&self, token_len: usize) -> usize {
        self.keys.len() / token_len.max(1)
    }
}

/// The state of a model after a token sequence (or a composition of such states).
///
/// `S` is how the SSM values are held: f32 (exact; what every operation takes) or, while a
/// server decodes many sequences at once, [`half::f16`] (half the bytes per step; see
/// [`SsmValue`]). The conv tail and the log-decays are f32 either way.
#[derive(Debug, Clone, PartialEq)]
pub struct State<S = f32> {
    /// Fingerprint of the model that made it; a state only continues on that model.
    pub fingerprint: String,
    /// Tokens it summarises (for a composed state, the sum over its parts).
    pub n_tokens: u64,
    /// Tensor shapes.
    pub shape: StateShape,
    /// One entry per SSM layer.
    pub layers: Vec<LayerState<S>>,
    /// One entry per attention layer of a hybrid model (empty for a pure SSM model).
    pub attention: Vec<KvState>,
    /// The position the next token takes (RoPE): the tokens seen, or for a composed state the
    /// longest part's, since each context was encoded from position 0.
    pub position: u64,
}

impl<S> State<S> {
    /// Counts `t` more tokens: the tokens summarised and the position the next one takes.
    pub(crate) fn advance(&mut self, t: usize) {
        self.n_tokens = self.n_tokens.saturating_add(t as u64);
        self.position = self.position.saturating_add(t as u64);
    }

    /// Checks that this state belongs to the model with `fingerprint` and has `shape`.
    /// Values are checked where states enter from outside ([`State::load`], composition), not
    /// here: this runs before every decoded token.
    pub fn check_compatible(&self, fingerprint: &str, shape: &StateShape) -> Result<()> {
        if self.fingerprint != fingerprint {
            return Err(Error::state(format!(
                "made by another model (fingerprint {}, this model is {fingerprint}); recompute the state with this model",
                self.fingerprint
            )));
        }
        if &self.shape != shape {
            return Err(Error::state(format!("has shape {:?}, this model needs {shape:?}", self.shape)));
        }
        let sizes_ok = self.layers.len() == shape.n_layer
            && self.layers.iter().all(|l| {
                l.ssm.len() == shape.ssm_len()
                    && l.conv.len() == shape.conv_len()
                    && l.log_decay.len() == shape.log_decay_len()
            });
        let kv_ok = match &shape.attention {
            None => self.attention.is_empty(),
            Some(a) => {
                self.attention.len() == a.layers.len()
                    && self
                        .attention
                        .iter()
                        .all(|kv| kv.keys.len() == kv.values.len() && kv.keys.len().is_multiple_of(a.token_len()))
            }
        };
        if !sizes_ok || !kv_ok {
            return Err(Error::state("tensor sizes do not match the declared shape"));
        }
        Ok(())
    }

    /// The same state with its SSM values mapped by `f`.
    fn map_ssm<T>(&self, f: impl Fn(&[S], &mut [T])) -> State<T>
    where
        T: Clone + Default,
    {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mut ssm = vec![T::default(); l.ssm.len()];
                f(&l.ssm, &mut ssm);
                LayerState { ssm, conv: l.conv.clone(), log_decay: l.log_decay.clone() }
            })
            .collect();
        State {
            fingerprint: self.fingerprint.clone(),
            n_tokens: self.n_tokens,
            shape: self.shape.clone(),
            layers,
            attention: self.attention.clone(),
            position: self.position,
        }
    }
}

impl State<half::f16> {
    /// The f32 state (exact: every f16 is an f32).
    pub fn to_f32(&self) -> State {
        self.map_ssm(crate::cpu::scan::f16::widen)
    }
}

/// How a state's SSM values are held while a model advances it ([`crate::Model::step_batch`]).
///
/// * `f32`: exact; every engine.
/// * [`half::f16`]: half the bytes, for decoding many sequences at once on the CPU engine of a
///   Mamba-2 model ([`crate::Model::runs_f16_states`]), where reading and writing the states is
///   most of a step's memory traffic. The arithmetic stays f32; the values are rounded to f16
///   after every step, so log-probs drift slowly from the f32 ones (measured in BENCHMARKS.md),
///   and a value beyond ±65,504 becomes infinite (the next logits are then not finite).
pub trait SsmValue: Copy + Default + Send + Sync + std::fmt::Debug + PartialEq + 'static {
    /// The selective scan of one head ([`crate::cpu::scan::scan_head`]) on values held as `Self`.
    fn scan_head(s: &mut [Self], head: &crate::cpu::scan::ScanInputs, y: &mut [f32]);
    /// `states`, if they hold f32 (what the engines other than the CPU Mamba-2 one take).
    fn as_f32<'a, 'b>(states: &'a mut [&'b mut State<Self>]) -> Option<&'a mut [&'b mut State]>;
    /// `states`, if they hold f16.
    fn as_f16<'a, 'b>(states: &'a mut [&'b mut State<Self>]) -> Option<&'a mut [&'b mut State<half::f16>]>;
}

impl SsmValue for f32 {
    fn scan_head(s: &mut [f32], head: &crate::cpu::scan::ScanInputs, y: &mut [f32]) {
        crate::cpu::scan::scan_head(s, head, y);
    }
    fn as_f32<'a, 'b>(states: &'a mut [&'b mut State]) -> Option<&'a mut [&'b mut State]> {
        Some(states)
    }
    fn as_f16<'a, 'b>(_: &'a mut [&'b mut State]) -> Option<&'a mut [&'b mut State<half::f16>]> {
        None
    }
}

impl SsmValue for half::f16 {
    fn scan_head(s: &mut [half::f16], head: &crate::cpu::scan::ScanInputs, y: &mut [f32]) {
        crate::cpu::scan::f16::scan_head_f16(s, head, y);
    }
    fn as_f32<'a, 'b>(_: &'a mut [&'b mut State<half::f16>]) -> Option<&'a mut [&'b mut State]> {
        None
    }
    fn as_f16<'a, 'b>(states: &'a mut [&'b mut State<half::f16>]) -> Option<&'a mut [&'b mut State<half::f16>]> {
        Some(states)
    }
}

impl State {
    /// This state with its SSM values rounded to f16 (to nearest): what decoding with f16
    /// states ([`SsmValue`]) starts from.
    pub fn to_f16(&self) -> State<half::f16> {
        self.map_ssm(crate::cpu::scan::f16::narrow)
    }

    /// The state before any token: all zeros.
    pub fn zeros(shape: StateShape, fingerprint: impl Into<String>) -> Self {
        // Zeros written, not `vec![0.0; n]`: that is calloc, whose fresh pages map the shared
        // zero page until written. The scan reads a state before writing it, so each page then
        // faulted twice, and the second fault (copy-on-write) flushed the page from the other
        // cores' TLBs by interrupt: ~36 ms per mamba2-130m state, a third of a server's prefill
        // pass (perf, 16 clients). Written once, a page faults once.
        let zeros = |n| big_vec(n, 0.0f32);
        let layers = (0..shape.n_layer)
            .map(|_| LayerState {
                ssm: zeros(shape.ssm_len()),
                conv: zeros(shape.conv_len()),
                log_decay: zeros(shape.log_decay_len()),
            })
            .collect();
        let attention = vec![KvState::default(); shape.attention_layers().len()];
        Self { fingerprint: fingerprint.into(), n_tokens: 0, layers, attention, position: 0, shape }
    }

    /// Bytes of the state in f32 (keys and values included).
    pub fn nbytes_f32(&self) -> usize {
        let kv: usize = self.attention.iter().map(|a| a.keys.len() + a.values.len()).sum();
        4 * (self.shape.n_layer * (self.shape.ssm_len() + self.shape.conv_len() + self.shape.log_decay_len()) + kv)
    }

    /// Rejects NaN or infinite values (a corrupted or diverged state must not propagate).
    pub fn check_values(&self) -> Result<()> {
        self.view().check_values()
    }

    /// The state's tensors, borrowed.
    pub fn view(&self) -> StateView<'_> {
        let (heads, head_dim) = self.shape.attention.as_ref().map_or((0, 0), |a| (a.kv_heads, a.head_dim));
        StateView {
            fingerprint: &self.fingerprint,
            n_tokens: self.n_tokens,
            shape: &self.shape,
            layers: self
                .layers
                .iter()
                .map(|l| LayerView { ssm: Values::F32(&l.ssm), conv: Values::F32(&l.conv), log_decay: &l.log_decay })
                .collect(),
            attention: self
                .attention
                .iter()
                .map(|a| KvView {
                    keys: Values::F32(&a.keys),
                    values: Values::F32(&a.values),
                    heads,
                    head_dim,
                    head_major: false,
                })
                .collect(),
            position: self.position,
        }
    }

    /// Serialises to safetensors bytes. The bytes are a pure function of the state: the
    /// header lists metadata keys sorted and tensors in layer order, so equal states have equal
    /// files (the store names state files by their hash).
    pub fn to_bytes(&self, dtype: StateDtype) -> Result<Vec<u8>> {
        let kv_shapes: Vec<[usize; 3]> = match &self.shape.attention {
            Some(a) => self.attention.iter().map(|kv| [a.kv_heads, kv.tokens(a.token_len()), a.head_dim]).collect(),
            None => Vec::new(),
        };
        // Tensors in the model's layer order (a pure SSM model's: layers 0.. of the state), a
        // layer's SSM tensors before its keys and values.
        let kinds = match &self.shape.attention {
            Some(a) => a.kinds(),
            None => vec![(true, false); self.layers.len()],
        };
        // Per layer of the model: its index, its SSM state, its keys and values with their shape.
        type Layer<'s> = (usize, Option<&'s LayerState>, Option<(&'s KvState, &'s [usize; 3])>);
        let mut per_layer: Vec<Layer<'_>> = Vec::new();
        let (mut ssm, mut attention) = (self.layers.iter(), self.attention.iter().zip(&kv_shapes));
        for (i, &(has_ssm, attends)) in kinds.iter().enumerate() {
            let l = match has_ssm {
                true => Some(ssm.next().ok_or_else(|| {
                    Error::state(format!("layer {i} is an SSM layer, but the state holds no SSM state for it"))
                })?),
                false => None,
            };
            let kv = match attends {
                true => Some(attention.next().ok_or_else(|| {
                    Error::state(format!("layer {i} attends, but the state holds no keys and values for it"))
                })?),
                false => None,
            };
            per_layer.push((i, l, kv));
        }
        if ssm.next().is_some() || attention.next().is_some() {
            return Err(Error::state("the state holds more layers than its shape lists"));
        }
        let mut tensors: Vec<(String, &'static str, Vec<usize>, Vec<u8>)> = Vec::new();
        let mut metadata = vec![
            ("arch", self.shape.arch.name().to_string()),
            ("checksum", CHECKSUM_PLACEHOLDER.to_string()),
            ("fingerprint", self.fingerprint.clone()),
            ("format", STATE_FORMAT.to_string()),
            ("n_tokens", self.n_tokens.to_string()),
        ];
        if let Some(a) = &self.shape.attention {
            metadata.push(("layer_types", a.layer_types().join(",")));
            metadata.push(("position", self.position.to_string()));
        }
        let f32s = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        if dtype.is_quantized() {
            // Log-decays first: every f32 tensor then starts 8-byte aligned, for in-place reads.
            for &(i, l, _) in &per_layer {
                if let Some(l) = l {
                    tensors.push((
                        format!("layers.{i}.log_decay"),
                        "F32",
                        self.shape.log_decay.clone(),
                        f32s(&l.log_decay),
                    ));
                }
            }
            let (dt, per) = if dtype == StateDtype::Int8 { ("I8", GROUP) } else { ("U8", GROUP / 2) };
            let mut push = |name: String, v: &[f32]| -> Result<()> {
                let e = picaso_compose::codec::encode(v, dtype)
                    .map_err(|j| Error::state(format!("{name} holds a non-finite value at flat index {j}")))?;
                let groups = v.len().div_ceil(GROUP);
                tensors.push((name.clone(), dt, vec![groups, per], e.values));
                tensors.push((format!("{name}.scales"), "BF16", vec![groups], e.scales));
                Ok(())
            };
            for &(i, l, kv) in &per_layer {
                if let Some(l) = l {
                    push(format!("layers.{i}.ssm"), &l.ssm)?;
                    push(format!("layers.{i}.conv"), &l.conv)?;
                }
                if let Some((kv, shape)) = kv {
                    push(format!("layers.{i}.k"), &head_major(&kv.keys, shape))?;
                    push(format!("layers.{i}.v"), &head_major(&kv.values, shape))?;
                }
            }
            let dims = |d: &[usize]| d.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
            metadata.push(("codec", dtype.name().to_string()));
            metadata.push(("group", GROUP.to_string()));
            metadata.push(("ssm_shape", dims(&self.shape.ssm)));
            metadata.push(("conv_shape", dims(&self.shape.conv)));
            if let Some(shape) = kv_shapes.first() {
                metadata.push(("kv_shape", dims(shape)));
            }
        } else {
            let name = if dtype == StateDtype::F32 { "F32" } else { "BF16" };
            let encode =
                |v: &[f32]| picaso_compose::codec::encode(v, dtype).expect("f32 and bf16 take any value").values;
            for &(i, l, kv) in &per_layer {
                if let Some(l) = l {
                    tensors.push((format!("layers.{i}.ssm"), name, self.shape.ssm.clone(), encode(&l.ssm)));
                    tensors.push((format!("layers.{i}.conv"), name, self.shape.conv.clone(), encode(&l.conv)));
                    tensors.push((
                        format!("layers.{i}.log_decay"),
                        "F32",
                        self.shape.log_decay.clone(),
                        f32s(&l.log_decay),
                    ));
                }
                if let Some((kv, shape)) = kv {
                    tensors.push((format!("layers.{i}.k"), name, shape.to_vec(), encode(&head_major(&kv.keys, shape))));
                    tensors.push((
                        format!("layers.{i}.v"),
                        name,
                        shape.to_vec(),
                        encode(&head_major(&kv.values, shape)),
                    ));
                }
            }
        }
        metadata.sort_by_key(|(k, _)| *k);
        let quote = |s: &str| serde_json::to_string(s).expect("strings serialise");
        let mut header = String::from("{\"__metadata__\":{");
        let fields: Vec<String> = metadata.iter().map(|(k, v)| format!("{}:{}", quote(k), quote(v))).collect();
        header.push_str(&fields.join(","));
        header.push('}');
        let mut offset = 0usize;
        for (name, dt, shape, bytes) in &tensors {
            let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
            header.push_str(&format!(
                ",{}:{{\"dtype\":\"{dt}\",\"shape\":[{}],\"data_offsets\":[{offset},{}]}}",
                quote(name),
                dims.join(","),
                offset + bytes.len()
            ));
            offset += bytes.len();
        }
        header.push('}');
        // Pad the header with spaces so the data starts 8-byte aligned, as safetensors does.
        while !header.len().is_multiple_of(8) {
            header.push(' ');
        }
        let mut out = Vec::with_capacity(8 + header.len() + offset);
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        for (_, _, _, bytes) in &tensors {
            out.extend_from_slice(bytes);
        }
        let digits = checksum_digits(&out, 8 + header.len()).expect("the header holds one checksum");
        let sum = checksum(&out);
        out[digits].copy_from_slice(sum.as_bytes());
        Ok(out)
    }

    /// Parses safetensors bytes written by [`State::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let parsed = Parsed::new(bytes)?;
        let state = Self {
            layers: parsed.decode_layers(bytes),
            attention: parsed.decode_kv(bytes),
            position: parsed.position,
            fingerprint: parsed.fingerprint,
            n_tokens: parsed.n_tokens,
            shape: parsed.shape,
        };
        state.check_values()?;
        Ok(state)
    }

    /// Writes atomically: a temporary file in the same folder, fsync, rename.
    pub fn save(&self, path: &Path, dtype: StateDtype) -> Result<()> {
        let bytes = self.to_bytes(dtype)?;
        write_atomic(path, &bytes)
    }

    /// Reads a state file through a memory map.
    pub fn load(path: &Path) -> Result<Self> {
        if path.is_dir() {
            let why = "a folder, not a state file: give the .safetensors file `picaso state` or `compose` wrote";
            return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, why)));
        }
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: read-only map, dropped at the end of this function.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        Self::from_bytes(&mmap).map_err(|e| e.at_state_file(path))
    }
}

/// A state's tensors borrowed from wherever they live (a [`State`], a [`MappedState`]), in
/// whatever codec they were stored: what composition reads, so that stored states are composed
/// without being copied or dequantized whole.
#[derive(Debug, Clone)]
pub struct StateView<'a> {
    /// Fingerprint of the model that made it.
    pub fingerprint: &'a str,
    /// Tokens it summarises.
    pub n_tokens: u64,
    /// Tensor shapes.
    pub shape: &'a StateShape,
    /// One entry per SSM layer.
    pub layers: Vec<LayerView<'a>>,
    /// One entry per attention layer (empty for a pure SSM model).
    pub attention: Vec<KvView<'a>>,
    /// The position the next token takes.
    pub position: u64,
}

/// One attention layer of a [`StateView`]: its keys and values, token-major (T, heads,
/// head_dim) as a [`State`] holds them or head-major (heads, T, head_dim) as a file does.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    /// Keys.
    pub keys: Values<'a>,
    /// Values.
    pub values: Values<'a>,
    /// Key/value heads.
    pub heads: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// Whether rows are head-major (a file's layout) rather than token-major.
    pub head_major: bool,
}

impl KvView<'_> {
    /// Tokens held.
    pub fn tokens(&self) -> usize {
        self.keys.len() / (self.heads * self.head_dim).max(1)
    }

    /// Appends `v` (this layer's keys or values) to `out` as token-major f32 rows, dequantized
    /// as they are copied.
    pub fn extend_token_major(&self, v: &Values<'_>, out: &mut Vec<f32>) {
        let start = out.len();
        out.resize(start + v.len(), 0.0);
        self.write_token_major(v, &mut out[start..]);
    }

    /// [`KvView::extend_token_major`] into `dst` (of `v.len()` values), for a caller that
    /// lays out several parts in a buffer it sized once (a reused buffer is then not
    /// zero-filled first). Head-major parts are transposed a head at a time, each of its
    /// tokens' rows dequantized straight to its place.
    pub fn write_token_major(&self, v: &Values<'_>, dst: &mut [f32]) {
        debug_assert_eq!(dst.len(), v.len());
        if !self.head_major {
            v.dequantize_into(0, dst);
            return;
        }
        let (h, t, d) = (self.heads, self.tokens(), self.head_dim);
        for hi in 0..h {
            for ti in 0..t {
                v.dequantize_into((hi * t + ti) * d, &mut dst[(ti * h + hi) * d..][..d]);
            }
        }
    }

    /// Keys and values as an owned, token-major [`KvState`].
    pub fn to_kv_state(&self) -> KvState {
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        self.extend_token_major(&self.keys, &mut keys);
        self.extend_token_major(&self.values, &mut values);
        KvState { keys, values }
    }
}

/// One layer of a [`StateView`].
#[derive(Debug, Clone, Copy)]
pub struct LayerView<'a> {
    /// SSM state, (H, P, N).
    pub ssm: Values<'a>,
    /// Conv tail, (C, K-1).
    pub conv: Values<'a>,
    /// Log-decay per head, (H); always f32.
    pub log_decay: &'a [f32],
}

impl StateView<'_> {
    /// Rejects NaN or infinite values (in a compressed state: scales) and positive log-decays.
    pub fn check_values(&self) -> Result<()> {
        for (i, l) in self.layers.iter().enumerate() {
            for (name, v) in [("ssm", l.ssm), ("conv", l.conv), ("log_decay", Values::F32(l.log_decay))] {
                if let Some(j) = v.first_non_finite() {
                    return Err(Error::state(format!("layers.{i}.{name} holds a non-finite value at flat index {j}")));
                }
            }
            if let Some(j) = l.log_decay.iter().position(|&x| x > 0.0) {
                return Err(Error::state(format!("layers.{i}.log_decay[{j}] is positive; decays must be <= 1")));
            }
        }
        for (kv, &i) in self.attention.iter().zip(self.shape.attention_layers()) {
            for (name, v) in [("k", kv.keys), ("v", kv.values)] {
                if let Some(j) = v.first_non_finite() {
                    return Err(Error::state(format!("layers.{i}.{name} holds a non-finite value at flat index {j}")));
                }
            }
        }
        Ok(())
    }

    /// An owned f32 copy (compressed values dequantized).
    pub fn to_state(&self) -> State {
        State {
            fingerprint: self.fingerprint.to_string(),
            n_tokens: self.n_tokens,
            shape: self.shape.clone(),
            layers: self
                .layers
                .iter()
                .map(|l| LayerState { ssm: l.ssm.to_vec(), conv: l.conv.to_vec(), log_decay: l.log_decay.to_vec() })
                .collect(),
            attention: self.attention.iter().map(KvView::to_kv_state).collect(),
            position: self.position,
        }
    }

    /// The codec of its SSM values (f32 for an in-memory state).
    pub fn codec(&self) -> Codec {
        self.layers.first().map_or(Codec::F32, |l| l.ssm.codec())
    }

    /// Bytes read to compose it: every tensor in its codec, scales included.
    pub fn nbytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(|l| l.ssm.nbytes() + l.conv.nbytes() + 4 * l.log_decay.len()).sum();
        layers + self.attention.iter().map(|a| a.keys.nbytes() + a.values.nbytes()).sum::<usize>()
    }
}

/// Where one tensor's values (and an int8 / int4 tensor's scales) are in a state file.
#[derive(Debug, Clone)]
struct TensorAt {
    codec: Codec,
    range: std::ops::Range<usize>,
    /// Empty for f32 and bf16.
    scales: std::ops::Range<usize>,
    /// Values held.
    len: usize,
}

impl TensorAt {
    /// The tensor in `bytes` (the whole file); None for f32 at an address not 4-byte aligned.
    fn values<'a>(&self, bytes: &'a [u8]) -> Option<Values<'a>> {
        Values::from_bytes(self.codec, &bytes[self.range.clone()], &bytes[self.scales.clone()], self.len)
    }

    /// The tensor as f32 values, wherever it lies.
    fn decode(&self, bytes: &[u8]) -> Vec<f32> {
        match self.codec {
            Codec::F32 => bytes[self.range.clone()]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            _ => self.values(bytes).expect("sizes checked when parsing").to_vec(),
        }
    }

    /// Whether it can be read in place from `bytes`.
    fn in_place(&self, bytes: &[u8]) -> bool {
        self.codec != Codec::F32
            || (cfg!(target_endian = "little") && (bytes.as_ptr() as usize + self.range.start).is_multiple_of(4))
    }
}

/// The parsed header of a state file: metadata, shape, and each tensor's place.
struct Parsed {
    fingerprint: String,
    n_tokens: u64,
    shape: StateShape,
    /// Per SSM layer: ssm, conv, log_decay.
    tensors: Vec<[TensorAt; 3]>,
    /// Per attention layer: keys, values (each (kv_heads, T, head_dim)) and T.
    kv: Vec<(TensorAt, TensorAt, usize)>,
    position: u64,
}

/// "a,b,c" as dimensions.
fn parse_dims(key: &str, value: &str) -> Result<Vec<usize>> {
    value
        .split(',')
        .map(|d| d.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| Error::state(format!("metadata `{key}` is {value:?}, not comma-separated dimensions")))
}

impl Parsed {
    fn new(bytes: &[u8]) -> Result<Self> {
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| Error::state(format!("not a safetensors file: {e}")))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |k: &str| {
            meta.get(k).cloned().ok_or_else(|| Error::state(format!("metadata lacks `{k}`; not a picaso state file")))
        };
        let format = get("format")?;
        let header_end =
            8 + u64::from_le_bytes(bytes[..8].try_into().expect("read_metadata checked the length")) as usize;
        let damaged = |got: &str, want: &str| {
            Error::state(format!(
                "the file's bytes do not match its checksum ({got} vs {want}): the file is damaged; make the state again"
            ))
        };
        match format.as_str() {
            STATE_FORMAT => {
                let want = get("checksum")?;
                let digits = checksum_digits(bytes, header_end)
                    .ok_or_else(|| Error::state("the header's checksum cannot be located: the file is damaged"))?;
                let mut zeroed = xxhash_rust::xxh3::Xxh3::new();
                zeroed.update(&bytes[..digits.start]);
                zeroed.update(CHECKSUM_PLACEHOLDER.as_bytes());
                zeroed.update(&bytes[digits.end..]);
                let got = format!("{:032x}", zeroed.digest128());
                if got != want {
                    return Err(damaged(&got, &want));
                }
            }
            STATE_FORMAT_V2 => {
                let want = get("checksum")?;
                let got = checksum(&bytes[header_end..]);
                if got != want {
                    return Err(damaged(&got, &want));
                }
            }
            STATE_FORMAT_V1 if meta.contains_key("checksum") => {
                return Err(Error::state(
                    "the format tag says picaso-state/1, which had no checksum, but the file carries one: the file is damaged; make the state again",
                ));
            }
            STATE_FORMAT_V1 => {}
            _ => return Err(Error::state(format!("format {format:?} is not {STATE_FORMAT:?}"))),
        }
        // An int8 / int4 state names its codec and its tensors' shapes; f32 and bf16 ones do not.
        let codec = match meta.get("codec") {
            None => None,
            Some(c) => match c.parse::<Codec>() {
                Ok(c) if c.is_quantized() => Some(c),
                _ => {
                    return Err(Error::state(format!(
                        "metadata `codec` is {c:?}; a state file names its codec only for int8 or int4"
                    )))
                }
            },
        };
        if codec.is_some() && meta.get("group").map(String::as_str) != Some("32") {
            return Err(Error::state(format!(
                "metadata `group` is {:?}; this picaso reads groups of {GROUP} values",
                meta.get("group")
            )));
        }
        let arch = match get("arch")?.as_str() {
            "mamba2" => Arch::Mamba2,
            "mamba1" => Arch::Mamba1,
            other => return Err(Error::state(format!("architecture {other:?} is neither mamba1 nor mamba2"))),
        };
        let fingerprint = get("fingerprint")?;
        let n_tokens = get("n_tokens")?.parse().map_err(|_| Error::state("metadata `n_tokens` is not an integer"))?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| Error::state(format!("not a safetensors file: {e}")))?;
        // A hybrid's layer kinds are in its metadata; a pure SSM state's layers run from 0.
        // (has an SSM state, has keys and values) per layer.
        let kinds: Option<Vec<(bool, bool)>> = match meta.get("layer_types") {
            None => None,
            Some(list) => Some(
                list.split(',')
                    .map(|k| match k {
                        "mamba" => Ok((true, false)),
                        "attention" => Ok((false, true)),
                        "hybrid" => Ok((true, true)),
                        other => Err(Error::state(format!(
                            "metadata `layer_types` lists {other:?}; a layer is \"mamba\", \"attention\" or \"hybrid\" (both)"
                        ))),
                    })
                    .collect::<Result<_>>()?,
            ),
        };
        let (ssm_at, attention_at): (Vec<usize>, Vec<usize>) = match &kinds {
            Some(k) => ((0..k.len()).filter(|&i| k[i].0).collect(), (0..k.len()).filter(|&i| k[i].1).collect()),
            None => ((0..).take_while(|i| st.tensor(&format!("layers.{i}.ssm")).is_ok()).collect(), Vec::new()),
        };
        let n_layer = ssm_at.len();
        if n_layer == 0 {
            return Err(Error::state(format!("holds no `layers.{}.ssm` tensor", ssm_at.first().unwrap_or(&0))));
        }
        // Every tensor must be one of the layers': a renamed or extra tensor would otherwise be
        // skipped and the state silently cut short (found by fuzzing).
        let (per_ssm, per_kv) = if codec.is_some() { (5, 4) } else { (3, 2) };
        if st.len() != per_ssm * n_layer + per_kv * attention_at.len() {
            let mut names: Vec<&str> = st.names();
            names.sort();
            let scales = if codec.is_some() { " and a .scales beside each but .log_decay" } else { "" };
            let want = if attention_at.is_empty() {
                format!(
                    "a state whose layers run to layers.{}.ssm has {} (layers.i.ssm, .conv, .log_decay for each{scales})",
                    n_layer - 1,
                    per_ssm * n_layer
                )
            } else {
                format!(
                    "a state of {n_layer} SSM states and {} sets of keys and values has {} (.ssm, .conv, .log_decay and .k, .v{scales})",
                    attention_at.len(),
                    per_ssm * n_layer + per_kv * attention_at.len()
                )
            };
            return Err(Error::state(format!("holds {} tensors, but {want}: {}", st.len(), names.join(", "))));
        }
        let dims = |name: &str| -> Result<Vec<usize>> {
            st.tensor(name).map(|v| v.shape().to_vec()).map_err(|_| Error::state(format!("missing tensor `{name}`")))
        };
        let first = ssm_at[0];
        let log_decay = dims(&format!("layers.{first}.log_decay"))?;
        let (ssm, conv, kv_dims) = match codec {
            Some(_) => (
                parse_dims("ssm_shape", &get("ssm_shape")?)?,
                parse_dims("conv_shape", &get("conv_shape")?)?,
                match attention_at.is_empty() {
                    true => None,
                    false => Some(parse_dims("kv_shape", &get("kv_shape")?)?),
                },
            ),
            None => (
                dims(&format!("layers.{first}.ssm"))?,
                dims(&format!("layers.{first}.conv"))?,
                match attention_at.first() {
                    None => None,
                    Some(&a) => Some(dims(&format!("layers.{a}.k"))?),
                },
            ),
        };
        let attention = match (attention_at.first(), kv_dims.as_deref()) {
            (None, _) | (_, None) => None,
            (Some(_), Some(&[kv_heads, _, head_dim])) => Some(AttentionShape {
                layers: attention_at.clone(),
                ssm: ssm_at.clone(),
                n_layers: kinds.as_ref().map_or(0, Vec::len),
                kv_heads,
                head_dim,
            }),
            (Some(&a), Some(other)) => {
                return Err(Error::state(format!(
                    "tensor `layers.{a}.k` has shape {other:?}; keys are (kv_heads, tokens, head_dim)"
                )))
            }
        };
        let shape = StateShape { arch, n_layer, ssm, conv, log_decay, attention };
        shape.check()?;
        let position = match meta.get("position") {
            Some(p) => p.parse().map_err(|_| Error::state("metadata `position` is not an integer"))?,
            None => n_tokens,
        };
        let base = bytes.as_ptr() as usize;
        let place = |v: &safetensors::tensor::TensorView<'_>| {
            let start = v.data().as_ptr() as usize - base;
            start..start + v.data().len()
        };
        // A tensor of `want` dimensions in the file's codec (log-decays: f32 whatever it is).
        let at = |name: String, want: &[usize], f32_only: bool| -> Result<TensorAt> {
            let v = st.tensor(&name).map_err(|_| Error::state(format!("missing tensor `{name}`")))?;
            let len = want.iter().product::<usize>();
            match codec {
                Some(codec) if !f32_only => {
                    let groups = len.div_ceil(GROUP);
                    let (dtype, per) = if codec == Codec::Int8 { (Dtype::I8, GROUP) } else { (Dtype::U8, GROUP / 2) };
                    if v.dtype() != dtype || v.shape() != [groups, per] {
                        return Err(Error::state(format!(
                            "tensor `{name}` is {:?} {:?}; {codec} values of shape {want:?} are {dtype:?} [{groups}, {per}]",
                            v.dtype(),
                            v.shape()
                        )));
                    }
                    let scales_name = format!("{name}.scales");
                    let sc =
                        st.tensor(&scales_name).map_err(|_| Error::state(format!("missing tensor `{scales_name}`")))?;
                    if sc.dtype() != Dtype::BF16 || sc.shape() != [groups] {
                        return Err(Error::state(format!(
                            "tensor `{scales_name}` is {:?} {:?}; scales are BF16 [{groups}]",
                            sc.dtype(),
                            sc.shape()
                        )));
                    }
                    Ok(TensorAt { codec, range: place(&v), scales: place(&sc), len })
                }
                _ => {
                    if v.shape() != want {
                        return Err(Error::state(format!(
                            "tensor `{name}` has shape {:?}, expected {want:?}",
                            v.shape()
                        )));
                    }
                    let codec = match v.dtype() {
                        Dtype::F32 => Codec::F32,
                        Dtype::BF16 if !f32_only => Codec::Bf16,
                        other => {
                            let allowed = if f32_only { "f32" } else { "f32 or bf16" };
                            return Err(Error::state(format!("tensor `{name}` has dtype {other:?}; want {allowed}")));
                        }
                    };
                    Ok(TensorAt { codec, range: place(&v), scales: 0..0, len })
                }
            }
        };
        let mut tensors = Vec::with_capacity(n_layer);
        for i in ssm_at {
            tensors.push([
                at(format!("layers.{i}.ssm"), &shape.ssm, false)?,
                at(format!("layers.{i}.conv"), &shape.conv, false)?,
                at(format!("layers.{i}.log_decay"), &shape.log_decay, codec.is_some())?,
            ]);
        }
        let mut kv = Vec::with_capacity(attention_at.len());
        if let Some(a) = &shape.attention {
            for &i in &a.layers {
                let t = match (codec, kv_dims.as_deref()) {
                    (Some(_), Some(d)) => d[1],
                    _ => dims(&format!("layers.{i}.k"))?.get(1).copied().unwrap_or(0),
                };
                let want = [a.kv_heads, t, a.head_dim];
                kv.push((at(format!("layers.{i}.k"), &want, false)?, at(format!("layers.{i}.v"), &want, false)?, t));
            }
        }
        Ok(Self { fingerprint, n_tokens, shape, tensors, kv, position })
    }

    /// The attention layers' keys and values, token-major f32.
    fn decode_kv(&self, bytes: &[u8]) -> Vec<KvState> {
        let Some(a) = &self.shape.attention else { return Vec::new() };
        self.kv
            .iter()
            .map(|(k, v, t)| {
                let dims = [a.kv_heads, *t, a.head_dim];
                KvState { keys: token_major(&k.decode(bytes), dims), values: token_major(&v.decode(bytes), dims) }
            })
            .collect()
    }

    fn decode_layers(&self, bytes: &[u8]) -> Vec<LayerState> {
        self.tensors
            .iter()
            .map(|[s, c, l]| LayerState { ssm: s.decode(bytes), conv: c.decode(bytes), log_decay: l.decode(bytes) })
            .collect()
    }

    /// The codec of the SSM values.
    fn codec(&self) -> Codec {
        self.tensors.first().map_or(Codec::F32, |t| t[0].codec)
    }
}

/// The bytes of a state file: a memory map, or a buffer fetched from an object store.
type Buffer = Box<dyn AsRef<[u8]> + Send + Sync>;

/// A state file read in place, through a memory map or from a fetched buffer: every tensor is
/// used where it lies, in its codec (no copy, no allocation; composing stored states reads each
/// byte once and dequantizes int8 / int4 / bf16 inside its sums). Only an f32 tensor at an
/// unaligned address (a file written by another tool) is decoded once.
pub struct MappedState {
    buffer: Buffer,
    parsed: Parsed,
    /// f32 copies of the tensors that cannot be read in place, per SSM layer (ssm, conv,
    /// log_decay) and per attention layer (keys, values).
    owned: Vec<[Option<Vec<f32>>; 3]>,
    owned_kv: Vec<[Option<Vec<f32>>; 2]>,
}

impl std::fmt::Debug for MappedState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedState")
            .field("fingerprint", &self.parsed.fingerprint)
            .field("shape", &self.parsed.shape)
            .field("codec", &self.parsed.codec())
            .finish()
    }
}

impl MappedState {
    /// Parses a mapped state file. Values are not scanned here (composition detects non-finite
    /// values as it reads them); log-decays, which are small, are checked.
    pub fn new(mmap: memmap2::Mmap) -> Result<Self> {
        Self::from_buffer(mmap)
    }

    /// Parses a state file held in any buffer (e.g. an object fetched from S3). The buffer
    /// must return the same slice on every call, as maps, `Vec`s and `Bytes` do.
    pub fn from_buffer(buffer: impl AsRef<[u8]> + Send + Sync + 'static) -> Result<Self> {
        let buffer: Buffer = Box::new(buffer);
        let bytes = (*buffer).as_ref();
        let parsed = Parsed::new(bytes)?;
        let copy = |t: &TensorAt| (!t.in_place(bytes)).then(|| t.decode(bytes));
        let owned = parsed.tensors.iter().map(|ts| ts.each_ref().map(copy)).collect();
        let owned_kv = parsed.kv.iter().map(|(k, v, _)| [copy(k), copy(v)]).collect();
        let state = Self { buffer, parsed, owned, owned_kv };
        for (i, l) in state.view().layers.iter().enumerate() {
            if let Some(v) = l.log_decay.iter().find(|v| !(v.is_finite() && **v <= 0.0)) {
                return Err(Error::state(format!(
                    "layers.{i}.log_decay holds {v}; log-decays must be finite and <= 0"
                )));
            }
        }
        Ok(state)
    }

    /// Maps and parses the state file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: state files are written once (atomic rename) and never modified in place.
        let mmap = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        Self::new(mmap).map_err(|e| e.at_state_file(path))
    }

    /// The tensors, in the file's codec.
    pub fn view(&self) -> StateView<'_> {
        let p = &self.parsed;
        let bytes = self.bytes();
        fn values<'a>(t: &TensorAt, owned: &'a Option<Vec<f32>>, bytes: &'a [u8]) -> Values<'a> {
            match owned {
                Some(v) => Values::F32(v),
                None => t.values(bytes).expect("checked in place when mapped"),
            }
        }
        let layers = p
            .tensors
            .iter()
            .zip(&self.owned)
            .map(|([s, c, l], [os, oc, ol])| LayerView {
                ssm: values(s, os, bytes),
                conv: values(c, oc, bytes),
                log_decay: match values(l, ol, bytes) {
                    Values::F32(v) => v,
                    _ => unreachable!("log-decays are f32"),
                },
            })
            .collect();
        let (heads, head_dim) = p.shape.attention.as_ref().map_or((0, 0), |a| (a.kv_heads, a.head_dim));
        let attention =
            p.kv.iter()
                .zip(&self.owned_kv)
                .map(|((k, v, _), [ok, ov])| KvView {
                    keys: values(k, ok, bytes),
                    values: values(v, ov, bytes),
                    heads,
                    head_dim,
                    head_major: true,
                })
                .collect();
        StateView {
            fingerprint: &p.fingerprint,
            n_tokens: p.n_tokens,
            shape: &p.shape,
            layers,
            attention,
            position: p.position,
        }
    }

    /// The codec its `ssm`, `conv`, keys and values are stored in.
    pub fn codec(&self) -> Codec {
        self.parsed.codec()
    }

    /// Bytes of the state as f32 (what holding it decoded in memory costs).
    pub fn nbytes_f32(&self) -> usize {
        let tokens = self.parsed.kv.first().map_or(0, |(_, _, t)| *t);
        self.parsed.shape.nbytes(StateDtype::F32, tokens)
    }

    /// Bytes held in memory: the file's and any decoded copies.
    pub fn nbytes(&self) -> usize {
        let owned: usize =
            self.owned.iter().flatten().chain(self.owned_kv.iter().flatten()).flatten().map(|v| 4 * v.len()).sum();
        self.bytes().len() + owned
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        (*self.buffer).as_ref()
    }
}

/// Token-major (T, H, D) rows as head-major (H, T, D), the file's layout of keys and values.
fn head_major(rows: &[f32], [h, t, d]: &[usize; 3]) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len()];
    for ti in 0..*t {
        for hi in 0..*h {
            out[(hi * t + ti) * d..][..*d].copy_from_slice(&rows[(ti * h + hi) * d..][..*d]);
        }
    }
    out
}

/// Head-major (H, T, D) as token-major (T, H, D): the inverse of [`head_major`].
fn token_major(rows: &[f32], [h, t, d]: [usize; 3]) -> Vec<f32> {
    let mut out = vec![0.0f32; rows.len()];
    for hi in 0..h {
        for ti in 0..t {
            out[(ti * h + hi) * d..][..d].copy_from_slice(&rows[(hi * t + ti) * d..][..d]);
        }
    }
    out
}

/// Writes `bytes` to `path` so that readers see either the old file or the complete new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    // The rename below replaces whatever is at `path`: a symlink is written through (to the
    // file it names), and anything but a regular file is refused rather than replaced.
    let resolved;
    let path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            resolved = std::fs::canonicalize(path).map_err(|e| {
                Error::io(
                    path,
                    std::io::Error::new(e.kind(), format!("a symlink to nothing that can be written ({e})")),
                )
            })?;
            &resolved
        }
        _ => path,
    };
    if let Ok(m) = std::fs::metadata(path) {
        if !m.is_file() {
            let what = if m.is_dir() { "a folder" } else { "not a regular file (a device, pipe or socket)" };
            let why = format!("{what}: give the path of a file to write");
            return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, why)));
        }
    }
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| Error::Input(format!("{}: not a file path", path.display())))?;
    if !dir.is_dir() {
        let why = format!("the folder {} does not exist (create it, or write elsewhere)", dir.display());
        return Err(Error::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, why)));
    }
    // Unique per process and call, so that concurrent writers of one path never share a temp file.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{}.tmp-{}-{n}", name.to_string_lossy(), std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // Persist the rename itself.
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn write_atomic_writes_through_symlinks_and_refuses_what_is_not_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let (real, link) = (dir.path().join("real.st"), dir.path().join("link.st"));
        std::fs::write(&real, b"old").unwrap();
        std::os::unix::fs::symlink(&real, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert_eq!(std::fs::read(&real).unwrap(), b"new", "written through the link");
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link stays");
        let dangling = dir.path().join("dangling.st");
        std::os::unix::fs::symlink(dir.path().join("nowhere/x.st"), &dangling).unwrap();
        assert!(write_atomic(&dangling, b"x").unwrap_err().to_string().contains("symlink"));
        let socket = dir.path().join("socket.st");
        let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let e = write_atomic(&socket, b"x").unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(!std::fs::symlink_metadata(&socket).unwrap().is_file(), "the socket is left alone");
        assert!(write_atomic(dir.path(), b"x").unwrap_err().to_string().contains("a folder"));
    }

    /// A hybrid's layers may hold an SSM state, keys and values, or both (Falcon-H1); a layer
    /// that holds neither, a list out of order, or an SSM count that disagrees is refused.
    #[test]
    fn hybrid_shapes_list_every_layer_once_or_twice() {
        let shape = |ssm: Vec<usize>, layers: Vec<usize>, n_layers: usize| StateShape {
            n_layer: ssm.len(),
            attention: Some(AttentionShape { layers, ssm, n_layers, kv_heads: 2, head_dim: 4 }),
            ..StateShape::of(&Mamba2Config::tiny(2, 4))
        };
        let both = shape(vec![0, 1, 2], vec![0, 1, 2], 3);
        both.check().unwrap();
        assert_eq!(both.attention.as_ref().unwrap().layer_types(), ["hybrid"; 3]);
        let apart = shape(vec![0, 2], vec![1], 3);
        apart.check().unwrap();
        assert_eq!(apart.attention.as_ref().unwrap().layer_types(), ["mamba", "attention", "mamba"]);
        for bad in [shape(vec![0], vec![1], 3), shape(vec![1, 0], vec![2], 3), shape(vec![0, 3], vec![1, 2], 3)] {
            let e = bad.check().unwrap_err().to_string();
            assert!(e.contains("do not make a model of 3 layers"), "{e}");
        }
        let mut counted_wrong = both.clone();
        counted_wrong.n_layer = 2;
        assert!(counted_wrong.check().is_err());
        // A state of the both-in-each shape round-trips through its file.
        let mut s = State::zeros(both, "falcon-test");
        for (i, kv) in s.attention.iter_mut().enumerate() {
            kv.keys = (0..16).map(|j| (i * 16 + j) as f32).collect();
            kv.values = (0..16).map(|j| -((i * 16 + j) as f32)).collect();
        }
        s.advance(2);
        let back = State::from_bytes(&s.to_bytes(StateDtype::F32).unwrap()).unwrap();
        assert_eq!(back, s);
    }

    fn sample_state() -> State {
        let shape = StateShape::of(&Mamba2Config::tiny(2, 4));
        let mut s = State::zeros(shape, "mamba2-test\"quoted\"");
        s.n_tokens = 7;
        for (i, l) in s.layers.iter_mut().enumerate() {
            l.ssm.iter_mut().enumerate().for_each(|(j, x)| *x = (i * 1000 + j) as f32 * 0.001 - 0.3);
            l.conv.iter_mut().enumerate().for_each(|(j, x)| *x = j as f32 * -0.01);
            l.log_decay.iter_mut().enumerate().for_each(|(j, x)| *x = -(j as f32) - 0.5);
        }
        s
    }

    /// Saving into a folder that does not exist names the folder, and writes nothing.
    #[test]
    fn saving_into_a_missing_folder_names_it() {
        let dir = std::env::temp_dir().join(format!("picaso-missing-{}", std::process::id()));
        let path = dir.join("s.safetensors");
        let err = sample_state().save(&path, StateDtype::F32).unwrap_err();
        // A missing file's kind, as for any write into a missing folder (Python: FileNotFoundError).
        assert!(matches!(&err, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound));
        let e = err.to_string();
        assert!(e.contains(&format!("the folder {} does not exist", dir.display())), "{e}");
        assert!(!dir.exists());
    }

    /// Pages of `v` that are in memory (Linux `mincore`): 4 KiB pages wholly inside it.
    #[cfg(target_os = "linux")]
    fn resident_pages(v: &[f32]) -> (usize, usize) {
        const PAGE: usize = 4096;
        let start = (v.as_ptr() as usize).div_ceil(PAGE) * PAGE;
        let end = (v.as_ptr() as usize + 4 * v.len()) / PAGE * PAGE;
        let pages = (end - start) / PAGE;
        let mut flags = vec![0u8; pages];
        // SAFETY: the range is page-aligned and inside v's allocation; flags holds one byte per page.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, flags.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore failed");
        (flags.iter().filter(|&&f| f & 1 == 1).count(), pages)
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_zero_state_is_in_memory_before_the_scan_reads_it() {
        // Untouched calloc'd pages would map to the zero page and fault twice under the scan's
        // read-then-write (see State::zeros); this fails with `vec![0.0; n]` (tried).
        let s = State::zeros(StateShape::of(&Mamba2Config::mamba2_130m()), "m");
        for l in &s.layers {
            let (resident, pages) = resident_pages(&l.ssm);
            assert!(pages > 100, "the layer spans {pages} pages");
            assert_eq!(resident, pages, "pages of a zero state not yet in memory");
        }
    }

    #[test]
    fn bytes_are_deterministic_valid_safetensors_and_round_trip() {
        let s = sample_state();
        for dtype in [StateDtype::F32, StateDtype::Bf16] {
            let a = s.to_bytes(dtype).unwrap();
            assert_eq!(a, s.to_bytes(dtype).unwrap(), "equal states serialise to equal bytes");
            let st = SafeTensors::deserialize(&a).expect("valid safetensors");
            assert_eq!(st.len(), 3 * s.layers.len());
            let (_, header) = SafeTensors::read_metadata(&a).unwrap();
            let meta = header.metadata().clone().unwrap();
            assert_eq!(meta["n_tokens"], "7");
            assert_eq!(meta["fingerprint"], s.fingerprint);
            assert_eq!(u64::from_le_bytes(a[..8].try_into().unwrap()) % 8, 0, "data is 8-byte aligned");
            let back = State::from_bytes(&a).unwrap();
            assert_eq!((back.n_tokens, &back.fingerprint, &back.shape), (s.n_tokens, &s.fingerprint, &s.shape));
            if dtype == StateDtype::F32 {
                assert!(back.layers == s.layers, "f32 round trip is exact");
            } else {
                assert!(
                    back.layers.iter().zip(&s.layers).all(|(x, y)| x.log_decay == y.log_decay),
                    "log-decays stay f32"
                );
            }
        }
    }

    /// int8 and int4 files: deterministic, valid safetensors whose tensors are the groups and
    /// their scales, values back within half a step of their group, log-decays exact, and the
    /// mapped reader using the bytes in place.
    #[test]
    fn quantized_states_round_trip_within_half_a_step_and_map_in_place() {
        let s = sample_state();
        for codec in [StateDtype::Int8, StateDtype::Int4] {
            let a = s.to_bytes(codec).unwrap();
            assert_eq!(a, s.to_bytes(codec).unwrap(), "{codec}: equal states, equal bytes");
            let st = SafeTensors::deserialize(&a).expect("valid safetensors");
            assert_eq!(st.len(), 5 * s.layers.len(), "{codec}: ssm, conv, their scales, log_decay");
            assert_eq!(a.len() - 8 - u64::from_le_bytes(a[..8].try_into().unwrap()) as usize, s.shape.nbytes(codec, 0));
            let back = State::from_bytes(&a).unwrap();
            for (x, y) in back.layers.iter().zip(&s.layers) {
                assert_eq!(x.log_decay, y.log_decay, "{codec}: log-decays stay f32");
                for (got, want) in [(&x.ssm, &y.ssm), (&x.conv, &y.conv)] {
                    for (g, w) in got.chunks(GROUP).zip(want.chunks(GROUP)) {
                        let bound = codec.error_bound(w.iter().fold(0.0f32, |m, v| m.max(v.abs())));
                        assert!(g.iter().zip(w).all(|(p, q)| (p - q).abs() <= bound), "{codec}: {g:?} vs {w:?}");
                    }
                }
            }
            let mapped = MappedState::from_buffer(a.clone()).unwrap();
            assert_eq!(mapped.codec(), codec);
            assert_eq!(mapped.nbytes(), a.len(), "{codec}: nothing decoded");
            assert_eq!(mapped.view().to_state(), back, "{codec}: mapped and copied readers agree");
        }
    }

    /// A damaged scale is refused by the checksum, as any damaged byte is.
    #[test]
    fn a_damaged_scale_is_refused_by_the_checksum() {
        let a = sample_state().to_bytes(StateDtype::Int4).unwrap();
        let parsed = Parsed::new(&a).unwrap();
        let mut bad = a.clone();
        bad[parsed.tensors[1][0].scales.start + 1] ^= 0x40;
        for e in [State::from_bytes(&bad).unwrap_err(), MappedState::from_buffer(bad).unwrap_err()] {
            assert!(e.to_string().contains("do not match its checksum"), "{e}");
        }
    }

    /// Composing mapped int8 / int4 / bf16 states equals composing their dequantized copies.
    #[test]
    fn mapped_compressed_states_compose_as_their_dequantized_copies() {
        let base = sample_state();
        let parts: Vec<State> = (0..3)
            .map(|k| {
                let mut s = base.clone();
                for l in &mut s.layers {
                    l.ssm.iter_mut().enumerate().for_each(|(j, x)| *x *= 1.0 + ((j * 7 + k) % 5) as f32);
                    l.log_decay.iter_mut().for_each(|x| *x *= 1.0 + k as f32);
                }
                s
            })
            .collect();
        for codec in [StateDtype::Bf16, StateDtype::Int8, StateDtype::Int4] {
            let mapped: Vec<MappedState> =
                parts.iter().map(|p| MappedState::from_buffer(p.to_bytes(codec).unwrap()).unwrap()).collect();
            let views: Vec<StateView<'_>> = mapped.iter().map(|m| m.view()).collect();
            let copies: Vec<State> = views.iter().map(|v| v.to_state()).collect();
            for method in [crate::Composition::Soup, crate::Composition::PicasoS, crate::Composition::PicasoR] {
                let got = crate::composition::compose_views(method, &views, None).unwrap();
                let want = crate::composition::compose(method, &copies.iter().collect::<Vec<_>>(), None).unwrap();
                for (x, y) in got.layers.iter().zip(&want.layers) {
                    let scale = y.ssm.iter().fold(1e-30f32, |m, v| m.max(v.abs()));
                    assert!(x.ssm.iter().zip(&y.ssm).all(|(p, q)| (p - q).abs() <= 1e-6 * scale), "{codec} {method:?}");
                    assert_eq!(x.log_decay, y.log_decay);
                }
            }
        }
    }

    /// One flipped exponent bit (a value −0.0021 turned into −557) is refused with a clear
    /// error, by the copying and the in-place readers; a file of the first format (no checksum)
    /// is still read.
    #[test]
    fn a_damaged_state_file_is_refused() {
        let s = sample_state();
        let bytes = s.to_bytes(StateDtype::F32).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut bad = bytes.clone();
        bad[8 + header_len + 4 * 10 + 3] ^= 0x20; // the exponent of the 11th ssm value
        let e = State::from_bytes(&bad).unwrap_err().to_string();
        assert!(e.contains("damaged"), "{e}");
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.safetensors");
        std::fs::write(&path, &bad).unwrap();
        let e = State::load(&path).unwrap_err().to_string();
        assert!(e.contains("damaged") && e.contains("s.safetensors"), "{e}");
        assert!(MappedState::open(&path).is_err());
        // The first format: same tensors, no checksum, older tag.
        let text = String::from_utf8_lossy(&bytes[8..8 + header_len]).into_owned();
        let start = text.find("\"checksum\":").unwrap();
        let end = start + text[start..].find(',').unwrap() + 1;
        let mut v1 = text[..start].to_string() + &text[end..];
        v1 = v1.replace(STATE_FORMAT, STATE_FORMAT_V1);
        while v1.len() < header_len {
            v1.push(' ');
        }
        let mut old = (v1.len() as u64).to_le_bytes().to_vec();
        old.extend_from_slice(v1.as_bytes());
        old.extend_from_slice(&bytes[8 + header_len..]);
        assert!(State::from_bytes(&old).unwrap().layers == s.layers);
    }

    /// Replaces `from` by `to` (same length) in a file's header.
    fn edit_header(bytes: &[u8], from: &str, to: &str) -> Vec<u8> {
        assert_eq!(from.len(), to.len());
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let text = std::str::from_utf8(&bytes[8..header_end]).unwrap();
        assert_eq!(text.matches(from).count(), 1, "{from} occurs once");
        let mut out = bytes[..8].to_vec();
        out.extend_from_slice(text.replace(from, to).as_bytes());
        out.extend_from_slice(&bytes[header_end..]);
        out
    }

    /// The checksum covers the metadata too: a changed token count or fingerprint, or a format
    /// tag rewritten to an older format, is refused; genuine files of the older formats are read.
    #[test]
    fn damaged_metadata_and_downgraded_tags_are_refused() {
        let s = sample_state();
        let bytes = s.to_bytes(StateDtype::F32).unwrap();
        for (from, to) in [
            ("\"n_tokens\":\"7\"", "\"n_tokens\":\"8\""),
            ("mamba2-test", "mamba2-tesu"),
            (STATE_FORMAT, STATE_FORMAT_V2),
        ] {
            let e = State::from_bytes(&edit_header(&bytes, from, to)).unwrap_err().to_string();
            assert!(e.contains("damaged"), "{from} → {to}: {e}");
        }
        let e = State::from_bytes(&edit_header(&bytes, STATE_FORMAT, STATE_FORMAT_V1)).unwrap_err().to_string();
        assert!(e.contains("carries one") && e.contains("damaged"), "{e}");
        // A genuine second-format file: the checksum of the tensor bytes.
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let digits = checksum_digits(&bytes, header_end).unwrap();
        let current = std::str::from_utf8(&bytes[digits]).unwrap().to_string();
        let v2 = edit_header(&bytes, STATE_FORMAT, STATE_FORMAT_V2);
        let v2 = edit_header(&v2, &current, &checksum(&bytes[header_end..]));
        assert!(State::from_bytes(&v2).unwrap().layers == s.layers);
    }

    /// The case the fuzzer found (before the checksum covered the header): one flipped bit
    /// renamed `layers.1.ssm` to `mayers.1.ssm`, and the reader loaded a one-layer state,
    /// skipping the stray tensors. Even with a checksum that matches, it is refused.
    #[test]
    fn a_renamed_layer_tensor_is_refused_not_skipped() {
        let bytes = sample_state().to_bytes(StateDtype::Bf16).unwrap();
        let mut renamed = edit_header(&bytes, "\"layers.1.ssm\"", "\"mayers.1.ssm\"");
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let digits = checksum_digits(&renamed, header_end).unwrap();
        renamed[digits.clone()].copy_from_slice(CHECKSUM_PLACEHOLDER.as_bytes());
        let sum = checksum(&renamed);
        renamed[digits].copy_from_slice(sum.as_bytes());
        let e = State::from_bytes(&renamed).unwrap_err().to_string();
        assert!(e.contains("mayers.1.ssm") && e.contains("holds 6 tensors"), "{e}");
    }
}
