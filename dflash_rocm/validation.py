"""Argument checks for both operations, shared by every backend, run before any write.

Two tiers: structural checks (types, dtypes, shapes, devices) cost nothing and always
run; index checks read tensor values (block ids, slots, positions, ``q_len <= seq_len``)
and therefore sync with the device. A caller that has already checked its indices
(the vLLM plugin, on its hot path) passes ``validate=False`` to skip the second tier
only. Every message names the argument, what was expected and what was received.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import torch

from .calls import FP8_DTYPES, QUERY_DTYPES, AttentionCall, PrecomputeCall
from .weights import ContextKVWeights

_INDEX_DTYPES = (torch.int32, torch.int64)


def _tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name}: expected dtype {names}; got {str(t.dtype).replace('torch.', '')}")


def _shape(name: str, t: torch.Tensor, expected: Sequence[int | None], words: str) -> None:
    if t.dim() != len(expected) or any(e is not None and s != e for s, e in zip(t.shape, expected)):
        shown = [("?" if e is None else e) for e in expected]
        raise ValueError(f"{name}: expected shape {words} = {shown}; got {list(t.shape)}")


def _device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (where query/context_states are); got {t.device}")


def _scalar_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """A cache scale as a float32 one-element tensor on ``device`` (vLLM passes tensors)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a float scalar or one-element float tensor; "
                             f"got shape {list(value.shape)} {value.dtype}")
        _device(name, value, device)
        return value.reshape(1).to(torch.float32)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}: expected a positive finite scale, got {value}")
        return torch.tensor([float(value)], dtype=torch.float32, device=device)
    raise TypeError(f"{name}: expected a float or a one-element tensor, got {type(value).__name__}")


def attention_call(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, *,
                   scale=None, causal=False, sliding_window=None, sinks=None, k_scale=None,
                   v_scale=None, out=None, validate=True, max_query_len=None,
                   max_seq_len=None) -> AttentionCall:
    query = _tensor("query", query)
    _dtype("query", query, QUERY_DTYPES)
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [num_tokens, num_q_heads, head_dim]; got {list(query.shape)}")
    T, Hq, D = query.shape
    device = query.device
    key_cache = _tensor("key_cache", key_cache)
    value_cache = _tensor("value_cache", value_cache)
    _dtype("key_cache", key_cache, (query.dtype, *FP8_DTYPES))
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: expected dtype {key_cache.dtype} (as key_cache); got {value_cache.dtype}")
    if key_cache.dim() != 4:
        raise ValueError("key_cache: expected shape [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {list(key_cache.shape)}")
    num_blocks, block_size, Hk, _ = key_cache.shape
    _shape("key_cache", key_cache, (None, None, None, D),
           f"[num_blocks, block_size, num_kv_heads, head_dim={D}]")
    _shape("value_cache", value_cache, tuple(key_cache.shape), "the shape of key_cache")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"key_cache: num_kv_heads={Hk} must divide num_q_heads={Hq} (query shape {list(query.shape)})")
    if num_blocks == 0 or block_size == 0:
        raise ValueError(f"key_cache: expected at least one block of at least one row; got {list(key_cache.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _device(name, t, device)

    seq_lens = _tensor("seq_lens", seq_lens)
    _dtype("seq_lens", seq_lens, _INDEX_DTYPES)
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [num_seqs]; got {list(seq_lens.shape)}")
    B = seq_lens.shape[0]
    query_start_loc = _tensor("query_start_loc", query_start_loc)
    _dtype("query_start_loc", query_start_loc, _INDEX_DTYPES)
    _shape("query_start_loc", query_start_loc, (B + 1,), f"[num_seqs + 1] with num_seqs={B} (from seq_lens)")
    block_table = _tensor("block_table", block_table)
    _dtype("block_table", block_table, _INDEX_DTYPES)
    _shape("block_table", block_table, (B, None), f"[num_seqs={B}, max_blocks_per_seq]")
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("block_table", block_table)):
        _device(name, t, device)

    if out is None:
        out = torch.empty_like(query)
    else:
        out = _tensor("out", out)
        if out.dtype != query.dtype:
            raise TypeError(f"out: expected dtype {query.dtype} (as query); got {out.dtype}")
        _shape("out", out, (T, Hq, D), "[num_tokens, num_q_heads, head_dim] as query")
        _device("out", out, device)
    if sinks is not None:
        sinks = _tensor("sinks", sinks)
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks: expected a float tensor; got {sinks.dtype}")
        _shape("sinks", sinks, (Hq,), f"[num_q_heads={Hq}]")
        _device("sinks", sinks, device)
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
            raise TypeError(f"sliding_window: expected an int or None, got {type(sliding_window).__name__}")
        if sliding_window < 1:
            raise ValueError(f"sliding_window: expected a window of at least 1 (it counts the query's own "
                             f"position); got {sliding_window}")
        sliding_window = int(sliding_window)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    if scale is None:
        scale = D ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    is_fp8 = key_cache.dtype in FP8_DTYPES
    k_scale_t = _scalar_tensor("k_scale", 1.0 if k_scale is None else k_scale, device) if is_fp8 else None
    v_scale_t = _scalar_tensor("v_scale", 1.0 if v_scale is None else v_scale, device) if is_fp8 else None
    for name, hint in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, numbers.Integral) or hint < 0):
            raise ValueError(f"{name}: expected a non-negative int or None, got {hint!r}")

    if validate:
        max_query_len, max_seq_len = _check_attention_indices(
            query_start_loc, seq_lens, block_table, T, num_blocks, block_size)
    return AttentionCall(query=query, key_cache=key_cache, value_cache=value_cache,
                         block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
                         out=out, scale=float(scale), causal=causal, sliding_window=sliding_window,
                         sinks=sinks, k_scale=k_scale_t, v_scale=v_scale_t,
                         max_query_len=max_query_len, max_seq_len=max_seq_len)


def _check_attention_indices(query_start_loc, seq_lens, block_table, T, num_blocks, block_size):
    qsl = query_start_loc.detach().to("cpu", torch.int64)
    lens = seq_lens.detach().to("cpu", torch.int64)
    B = lens.shape[0]
    if qsl[0] != 0 or qsl[-1] != T:
        raise ValueError(f"query_start_loc: expected query_start_loc[0] == 0 and query_start_loc[{B}] == "
                         f"num_tokens={T}; got {qsl[0].item()} and {qsl[-1].item()}")
    q_lens = qsl[1:] - qsl[:-1]
    if (q_lens < 0).any():
        b = int(torch.nonzero(q_lens < 0)[0])
        raise ValueError(f"query_start_loc: must be non-decreasing; query_start_loc[{b + 1}]="
                         f"{qsl[b + 1].item()} < query_start_loc[{b}]={qsl[b].item()}")
    if (lens < 0).any():
        b = int(torch.nonzero(lens < 0)[0])
        raise ValueError(f"seq_lens[{b}]: expected >= 0; got {lens[b].item()}")
    if (q_lens > lens).any():
        b = int(torch.nonzero(q_lens > lens)[0])
        raise ValueError(f"seq_lens[{b}]={lens[b].item()} is shorter than that request's query length "
                         f"{q_lens[b].item()} (the query tokens are the last q_len keys: q_len <= seq_len)")
    capacity = block_table.shape[1] * block_size
    if (lens > capacity).any():
        b = int(torch.nonzero(lens > capacity)[0])
        raise ValueError(f"seq_lens[{b}]={lens[b].item()} exceeds what block_table rows hold: "
                         f"{block_table.shape[1]} blocks x block_size {block_size} = {capacity}")
    if B and block_table.shape[1]:
        needed = (seq_lens.to(torch.int64) + block_size - 1) // block_size
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < needed[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_blocks))
        if bool(bad.any()):
            b, i = (int(x) for x in torch.nonzero(bad)[0])
            raise ValueError(f"block_table[{b}, {i}]={int(block_table[b, i])} is outside the cache: "
                             f"expected a block id in [0, num_blocks={num_blocks})")
    max_q = int(q_lens.max()) if B else 0
    max_s = int(lens.max()) if B else 0
    return max_q, max_s


def _per_layer(name: str, value: Any, L: int) -> tuple:
    if isinstance(value, torch.Tensor) or isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name}: expected a sequence of num_layers={L} entries, got {type(value).__name__}")
    if len(value) != L:
        raise ValueError(f"{name}: expected num_layers={L} entries; got {len(value)}")
    return tuple(value)


def _layer_scales(name: str, value: Any, L: int, device: torch.device) -> torch.Tensor:
    if value is None:
        return torch.ones(L, dtype=torch.float32, device=device)
    if isinstance(value, torch.Tensor):
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a float tensor; got {value.dtype}")
        if value.numel() != L:
            raise ValueError(f"{name}: expected one scale per layer, [num_layers={L}]; got {list(value.shape)}")
        _device(name, value, device)
        return value.reshape(L).to(torch.float32)
    scales = [_scalar_tensor(f"{name}[{i}]", s, device) for i, s in enumerate(_per_layer(name, value, L))]
    return torch.cat(scales)


def precompute_call(context_states, positions, weights, key_caches, value_caches, slot_mapping, *,
                    k_scales=None, v_scales=None, return_kv=False, validate=True) -> PrecomputeCall:
    if not isinstance(weights, ContextKVWeights):
        raise TypeError(f"weights: expected ContextKVWeights, got {type(weights).__name__}")
    L, Hk, D = weights.num_layers, weights.num_kv_heads, weights.head_dim
    states = _tensor("context_states", context_states)
    _dtype("context_states", states, QUERY_DTYPES)
    _shape("context_states", states, (None, weights.hidden_size), f"[num_tokens, hidden={weights.hidden_size}]")
    if states.dtype != weights.dtype:
        raise TypeError(f"context_states: expected dtype {weights.dtype} (as weights.kv_weight); got {states.dtype}")
    device = states.device
    if weights.device != device:
        raise ValueError(f"weights: on {weights.device}, context_states on {device}")
    N = states.shape[0]
    positions = _tensor("positions", positions)
    _dtype("positions", positions, _INDEX_DTYPES)
    _shape("positions", positions, (N,), f"[num_tokens={N}]")
    _device("positions", positions, device)
    if not isinstance(return_kv, bool):
        raise TypeError(f"return_kv: expected bool, got {type(return_kv).__name__}")

    if slot_mapping is None:
        slots: tuple = (None,) * L
    elif isinstance(slot_mapping, torch.Tensor):
        slots = (slot_mapping,) * L
    else:
        slots = _per_layer("slot_mapping", slot_mapping, L)
    for i, s in enumerate(slots):
        if s is not None:
            name = f"slot_mapping[{i}]" if not isinstance(slot_mapping, torch.Tensor) else "slot_mapping"
            _tensor(name, s)
            _dtype(name, s, _INDEX_DTYPES)
            _shape(name, s, (N,), f"[num_tokens={N}]")
            _device(name, s, device)

    written = [i for i, s in enumerate(slots) if s is not None]
    if written:
        kcs = _per_layer("key_caches", key_caches, L)
        vcs = _per_layer("value_caches", value_caches, L)
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
            _tensor(name, c)
            _dtype(name, c, (states.dtype, *FP8_DTYPES))
            _shape(name, c, (None, None, Hk, D), f"[num_blocks, block_size, num_kv_heads={Hk}, head_dim={D}]")
            _device(name, c, device)
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
    ks = _layer_scales("k_scales", k_scales, L, device) if is_fp8 else None
    vs = _layer_scales("v_scales", v_scales, L, device) if is_fp8 else None

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
