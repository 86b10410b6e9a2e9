//! The committed recall model (`models/picaso-recall`, trained by `picaso train pretrain
//! --config models/training/recall.json`) recalls through every path a state crosses: the
//! tokenizer written with it, prefill of each context, composition, and scoring. A regression
//! in any of them shows up as lost accuracy.

use picaso_eval::recall::{run, Form, Options, Task};
use picaso_eval::{Composition, Method};
use picaso_model::{LoadOptions, Model};

fn model(name: &str) -> Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(name);
    Model::load(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("the committed {name} loads: {e}"))
}

/// A short run of `methods` at k = 1 and 4 on the synthetic task of `m`'s vocabulary.
fn options(m: &Model, methods: Vec<Method>) -> Options {
    let task = Task::synthetic_from_vocab(&m.tokenizer().unwrap().inner().get_vocab(true), 4).unwrap();
    Options { task, ks: vec![1, 4], episodes: 25, queries: 4, orders: 2, distractors: 9, methods, seed: 11 }
}

#[test]
fn the_recall_model_recalls_through_concat_and_composition() {
    let m = model("picaso-recall");
    let options = options(
        &m,
        vec![
            Method::Naive,
            Method::Concat,
            Method::Compose(Composition::Soup),
            Method::Compose(Composition::PicasoS),
            Method::Compose(Composition::PicasoR),
        ],
    );
    assert_eq!(options.task, Task { form: Form::Synthetic, facts: 4, keys: 256, values: 256 });
    let r = run(&m, &options, |_, _| {}).unwrap();
    let exact = |method: Method, k: usize| r.cell(method, k).unwrap().exact;
    assert!(exact(Method::Concat, 1) >= 0.95, "concat k=1: {}", exact(Method::Concat, 1));
    assert!(exact(Method::Concat, 4) >= 0.9, "concat k=4: {}", exact(Method::Concat, 4));
    assert!(exact(Method::Compose(Composition::PicasoR), 4) >= 0.85);
    // Without the facts there is nothing to recall; averaging the states dilutes them.
    assert!(exact(Method::Naive, 4) <= 0.05);
    assert!(exact(Method::Compose(Composition::Soup), 4) < exact(Method::Compose(Composition::PicasoR), 4));
    // PICASO-S answers the same in every order of its inputs.
    let s = r.cell(Method::Compose(Composition::PicasoS), 4).unwrap();
    assert_eq!((s.order_range, s.order_flips), (0.0, 0.0));
}

/// The committed hybrid recall model (`models/picaso-recall-hybrid`: one Mamba-2 and one NoPE
/// attention layer) recalls through Concat and through its composed state (PICASO on the Mamba
/// layer, the union of keys and values on the attention layer); each half alone keeps less.
#[test]
fn the_hybrid_recall_model_recalls_through_its_composed_state() {
    let m = model("picaso-recall-hybrid");
    let options = options(
        &m,
        vec![
            Method::Naive,
            Method::Concat,
            Method::Compose(Composition::PicasoS),
            Method::Compose(Composition::PicasoR),
            Method::KvUnion,
            Method::PicasoRNoKv,
        ],
    );
    let r = run(&m, &options, |_, _| {}).unwrap();
    let exact = |method: Method, k: usize| r.cell(method, k).unwrap().exact;
    assert!(exact(Method::Concat, 1) >= 0.95, "concat k=1: {}", exact(Method::Concat, 1));
    assert!(exact(Method::Concat, 4) >= 0.9, "concat k=4: {}", exact(Method::Concat, 4));
    let picaso_r = exact(Method::Compose(Composition::PicasoR), 4);
    assert!(picaso_r >= 0.9, "picaso-r + kv union k=4: {picaso_r}");
    assert!(exact(Method::Naive, 4) <= 0.05);
    // This model recalls through its Mamba layer (measured at k = 4: the Mamba states alone
    // 97%, the keys and values alone 2%): each ablation drops exactly its half.
    let (ssm_only, kv_only) = (exact(Method::PicasoRNoKv, 4), exact(Method::KvUnion, 4));
    assert!(ssm_only >= 0.8, "picaso-r without keys and values k=4: {ssm_only}");
    assert!(kv_only <= 0.2, "keys and values without Mamba states k=4: {kv_only}");
    let s = r.cell(Method::Compose(Composition::PicasoS), 4).unwrap();
    assert_eq!((s.order_range, s.order_flips), (0.0, 0.0));
}
