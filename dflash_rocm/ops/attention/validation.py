"""Validation of ``draft_attention``'s arguments: the only way an :class:`AttentionCall` is built."""

from __future__ import annotations

import math
import numbers

import torch

from ...contract import FP8_DTYPES, INDEX_DTYPES, QUERY_DTYPES
from ...validation import check_device, check_dtype, check_shape, scale_tensor, tensor_arg
from .call import AttentionCall


def attention_call(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, *,
                   scale=None, causal=False, sliding_window=None, sinks=None, k_scale=None,
                   v_scale=None, out=None, validate=True, max_query_len=None,
                   max_seq_len=None) -> AttentionCall:
    query = tensor_arg("query", query)
    check_dtype("query", query, QUERY_DTYPES)
    if query.dim() != 3:
        raise ValueError(f"query: expected shape [num_tokens, num_q_heads, head_dim]; got {list(query.shape)}")
    T, Hq, D = query.shape
    device = query.device
    key_cache = tensor_arg("key_cache", key_cache)
    value_cache = tensor_arg("value_cache", value_cache)
    check_dtype("key_cache", key_cache, (query.dtype, *FP8_DTYPES))
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: expected dtype {key_cache.dtype} (as key_cache); got {value_cache.dtype}")
    if key_cache.dim() != 4:
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
    check_dtype("seq_lens", seq_lens, INDEX_DTYPES)
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected shape [num_seqs]; got {list(seq_lens.shape)}")
    B = seq_lens.shape[0]
    query_start_loc = tensor_arg("query_start_loc", query_start_loc)
    check_dtype("query_start_loc", query_start_loc, INDEX_DTYPES)
    check_shape("query_start_loc", query_start_loc, (B + 1,), f"[num_seqs + 1] with num_seqs={B} (from seq_lens)")
    block_table = tensor_arg("block_table", block_table)
    check_dtype("block_table", block_table, INDEX_DTYPES)
    check_shape("block_table", block_table, (B, None), f"[num_seqs={B}, max_blocks_per_seq]")
    for name, t in (("seq_lens", seq_lens), ("query_start_loc", query_start_loc), ("block_table", block_table)):
        check_device(name, t, device)

    if out is None:
        out = torch.empty_like(query)
    else:
        out = tensor_arg("out", out)
        if out.dtype != query.dtype:
            raise TypeError(f"out: expected dtype {query.dtype} (as query); got {out.dtype}")
        check_shape("out", out, (T, Hq, D), "[num_tokens, num_q_heads, head_dim] as query")
        check_device("out", out, device)
    if sinks is not None:
        sinks = tensor_arg("sinks", sinks)
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks: expected a float tensor; got {sinks.dtype}")
        check_shape("sinks", sinks, (Hq,), f"[num_q_heads={Hq}]")
        check_device("sinks", sinks, device)
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
    k_scale_t = scale_tensor("k_scale", 1.0 if k_scale is None else k_scale, device) if is_fp8 else None
    v_scale_t = scale_tensor("v_scale", 1.0 if v_scale is None else v_scale, device) if is_fp8 else None
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


