"""The public operations (docs/SPEC.md): validate, get or make the call's plan, run it."""

from __future__ import annotations

from typing import Sequence

import torch

from . import dispatch
from .ops import ATTENTION, PRECOMPUTE, op_named
from .weights import ContextKVWeights


def draft_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *,
                    scale: float | None = None, causal: bool = False, sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None, k_scale=None, v_scale=None,
                    out: torch.Tensor | None = None, backend: str | None = None,
                    validate: bool = True, max_query_len: int | None = None,
                    max_seq_len: int | None = None) -> torch.Tensor:
    """Attention of each request's query block over its paged KV (SPEC.md section 1).

    Beyond SPEC.md: ``validate=False`` skips the index checks that sync with the device
    (for callers that checked already); ``max_query_len``/``max_seq_len`` are optional
    host-side bounds that let kernels size their launch without reading the device.
    """
    call = ATTENTION.build_call(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                scale=scale, causal=causal, sliding_window=sliding_window, sinks=sinks,
                                k_scale=k_scale, v_scale=v_scale, out=out, validate=validate,
                                max_query_len=max_query_len, max_seq_len=max_seq_len)
    dispatch.planned(ATTENTION, call, backend)(call)
    return call.out


def precompute_and_store_context_kv(context_states: torch.Tensor, positions: torch.Tensor,
                                    weights: ContextKVWeights,
                                    key_caches: Sequence[torch.Tensor | None] | None,
                                    value_caches: Sequence[torch.Tensor | None] | None,
                                    slot_mapping, *, k_scales=None, v_scales=None,
                                    return_kv: bool = False, backend: str | None = None,
                                    validate: bool = True):
    """K/V of the context states for every draft layer, written into each layer's paged
    cache (SPEC.md section 2). Returns ``(k, v)`` ``[L, N, Hk, D]`` iff ``return_kv``.

    ``validate=False`` skips the position and slot range checks (device syncs).
    """
    call = PRECOMPUTE.build_call(context_states, positions, weights, key_caches, value_caches, slot_mapping,
                                 k_scales=k_scales, v_scales=v_scales, return_kv=return_kv, validate=validate)
    return dispatch.planned(PRECOMPUTE, call, backend)(call)


def explain(op: str, *args, **kwargs) -> dict[str, list[str]]:
    """Each backend's reasons for a call of ``op`` with these arguments (empty list: it
    would serve), auto's candidates first in its order; the arguments are validated,
    nothing is computed. ``op`` is ``"draft_attention"`` or ``"precompute_and_store_context_kv"``."""
    kwargs.pop("backend", None)
    record = op_named(op)
    return dispatch.explain_call(record, record.build_call(*args, **kwargs))


def available_backends(device: torch.device | str | None = None) -> dict[str, list[str]]:
    """Each backend's device-level reasons on ``device`` (empty list: available)."""
    return dispatch.device_reasons(device)
