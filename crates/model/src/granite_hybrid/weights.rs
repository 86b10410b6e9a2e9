//! [`GraniteHybridWeights`]: a Granite 4.0 H, Bamba, Nemotron-H or Falcon-H1 checkpoint's tensors
//! (one file or hub shards, f32 or bf16), named as transformers names them, validated against the
//! config.

use std::collections::HashMap;
use std::path::Path;

use super::config::{GraniteHybridConfig, HybridFamily, LayerKind, Routing};
use crate::error::{Error, Result};
use crate::mamba2::{GateNorm, LayerWeights};
use crate::weights::{fingerprint, normal_sampler, read_tensors, write_checkpoint, HostTensor, Take};

/// One layer's mixer weights.
#[derive(Debug, Clone)]
pub enum MixerWeights {
    /// A Mamba-2 mixer (its `norm` field holds the layer's input RMSNorm).
    Mamba(LayerWeights),
    /// Grouped-query attention.
    Attention(AttentionWeights),
    /// Both on the same normed input, their outputs summed (Falcon-H1).
    Parallel(LayerWeights, AttentionWeights),
}

impl MixerWeights {
    /// The Mamba-2 mixer, if the layer has one.
    pub fn mamba(&self) -> Option<&LayerWeights> {
        match self {
            Self::Mamba(w) | Self::Parallel(w, _) => Some(w),
            Self::Attention(_) => None,
        }
    }
    /// The attention, if the layer has one.
    pub fn attention(&self) -> Option<&AttentionWeights> {
        match self {
            Self::Attention(a) | Self::Parallel(_, a) => Some(a),
            Self::Mamba(_) => None,
        }
    }
    /// The Mamba-2 mixer and the attention, each if the layer has it, to change.
    pub fn parts_mut(&mut self) -> (Option<&mut LayerWeights>, Option<&mut AttentionWeights>) {
        match self {
            Self::Mamba(w) => (Some(w), None),
            Self::Attention(a) => (None, Some(a)),
            Self::Parallel(w, a) => (Some(w), Some(a)),
        }
    }
    /// The Mamba-2 mixer and the attention, each if the layer has it, to keep.
    pub fn into_parts(self) -> (Option<LayerWeights>, Option<AttentionWeights>) {
        match self {
            Self::Mamba(w) => (Some(w), None),
            Self::Attention(a) => (None, Some(a)),
            Self::Parallel(w, a) => (Some(w), Some(a)),
        }
    }
}

/// Grouped-query attention's projections, without biases.
#[derive(Debug, Clone)]
pub struct AttentionWeights {
    /// (n_heads * head_dim, d_model).
    pub q: Vec<f32>,
    /// (n_kv_heads * head_dim, d_model).
    pub k: Vec<f32>,
    /// (n_kv_heads * head_dim, d_model).
    pub v: Vec<f32>,
    /// (d_model, n_heads * head_dim).
    pub o: Vec<f32>,
}

/// The routed experts of one layer.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router (n_experts, d_model).
    pub router: Vec<f32>,
    /// The router's correction bias, added to the scores to choose experts but not to weigh
    /// them (Nemotron 3's `e_score_correction_bias`).
    pub bias: Option<Vec<f32>>,
    /// Each expert's gate and up projections, (n_experts, 2 * inner, d_model): gate rows first;
    /// relu² experts (Nemotron 3): the up projection, (n_experts, inner, width), `width` the
    /// latent width if the experts have one, else d_model.
    pub gate_up: Vec<f32>,
    /// Each expert's down projection, (n_experts, width, inner).
    pub down: Vec<f32>,
    /// Nemotron 3's latent projections around the experts: down to the latent width (latent,
    /// d_model), and the experts' weighted sum back up (d_model, latent).
    pub latent: Option<(Vec<f32>, Vec<f32>)>,
}

/// The MLP after a layer's mixer, with the RMSNorm before it.
#[derive(Debug, Clone)]
pub struct MlpWeights {
    /// RMSNorm before the MLP (d_model).
    pub norm: Vec<f32>,
    /// SwiGLU: the gate and up projections (2 * inner, d_model), gate rows first; relu²: the
    /// up projection (inner, d_model).
    pub input: Vec<f32>,
    /// The down projection (d_model, inner).
    pub output: Vec<f32>,
}

/// One layer: input norm, mixer, the MLP (absent after a Nemotron-H mixer block no `mlp`
/// block follows) and optional experts.
#[derive(Debug, Clone)]
pub struct GraniteLayerWeights {
    /// Input RMSNorm (d_model).
    pub input_norm: Vec<f32>,
    /// The mixer.
    pub mixer: MixerWeights,
    /// The MLP and its norm.
    pub mlp: Option<MlpWeights>,
    /// The routed experts, if any.
    pub moe: Option<MoeWeights>,
}

/// All weights of a hybrid model, as its checkpoint holds them.
#[derive(Debug, Clone)]
pub struct GraniteHybridWeights {
    /// Token embeddings (vocab, d_model).
    pub embedding: Vec<f32>,
    /// One entry per layer.
    pub layers: Vec<GraniteLayerWeights>,
    /// Final RMSNorm (d_model).
    pub norm_f: Vec<f32>,
    /// Untied LM head (vocab, d_model).
    pub lm_head: Option<Vec<f32>>,
}

impl GraniteHybridWeights {
    /// Loads and validates the weights in `dir`.
    pub fn load(dir: &Path, c: &GraniteHybridConfig) -> Result<Self> {
        Self::from_tensors(dir, c, read_tensors(dir)?)
    }

    /// Validates a name → tensor map against `c`. Experts are read in the hub's spelling
    /// (`block_sparse_moe.input_linear`, `.output_linear`, `.router.layer`) or transformers 5's
    /// (`.experts.gate_up_proj`, `.experts.down_proj`, `.router.weight`); a Nemotron-H model's
    /// tensors under the hub's `backbone.` or transformers 5's `model.`, its multi-token
    /// prediction head (`mtp.*`, unused by a forward pass, as transformers ignores it) dropped.
    pub fn from_tensors(dir: &Path, c: &GraniteHybridConfig, mut map: HashMap<String, HostTensor>) -> Result<Self> {
        let prefix = match c.family {
            HybridFamily::NemotronH => {
                map.retain(|name, _| !name.starts_with("mtp."));
                if map.contains_key("model.embeddings.weight") {
                    "model"
                } else {
                    "backbone"
                }
            }
            HybridFamily::FalconH1 => {
                // Unused by the computation, as transformers leaves them: a µP vector saved as a
                // buffer, and the mixer norm's weight of a model that runs without it.
                let no_norm = c.mamba.gate_norm == GateNorm::GateOnly;
                map.retain(|name, _| {
                    !(name.ends_with(".mamba.mup_vector") || (no_norm && name.ends_with(".mamba.norm.weight")))
                });
                "model"
            }
            _ => "model",
        };
        let names = Names { family: c.family, prefix };
        let mut t = Take { dir, map };
        let (d, v) = (c.d_model, c.vocab_size);
        let m = &c.mamba;
        let embedding = t.get(&names.embedding(), &[v, d])?;
        let mut layers = Vec::with_capacity(c.n_layer());
        for (i, (kind, (block, mlp_block))) in c.layers.iter().zip(c.hf_blocks()).enumerate() {
            let inner = c.mlp_inner(i);
            let input_norm = t.get(&names.input_norm(block), &[d])?;
            let mamba = |t: &mut Take<'_>| -> Result<LayerWeights> {
                let x = names.mamba(block);
                Ok(LayerWeights {
                    norm: input_norm.clone(),
                    in_proj: t.get(&format!("{x}.in_proj.weight"), &[m.d_in_proj(), d])?,
                    in_proj_bias: t.opt(&format!("{x}.in_proj.bias"), &[m.d_in_proj()], m.use_bias)?,
                    conv_weight: t.get(&format!("{x}.conv1d.weight"), &[m.conv_dim(), 1, m.d_conv])?,
                    conv_bias: t.opt(&format!("{x}.conv1d.bias"), &[m.conv_dim()], m.use_conv_bias)?,
                    dt_bias: t.get(&format!("{x}.dt_bias"), &[m.nheads])?,
                    a_log: t.get(&format!("{x}.A_log"), &[m.nheads])?,
                    d: t.get(&format!("{x}.D"), &[m.nheads])?,
                    gated_norm: match m.gate_norm {
                        GateNorm::GateOnly => Vec::new(),
                        _ => t.get(&format!("{x}.norm.weight"), &[m.d_inner()])?,
                    },
                    out_proj: t.get(&format!("{x}.out_proj.weight"), &[d, m.d_inner()])?,
                    out_proj_bias: t.opt(&format!("{x}.out_proj.bias"), &[d], m.use_bias)?,
                })
            };
            let attention = |t: &mut Take<'_>| -> Result<AttentionWeights> {
                let a = names.attention(block);
                let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                Ok(AttentionWeights {
                    q: t.get(&format!("{a}.q_proj.weight"), &[q, d])?,
                    k: t.get(&format!("{a}.k_proj.weight"), &[kv, d])?,
                    v: t.get(&format!("{a}.v_proj.weight"), &[kv, d])?,
                    o: t.get(&format!("{a}.o_proj.weight"), &[d, q])?,
                })
            };
            let mixer = match kind {
                LayerKind::Mamba => MixerWeights::Mamba(mamba(&mut t)?),
                LayerKind::Attention => MixerWeights::Attention(attention(&mut t)?),
                LayerKind::Parallel => MixerWeights::Parallel(mamba(&mut t)?, attention(&mut t)?),
            };
            let moe = if c.has_experts(i) && c.family == HybridFamily::NemotronH {
                let Some(b) = mlp_block else {
                    return Err(Error::weights(
                        dir,
                        format!("layer {i} has experts but no MLP block; validate the config"),
                    ));
                };
                let (e, ei, x, w) = (c.n_experts, c.expert_intermediate, names.mixer(b), c.expert_width());
                // The hub's one tensor per expert, or transformers 5's stacked ones.
                let stacked = |t: &mut Take<'_>, name: &str, shape: [usize; 2]| -> Result<Vec<f32>> {
                    if t.map.contains_key(&format!("{x}.experts.{name}")) {
                        return t.get(&format!("{x}.experts.{name}"), &[e, shape[0], shape[1]]);
                    }
                    // Grown tensor by tensor: each is checked before it is kept.
                    let mut all = Vec::new();
                    for j in 0..e {
                        all.extend(t.get(&format!("{x}.experts.{j}.{name}.weight"), &shape)?);
                    }
                    Ok(all)
                };
                let gate_up = stacked(&mut t, "up_proj", [ei, w])?;
                let down = stacked(&mut t, "down_proj", [w, ei])?;
                let latent = match c.moe_latent {
                    0 => None,
                    l => Some((
                        t.get(&format!("{x}.fc1_latent_proj.weight"), &[l, d])?,
                        t.get(&format!("{x}.fc2_latent_proj.weight"), &[d, l])?,
                    )),
                };
                Some(MoeWeights {
                    router: t.get(&format!("{x}.gate.weight"), &[e, d])?,
                    bias: Some(t.get(&format!("{x}.gate.e_score_correction_bias"), &[e])?),
                    gate_up,
                    down,
                    latent,
                })
            } else if c.has_experts(i) {
                let (e, ei, x) = (c.n_experts, c.expert_intermediate, format!("model.layers.{i}.block_sparse_moe"));
                let either = |t: &mut Take<'_>, hub: &str, new: &str, shape: &[usize]| {
                    let name = if t.map.contains_key(&format!("{x}.{new}")) { new } else { hub };
                    t.get(&format!("{x}.{name}"), shape)
                };
                Some(MoeWeights {
                    router: either(&mut t, "router.layer.weight", "router.weight", &[e, d])?,
                    bias: None,
                    gate_up: either(&mut t, "input_linear.weight", "experts.gate_up_proj", &[e, 2 * ei, d])?,
                    down: either(&mut t, "output_linear.weight", "experts.down_proj", &[e, d, ei])?,
                    latent: None,
                })
            } else {
                None
            };
            let mlp = match mlp_block {
                None => None,
                Some(b) => {
                    let p = names.block(b);
                    let (input, output) = match c.family {
                        HybridFamily::Granite => (
                            t.get(&format!("{p}.shared_mlp.input_linear.weight"), &[2 * inner, d])?,
                            t.get(&format!("{p}.shared_mlp.output_linear.weight"), &[d, inner])?,
                        ),
                        HybridFamily::Bamba | HybridFamily::FalconH1 => {
                            let mut gate_up = t.get(&format!("{p}.feed_forward.gate_proj.weight"), &[inner, d])?;
                            gate_up.extend(t.get(&format!("{p}.feed_forward.up_proj.weight"), &[inner, d])?);
                            (gate_up, t.get(&format!("{p}.feed_forward.down_proj.weight"), &[d, inner])?)
                        }
                        HybridFamily::NemotronH => {
                            let x = names.nemotron_mlp(b, c.has_experts(i));
                            (
                                t.get(&format!("{x}.up_proj.weight"), &[inner, d])?,
                                t.get(&format!("{x}.down_proj.weight"), &[d, inner])?,
                            )
                        }
                    };
                    Some(MlpWeights { norm: t.get(&names.post_norm(b), &[d])?, input, output })
                }
            };
            layers.push(GraniteLayerWeights { input_norm, mixer, mlp, moe });
        }
        let norm_f = t.get(&names.norm_f(), &[d])?;
        let lm_head = if c.tie_embeddings {
            t.map.remove("lm_head.weight");
            None
        } else {
            Some(t.get("lm_head.weight", &[v, d])?)
        };
        if let Some(name) = t.map.keys().min() {
            return Err(Error::weights(
                dir,
                format!("tensor `{name}` is not part of a {} model as config.json describes it", c.describe()),
            ));
        }
        Ok(Self { embedding, layers, norm_f, lm_head })
    }

    /// Visits every tensor under its hub name for `c`'s family (a Nemotron-H model's under
    /// `backbone.`), in a fixed order.
    pub fn for_each(&self, c: &GraniteHybridConfig, mut f: impl FnMut(&str, &[f32])) {
        let names = Names::writing(c.family);
        f(&names.embedding(), &self.embedding);
        for (i, (l, (block, mlp_block))) in self.layers.iter().zip(c.hf_blocks()).enumerate() {
            f(&names.input_norm(block), &l.input_norm);
            if let Some(w) = l.mixer.mamba() {
                let x = names.mamba(block);
                f(&format!("{x}.in_proj.weight"), &w.in_proj);
                if let Some(b) = &w.in_proj_bias {
                    f(&format!("{x}.in_proj.bias"), b);
                }
                f(&format!("{x}.conv1d.weight"), &w.conv_weight);
                if let Some(b) = &w.conv_bias {
                    f(&format!("{x}.conv1d.bias"), b);
                }
                f(&format!("{x}.dt_bias"), &w.dt_bias);
                f(&format!("{x}.A_log"), &w.a_log);
                f(&format!("{x}.D"), &w.d);
                if !w.gated_norm.is_empty() {
                    f(&format!("{x}.norm.weight"), &w.gated_norm);
                }
                f(&format!("{x}.out_proj.weight"), &w.out_proj);
                if let Some(b) = &w.out_proj_bias {
                    f(&format!("{x}.out_proj.bias"), b);
                }
            }
            if let Some(AttentionWeights { q, k, v, o }) = l.mixer.attention() {
                let a = names.attention(block);
                for (n, w) in [("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)] {
                    f(&format!("{a}.{n}.weight"), w);
                }
            }
            if let (Some(mlp), Some(b)) = (&l.mlp, mlp_block) {
                let p = names.block(b);
                f(&names.post_norm(b), &mlp.norm);
                match c.family {
                    HybridFamily::Granite => {
                        f(&format!("{p}.shared_mlp.input_linear.weight"), &mlp.input);
                        f(&format!("{p}.shared_mlp.output_linear.weight"), &mlp.output);
                    }
                    HybridFamily::Bamba | HybridFamily::FalconH1 => {
                        let (gate, up) = mlp.input.split_at(mlp.input.len() / 2);
                        f(&format!("{p}.feed_forward.gate_proj.weight"), gate);
                        f(&format!("{p}.feed_forward.up_proj.weight"), up);
                        f(&format!("{p}.feed_forward.down_proj.weight"), &mlp.output);
                    }
                    HybridFamily::NemotronH => {
                        let x = names.nemotron_mlp(b, l.moe.is_some());
                        f(&format!("{x}.up_proj.weight"), &mlp.input);
                        f(&format!("{x}.down_proj.weight"), &mlp.output);
                    }
                }
            }
            if let (Some(moe), HybridFamily::NemotronH, Some(b)) = (&l.moe, c.family, mlp_block) {
                let x = names.mixer(b);
                f(&format!("{x}.gate.weight"), &moe.router);
                if let Some(bias) = &moe.bias {
                    f(&format!("{x}.gate.e_score_correction_bias"), bias);
                }
                if let Some((down, up)) = &moe.latent {
                    f(&format!("{x}.fc1_latent_proj.weight"), down);
                    f(&format!("{x}.fc2_latent_proj.weight"), up);
                }
                let e = moe.router.len() / c.d_model;
                let (up, down) = (moe.gate_up.len() / e, moe.down.len() / e);
                for j in 0..e {
                    f(&format!("{x}.experts.{j}.up_proj.weight"), &moe.gate_up[j * up..(j + 1) * up]);
                    f(&format!("{x}.experts.{j}.down_proj.weight"), &moe.down[j * down..(j + 1) * down]);
                }
            } else if let Some(moe) = &l.moe {
                let p = format!("model.layers.{i}.block_sparse_moe");
                f(&format!("{p}.router.layer.weight"), &moe.router);
                f(&format!("{p}.input_linear.weight"), &moe.gate_up);
                f(&format!("{p}.output_linear.weight"), &moe.down);
            }
        }
        f(&names.norm_f(), &self.norm_f);
        if let Some(h) = &self.lm_head {
            f("lm_head.weight", h);
        }
    }

    /// Number of parameters (a tied head counted once): every tensor [`Self::for_each`] visits.
    pub fn n_params(&self, c: &GraniteHybridConfig) -> usize {
        let mut n = 0;
        self.for_each(c, |_, t| n += t.len());
        n
    }

    /// The fingerprint every state of this model carries.
    pub fn fingerprint(&self, c: &GraniteHybridConfig) -> String {
        fingerprint("granite-hybrid", c.to_hf_json(), |f| self.for_each(c, |name, data| f(name, data)))
    }
}

impl GraniteHybridWeights {
    /// Random weights for `c` (seeded), scaled so activations stay O(1): for tests and
    /// benchmarks of shapes whose trained weights are not at hand. Mamba layers as
    /// [`crate::Mamba2Weights::random`]'s.
    pub fn random(c: &GraniteHybridConfig, seed: u64) -> Self {
        let mut normal = normal_sampler(seed);
        let (d, v) = (c.d_model, c.vocab_size);
        let mut mamba_layers = crate::Mamba2Weights::random(&c.mamba, seed ^ 0x9e37_79b9).layers.into_iter();
        let ones = |n: usize, normal: &mut dyn FnMut(usize, f32) -> Vec<f32>| -> Vec<f32> {
            normal(n, 0.1).iter().map(|x| 1.0 + x).collect()
        };
        let out_scale = 1.0 / (2.0 * c.n_layer() as f32).sqrt();
        let layers = c
            .layers
            .iter()
            .enumerate()
            .map(|(l, kind)| {
                let input_norm = ones(d, &mut normal);
                let mut mamba = || {
                    let mut w = mamba_layers.next().expect("one Mamba-2 layer per layer with a Mamba mixer");
                    w.norm = input_norm.clone();
                    if c.mamba.gate_norm == GateNorm::GateOnly {
                        w.gated_norm.clear();
                    }
                    w
                };
                let mut attention = || {
                    let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                    let s = 1.0 / (d as f32).sqrt();
                    AttentionWeights {
                        q: normal(q * d, s),
                        k: normal(kv * d, s),
                        v: normal(kv * d, s),
                        o: normal(d * q, out_scale / (q as f32).sqrt()),
                    }
                };
                let mixer = match kind {
                    LayerKind::Mamba => MixerWeights::Mamba(mamba()),
                    LayerKind::Attention => MixerWeights::Attention(attention()),
                    LayerKind::Parallel => MixerWeights::Parallel(mamba(), attention()),
                };
                let gates = c.mlp_kind.projections();
                let moe = c.has_experts(l).then(|| {
                    let (e, ei) = (c.n_experts, c.expert_intermediate);
                    MoeWeights {
                        router: normal(e * d, 1.0 / (d as f32).sqrt()),
                        bias: (c.routing != Routing::Softmax).then(|| normal(e, 0.1)),
                        gate_up: normal(e * gates * ei * c.expert_width(), 1.0 / (c.expert_width() as f32).sqrt()),
                        down: normal(e * c.expert_width() * ei, out_scale / (ei as f32).sqrt()),
                        latent: (c.moe_latent > 0).then(|| {
                            let l = c.moe_latent;
                            (normal(l * d, 1.0 / (d as f32).sqrt()), normal(d * l, 1.0 / (l as f32).sqrt()))
                        }),
                    }
                });
                let i = c.mlp_inner(l);
                let mlp = c.has_mlp(l).then(|| MlpWeights {
                    norm: ones(d, &mut normal),
                    input: normal(gates * i * d, 1.0 / (d as f32).sqrt()),
                    output: normal(d * i, out_scale / (i as f32).sqrt()),
                });
                GraniteLayerWeights { input_norm, mixer, mlp, moe }
            })
            .collect();
        Self {
            embedding: normal(v * d, 1.0),
            layers,
            norm_f: ones(d, &mut normal),
            lm_head: (!c.tie_embeddings).then(|| normal(v * d, 1.0 / (d as f32).sqrt())),
        }
    }

    /// Writes `config.json` (the hub's spelling) and `model.safetensors` (f32) into `dir`: a
    /// folder [`crate::Model::load`] and transformers both read.
    pub fn save_pretrained(&self, dir: &Path, c: &GraniteHybridConfig) -> Result<()> {
        let (d, m) = (c.d_model, &c.mamba);
        let names = Names::writing(c.family);
        let mut shapes: HashMap<String, Vec<usize>> = HashMap::new();
        shapes.insert(names.embedding(), vec![c.vocab_size, d]);
        shapes.insert("lm_head.weight".into(), vec![c.vocab_size, d]);
        for (i, (kind, (block, mlp_block))) in c.layers.iter().zip(c.hf_blocks()).enumerate() {
            if kind.has_mamba() {
                let x = names.mamba(block);
                shapes.insert(format!("{x}.in_proj.weight"), vec![m.d_in_proj(), d]);
                shapes.insert(format!("{x}.conv1d.weight"), vec![m.conv_dim(), 1, m.d_conv]);
                shapes.insert(format!("{x}.out_proj.weight"), vec![d, m.d_inner()]);
            }
            if kind.attends() {
                let (a, q, kv) = (names.attention(block), c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                shapes.insert(format!("{a}.q_proj.weight"), vec![q, d]);
                shapes.insert(format!("{a}.k_proj.weight"), vec![kv, d]);
                shapes.insert(format!("{a}.v_proj.weight"), vec![kv, d]);
                shapes.insert(format!("{a}.o_proj.weight"), vec![d, q]);
            }
            if let Some(b) = mlp_block {
                let (p, inner, ei) = (names.block(b), c.mlp_inner(i), c.expert_intermediate);
                shapes.insert(format!("{p}.shared_mlp.input_linear.weight"), vec![2 * inner, d]);
                shapes.insert(format!("{p}.shared_mlp.output_linear.weight"), vec![d, inner]);
                shapes.insert(format!("{p}.feed_forward.gate_proj.weight"), vec![inner, d]);
                shapes.insert(format!("{p}.feed_forward.up_proj.weight"), vec![inner, d]);
                shapes.insert(format!("{p}.feed_forward.down_proj.weight"), vec![d, inner]);
                shapes.insert(format!("{p}.mixer.up_proj.weight"), vec![inner, d]);
                shapes.insert(format!("{p}.mixer.down_proj.weight"), vec![d, inner]);
                shapes.insert(format!("{p}.mixer.shared_experts.up_proj.weight"), vec![inner, d]);
                shapes.insert(format!("{p}.mixer.shared_experts.down_proj.weight"), vec![d, inner]);
                shapes.insert(format!("{p}.mixer.gate.weight"), vec![c.n_experts, d]);
                let w = c.expert_width();
                for j in 0..c.n_experts {
                    shapes.insert(format!("{p}.mixer.experts.{j}.up_proj.weight"), vec![ei, w]);
                    shapes.insert(format!("{p}.mixer.experts.{j}.down_proj.weight"), vec![w, ei]);
                }
                shapes.insert(format!("{p}.mixer.fc1_latent_proj.weight"), vec![c.moe_latent, d]);
                shapes.insert(format!("{p}.mixer.fc2_latent_proj.weight"), vec![d, c.moe_latent]);
            }
            let (e, ei, p) = (c.n_experts, c.expert_intermediate, format!("model.layers.{i}.block_sparse_moe"));
            shapes.insert(format!("{p}.router.layer.weight"), vec![e, d]);
            shapes.insert(format!("{p}.input_linear.weight"), vec![e, 2 * ei, d]);
            shapes.insert(format!("{p}.output_linear.weight"), vec![e, d, ei]);
        }
        write_checkpoint(dir, &c.to_hf_json(), &shapes, |f| self.for_each(c, |name, data| f(name, data)))
    }
}

/// The tensor names of a family, by the checkpoint's block index (see
/// [`GraniteHybridConfig::hf_blocks`]).
struct Names {
    family: HybridFamily,
    /// What the model's tensors are under: `model` (a Nemotron-H checkpoint from the hub:
    /// `backbone`).
    prefix: &'static str,
}

impl Names {
    /// The names picaso writes (and fingerprints): the hub's.
    fn writing(family: HybridFamily) -> Self {
        Names { family, prefix: if family == HybridFamily::NemotronH { "backbone" } else { "model" } }
    }
    fn embedding(&self) -> String {
        match self.family {
            HybridFamily::NemotronH => format!("{}.embeddings.weight", self.prefix),
            _ => format!("{}.embed_tokens.weight", self.prefix),
        }
    }
    fn block(&self, b: usize) -> String {
        format!("{}.layers.{b}", self.prefix)
    }
    fn input_norm(&self, b: usize) -> String {
        match self.family {
            HybridFamily::NemotronH => format!("{}.norm.weight", self.block(b)),
            _ => format!("{}.input_layernorm.weight", self.block(b)),
        }
    }
    /// A Nemotron-H block's one module (Mamba, attention, MLP or experts).
    fn mixer(&self, b: usize) -> String {
        format!("{}.mixer", self.block(b))
    }
    /// The Mamba mixer's tensors' prefix.
    fn mamba(&self, b: usize) -> String {
        match self.family {
            HybridFamily::NemotronH => self.mixer(b),
            _ => format!("{}.mamba", self.block(b)),
        }
    }
    /// The attention's projections' prefix.
    fn attention(&self, b: usize) -> String {
        match self.family {
            HybridFamily::NemotronH => self.mixer(b),
            _ => format!("{}.self_attn", self.block(b)),
        }
    }
    /// A Nemotron-H MLP's prefix: an `mlp` block's module, or a `moe` block's shared expert.
    fn nemotron_mlp(&self, b: usize, experts: bool) -> String {
        if experts {
            format!("{}.shared_experts", self.mixer(b))
        } else {
            self.mixer(b)
        }
    }
    /// The RMSNorm before the MLP of block `b`.
    fn post_norm(&self, b: usize) -> String {
        let name = match self.family {
            HybridFamily::Granite => "post_attention_layernorm",
            HybridFamily::Bamba | HybridFamily::FalconH1 => "pre_ff_layernorm",
            HybridFamily::NemotronH => "norm",
        };
        format!("{}.{name}.weight", self.block(b))
    }
    fn norm_f(&self) -> String {
        match self.family {
            HybridFamily::Granite => format!("{}.norm.weight", self.prefix),
            HybridFamily::Bamba | HybridFamily::FalconH1 => format!("{}.final_layernorm.weight", self.prefix),
            HybridFamily::NemotronH => format!("{}.norm_f.weight", self.prefix),
        }
    }
}
