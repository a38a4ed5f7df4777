"""Validation of ``draft_attention``'s arguments: the only way an :class:`AttentionCall` is built.

See :mod:`dflash_rocm.validation` for the two tiers (metadata always; values on the host
for CPU tensors, as device-side asserts for GPU tensors, skipped by ``validate=False``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract import FP8_DTYPES, QUERY_DTYPES
from ...capture import keep_unless_captured
from ...validation import (IndexChecks, StructureMemo, cache_arg, check_device, check_disjoint, check_dtype,
                           check_layout_once, check_scale_values, check_shape, check_writable, holds_tensor,
                           index_tensor, int_bound, merged_ranges, positive_float, scale_tensor, signature,
                           storage_range, storages_meet, tensor_arg)
from .call import AttentionCall, seq_len_bucket


_STRUCTURES = StructureMemo()


@dataclass(frozen=True)
class _Derived:
    """What the structural checks of one call structure settle for every call of it."""

    scale: float
    sliding_window: int | None  # a Python int: kernels take numpy integers as tensors
    k_scale: torch.Tensor | None  # the fp8 scale as a device tensor when given as a float
    v_scale: torch.Tensor | None


def attention_call(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, *,
                   scale=None, causal=False, sliding_window=None, sinks=None, k_scale=None,
                   v_scale=None, out=None, validate=True, max_query_len=None,
                   max_seq_len=None) -> AttentionCall:
    """Check the arguments and build the call. The structural checks run once per call
    structure (every argument's shape, strides, dtype, device; scalars' values): a hot
    loop of same-shaped calls pays for building the call, the address-dependent overlap
    test and, with ``validate``, the value checks."""
    key = _STRUCTURES.structure(tuple(map(signature, (query, key_cache, value_cache, block_table, query_start_loc,
                                                      seq_lens, out, sinks, scale, causal, sliding_window, k_scale,
                                                      v_scale))))
    known = _STRUCTURES.get(key)
    if known is None:
        derived = _check_structure(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
                                   sinks, scale, causal, sliding_window, k_scale, v_scale)
        keep_unless_captured(_STRUCTURES, key, derived, query.device)  # a capture's scale tensors are its own
    else:
        key, derived = known
    fresh_out = out is None
    if fresh_out:
        out = torch.empty_like(query)
    if max_query_len is not None:
        max_query_len = int_bound("max_query_len", max_query_len, low=0)
    if max_seq_len is not None:
        max_seq_len = int_bound("max_seq_len", max_seq_len, low=0)
    is_fp8 = key_cache.dtype in FP8_DTYPES
    device = query.device
    k_scale_t, v_scale_t = derived.k_scale, derived.v_scale
    if is_fp8 and k_scale_t is None:
        k_scale_t = scale_tensor("k_scale", k_scale, 1, device)
    if is_fp8 and v_scale_t is None:
        v_scale_t = scale_tensor("v_scale", v_scale, 1, device)
    query_start_loc, seq_lens, block_table = (
        t if t.is_contiguous() else t.contiguous() for t in (query_start_loc, seq_lens, block_table))
    if sinks is not None and not sinks.is_contiguous():
        sinks = sinks.contiguous()
    if validate:
        checks = IndexChecks(device)
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        _check_indices(checks, query_start_loc, seq_lens, block_table, query.shape[0], num_blocks, block_size)
        if is_fp8:
            check_scale_values("k_scale", k_scale_t, checks)
            check_scale_values("v_scale", v_scale_t, checks)
        if checks.on_host and seq_lens.shape[0]:  # free on the host: exact bounds size the launch
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
            max_seq_len = int(seq_lens.max())
    if max_seq_len is not None:
        max_seq_len = seq_len_bucket(max_seq_len, block_table.shape[1] * key_cache.shape[1])
    call = AttentionCall(query=query, key_cache=key_cache, value_cache=value_cache,
                         block_table=block_table, query_start_loc=query_start_loc, seq_lens=seq_lens,
                         out=out, scale=derived.scale, causal=causal, sliding_window=derived.sliding_window,
                         sinks=sinks, k_scale=k_scale_t, v_scale=v_scale_t,
                         max_query_len=max_query_len, max_seq_len=max_seq_len, structure=key)
    if not fresh_out:
        check_out_apart(call)
    return call


def _check_structure(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out, sinks, scale,
                     causal, sliding_window, k_scale, v_scale) -> _Derived:
    """Every check that reads only metadata and scalar values; raises on the first problem."""
    query = tensor_arg("query", query)
    check_dtype("query", query, QUERY_DTYPES)
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [num_tokens, num_q_heads, head_dim]; got {list(query.shape)}")
    T, Hq, D = query.shape
    device = query.device
    key_cache = cache_arg("key_cache", key_cache)
    value_cache = cache_arg("value_cache", value_cache)
    check_dtype("key_cache", key_cache, (query.dtype, *FP8_DTYPES))
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: expected dtype {key_cache.dtype} (as key_cache); got {value_cache.dtype}")
    if len(key_cache.shape) != 4:
        raise ValueError("key_cache: expected shape [num_blocks, block_size, num_kv_heads, head_dim]; "
                         f"got {list(key_cache.shape)}")
    num_blocks, block_size, Hk, _ = key_cache.shape
    check_shape("key_cache", key_cache, (None, None, None, D),
                f"[num_blocks, block_size, num_kv_heads, head_dim={D}]")
    check_shape("value_cache", value_cache, tuple(key_cache.shape), "the shape of key_cache")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"key_cache: num_kv_heads={Hk} must divide num_q_heads={Hq} (query shape {list(query.shape)})")
    if num_blocks == 0 or block_size == 0:
        raise ValueError(f"key_cache: expected at least one block of at least one row; got {list(key_cache.shape)}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_device(name, t, device)

    seq_lens = tensor_arg("seq_lens", seq_lens)
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [num_seqs]; got {list(seq_lens.shape)}")
    B = seq_lens.shape[0]
    index_tensor("seq_lens", seq_lens, (B,), "[num_seqs]", device)
    index_tensor("query_start_loc", query_start_loc, (B + 1,), f"[num_seqs + 1] with num_seqs={B} (from seq_lens)",
                 device)
    index_tensor("block_table", block_table, (B, None), f"[num_seqs={B}, max_blocks_per_seq]", device)
    if out is not None:
        out = tensor_arg("out", out)
        if out.dtype != query.dtype:
            raise TypeError(f"out: expected dtype {query.dtype} (as query); got {out.dtype}")
        check_shape("out", out, (T, Hq, D), "[num_tokens, num_q_heads, head_dim] as query")
        check_device("out", out, device)
        check_writable("out", out)
    if sinks is not None:
        sinks = tensor_arg("sinks", sinks)
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks: expected a float tensor; got {sinks.dtype}")
        check_shape("sinks", sinks, (Hq,), f"[num_q_heads={Hq}]")
        check_device("sinks", sinks, device)
    if sliding_window is not None:
        sliding_window = int_bound("sliding_window", sliding_window, low=1)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected bool, got {type(causal).__name__}")
    # Positive: kernels keep the scores' running max unscaled and apply the scale in each
    # exponent (the max commutes only with a positive factor; a masked key's -inf score
    # times a non-positive scale is NaN). No attention layer scales by a non-positive factor.
    scale = D ** -0.5 if scale is None else positive_float("scale", scale)
    scales = [None, None]
    if key_cache.dtype in FP8_DTYPES:
        for i, (name, given) in enumerate((("k_scale", k_scale), ("v_scale", v_scale))):
            t = scale_tensor(name, 1.0 if given is None else given, 1, device)  # checks a tensor's form too
            if not holds_tensor(given):
                scales[i] = t  # a float: constant for every call of this structure
    return _Derived(scale, sliding_window, *scales)


_INDEX = ("block_table", "query_start_loc", "seq_lens")  # the batch
_READ = ("query", "key_cache", "value_cache", "sinks", "k_scale", "v_scale", *_INDEX)  # every tensor a call reads


def batch_memory(call: AttentionCall) -> tuple:
    """The memory of the call's index tensors' storages (:func:`merged_ranges`): what a
    plan keeps for every run."""
    return merged_ranges(storage_range(getattr(call, name)) for name in _INDEX)


def check_out_apart(call: AttentionCall, batch: tuple | None = None) -> None:
    """``call.out`` shares no memory with anything the call reads: free when its storage's
    memory meets none of theirs (the usual case), else judged once per layout (addresses,
    shapes, strides). ``batch``: :func:`batch_memory`, when a plan kept it. That ``out``
    does not alias itself is a structural check."""
    c = call
    start, end = storage_range(c.out)
    index = (c.block_table, c.query_start_loc, c.seq_lens) if batch is None else ()
    if storages_meet((c.query, c.key_cache, c.value_cache, c.sinks, c.k_scale, c.v_scale, *index), ((start, end),)) \
            or any(b_start < end and start < b_end for b_start, b_end in batch or ()):
        read = [getattr(c, name) for name in _READ]
        check_layout_once("attention out", [c.out, *(t for t in read if t is not None)],
                          lambda: _check_out_memory(c.out, read))


def _check_out_memory(out, read: list) -> None:
    for name, t in zip(_READ, read):
        if t is not None:
            check_disjoint("out", out, name, t)


def _plainly_in_range(qsl, seq_lens, block_table, T, num_blocks, block_size) -> bool:
    """Host tensors: whether every condition :func:`_exact_index_checks` states holds, from two
    short lists and one reduction over the block-table columns some request uses (a
    superset of the entries in use: in range there, in range where it counts). False sends
    the call through the exact checks, which pass it or name the offender."""
    starts, lens = qsl.tolist(), seq_lens.tolist()
    if starts[0] != 0 or starts[-1] != T:
        return False
    capacity = block_table.shape[1] * block_size
    used = 0
    for b, seq_len in enumerate(lens):
        q_len = starts[b + 1] - starts[b]
        if q_len < 0 or seq_len < q_len or seq_len > capacity:
            return False
        used = max(used, -(-seq_len // block_size))
    if used == 0:
        return True
    low, high = torch.aminmax(block_table[:, :used])
    return int(low) >= 0 and int(high) < num_blocks


def _check_indices(checks: IndexChecks, qsl, seq_lens, block_table, T, num_blocks, block_size) -> None:
    if not (checks.on_host and _plainly_in_range(qsl, seq_lens, block_table, T, num_blocks, block_size)):
        _exact_index_checks(checks, qsl, seq_lens, block_table, T, num_blocks, block_size)


def _exact_index_checks(checks: IndexChecks, qsl, seq_lens, block_table, T, num_blocks, block_size) -> None:
    """Every condition on the index values, each by :meth:`IndexChecks.require` (on a
    device: asynchronous asserts; on the host: the first offender named)."""
    B = seq_lens.shape[0]
    checks.require(torch.stack((qsl[0] == 0, qsl[-1] == T)),
                   f"query_start_loc: expected query_start_loc[0] == 0 and query_start_loc[{B}] == num_tokens={T}",
                   lambda i: f"query_start_loc: expected query_start_loc[0] == 0 and query_start_loc[{B}] == "
                             f"num_tokens={T}; got {int(qsl[0])} and {int(qsl[-1])}")
    q_lens = qsl[1:] - qsl[:-1]
    checks.require(q_lens >= 0, "query_start_loc: must be non-decreasing",
                   lambda i: f"query_start_loc: must be non-decreasing; query_start_loc[{i[0] + 1}]="
                             f"{int(qsl[i[0] + 1])} < query_start_loc[{i[0]}]={int(qsl[i[0]])}")
    checks.require(seq_lens >= 0, "seq_lens: expected values >= 0",
                   lambda i: f"seq_lens[{i[0]}]: expected >= 0; got {int(seq_lens[i[0]])}")
    checks.require(q_lens <= seq_lens, "seq_lens: a request's query length exceeds its sequence length",
                   lambda i: f"seq_lens[{i[0]}]={int(seq_lens[i[0]])} is shorter than that request's query length "
                             f"{int(q_lens[i[0]])} (the query tokens are the last q_len keys: q_len <= seq_len)")
    capacity = block_table.shape[1] * block_size
    checks.require(seq_lens <= capacity, f"seq_lens: a sequence exceeds what block_table rows hold ({capacity} keys)",
                   lambda i: f"seq_lens[{i[0]}]={int(seq_lens[i[0]])} exceeds what block_table rows hold: "
                             f"{block_table.shape[1]} blocks x block_size {block_size} = {capacity}")
    if B and block_table.shape[1]:
        needed = (seq_lens.to(torch.int64) + block_size - 1) // block_size
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < needed[:, None]
        checks.require(~used | ((block_table >= 0) & (block_table < num_blocks)),
                       f"block_table: a block id in use is outside the cache [0, num_blocks={num_blocks})",
                       lambda i: f"block_table[{i[0]}, {i[1]}]={int(block_table[i])} is outside the cache: "
                                 f"expected a block id in [0, num_blocks={num_blocks})")
