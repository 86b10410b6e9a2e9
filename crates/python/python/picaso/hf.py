"""picaso states in and out of Hugging Face transformers' Mamba caches.

A picaso `State` holds, per layer, the SSM state, the last d_conv - 1 inputs of the causal
convolution and the log of the accumulated decay. transformers (>= 5) keeps the first two in
its `DynamicCache` (a linear-attention layer per Mamba layer: `recurrent_states` of shape
(batch, heads, headdim, d_state) for Mamba-2 or (batch, d_inner, d_state) for Mamba-1, and
`conv_states` of shape (batch, conv_dim, d_conv)), so a state moves across exactly:

    >>> from transformers import Mamba2ForCausalLM
    >>> from picaso import hf
    >>> hf_model = Mamba2ForCausalLM.from_pretrained(path)
    >>> cache = hf.to_cache(state, hf_model)                      # picaso -> transformers
    >>> out = hf_model(input_ids, **hf.cache_kwargs(hf_model, cache))
    >>> back = hf.from_cache(hf.output_cache(out), hf_model, fingerprint=model.fingerprint,
    ...                      n_tokens=..., log_decays=hf.log_decays(hf_model, input_ids))

A hybrid's state (GraniteMoeHybridForCausalLM, BambaForCausalLM, NemotronHForCausalLM,
FalconH1ForCausalLM, JambaForCausalLM) moves the same way: its Mamba layers as above, each attention layer's keys and
values (kv_heads, tokens, head_dim) into the cache's attention layer; a Falcon-H1 layer (layer type
"hybrid": a Mamba mixer and attention side by side) holds both in one cache layer. A Nemotron-H model's `mlp` and `moe` blocks hold no state: picaso's
layer j is its j-th Mamba or attention block (each `mlp` or `moe` block joins the one before it),
and the cache's layer index is the block's. Pass `position_ids=hf.position_ids(state, n)` to a RoPE hybrid's forward: transformers
counts positions from its cache's first layer, a Mamba layer that holds none, and a composed
state continues at `state.position` (its longest part's length), not at its token count.
transformers' Jamba reads a cache's SSM states only one token at a time (its many-token scan
starts from zero, a TODO in its code): continue a Jamba cache token by token.

transformers does not keep the log-decays. They are only needed to *compose* a state (every
method but soup weights contexts by them); `log_decays(hf_model, input_ids)` computes them
from the tokens, or `from_cache` fills zeros (a state to continue from, not to compose).
Needs torch and transformers >= 5.
"""
from __future__ import annotations

import numpy as np

from ._errors import InvalidArgument
from ._picaso import State

__all__ = ["to_cache", "from_cache", "log_decays", "cache_kwargs", "output_cache", "position_ids"]


def cache_kwargs(hf_model, cache) -> dict:
    """The keyword arguments that hand `cache` to `hf_model`'s forward: transformers 5.24
    renamed `cache_params` to `cache`; this works with either."""
    import inspect

    name = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "cache_params"
    return {name: cache, "use_cache": True}


def output_cache(output):
    """The cache in a forward's output (`cache` or, before transformers 5.24, `cache_params`)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.cache_params


def position_ids(state: State, n: int):
    """The positions of `n` tokens that continue `state` (a (1, n) torch tensor), for the
    `position_ids` argument of a RoPE hybrid's forward: a composed state's next position is its
    longest part's length, not the sum of its tokens."""
    import torch

    return torch.arange(state.position, state.position + n)[None]


def _layers(config):
    """(cache layer index, "mamba" / "attention" / "hybrid") per picaso layer, from a hybrid's
    `layer_types` (either spelling; a Nemotron-H model's `mlp` and `moe` blocks hold no state and are
    skipped; a Falcon-H1 layer is "hybrid", both), else all Mamba."""
    types = getattr(config, "layer_types", None)
    if not types:
        return [(i, "mamba") for i in range(config.num_hidden_layers)]
    names = {"mamba": "mamba", "linear_attention": "mamba", "attention": "attention", "full_attention": "attention",
             "hybrid": "hybrid", "mlp": None, "moe": None}
    unknown = sorted({t for t in types if t not in names})
    if unknown:
        raise InvalidArgument(f"layer types {unknown} in the model's config are not ones picaso runs")
    return [(i, names[t]) for i, t in enumerate(types) if names[t] is not None]


def _cache_layers(cache, config):
    """The cache's layer objects, checked against the model's blocks."""
    layers = getattr(cache, "layers", None)
    blocks = _layers(config)
    wanted = {"mamba": ["recurrent_states"], "attention": ["keys"], "hybrid": ["recurrent_states", "keys"]}
    n = len(getattr(config, "layer_types", None) or []) or config.num_hidden_layers
    if layers is None or len(layers) != n or not all(hasattr(layers[i], w) for i, t in blocks for w in wanted[t]):
        raise InvalidArgument(
            "expected a transformers >= 5 DynamicCache of this Mamba or hybrid model (a linear-attention "
            "layer per Mamba layer, an attention layer per attention layer, a layer with both per Falcon-H1 "
            f"layer); got {type(cache).__name__}"
        )
    return layers


def to_cache(state: State, hf_model, *, dtype=None, device=None):
    """A transformers `DynamicCache` holding `state`, for `hf_model` (a Mamba2ForCausalLM,
    MambaForCausalLM, GraniteMoeHybridForCausalLM, BambaForCausalLM, NemotronHForCausalLM, FalconH1ForCausalLM or
    JambaForCausalLM of
    the same checkpoint
    as the picaso model that made the state). Pass it with `cache_kwargs(hf_model, cache)`; the model continues
    exactly where the state stopped."""
    import torch
    from transformers import DynamicCache

    config = hf_model.config
    blocks = _layers(config)
    types = [t for _, t in blocks]
    if state.n_layers != len(types) or list(state.layer_types) != types:
        raise InvalidArgument(
            f"the state's layers ({state.n_layers}: {_summary(state.layer_types)}) do not match the model's "
            f"({len(types)}: {_summary(types)})"
        )
    hybrid = "attention" in types or "hybrid" in types
    param = next(hf_model.parameters())
    dtype = dtype or param.dtype
    device = device or param.device
    tensor = lambda a: torch.from_numpy(np.array(a, dtype=np.float32)).to(dtype=dtype, device=device)  # noqa: E731
    cache = DynamicCache(config=config)
    for j, (i, kind) in enumerate(blocks):  # picaso's layer j is the cache's layer i
        if kind != "mamba":
            cache.layers[i].update(tensor(state.keys(j))[None], tensor(state.values(j))[None])
        if kind == "attention":
            continue
        conv = np.asarray(state.conv(j))
        # transformers keeps d_conv columns; the oldest never reaches an output, so it is zero.
        full = torch.zeros((1, conv.shape[0], conv.shape[1] + 1), dtype=dtype, device=device)
        full[0, :, 1:] = tensor(conv)
        cache.update_conv_state(full, layer_idx=i)
        cache.update_recurrent_state(tensor(state.ssm(j))[None], layer_idx=i)
        if hybrid:  # the hybrid's mixer reads a cached conv state only when told there is one
            cache.layers[i].has_previous_state[0] = True
    return cache


def _summary(types) -> str:
    if types and all(t == "hybrid" for t in types):
        return "Mamba and attention side by side in each"
    attention = [i for i, t in enumerate(types) if t != "mamba"]
    return f"attention at {attention}" if attention else "all Mamba"


def from_cache(cache, hf_model, *, fingerprint: str, n_tokens: int, log_decays=None, batch_index: int = 0) -> State:
    """The picaso `State` in row `batch_index` of a transformers Mamba or hybrid cache.

    `fingerprint` is the picaso model's (`Model.fingerprint`), `n_tokens` the tokens the cache
    has seen, `log_decays` one array per picaso layer (from `log_decays()`); without them the
    state continues exactly but carries zero log-decays, so composing it weighs it wrongly (soup
    aside).
    """
    blocks = _layers(hf_model.config)
    layers = _cache_layers(cache, hf_model.config)
    out = []
    for j, (i, kind) in enumerate(blocks):
        layer = layers[i]
        kv = ()
        if kind != "mamba":
            if layer.keys is None or layer.keys.numel() == 0:
                raise InvalidArgument(f"layer {i} of the cache is empty: run the model on some tokens first")
            kv = tuple(
                np.ascontiguousarray(t[batch_index].detach().float().cpu().numpy(), dtype=np.float32)
                for t in (layer.keys, layer.values)
            )
        if kind == "attention":
            out.append(kv)
            continue
        conv, ssm = layer.conv_states[0], layer.recurrent_states[0]
        if conv is None or ssm is None:
            raise InvalidArgument(f"layer {i} of the cache is empty: run the model on some tokens first")
        conv = conv[batch_index, :, 1:].detach().float().cpu().numpy()
        ssm = ssm[batch_index].detach().float().cpu().numpy()
        if log_decays is None:
            ld = np.zeros(ssm.shape[:1] if ssm.ndim == 3 else ssm.shape, dtype=np.float32)
        else:
            ld = np.asarray(log_decays[j], dtype=np.float32)
        out.append((np.ascontiguousarray(ssm, dtype=np.float32), np.ascontiguousarray(conv, dtype=np.float32), ld) + kv)
    return State.from_arrays(out, fingerprint=fingerprint, n_tokens=n_tokens)


def log_decays(hf_model, input_ids, *, batch_index: int = 0):
    """Per picaso layer, the log of the decay accumulated over `input_ids` (what a picaso
    state's `log_decay` holds): Mamba-2 Σ_t dt_t,h · A_h per head, Mamba-1 Σ_t dt_t,d · A_d,n;
    None for a hybrid's attention layers. Runs the model once, reading each mixer's time steps."""
    import torch
    import torch.nn.functional as F

    captured = {}
    hooks = []
    if hasattr(hf_model, "backbone"):
        mixers = [layer.mixer for layer in hf_model.backbone.layers]
        if not all(hasattr(m, "in_proj") or hasattr(m, "x_proj") for m in mixers):
            raise InvalidArgument(
                "a model whose `backbone` holds other blocks than Mamba ones (a remote-code hybrid?): load it "
                "with transformers' own class (without trust_remote_code)"
            )
    else:  # a hybrid: a Mamba layer's mixer is `mamba` (Granite, Bamba, Falcon-H1, Jamba) or `mixer` (Nemotron-H)
        blocks = hf_model.model.layers
        mamba = lambda b: b.mamba if hasattr(b, "mamba") else b.mixer  # noqa: E731
        mixers = [mamba(blocks[i]) if kind != "attention" else None for i, kind in _layers(hf_model.config)]
    for i, mixer in enumerate(mixers):
        if mixer is None:
            continue
        # Jamba's time step is RMS-normed after x_proj: read it from that norm.
        target = mixer.in_proj if hasattr(mixer, "num_heads") else getattr(mixer, "dt_layernorm", mixer.x_proj)

        # Falcon-H1 scales in_proj's output by its µP vector (dt's columns included) before using it.
        scale = getattr(mixer, "mup_vector", None)

        def hook(module, args, output, i=i, scale=scale):
            captured[i] = output.detach() if scale is None else output.detach() * scale

        hooks.append(target.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf_model(input_ids=torch.as_tensor(input_ids).reshape(1, -1) if np.ndim(input_ids) == 1 else input_ids)
    finally:
        for h in hooks:
            h.remove()
    out = []
    for i, mixer in enumerate(mixers):
        if mixer is None:
            out.append(None)
            continue
        A = -torch.exp(mixer.A_log.detach().float())
        if hasattr(mixer, "num_heads"):  # Mamba-2: dt is the projection's last `num_heads` columns
            dt = captured[i][batch_index, :, -mixer.num_heads :].float()
            dt = F.softplus(dt + mixer.dt_bias.detach().float())
            lo, hi = mixer.time_step_limit
            if (lo, hi) != (0.0, float("inf")):
                dt = dt.clamp(lo, hi)
            out.append((dt * A).sum(0).cpu().numpy().astype(np.float32))
        else:  # Mamba-1: x_proj's first time_step_rank columns (Jamba: normed) through dt_proj (with its bias), softplus
            rank = mixer.time_step_rank
            ts = captured[i][batch_index, :, :rank].float()  # (T, rank)
            dt = F.softplus(ts @ mixer.dt_proj.weight.detach().float().T + mixer.dt_proj.bias.detach().float())
            out.append((dt.sum(0)[:, None] * A).cpu().numpy().astype(np.float32))
    return out
