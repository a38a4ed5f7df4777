"""The contract's attention in the terms of FlashAttention-style varlen kernels.

FlashAttention (vLLM's ``vllm_flash_attn``) and aiter's CK ``flash_attn_varlen_func``
take the same paged varlen arguments; the backends that call them start from these and
add their own spellings (how keys are counted, how sinks are passed).
"""

from __future__ import annotations

from .call import AttentionCall


def flash_window(call: AttentionCall) -> list[int]:
    """SPEC.md's window as ``(left, right)`` spans: key ``j`` is visible from position
    ``p`` iff ``j > p - W``, a left span of ``W - 1``; the right side is unbounded unless
    causal. (vLLM's own FlashAttention backend passes ``(W - 1, W - 1)`` for non-causal
    layers; the two agree whenever ``W >= q_len``, always true for DFlash: windows of
    hundreds of tokens, blocks of 16. SPEC.md is the contract.)"""
    if call.sliding_window is None:
        return [-1, -1]
    return [call.sliding_window - 1, 0 if call.causal else -1]


def varlen_kwargs(call: AttentionCall) -> dict:
    """The arguments both kernels share, with host-side length bounds."""
    return dict(q=call.query, k=call.key_cache, v=call.value_cache, cu_seqlens_q=call.query_start_loc,
                max_seqlen_q=call.query_len_bound, max_seqlen_k=call.key_span_bound, softmax_scale=call.scale,
                causal=call.causal, window_size=flash_window(call), block_table=call.block_table, out=call.out)
