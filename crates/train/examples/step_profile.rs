//! Times one training step (forward + loss + backward) of the candle trainer and of the CPU
//! fast path on random data: `step_profile BATCH SEQ_LEN CHUNK [D_MODEL N_LAYER D_STATE HEADDIM VOCAB]`.
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use picaso_model::Mamba2Config;
use picaso_train::cpu::ops::Matmul;
use picaso_train::cpu::CpuTrainer;
use picaso_train::mamba::TrainMamba2;
use picaso_train::pretrain::init_weights;
use picaso_train::Net;

fn main() -> candle_core::Result<()> {
    // As the picaso binary does: freed activations are reused, not mapped and zeroed anew.
    picaso_model::reuse_freed_buffers();
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().expect("numbers")).collect();
    let arg = |i: usize, default: usize| args.get(i).copied().unwrap_or(default);
    let (b, t, chunk) = (arg(0, 8), arg(1, 256), arg(2, 64));
    let mut c = Mamba2Config::tiny(4, 4);
    c.d_model = arg(3, 256);
    c.n_layer = arg(4, 4);
    c.d_state = arg(5, 64);
    c.headdim = arg(6, 32);
    c.nheads = c.d_model * 2 / c.headdim;
    c.n_groups = 1;
    c.vocab_size = arg(7, 8192);
    let skip_candle = std::env::var("SKIP_CANDLE").is_ok();
    let w = init_weights(&c, 1);
    let toks: Vec<u32> = (0..b * t).map(|i| (i * 7919 % c.vocab_size) as u32).collect();
    let tokens_per_step = (b * t) as f64;
    println!(
        "batch {b} × {t} tokens, chunk {chunk}, d_model {} × {} layers, d_state {}, headdim {}, vocab {}, {} threads",
        c.d_model,
        c.n_layer,
        c.d_state,
        c.headdim,
        c.vocab_size,
        rayon::current_num_threads()
    );
    if !skip_candle {
        let net = TrainMamba2::from_weights(&c, &w, DType::F32, &Device::Cpu)?.with_chunk(chunk);
        let x = Tensor::from_vec(toks.clone(), (b, t), &Device::Cpu)?;
        for _ in 0..3 {
            let t0 = Instant::now();
            let (loss, _) = net.loss(&x, &toks, None)?;
            let t1 = Instant::now();
            let _g = loss.backward()?;
            let t2 = Instant::now();
            let step = (t2 - t0).as_secs_f64();
            println!(
                "candle   fwd+loss {:.3}s  backward {:.3}s  step {:.3}s  {:.0} tokens/s",
                (t1 - t0).as_secs_f64(),
                (t2 - t1).as_secs_f64(),
                step,
                tokens_per_step / step
            );
        }
    }
    // The fast path in each precision asked for (MATMUL=f32,bf16; default f32).
    let asked = std::env::var("MATMUL").unwrap_or_else(|_| "f32".into());
    for name in asked.split(',') {
        let matmul = match name {
            "f32" => Matmul::F32,
            "bf16" => Matmul::Bf16,
            other => panic!("MATMUL={other}: expected f32 or bf16"),
        };
        fast_steps(&CpuTrainer::new(&c, chunk)?.with_matmul(matmul), matmul, &w, &toks, b, t)?;
    }
    Ok(())
}

fn fast_steps(
    fast: &CpuTrainer,
    matmul: Matmul,
    w: &picaso_model::Mamba2Weights,
    toks: &[u32],
    b: usize,
    t: usize,
) -> candle_core::Result<()> {
    let tokens_per_step = (b * t) as f64;
    let mut grads = CpuTrainer::zero_grads(w);
    for _ in 0..3 {
        let t0 = Instant::now();
        fast.token_losses(w, toks, toks, b, t)?;
        let t1 = Instant::now();
        fast.loss_and_grads(w, toks, toks, b, t, &mut grads)?;
        let t2 = Instant::now();
        let step = (t2 - t1).as_secs_f64();
        println!(
            "cpu-fast {} fwd+loss {:.3}s  step {:.3}s  {:.0} tokens/s",
            matmul.describe(),
            (t1 - t0).as_secs_f64(),
            step,
            tokens_per_step / step
        );
    }
    Ok(())
}
