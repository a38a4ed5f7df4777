"""Validation of ``precompute_and_store_context_kv``'s arguments: the only way a
:class:`PrecomputeCall` is built.

See :mod:`dflash_rocm.validation` for the two tiers (metadata always; values on the host
for CPU tensors, as device-side asserts for GPU tensors, skipped by ``validate=False``).
"""

from __future__ import annotations

import torch

from ...contract import FP8_DTYPES, QUERY_DTYPES
from ...validation import (IndexChecks, cache_arg, check_device, check_layout_once, check_disjoint, check_dtype, check_scale_values, check_shape,
                           check_writable, index_tensor, per_layer, scale_tensor, tensor_arg)
from ...paged import cache_packing
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
    positions = index_tensor("positions", positions, (N,), f"[num_tokens={N}]", device)
    if not isinstance(return_kv, bool):
        raise TypeError(f"return_kv: expected bool, got {type(return_kv).__name__}")

    if slot_mapping is None:
        slots: tuple = (None,) * L
    elif isinstance(slot_mapping, torch.Tensor):
        slots = (slot_mapping,) * L
    else:
        slots = per_layer("slot_mapping", slot_mapping, L)
    shared = isinstance(slot_mapping, torch.Tensor)
    contiguous: dict[int, torch.Tensor] = {}  # one copy per distinct tensor
    checked = []
    for i, s in enumerate(slots):
        if s is not None:
            if id(s) not in contiguous:
                contiguous[id(s)] = index_tensor("slot_mapping" if shared else f"slot_mapping[{i}]", s, (N,),
                                                 f"[num_tokens={N}]", device)
            checked.append(contiguous[id(s)])
        else:
            checked.append(None)
    slots = tuple(checked)

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
            cache_arg(name, c)
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
    packings = {cache_packing(kcs[i], vcs[i]) for i in written}
    if len(packings) > 1:
        raise ValueError(f"key_caches/value_caches: every written layer must use one page layout; got "
                         f"(row pack, dim pack) of (K, V) per layer {[cache_packing(kcs[i], vcs[i]) for i in written]}")
    _check_written_memory(states, [kcs[i] for i in written] + [vcs[i] for i in written],
                          [f"key_caches[{i}]" for i in written] + [f"value_caches[{i}]" for i in written])
    is_fp8 = cache_dtype in FP8_DTYPES
    ks = scale_tensor("k_scales", [1.0] * L if k_scales is None else k_scales, L, device) if is_fp8 else None
    vs = scale_tensor("v_scales", [1.0] * L if v_scales is None else v_scales, L, device) if is_fp8 else None

    if validate:
        checks = IndexChecks(device)
        _check_indices(checks, positions, weights.max_position, slots, kcs)
        if is_fp8:
            check_scale_values("k_scales", ks, checks)
            check_scale_values("v_scales", vs, checks)
    return PrecomputeCall(states=states, positions=positions, weights=weights, key_caches=kcs,
                          value_caches=vcs, slot_mappings=slots, k_scales=ks, v_scales=vs,
                          return_kv=return_kv)


def _check_indices(checks: IndexChecks, positions, max_position, slots, caches) -> None:
    checks.require((positions >= 0) & (positions < max_position),
                   f"positions: expected values in [0, max_position={max_position}) (rows of weights.cos_sin_cache)",
                   lambda i: f"positions: expected values in [0, max_position={max_position}) (rows of "
                             f"weights.cos_sin_cache); got {int(positions[i])} at [{i[0]}]")
    seen: set[tuple[int, int]] = set()
    for layer, s in enumerate(slots):
        if s is None:
            continue
        capacity = caches[layer].shape[0] * caches[layer].shape[1]
        if (id(s), capacity) in seen:
            continue
        seen.add((id(s), capacity))
        checks.require((s >= -1) & (s < capacity),
                       f"slot_mapping for layer {layer}: expected slots in [-1, num_blocks*block_size={capacity})",
                       lambda i, s=s, layer=layer, capacity=capacity: (
                           f"slot_mapping for layer {layer}: expected slots in [-1, num_blocks*block_size={capacity}) "
                           f"(-1 skips a token); got {int(s[i])} at [{i[0]}]"))


def _check_written_memory(states: torch.Tensor, caches: list[torch.Tensor], names: list[str]) -> None:
    """Every written cache has its own memory: no cache aliases itself, another cache or the
    states."""
    def check() -> None:
        for name, c in zip(names, caches):
            check_writable(name, c)
            check_disjoint(name, c, "context_states", states)
        for i in range(len(caches)):
            for j in range(i + 1, len(caches)):
                check_disjoint(names[i], caches[i], names[j], caches[j])

    check_layout_once("precompute", [states, *caches], check)
