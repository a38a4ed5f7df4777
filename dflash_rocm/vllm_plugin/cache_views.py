"""Each vLLM attention backend's per-layer KV cache as strided ``[blocks, bs, Hk, D]`` views.

Views, never copies: dflash_rocm's kernels take any strides, so the layouts vLLM 0.32-0.34
uses all fit. A layout that is not a strided view (packed pages, per-token-head scales)
is reported as a reason, and vLLM's own code then serves that layer.
"""

from __future__ import annotations

import torch

# Layouts per impl class name, checked along the MRO (subclasses first).
_CPU = "CPUAttentionBackendImpl"
_SEGMENTED = "RocmSegmentedAttentionImpl"
_LOGICAL_BHN2D = ("FlashAttentionImpl", "TritonAttentionImpl", "AiterFlashAttentionImpl")
_CPU_PLAIN_ISAS = ("vec", "vec16")


def _fp8_dtype(impl) -> torch.dtype:
    dtype = getattr(impl, "fp8_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    from vllm.platforms import current_platform
    return current_platform.fp8_dtype()


def cpu_page_views(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU_ATTN cache ``[blocks, Hk, bs, 2D]`` (ISA vec/vec16): per (block, head) page,
    K stored transposed ``[D, bs]``, then V ``[bs, D]``."""
    nb, _, bs, _ = kv_cache.shape
    pages = kv_cache.view(nb, num_kv_heads, 2, bs * head_dim)
    key = pages[:, :, 0].view(nb, num_kv_heads, head_dim, bs).permute(0, 3, 1, 2)
    value = pages[:, :, 1].view(nb, num_kv_heads, bs, head_dim).permute(0, 2, 1, 3)
    return key, value


def kv_cache_views(impl, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | str:
    """``(key_view, value_view)`` or why this layer's cache cannot be viewed."""
    names = [cls.__name__ for cls in type(impl).__mro__]
    Hk, D = impl.num_kv_heads, impl.head_size
    if _CPU in names:
        isa = getattr(layer, "isa", None)
        if isa not in _CPU_PLAIN_ISAS:
            return f"vLLM's CPU attention packs its pages for ISA {isa!r} (plain layouts: {', '.join(_CPU_PLAIN_ISAS)})"
        key, value = cpu_page_views(kv_cache, Hk, D)
    elif _SEGMENTED in names:
        # [blocks, 2, bs, Hk*D] (vLLM's ROCm segmented backend)
        key = kv_cache[:, 0].unflatten(-1, (Hk, D))
        value = kv_cache[:, 1].unflatten(-1, (Hk, D))
    elif any(n in names for n in _LOGICAL_BHN2D):
        if "AiterFlashAttentionImpl" in names and _aiter_shuffled():
            return "aiter's shuffled KV cache layout is not a strided view"
        if getattr(impl, "_is_per_token_head_quant", False):
            return "per-token-head quantised caches carry scales dflash_rocm does not read"
        # logical [blocks, Hk, bs, 2D] -> ([blocks, bs, Hk, D], [blocks, bs, Hk, D])
        key, value = kv_cache.transpose(1, 2).split(D, dim=-1)
    else:
        return f"the draft runs on vLLM's {type(impl).__name__}, whose cache layout dflash_rocm does not know"
    if str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8"):
        fp8 = _fp8_dtype(impl)
        key, value = key.view(fp8), value.view(fp8)
    return key, value


def _aiter_shuffled() -> bool:
    try:
        from vllm._aiter_ops import rocm_aiter_ops
        return bool(rocm_aiter_ops.is_shuffle_kv_cache_enabled())
    except Exception:  # no aiter ops in this build: nothing is shuffled
        return False
