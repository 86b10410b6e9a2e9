//! [`GraniteHybridWeights`]: a Granite 4.0 H (or Bamba) checkpoint's tensors (one file or hub
//! shards, f32 or bf16), named as transformers names them, validated against the config.

use std::collections::HashMap;
use std::path::Path;

use super::config::{GraniteHybridConfig, HybridFamily, LayerKind};
use crate::error::{Error, Result};
use crate::mamba2::LayerWeights;
use crate::weights::{fingerprint, normal_sampler, read_tensors, write_checkpoint, HostTensor, Take};

/// One layer's mixer weights.
#[derive(Debug, Clone)]
pub enum MixerWeights {
    /// A Mamba-2 mixer (its `norm` field holds the layer's input RMSNorm).
    Mamba(LayerWeights),
    /// Grouped-query attention without biases.
    Attention {
        /// (n_heads * head_dim, d_model).
        q: Vec<f32>,
        /// (n_kv_heads * head_dim, d_model).
        k: Vec<f32>,
        /// (n_kv_heads * head_dim, d_model).
        v: Vec<f32>,
        /// (d_model, n_heads * head_dim).
        o: Vec<f32>,
    },
}

/// The routed experts of one layer.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router (n_experts, d_model).
    pub router: Vec<f32>,
    /// Each expert's gate and up projections, (n_experts, 2 * inner, d_model): gate rows first.
    pub gate_up: Vec<f32>,
    /// Each expert's down projection, (n_experts, d_model, inner).
    pub down: Vec<f32>,
}

/// One layer: input norm, mixer, post norm, shared MLP and optional experts.
#[derive(Debug, Clone)]
pub struct GraniteLayerWeights {
    /// Input RMSNorm (d_model).
    pub input_norm: Vec<f32>,
    /// The mixer.
    pub mixer: MixerWeights,
    /// RMSNorm before the MLP (d_model).
    pub post_norm: Vec<f32>,
    /// The shared SwiGLU MLP's gate and up projections (2 * inner, d_model): gate rows first.
    pub mlp_in: Vec<f32>,
    /// Its down projection (d_model, inner).
    pub mlp_out: Vec<f32>,
    /// The routed experts, if any.
    pub moe: Option<MoeWeights>,
}

/// All weights of a Granite 4.0 H model.
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
    /// (`.experts.gate_up_proj`, `.experts.down_proj`, `.router.weight`).
    pub fn from_tensors(dir: &Path, c: &GraniteHybridConfig, map: HashMap<String, HostTensor>) -> Result<Self> {
        let mut t = Take { dir, map };
        let (d, v) = (c.d_model, c.vocab_size);
        let m = &c.mamba;
        let names = Names::of(c.family);
        let embedding = t.get("model.embed_tokens.weight", &[v, d])?;
        let mut layers = Vec::with_capacity(c.n_layer());
        for (i, kind) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let input_norm = t.get(&format!("{p}.input_layernorm.weight"), &[d])?;
            let mixer = match kind {
                LayerKind::Mamba => {
                    let x = format!("{p}.mamba");
                    MixerWeights::Mamba(LayerWeights {
                        norm: input_norm.clone(),
                        in_proj: t.get(&format!("{x}.in_proj.weight"), &[m.d_in_proj(), d])?,
                        in_proj_bias: None,
                        conv_weight: t.get(&format!("{x}.conv1d.weight"), &[m.conv_dim(), 1, m.d_conv])?,
                        conv_bias: t.opt(&format!("{x}.conv1d.bias"), &[m.conv_dim()], m.use_conv_bias)?,
                        dt_bias: t.get(&format!("{x}.dt_bias"), &[m.nheads])?,
                        a_log: t.get(&format!("{x}.A_log"), &[m.nheads])?,
                        d: t.get(&format!("{x}.D"), &[m.nheads])?,
                        gated_norm: t.get(&format!("{x}.norm.weight"), &[m.d_inner()])?,
                        out_proj: t.get(&format!("{x}.out_proj.weight"), &[d, m.d_inner()])?,
                        out_proj_bias: None,
                    })
                }
                LayerKind::Attention => {
                    let a = format!("{p}.self_attn");
                    let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                    MixerWeights::Attention {
                        q: t.get(&format!("{a}.q_proj.weight"), &[q, d])?,
                        k: t.get(&format!("{a}.k_proj.weight"), &[kv, d])?,
                        v: t.get(&format!("{a}.v_proj.weight"), &[kv, d])?,
                        o: t.get(&format!("{a}.o_proj.weight"), &[d, q])?,
                    }
                }
            };
            let inner = c.shared_intermediate;
            let moe = if c.n_experts > 0 {
                let (e, ei, x) = (c.n_experts, c.expert_intermediate, format!("{p}.block_sparse_moe"));
                let either = |t: &mut Take<'_>, hub: &str, new: &str, shape: &[usize]| {
                    let name = if t.map.contains_key(&format!("{x}.{new}")) { new } else { hub };
                    t.get(&format!("{x}.{name}"), shape)
                };
                Some(MoeWeights {
                    router: either(&mut t, "router.layer.weight", "router.weight", &[e, d])?,
                    gate_up: either(&mut t, "input_linear.weight", "experts.gate_up_proj", &[e, 2 * ei, d])?,
                    down: either(&mut t, "output_linear.weight", "experts.down_proj", &[e, d, ei])?,
                })
            } else {
                None
            };
            let (mlp_in, mlp_out) = match c.family {
                HybridFamily::Granite => (
                    t.get(&format!("{p}.shared_mlp.input_linear.weight"), &[2 * inner, d])?,
                    t.get(&format!("{p}.shared_mlp.output_linear.weight"), &[d, inner])?,
                ),
                HybridFamily::Bamba => {
                    let mut gate_up = t.get(&format!("{p}.feed_forward.gate_proj.weight"), &[inner, d])?;
                    gate_up.extend(t.get(&format!("{p}.feed_forward.up_proj.weight"), &[inner, d])?);
                    (gate_up, t.get(&format!("{p}.feed_forward.down_proj.weight"), &[d, inner])?)
                }
            };
            layers.push(GraniteLayerWeights {
                input_norm,
                mixer,
                post_norm: t.get(&format!("{p}.{}.weight", names.post_norm), &[d])?,
                mlp_in,
                mlp_out,
                moe,
            });
        }
        let norm_f = t.get(names.norm_f, &[d])?;
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

    /// Visits every tensor under its hub name for `family`, in a fixed order.
    pub fn for_each(&self, family: HybridFamily, mut f: impl FnMut(&str, &[f32])) {
        let names = Names::of(family);
        f("model.embed_tokens.weight", &self.embedding);
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            f(&format!("{p}.input_layernorm.weight"), &l.input_norm);
            match &l.mixer {
                MixerWeights::Mamba(w) => {
                    let x = format!("{p}.mamba");
                    f(&format!("{x}.in_proj.weight"), &w.in_proj);
                    f(&format!("{x}.conv1d.weight"), &w.conv_weight);
                    if let Some(b) = &w.conv_bias {
                        f(&format!("{x}.conv1d.bias"), b);
                    }
                    f(&format!("{x}.dt_bias"), &w.dt_bias);
                    f(&format!("{x}.A_log"), &w.a_log);
                    f(&format!("{x}.D"), &w.d);
                    f(&format!("{x}.norm.weight"), &w.gated_norm);
                    f(&format!("{x}.out_proj.weight"), &w.out_proj);
                }
                MixerWeights::Attention { q, k, v, o } => {
                    for (n, w) in [("q_proj", q), ("k_proj", k), ("v_proj", v), ("o_proj", o)] {
                        f(&format!("{p}.self_attn.{n}.weight"), w);
                    }
                }
            }
            f(&format!("{p}.{}.weight", names.post_norm), &l.post_norm);
            match family {
                HybridFamily::Granite => {
                    f(&format!("{p}.shared_mlp.input_linear.weight"), &l.mlp_in);
                    f(&format!("{p}.shared_mlp.output_linear.weight"), &l.mlp_out);
                }
                HybridFamily::Bamba => {
                    let (gate, up) = l.mlp_in.split_at(l.mlp_in.len() / 2);
                    f(&format!("{p}.feed_forward.gate_proj.weight"), gate);
                    f(&format!("{p}.feed_forward.up_proj.weight"), up);
                    f(&format!("{p}.feed_forward.down_proj.weight"), &l.mlp_out);
                }
            }
            if let Some(moe) = &l.moe {
                f(&format!("{p}.block_sparse_moe.router.layer.weight"), &moe.router);
                f(&format!("{p}.block_sparse_moe.input_linear.weight"), &moe.gate_up);
                f(&format!("{p}.block_sparse_moe.output_linear.weight"), &moe.down);
            }
        }
        f(names.norm_f, &self.norm_f);
        if let Some(h) = &self.lm_head {
            f("lm_head.weight", h);
        }
    }

    /// Number of parameters (a tied head counted once).
    pub fn n_params(&self) -> usize {
        let mut n = 0;
        self.for_each(HybridFamily::Granite, |_, t| n += t.len());
        n
    }

    /// The fingerprint every state of this model carries.
    pub fn fingerprint(&self, c: &GraniteHybridConfig) -> String {
        fingerprint("granite-hybrid", c.to_hf_json(), |f| self.for_each(c.family, |name, data| f(name, data)))
    }
}

impl GraniteHybridWeights {
    /// Random weights for `c` (seeded), scaled so activations stay O(1): for tests and
    /// benchmarks of shapes whose trained weights are not at hand. Mamba layers as
    /// [`crate::Mamba2Weights::random`]'s.
    pub fn random(c: &GraniteHybridConfig, seed: u64) -> Self {
        let mut normal = normal_sampler(seed);
        let (d, v) = (c.d_model, c.vocab_size);
        let mut mamba = crate::Mamba2Weights::random(&c.mamba, seed ^ 0x9e37_79b9).layers.into_iter();
        let ones = |n: usize, normal: &mut dyn FnMut(usize, f32) -> Vec<f32>| -> Vec<f32> {
            normal(n, 0.1).iter().map(|x| 1.0 + x).collect()
        };
        let out_scale = 1.0 / (2.0 * c.n_layer() as f32).sqrt();
        let layers = c
            .layers
            .iter()
            .map(|kind| {
                let input_norm = ones(d, &mut normal);
                let mixer = match kind {
                    LayerKind::Mamba => {
                        let mut w = mamba.next().expect("one Mamba-2 layer per mamba kind");
                        w.norm = input_norm.clone();
                        MixerWeights::Mamba(w)
                    }
                    LayerKind::Attention => {
                        let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                        let s = 1.0 / (d as f32).sqrt();
                        MixerWeights::Attention {
                            q: normal(q * d, s),
                            k: normal(kv * d, s),
                            v: normal(kv * d, s),
                            o: normal(d * q, out_scale / (q as f32).sqrt()),
                        }
                    }
                };
                let i = c.shared_intermediate;
                let moe = (c.n_experts > 0).then(|| {
                    let (e, ei) = (c.n_experts, c.expert_intermediate);
                    MoeWeights {
                        router: normal(e * d, 1.0 / (d as f32).sqrt()),
                        gate_up: normal(e * 2 * ei * d, 1.0 / (d as f32).sqrt()),
                        down: normal(e * d * ei, out_scale / (ei as f32).sqrt()),
                    }
                });
                GraniteLayerWeights {
                    input_norm,
                    mixer,
                    post_norm: ones(d, &mut normal),
                    mlp_in: normal(2 * i * d, 1.0 / (d as f32).sqrt()),
                    mlp_out: normal(d * i, out_scale / (i as f32).sqrt()),
                    moe,
                }
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
        let mut shapes: HashMap<String, Vec<usize>> = HashMap::new();
        shapes.insert("model.embed_tokens.weight".into(), vec![c.vocab_size, d]);
        shapes.insert("lm_head.weight".into(), vec![c.vocab_size, d]);
        for (i, kind) in c.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            match kind {
                LayerKind::Mamba => {
                    shapes.insert(format!("{p}.mamba.in_proj.weight"), vec![m.d_in_proj(), d]);
                    shapes.insert(format!("{p}.mamba.conv1d.weight"), vec![m.conv_dim(), 1, m.d_conv]);
                    shapes.insert(format!("{p}.mamba.out_proj.weight"), vec![d, m.d_inner()]);
                }
                LayerKind::Attention => {
                    let (q, kv) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
                    shapes.insert(format!("{p}.self_attn.q_proj.weight"), vec![q, d]);
                    shapes.insert(format!("{p}.self_attn.k_proj.weight"), vec![kv, d]);
                    shapes.insert(format!("{p}.self_attn.v_proj.weight"), vec![kv, d]);
                    shapes.insert(format!("{p}.self_attn.o_proj.weight"), vec![d, q]);
                }
            }
            let inner = c.shared_intermediate;
            shapes.insert(format!("{p}.shared_mlp.input_linear.weight"), vec![2 * inner, d]);
            shapes.insert(format!("{p}.shared_mlp.output_linear.weight"), vec![d, inner]);
            shapes.insert(format!("{p}.feed_forward.gate_proj.weight"), vec![inner, d]);
            shapes.insert(format!("{p}.feed_forward.up_proj.weight"), vec![inner, d]);
            shapes.insert(format!("{p}.feed_forward.down_proj.weight"), vec![d, inner]);
            let (e, ei) = (c.n_experts, c.expert_intermediate);
            shapes.insert(format!("{p}.block_sparse_moe.router.layer.weight"), vec![e, d]);
            shapes.insert(format!("{p}.block_sparse_moe.input_linear.weight"), vec![e, 2 * ei, d]);
            shapes.insert(format!("{p}.block_sparse_moe.output_linear.weight"), vec![e, d, ei]);
        }
        write_checkpoint(dir, &c.to_hf_json(), &shapes, |f| self.for_each(c.family, |name, data| f(name, data)))
    }
}

/// The tensor names that differ between the families.
struct Names {
    /// The RMSNorm before each layer's MLP, after `model.layers.{i}.`.
    post_norm: &'static str,
    /// The final RMSNorm.
    norm_f: &'static str,
}

impl Names {
    fn of(family: HybridFamily) -> Self {
        match family {
            HybridFamily::Granite => Names { post_norm: "post_attention_layernorm", norm_f: "model.norm.weight" },
            HybridFamily::Bamba => Names { post_norm: "pre_ff_layernorm", norm_f: "model.final_layernorm.weight" },
        }
    }
}
