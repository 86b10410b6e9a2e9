//! Weighted sums of 10 inputs of mamba2-130m's size (4.8 M values) in each codec, against a
//! plain read of their bytes: `cargo run --release -p picaso-compose --example codec_speed`.

use picaso_compose::codec::{encode, Encoded};
use picaso_compose::{weighted_sum_values, Codec, Values};
use rayon::prelude::*;

fn main() {
    let (n, len, block) = (10, 24 * 24 * 64 * 128, 64 * 128);
    let xs: Vec<Vec<f32>> =
        (0..n).map(|i| (0..len).map(|j| ((j * 7 + i) % 101) as f32 / 50.0 - 1.0).collect()).collect();
    let w: Vec<f32> = (0..len / block * n).map(|i| (i % 7) as f32 / 7.0).collect();
    let mut out = vec![0.0f32; len];
    for codec in Codec::ALL {
        let enc: Vec<Encoded> = xs.iter().map(|x| encode(x, codec).unwrap()).collect();
        let views: Vec<Values<'_>> = match codec {
            Codec::F32 => xs.iter().map(|x| Values::F32(x)).collect(),
            _ => enc.iter().map(|e| Values::from_bytes(codec, &e.values, &e.scales, len).unwrap()).collect(),
        };
        let bytes: usize = views.iter().map(Values::nbytes).sum();
        let best = |f: &mut dyn FnMut()| {
            f();
            (0..5)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f();
                    t.elapsed().as_secs_f64() * 1e3
                })
                .fold(f64::INFINITY, f64::min)
        };
        let sum = best(&mut || weighted_sum_values(&views, &w, block, &mut out).unwrap());
        let raw: Vec<&[u8]> = enc.iter().map(|e| &e.values[..]).collect();
        let read = best(&mut || {
            let s: u64 = raw
                .par_iter()
                .flat_map(|r| r.par_chunks(65536))
                .map(|c| c.iter().map(|&b| b as u64).sum::<u64>())
                .sum();
            std::hint::black_box(s);
        });
        println!(
            "{codec:<5} {:>7.1} MB  sum {sum:>7.2} ms  read {read:>6.2} ms  {:>5.2}x",
            bytes as f64 / 1e6,
            sum / read
        );
    }
}
