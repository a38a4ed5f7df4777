"""Validated, normalised arguments of the two operations, as backends receive them.

Only :mod:`dflash_rocm.validation` builds these; a backend can rely on every shape,
dtype and device relation stated here (and, unless the caller opted out, on every
index being in range).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import ContextKVWeights

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.float8_e4m3fn: "fp8e4m3", torch.float8_e4m3fnuz: "fp8e4m3fnuz"}


# SPEC.md "What every backend guarantees": relative error against the reference.
TOLERANCES = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
FP8_TOLERANCE = 6e-2


def spec_tolerance(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> float:
    """The largest ``||out - ref|| / ||ref||`` SPEC.md allows for these dtypes."""
    return FP8_TOLERANCE if cache_dtype in FP8_DTYPES else TOLERANCES[dtype]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    diff, denom = (out - ref).norm().item(), ref.norm().item()
    return diff / denom if denom > 0 else diff


def dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else _SHORT.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True, eq=False)
class AttentionCall:
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    value_cache: torch.Tensor
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
    def key_span_bound(self) -> int:
        """Largest sequence length: the host hint, else what the block table can hold."""
        if self.max_seq_len is not None:
            return self.max_seq_len
        return self.block_table.shape[1] * self.block_size

    @property
    def query_len_bound(self) -> int:
        return self.max_query_len if self.max_query_len is not None else self.num_tokens

    def support_key(self) -> tuple:
        """Every property a backend's ``*_not_supported_reasons`` may read: dispatch caches
        its choice per key (a backend that starts reading another property adds it here)."""
        from .platform import platform_for

        contiguous = tuple(t.stride(-1) == 1 for t in (self.query, self.key_cache, self.value_cache, self.out))
        return (self.device, platform_for(self.device), self.dtype, self.cache_dtype, self.num_q_heads,
                self.num_kv_heads, self.head_dim, self.block_size, self.causal, self.sliding_window is not None,
                self.sinks is not None, self.block_table.dtype, contiguous)

    def signature(self) -> str:
        """A readable summary of the call's shape: logged once per distinct value."""
        parts = [f"q={dtype_name(self.dtype)}", f"kv={dtype_name(self.cache_dtype)}",
                 f"Hq={self.num_q_heads}", f"Hk={self.num_kv_heads}", f"D={self.head_dim}",
                 f"bs={self.block_size}", "causal" if self.causal else "non-causal"]
        if self.sliding_window is not None:
            parts.append(f"window={self.sliding_window}")
        if self.sinks is not None:
            parts.append("sinks")
        parts.append(f"dev={self.device.type}")
        return " ".join(parts)


@dataclass(frozen=True, eq=False)
class PrecomputeCall:
    states: torch.Tensor  # [N, H]
    positions: torch.Tensor  # int [N]
    weights: ContextKVWeights
    key_caches: tuple[torch.Tensor | None, ...]  # L entries, None where the layer is skipped
    value_caches: tuple[torch.Tensor | None, ...]
    slot_mappings: tuple[torch.Tensor | None, ...]  # L entries; None: do not write that layer
    k_scales: torch.Tensor | None  # float32 [L] on the device; set iff the caches are fp8
    v_scales: torch.Tensor | None
    return_kv: bool

    @property
    def num_tokens(self) -> int:
        return self.states.shape[0]

    @property
    def num_layers(self) -> int:
        return self.weights.num_layers

    @property
    def writes(self) -> bool:
        return any(s is not None for s in self.slot_mappings)

    @property
    def written_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.slot_mappings) if s is not None)

    @property
    def cache_dtype(self) -> torch.dtype | None:
        for i in self.written_layers:
            return self.key_caches[i].dtype
        return None

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype in FP8_DTYPES

    @property
    def dtype(self) -> torch.dtype:
        return self.states.dtype

    @property
    def device(self) -> torch.device:
        return self.states.device

    def support_key(self) -> tuple:
        """See :meth:`AttentionCall.support_key`."""
        from .platform import platform_for

        return (self.device, platform_for(self.device), self.dtype, self.cache_dtype, self.weights.head_dim)

    def signature(self) -> str:
        w = self.weights
        parts = [f"x={dtype_name(self.dtype)}", f"kv={dtype_name(self.cache_dtype)}",
                 f"L={w.num_layers}", f"Hk={w.num_kv_heads}", f"D={w.head_dim}", f"R={w.rotary_dim}",
                 "neox" if w.is_neox else "gptj", f"layers_written={len(self.written_layers)}"]
        if self.return_kv:
            parts.append("return_kv")
        parts.append(f"dev={self.device.type}")
        return " ".join(parts)
