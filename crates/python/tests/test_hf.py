"""picaso states in and out of transformers' caches: continuing from a moved state gives
transformers' own logits (to 1e-4), wherever transformers agrees with itself."""
import os

import numpy as np
import pytest

import picaso
from conftest import FIXTURES

if os.environ.get("CI"):  # CI installs both: their absence there is a failure, not a skip
    import torch
    import transformers
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
from picaso import hf  # noqa: E402


def load(case):
    path = FIXTURES / case / "hf"
    return picaso.Model.load(str(path)), transformers.AutoModelForCausalLM.from_pretrained(str(path)).float().eval()


def ids(vocab, n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(0, vocab, n)]


def hf_logits(hf_model, tokens, cache):
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor([tokens]), **hf.cache_kwargs(hf_model, cache)).logits[0, -1].numpy()


# transformers' own paths disagree in two places, so each check uses the path it trusts:
# its one-token Mamba-2 step ignores time_step_limit (g2 sets one), and its many-token
# Mamba-1 forward ignores the cached state (it starts from zeros).
@pytest.mark.parametrize("case,many,one", [("mamba2/g1", True, True), ("mamba2/g2", True, False), ("mamba1/a", False, True)])
def test_state_continues_in_transformers(case, many, one):
    model, hf_model = load(case)
    a, b = ids(hf_model.config.vocab_size, 13, 0), ids(hf_model.config.vocab_size, 5, 1)
    state = model.state(a)
    if many:
        np.testing.assert_allclose(hf_logits(hf_model, b, hf.to_cache(state, hf_model)), model.next_logits(b, state=state), atol=1e-4)
    if one:
        np.testing.assert_allclose(hf_logits(hf_model, b[:1], hf.to_cache(state, hf_model)), model.next_logits(b[:1], state=state), atol=1e-4)


@pytest.mark.parametrize("case", ["mamba2/g1", "mamba2/g2", "mamba1/a"])
def test_transformers_cache_back_to_picaso(case):
    model, hf_model = load(case)
    a, b = ids(hf_model.config.vocab_size, 13, 0), ids(hf_model.config.vocab_size, 4, 2)
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([a]), use_cache=True)
    back = hf.from_cache(hf.output_cache(out), hf_model, fingerprint=model.fingerprint, n_tokens=len(a),
                         log_decays=hf.log_decays(hf_model, a))
    mine = model.state(a)
    for i in range(mine.n_layers):
        np.testing.assert_allclose(back.ssm(i), mine.ssm(i), atol=1e-5)
        np.testing.assert_allclose(back.conv(i), mine.conv(i), atol=1e-5)
        np.testing.assert_allclose(back.log_decay(i), mine.log_decay(i), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.score(b, state=back), model.score(b, state=mine), atol=1e-4)
    # Composable: the log-decays came along.
    c = picaso.compose([back, model.state(b)], "picaso-r")
    d = picaso.compose([mine, model.state(b)], "picaso-r")
    np.testing.assert_allclose(c.ssm(0), d.ssm(0), atol=1e-5)


def test_interop_errors():
    model, hf_model = load("mamba2/g1")
    other, _ = load("mamba2/g2")
    with pytest.raises(picaso.InvalidArgument, match="layers"):
        hf.to_cache(other.state([1, 2, 3]), hf_model)
    with pytest.raises(picaso.InvalidArgument, match="DynamicCache"):
        hf.from_cache(object(), hf_model, fingerprint=model.fingerprint, n_tokens=0)


@pytest.mark.parametrize(
    "folder",
    [
        "models/picaso-hybrid",
        "testdata/granite/moe-rope-g2/hf",
        "testdata/granite/bamba-rope-g2/hf",
        "testdata/granite/nemotron-h-g2/hf",
        "testdata/granite/nemotron-h-moe-g2/hf",
        "testdata/granite/nemotron-h-latent-g2/hf",
        "testdata/granite/falcon-h1-g2/hf",
        "testdata/granite/falcon-h1-norm-g2/hf",
        "testdata/granite/jamba-moe/hf",
        "testdata/granite/jamba-dense/hf",
    ],
)
def test_hybrid_models_score_as_transformers(folder):
    """A hybrid (the bundled one, a MoE RoPE Granite 4.0 H fixture, a Bamba fixture, Nemotron-H and
    Falcon-H1 fixtures) scores as transformers' GraniteMoeHybridForCausalLM / BambaForCausalLM /
    NemotronHForCausalLM / FalconH1ForCausalLM does on the same folder; its composed states score
    from Python."""
    path = FIXTURES.parent / folder
    model = picaso.Model.load(str(path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    tokens = ids(hf_model.config.vocab_size, 300 if "picaso-hybrid" in folder else 37, 3)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].double()
    want = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
    got = model.score(tokens)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()
    parts = [model.state(tokens[a:b]) for a, b in [(0, 9), (9, 20)]]
    composed = picaso.compose(parts, method="picaso-r")
    assert composed.n_tokens == 20
    assert np.all(np.isfinite(model.score(tokens[20:30], composed)))


# transformers' one-token step skips the `time_step_limit` clamp its prefill applies (see
# docs/correctness.md), so on the fixtures that clamp dt it disagrees with its own full forward (by
# 0.65 in the logits on moe-rope-g2, 0.0057 on falcon-h1-g2): those fixtures check the many-token path.
# transformers' Jamba reads a cache's SSM states only one token at a time ("only"): its many-token
# scan starts from zero.
@pytest.mark.parametrize(
    "case,one", [("dense-nope-g1", True), ("moe-rope-g2", False), ("bamba-rope-g2", False), ("nemotron-h-g2", False),
                 ("nemotron-h-moe-g2", False), ("nemotron-h-latent-g2", True), ("falcon-h1-g2", False), ("falcon-h1-norm-g2", True),
                 ("jamba-moe", "only"), ("jamba-dense", "only")]
)
def test_hybrid_states_move_to_transformers_and_back(case, one):
    """A Granite 4.0 H, Bamba, Nemotron-H, Falcon-H1 or Jamba state (Mamba layers and attention keys/values,
    both in each Falcon-H1 layer; Nemotron-H's `mlp` blocks hold none, so picaso's layer j is its
    j-th mixer block) continues in transformers
    as in picaso, a transformers cache comes back to the same picaso state, and a composed state
    (PICASO-R + the union of keys and values) continues in transformers at its own position."""
    path = FIXTURES.parent / "testdata" / "granite" / case / "hf"
    model = picaso.Model.load(str(path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    vocab = hf_model.config.vocab_size
    a, b = ids(vocab, 13, 0), ids(vocab, 5, 1)
    state = model.state(a)
    kinds = {"attention": "attention", "full_attention": "attention", "hybrid": "hybrid"}
    assert state.layer_types == [kinds.get(t, "mamba") for t in hf_model.config.layer_types if t not in ("mlp", "moe")]
    for cont in {True: (b, b[:1]), False: (b,), "only": (b[:1],)}[one]:  # transformers counts positions from the cache's first layer, a Mamba one: pass them
        with torch.no_grad():
            logits = hf_model(input_ids=torch.tensor([cont]), position_ids=hf.position_ids(state, len(cont)),
                              **hf.cache_kwargs(hf_model, hf.to_cache(state, hf_model))).logits[0, -1].numpy()
        np.testing.assert_allclose(logits, model.next_logits(cont, state=state), atol=1e-4)

    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor([a]), use_cache=True)
    back = hf.from_cache(hf.output_cache(out), hf_model, fingerprint=model.fingerprint, n_tokens=len(a),
                         log_decays=hf.log_decays(hf_model, a))
    for i, kind in enumerate(state.layer_types):
        names = ([] if kind == "attention" else ["ssm", "conv", "log_decay"]) + ([] if kind == "mamba" else ["keys", "values"])
        for name in names:
            # float32 on both sides, summed in different orders: within 1e-5 of the tensor's scale.
            want = np.asarray(getattr(state, name)(i))
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(getattr(back, name)(i), want, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(model.score(b, state=back), model.score(b, state=state), atol=1e-4)

    parts = [model.state(ids(vocab, n, 10 + n)) for n in (7, 11, 4)]
    composed = picaso.compose(parts, "picaso-r")
    assert composed.position == 11 and composed.n_tokens == 22
    if one == "only":
        b = b[:1]
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([b]), position_ids=hf.position_ids(composed, len(b)),
                          **hf.cache_kwargs(hf_model, hf.to_cache(composed, hf_model))).logits[0, -1].numpy()
    np.testing.assert_allclose(logits, model.next_logits(b, state=composed), atol=1e-4)


def test_hybrid_state_arrays_and_errors():
    path = FIXTURES.parent / "testdata" / "granite" / "dense-nope-g1" / "hf"
    model = picaso.Model.load(str(path))
    state = model.state([1, 2, 3, 4])
    attention = state.layer_types.index("attention")
    mamba = state.layer_types.index("mamba")
    assert state.keys(attention).shape[1] == 4 and state.keys(attention).shape == state.values(attention).shape
    with pytest.raises(picaso.InvalidArgument, match="attention layer"):
        state.ssm(attention)
    with pytest.raises(picaso.InvalidArgument, match="not an attention layer"):
        state.keys(mamba)
    # Round trip through arrays: the same state, scoring the same.
    arrays = [tuple(d.values()) for d in state.layers]
    again = picaso.State.from_arrays(arrays, fingerprint=state.fingerprint, n_tokens=state.n_tokens)
    np.testing.assert_array_equal(model.score([5, 6, 7], state=again), model.score([5, 6, 7], state=state))
    bad = list(arrays)
    bad[attention] = (arrays[attention][0][:, :2], arrays[attention][1])
    with pytest.raises(picaso.InvalidArgument, match="same tokens"):
        picaso.State.from_arrays(bad, fingerprint=state.fingerprint, n_tokens=state.n_tokens)
    pure, hf_pure = load("mamba2/g1")
    with pytest.raises(picaso.InvalidArgument, match="do not match"):
        hf.to_cache(state, hf_pure)
