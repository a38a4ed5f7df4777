"""The interface every backend implements, in the style of xformers' ``ops/fmha``.

A backend declares which ops it implements (``OPS``) and what it supports in class
attributes; the generic checks below turn those into human-readable reasons, and a
backend adds its own (device, missing library, kernel limits) by extending
``*_not_supported_reasons``. An empty list means "I can serve this call". Dispatch
never calls a backend that gave a reason; not implementing an op is a reason too.

Hooks let the tools above (CLI, bench, the vLLM plugin) talk to a backend without
importing its internals: :meth:`configure` passes what a serving engine knows,
:meth:`warm_up` does startup work for a layer's call spec, :meth:`tune` runs a backend's
tuner by hand, :meth:`status` reports backend-specific state for ``info``.
"""

from __future__ import annotations

import functools

from typing import Any, Callable, ClassVar

import torch

from .contract import FP8_DTYPES, QUERY_DTYPES, dtype_name
from .ops import Op
from .ops.attention import AttentionCall, AttentionSpec
from .ops.precompute import PrecomputeCall
from .platform import Platform, platform_for

# What serving engines pass to :meth:`Backend.configure` (a backend ignores what it does not use).
SETTINGS = ("query_limit", "batch_limit", "max_model_len", "layer_causal")


class Backend:
    name: ClassVar[str] = "?"
    description: ClassVar[str] = ""
    OPS: ClassVar[frozenset[str]] = frozenset({"draft_attention", "precompute_and_store_context_kv"})

    QUERY_DTYPES: ClassVar[tuple[torch.dtype, ...]] = QUERY_DTYPES
    FP8_CACHE_DTYPES: ClassVar[tuple[torch.dtype, ...]] = FP8_DTYPES
    MAX_HEAD_DIM: ClassVar[int | None] = None
    HEAD_DIM_MULTIPLE: ClassVar[int] = 1
    MAX_QUERIES_PER_KV: ClassVar[int | None] = None
    SUPPORTS_SINKS: ClassVar[bool] = True
    SUPPORTS_SLIDING_WINDOW: ClassVar[bool] = True
    SUPPORTS_PACKED_CACHES: ClassVar[bool] = False  # dflash_rocm.PackedCache (vLLM's ROCM_ATTN layout)

    # -- what it supports ------------------------------------------------------------------
    @classmethod
    def not_supported_reasons(cls, op: Op, call) -> list[str]:
        """Why this backend cannot serve ``call`` of ``op`` (empty: it can)."""
        if op.name not in cls.OPS:  # device reasons first: they are what a user can act on
            return cls.device_not_supported_reasons(call.device, platform_for(call.device)) + [
                f"does not implement {op.name}"]
        return getattr(cls, op.reasons_method)(call)

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform) -> list[str]:
        """Reasons that hold for every call on ``device`` (no GPU, library missing)."""
        return []

    @classmethod
    def fp8_cache_reasons(cls, cache_dtype: torch.dtype, platform: Platform) -> list[str]:
        """Why this backend cannot read/write an fp8 cache of ``cache_dtype`` on ``platform``."""
        if cache_dtype not in cls.FP8_CACHE_DTYPES:
            return [f"fp8 cache dtype {dtype_name(cache_dtype)} not supported"]
        return []

    @classmethod
    def _common_reasons(cls, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype | None,
                        head_dim: int, what: str) -> list[str]:
        platform = platform_for(device)
        reasons = cls.device_not_supported_reasons(device, platform)
        if dtype not in cls.QUERY_DTYPES:
            reasons.append(f"{what} dtype {dtype_name(dtype)} not supported")
        if cache_dtype in FP8_DTYPES:
            reasons += cls.fp8_cache_reasons(cache_dtype, platform)
        return reasons + cls._head_dim_reasons(head_dim)

    @classmethod
    def attention_not_supported_reasons(cls, call: AttentionCall) -> list[str]:
        reasons = cls._common_reasons(call.device, call.dtype, call.cache_dtype, call.head_dim, "query")
        if cls.MAX_QUERIES_PER_KV is not None and call.num_queries_per_kv > cls.MAX_QUERIES_PER_KV:
            reasons.append(f"GQA ratio {call.num_queries_per_kv} > {cls.MAX_QUERIES_PER_KV}")
        if call.sinks is not None and not cls.SUPPORTS_SINKS:
            reasons.append("attention sinks not supported")
        if call.sliding_window is not None and not cls.SUPPORTS_SLIDING_WINDOW:
            reasons.append("sliding window not supported")
        return reasons + cls._packing_reasons(call.packing)

    @classmethod
    def precompute_not_supported_reasons(cls, call: PrecomputeCall) -> list[str]:
        return cls._common_reasons(call.device, call.dtype, call.cache_dtype, call.weights.head_dim,
                                   "context_states") + cls._packing_reasons(call.packing)

    @classmethod
    def _packing_reasons(cls, packing) -> list[str]:
        if packing is not None and not cls.SUPPORTS_PACKED_CACHES:
            return [f"packed cache pages (row/dim packing of K, V: {packing}) not supported"]
        return []

    @classmethod
    def _head_dim_reasons(cls, head_dim: int) -> list[str]:
        if cls.MAX_HEAD_DIM is not None and head_dim > cls.MAX_HEAD_DIM:
            return [f"head_dim {head_dim} > {cls.MAX_HEAD_DIM}"]
        if head_dim % cls.HEAD_DIM_MULTIPLE:
            return [f"head_dim {head_dim} is not a multiple of {cls.HEAD_DIM_MULTIPLE}"]
        return []

    # -- running ---------------------------------------------------------------------------
    @classmethod
    def run(cls, op: Op, call):
        return getattr(cls, op.run_method)(call)

    @classmethod
    def plan(cls, op: Op, call) -> Callable[[Any], Any]:
        """Host work for every call of ``call``'s structure and batch, done once (launch
        configuration, lookups): returns what runs one such call. :mod:`dflash_rocm.plan`
        hands it calls that differ from ``call`` only in tensors of the same layout. The
        default keeps nothing."""
        return functools.partial(cls.run, op)

    # -- hooks for the tools above ---------------------------------------------------------
    @classmethod
    def configure(cls, **settings: Any) -> None:
        """What a serving engine knows (names in ``SETTINGS``); ignored unless used."""

    @classmethod
    def warm_up(cls, op: Op, spec: AttentionSpec, device: torch.device) -> None:
        """Startup work for a layer about to be served with ``spec`` (default: none).
        Raises only for bugs; an optimisation that fails is logged and skipped."""

    @classmethod
    def tune(cls, op: Op, spec: AttentionSpec, device: torch.device, *,
             progress: Callable[[int, int, Any], None] | None = None):
        """Run this backend's tuner for ``spec`` now and return its table; None when
        this backend has no tuner."""
        return None

    @classmethod
    def status(cls) -> dict[str, str]:
        """Backend-specific facts for ``dflash-rocm info`` (label -> text)."""
        return {}

    @classmethod
    def launch_overhead(cls, launch, arch: str) -> tuple[float, float] | None:
        """Seconds the host spends on one captured launch (:mod:`dflash_rocm.launches`)
        before the driver call, for a GPU of ``arch``: through the compiler's generic entry
        and through this backend's hot path. None: this backend cannot say (``bench --host``
        then counts the launch as free)."""
        return None
