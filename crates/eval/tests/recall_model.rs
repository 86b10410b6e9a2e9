//! The committed recall model (`models/picaso-recall`, trained by `picaso train pretrain
//! --config models/training/recall.json`) recalls through every path a state crosses: the
//! tokenizer written with it, prefill of each context, composition, and scoring. A regression
//! in any of them shows up as lost accuracy.

use picaso_eval::recall::{run, Form, Options, Task};
use picaso_eval::{Composition, Method};
use picaso_model::{LoadOptions, Model};

fn model() -> Model {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/picaso-recall");
    Model::load(&dir, &LoadOptions::default()).expect("the committed recall model loads")
}

#[test]
fn the_recall_model_recalls_through_concat_and_composition() {
    let m = model();
    let task = Task::synthetic_from_vocab(&m.tokenizer().unwrap().inner().get_vocab(true), 4).unwrap();
    assert_eq!(task, Task { form: Form::Synthetic, facts: 4, keys: 256, values: 256 });
    let options = Options {
        task,
        ks: vec![1, 4],
        episodes: 25,
        queries: 4,
        orders: 2,
        distractors: 9,
        methods: vec![
            Method::Naive,
            Method::Concat,
            Method::Compose(Composition::Soup),
            Method::Compose(Composition::PicasoS),
            Method::Compose(Composition::PicasoR),
        ],
        seed: 11,
    };
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
