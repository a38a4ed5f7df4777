"""Validation of ``precompute_and_store_context_kv``'s arguments: the only way a
:class:`PrecomputeCall` is built."""

from __future__ import annotations

import torch

from ...contract import FP8_DTYPES, INDEX_DTYPES, QUERY_DTYPES
from ...validation import check_device, check_dtype, check_shape, layer_scales, per_layer, tensor_arg
from ...weights import ContextKVWeights
from .call import PrecomputeCall


def precompute_call(context_states, positions, weights, key_caches, value_caches, slot_mapping, *,
                    k_scales=None, v_scales=None, return_kv=False, validate=True) -> PrecomputeCall:
    if not isinstance(weights, ContextKVWeights):
        raise TypeError(f"weights: expected ContextKVWeights, got {type(weights).__name__}")
    L, Hk, D = weights.num_layers, weights.num_kv_heads, weights.head_dim
    states = tensor_arg("context_states", context_states)
    check_dtype("context_states", states, QUERY_DTYPES)
    check_shape("context_states", states, (None, weights.hidden_size), f"[num_tokens, hidden={weights.hidden_size}]")
    if states.dtype != weights.dtype:
        raise TypeError(f"context_states: expected dtype {weights.dtype} (as weights.kv_weight); got {states.dtype}")
    device = states.device
    if weights.device != device:
        raise ValueError(f"weights: on {weights.device}, context_states on {device}")
    N = states.shape[0]
    positions = tensor_arg("positions", positions)
    check_dtype("positions", positions, INDEX_DTYPES)
    check_shape("positions", positions, (N,), f"[num_tokens={N}]")
    check_device("positions", positions, device)
    if not isinstance(return_kv, bool):
        raise TypeError(f"return_kv: expected bool, got {type(return_kv).__name__}")

    if slot_mapping is None:
        slots: tuple = (None,) * L
    elif isinstance(slot_mapping, torch.Tensor):
        slots = (slot_mapping,) * L
    else:
        slots = per_layer("slot_mapping", slot_mapping, L)
    for i, s in enumerate(slots):
        if s is not None:
            name = f"slot_mapping[{i}]" if not isinstance(slot_mapping, torch.Tensor) else "slot_mapping"
            tensor_arg(name, s)
            check_dtype(name, s, INDEX_DTYPES)
            check_shape(name, s, (N,), f"[num_tokens={N}]")
            check_device(name, s, device)

    written = [i for i, s in enumerate(slots) if s is not None]
    if written:
        kcs = per_layer("key_caches", key_caches, L)
        vcs = per_layer("value_caches", value_caches, L)
    else:
        kcs = tuple(key_caches) if key_caches is not None else (None,) * L
        vcs = tuple(value_caches) if value_caches is not None else (None,) * L
        if len(kcs) != L or len(vcs) != L:
            raise ValueError(f"key_caches/value_caches: expected num_layers={L} entries; got {len(kcs)}, {len(vcs)}")
    cache_dtype = None
    for i in written:
        for kind, caches in (("key_caches", kcs), ("value_caches", vcs)):
            c = caches[i]
            name = f"{kind}[{i}]"
            if c is None:
                raise ValueError(f"{name}: is None but slot_mapping for layer {i} is not")
            tensor_arg(name, c)
            check_dtype(name, c, (states.dtype, *FP8_DTYPES))
            check_shape(name, c, (None, None, Hk, D), f"[num_blocks, block_size, num_kv_heads={Hk}, head_dim={D}]")
            check_device(name, c, device)
            if c.shape[0] == 0 or c.shape[1] == 0:
                raise ValueError(f"{name}: expected at least one block of at least one row; got {list(c.shape)}")
            if cache_dtype is None:
                cache_dtype = c.dtype
            elif c.dtype != cache_dtype:
                raise TypeError(f"{name}: expected dtype {cache_dtype} (every written cache shares one dtype); "
                                f"got {c.dtype}")
        if vcs[i].shape != kcs[i].shape:
            raise ValueError(f"value_caches[{i}]: expected the shape of key_caches[{i}] {list(kcs[i].shape)}; "
                             f"got {list(vcs[i].shape)}")
    is_fp8 = cache_dtype in FP8_DTYPES
    ks = layer_scales("k_scales", k_scales, L, device) if is_fp8 else None
    vs = layer_scales("v_scales", v_scales, L, device) if is_fp8 else None

    if validate:
        _check_precompute_indices(positions, weights.max_position, slots, kcs)
    return PrecomputeCall(states=states, positions=positions, weights=weights, key_caches=kcs,
                          value_caches=vcs, slot_mappings=slots, k_scales=ks, v_scales=vs,
                          return_kv=return_kv)


def _check_precompute_indices(positions, max_position, slots, caches) -> None:
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_position:
            raise ValueError(f"positions: expected values in [0, max_position={max_position}) (rows of "
                             f"weights.cos_sin_cache); got min {lo}, max {hi}")
    checked: dict[int, tuple[int, int]] = {}
    for i, s in enumerate(slots):
        if s is None or not s.numel():
            continue
        if id(s) not in checked:
            checked[id(s)] = (int(s.min()), int(s.max()))
        lo, hi = checked[id(s)]
        capacity = caches[i].shape[0] * caches[i].shape[1]
        if lo < -1 or hi >= capacity:
            raise ValueError(f"slot_mapping for layer {i}: expected slots in [-1, num_blocks*block_size={capacity}) "
                             f"(-1 skips a token); got min {lo}, max {hi}")
