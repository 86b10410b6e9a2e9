"""The engine, states and composition from Python, checked against brute force in numpy."""
import itertools
import threading
import time

import numpy as np
import pytest

import picaso

A = "The Eiffel Tower is a wrought-iron lattice tower in Paris.\n\n"
B = "It was designed by the company of Gustave Eiffel and finished in 1889.\n\n"


def test_module_reads_well():
    assert picaso.__version__
    for name in picaso.__all__:
        assert getattr(picaso, name) is not None
    for obj in (picaso.Model, picaso.State, picaso.Store, picaso.compose, picaso.weights, picaso.Model.score):
        assert obj.__doc__ and len(obj.__doc__) > 20, obj


def test_markov_property_multi_token(model):
    """Scoring a + b equals scoring b from the state of a (b's first token is context)."""
    a, b = model.encode(A), model.encode(B)
    whole = model.score(a + b)
    tail = model.score(a[-1:] + b, state=model.state(a[:-1]))
    np.testing.assert_allclose(whole[len(a) - 1 :], tail, rtol=0, atol=1e-5)
    assert whole.dtype == np.float32 and whole.shape == (len(a) + len(b) - 1,)


def test_text_and_ids_agree(model):
    ids = model.encode(A)
    assert model.decode(ids) == A
    np.testing.assert_array_equal(model.score(A), model.score(ids))
    np.testing.assert_array_equal(model.next_logits(A), model.next_logits(ids))
    assert model.next_logits(A).shape[0] >= 8192
    zero = model.zero_state()
    assert zero.n_tokens == 0 and not np.any(zero.ssm(0)) and zero.nbytes == model.state(A).nbytes
    np.testing.assert_array_equal(model.score(A, state=zero), model.score(A))
    assert model.n_params == 17_426_304 and model.arch == "mamba2" and str(model.path).endswith("picaso-mamba2")
    assert "mamba2" in repr(model) and "n_tokens=0" in repr(zero)


def test_state_arrays_are_read_only_views(model):
    s = model.state(A)
    assert s.n_tokens == len(model.encode(A)) and s.fingerprint == model.fingerprint and s.arch == "mamba2"
    ssm, conv, ld = s.ssm(0), s.conv(0), s.log_decay(0)
    assert ssm.shape == (16, 64, 64) and conv.shape == (1152, 3) and ld.shape == (16,)
    assert ssm.dtype == np.float32 and not ssm.flags.writeable and not ssm.flags.owndata
    with pytest.raises(ValueError):
        ssm[0, 0, 0] = 1.0
    assert np.all(ld <= 0)
    assert len(s.layers) == s.n_layers == 8
    np.testing.assert_array_equal(s.layers[3]["conv"], s.conv(3))
    with pytest.raises(IndexError):
        s.ssm(8)
    # The views keep their state alive.
    v = model.state(B).ssm(1)
    assert np.isfinite(v).all()


# int8: half a step of max/127; int4: half the widest gap between its levels (1 − 0.7187).
@pytest.mark.parametrize("dtype,tol", [("f32", 0.0), ("bf16", 1e-2), ("int8", 0.5 / 127), ("int4", 0.5 * 0.2813)])
def test_save_load_round_trip(model, tmp_path, dtype, tol):
    s = model.state(A)
    path = tmp_path / "a.safetensors"
    s.save(str(path), dtype=dtype)
    t = picaso.State.load(str(path))
    assert (t.n_tokens, t.fingerprint, t.n_layers) == (s.n_tokens, s.fingerprint, s.n_layers)
    for i in range(s.n_layers):
        if dtype.startswith("int"):
            # Within half a step of the group's largest magnitude (groups of 32 values).
            want, got = s.ssm(i).reshape(-1), t.ssm(i).reshape(-1)
            pad = -len(want) % 32
            group_max = np.abs(np.pad(want, (0, pad)).reshape(-1, 32)).max(axis=1)
            bound = np.repeat(group_max * tol * 1.01, 32)[: len(want)]
            assert (np.abs(got - want) <= bound).all()
        else:
            np.testing.assert_allclose(t.ssm(i), s.ssm(i), rtol=tol, atol=tol)
        np.testing.assert_array_equal(t.log_decay(i), s.log_decay(i))  # always f32


def test_from_arrays_round_trip_and_errors(model):
    s = model.state(A)
    layers = [(l["ssm"], l["conv"], l["log_decay"]) for l in s.layers]
    t = picaso.State.from_arrays(layers, fingerprint=s.fingerprint, n_tokens=s.n_tokens)
    np.testing.assert_array_equal(model.score(B, state=t), model.score(B, state=s))
    with pytest.raises(picaso.InvalidArgument, match="layer 1: ssm has shape"):
        bad = list(layers)
        bad[1] = (layers[1][0][:8], layers[1][1], layers[1][2])
        picaso.State.from_arrays(bad, fingerprint=s.fingerprint, n_tokens=1)
    with pytest.raises(ValueError):
        picaso.State.from_arrays([], fingerprint=s.fingerprint, n_tokens=0)
    nan = [(np.full_like(x, np.nan), c, d) for x, c, d in layers]
    with pytest.raises(picaso.Error):
        picaso.State.from_arrays(nan, fingerprint=s.fingerprint, n_tokens=1)
    # Arrays that do not fit together (8 decays for 16 heads, an empty axis) would compose
    # with the decays applied to the wrong values: refused.
    with pytest.raises(picaso.InvalidArgument, match="do not fit"):
        picaso.State.from_arrays([(x, c, d[:8]) for x, c, d in layers], fingerprint=s.fingerprint, n_tokens=1)
    z = np.float32
    with pytest.raises(picaso.InvalidArgument, match="empty axis"):
        picaso.State.from_arrays([(np.zeros((0, 4, 4), z), np.zeros((4, 3), z), np.zeros((0,), z))], fingerprint="x", n_tokens=1)
    # Token counts saturate instead of wrapping around.
    big = picaso.State.from_arrays(layers, fingerprint=s.fingerprint, n_tokens=2**64 - 1)
    assert picaso.compose([big, big]).n_tokens == 2**64 - 1
    assert model.state(B, start=big).n_tokens == 2**64 - 1
    other = picaso.State.from_arrays(layers, fingerprint="mamba2-someone-else", n_tokens=1)
    with pytest.raises(picaso.StateMismatch):
        model.score(B, state=other)


def brute_force(xs, lds, method):
    """Composed ssm of one layer by the paper's definitions: xs (n, H, P, N), lds (n, H)."""
    n = len(xs)

    def caso(order):
        out = np.zeros_like(xs[0], dtype=np.float64)
        for pos, i in enumerate(order):
            later = sum(lds[j] for j in order[pos + 1 :]) if pos + 1 < n else np.zeros_like(lds[0])
            out += np.exp(later)[:, None, None] * xs[i]
        return out

    if method == "soup":
        return np.mean(xs, axis=0)
    if method == "caso":
        return caso(list(range(n)))
    if method == "picaso-r":
        return np.mean([caso([(r + k) % n for k in range(n)]) for r in range(n)], axis=0)
    return np.mean([caso(list(p)) for p in itertools.permutations(range(n))], axis=0)


@pytest.mark.parametrize("method", picaso.METHODS)
def test_compose_matches_brute_force(model, method):
    texts = [A, B, "Paris is the capital of France.\n\n", "Iron rusts when it meets water and air.\n\n"]
    states = [model.state(t) for t in texts]
    c = picaso.compose(states, method=method)
    assert c.n_tokens == sum(s.n_tokens for s in states)
    for layer in (0, 7):
        xs = np.stack([s.ssm(layer).astype(np.float64) for s in states])
        lds = np.stack([s.log_decay(layer).astype(np.float64) for s in states])
        want = brute_force(xs, lds, method)
        np.testing.assert_allclose(c.ssm(layer), want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(c.log_decay(layer), lds.sum(0), rtol=1e-5)
    # Every method averages the conv tails.
    np.testing.assert_allclose(c.conv(2), np.mean([s.conv(2) for s in states], axis=0), rtol=1e-5, atol=1e-6)


def test_compose_order_and_weights():
    lds = [-0.1, -0.7, -2.0]
    w = picaso.weights(lds, "caso")
    np.testing.assert_allclose(w, [np.exp(-0.7 - 2.0), np.exp(-2.0), 1.0], rtol=1e-12)
    np.testing.assert_allclose(picaso.weights(lds, "soup"), [1 / 3] * 3, rtol=1e-12)
    r = picaso.weights(lds, "picaso-r")
    rot = [np.roll(np.arange(3), -k) for k in range(3)]
    want = np.zeros(3)
    for order in rot:
        for pos, i in enumerate(order):
            want[i] += np.exp(sum(lds[j] for j in order[pos + 1 :])) / 3
    np.testing.assert_allclose(r, want, rtol=1e-12)
    with pytest.raises(picaso.InvalidArgument, match="not a number <= 0"):
        picaso.weights([0.5], "caso")


def test_compose_order_argument(model):
    a, b = model.state(A), model.state(B)
    np.testing.assert_array_equal(picaso.compose([a, b], "caso", order=[1, 0]).ssm(0), picaso.compose([b, a], "caso").ssm(0))
    with pytest.raises(ValueError, match="not a permutation"):
        picaso.compose([a, b], "caso", order=[0, 0])


def test_generate_from_states(model):
    both = picaso.compose([model.state(A), model.state(B)], "picaso-r")
    g = model.generate("The tower", state=both, max_tokens=8)
    assert isinstance(g, picaso.Generation) and g.stop_reason == "length" and len(g.token_ids) == 8
    assert g.text == model.decode(g.token_ids)
    assert g.state.n_tokens == both.n_tokens + len(model.encode("The tower")) + 8
    again = model.generate("The tower", state=both, max_tokens=8)
    assert again.text == g.text  # greedy is deterministic
    sampled = [model.generate("The tower", max_tokens=8, temperature=1.0, seed=s).text for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]
    stopped = model.generate("The tower", state=both, max_tokens=32, stop=[g.text[3:6]])
    assert stopped.stop_reason == "stop"


def test_bad_arguments_raise_clear_errors(model, tiny):
    a = model.state(A)
    with pytest.raises(picaso.InvalidArgument, match="unknown composition method"):
        picaso.compose([a], method="average")
    with pytest.raises(ValueError, match="no contexts"):
        picaso.compose([], method="soup")
    with pytest.raises(TypeError):
        model.score(3.5)
    with pytest.raises(ValueError, match="token id"):
        model.score([1, -2])
    with pytest.raises(ValueError):
        model.score([1, 10**6])
    with pytest.raises(ValueError, match="temperature"):
        model.generate("x", temperature=-1.0)
    with pytest.raises(ValueError, match="at least one token"):
        model.generate("")
    with pytest.raises(ValueError, match="nothing to score"):
        model.score("")
    with pytest.raises(ValueError, match="nothing to score"):
        model.score([])
    with pytest.raises(picaso.StateMismatch):
        tiny.score([1, 2, 3], state=a)
    with pytest.raises(picaso.StateMismatch):
        picaso.compose([a, tiny.state([1, 2])], "soup")
    with pytest.raises(FileNotFoundError):
        picaso.Model.load("/no/such/model")
    with pytest.raises(picaso.NotFound):
        picaso.State.load("/no/such/state.safetensors")
    with pytest.raises(picaso.InvalidArgument):
        a.save("/tmp/x.safetensors", dtype="f16")
    with pytest.raises(picaso.Error, match="tokenizer"):
        tiny.score("text needs a tokenizer")


def test_tiny_model_token_ids(tiny):
    s = tiny.state([5, 6, 7])
    assert s.ssm(0).shape == (4, 16, 8)
    np.testing.assert_allclose(tiny.score([5, 6, 7, 8, 9])[2:], tiny.score([7, 8, 9], state=tiny.state([5, 6])), atol=1e-5)
    # Without a tokenizer generation is token ids in, token ids out.
    g = tiny.generate([5, 6, 7], max_tokens=4)
    assert g.text is None and len(g.token_ids) == 4 and g.stop_reason == "length"
    assert g.token_ids[0] == int(np.argmax(tiny.next_logits([5, 6, 7])))
    np.testing.assert_allclose(g.state.ssm(1), tiny.state([5, 6, 7] + g.token_ids).ssm(1), atol=1e-5)
    with pytest.raises(picaso.Error, match="stop strings are matched in text, which needs a tokenizer"):
        tiny.generate([5, 6, 7], max_tokens=4, stop=["x"])


def test_model_work_releases_the_gil(model):
    """Another Python thread runs while a long score is under way."""
    ids = model.encode(A) * 60  # ~1,000 tokens: about half a second here
    done = threading.Event()
    worker = threading.Thread(target=lambda: (model.score(ids), done.set()))
    worker.start()
    time.sleep(0.02)  # the worker is inside score now
    counted = 0
    while not done.is_set() and counted < 100_000:
        counted += 1
    finished_first = done.is_set()
    worker.join()
    assert counted == 100_000 and not finished_first


def test_decode_refuses_ids_outside_the_vocabulary(model):
    assert model.decode(model.encode("Paris")) == "Paris"
    with pytest.raises(picaso.InvalidArgument, match="outside the vocabulary"):
        model.decode([51, 10**6, 3393])
