"""Validation of ``precompute_and_store_context_kv``'s arguments: the only way a
:class:`PrecomputeCall` is built.

See :mod:`dflash_rocm.validation` for the two tiers (metadata always; values on the host
for CPU tensors, as device-side asserts for GPU tensors, skipped by ``validate=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, NamedTuple

import torch

from ...contract import FP8_DTYPES, QUERY_DTYPES
from ...capture import keep_unless_captured
from ...validation import (IndexChecks, StructureMemo, Structure, byte_span, cache_arg, check_device, check_disjoint,
                           check_dtype, check_layout_once, check_scale_values, check_shape, check_writable,
                           holds_tensor, index_tensor, merged_ranges, per_layer, provably_disjoint, scale_tensor,
                           signature, storages_meet, tensor_arg)
from ...paged import PackedCache, cache_packing, memory_of
from ...weights import ContextKVWeights
from .call import PrecomputeCall


_STRUCTURES = StructureMemo()


@dataclass(frozen=True)
class _Derived:
    """What the structural checks of one call structure settle for every call of it."""

    fp8: bool  # the written caches are fp8: scales are used
    # The written caches' bytes (exact spans, merged: the structure holds their addresses,
    # shapes and strides): a read tensor whose storage meets none of them needs no overlap test.
    written_memory: tuple
    shared_rows: tuple  # written caches over common rows (SharedRows): their slots are checked apart per call
    k_scales: torch.Tensor | None  # fp8 scales as a device tensor when given as floats (or defaulted)
    v_scales: torch.Tensor | None


@dataclass(frozen=True)
class ModelArguments:
    """The arguments of the precompute that a serving engine keeps for the model's life
    (weights, each layer's caches, fp8 scales), with their part of the structure key taken
    once: what a :func:`dflash_rocm.plan_context_kv` plan holds. The caches are held as
    tuples, so the caller's lists may change without changing the plan; the tensors
    themselves must not be resized or re-pointed (``set_``) while it is used."""

    weights: object
    key_caches: tuple | None
    value_caches: tuple | None
    k_scales: object
    v_scales: object
    key: Structure | tuple  # their signatures and the caches' addresses (hashed once)


def model_arguments(weights, key_caches, value_caches, k_scales=None, v_scales=None) -> ModelArguments:
    frozen = [tuple(c) if isinstance(c, (list, tuple)) else c for c in (key_caches, value_caches, k_scales, v_scales)]
    key_caches, value_caches, k_scales, v_scales = frozen
    key = (_weights_signature(weights), _caches(key_caches), _caches(value_caches), signature(k_scales),
           signature(v_scales))
    return ModelArguments(weights, key_caches, value_caches, k_scales, v_scales, StructureMemo.structure(key) or key)


def precompute_call(context_states, positions, weights, key_caches, value_caches, slot_mapping, *,
                    k_scales=None, v_scales=None, return_kv=False, validate=True) -> PrecomputeCall:
    """Check the arguments and build the call; the structural checks run once per call
    structure (see :func:`dflash_rocm.ops.attention.validation.attention_call`)."""
    return bound_precompute_call(model_arguments(weights, key_caches, value_caches, k_scales, v_scales),
                                 context_states, positions, slot_mapping, return_kv=return_kv, validate=validate)


def bound_precompute_call(model: ModelArguments, context_states, positions, slot_mapping, *, return_kv=False,
                          validate=True) -> PrecomputeCall:
    """:func:`precompute_call` with the model's arguments taken once (a plan's run)."""
    weights, key_caches, value_caches = model.weights, model.key_caches, model.value_caches
    k_scales, v_scales = model.k_scales, model.v_scales
    if isinstance(weights, ContextKVWeights):  # (anything else is refused below, by type)
        weights.check_shapes()  # tensors resized in place since the weights were built: refused by name
    key = _STRUCTURES.structure((signature(context_states), signature(positions), _sequence(slot_mapping),
                                 signature(return_kv), model.key))
    known = _STRUCTURES.get(key)
    if known is None:
        derived = _check_structure(context_states, positions, weights, key_caches, value_caches, slot_mapping,
                                   k_scales, v_scales, return_kv)
        keep_unless_captured(_STRUCTURES, key, derived, context_states.device)  # a capture's scale tensors are its own
    else:
        key, derived = known
    L = weights.num_layers
    if slot_mapping is None:
        slots: tuple = (None,) * L
    elif isinstance(slot_mapping, torch.Tensor):
        slots = (_contiguous(slot_mapping),) * L
    else:
        slots = _one_object_per_mapping(tuple(None if s is None else _contiguous(s) for s in slot_mapping))
    kcs = tuple(key_caches) if key_caches is not None else (None,) * L
    vcs = tuple(value_caches) if value_caches is not None else (None,) * L
    device = context_states.device
    ks, vs = derived.k_scales, derived.v_scales
    if derived.fp8 and ks is None:
        ks = scale_tensor("k_scales", k_scales, L, device)
    if derived.fp8 and vs is None:
        vs = scale_tensor("v_scales", v_scales, L, device)
    positions = _contiguous(positions)
    shared = isinstance(slot_mapping, torch.Tensor)
    reads = (context_states, positions, ks, vs, *(slots[:1] if shared else slots))
    if storages_meet(reads, derived.written_memory):  # (no memory when no layer is written)
        written = [kcs[i] for i, s in enumerate(slots) if s is not None] + [
            vcs[i] for i, s in enumerate(slots) if s is not None]
        names = ("context_states", "positions", "k_scales", "v_scales",
                 *(["slot_mapping"] if shared else [f"slot_mapping[{i}]" for i in range(L)]))
        named = [(name, t) for name, t in zip(names, reads) if t is not None]
        check_layout_once("precompute reads", [t for _, t in named] + written,
                          lambda: _check_reads_apart(named, written))
    if validate:
        checks = IndexChecks(device)
        _check_indices(checks, positions, weights.max_position, slots, kcs)
        check_rows_apart(checks, derived.shared_rows, slots)
        if ks is not None:
            check_scale_values("k_scales", ks, checks)
            check_scale_values("v_scales", vs, checks)
    return PrecomputeCall(states=context_states, positions=positions, weights=weights, key_caches=kcs,
                          value_caches=vcs, slot_mappings=slots, k_scales=ks, v_scales=vs, return_kv=return_kv,
                          structure=key)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _weights_signature(weights) -> tuple:
    if not isinstance(weights, ContextKVWeights):
        return (type(weights),)
    w = weights.kv_weight
    # every field a backend's reasons or plan read (the tensors' values excepted)
    return (ContextKVWeights, weights.num_layers, weights.num_kv_heads, weights.head_dim, w.shape, w.dtype, w.device,
            weights.cos_sin_cache.shape, weights.per_layer_hidden_norm, weights.rope_layers,
            weights.round_k_before_rope, weights.kv_bias is None, weights.v_scale, weights.is_neox, weights.eps,
            weights.rotary_dim, None if weights.kv_weight_scale is None else weights.kv_weight_scale.shape)


def _sequence(value) -> tuple:
    """The signature of an argument that may be a sequence (per-layer slots), with which
    entries are the same mapping (:func:`_mapping_identity`; layers sharing a mapping may
    not share a cache, and a plan passes a shared mapping as is)."""
    if isinstance(value, (list, tuple)):
        firsts: dict = {}
        return signature(value), tuple(firsts.setdefault(_mapping_identity(v), i) for i, v in enumerate(value))
    return signature(value)


def _mapping_identity(t) -> Hashable:
    """What makes two per-layer slot mappings one: the same tensor, or views of the same
    memory with the same shape, strides and dtype (vLLM 0.34 passes each layer its own
    slice of its KV-cache group's row)."""
    if isinstance(t, torch.Tensor):
        return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device
    return id(t)


def _one_object_per_mapping(slots: tuple) -> tuple:
    """``slots`` with every mapping that is one with an earlier layer's
    (:func:`_mapping_identity`) replaced by that layer's tensor, so that backends (and the
    planning record's facts) see shared mappings as one object, as the structure counts them."""
    if len(slots) < 2:
        return slots
    firsts: dict = {}
    return tuple(None if s is None else firsts.setdefault(_mapping_identity(s), s) for s in slots)


def _caches(value) -> tuple:
    """The caches' signatures and addresses: whether written caches alias one another is
    judged with the structure (a server's caches never move)."""
    if isinstance(value, (list, tuple)):
        return type(value), tuple((signature(c), memory_of(c).data_ptr() if isinstance(c, (torch.Tensor, PackedCache))
                                   else None) for c in value)
    return signature(value)


def _check_structure(context_states, positions, weights, key_caches, value_caches, slot_mapping, k_scales, v_scales,
                     return_kv) -> _Derived:
    """Every check that reads only metadata and scalar values; raises on the first problem."""
    if not isinstance(weights, ContextKVWeights):
        raise TypeError(f"weights: expected ContextKVWeights, got {type(weights).__name__}")
    L, Hk, D = weights.num_layers, weights.num_kv_heads, weights.head_dim
    states = tensor_arg("context_states", context_states)
    check_dtype("context_states", states, QUERY_DTYPES)
    check_shape("context_states", states, (None, weights.hidden_size), f"[num_tokens, hidden={weights.hidden_size}]")
    if not weights.accepts_states(states.dtype):  # float rows: the states' dtype; fp8 rows: any float dtype
        raise TypeError(f"context_states: expected dtype {weights.dtype} (as weights.kv_weight); got {states.dtype}")
    device = states.device
    if weights.device != device:
        raise ValueError(f"weights: on {weights.device}, context_states on {device}")
    N = states.shape[0]
    index_tensor("positions", positions, (N,), f"[num_tokens={N}]", device)
    if not isinstance(return_kv, bool):
        raise TypeError(f"return_kv: expected bool, got {type(return_kv).__name__}")

    if slot_mapping is None:
        slots: tuple = (None,) * L
    elif isinstance(slot_mapping, torch.Tensor):
        slots = (slot_mapping,) * L
    else:
        slots = per_layer("slot_mapping", slot_mapping, L)
    shared = isinstance(slot_mapping, torch.Tensor)
    for i, s in enumerate(slots):
        if s is not None:
            index_tensor("slot_mapping" if shared else f"slot_mapping[{i}]", s, (N,), f"[num_tokens={N}]", device)

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
    shared_rows = check_caches_apart([kcs[i] for i in written], [vcs[i] for i in written], written, slots)
    memory = merged_ranges(byte_span(memory_of(c)) for c in [kcs[i] for i in written] + [vcs[i] for i in written])
    if cache_dtype not in FP8_DTYPES:
        return _Derived(fp8=False, written_memory=memory, shared_rows=shared_rows, k_scales=None, v_scales=None)
    scales = []
    for name, given in (("k_scales", k_scales), ("v_scales", v_scales)):
        t = scale_tensor(name, [1.0] * L if given is None else given, L, device)  # checks the form of a tensor too
        scales.append(None if holds_tensor(given) else t)
    return _Derived(fp8=True, written_memory=memory, shared_rows=shared_rows, k_scales=scales[0], v_scales=scales[1])


def _check_indices(checks: IndexChecks, positions, max_position, slots, caches) -> None:
    checks.require_range(positions, 0, max_position,
                         f"positions: expected values in [0, max_position={max_position}) "
                         "(rows of weights.cos_sin_cache)",
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
        checks.require_range(s, -1, capacity,
                             f"slot_mapping for layer {layer}: expected slots in "
                             f"[-1, num_blocks*block_size={capacity})",
                             lambda i, s=s, layer=layer, capacity=capacity: (
                                 f"slot_mapping for layer {layer}: expected slots in [-1, "
                                 f"num_blocks*block_size={capacity}) (-1 skips a token); got {int(s[i])} at [{i[0]}]"))


class SharedRows(NamedTuple):
    """Two written caches over common rows of one page layout (:func:`row_offset`): their
    layers may write them only at different rows, checked on the slots' values at every
    call. Slot ``s`` of the first is the layout's row ``s + first_shift``."""

    first: int  # the layers whose slot mappings write them
    second: int
    first_shift: int
    second_shift: int
    names: str  # the two caches, as messages name them


def _reach(t: torch.Tensor, first_dim: int) -> int:
    """Elements from the first to the last of one index of dims ``< first_dim``, plus one."""
    return sum((s - 1) * st for s, st in zip(t.shape[first_dim:], t.stride()[first_dim:])) + 1


def row_offset(a, b) -> int | None:
    """How many rows after ``a``'s slot 0 ``b``'s slot 0 lies, when both are views of one
    page layout (the same dtype, page shape and strides; each page, or each row where a
    page's rows follow one another, clear of the next) starting whole pages (or rows) apart:
    then a row of one is either a row of the other or shares no byte with it. None for any
    other pair."""
    rows = a.shape[1]  # a packed cache's logical block size
    a, b = memory_of(a), memory_of(b)
    if (a.dtype != b.dtype or a.shape[1:] != b.shape[1:] or a.stride() != b.stride() or a.device != b.device
            or any(st < 0 for st in a.stride())):
        return None
    if a.dim() == 4 and a.stride(0) == rows * a.stride(1) and a.stride(1) >= _reach(a, 2):
        unit, rows_per_unit = a.stride(1), 1  # rows follow one another across pages
    elif a.stride(0) >= _reach(a, 1):
        unit, rows_per_unit = a.stride(0), rows
    else:
        return None
    units, rest = divmod(b.data_ptr() - a.data_ptr(), unit * a.element_size())
    return None if rest else units * rows_per_unit


def check_caches_apart(key_caches: list, value_caches: list, layers: list[int], slots) -> tuple[SharedRows, ...]:
    """The apartness rule of written caches, decided by memory (addresses, strides and byte
    ranges; never by which Python objects were passed): no written cache aliases itself,
    and two written caches share no byte unless they are views of one page layout over
    common rows (:func:`row_offset`; vLLM's hybrid KV-cache groups give layers of different
    groups one pool, each layer writing its own group's slots). Those are allowed where
    their layers' writes cannot meet: refused here when one slot mapping (the same memory,
    shape and strides) writes both at the same rows, every slot then written twice; the
    other pairs are returned for :func:`check_rows_apart`, which checks the slots' values at
    every call."""
    caches = key_caches + value_caches
    names = [f"key_caches[{i}]" for i in layers] + [f"value_caches[{i}]" for i in layers]
    owners = layers + layers
    for name, c in zip(names, caches):
        check_writable(name, c)
    shared = []
    for i in range(len(caches)):
        for j in range(i + 1, len(caches)):
            if provably_disjoint(memory_of(caches[i]), memory_of(caches[j])):
                continue
            shift = row_offset(caches[i], caches[j])
            one_mapping = _mapping_identity(slots[owners[i]]) == _mapping_identity(slots[owners[j]])
            if shift is None or (shift == 0 and one_mapping):
                raise ValueError(f"{names[i]}: shares memory with {names[j]}; "
                                 + ("both are written through one slot mapping at the same rows (give each layer "
                                    "its own cache, or its own slots)" if shift is not None else
                                    "written caches may share memory only as views of one page layout over "
                                    "whole rows (pass separate tensors)"))
            shared.append(SharedRows(first=owners[i], second=owners[j], first_shift=max(-shift, 0),
                                     second_shift=max(shift, 0), names=f"{names[i]} and {names[j]}"))
    return tuple(shared)


def check_rows_apart(checks: IndexChecks, shared: tuple[SharedRows, ...], slots: tuple) -> None:
    """Layers writing common blocks (:func:`check_caches_apart`) name no common row."""
    for p in shared:
        a, b = slots[p.first], slots[p.second]
        met = torch.isin(torch.where(a >= 0, a + p.first_shift, -1), torch.where(b >= 0, b + p.second_shift, -2))
        message = (f"slot_mapping[{p.first}], slot_mapping[{p.second}]: both name a row of {p.names} (one memory); "
                   "layers that write one cache must write different slots")
        checks.require(~met, message, lambda i, a=a, message=message: f"{message}; got slot {int(a[i])} at [{i[0]}]")


def _check_reads_apart(reads: list, caches: list) -> None:
    """No written cache shares memory with a tensor the call reads (``reads``: name, tensor)."""
    for name, t in reads:
        for c in caches:
            check_disjoint("a written cache", c, name, t)
