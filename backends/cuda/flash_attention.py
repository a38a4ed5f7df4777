"""Draft attention through vLLM's FlashAttention (varlen with a block table)."""

from __future__ import annotations

from typing import Callable

import torch

from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.attention.varlen import varlen_kwargs
from dflash_rocm.process import process_constant


@process_constant
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
    """The FlashAttention arguments that compute SPEC.md's attention for ``call``: keys
    counted by ``seqused_k``, sinks through ``s_aux`` (FA3/4)."""
    kwargs = varlen_kwargs(call)
    kwargs.update(seqused_k=call.seq_lens, fa_version=fa_version)
    if call.sinks is not None:
        kwargs["s_aux"] = call.sinks.float()
    return kwargs


def run_flash_attention(call: AttentionCall, flash_attn_varlen_func: Callable, fa_version: int) -> None:
    if call.num_tokens:
        flash_attn_varlen_func(**flash_attention_kwargs(call, fa_version))
