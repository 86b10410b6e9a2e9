//! Falcon-H1 (`FalconH1ForCausalLM`, TII): every layer runs a Mamba-2 mixer and grouped-query
//! attention side by side on the same normed input and adds both to the residual stream, then a
//! SwiGLU MLP. Its state therefore holds, per layer, an SSM state *and* keys and values.
//!
//! Falcon-H1 scales the inputs and outputs of its projections by µP multipliers
//! (`ssm_in_multiplier`, the five `ssm_multipliers` of z, x, B, C and dt, `ssm_out_multiplier`,
//! `attention_in_multiplier`, `key_multiplier`, `attention_out_multiplier`, the two
//! `mlp_multipliers`). Each scales a linear map, so the CPU engine folds it into its own copy of
//! that map's weights when it is built ([`Mup::fold`]) and runs Falcon-H1 with the arithmetic
//! every other hybrid uses. The weights as read, their fingerprint and a model written back stay
//! the checkpoint's. The embedding and LM-head multipliers are applied as the other families'
//! (`embedding_multiplier`, `logits_scaling`): a tied head shares its matrix with the embedding,
//! so neither can be folded into it.

use std::path::Path;

use serde_json::{Map, Value};

use super::config::{GraniteHybridConfig, HybridFamily, LayerKind, MlpKind, Mup, Routing};
use super::weights::{AttentionWeights, GraniteHybridWeights};
use crate::config::Fields;
use crate::error::{Error, Result};
use crate::mamba2::{GateNorm, Mamba2Config};

impl Mup {
    /// Scales each projection of `w` by its multipliers, in f64 and rounded once to f32: the
    /// weights the engine multiplies by, never the ones written back or fingerprinted. The
    /// in-projection's rows are [z, x, B, C, dt] (`d_inner`, `d_inner`, `groups·d_state` twice,
    /// heads); its bias, if any, is scaled by the row's multiplier but not by `ssm_in`, which
    /// scales the input.
    pub fn fold(&self, c: &GraniteHybridConfig, w: &mut GraniteHybridWeights) {
        let m = &c.mamba;
        let (d, di, gn) = (c.d_model, m.d_inner(), m.n_groups * m.d_state);
        let bounds = [di, 2 * di, 2 * di + gn, 2 * di + 2 * gn, m.d_in_proj()];
        let row_scale = |row: usize| self.ssm[bounds.iter().position(|&b| row < b).expect("rows of in_proj")];
        for l in &mut w.layers {
            let (mamba, attention) = l.mixer.parts_mut();
            if let Some(mw) = mamba {
                for (r, row) in mw.in_proj.chunks_exact_mut(d).enumerate() {
                    scale(row, self.ssm_in * row_scale(r));
                }
                if let Some(b) = &mut mw.in_proj_bias {
                    b.iter_mut().enumerate().for_each(|(r, x)| *x = (*x as f64 * row_scale(r)) as f32);
                }
                scale(&mut mw.out_proj, self.ssm_out);
                if let Some(b) = &mut mw.out_proj_bias {
                    scale(b, self.ssm_out);
                }
            }
            if let Some(AttentionWeights { q, k, v, o }) = attention {
                scale(q, self.attention_in);
                scale(k, self.attention_in * self.key);
                scale(v, self.attention_in);
                scale(o, self.attention_out);
            }
            if let Some(mlp) = &mut l.mlp {
                let gate = mlp.input.len() / 2;
                scale(&mut mlp.input[..gate], self.mlp[0]);
                scale(&mut mlp.output, self.mlp[1]);
            }
        }
    }
}

/// `x ·= by`, computed in f64 and rounded once.
fn scale(x: &mut [f32], by: f64) {
    if by != 1.0 {
        x.iter_mut().for_each(|v| *v = (*v as f64 * by) as f32);
    }
}

impl GraniteHybridConfig {
    /// Reads transformers' `config.json` of a `falcon_h1` model (`FalconH1ForCausalLM`): every
    /// layer a Mamba-2 mixer of `mamba_d_ssm` channels beside RoPE attention at the softmax scale
    /// 1/√head_dim, a SwiGLU MLP of `intermediate_size`, the µP multipliers ([`Mup`]). Options
    /// picaso does not implement (scaled RoPE, partial rotation, biases but the Mamba
    /// projections' and convolution's, other activations) are refused by name.
    pub fn from_falcon_h1(path: &Path, map: &Map<String, Value>) -> Result<Self> {
        let f = Fields { path, map };
        let bad = |m: String| Error::config(path, m);
        super::config::silu_without(&f, &["attention_bias", "mlp_bias"])?;
        // picaso's Mamba-2 mixer has biases on both projections or on neither.
        let (in_bias, out_bias) = (f.bool_or("mamba_proj_bias", false)?, f.bool_or("projectors_bias", false)?);
        if in_bias != out_bias {
            return Err(bad(format!(
                "`mamba_proj_bias: {in_bias}` with `projectors_bias: {out_bias}`: picaso runs Mamba mixers with biases \
                 on both projections or on neither"
            )));
        }
        let n_layer = super::config::layer_count(&f)?;
        let d_model = f.usize("hidden_size")?;
        let n_heads = f.usize("num_attention_heads")?;
        let head_dim = match map.get("head_dim") {
            None | Some(Value::Null) => d_model / n_heads.max(1),
            Some(_) => f.usize("head_dim")?,
        };
        let n_kv_heads = super::config::kv_heads_or_8(&f, n_heads)?;
        let expand = f.usize_or("mamba_expand", 2)?;
        let d_ssm = match map.get("mamba_d_ssm") {
            None => 1024,
            Some(Value::Null) => expand.saturating_mul(d_model),
            Some(_) => f.usize("mamba_d_ssm")?,
        };
        let mamba_heads = f.usize_or("mamba_n_heads", 128)?;
        let mamba_head_dim = match map.get("mamba_d_head") {
            None | Some(Value::Null) => d_ssm / mamba_heads.max(1),
            Some(Value::String(s)) if s == "auto" => d_ssm / mamba_heads.max(1),
            Some(_) => f.usize("mamba_d_head")?,
        };
        if mamba_heads.saturating_mul(mamba_head_dim) != d_ssm {
            return Err(bad(format!(
                "mamba_n_heads ({mamba_heads}) × mamba_d_head ({mamba_head_dim}) must equal the mixer's width ({d_ssm})"
            )));
        }
        let gate_norm = match (f.bool_or("mamba_rms_norm", false)?, f.bool_or("mamba_norm_before_gate", true)?) {
            (false, _) => GateNorm::GateOnly,
            (true, true) => GateNorm::NormThenGate,
            (true, false) => GateNorm::NormGated,
        };
        let norm_eps = f.f64_or("rms_norm_eps", 1e-5)?;
        let mamba = Mamba2Config {
            n_layer,
            vocab_size: f.usize_or("vocab_size", 128000)?,
            use_bias: in_bias,
            gate_norm,
            ..super::config::granite_mamba(&f, d_model, (mamba_heads, mamba_head_dim, expand), norm_eps)?
        };
        let pair = |key: &str, n: usize| -> Result<Vec<f64>> {
            match map.get(key) {
                None | Some(Value::Null) => Ok(vec![1.0; n]),
                Some(Value::Array(a)) if a.len() == n && a.iter().all(Value::is_number) => {
                    Ok(a.iter().filter_map(Value::as_f64).collect())
                }
                Some(_) => Err(f.err(key, &format!("a list of {n} numbers"))),
            }
        };
        let (ssm, mlp) = (pair("ssm_multipliers", 5)?, pair("mlp_multipliers", 2)?);
        let mup = Mup {
            ssm_in: f.f64_or("ssm_in_multiplier", 1.0)?,
            ssm: [ssm[0], ssm[1], ssm[2], ssm[3], ssm[4]],
            ssm_out: f.f64_or("ssm_out_multiplier", 1.0)?,
            attention_in: f.f64_or("attention_in_multiplier", 1.0)?,
            key: f.f64_or("key_multiplier", 1.0)?,
            attention_out: f.f64_or("attention_out_multiplier", 1.0)?,
            mlp: [mlp[0], mlp[1]],
        };
        let lm_head_multiplier = f.f64_or("lm_head_multiplier", 1.0)?;
        if !(lm_head_multiplier.is_finite() && lm_head_multiplier != 0.0) {
            return Err(bad(format!("`lm_head_multiplier` is {lm_head_multiplier}; it must be finite and not 0")));
        }
        let config = Self {
            family: HybridFamily::FalconH1,
            d_model,
            vocab_size: mamba.vocab_size,
            tie_embeddings: mamba.tie_embeddings,
            layers: vec![LayerKind::Parallel; n_layer],
            mamba,
            n_heads,
            n_kv_heads,
            head_dim,
            attention_multiplier: 1.0 / (head_dim as f64).sqrt(),
            rope_theta: Some(super::config::rope_theta(&f, path)?),
            partial_rotary_factor: super::config::partial_rotary_factor(&f, 1.0)?,
            embedding_multiplier: f.f64_or("embedding_multiplier", 1.0)?,
            residual_multiplier: 1.0,
            logits_scaling: 1.0 / lm_head_multiplier,
            shared_intermediate: f.usize_or("intermediate_size", 14336)?,
            mlp_kind: MlpKind::SwiGlu,
            without_mlp: Vec::new(),
            n_experts: 0,
            top_k: 0,
            expert_intermediate: 0,
            routing: Routing::Softmax,
            moe_layers: Vec::new(),
            moe_shared_intermediate: 0,
            mup: Some(mup),
            moe_latent: 0,
            norm_eps,
        };
        config.validate(path)?;
        Ok(config)
    }
}
