//! [`GraniteHybridConfig`]: transformers' `GraniteMoeHybridConfig` (IBM Granite 4.0 H), as the
//! hub ships it (`layer_types` of `mamba` / `attention`) or as newer transformers writes it
//! (`linear_attention` / `full_attention`); its predecessor `BambaConfig` (IBM's Bamba:
//! the same blocks without multipliers or experts, RoPE on half of each head's channels); and
//! `NemotronHConfig` (NVIDIA's Nemotron-H and Nemotron Nano 2: mixer and MLP blocks stand apart,
//! and each `mlp` block is read as the MLP of the mixer block before it); and `FalconH1Config`,
//! read in [`super::falcon_h1`].

use std::path::Path;

use serde_json::{Map, Value};

use crate::config::{CheckpointFormat, Fields};
use crate::error::{Error, Result};
use crate::mamba2::{GateNorm, Mamba2Config};
use crate::state::{Arch, AttentionShape, StateShape};

/// The mixer of one layer of a hybrid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// A Mamba-2 mixer: its state is the SSM state, the conv tail and the log-decay.
    Mamba,
    /// Causal self-attention: its state is the keys and values of the tokens seen.
    Attention,
    /// Both side by side on the same normed input, their outputs summed (Falcon-H1;
    /// transformers calls such a layer `hybrid`): its state is both.
    #[serde(rename = "hybrid")]
    Parallel,
}

impl LayerKind {
    /// Whether the layer runs a Mamba-2 mixer (and its state holds an SSM state).
    pub fn has_mamba(self) -> bool {
        matches!(self, Self::Mamba | Self::Parallel)
    }
    /// Whether the layer attends (and its state holds keys and values).
    pub fn attends(self) -> bool {
        matches!(self, Self::Attention | Self::Parallel)
    }
}

/// Which transformers class a hybrid's checkpoint is written for: it decides the config's
/// keys and the tensors' names (a Bamba model is a Granite 4.0 H model whose multipliers are 1,
/// with no experts and partial RoPE), and for Nemotron-H how its blocks make picaso's layers
/// and that its MLPs are relu² (checked by [`GraniteHybridConfig::validate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HybridFamily {
    /// `GraniteMoeHybridForCausalLM` (`model_type: "granitemoehybrid"`).
    #[default]
    Granite,
    /// `BambaForCausalLM` (`model_type: "bamba"`).
    Bamba,
    /// `NemotronHForCausalLM` (`model_type: "nemotron_h"`): a picaso layer is a mixer block
    /// and the `mlp` block after it, if there is one (see [`GraniteHybridConfig::hf_blocks`]).
    #[serde(rename = "nemotron_h")]
    NemotronH,
    /// `FalconH1ForCausalLM` (`model_type: "falcon_h1"`): every layer runs a Mamba-2 mixer and
    /// attention side by side ([`LayerKind::Parallel`]); its µP multipliers are folded into the
    /// weights as they are read (see [`super::falcon_h1`]).
    #[serde(rename = "falcon_h1")]
    FalconH1,
}

impl HybridFamily {
    /// The family's name as `picaso info` and [`GraniteHybridConfig::describe`] print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Granite => "granite-hybrid",
            Self::Bamba => "bamba",
            Self::NemotronH => "nemotron-h",
            Self::FalconH1 => "falcon-h1",
        }
    }
}

/// The MLP after a mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// `down(silu(gate(x)) · up(x))` (Granite 4.0 H, Bamba).
    #[default]
    SwiGlu,
    /// `down(relu(up(x))²)`, not gated (Nemotron-H's `relu2`).
    Relu2,
}

impl MlpKind {
    /// Projections into the inner width (an input matrix holds this many × inner rows): the
    /// gate and the up projection, or the up projection alone.
    pub fn projections(self) -> usize {
        match self {
            Self::SwiGlu => 2,
            Self::Relu2 => 1,
        }
    }
}

/// How a token picks its experts.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Granite 4.0 H: the top-k router logits, softmax over those k.
    #[default]
    Softmax,
    /// Nemotron 3 (DeepSeek-V3's rule): sigmoid scores; with the router's correction bias added,
    /// the experts split into `groups`, each group scored by its two best, the best `keep_groups`
    /// groups kept, the top-k experts among them chosen; their plain sigmoid scores, divided by
    /// their sum when `normalize`, times `scale`, are the weights.
    Sigmoid {
        /// `n_group`.
        groups: usize,
        /// `topk_group`.
        keep_groups: usize,
        /// `norm_topk_prob`.
        normalize: bool,
        /// `routed_scaling_factor`.
        scale: f64,
    },
}

/// Everything that shapes a Granite 4.0 H, Bamba or Nemotron-H model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GraniteHybridConfig {
    /// The checkpoint's class: its config keys and tensor names.
    #[serde(default)]
    pub family: HybridFamily,
    /// Width of the residual stream.
    pub d_model: usize,
    /// Rows of the embedding matrix.
    pub vocab_size: usize,
    /// Each layer's mixer, in order.
    pub layers: Vec<LayerKind>,
    /// The Mamba-2 mixers' settings (`n_layer` counts the Mamba layers; `d_model` is the model's).
    pub mamba: Mamba2Config,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Channels per attention head.
    pub head_dim: usize,
    /// The softmax scale of attention (`attention_multiplier`).
    pub attention_multiplier: f64,
    /// RoPE's base (`rope_theta`) when `position_embedding_type` is `rope`; `None` for NoPE.
    pub rope_theta: Option<f64>,
    /// The share of each head's channels RoPE rotates, from the first (`partial_rotary_factor`:
    /// 1 for Granite, 0.5 for Bamba); the rest pass unrotated.
    #[serde(default = "one")]
    pub partial_rotary_factor: f64,
    /// Scale of the token embeddings.
    pub embedding_multiplier: f64,
    /// Scale of every mixer's and MLP's output before it joins the residual stream.
    pub residual_multiplier: f64,
    /// Divisor of the logits.
    pub logits_scaling: f64,
    /// Inner width of the MLP that follows a mixer.
    pub shared_intermediate: usize,
    /// The MLPs' kind.
    #[serde(default)]
    pub mlp_kind: MlpKind,
    /// The layers whose mixer no MLP follows (a Nemotron-H mixer block with no `mlp` block
    /// after it); none for Granite 4.0 H and Bamba.
    #[serde(default)]
    pub without_mlp: Vec<usize>,
    /// Routed experts beside the shared MLP (0: dense).
    pub n_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Inner width of one expert.
    pub expert_intermediate: usize,
    /// How tokens pick experts.
    #[serde(default)]
    pub routing: Routing,
    /// The layers with routed experts when not all have them (a Nemotron 3 mixer block followed
    /// by a `moe` block); empty for Granite 4.0 H, where every layer has them when
    /// `n_experts > 0`.
    #[serde(default)]
    pub moe_layers: Vec<usize>,
    /// Inner width of the shared expert of a Nemotron 3 `moe` block (its layer's MLP).
    #[serde(default)]
    pub moe_shared_intermediate: usize,
    /// The width the routed experts of a Nemotron 3 `moe` block work in (`moe_latent_size`):
    /// each token is projected down to it before the experts and their weighted sum back up
    /// after; 0 when the experts work in `d_model`.
    #[serde(default)]
    pub moe_latent: usize,
    /// Falcon-H1's µP multipliers, folded into the CPU engine's copy of the weights; `None` for
    /// the other families.
    #[serde(default)]
    pub mup: Option<Mup>,
    /// Epsilon of every RMSNorm.
    pub norm_eps: f64,
    /// Whether the LM head is the embedding matrix.
    pub tie_embeddings: bool,
}

fn one() -> f64 {
    1.0
}

impl GraniteHybridConfig {
    /// Reads transformers' `config.json` of a `granitemoehybrid` model. Options picaso does
    /// not implement are refused by name (never silently computed wrong).
    pub fn from_hf(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let config = Self::read_hf(path, map)?;
        config.validate(path)?;
        Ok(config)
    }

    /// [`GraniteHybridConfig::from_hf`] before the sizes are checked: the fields both families
    /// share, read once (Bamba's reader overrides what it spells otherwise, then checks).
    fn read_hf(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let bad = |m: String| Error::config(path, m);
        let d_model = f.usize("hidden_size")?;
        let n_layer = layer_count(&f)?;
        let (types_key, types) = match map.get("layer_types") {
            Some(v) => ("layer_types", Some(v)),
            None => ("layers_block_type", map.get("layers_block_type")),
        };
        let layers: Vec<LayerKind> = match types {
            None | Some(Value::Null) => vec![LayerKind::Mamba; n_layer],
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, v)| match v.as_str() {
                    Some("mamba" | "linear_attention") => Ok(LayerKind::Mamba),
                    Some("attention" | "full_attention") => Ok(LayerKind::Attention),
                    other => Err(bad(format!(
                        "{types_key}[{i}] is {other:?}; picaso runs \"mamba\" (\"linear_attention\") and \
                         \"attention\" (\"full_attention\") layers"
                    ))),
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(f.err(types_key, "a list of layer kinds")),
        };
        if layers.len() != n_layer {
            return Err(bad(format!("layer_types lists {} layers, num_hidden_layers is {n_layer}", layers.len())));
        }
        silu_without(&f, &["attention_bias", "mamba_proj_bias"])?;
        let rope_theta = match map.get("position_embedding_type").and_then(Value::as_str) {
            None | Some("nope") => None,
            Some("rope") => Some(rope_theta(&f, path)?),
            Some(other) => {
                return Err(bad(format!("position_embedding_type is {other:?}; picaso runs \"nope\" and \"rope\"")))
            }
        };
        // transformers' Granite rotates whole heads (its RoPE cannot rotate part of one), and
        // ignores the factor without RoPE.
        if rope_theta.is_some() && partial_rotary_factor(&f, 1.0)? != 1.0 {
            return Err(bad(
                "`partial_rotary_factor` below 1 on a Granite 4.0 H model: transformers' Granite rotates whole \
                 heads, so picaso has no reference to run it against"
                    .into(),
            ));
        }
        let n_heads = f.usize("num_attention_heads")?;
        let n_kv_heads = f.usize_or("num_key_value_heads", n_heads)?;
        let head_dim = f.usize_or("head_dim", d_model / n_heads.max(1))?;
        let expand = f.usize_or("mamba_expand", 2)?;
        let mamba_heads = f.usize_or("mamba_n_heads", 128)?;
        let mamba_head_dim = match map.get("mamba_d_head") {
            None | Some(Value::Null) => expand * d_model / mamba_heads.max(1),
            Some(Value::String(s)) if s == "auto" => expand * d_model / mamba_heads.max(1),
            Some(_) => f.usize("mamba_d_head")?,
        };
        let norm_eps = f.f64_or("rms_norm_eps", 1e-6)?;
        let n_mamba = layers.iter().filter(|k| k.has_mamba()).count();
        let mamba = Mamba2Config {
            n_layer: n_mamba,
            vocab_size: f.usize("vocab_size")?,
            ..granite_mamba(&f, d_model, (mamba_heads, mamba_head_dim, expand), norm_eps)?
        };
        let n_experts = f.usize_or("num_local_experts", 0)?;
        let config = Self {
            family: HybridFamily::Granite,
            d_model,
            vocab_size: mamba.vocab_size,
            tie_embeddings: mamba.tie_embeddings,
            layers,
            mamba,
            n_heads,
            n_kv_heads,
            head_dim,
            attention_multiplier: f.f64_or("attention_multiplier", 1.0)?,
            rope_theta,
            partial_rotary_factor: 1.0,
            embedding_multiplier: f.f64_or("embedding_multiplier", 1.0)?,
            residual_multiplier: f.f64_or("residual_multiplier", 1.0)?,
            logits_scaling: f.f64_or("logits_scaling", 1.0)?,
            shared_intermediate: f.usize_or("shared_intermediate_size", 1024)?,
            mlp_kind: MlpKind::SwiGlu,
            without_mlp: Vec::new(),
            n_experts,
            top_k: if n_experts > 0 { f.usize_or("num_experts_per_tok", 2)? } else { 0 },
            expert_intermediate: if n_experts > 0 { f.usize("intermediate_size")? } else { 0 },
            routing: Routing::Softmax,
            moe_layers: Vec::new(),
            moe_shared_intermediate: 0,
            mup: None,
            moe_latent: 0,
            norm_eps,
        };
        Ok(config)
    }

    /// Reads transformers' `config.json` of a `bamba` model (`BambaForCausalLM`): attention
    /// at `attn_layer_indices`, a SwiGLU MLP of `intermediate_size` after every mixer, RoPE on
    /// `partial_rotary_factor` (0.5 unless the file says otherwise) of each head, softmax scale
    /// 1/√head_dim, no multipliers. Options picaso does not implement are refused by name.
    pub fn from_bamba(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let bad = |m: String| Error::config(path, m);
        let n_layer = layer_count(&f)?;
        let attention: Vec<usize> = match map.get("attn_layer_indices") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v.as_u64() {
                    Some(i) if (i as usize) < n_layer => Ok(i as usize),
                    _ => Err(bad(format!(
                        "attn_layer_indices holds {v}; each must be a layer index below num_hidden_layers ({n_layer})"
                    ))),
                })
                .collect::<Result<_>>()?,
            Some(_) => return Err(f.err("attn_layer_indices", "a list of layer indices")),
        };
        let layers = (0..n_layer)
            .map(|i| if attention.contains(&i) { LayerKind::Attention } else { LayerKind::Mamba })
            .collect();
        // The activation, attention and Mamba biases are checked by the Granite reader below.
        if f.bool_or("mlp_bias", false)? {
            return Err(bad("`mlp_bias: true` is not supported by picaso".into()));
        }
        let mut config = Self::read_hf(path, map)?;
        config.n_kv_heads = kv_heads_or_8(&f, config.n_heads)?;
        config.family = HybridFamily::Bamba;
        config.layers = layers;
        config.mamba.n_layer = config.n_mamba();
        config.attention_multiplier = 1.0 / (config.head_dim as f64).sqrt();
        config.rope_theta = Some(rope_theta(&f, path)?);
        config.partial_rotary_factor = partial_rotary_factor(&f, 0.5)?;
        config.shared_intermediate = f.usize("intermediate_size")?;
        // Bamba's default epsilon is not Granite's.
        config.norm_eps = f.f64_or("rms_norm_eps", 1e-5)?;
        (config.mamba.norm_eps, config.mamba.gated_norm_eps) = (config.norm_eps, config.norm_eps);
        (config.n_experts, config.top_k, config.expert_intermediate) = (0, 0, 0);
        (config.embedding_multiplier, config.residual_multiplier, config.logits_scaling) = (1.0, 1.0, 1.0);
        config.validate(path)?;
        Ok(config)
    }

    /// Reads transformers' `config.json` of a `nemotron_h` model (`NemotronHForCausalLM`): its
    /// blocks from `layers_block_type` (transformers 5) or `hybrid_override_pattern` (the hub's
    /// `M`, `*`, `-`, `E`), each `mlp` block folded into the mixer block before it as that
    /// layer's relu² MLP, each `moe` block (Nemotron 3) as that layer's shared expert and routed
    /// experts; NoPE attention at the softmax scale 1/√head_dim; no multipliers. An MLP block
    /// with no mixer before it, biases on attention or MLP, and
    /// other activations are refused by name.
    pub fn from_nemotron_h(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let bad = |m: String| Error::config(path, m);
        let blocks = nemotron_blocks(&f)?;
        let (mut layers, mut without_mlp, mut moe_layers) = (Vec::new(), Vec::new(), Vec::new());
        let is_mlp = |b: char| b == '-' || b == 'E';
        for (i, &b) in blocks.iter().enumerate() {
            match b {
                'M' | '*' => {
                    if i > 0 && !is_mlp(blocks[i - 1]) {
                        without_mlp.push(layers.len() - 1);
                    }
                    layers.push(if b == 'M' { LayerKind::Mamba } else { LayerKind::Attention });
                }
                _ if i > 0 && !is_mlp(blocks[i - 1]) => {
                    if b == 'E' {
                        moe_layers.push(layers.len() - 1);
                    }
                }
                _ => {
                    let (kind, before) = (
                        if b == 'E' { "`moe`" } else { "`mlp`" },
                        if i == 0 { "no block before it" } else { "another MLP block before it" },
                    );
                    return Err(bad(format!(
                        "block {i} is an {kind} block with {before}; picaso reads each `mlp` or `moe` block as the \
                         MLP of the Mamba or attention block it follows"
                    )));
                }
            }
        }
        if !blocks.last().is_some_and(|&b| is_mlp(b)) {
            without_mlp.push(layers.len() - 1);
        }
        let routed = !moe_layers.is_empty();
        if layers.len() > 1 << 24 {
            return Err(bad(format!("{} layers; at most 2^24", layers.len())));
        }
        for (key, want) in [("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")] {
            match map.get(key).and_then(Value::as_str) {
                None => {}
                Some(v) if v == want => {}
                Some(v) => return Err(bad(format!("{key} is {v:?}; picaso runs {want:?}"))),
            }
        }
        for key in ["attention_bias", "mlp_bias"] {
            if f.bool_or(key, false)? {
                return Err(bad(format!("`{key}: true` is not supported by picaso")));
            }
        }
        // transformers 5 never ties a Nemotron-H head to the embeddings (its remote code does):
        // with two references that disagree, picaso does not guess.
        if f.bool_or("tie_word_embeddings", false)? {
            return Err(bad("`tie_word_embeddings: true` on a Nemotron-H model: transformers keeps its own \
                 `lm_head` and the hub's remote code ties it, so picaso runs neither"
                .into()));
        }
        if !matches!(map.get("sliding_window"), None | Some(Value::Null)) {
            return Err(bad(
                "`sliding_window` on a Nemotron-H model is not supported by picaso (full attention only)".into()
            ));
        }
        let d_model = f.usize("hidden_size")?;
        let n_heads = f.usize("num_attention_heads")?;
        // The hub's configs spell it `attention_head_dim`; transformers' default is 128.
        let head_dim = match (map.get("head_dim"), map.get("attention_head_dim")) {
            (Some(v), _) if !v.is_null() => f.usize("head_dim")?,
            (_, Some(v)) if !v.is_null() => f.usize("attention_head_dim")?,
            _ => 128,
        };
        let norm_eps = f.f64_or("layer_norm_epsilon", 1e-5)?;
        // transformers reads the hub's older `mamba_*` spellings first, where present.
        let either = |new: &str, old: &str| {
            if map.contains_key(old) {
                old.to_string()
            } else {
                new.to_string()
            }
        };
        let use_bias = f.bool_or("use_bias", false)?;
        let mamba = Mamba2Config {
            d_model,
            n_layer: layers.iter().filter(|k| k.has_mamba()).count(),
            vocab_size: f.usize("vocab_size")?,
            d_state: f.usize_or("ssm_state_size", 128)?,
            headdim: f.usize_or("mamba_head_dim", 64)?,
            nheads: f.usize_or("mamba_num_heads", 128)?,
            expand: f.usize_or(&either("expand", "mamba_expand"), 2)?,
            n_groups: f.usize_or(&either("n_groups", "mamba_n_groups"), 8)?,
            d_conv: f.usize_or(&either("conv_kernel", "mamba_d_conv"), 4)?,
            norm_eps,
            gated_norm_eps: norm_eps,
            time_step_limit: f.limit(&either("time_step_limit", "mamba_dt_limit"))?,
            tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
            use_bias,
            use_conv_bias: f.bool_or(&either("use_conv_bias", "mamba_conv_bias"), true)?,
            gate_norm: GateNorm::NormGated,
            format: CheckpointFormat::HfTransformers,
        };
        let config = Self {
            family: HybridFamily::NemotronH,
            d_model,
            vocab_size: mamba.vocab_size,
            tie_embeddings: mamba.tie_embeddings,
            layers,
            mamba,
            n_heads,
            n_kv_heads: kv_heads_or_8(&f, n_heads)?,
            head_dim,
            attention_multiplier: 1.0 / (head_dim as f64).sqrt(),
            rope_theta: None,
            partial_rotary_factor: 1.0,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            logits_scaling: 1.0,
            shared_intermediate: f.usize_or("intermediate_size", 21504)?,
            mlp_kind: MlpKind::Relu2,
            without_mlp,
            n_experts: if routed { f.usize_or("n_routed_experts", 8)? } else { 0 },
            top_k: if routed { f.usize_or("num_experts_per_tok", 2)? } else { 0 },
            expert_intermediate: if routed { f.usize_or("moe_intermediate_size", 7688)? } else { 0 },
            routing: if routed {
                Routing::Sigmoid {
                    groups: f.usize_or("n_group", 1)?,
                    keep_groups: f.usize_or("topk_group", 1)?,
                    normalize: f.bool_or("norm_topk_prob", true)?,
                    scale: f.f64_or("routed_scaling_factor", 1.0)?,
                }
            } else {
                Routing::Softmax
            },
            moe_layers,
            moe_shared_intermediate: if routed { f.usize_or("moe_shared_expert_intermediate_size", 7688)? } else { 0 },
            mup: None,
            moe_latent: match map.get("moe_latent_size") {
                Some(v) if routed && !v.is_null() => f.usize("moe_latent_size")?,
                _ => 0,
            },
            norm_eps,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// The width a layer's routed experts work in: `moe_latent_size` (Nemotron 3's latent
    /// experts), else `d_model`.
    pub fn expert_width(&self) -> usize {
        if self.moe_latent > 0 {
            self.moe_latent
        } else {
            self.d_model
        }
    }

    /// Whether an MLP follows layer `i`'s mixer.
    pub fn has_mlp(&self, i: usize) -> bool {
        !self.without_mlp.contains(&i)
    }

    /// Whether layer `i` has routed experts beside its MLP.
    pub fn has_experts(&self, i: usize) -> bool {
        self.n_experts > 0 && (self.family != HybridFamily::NemotronH || self.moe_layers.contains(&i))
    }

    /// Inner width of layer `i`'s MLP (a Nemotron 3 `moe` block's shared expert has its own).
    pub fn mlp_inner(&self, i: usize) -> usize {
        if self.family == HybridFamily::NemotronH && self.moe_layers.contains(&i) {
            self.moe_shared_intermediate
        } else {
            self.shared_intermediate
        }
    }

    /// The checkpoint's block index of each layer's mixer and of its MLP. Granite 4.0 H and
    /// Bamba blocks hold both (`(i, Some(i))`); a Nemotron-H block holds one, so its indices
    /// run past picaso's layer indices wherever an `mlp` block was folded in.
    pub fn hf_blocks(&self) -> Vec<(usize, Option<usize>)> {
        let mut next = 0;
        (0..self.n_layer())
            .map(|i| {
                if self.family != HybridFamily::NemotronH {
                    return (i, Some(i));
                }
                let mixer = next;
                let mlp = self.has_mlp(i).then_some(mixer + 1);
                next = mlp.unwrap_or(mixer) + 1;
                (mixer, mlp)
            })
            .collect()
    }

    /// Channels of a head RoPE rotates (transformers' `int(head_dim * partial_rotary_factor)`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }

    /// Checks that the sizes fit together.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, m));
        if self.n_mamba() > 0 {
            // Nemotron-H's and Falcon-H1's mixers take their width from the heads alone.
            self.mamba.validate_with(path, matches!(self.family, HybridFamily::Granite | HybridFamily::Bamba))?;
        }
        let falcon = self.family == HybridFamily::FalconH1;
        let parallel = self.layers.iter().filter(|k| **k == LayerKind::Parallel).count();
        if (falcon && parallel != self.n_layer()) || (!falcon && parallel > 0) {
            return bad("a Falcon-H1 model runs a Mamba mixer and attention side by side in every layer, and no \
                 other family does"
                .into());
        }
        if falcon != self.mup.is_some() || (!falcon && self.mamba.gate_norm != GateNorm::NormGated) {
            return bad("µP multipliers and another gate norm than Mamba-2's belong to Falcon-H1 models only".into());
        }
        if falcon {
            let scale = 1.0 / (self.head_dim as f64).sqrt();
            if self.rope_theta.is_none()
                || self.partial_rotary_factor != 1.0
                || self.n_experts > 0
                || self.residual_multiplier != 1.0
                || (self.attention_multiplier - scale).abs() > 1e-12 * scale
            {
                return bad("a Falcon-H1 model has RoPE on whole heads, no experts, no residual multiplier and the \
                     softmax scale 1/√head_dim; this config sets one of them otherwise"
                    .into());
            }
            let m = self.mup.unwrap_or(Mup::ONE);
            let all =
                [m.ssm_in, m.ssm_out, m.attention_in, m.key, m.attention_out].into_iter().chain(m.ssm).chain(m.mlp);
            // (Real ones are O(0.01–10); folded into f32 weights, a huge one would overflow them.)
            if let Some(v) = all.into_iter().find(|v| !v.is_finite() || v.abs() > 1e6) {
                return bad(format!("a µP multiplier is {v}; each must be finite and at most 1e6 in magnitude"));
            }
        }
        for (name, v) in [
            ("hidden_size", self.d_model),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("shared_intermediate_size", self.shared_intermediate),
            ("n_routed_experts", if self.moe_layers.is_empty() { 1 } else { self.n_experts }),
            ("moe_intermediate_size", if self.moe_layers.is_empty() { 1 } else { self.expert_intermediate }),
            (
                "moe_shared_expert_intermediate_size",
                if self.moe_layers.is_empty() { 1 } else { self.moe_shared_intermediate },
            ),
        ] {
            if v == 0 || v > 1 << 24 {
                return bad(format!("`{name}` is {v}; it must be between 1 and 2^24"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.rope_theta.is_some() && (self.rotary_dim() == 0 || !self.rotary_dim().is_multiple_of(2)) {
            return bad(format!(
                "RoPE needs an even, positive number of rotated channels, not {} (head_dim {} × partial_rotary_factor {})",
                self.rotary_dim(),
                self.head_dim,
                self.partial_rotary_factor
            ));
        }
        if !(self.partial_rotary_factor > 0.0 && self.partial_rotary_factor <= 1.0) {
            return bad(format!("`partial_rotary_factor` is {}; it must be in (0, 1]", self.partial_rotary_factor));
        }
        if self.family == HybridFamily::Granite && self.partial_rotary_factor != 1.0 {
            return bad("a Granite 4.0 H model rotates whole heads: `partial_rotary_factor` must be 1".into());
        }
        // A Bamba checkpoint has no key for these: they are fixed, so a config that sets them
        // otherwise would be written out (and fingerprinted) as a model it is not.
        if self.family == HybridFamily::Bamba {
            let scale = 1.0 / (self.head_dim as f64).sqrt();
            if self.rope_theta.is_none()
                || self.n_experts > 0
                || (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) != (1.0, 1.0, 1.0)
                || (self.attention_multiplier - scale).abs() > 1e-12 * scale
            {
                return bad("a Bamba model has RoPE, no experts, no multipliers and the softmax scale 1/√head_dim; \
                     this config sets one of them otherwise"
                    .into());
            }
        }
        if self.family == HybridFamily::NemotronH {
            if !self.moe_layers.is_empty() && self.n_experts == 0 {
                return bad("the model has `moe` blocks but `n_routed_experts` is 0".into());
            }
            let scale = 1.0 / (self.head_dim as f64).sqrt();
            if self.rope_theta.is_some()
                || (self.n_experts > 0) == self.moe_layers.is_empty()
                || (self.n_experts > 0 && self.routing == Routing::Softmax)
                || self.tie_embeddings
                || self.mlp_kind != MlpKind::Relu2
                || (self.embedding_multiplier, self.residual_multiplier, self.logits_scaling) != (1.0, 1.0, 1.0)
                || (self.attention_multiplier - scale).abs() > 1e-12 * scale
            {
                return bad("a Nemotron-H model has NoPE attention at the softmax scale 1/√head_dim, relu² MLPs, an \
                     untied head, experts (routed by sigmoid scores) only after `moe` blocks and no multipliers; \
                     this config sets one of them otherwise"
                    .into());
            }
            if self.moe_latent > 1 << 24 || (self.moe_latent > 0 && self.moe_layers.is_empty()) {
                return bad(format!(
                    "`moe_latent_size` is {}; it must be at most 2^24, on a model with `moe` blocks",
                    self.moe_latent
                ));
            }
            if let Some(&i) = self.moe_layers.iter().find(|&&i| i >= self.n_layer() || !self.has_mlp(i)) {
                return bad(format!("layer {i} is listed with experts but has no MLP block"));
            }
            if let Routing::Sigmoid { groups, keep_groups, scale, .. } = self.routing {
                let per_group = self.n_experts.checked_div(groups).unwrap_or(0);
                if groups == 0
                    || !self.n_experts.is_multiple_of(groups)
                    || per_group < 2
                    || keep_groups == 0
                    || keep_groups > groups
                    || self.top_k > keep_groups * per_group
                    || !scale.is_finite()
                {
                    return bad(format!(
                        "n_group ({groups}) must split n_routed_experts ({}) into groups of at least 2, topk_group \
                         ({keep_groups}) be 1..=n_group, the kept groups hold num_experts_per_tok ({}) experts, and \
                         routed_scaling_factor ({scale}) be finite",
                        self.n_experts, self.top_k
                    ));
                }
            }
        } else if self.mlp_kind != MlpKind::SwiGlu
            || !self.without_mlp.is_empty()
            || !self.moe_layers.is_empty()
            || self.moe_latent > 0
            || self.routing != Routing::Softmax
        {
            return bad(format!(
                "a {} model has a SwiGLU MLP after every mixer and softmax routing",
                self.family.name()
            ));
        }
        if let Some(&i) = self.without_mlp.iter().find(|&&i| i >= self.n_layer()) {
            return bad(format!("layer {i} is listed without an MLP, but the model has {} layers", self.n_layer()));
        }
        if self.n_experts > 0 && (self.top_k == 0 || self.top_k > self.n_experts || self.expert_intermediate == 0) {
            return bad(format!(
                "num_experts_per_tok ({}) must be 1..=num_local_experts ({}) and intermediate_size positive",
                self.top_k, self.n_experts
            ));
        }
        if self.n_mamba() == 0 {
            return bad("no mamba layer: picaso keeps a database of states of models with Mamba layers".into());
        }
        for (name, v) in [
            ("attention_multiplier", self.attention_multiplier),
            ("embedding_multiplier", self.embedding_multiplier),
            ("residual_multiplier", self.residual_multiplier),
            ("logits_scaling", self.logits_scaling),
            ("rms_norm_eps", self.norm_eps),
        ] {
            if !v.is_finite() || (name == "logits_scaling" && v == 0.0) || (name == "rms_norm_eps" && v <= 0.0) {
                return bad(format!("`{name}` is {v}"));
            }
        }
        Ok(())
    }

    /// A small dense NoPE hybrid for tests: `mamba, attention, mamba, attention`, width 16.
    pub fn tiny(vocab_size: usize) -> Self {
        let mamba = Mamba2Config {
            d_model: 16,
            n_layer: 2,
            vocab_size,
            headdim: 8,
            nheads: 4,
            n_groups: 1,
            ..Mamba2Config::tiny(2, 4)
        };
        Self {
            family: HybridFamily::Granite,
            d_model: 16,
            vocab_size,
            layers: vec![LayerKind::Mamba, LayerKind::Attention, LayerKind::Mamba, LayerKind::Attention],
            mamba,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 8,
            attention_multiplier: 1.0 / 8f64.sqrt(),
            rope_theta: None,
            partial_rotary_factor: 1.0,
            embedding_multiplier: 1.0,
            residual_multiplier: 1.0,
            logits_scaling: 1.0,
            shared_intermediate: 24,
            mlp_kind: MlpKind::SwiGlu,
            without_mlp: Vec::new(),
            n_experts: 0,
            top_k: 0,
            expert_intermediate: 0,
            routing: Routing::Softmax,
            moe_layers: Vec::new(),
            moe_shared_intermediate: 0,
            mup: None,
            moe_latent: 0,
            norm_eps: 1e-5,
            tie_embeddings: true,
        }
    }

    /// Granite 4.0 H-350M's layout as IBM describes it, sizes chosen here (for benchmarks with
    /// random weights; `scripts/make_random_granite.py --preset 350m-like` writes the same
    /// shape through transformers): hidden 768, 32 layers of which 4 NoPE attention (12 query
    /// and 4 key-value heads of 64) evenly spread, Mamba-2 mixers of 48 heads × 32 (state 128),
    /// a SwiGLU MLP of 2,048, tied embeddings, Granite's multipliers.
    pub fn granite_350m_like() -> Self {
        Self::granite_like(768, 32, (12, 4), (48, 32), 2048)
    }

    /// Granite 4.0 H-Micro's layout (2.9 B, dense), sizes chosen here: hidden 2,560, 40 layers
    /// of which 4 attention (40 query and 8 key-value heads of 64), Mamba-2 mixers of 80 heads
    /// × 64, a SwiGLU MLP of 4,096 (`make_random_granite.py --preset micro-like`).
    pub fn granite_micro_like() -> Self {
        Self::granite_like(2560, 40, (40, 8), (80, 64), 4096)
    }

    /// The state of Granite 4.0 H-Tiny's layout (7 B with experts; sizes chosen here after its
    /// published config): hidden 1,536, 40 layers of which 4 attention (12 query and 4
    /// key-value heads of 128), Mamba-2 mixers of 48 heads × 64 (state 128). The experts are
    /// left out (a dense MLP of 1,024 stands in): they change neither a state nor its size.
    /// For state sizes and composition speed (`picaso bench-codecs`), not for random weights.
    pub fn granite_tiny_like() -> Self {
        Self::granite_like(1536, 40, (12, 4), (48, 64), 1024)
    }

    /// The state of Nemotron-H 8B's layout (sizes chosen here after its published config):
    /// hidden 4,096, 24 Mamba-2 mixers of 128 heads × 64 (state 128, 8 groups) and 4 attention
    /// layers (32 query and 8 key-value heads of 128); its 24 MLP blocks hold no state and are
    /// left out. For state sizes and composition speed, not for random weights.
    pub fn nemotron_h_8b_like() -> Self {
        let mut c = Self::granite_like(4096, 28, (32, 8), (128, 64), 4096);
        c.mamba.n_groups = 8;
        c
    }

    /// A dense NoPE Granite 4.0 H of these sizes, its 4 attention layers where
    /// `make_random_granite.py` puts them (the k-th at round((k + ½)·layers / 4)).
    fn granite_like(
        d: usize,
        layers: usize,
        (heads, kv_heads): (usize, usize),
        (m_heads, m_dim): (usize, usize),
        mlp: usize,
    ) -> Self {
        let attention: Vec<usize> = (0..4).map(|k| ((k as f64 + 0.5) * layers as f64 / 4.0).round() as usize).collect();
        let vocab_size = 50304;
        let mamba = Mamba2Config {
            d_model: d,
            n_layer: layers - attention.len(),
            vocab_size,
            d_state: 128,
            headdim: m_dim,
            nheads: m_heads,
            expand: 2,
            n_groups: 1,
            d_conv: 4,
            ..Mamba2Config::tiny(layers - attention.len(), 4)
        };
        Self {
            d_model: d,
            vocab_size,
            layers: (0..layers)
                .map(|i| if attention.contains(&i) { LayerKind::Attention } else { LayerKind::Mamba })
                .collect(),
            mamba,
            n_heads: heads,
            n_kv_heads: kv_heads,
            head_dim: d / heads,
            attention_multiplier: 1.0 / (d / heads) as f64,
            embedding_multiplier: 12.0,
            residual_multiplier: 0.22,
            logits_scaling: 3.0,
            shared_intermediate: mlp,
            ..Self::tiny(vocab_size)
        }
    }

    /// Number of layers.
    pub fn n_layer(&self) -> usize {
        self.layers.len()
    }
    /// Number of Mamba layers.
    pub fn n_mamba(&self) -> usize {
        self.layers.iter().filter(|k| k.has_mamba()).count()
    }
    /// The model's index of each layer that attends.
    pub fn attention_layers(&self) -> Vec<usize> {
        (0..self.layers.len()).filter(|&i| self.layers[i].attends()).collect()
    }
    /// The model's index of each layer with a Mamba mixer.
    pub fn mamba_layers(&self) -> Vec<usize> {
        (0..self.layers.len()).filter(|&i| self.layers[i].has_mamba()).collect()
    }

    /// The shape of this model's states: the Mamba layers' as a Mamba-2 model's, plus the
    /// attention layers' keys and values.
    pub fn state_shape(&self) -> StateShape {
        StateShape {
            attention: Some(AttentionShape {
                layers: self.attention_layers(),
                ssm: self.mamba_layers(),
                n_layers: self.n_layer(),
                kv_heads: self.n_kv_heads,
                head_dim: self.head_dim,
            }),
            ..StateShape::of(&self.mamba)
        }
    }

    /// Floats in a state after `tokens` tokens.
    pub fn state_floats(&self, tokens: usize) -> usize {
        self.mamba.state_floats() + self.attention_layers().len() * 2 * tokens * self.n_kv_heads * self.head_dim
    }

    /// The architecture of the state's SSM layers.
    pub fn arch(&self) -> Arch {
        Arch::Mamba2
    }

    /// The HF transformers spelling (the hub's names), for fingerprints and saved models.
    pub fn to_hf_json(&self) -> Value {
        let m = &self.mamba;
        let hi = if m.time_step_limit.1.is_infinite() {
            serde_json::json!({"__float__": "Infinity"})
        } else {
            serde_json::json!(m.time_step_limit.1)
        };
        let mut json = serde_json::json!({
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layer(),
            "vocab_size": self.vocab_size,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "tie_word_embeddings": self.tie_embeddings,
            "time_step_limit": [m.time_step_limit.0, hi],
        });
        // Granite 4.0 H, Bamba and Falcon-H1 spell the Mamba settings alike.
        let granite_mamba = serde_json::json!({
            "rms_norm_eps": self.norm_eps,
            "mamba_n_heads": m.nheads,
            "mamba_d_head": m.headdim,
            "mamba_d_state": m.d_state,
            "mamba_n_groups": m.n_groups,
            "mamba_d_conv": m.d_conv,
            "mamba_expand": m.expand,
            "mamba_conv_bias": m.use_conv_bias,
        });
        let extra = match self.family {
            HybridFamily::Granite => {
                let kinds: Vec<&str> = self
                    .layers
                    .iter()
                    .map(|k| match k {
                        LayerKind::Mamba => "mamba",
                        LayerKind::Attention => "attention",
                        LayerKind::Parallel => unreachable!("validated: only Falcon-H1 runs mixers side by side"),
                    })
                    .collect();
                serde_json::json!({
                    "architectures": ["GraniteMoeHybridForCausalLM"],
                    "model_type": "granitemoehybrid",
                    "layer_types": kinds,
                    "attention_multiplier": self.attention_multiplier,
                    "position_embedding_type": if self.rope_theta.is_some() { "rope" } else { "nope" },
                    "rope_theta": self.rope_theta,
                    "embedding_multiplier": self.embedding_multiplier,
                    "residual_multiplier": self.residual_multiplier,
                    "logits_scaling": self.logits_scaling,
                    "shared_intermediate_size": self.shared_intermediate,
                    "num_local_experts": self.n_experts,
                    "num_experts_per_tok": self.top_k,
                    "intermediate_size": self.expert_intermediate,
                })
            }
            HybridFamily::NemotronH => {
                let mut pattern = String::new();
                for (i, k) in self.layers.iter().enumerate() {
                    pattern.push(match k {
                        LayerKind::Mamba => 'M',
                        LayerKind::Attention => '*',
                        LayerKind::Parallel => unreachable!("validated: only Falcon-H1 runs mixers side by side"),
                    });
                    if self.has_mlp(i) {
                        pattern.push(if self.has_experts(i) { 'E' } else { '-' });
                    }
                }
                let mut json = serde_json::json!({
                    "architectures": ["NemotronHForCausalLM"],
                    "model_type": "nemotron_h",
                    "num_hidden_layers": pattern.len(),
                    "hybrid_override_pattern": pattern,
                    "intermediate_size": self.shared_intermediate,
                    "mlp_hidden_act": "relu2",
                    "mamba_hidden_act": "silu",
                    "layer_norm_epsilon": self.norm_eps,
                    "mamba_num_heads": m.nheads,
                    "mamba_head_dim": m.headdim,
                    "ssm_state_size": m.d_state,
                    "n_groups": m.n_groups,
                    "conv_kernel": m.d_conv,
                    "expand": m.expand,
                    "use_conv_bias": m.use_conv_bias,
                    "use_bias": m.use_bias,
                    "attention_bias": false,
                    "mlp_bias": false,
                });
                if let (Routing::Sigmoid { groups, keep_groups, normalize, scale }, Value::Object(o)) =
                    (self.routing, &mut json)
                {
                    o.extend([
                        ("n_routed_experts".to_string(), serde_json::json!(self.n_experts)),
                        ("num_experts_per_tok".to_string(), serde_json::json!(self.top_k)),
                        ("moe_intermediate_size".to_string(), serde_json::json!(self.expert_intermediate)),
                        (
                            "moe_shared_expert_intermediate_size".to_string(),
                            serde_json::json!(self.moe_shared_intermediate),
                        ),
                        ("n_group".to_string(), serde_json::json!(groups)),
                        ("topk_group".to_string(), serde_json::json!(keep_groups)),
                        ("norm_topk_prob".to_string(), serde_json::json!(normalize)),
                        ("routed_scaling_factor".to_string(), serde_json::json!(scale)),
                    ]);
                    if self.moe_latent > 0 {
                        o.insert("moe_latent_size".to_string(), serde_json::json!(self.moe_latent));
                    }
                }
                json
            }
            HybridFamily::FalconH1 => Value::Object(self.falcon_h1_json()),
            HybridFamily::Bamba => serde_json::json!({
                "architectures": ["BambaForCausalLM"],
                "model_type": "bamba",
                "attn_layer_indices": self.attention_layers(),
                "intermediate_size": self.shared_intermediate,
                "hidden_act": "silu",
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": self.rope_theta,
                    "partial_rotary_factor": self.partial_rotary_factor,
                },
            }),
        };
        let (Value::Object(all), Value::Object(extra), Value::Object(granite_mamba)) =
            (&mut json, extra, granite_mamba)
        else {
            unreachable!("all are JSON objects")
        };
        if self.family != HybridFamily::NemotronH {
            all.extend(granite_mamba);
        }
        all.extend(extra);
        json
    }

    /// The Falcon-H1 keys of [`GraniteHybridConfig::to_hf_json`], its multipliers as read.
    fn falcon_h1_json(&self) -> Map<String, Value> {
        let m = &self.mamba;
        let Value::Object(mut o) = serde_json::json!({
            "architectures": ["FalconH1ForCausalLM"],
            "model_type": "falcon_h1",
            "intermediate_size": self.shared_intermediate,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "embedding_multiplier": self.embedding_multiplier,
            "lm_head_multiplier": 1.0 / self.logits_scaling,
            "mamba_d_ssm": m.d_inner(),
            "mamba_proj_bias": m.use_bias,
            "projectors_bias": m.use_bias,
            "mamba_rms_norm": m.gate_norm != GateNorm::GateOnly,
            "mamba_norm_before_gate": m.gate_norm == GateNorm::NormThenGate,
            "attention_bias": false,
            "mlp_bias": false,
        }) else {
            unreachable!("a JSON object")
        };
        o.extend(self.mup.unwrap_or(Mup::ONE).to_json());
        o
    }

    /// The sizes, in one line.
    pub fn describe(&self) -> String {
        let att = self.attention_layers();
        format!(
            "{}: d_model {}, {} layers{} ({} Mamba-2: {} heads x {} x d_state {}; {} attention at {:?}: {} heads, {} kv, head_dim {}, {}), {}, vocab {}",
            self.family.name(),
            self.d_model,
            self.n_layer(),
            match self.hf_blocks().last() {
                Some(&(m, mlp)) if self.family == HybridFamily::NemotronH => {
                    format!(" from the checkpoint's {} blocks", mlp.unwrap_or(m) + 1)
                }
                _ if self.family == HybridFamily::FalconH1 => ", Mamba-2 and attention side by side in each".into(),
                _ => String::new(),
            },
            self.n_mamba(),
            self.mamba.nheads,
            self.mamba.headdim,
            self.mamba.d_state,
            att.len(),
            att,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            match (self.rope_theta.is_some(), self.partial_rotary_factor == 1.0) {
                (false, _) => "NoPE".to_string(),
                (true, true) => "RoPE".to_string(),
                (true, false) => format!("RoPE on {} of {} channels", self.rotary_dim(), self.head_dim),
            },
            if self.n_experts > 0 && self.family == HybridFamily::NemotronH {
                let dense = self.n_layer() - self.without_mlp.len() - self.moe_layers.len();
                format!(
                    "{}after {} mixers sigmoid-routed MoE {} of {} experts ({}{}) + shared expert {}",
                    if dense > 0 { format!("relu² MLP {} after {dense} mixers; ", self.shared_intermediate) } else { String::new() },
                    self.moe_layers.len(),
                    self.top_k,
                    self.n_experts,
                    self.expert_intermediate,
                    if self.moe_latent > 0 { format!(" in a latent width of {}", self.moe_latent) } else { String::new() },
                    self.moe_shared_intermediate
                )
            } else if self.n_experts > 0 {
                format!("MoE {} of {} experts + shared MLP {}", self.top_k, self.n_experts, self.shared_intermediate)
            } else {
                match (self.mlp_kind, self.without_mlp.len()) {
                    (MlpKind::SwiGlu, 0) => format!("MLP {}", self.shared_intermediate),
                    (MlpKind::SwiGlu, n) => format!("MLP {} after {} mixers", self.shared_intermediate, self.n_layer() - n),
                    (MlpKind::Relu2, n) => {
                        format!("relu² MLP {} after {} mixers", self.shared_intermediate, self.n_layer() - n)
                    }
                }
            },
            self.vocab_size
        )
    }
}

/// Falcon-H1's µP multipliers, named as in its `config.json` (folded into the CPU engine's copy
/// of the weights by `Mup::fold`, in [`super::falcon_h1`]).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Mup {
    /// `ssm_in_multiplier`: the Mamba mixer's input.
    pub ssm_in: f64,
    /// `ssm_multipliers`: the in-projection's z, x, B, C and dt outputs.
    pub ssm: [f64; 5],
    /// `ssm_out_multiplier`: the Mamba mixer's output.
    pub ssm_out: f64,
    /// `attention_in_multiplier`: the attention's input.
    pub attention_in: f64,
    /// `key_multiplier`: the keys (before RoPE, which is linear).
    pub key: f64,
    /// `attention_out_multiplier`: the attention's output.
    pub attention_out: f64,
    /// `mlp_multipliers`: the MLP's gate projection and its down projection.
    pub mlp: [f64; 2],
}

impl Mup {
    /// Every multiplier 1.
    pub const ONE: Mup = Mup {
        ssm_in: 1.0,
        ssm: [1.0; 5],
        ssm_out: 1.0,
        attention_in: 1.0,
        key: 1.0,
        attention_out: 1.0,
        mlp: [1.0; 2],
    };

    /// Each multiplier under its config key.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut o = Map::new();
        for (key, v) in [
            ("ssm_in_multiplier", serde_json::json!(self.ssm_in)),
            ("ssm_multipliers", serde_json::json!(self.ssm)),
            ("ssm_out_multiplier", serde_json::json!(self.ssm_out)),
            ("attention_in_multiplier", serde_json::json!(self.attention_in)),
            ("key_multiplier", serde_json::json!(self.key)),
            ("attention_out_multiplier", serde_json::json!(self.attention_out)),
            ("mlp_multipliers", serde_json::json!(self.mlp)),
        ] {
            o.insert(key.to_string(), v);
        }
        o
    }
}

/// RoPE's parameters as transformers reads them: a non-empty `rope_scaling` object (older
/// configs) before `rope_parameters` (transformers 5).
fn rope_params<'a>(f: &Fields<'a>) -> Option<&'a Map<String, Value>> {
    match f.map.get("rope_scaling") {
        Some(Value::Object(p)) if !p.is_empty() => Some(p),
        _ => match f.map.get("rope_parameters") {
            Some(Value::Object(p)) => Some(p),
            _ => None,
        },
    }
}

/// The share of a head's channels RoPE rotates: `partial_rotary_factor` among RoPE's
/// parameters, else `default` (transformers ignores a top-level one: Bamba's config replaces it
/// by 0.5).
pub(super) fn partial_rotary_factor(f: &Fields<'_>, default: f64) -> Result<f64> {
    match rope_params(f).and_then(|p| p.get("partial_rotary_factor")) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().ok_or_else(|| {
            Error::config(f.path, format!("field `rope_parameters.partial_rotary_factor` must be a number, found {v}"))
        }),
    }
}

/// A Nemotron-H config's blocks as the hub's pattern letters (`M` Mamba, `*` attention, `-`
/// MLP, `E` experts): from `layers_block_type` (or its alias `layer_types`), else from
/// `hybrid_override_pattern`, as transformers reads them (the list wins).
fn nemotron_blocks(f: &Fields<'_>) -> Result<Vec<char>> {
    let key = if f.map.contains_key("layers_block_type") { "layers_block_type" } else { "layer_types" };
    let blocks: Vec<char> = match (f.map.get(key), f.map.get("hybrid_override_pattern")) {
        (Some(Value::Array(a)), _) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v.as_str() {
                Some("mamba" | "linear_attention") => Ok('M'),
                Some("attention" | "full_attention") => Ok('*'),
                Some("mlp") => Ok('-'),
                Some("moe") => Ok('E'),
                other => Err(Error::config(
                    f.path,
                    format!(
                        "{key}[{i}] is {other:?}; Nemotron-H blocks are \"mamba\", \"attention\", \"mlp\" and \"moe\""
                    ),
                )),
            })
            .collect::<Result<_>>()?,
        (None | Some(Value::Null), Some(Value::String(p))) => p
            .chars()
            .enumerate()
            .map(|(i, c)| match c {
                'M' | '*' | '-' | 'E' => Ok(c),
                _ => Err(Error::config(
                    f.path,
                    format!("hybrid_override_pattern[{i}] is {c:?}; its letters are M, *, - and E"),
                )),
            })
            .collect::<Result<_>>()?,
        (Some(v), _) if !v.is_null() => return Err(f.err(key, "a list of block kinds")),
        (_, Some(v)) if !v.is_null() => return Err(f.err("hybrid_override_pattern", "a string of M, *, - and E")),
        _ => {
            return Err(Error::config(
                f.path,
                "neither `layers_block_type` nor `hybrid_override_pattern` says which blocks the model has",
            ))
        }
    };
    if blocks.is_empty() {
        return Err(Error::config(f.path, "the model has no blocks"));
    }
    Ok(blocks)
}

/// Refuses, by name, an activation other than SiLU (`hidden_act`) and any of the `biases` set.
pub(super) fn silu_without(f: &Fields<'_>, biases: &[&str]) -> Result<()> {
    if let Some(act) = f.map.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(Error::config(f.path, format!("hidden_act is {act:?}; picaso runs \"silu\" (SwiGLU) MLPs")));
        }
    }
    for &key in biases {
        if f.bool_or(key, false)? {
            return Err(Error::config(f.path, format!("`{key}: true` is not supported by picaso")));
        }
    }
    Ok(())
}

/// The Mamba-2 settings as Granite 4.0 H, Bamba and Falcon-H1 configs spell them (`mamba_*`,
/// transformers' defaults), for mixers of `(heads, head_dim, expand)`, without biases, with
/// Mamba-2's gate norm; `n_layer` and `vocab_size` are the caller's to set.
pub(super) fn granite_mamba(
    f: &Fields<'_>,
    d_model: usize,
    (nheads, headdim, expand): (usize, usize, usize),
    norm_eps: f64,
) -> Result<Mamba2Config> {
    Ok(Mamba2Config {
        d_model,
        n_layer: 0,
        vocab_size: 0,
        d_state: f.usize_or("mamba_d_state", 256)?,
        headdim,
        nheads,
        expand,
        n_groups: f.usize_or("mamba_n_groups", 1)?,
        d_conv: f.usize_or("mamba_d_conv", 4)?,
        norm_eps,
        gated_norm_eps: norm_eps,
        time_step_limit: f.limit("time_step_limit")?,
        tie_embeddings: f.bool_or("tie_word_embeddings", false)?,
        use_bias: false,
        use_conv_bias: f.bool_or("mamba_conv_bias", true)?,
        gate_norm: GateNorm::NormGated,
        format: CheckpointFormat::HfTransformers,
    })
}

/// `num_key_value_heads` with Bamba's and Nemotron-H's defaults: 8 when the key is absent, all
/// `n_heads` when it is null.
pub(super) fn kv_heads_or_8(f: &Fields<'_>, n_heads: usize) -> Result<usize> {
    match f.map.get("num_key_value_heads") {
        None => Ok(8),
        Some(Value::Null) => Ok(n_heads),
        Some(_) => f.usize("num_key_value_heads"),
    }
}

/// At most 2^24 layers, checked before anything is allocated per layer.
pub(super) fn layer_count(f: &Fields<'_>) -> Result<usize> {
    let n = f.usize("num_hidden_layers")?;
    if n == 0 || n > 1 << 24 {
        return Err(Error::config(f.path, format!("`num_hidden_layers` is {n}; it must be between 1 and 2^24")));
    }
    Ok(n)
}

/// RoPE's base from `rope_parameters` (transformers 5) or `rope_theta` (the hub's); only the
/// default (unscaled) rotary embedding is supported.
pub(super) fn rope_theta(f: &Fields<'_>, path: &Path) -> Result<f64> {
    if let Some(p) = rope_params(f) {
        if let Some(kind) = p.get("rope_type").or_else(|| p.get("type")).and_then(Value::as_str) {
            if kind != "default" {
                return Err(Error::config(
                    path,
                    format!("rope_type {kind:?} is not supported by picaso (only the default RoPE)"),
                ));
            }
        }
        if let Some(t) = p.get("rope_theta").and_then(Value::as_f64) {
            return Ok(t);
        }
    }
    f.f64_or("rope_theta", 10000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The benchmark presets are valid models with their attention layers where
    /// `make_random_granite.py` puts them.
    #[test]
    fn the_benchmark_presets_are_valid_granite_layouts() {
        for (c, at, n) in [
            (GraniteHybridConfig::granite_350m_like(), [4, 12, 20, 28], 32),
            (GraniteHybridConfig::granite_micro_like(), [5, 15, 25, 35], 40),
        ] {
            c.validate(Path::new("preset")).unwrap();
            assert_eq!((c.n_layer(), c.attention_layers(), c.n_mamba()), (n, at.to_vec(), n - 4));
            assert_eq!(c.mamba.d_inner(), 2 * c.d_model);
        }
    }
}
