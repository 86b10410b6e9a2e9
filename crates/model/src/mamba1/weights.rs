//! Reading a Mamba-1 checkpoint (any file layout [`crate::weights::read_tensors`] reads, either
//! naming) into host memory, checked against its config.

use std::collections::HashMap;
use std::path::Path;

use super::config::Mamba1Config;
use crate::config::CheckpointFormat;
use crate::error::{Error, Result};
use crate::weights::{fingerprint, normal_sampler, read_tensors, write_checkpoint, HostTensor, Take};

/// The weights of one Mamba-1 block, named as in `backbone.layers.{i}`.
#[derive(Debug, Clone)]
pub struct Mamba1LayerWeights {
    /// Pre-norm RMSNorm weight (d_model).
    pub norm: Vec<f32>,
    /// in_proj (2·d_inner, d_model): rows [x | z].
    pub in_proj: Vec<f32>,
    /// in_proj bias, when the config has `use_bias`.
    pub in_proj_bias: Option<Vec<f32>>,
    /// Depthwise conv weight (d_inner, d_conv).
    pub conv_weight: Vec<f32>,
    /// Conv bias (d_inner), when the config has `use_conv_bias`.
    pub conv_bias: Option<Vec<f32>>,
    /// x_proj (dt_rank + 2N, d_inner): rows [dt | B | C].
    pub x_proj: Vec<f32>,
    /// dt_proj (d_inner, dt_rank).
    pub dt_proj: Vec<f32>,
    /// dt_proj bias (d_inner).
    pub dt_proj_bias: Vec<f32>,
    /// A = -exp(A_log), (d_inner, N).
    pub a_log: Vec<f32>,
    /// Skip connection D (d_inner).
    pub d: Vec<f32>,
    /// out_proj (d_model, d_inner).
    pub out_proj: Vec<f32>,
    /// out_proj bias, when the config has `use_bias`.
    pub out_proj_bias: Option<Vec<f32>>,
}

/// All weights of a Mamba-1 language model, validated against its config.
#[derive(Debug, Clone)]
pub struct Mamba1Weights {
    /// Token embeddings (vocab_size, d_model).
    pub embedding: Vec<f32>,
    /// One entry per block.
    pub layers: Vec<Mamba1LayerWeights>,
    /// Final RMSNorm weight (d_model).
    pub norm_f: Vec<f32>,
    /// Untied LM head (vocab_size, d_model); `None` when tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

impl Mamba1Weights {
    /// Loads and validates the weights in `dir` for `config`.
    pub fn load(dir: &Path, config: &Mamba1Config) -> Result<Self> {
        Self::from_tensors(dir, config, read_tensors(dir)?)
    }

    /// Validates a name → tensor map (either naming) against `config`.
    pub fn from_tensors(dir: &Path, c: &Mamba1Config, map: HashMap<String, HostTensor>) -> Result<Self> {
        let mut t = Take { dir, map };
        let (d, di, v, n) = (c.d_model, c.d_inner(), c.vocab_size, c.d_state);
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
            if t.map.contains_key(&format!("{m}.dt_bias")) {
                return Err(Error::weights(
                    dir,
                    format!("`{m}.dt_bias` is a Mamba-2 tensor, but config.json describes a Mamba-1 model"),
                ));
            }
            layers.push(Mamba1LayerWeights {
                norm: t.get(&format!("{p}.norm.weight"), &[d])?,
                in_proj: t.get(&format!("{m}.in_proj.weight"), &[2 * di, d])?,
                in_proj_bias: t.opt(&format!("{m}.in_proj.bias"), &[2 * di], c.use_bias)?,
                conv_weight: t.get(&format!("{m}.conv1d.weight"), &[di, 1, c.d_conv])?,
                conv_bias: t.opt(&format!("{m}.conv1d.bias"), &[di], c.use_conv_bias)?,
                x_proj: t.get(&format!("{m}.x_proj.weight"), &[c.x_proj_dim(), di])?,
                dt_proj: t.get(&format!("{m}.dt_proj.weight"), &[di, c.dt_rank])?,
                dt_proj_bias: t.get(&format!("{m}.dt_proj.bias"), &[di])?,
                a_log: t.get(&format!("{m}.A_log"), &[di, n])?,
                d: t.get(&format!("{m}.D"), &[di])?,
                out_proj: t.get(&format!("{m}.out_proj.weight"), &[d, di])?,
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
    pub fn for_each(&self, f: &mut dyn FnMut(&str, &[f32])) {
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
            f(&format!("{m}.x_proj.weight"), &l.x_proj);
            f(&format!("{m}.dt_proj.weight"), &l.dt_proj);
            f(&format!("{m}.dt_proj.bias"), &l.dt_proj_bias);
            f(&format!("{m}.A_log"), &l.a_log);
            f(&format!("{m}.D"), &l.d);
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
        self.for_each(&mut |_, t| n += t.len());
        n
    }

    /// A 128-bit fingerprint of the config and every weight value (any file layout).
    pub fn fingerprint(&self, config: &Mamba1Config) -> String {
        fingerprint("mamba1", config.to_hf_json(), |f| self.for_each(f))
    }

    /// Random weights for `config` (seeded), shaped like the Mamba-1 initialisation: A_log =
    /// ln(1..=N) per channel (S4D-real), dt in [1e-3, 1e-1].
    pub fn random(c: &Mamba1Config, seed: u64) -> Self {
        let mut normal = normal_sampler(seed);
        let (d, di, v, n) = (c.d_model, c.d_inner(), c.vocab_size, c.d_state);
        let mut layers = Vec::with_capacity(c.n_layer);
        for _ in 0..c.n_layer {
            let dt_proj_bias = normal(di, 1.0)
                .iter()
                .map(|z| {
                    let u = 0.5 * (1.0 + (z / 2.0).tanh());
                    let dt = (1e-3f32.ln() + u * (1e-1f32.ln() - 1e-3f32.ln())).exp();
                    dt + (-(-dt).exp_m1()).ln()
                })
                .collect();
            layers.push(Mamba1LayerWeights {
                norm: normal(d, 0.1).iter().map(|x| 1.0 + x).collect(),
                in_proj: normal(2 * di * d, 1.0 / (d as f32).sqrt()),
                in_proj_bias: c.use_bias.then(|| normal(2 * di, 0.1)),
                conv_weight: normal(di * c.d_conv, 1.0 / (c.d_conv as f32).sqrt()),
                conv_bias: c.use_conv_bias.then(|| normal(di, 0.1)),
                x_proj: normal(c.x_proj_dim() * di, 1.0 / (di as f32).sqrt()),
                dt_proj: normal(di * c.dt_rank, 1.0 / (c.dt_rank as f32).sqrt()),
                dt_proj_bias,
                a_log: (0..di * n).map(|i| ((i % n + 1) as f32).ln()).collect(),
                d: vec![1.0; di],
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

    /// Writes `config.json` (HF transformers spelling) and `model.safetensors` (f32) into
    /// `dir`, a folder [`crate::Model::load`] and HF transformers both read.
    pub fn save_pretrained(&self, dir: &Path, c: &Mamba1Config) -> Result<()> {
        let mut shapes = HashMap::new();
        shapes.insert("backbone.embeddings.weight".to_string(), vec![c.vocab_size, c.d_model]);
        shapes.insert("lm_head.weight".to_string(), vec![c.vocab_size, c.d_model]);
        for i in 0..c.n_layer {
            let m = format!("backbone.layers.{i}.mixer");
            shapes.insert(format!("{m}.in_proj.weight"), vec![2 * c.d_inner(), c.d_model]);
            shapes.insert(format!("{m}.conv1d.weight"), vec![c.d_inner(), 1, c.d_conv]);
            shapes.insert(format!("{m}.x_proj.weight"), vec![c.x_proj_dim(), c.d_inner()]);
            shapes.insert(format!("{m}.dt_proj.weight"), vec![c.d_inner(), c.dt_rank]);
            shapes.insert(format!("{m}.A_log"), vec![c.d_inner(), c.d_state]);
            shapes.insert(format!("{m}.out_proj.weight"), vec![c.d_model, c.d_inner()]);
        }
        write_checkpoint(dir, &c.to_hf_json(), &shapes, |f| self.for_each(f))
    }
}
