"""The validated arguments of one ``draft_attention`` call, as backends receive them.

Only :func:`dflash_rocm.ops.attention.validation.attention_call` builds these; a backend
can rely on every shape, dtype and device relation stated here (and, unless the caller
opted out, on every index being in range).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract import FP8_DTYPES, dtype_name
from ...paged import PackedCache, cache_packing, memory_of
from ..base import describe_call


def seq_len_bucket(max_seq_len: int, capacity: int) -> int:
    """The bound a call is planned with for a host ``max_seq_len``: the next power of two
    (at least 16), at most the block table's ``capacity`` (vLLM's is ``max_model_len``)
    when that still bounds it. The plan is keyed by it, so eager steps whose exact maxima
    differ (vLLM 0.34 passes each step's own) share one plan, as graph replays share the
    one made with ``max_model_len``; the kernels read the exact lengths from ``seq_lens``."""
    bucket = max(16, 1 << max(max_seq_len - 1, 0).bit_length())
    return max(max_seq_len, min(bucket, capacity))


@dataclass(frozen=True)
class AttentionSpec:
    """The part of an attention call that is fixed for a model layer: everything but the
    batch layout. Backends key startup work (tuning, warm-up) by it."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    causal: bool
    sliding_window: int | None
    sinks: bool

    @property
    def fp8(self) -> bool:
        return self.cache_dtype in FP8_DTYPES


@dataclass(eq=False, slots=True)
class AttentionCall:
    """One validated call. Not frozen (a frozen dataclass sets each field through
    ``object.__setattr__``: about 1 us more for every call a plan runs), so treat it as
    read-only: nothing below validation assigns a field."""

    # What a plan may know of each tensor's memory (dflash_rocm.planning): the caches' alignment and
    # storage size (AMD buffer loads need storage under 2 GiB).
    PLANNED_ADDRESSES = {"key_cache": "memory", "value_cache": "memory"}

    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor | PackedCache  # [num_blocks, block_size, Hk, D]: strided or packed
    value_cache: torch.Tensor | PackedCache
    block_table: torch.Tensor  # int [B, max_blocks]
    query_start_loc: torch.Tensor  # int [B + 1]
    seq_lens: torch.Tensor  # int [B]
    out: torch.Tensor  # [T, Hq, D], query dtype
    scale: float
    causal: bool
    sliding_window: int | None
    sinks: torch.Tensor | None  # float [Hq]
    k_scale: torch.Tensor | None  # float32 [1] on the device; set iff the cache is fp8
    v_scale: torch.Tensor | None
    # Host-side bounds; None when the caller skipped validation and gave no hint.
    max_query_len: int | None
    max_seq_len: int | None
    # Every argument's shape, strides, dtype and device (and the scalars): what the
    # structural checks read, and so everything a backend's reasons may depend on.
    structure: object = None

    def with_tensors(self, query: torch.Tensor, key_cache, value_cache, out: torch.Tensor,
                     sinks: torch.Tensor | None, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> "AttentionCall":
        """This call with a layer's tensors, of the same structure (a plan's ``run``, which
        has checked that each has the planned shape, strides, dtype and device)."""
        return AttentionCall(query=query, key_cache=key_cache, value_cache=value_cache, block_table=self.block_table,
                             query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, out=out, scale=self.scale,
                             causal=self.causal, sliding_window=self.sliding_window, sinks=sinks, k_scale=k_scale,
                             v_scale=v_scale, max_query_len=self.max_query_len, max_seq_len=self.max_seq_len,
                             structure=self.structure)

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_blocks(self) -> int:
        return self.key_cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.key_cache.dtype

    @property
    def is_fp8(self) -> bool:
        return self.key_cache.dtype in FP8_DTYPES

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def packing(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(row pack, dim pack) of K and of V when either is a :class:`PackedCache`; None
        for plain strided caches."""
        return cache_packing(self.key_cache, self.value_cache)

    @property
    def key_span_bound(self) -> int:
        """Largest sequence length: the host bound (bucketed: :func:`seq_len_bucket`), else
        what the block table can hold."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return self.block_table.shape[1] * self.block_size

    @property
    def query_len_bound(self) -> int:
        return self.max_query_len if self.max_query_len is not None else self.num_tokens

    @property
    def spec(self) -> "AttentionSpec":
        return AttentionSpec(self.num_q_heads, self.num_kv_heads, self.head_dim, self.block_size, self.dtype,
                             self.cache_dtype, self.causal, self.sliding_window, self.sinks is not None)

    def planning_parts(self) -> tuple:
        """This call's part of its planning record (:mod:`dflash_rocm.planning`): the
        structure (everything the checks and a backend's reasons read; None when the call
        was built outside validation, so nothing may be kept for it), the host bounds (they
        size the launch) and the caches' 16-byte alignment (the kernels' stride unit) and
        storage sizes (AMD buffer loads: the ROCm tables' choice)."""
        k, v = memory_of(self.key_cache), memory_of(self.value_cache)
        return (self.structure, (self.max_query_len, self.max_seq_len),
                (k.data_ptr() & 15, v.data_ptr() & 15, k.untyped_storage().nbytes(), v.untyped_storage().nbytes()))

    def describe(self) -> str:
        """Every argument's shape and dtype and the scalars, one line each (errors)."""
        return describe_call(self, ("query", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens",
                                    "out", "sinks", "k_scale", "v_scale", "scale", "causal", "sliding_window",
                                    "max_query_len", "max_seq_len"))

    def summary(self) -> str:
        """A readable summary of the call's shape: logged once per distinct value."""
        parts = [f"q={dtype_name(self.dtype)}", f"kv={dtype_name(self.cache_dtype)}",
                 f"Hq={self.num_q_heads}", f"Hk={self.num_kv_heads}", f"D={self.head_dim}",
                 f"bs={self.block_size}", "causal" if self.causal else "non-causal"]
        if self.sliding_window is not None:
            parts.append(f"window={self.sliding_window}")
        if self.sinks is not None:
            parts.append("sinks")
        if self.packing is not None:
            parts.append(f"packed={self.packing}")
        parts.append(f"dev={self.device.type}")
        return " ".join(parts)
