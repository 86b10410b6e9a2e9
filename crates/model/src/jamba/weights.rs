//! Reading a Jamba checkpoint into host memory, checked against its config. Tensors are named
//! as the hub's checkpoints name them (`model.layers.{i}.mamba.*`, `.self_attn.*`,
//! `.feed_forward.experts.{e}.gate_proj.weight`, …); transformers 5's fused experts
//! (`feed_forward.experts.gate_up_proj`, `.down_proj`) are read too.

use std::collections::HashMap;
use std::path::Path;

use super::config::JambaConfig;
use crate::error::Result;
use crate::granite_hybrid::weights::AttentionWeights;
use crate::mamba1::Mamba1LayerWeights;
use crate::weights::{fingerprint, normal_sampler, read_tensors, write_checkpoint, HostTensor, Take};

/// A layer's mixer.
#[derive(Debug, Clone)]
pub enum JambaMixerWeights {
    /// A Mamba-1 mixer (its `norm` is empty: the layer's input norm stands apart) and the
    /// RMSNorm weights of its time step, B and C (dt_rank, N, N).
    Mamba(Box<Mamba1LayerWeights>, [Vec<f32>; 3]),
    /// NoPE grouped-query attention.
    Attention(AttentionWeights),
}

/// What follows a layer's mixer.
#[derive(Debug, Clone)]
pub enum JambaFeedForward {
    /// A SwiGLU MLP: gate and up stacked (2·inner × d_model), down (d_model × inner).
    Mlp {
        /// Gate rows, then up rows.
        gate_up: Vec<f32>,
        /// Down projection.
        down: Vec<f32>,
    },
    /// Routed experts: the router (n_experts × d_model); per expert gate and up stacked
    /// (n_experts × 2·inner × d_model) and down (n_experts × d_model × inner).
    Experts {
        /// Router weight.
        router: Vec<f32>,
        /// Every expert's gate rows then up rows, one expert after another.
        gate_up: Vec<f32>,
        /// Every expert's down projection, one after another.
        down: Vec<f32>,
    },
}

/// One layer.
#[derive(Debug, Clone)]
pub struct JambaLayerWeights {
    /// The norm before the mixer (d_model).
    pub input_norm: Vec<f32>,
    /// The mixer.
    pub mixer: JambaMixerWeights,
    /// The norm before the MLP or experts (d_model).
    pub ff_norm: Vec<f32>,
    /// The MLP or the experts.
    pub ff: JambaFeedForward,
}

/// All weights of a Jamba model, validated against its config.
#[derive(Debug, Clone)]
pub struct JambaWeights {
    /// Token embeddings (vocab_size, d_model).
    pub embedding: Vec<f32>,
    /// One entry per layer.
    pub layers: Vec<JambaLayerWeights>,
    /// Final RMSNorm weight (d_model).
    pub norm_f: Vec<f32>,
    /// Untied LM head (vocab_size, d_model); `None` when tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl JambaWeights {
    /// Loads and validates the weights in `dir` for `config`.
    pub fn load(dir: &Path, config: &JambaConfig) -> Result<Self> {
        Self::from_tensors(dir, config, read_tensors(dir)?)
    }

    /// Validates a name → tensor map against `config`.
    pub fn from_tensors(dir: &Path, c: &JambaConfig, map: HashMap<String, HostTensor>) -> Result<Self> {
        let mut t = Take { dir, map };
        let (d, v) = (c.d_model, c.vocab_size);
        let m = &c.mamba;
        let (di, n, r) = (m.d_inner(), m.d_state, m.dt_rank);
        let (qw, kvw, inner, e) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.intermediate, c.n_experts);
        let embedding = t.get("model.embed_tokens.weight", &[v, d])?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let p = format!("model.layers.{i}");
            let input_norm = t.get(&format!("{p}.input_layernorm.weight"), &[d])?;
            let mixer = if c.attends(i) {
                let a = format!("{p}.self_attn");
                let weights = AttentionWeights {
                    q: t.get(&format!("{a}.q_proj.weight"), &[qw, d])?,
                    k: t.get(&format!("{a}.k_proj.weight"), &[kvw, d])?,
                    v: t.get(&format!("{a}.v_proj.weight"), &[kvw, d])?,
                    o: t.get(&format!("{a}.o_proj.weight"), &[d, qw])?,
                };
                JambaMixerWeights::Attention(weights)
            } else {
                let x = format!("{p}.mamba");
                let mixer = Mamba1LayerWeights {
                    norm: Vec::new(),
                    in_proj: t.get(&format!("{x}.in_proj.weight"), &[2 * di, d])?,
                    in_proj_bias: t.opt(&format!("{x}.in_proj.bias"), &[2 * di], m.use_bias)?,
                    conv_weight: t.get(&format!("{x}.conv1d.weight"), &[di, 1, m.d_conv])?,
                    conv_bias: t.opt(&format!("{x}.conv1d.bias"), &[di], m.use_conv_bias)?,
                    x_proj: t.get(&format!("{x}.x_proj.weight"), &[m.x_proj_dim(), di])?,
                    dt_proj: t.get(&format!("{x}.dt_proj.weight"), &[di, r])?,
                    dt_proj_bias: t.get(&format!("{x}.dt_proj.bias"), &[di])?,
                    a_log: t.get(&format!("{x}.A_log"), &[di, n])?,
                    d: t.get(&format!("{x}.D"), &[di])?,
                    out_proj: t.get(&format!("{x}.out_proj.weight"), &[d, di])?,
                    out_proj_bias: t.opt(&format!("{x}.out_proj.bias"), &[d], m.use_bias)?,
                };
                let norms = [
                    t.get(&format!("{x}.dt_layernorm.weight"), &[r])?,
                    t.get(&format!("{x}.b_layernorm.weight"), &[n])?,
                    t.get(&format!("{x}.c_layernorm.weight"), &[n])?,
                ];
                JambaMixerWeights::Mamba(Box::new(mixer), norms)
            };
            let ff_norm = t.get(&format!("{p}.pre_ff_layernorm.weight"), &[d])?;
            let f = format!("{p}.feed_forward");
            let ff = if c.has_experts(i) {
                let router = t.get(&format!("{f}.router.weight"), &[e, d])?;
                let (gate_up, down) = if t.map.contains_key(&format!("{f}.experts.gate_up_proj")) {
                    (
                        t.get(&format!("{f}.experts.gate_up_proj"), &[e, 2 * inner, d])?,
                        t.get(&format!("{f}.experts.down_proj"), &[e, d, inner])?,
                    )
                } else {
                    let (mut gate_up, mut down) = (Vec::new(), Vec::new());
                    for x in 0..e {
                        let ex = format!("{f}.experts.{x}");
                        gate_up.extend(t.get(&format!("{ex}.gate_proj.weight"), &[inner, d])?);
                        gate_up.extend(t.get(&format!("{ex}.up_proj.weight"), &[inner, d])?);
                        down.extend(t.get(&format!("{ex}.down_proj.weight"), &[d, inner])?);
                    }
                    (gate_up, down)
                };
                JambaFeedForward::Experts { router, gate_up, down }
            } else {
                let mut gate_up = t.get(&format!("{f}.gate_proj.weight"), &[inner, d])?;
                gate_up.extend(t.get(&format!("{f}.up_proj.weight"), &[inner, d])?);
                JambaFeedForward::Mlp { gate_up, down: t.get(&format!("{f}.down_proj.weight"), &[d, inner])? }
            };
            layers.push(JambaLayerWeights { input_norm, mixer, ff_norm, ff });
        }
        let norm_f = t.get("model.final_layernorm.weight", &[d])?;
        let lm_head = if c.tie_embeddings {
            t.map.remove("lm_head.weight");
            None
        } else {
            Some(t.get("lm_head.weight", &[v, d])?)
        };
        Ok(Self { embedding, layers, norm_f, lm_head })
    }

    /// Visits every tensor under the hub's name, in a fixed order (experts one by one).
    pub fn for_each(&self, c: &JambaConfig, f: &mut dyn FnMut(&str, &[f32])) {
        let (d, inner) = (c.d_model, c.intermediate);
        f("model.embed_tokens.weight", &self.embedding);
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            f(&format!("{p}.input_layernorm.weight"), &l.input_norm);
            match &l.mixer {
                JambaMixerWeights::Attention(a) => {
                    for (name, w) in [("q", &a.q), ("k", &a.k), ("v", &a.v), ("o", &a.o)] {
                        f(&format!("{p}.self_attn.{name}_proj.weight"), w);
                    }
                }
                JambaMixerWeights::Mamba(m, [dt, b, cn]) => {
                    let x = format!("{p}.mamba");
                    f(&format!("{x}.in_proj.weight"), &m.in_proj);
                    if let Some(b) = &m.in_proj_bias {
                        f(&format!("{x}.in_proj.bias"), b);
                    }
                    f(&format!("{x}.conv1d.weight"), &m.conv_weight);
                    if let Some(b) = &m.conv_bias {
                        f(&format!("{x}.conv1d.bias"), b);
                    }
                    f(&format!("{x}.x_proj.weight"), &m.x_proj);
                    f(&format!("{x}.dt_layernorm.weight"), dt);
                    f(&format!("{x}.b_layernorm.weight"), b);
                    f(&format!("{x}.c_layernorm.weight"), cn);
                    f(&format!("{x}.dt_proj.weight"), &m.dt_proj);
                    f(&format!("{x}.dt_proj.bias"), &m.dt_proj_bias);
                    f(&format!("{x}.A_log"), &m.a_log);
                    f(&format!("{x}.D"), &m.d);
                    f(&format!("{x}.out_proj.weight"), &m.out_proj);
                    if let Some(b) = &m.out_proj_bias {
                        f(&format!("{x}.out_proj.bias"), b);
                    }
                }
            }
            f(&format!("{p}.pre_ff_layernorm.weight"), &l.ff_norm);
            let fw = format!("{p}.feed_forward");
            match &l.ff {
                JambaFeedForward::Mlp { gate_up, down } => {
                    f(&format!("{fw}.gate_proj.weight"), &gate_up[..inner * d]);
                    f(&format!("{fw}.up_proj.weight"), &gate_up[inner * d..]);
                    f(&format!("{fw}.down_proj.weight"), down);
                }
                JambaFeedForward::Experts { router, gate_up, down } => {
                    f(&format!("{fw}.router.weight"), router);
                    for (x, (gu, dn)) in
                        gate_up.chunks_exact(2 * inner * d).zip(down.chunks_exact(d * inner)).enumerate()
                    {
                        f(&format!("{fw}.experts.{x}.gate_proj.weight"), &gu[..inner * d]);
                        f(&format!("{fw}.experts.{x}.up_proj.weight"), &gu[inner * d..]);
                        f(&format!("{fw}.experts.{x}.down_proj.weight"), dn);
                    }
                }
            }
        }
        f("model.final_layernorm.weight", &self.norm_f);
        if let Some(h) = &self.lm_head {
            f("lm_head.weight", h);
        }
    }

    /// Number of parameters (a tied head counted once).
    pub fn n_params(&self, c: &JambaConfig) -> usize {
        let mut n = 0;
        self.for_each(c, &mut |_, t| n += t.len());
        n
    }

    /// A 128-bit fingerprint of the config and every weight value.
    pub fn fingerprint(&self, c: &JambaConfig) -> String {
        fingerprint("jamba", c.to_hf_json(), |f| self.for_each(c, f))
    }

    /// Random weights for `c` (seeded), scaled so activations stay O(1).
    pub fn random(c: &JambaConfig, seed: u64) -> Self {
        let mut normal = normal_sampler(seed);
        let (d, v, inner, e) = (c.d_model, c.vocab_size, c.intermediate, c.n_experts);
        let mut mamba = crate::mamba1::Mamba1Weights::random(&c.mamba, seed ^ 0x6a61_6d62).layers.into_iter();
        let m = &c.mamba;
        let (qw, kvw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let near_one = |x: Vec<f32>| x.iter().map(|x| 1.0 + x).collect::<Vec<f32>>();
        let layers = (0..c.n_layer)
            .map(|i| {
                let mixer = if c.attends(i) {
                    let s = 1.0 / (d as f32).sqrt();
                    let a = AttentionWeights {
                        q: normal(qw * d, s),
                        k: normal(kvw * d, s),
                        v: normal(kvw * d, s),
                        o: normal(d * qw, 1.0 / (qw as f32).sqrt()),
                    };
                    JambaMixerWeights::Attention(a)
                } else {
                    let mut layer = mamba.next().expect("one Mamba layer per Mamba index");
                    layer.norm = Vec::new();
                    let norms = [
                        near_one(normal(m.dt_rank, 0.1)),
                        near_one(normal(m.d_state, 0.1)),
                        near_one(normal(m.d_state, 0.1)),
                    ];
                    JambaMixerWeights::Mamba(Box::new(layer), norms)
                };
                let (s_in, s_out) = (1.0 / (d as f32).sqrt(), 1.0 / (inner as f32).sqrt());
                let ff = if c.has_experts(i) {
                    JambaFeedForward::Experts {
                        router: normal(e * d, s_in),
                        gate_up: normal(e * 2 * inner * d, s_in),
                        down: normal(e * d * inner, s_out),
                    }
                } else {
                    JambaFeedForward::Mlp { gate_up: normal(2 * inner * d, s_in), down: normal(d * inner, s_out) }
                };
                let input_norm = near_one(normal(d, 0.1));
                JambaLayerWeights { input_norm, mixer, ff_norm: near_one(normal(d, 0.1)), ff }
            })
            .collect();
        Self {
            embedding: normal(v * d, 1.0),
            layers,
            norm_f: near_one(normal(d, 0.1)),
            lm_head: (!c.tie_embeddings).then(|| normal(v * d, 1.0 / (d as f32).sqrt())),
        }
    }

    /// Writes `config.json` (HF transformers spelling) and `model.safetensors` (f32) into
    /// `dir`, a folder [`crate::Model::load`] and HF transformers both read.
    pub fn save_pretrained(&self, dir: &Path, c: &JambaConfig) -> Result<()> {
        let m = &c.mamba;
        let (d, di, inner) = (c.d_model, m.d_inner(), c.intermediate);
        let (qw, kvw) = (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let mut shapes = HashMap::new();
        shapes.insert("model.embed_tokens.weight".to_string(), vec![c.vocab_size, d]);
        shapes.insert("lm_head.weight".to_string(), vec![c.vocab_size, d]);
        for i in 0..c.n_layer {
            let p = format!("model.layers.{i}");
            for (name, shape) in [
                ("mamba.in_proj.weight", vec![2 * di, d]),
                ("mamba.conv1d.weight", vec![di, 1, m.d_conv]),
                ("mamba.x_proj.weight", vec![m.x_proj_dim(), di]),
                ("mamba.dt_proj.weight", vec![di, m.dt_rank]),
                ("mamba.A_log", vec![di, m.d_state]),
                ("mamba.out_proj.weight", vec![d, di]),
                ("self_attn.q_proj.weight", vec![qw, d]),
                ("self_attn.k_proj.weight", vec![kvw, d]),
                ("self_attn.v_proj.weight", vec![kvw, d]),
                ("self_attn.o_proj.weight", vec![d, qw]),
                ("feed_forward.gate_proj.weight", vec![inner, d]),
                ("feed_forward.up_proj.weight", vec![inner, d]),
                ("feed_forward.down_proj.weight", vec![d, inner]),
                ("feed_forward.router.weight", vec![c.n_experts, d]),
            ] {
                shapes.insert(format!("{p}.{name}"), shape);
            }
            for x in 0..c.n_experts {
                let ex = format!("{p}.feed_forward.experts.{x}");
                shapes.insert(format!("{ex}.gate_proj.weight"), vec![inner, d]);
                shapes.insert(format!("{ex}.up_proj.weight"), vec![inner, d]);
                shapes.insert(format!("{ex}.down_proj.weight"), vec![d, inner]);
            }
        }
        write_checkpoint(dir, &c.to_hf_json(), &shapes, |f| self.for_each(c, f))
    }
}
