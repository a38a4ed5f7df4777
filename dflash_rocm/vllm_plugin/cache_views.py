"""Each vLLM attention backend's per-layer KV cache as dflash_rocm caches, never copies.

vLLM 0.32-0.34 bind every layer's cache as a view of one buffer and each backend's impl
reinterprets it (vLLM 0.33: ``v1/kv_cache_interface.py`` allocates, the impls split; the
facts and the writers are in ``docs/vllm-backends.md``). This module knows, per impl
class, how to read it: a strided ``[blocks, bs, Hk, D]`` view where one exists, a
:class:`~dflash_rocm.paged.PackedCache` for ROCM_ATTN's x-packed K (and interleaved V),
and a reason where dflash_rocm cannot read the layout (vLLM's own code then serves).

Impl classes are matched along the MRO, most derived first: ROCm's unified and segmented
impls subclass ROCM_ATTN's with other layouts, and shapes cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..paged import PackedCache


@dataclass(frozen=True)
class VllmBackend:
    name: str  # vLLM's AttentionBackendEnum name (aiter FA reports "FLASH_ATTN" as its own name)
    impl: str  # the impl class name vLLM binds to a layer
    layout: str  # how K and V sit in the bound tensor
    served: str  # what dflash_rocm does with it


BACKENDS: tuple[VllmBackend, ...] = (
    VllmBackend("CPU_ATTN", "CPUAttentionBackendImpl",
                "[B, Hk, bs, 2D]; per (block, head) page K^T [D, bs] then V [bs, D] (ISA vec/vec16); amx packed",
                "precompute served (strided views), left to vLLM's faster CPU ops under auto where the CPU has a "
                "native GEMM for the dtype; attention left to vLLM's faster CPU kernel under auto; both served when "
                "a backend is named; amx pages stay on vLLM"),
    VllmBackend("ROCM_SEGMENTED_ATTN", "RocmSegmentedAttentionImpl", "[B, 2, bs, Hk*D], token-major slots",
                "served (strided views)"),
    VllmBackend("ROCM_AITER_UNIFIED_ATTN", "RocmAiterUnifiedAttentionImpl",
                "[B, Hk, bs, 2D], K then V in the last dim (gfx1250 shuffle: refused)",
                "served (strided views); causal drafts only: vLLM never picks it for non-causal ones"),
    VllmBackend("ROCM_ATTN", "RocmAttentionImpl",
                "[B, 2, bs, Hk*D]; K x-packed [B, Hk, D/x, bs, x], V [B, Hk, D, bs] or interleaved "
                "[B, Hk, bs/x, D, x], x = 16 / element size", "served (PackedCache K, strided or packed V)"),
    VllmBackend("ROCM_AITER_FA", "AiterFlashAttentionImpl",
                "[B, Hk, bs, 2D]; shuffled: as ROCM_ATTN with interleaved V",
                "served (strided views; shuffled: PackedCache K and V)"),
    VllmBackend("TRITON_ATTN", "TritonAttentionImpl", "[B, Hk, bs, 2D], K then V in the last dim",
                "served (strided views); per-token-head quantised caches stay on vLLM"),
    VllmBackend("FLASH_ATTN", "FlashAttentionImpl", "[B, Hk, bs, 2D], K then V in the last dim",
                "served (strided views)"),
    VllmBackend("FLEX_ATTENTION", "FlexAttentionImpl", "[B, Hk, bs, 2D], K then V in the last dim",
                "served (strided views)"),
    VllmBackend("FLASHINFER", "FlashInferImpl", "[B, Hk, bs, 2D], K then V in the last dim",
                "not served: its metadata carries no block table or sequence lengths"),
)
_BY_IMPL = {b.impl: b for b in BACKENDS}
_BY_NAME = {b.name: b for b in BACKENDS}

# vLLM 0.34's order for a non-causal draft per platform vendor (platforms/rocm.py
# _get_backend_priorities ~536-580, platforms/cuda.py, platforms/cpu.py); aiter's entries need
# VLLM_ROCM_USE_AITER=1. On gfx1100 and gfx1201 0.34 swaps ROCM_ATTN and TRITON_ATTN
# (rocm.py ~765-780; an fp8_e5m2 cache keeps ROCM_ATTN first): RDNA3/RDNA4 drafts get TRITON_ATTN.
VLLM_ORDER: dict[str, tuple[str, ...]] = {
    "rocm": ("ROCM_ATTN", "ROCM_AITER_FA", "TRITON_ATTN"),
    "cuda": ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"),
    "cpu": ("CPU_ATTN",),
}
TRITON_FIRST_ARCHS = ("gfx1100", "gfx1201")


def vllm_order(vendor: str, arch: str | None = None) -> list[VllmBackend]:
    """The backends vLLM 0.34 tries for a non-causal DFlash draft on this platform, in order."""
    names = list(VLLM_ORDER.get(vendor, ()))
    if vendor == "rocm" and arch is not None and arch.split(":")[0] in TRITON_FIRST_ARCHS:
        i, j = names.index("ROCM_ATTN"), names.index("TRITON_ATTN")
        names[i], names[j] = names[j], names[i]
    return [_BY_NAME[name] for name in names]


_CPU_PLAIN_ISAS = ("vec", "vec16")
_FLASH_STYLE = ("RocmAiterUnifiedAttentionImpl", "TritonAttentionImpl", "FlashAttentionImpl", "FlexAttentionImpl")


def backend_of(impl) -> VllmBackend | None:
    """The vLLM backend an impl object belongs to: the most derived known class of its MRO."""
    for cls in type(impl).__mro__:
        if cls.__name__ in _BY_IMPL:
            return _BY_IMPL[cls.__name__]
    return None


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


def kv_cache_views(impl, layer, kv_cache: torch.Tensor):
    """``(key, value)`` dflash_rocm caches over this layer's bound tensor, or why not."""
    backend = backend_of(impl)
    Hk, D = impl.num_kv_heads, impl.head_size
    cache_dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    if backend is None:
        return f"the draft runs on vLLM's {type(impl).__name__}, whose cache layout dflash_rocm does not know"
    if cache_dtype == "fp8_e5m2":
        return "fp8_e5m2 caches are not a dflash_rocm format (vLLM's ROCm writers store e4m3 bits for them)"
    if getattr(impl, "_is_per_token_head_quant", False):
        return "per-token-head quantised caches carry scales dflash_rocm does not read"
    if backend.name == "FLASHINFER":
        return "FlashInfer's metadata carries no block table or sequence lengths"
    if backend.name == "CPU_ATTN":
        isa = getattr(layer, "isa", None)
        if isa not in _CPU_PLAIN_ISAS:
            return f"vLLM's CPU attention packs its pages for ISA {isa!r} (plain layouts: {', '.join(_CPU_PLAIN_ISAS)})"
        key, value = cpu_page_views(kv_cache, Hk, D)
    elif backend.name == "ROCM_SEGMENTED_ATTN":
        key = kv_cache[:, 0].unflatten(-1, (Hk, D))
        value = kv_cache[:, 1].unflatten(-1, (Hk, D))
    elif backend.name == "ROCM_ATTN" or (backend.name == "ROCM_AITER_FA" and _aiter_shuffled()):
        interleaved = backend.name == "ROCM_AITER_FA" or bool(getattr(impl, "_use_interleaved_v_cache", False))
        key, value = rocm_attn_caches(kv_cache, Hk, D, interleaved)
    elif backend.name == "ROCM_AITER_FA" or backend.impl in _FLASH_STYLE:
        if backend.name == "ROCM_AITER_UNIFIED_ATTN" and _aiter_shuffled() and _on_gfx1250():
            return "aiter's gfx1250 shuffled layout of the unified backend is not a layout dflash_rocm reads"
        key, value = kv_cache.transpose(1, 2).split(D, dim=-1)  # logical [B, Hk, bs, 2D]
    else:  # a backend in the table without a reader would be a bug in this module
        raise AssertionError(f"no reader for {backend.name}")
    if cache_dtype.startswith("fp8"):
        fp8 = _fp8_dtype(impl)
        key, value = (c.reinterpret(fp8) if isinstance(c, PackedCache) else c.view(fp8) for c in (key, value))
    return key, value


def rocm_attn_caches(kv_cache: torch.Tensor, Hk: int, D: int, interleaved_v: bool):
    """ROCM_ATTN's split (vLLM 0.33 ``v1/attention/ops/paged_attn.py`` ``split_kv_cache``):
    each slot page of the bound ``[B, 2, bs, Hk*D]`` tensor reread as x-packed K
    ``[B, Hk, D/x, bs, x]`` and V ``[B, Hk, D, bs]`` (interleaved: ``[B, Hk, bs/x, D, x]``),
    ``x = 16 // element_size`` of the bound tensor (uint8 for fp8)."""
    x = 16 // kv_cache.element_size()
    nb, _, bs, _ = kv_cache.shape
    key = PackedCache.x_packed_key(kv_cache[:, 0].view(nb, Hk, D // x, bs, x))
    if interleaved_v:
        return key, PackedCache.interleaved_value(kv_cache[:, 1].view(nb, Hk, bs // x, D, x))
    return key, kv_cache[:, 1].view(nb, Hk, D, bs).permute(0, 3, 1, 2)


def _aiter_shuffled() -> bool:
    try:
        from vllm._aiter_ops import rocm_aiter_ops
        return bool(rocm_aiter_ops.is_shuffle_kv_cache_enabled())
    except Exception:  # no aiter ops in this build: nothing is shuffled
        return False


def _on_gfx1250() -> bool:
    try:
        from vllm.platforms.rocm import on_gfx1250
        return bool(on_gfx1250())
    except Exception:  # not a ROCm build
        return False
