//! Times the parts of one training step (forward trunk, head + loss, backward) on random data.
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use picaso_model::Mamba2Config;
use picaso_train::mamba::TrainMamba2;
use picaso_train::pretrain::init_weights;

fn main() -> candle_core::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let (b, t, chunk) =
        (args.first().copied().unwrap_or(8), args.get(1).copied().unwrap_or(256), args.get(2).copied().unwrap_or(64));
    let mut c = Mamba2Config::tiny(4, 4);
    c.d_model = 256;
    c.n_layer = 4;
    c.d_state = 64;
    c.headdim = 32;
    c.nheads = 16;
    c.vocab_size = 8192;
    let net = TrainMamba2::from_weights(&c, &init_weights(&c, 1), DType::F32, &Device::Cpu)?.with_chunk(chunk);
    let toks: Vec<u32> = (0..b * t).map(|i| (i * 7919 % 8192) as u32).collect();
    let x = Tensor::from_vec(toks.clone(), (b, t), &Device::Cpu)?;
    let y = toks;
    for _ in 0..3 {
        let t0 = Instant::now();
        let (h, _) = net.forward_hidden(&x, None)?;
        let t1 = Instant::now();
        let (loss, _) = net.loss(&x, &y, None)?;
        let t2 = Instant::now();
        let _g = loss.backward()?;
        let t3 = Instant::now();
        let t4 = Instant::now();
        let _g2 = h.sqr()?.mean_all()?.backward()?;
        let t5 = Instant::now();
        println!("trunk backward {:.3}s", (t5 - t4).as_secs_f64());
        println!(
            "trunk fwd {:.3}s  full fwd+loss {:.3}s  backward {:.3}s",
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64()
        );
    }
    Ok(())
}
