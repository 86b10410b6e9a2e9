//! Where a codec's error enters a composed state: the SSM states or the keys and values, and
//! which layers. Each WikiText paragraph's first half is scored after a PICASO-R composition of
//! the k paragraphs before it (their states made once), with the states in f32, then with one
//! part of them passed through a codec (every SSM layer, one SSM layer, the keys and values):
//! the mean change of the loss against f32 says how much each part costs.
//!
//! `cargo run --release -p picaso-model --example codec_error_sources -- MODEL WIKITEXT [CODEC] [PASSAGES] [K]`

use std::path::Path;

use picaso_model::{compose, Composition, LoadOptions, Model, State, StateDtype};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (model, text) = match (args.get(1), args.get(2)) {
        (Some(m), Some(t)) => (m, t),
        _ => return Err("usage: codec_error_sources MODEL WIKITEXT [CODEC] [PASSAGES] [K]".into()),
    };
    let codec: StateDtype = args.get(3).map_or("int4", String::as_str).parse()?;
    let passages: usize = args.get(4).map_or(Ok(40), |s| s.parse())?;
    let k: usize = args.get(5).map_or(Ok(10), |s| s.parse())?;
    let m = Model::load(Path::new(model), &LoadOptions::default())?;
    let tok = m.tokenizer()?;
    let paragraphs: Vec<Vec<u32>> = std::fs::read_to_string(text)?
        .lines()
        .map(str::trim)
        .filter(|l| l.split_whitespace().count() > 40 && !l.starts_with('='))
        .map(|l| tok.encode(l))
        .collect::<Result<_, _>>()?;
    // Through the codec and back: what a stored state holds.
    let through = |s: &State| State::from_bytes(&s.to_bytes(codec).unwrap()).unwrap();
    let n_ssm = m.zero_state().layers.len();
    let n_kv = m.zero_state().attention.len();
    let variants: Vec<String> = ["all", "ssm"]
        .into_iter()
        .map(String::from)
        .chain((0..n_ssm).map(|l| format!("ssm layer {l}")))
        .chain((n_kv > 0).then(|| "keys and values".to_string()))
        .collect();
    let mut delta = vec![0.0f64; variants.len()];
    let mut counted = 0;
    for p in (k..paragraphs.len()).step_by((paragraphs.len() / passages).max(1)).take(passages) {
        let states: Vec<State> =
            paragraphs[p - k..p].iter().map(|t| m.prefill(t, &m.zero_state())).collect::<Result<_, _>>()?;
        let coded: Vec<State> = states.iter().map(through).collect();
        let query = &paragraphs[p][..paragraphs[p].len() / 2];
        let loss = |parts: &[State]| -> f64 {
            let refs: Vec<&State> = parts.iter().collect();
            let s = compose(Composition::PicasoR, &refs, None).unwrap();
            let lp = m.score(query, &s).unwrap().logprobs;
            -lp.iter().map(|&v| v as f64).sum::<f64>() / lp.len() as f64
        };
        let base = loss(&states);
        for (v, name) in variants.iter().enumerate() {
            let mixed: Vec<State> = states
                .iter()
                .zip(&coded)
                .map(|(s, c)| {
                    let mut x = s.clone();
                    match name.as_str() {
                        "all" => x = c.clone(),
                        "ssm" => x.layers = c.layers.clone(),
                        "keys and values" => x.attention = c.attention.clone(),
                        layer => {
                            let l: usize = layer.trim_start_matches("ssm layer ").parse().unwrap();
                            x.layers[l] = c.layers[l].clone();
                        }
                    }
                    x
                })
                .collect();
            delta[v] += (loss(&mixed) - base).abs();
        }
        counted += 1;
    }
    println!("{model}: {codec}, PICASO-R of k = {k}, {counted} passages; mean |loss change| against f32 states (nats per token):");
    for (name, d) in variants.iter().zip(&delta) {
        println!("  {name:<16} {:.5}", d / counted as f64);
    }
    Ok(())
}
