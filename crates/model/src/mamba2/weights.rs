//! A Mamba-2 checkpoint in host memory, in either naming (HF transformers
//! `backbone.embeddings.weight`, state-spaces `backbone.embedding.weight`), checked for presence,
//! shape and finiteness so the engines can trust it.

use std::collections::HashMap;
use std::path::Path;

use super::Mamba2Config;
use crate::config::CheckpointFormat;
use crate::error::Result;
use crate::weights::{fingerprint, normal_sampler, read_tensors, write_checkpoint, HostTensor, Take};

/// The weights of one Mamba-2 block, named as in the checkpoint's `backbone.layers.{i}`.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// Pre-norm RMSNorm weight (d_model).
    pub norm: Vec<f32>,
    /// in_proj (d_in_proj, d_model): rows [z | xBC | dt].
    pub in_proj: Vec<f32>,
    /// in_proj bias (d_in_proj), when the config has `use_bias`.
    pub in_proj_bias: Option<Vec<f32>>,
    /// Depthwise conv weight (conv_dim, d_conv).
    pub conv_weight: Vec<f32>,
    /// Conv bias (conv_dim), when the config has `use_conv_bias`.
    pub conv_bias: Option<Vec<f32>>,
    /// dt bias (nheads).
    pub dt_bias: Vec<f32>,
    /// A = -exp(A_log) (nheads).
    pub a_log: Vec<f32>,
    /// Skip connection D (nheads).
    pub d: Vec<f32>,
    /// Gated RMSNorm weight (d_inner).
    pub gated_norm: Vec<f32>,
    /// out_proj (d_model, d_inner).
    pub out_proj: Vec<f32>,
    /// out_proj bias (d_model), when the config has `use_bias`.
    pub out_proj_bias: Option<Vec<f32>>,
}

/// All weights of a Mamba-2 language model, validated against its config.
#[derive(Debug, Clone)]
pub struct Mamba2Weights {
    /// Token embeddings (vocab_size, d_model).
    pub embedding: Vec<f32>,
    /// One entry per block.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm weight (d_model).
    pub norm_f: Vec<f32>,
    /// Untied LM head (vocab_size, d_model); `None` when tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl Mamba2Weights {
    /// Loads and validates the weights in `dir` for `config`.
    pub fn load(dir: &Path, config: &Mamba2Config) -> Result<Self> {
        let map = read_tensors(dir)?;
        Self::from_tensors(dir, config, map)
    }

    /// Validates a name → tensor map (either naming) against `config`.
    pub fn from_tensors(dir: &Path, c: &Mamba2Config, map: HashMap<String, HostTensor>) -> Result<Self> {
        let mut t = Take { dir, map };
        let (d, v) = (c.d_model, c.vocab_size);
        // Either spelling is accepted whatever the config looked like; the error names the one
        // the config's format expects.
        let expected = match c.format {
            CheckpointFormat::HfTransformers => "backbone.embeddings.weight",
            CheckpointFormat::StateSpaces => "backbone.embedding.weight",
        };
        let embedding_name = ["backbone.embeddings.weight", "backbone.embedding.weight"]
            .into_iter()
            .find(|n| t.map.contains_key(*n))
            .unwrap_or(expected);
        let embedding = t.get(embedding_name, &[v, d])?;
        let mut layers = Vec::with_capacity(c.n_layer);
        for i in 0..c.n_layer {
            let p = format!("backbone.layers.{i}");
            let m = format!("{p}.mixer");
            layers.push(LayerWeights {
                norm: t.get(&format!("{p}.norm.weight"), &[d])?,
                in_proj: t.get(&format!("{m}.in_proj.weight"), &[c.d_in_proj(), d])?,
                in_proj_bias: t.opt(&format!("{m}.in_proj.bias"), &[c.d_in_proj()], c.use_bias)?,
                conv_weight: t.get(&format!("{m}.conv1d.weight"), &[c.conv_dim(), 1, c.d_conv])?,
                conv_bias: t.opt(&format!("{m}.conv1d.bias"), &[c.conv_dim()], c.use_conv_bias)?,
                dt_bias: t.get(&format!("{m}.dt_bias"), &[c.nheads])?,
                a_log: t.get(&format!("{m}.A_log"), &[c.nheads])?,
                d: t.get(&format!("{m}.D"), &[c.nheads])?,
                gated_norm: t.get(&format!("{m}.norm.weight"), &[c.d_inner()])?,
                out_proj: t.get(&format!("{m}.out_proj.weight"), &[d, c.d_inner()])?,
                out_proj_bias: t.opt(&format!("{m}.out_proj.bias"), &[d], c.use_bias)?,
            });
        }
        let norm_f = t.get("backbone.norm_f.weight", &[d])?;
        let lm_head = if c.tie_embeddings {
            t.map.remove("lm_head.weight");
            None
        } else {
            Some(t.get("lm_head.weight", &[v, d])?)
        };
        Ok(Self { embedding, layers, norm_f, lm_head })
    }

    /// Visits every tensor under its canonical (HF) name, in a fixed order.
    pub fn for_each(&self, mut f: impl FnMut(&str, &[f32])) {
        f("backbone.embeddings.weight", &self.embedding);
        for (i, l) in self.layers.iter().enumerate() {
            let m = format!("backbone.layers.{i}.mixer");
            f(&format!("backbone.layers.{i}.norm.weight"), &l.norm);
            f(&format!("{m}.in_proj.weight"), &l.in_proj);
            if let Some(b) = &l.in_proj_bias {
                f(&format!("{m}.in_proj.bias"), b);
            }
            f(&format!("{m}.conv1d.weight"), &l.conv_weight);
            if let Some(b) = &l.conv_bias {
                f(&format!("{m}.conv1d.bias"), b);
            }
            f(&format!("{m}.dt_bias"), &l.dt_bias);
            f(&format!("{m}.A_log"), &l.a_log);
            f(&format!("{m}.D"), &l.d);
            f(&format!("{m}.norm.weight"), &l.gated_norm);
            f(&format!("{m}.out_proj.weight"), &l.out_proj);
            if let Some(b) = &l.out_proj_bias {
                f(&format!("{m}.out_proj.bias"), b);
            }
        }
        f("backbone.norm_f.weight", &self.norm_f);
        if let Some(h) = &self.lm_head {
            f("lm_head.weight", h);
        }
    }

    /// Number of parameters (tied heads counted once).
    pub fn n_params(&self) -> usize {
        let mut n = 0;
        self.for_each(|_, t| n += t.len());
        n
    }

    /// A 128-bit fingerprint of the config's shape-relevant fields and every weight value.
    /// Independent of the file format, so the same model read from either layout matches.
    pub fn fingerprint(&self, config: &Mamba2Config) -> String {
        fingerprint("mamba2", config.to_hf_json(), |f| self.for_each(|name, data| f(name, data)))
    }
}

impl Mamba2Weights {
    /// Random weights for `config` (seeded): what tests and benchmarks use when no trained
    /// checkpoint is at hand. Scales keep activations O(1) and dt within [1e-3, 1e-1], like
    /// the Mamba-2 initialisation.
    pub fn random(config: &Mamba2Config, seed: u64) -> Self {
        let mut normal = normal_sampler(seed);
        let c = config;
        let (d, di, v) = (c.d_model, c.d_inner(), c.vocab_size);
        let mut layers = Vec::with_capacity(c.n_layer);
        for _ in 0..c.n_layer {
            let uniform01 = normal(c.nheads, 1.0).iter().map(|z| 0.5 * (1.0 + (z / 2.0).tanh())).collect::<Vec<_>>();
            // dt = exp(U[ln 1e-3, ln 1e-1]); dt_bias = softplus⁻¹(dt).
            let dt_bias = uniform01
                .iter()
                .map(|u| {
                    let dt = (1e-3f32.ln() + u * (1e-1f32.ln() - 1e-3f32.ln())).exp();
                    dt + (-(-dt).exp_m1()).ln()
                })
                .collect();
            layers.push(LayerWeights {
                norm: normal(d, 0.1).iter().map(|x| 1.0 + x).collect(),
                in_proj: normal(c.d_in_proj() * d, 1.0 / (d as f32).sqrt()),
                in_proj_bias: c.use_bias.then(|| normal(c.d_in_proj(), 0.1)),
                conv_weight: normal(c.conv_dim() * c.d_conv, 1.0 / (c.d_conv as f32).sqrt()),
                conv_bias: c.use_conv_bias.then(|| normal(c.conv_dim(), 0.1)),
                dt_bias,
                a_log: (0..c.nheads).map(|h| (1.0 + 15.0 * h as f32 / c.nheads.max(2) as f32).ln()).collect(),
                d: normal(c.nheads, 0.1).iter().map(|x| 1.0 + x).collect(),
                gated_norm: normal(di, 0.1).iter().map(|x| 1.0 + x).collect(),
                out_proj: normal(d * di, 1.0 / (di as f32).sqrt() / (2.0 * c.n_layer as f32).sqrt()),
                out_proj_bias: c.use_bias.then(|| normal(d, 0.1)),
            });
        }
        Self {
            embedding: normal(v * d, 1.0),
            layers,
            norm_f: normal(d, 0.1).iter().map(|x| 1.0 + x).collect(),
            lm_head: (!c.tie_embeddings).then(|| normal(v * d, 1.0 / (d as f32).sqrt())),
        }
    }
}

impl Mamba2Weights {
    /// Writes `config.json` (HF transformers spelling) and `model.safetensors` (f32) into `dir`,
    /// a folder [`crate::Model::load`] and HF transformers both read.
    pub fn save_pretrained(&self, dir: &Path, config: &Mamba2Config) -> Result<()> {
        let shapes = tensor_shapes(config);
        write_checkpoint(dir, &config.to_hf_json(), &shapes, |f| self.for_each(|name, data| f(name, data)))
    }
}

/// Checkpoint shapes of the tensors that are not plain vectors.
fn tensor_shapes(c: &Mamba2Config) -> HashMap<String, Vec<usize>> {
    let mut m = HashMap::new();
    m.insert("backbone.embeddings.weight".to_string(), vec![c.vocab_size, c.d_model]);
    m.insert("lm_head.weight".to_string(), vec![c.vocab_size, c.d_model]);
    for i in 0..c.n_layer {
        let p = format!("backbone.layers.{i}.mixer");
        m.insert(format!("{p}.in_proj.weight"), vec![c.d_in_proj(), c.d_model]);
        m.insert(format!("{p}.conv1d.weight"), vec![c.conv_dim(), 1, c.d_conv]);
        m.insert(format!("{p}.out_proj.weight"), vec![c.d_model, c.d_inner()]);
    }
    m
}
