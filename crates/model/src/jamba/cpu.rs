//! The CPU engine of a Jamba model: each layer is an RMSNorm, a mixer (the Mamba-1 engine's
//! mixer with RMSNorms on the time step, B and C, or NoPE grouped-query attention over the
//! state's keys and values, as the hybrid engine runs it) added to the residual stream, then an
//! RMSNorm and a SwiGLU MLP or routed experts, added too.
//!
//! Prefill and decode are one code path, so scoring `a + b` equals scoring `b` from the state
//! of `a`; a composed state's keys (a union of contexts) are attended as any others.

use rayon::prelude::*;

use super::config::JambaConfig;
use super::weights::{JambaFeedForward, JambaMixerWeights, JambaWeights};
use crate::cpu::layers::by_kind;
use crate::cpu::matmul::{Bf16Kernel, Matrix};
use crate::cpu::rows::{rows_par, Rows};
use crate::cpu::token_io::TokenIo;
use crate::cpu::{matmul, norm, on_pool, WeightDtype};
use crate::granite_hybrid::cpu::{add_experts, add_scaled, attention, feed_forward, AttentionDims, Route};
use crate::granite_hybrid::MlpKind;
use crate::mamba1::cpu::Mixer as Mamba1Mixer;
use crate::state::{KvState, LayerState, State};

/// A Jamba model ready to run on the CPU.
#[derive(Debug)]
pub struct CpuJamba {
    config: JambaConfig,
    dims: AttentionDims,
    io: TokenIo,
    layers: Vec<Layer>,
}

#[derive(Debug)]
struct Layer {
    input_norm: Vec<f32>,
    mixer: Mixer,
    ff_norm: Vec<f32>,
    ff: FeedForward,
}

#[derive(Debug)]
enum Mixer {
    /// The `slot`-th Mamba layer (its state is `state.layers[slot]`).
    Mamba(usize, Box<Mamba1Mixer>),
    /// The `slot`-th attention layer (its state is `state.attention[slot]`): q, k, v, o.
    Attention(usize, Box<[Matrix; 4]>),
}

#[derive(Debug)]
enum FeedForward {
    /// Gate and up stacked; down.
    Mlp(Matrix, Matrix),
    /// The router (n_experts × d_model, f32: routing must not move with the weights' dtype),
    /// and per expert its gate and up stacked, and down.
    Experts(Vec<f32>, Vec<(Matrix, Matrix)>),
}

impl CpuJamba {
    /// Takes ownership of validated weights, storing the large matrices in `dtype`.
    pub fn new(config: JambaConfig, weights: JambaWeights, dtype: WeightDtype) -> Self {
        let kernel = Bf16Kernel::detect();
        let mat = |v: Vec<f32>, cols: usize| Matrix::with_kernel(v, cols, dtype, kernel);
        let (d, inner) = (config.d_model, config.intermediate);
        let qw = config.n_heads * config.head_dim;
        let eps = config.norm_eps as f32;
        let (mut n_mamba, mut n_attention) = (0, 0);
        let layers = weights
            .layers
            .into_iter()
            .map(|l| {
                let mixer = match l.mixer {
                    JambaMixerWeights::Mamba(m, norms) => {
                        n_mamba += 1;
                        Mixer::Mamba(
                            n_mamba - 1,
                            Box::new(Mamba1Mixer::new(*m, &config.mamba, dtype, Some((norms, eps)))),
                        )
                    }
                    JambaMixerWeights::Attention(a) => {
                        n_attention += 1;
                        Mixer::Attention(
                            n_attention - 1,
                            Box::new([mat(a.q, d), mat(a.k, d), mat(a.v, d), mat(a.o, qw)]),
                        )
                    }
                };
                let ff = match l.ff {
                    JambaFeedForward::Mlp { gate_up, down } => FeedForward::Mlp(mat(gate_up, d), mat(down, inner)),
                    JambaFeedForward::Experts { router, gate_up, down } => {
                        let experts = split_experts(gate_up, 2 * inner * d)
                            .into_iter()
                            .zip(split_experts(down, d * inner))
                            .map(|(gu, dn)| (mat(gu, d), mat(dn, inner)))
                            .collect();
                        FeedForward::Experts(router, experts)
                    }
                };
                Layer { input_norm: l.input_norm, mixer, ff_norm: l.ff_norm, ff }
            })
            .collect();
        let dims = AttentionDims {
            d_model: d,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
            scale: 1.0 / (config.head_dim as f32).sqrt(),
            rope: None,
        };
        let io =
            TokenIo::new(weights.embedding, weights.lm_head, weights.norm_f, config.norm_eps, config.vocab_size, dtype);
        Self { config, dims, io, layers }
    }

    /// The config.
    pub fn config(&self) -> &JambaConfig {
        &self.config
    }

    /// Runs `tokens` from `state` (updated in place) and returns the final-normed hidden states.
    pub fn forward(&self, tokens: &[u32], state: &mut State) -> Vec<f32> {
        self.forward_batch(tokens, &[tokens.len()], &mut [state])
    }

    /// Several sequences at once: `lens[i]` tokens continue `states[i]`. Single tokens and
    /// longer sequences run as separate passes (`cpu::by_kind`).
    pub fn forward_batch(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Vec<f32> {
        by_kind(self.config.d_model, tokens, lens, states, |t, l, s| self.forward_one_kind(t, l, s))
    }

    fn forward_one_kind(&self, tokens: &[u32], lens: &[usize], states: &mut [&mut State]) -> Vec<f32> {
        let c = &self.config;
        let (d, eps) = (c.d_model, c.norm_eps as f32);
        on_pool(|| {
            let kind = Rows::of(lens);
            let mut h = self.io.embed(tokens);
            let positions: Vec<u64> = states.iter().map(|s| s.position).collect();
            let rows = tokens.len();
            let mut xn = vec![0.0f32; rows * d];
            let mut branch = vec![0.0f32; rows * d];
            for layer in &self.layers {
                rows_par(&h, &mut xn, d, d, |x, o| norm::rmsnorm(x, &layer.input_norm, eps, o));
                match &layer.mixer {
                    Mixer::Mamba(slot, m) => {
                        let mut ls: Vec<&mut LayerState> = states.iter_mut().map(|s| &mut s.layers[*slot]).collect();
                        m.run(&c.mamba, &xn, &mut ls, lens, kind, &mut h, true);
                    }
                    Mixer::Attention(slot, w) => {
                        let mut kv: Vec<&mut KvState> = states.iter_mut().map(|s| &mut s.attention[*slot]).collect();
                        let [q, k, v, o] = &**w;
                        attention(&self.dims, &xn, &mut kv, &positions, lens, kind, [q, k, v, o], &mut branch);
                        add_scaled(&mut h, &branch, 1.0);
                    }
                }
                rows_par(&h, &mut xn, d, d, |x, o| norm::rmsnorm(x, &layer.ff_norm, eps, o));
                match &layer.ff {
                    FeedForward::Mlp(gate_up, down) => {
                        feed_forward(MlpKind::SwiGlu, &xn, rows, d, c.intermediate, gate_up, down, kind, &mut branch);
                    }
                    FeedForward::Experts(router, experts) => {
                        let routes: Vec<Route> = xn.par_chunks(d).map(|x| route(router, x, c.top_k)).collect();
                        branch.fill(0.0);
                        add_experts(MlpKind::SwiGlu, &xn, d, c.intermediate, routes, experts, kind, &mut branch);
                    }
                }
                add_scaled(&mut h, &branch, 1.0);
            }
            for (s, &t) in states.iter_mut().zip(lens) {
                s.advance(t);
            }
            self.io.final_norm(&h)
        })
    }

    /// Logits (rows × vocab) of hidden rows from [`CpuJamba::forward`].
    pub fn logits(&self, hidden: &[f32], kind: Rows) -> Vec<f32> {
        self.io.logits(hidden, kind)
    }

    /// `log p(targets[i] | hidden row i)` for each row.
    pub fn logprobs(&self, hidden: &[f32], targets: &[u32]) -> Vec<f32> {
        self.io.logprobs(hidden, targets)
    }
}

/// The experts' matrices of `each` floats, one after another in `all`, as one vector each.
/// Split off from the end, each time giving the rest's unused room back, so a layer's experts
/// never sit in memory twice (Jamba 1.5 Large's are 2.8 G floats a layer).
fn split_experts(mut all: Vec<f32>, each: usize) -> Vec<Vec<f32>> {
    let n = all.len() / each;
    let mut out: Vec<Vec<f32>> = (0..n)
        .rev()
        .map(|x| {
            let part = all.split_off(x * each);
            all.shrink_to_fit();
            part
        })
        .collect();
    out.reverse();
    out
}

/// A row's experts and their weights, as Jamba routes: the softmax over all the router's
/// logits, of which the `top` largest are kept as they are (not renormalised); ties go to the
/// lower index.
fn route(router: &[f32], x: &[f32], top: usize) -> Route {
    let d = x.len();
    let logits: Vec<f32> = router.chunks_exact(d).map(|w| matmul::dot(x, w)).collect();
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let sum: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    let mut picked: Vec<(usize, f32)> = logits.iter().map(|&l| (l - max).exp() / sum as f32).enumerate().collect();
    picked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    picked.truncate(top);
    picked
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The GPU engine runs Mamba-2 mixers: it refuses a Jamba model by name, saying which
    /// engine runs it.
    #[test]
    fn the_gpu_engine_refuses_jamba_by_name() {
        let c = JambaConfig::tiny(61);
        let w = JambaWeights::random(&c, 1);
        let gpu = crate::Backend::Gpu(crate::gpu::testing::test_gpu());
        let err = crate::Model::from_jamba_weights_on(c, w, None, &gpu, WeightDtype::F32).unwrap_err().to_string();
        assert!(err.contains("Jamba") && err.contains("--device cpu"), "{err}");
    }

    /// Random weights of the tiny shape run: finite log-probs, and the state holds 3 Mamba-1
    /// layers and 2 attention layers with a key per token.
    #[test]
    fn a_tiny_random_jamba_runs() {
        let c = JambaConfig::tiny(61);
        let m = CpuJamba::new(c.clone(), JambaWeights::random(&c, 2), WeightDtype::F32);
        let mut s = State::zeros(c.state_shape(), "test");
        let h = m.forward(&[1, 2, 3, 4, 5], &mut s);
        assert!(m.logprobs(&h[..4 * c.d_model], &[2, 3, 4, 5]).iter().all(|l| l.is_finite() && *l < 0.0));
        assert_eq!((s.layers.len(), s.attention.len(), s.n_tokens), (3, 2, 5));
        assert_eq!(s.attention[0].tokens(c.n_kv_heads * c.head_dim), 5);
    }

    #[test]
    fn experts_split_in_order() {
        let parts = split_experts((0..12).map(|v| v as f32).collect(), 4);
        assert_eq!(parts, vec![vec![0.0, 1.0, 2.0, 3.0], vec![4.0, 5.0, 6.0, 7.0], vec![8.0, 9.0, 10.0, 11.0]]);
    }

    /// Jamba's routing keeps the top-k of the softmax over all experts, unnormalised: worked
    /// by hand for logits 0, 1, 2, -1.
    #[test]
    fn routing_keeps_the_top_k_of_the_full_softmax() {
        // A router whose rows pick the logits out of x = (0, 1, 2, -1).
        let router = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0];
        let x = [0.0, 1.0, 2.0, -1.0];
        let z: f32 = x.iter().map(|v: &f32| v.exp()).sum();
        let got = route(&router, &x, 2);
        let want = [(2, 2f32.exp() / z), (1, 1f32.exp() / z)];
        assert_eq!(got.len(), 2);
        for ((j, w), (wj, ww)) in got.iter().zip(want) {
            assert!(*j == wj && (w - ww).abs() < 1e-6, "{got:?} vs {want:?}");
        }
    }
}
