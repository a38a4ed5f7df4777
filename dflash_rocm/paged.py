"""Paged KV caches whose pages are packed: the layouts a strided view cannot express.

The contract's cache is a strided ``[num_blocks, block_size, Hk, D]`` view. Some vLLM
backends pack a page further: ROCM_ATTN (vLLM's default on AMD) stores K "x-packed",
``[blocks, Hk, D // x, block_size, x]`` with ``x = 16 // element_size`` (dim ``d`` lives at
``(d // x) * stride + d % x``), and with aiter's fused RoPE + cache write, V "interleaved",
``[blocks, Hk, block_size // x, D, x]`` (row ``r`` at ``(r // x) * stride + r % x``).

A :class:`PackedCache` describes any of these as one strided 6-D view
``[blocks, block_size // R, R, Hk, D // C, C]``: row ``r`` is ``(r // R, r % R)`` and dim
``d`` is ``(d // C, d % C)``. ``R = 1`` and ``C = 1`` mean "not packed" along that axis: a
plain view is the special case ``t.unsqueeze(2).unsqueeze(-1)``, so one addressing rule,
``(r // R) * s1 + (r % R) * s2`` and ``(d // C) * s4 + (d % C) * s5``, serves every layout.
Kernels address it without a copy; the reference reads and writes it through
:func:`read_rows` / :func:`write_rows`, which take plain tensors too.
"""

from __future__ import annotations

import torch


class PackedCache:
    """One layer's K or V cache in a packed page layout (see the module docstring)."""

    __slots__ = ("view",)

    def __init__(self, view: torch.Tensor):
        if not isinstance(view, torch.Tensor) or view.dim() != 6:
            raise ValueError("PackedCache: expected a 6-D view [blocks, block_size // R, R, Hk, D // C, C]; got "
                             f"{type(view).__name__} {list(getattr(view, 'shape', []))}")
        self.view = view

    @classmethod
    def x_packed_key(cls, key_cache: torch.Tensor) -> "PackedCache":
        """vLLM's x-packed K, ``[blocks, Hk, D // x, block_size, x]`` (``split_kv_cache``)."""
        if key_cache.dim() != 5:
            raise ValueError(f"x_packed_key: expected [blocks, Hk, D // x, block_size, x]; got {list(key_cache.shape)}")
        return cls(key_cache.permute(0, 3, 1, 2, 4).unsqueeze(2))

    @classmethod
    def interleaved_value(cls, value_cache: torch.Tensor) -> "PackedCache":
        """vLLM's interleaved V, ``[blocks, Hk, block_size // x, D, x]``."""
        if value_cache.dim() != 5:
            raise ValueError("interleaved_value: expected [blocks, Hk, block_size // x, D, x]; got "
                             f"{list(value_cache.shape)}")
        return cls(value_cache.permute(0, 2, 4, 1, 3).unsqueeze(-1))

    @property
    def row_pack(self) -> int:
        return self.view.shape[2]

    @property
    def dim_pack(self) -> int:
        return self.view.shape[5]

    @property
    def shape(self) -> torch.Size:
        """The logical ``[num_blocks, block_size, Hk, D]``."""
        v = self.view.shape
        return torch.Size((v[0], v[1] * v[2], v[3], v[4] * v[5]))

    @property
    def dtype(self) -> torch.dtype:
        return self.view.dtype

    @property
    def device(self) -> torch.device:
        return self.view.device

    def reinterpret(self, dtype: torch.dtype) -> "PackedCache":
        """The same bytes viewed as ``dtype`` of the same size (vLLM keeps fp8 caches as uint8)."""
        return PackedCache(self.view.view(dtype))

    def __repr__(self) -> str:
        return (f"PackedCache(shape={list(self.shape)}, dtype={self.dtype}, rows packed by {self.row_pack}, "
                f"dims packed by {self.dim_pack})")


def read_rows(cache: torch.Tensor | PackedCache, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``cache[blocks, rows]`` as ``[n, Hk, D]``, for a plain or packed cache."""
    if isinstance(cache, torch.Tensor):
        return cache[blocks, rows]
    r = cache.row_pack
    picked = cache.view[blocks, rows // r, rows % r]  # [n, Hk, D // C, C]
    n, hk, outer, inner = picked.shape
    return picked.reshape(n, hk, outer * inner)


def write_rows(cache: torch.Tensor | PackedCache, blocks: torch.Tensor, rows: torch.Tensor,
               values: torch.Tensor) -> None:
    """``cache[blocks, rows] = values`` (``[n, Hk, D]``), for a plain or packed cache."""
    if isinstance(cache, torch.Tensor):
        cache[blocks, rows] = values
        return
    r, c = cache.row_pack, cache.dim_pack
    n, hk, d = values.shape
    cache.view[blocks, rows // r, rows % r] = values.reshape(n, hk, d // c, c)


def logical(cache: torch.Tensor | PackedCache) -> torch.Tensor:
    """The logical ``[num_blocks, block_size, Hk, D]`` tensor: the cache itself when plain,
    a copy when packed (for checks and tools, never a hot path)."""
    if isinstance(cache, torch.Tensor):
        return cache
    v = cache.view
    return v.reshape(v.shape[0], v.shape[1] * v.shape[2], v.shape[3], v.shape[4] * v.shape[5])


def memory_of(cache: torch.Tensor | PackedCache) -> torch.Tensor:
    """The strided tensor whose elements are the cache's memory (for overlap checks; a
    plan's tensor facts pass as they are)."""
    return cache.view if type(cache) is PackedCache else cache


def cache_packing(*caches: torch.Tensor | PackedCache | None) -> tuple[tuple[int, int], ...] | None:
    """(row pack, dim pack) of each cache when any is packed (None entries count as plain);
    None when all are plain strided tensors."""
    if not any(isinstance(c, PackedCache) for c in caches):
        return None
    return tuple((c.row_pack, c.dim_pack) if isinstance(c, PackedCache) else (1, 1) for c in caches)
