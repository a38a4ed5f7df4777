"""Draft attention through vLLM's FlashAttention (varlen with a block table)."""

from __future__ import annotations

import functools
from typing import Callable

import torch

from dflash_rocm.calls import AttentionCall


@functools.lru_cache(maxsize=1)
def load_flash_attention() -> tuple[Callable | None, int, str | None]:
    """``(flash_attn_varlen_func, fa_version, reason it is unusable or None)``."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as exc:  # a CPU or ROCm build of vLLM has no vllm_flash_attn
        return None, 0, f"vLLM's FlashAttention is not importable ({type(exc).__name__}: {exc})"
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        version = get_flash_attn_version() or 2
    except Exception:
        major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 0
        version = 3 if major == 9 else 2
    return flash_attn_varlen_func, int(version), None


def flash_attention_kwargs(call: AttentionCall, fa_version: int) -> dict:
    """The FlashAttention arguments that compute SPEC.md's attention for ``call``.

    Window: SPEC.md's key ``j`` is visible iff ``j > p - W``, a left span of ``W - 1``.
    vLLM's own FlashAttention backend passes ``(W - 1, W - 1)`` for non-causal layers;
    the two agree whenever ``W >= q_len`` (DFlash windows are hundreds of tokens, blocks
    16), and SPEC.md is the contract, so the right side is unbounded here.
    """
    window = [-1, -1]
    if call.sliding_window is not None:
        window = [call.sliding_window - 1, 0 if call.causal else -1]
    kwargs = dict(q=call.query, k=call.key_cache, v=call.value_cache, max_seqlen_q=call.query_len_bound,
                  cu_seqlens_q=call.query_start_loc, max_seqlen_k=call.key_span_bound, seqused_k=call.seq_lens,
                  softmax_scale=call.scale, causal=call.causal, window_size=window,
                  block_table=call.block_table, out=call.out, fa_version=fa_version)
    if call.sinks is not None:
        kwargs["s_aux"] = call.sinks.float()
    return kwargs


def run_flash_attention(call: AttentionCall, flash_attn_varlen_func: Callable, fa_version: int) -> None:
    if call.num_tokens:
        flash_attn_varlen_func(**flash_attention_kwargs(call, fa_version))
