"""What a backend is, in the style of xformers' ``ops/fmha``: one implementation class per
(backend, op), and one small per-backend object for what is not per op.

An :class:`Implementation` serves one op. It declares what it supports in class
attributes, turns them (and its own limits) into human-readable reasons in
:meth:`~Implementation.not_supported_reasons` (an empty list: it can serve the call), and
:meth:`~Implementation.plan` does the host work for every call of one structure once
(launch configuration, compiled launches, scratch sizes, the split-merge decision) from
the call's planning record (:mod:`dflash_rocm.planning`), returning the :class:`Runner`
of such calls. Dispatch keeps that runner in its one plan cache, keyed by the record.

A :class:`Backend` names its implementations (one per op it serves: a backend without
an implementation of an op is never chosen for it), says what it needs of the device
(:meth:`~Backend.device_not_supported_reasons`: no GPU, library missing) and carries the
hooks the tools above talk to without importing its internals: :meth:`~Backend.configure`
passes what a serving engine knows, :meth:`~Backend.warm_up` does startup work for a
layer's call spec, :meth:`~Backend.tune` runs its tuner by hand, :meth:`~Backend.status`
reports its state for ``info``.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from .capture import CaptureSupport
from .contract import FP8_DTYPES, QUERY_DTYPES, dtype_name
from .ops import ATTENTION, PRECOMPUTE, Op
from .ops.attention import AttentionCall
from .ops.precompute import PrecomputeCall
from .planning import SETTINGS, PlanningRecord, Switches
from .platform import Platform

__all__ = ["SETTINGS", "Runner", "CallRunner", "Implementation", "AttentionImplementation",
           "PrecomputeImplementation", "Backend"]


class Runner:
    """What a plan is: it runs every call of the planned structure (``run(call)``: the
    op's result). One type for every backend, so dispatch and the tools above handle any
    plan the same way.

    Every runner class declares :attr:`capture_support` itself (a class attribute, not
    derived: ``tests/test_capture.py`` refuses a runner without one): whether its runs may
    be recorded into a CUDA graph, and what a capture may keep of what its first call
    makes (:class:`~dflash_rocm.capture.CaptureSupport`). Dispatch applies it when a
    capture asks for a call structure it holds no plan for."""

    __slots__ = ()
    capture_support: ClassVar[CaptureSupport]

    def run(self, call) -> Any:
        raise NotImplementedError


class CallRunner(Runner):
    """A runner that passes each call to one function (with keywords fixed by the plan):
    what :meth:`Implementation.plan` returns by default. It knows nothing of what the
    function reads (the reference and cpu backends read the call's tensors on the host),
    so it is never captured; a backend whose function may be subclasses it and declares so."""

    __slots__ = ("fn", "kwargs")
    capture_support = CaptureSupport.NEVER

    def __init__(self, fn: Callable[..., Any], **kwargs: Any):
        self.fn, self.kwargs = fn, kwargs

    def run(self, call) -> Any:
        return self.fn(call, **self.kwargs)

    def __repr__(self) -> str:
        return f"CallRunner({getattr(self.fn, '__qualname__', self.fn)!r})"


class Implementation:
    """One backend's implementation of one op (subclass :class:`AttentionImplementation`
    or :class:`PrecomputeImplementation`)."""

    op: ClassVar[Op]
    QUERY_DTYPES: ClassVar[tuple[torch.dtype, ...]] = QUERY_DTYPES
    FP8_CACHE_DTYPES: ClassVar[tuple[torch.dtype, ...]] = FP8_DTYPES
    MAX_HEAD_DIM: ClassVar[int | None] = None
    HEAD_DIM_MULTIPLE: ClassVar[int] = 1
    SUPPORTS_PACKED_CACHES: ClassVar[bool] = False  # dflash_rocm.PackedCache (vLLM's ROCM_ATTN layout)

    @classmethod
    def not_supported_reasons(cls, call, platform: Platform) -> list[str]:
        """Why this implementation cannot serve ``call`` on ``platform`` (empty: it can),
        beyond the backend's device reasons, which come first."""
        raise NotImplementedError

    @classmethod
    def plan(cls, record: PlanningRecord, facts: Any) -> Runner:
        """The host work for every call with this planning record, done once: returns the
        :class:`Runner` dispatch then hands every call with an equal record. ``record``
        holds everything a plan may read (:mod:`dflash_rocm.planning`), ``facts`` the
        call's facts (the call with every tensor replaced by what the record holds of it);
        read nothing else (no environment, settings or global flags: put what a plan needs
        in the record; :mod:`dflash_rocm.process` declares the only exceptions). The
        default keeps nothing but :meth:`run`."""
        return CallRunner(cls.run)

    @classmethod
    def run(cls, call) -> Any:
        """Run one call (what the default :meth:`plan` returns)."""
        raise NotImplementedError

    # -- hooks per op (reached through Backend.warm_up and Backend.tune) -------------------
    @classmethod
    def warm_up(cls, spec: Any, device: torch.device) -> None:
        """Startup work for a layer about to be served with ``spec``, this op's spec (default: none)."""

    @classmethod
    def tune(cls, spec: Any, device: torch.device, *, progress: Callable[[int, int, Any], None] | None = None):
        """Run this implementation's tuner for ``spec`` now and return its table; None
        when it has no tuner (the default)."""
        return None

    @classmethod
    def fp8_cache_reasons(cls, cache_dtype: torch.dtype, platform: Platform) -> list[str]:
        """Why this implementation cannot read/write an fp8 cache of ``cache_dtype`` on ``platform``."""
        if cache_dtype not in cls.FP8_CACHE_DTYPES:
            return [f"fp8 cache dtype {dtype_name(cache_dtype)} not supported"]
        return []

    @classmethod
    def common_reasons(cls, platform: Platform, dtype: torch.dtype, cache_dtype: torch.dtype | None,
                       head_dim: int, packing, what: str) -> list[str]:
        """The reasons every op shares: input dtype, fp8 cache, head dim, packed pages."""
        reasons = []
        if dtype not in cls.QUERY_DTYPES:
            reasons.append(f"{what} dtype {dtype_name(dtype)} not supported")
        if cache_dtype in FP8_DTYPES:
            reasons += cls.fp8_cache_reasons(cache_dtype, platform)
        if cls.MAX_HEAD_DIM is not None and head_dim > cls.MAX_HEAD_DIM:
            reasons.append(f"head_dim {head_dim} > {cls.MAX_HEAD_DIM}")
        elif head_dim % cls.HEAD_DIM_MULTIPLE:
            reasons.append(f"head_dim {head_dim} is not a multiple of {cls.HEAD_DIM_MULTIPLE}")
        if packing is not None and not cls.SUPPORTS_PACKED_CACHES:
            reasons.append(f"packed cache pages (row/dim packing of K, V: {packing}) not supported")
        return reasons


class AttentionImplementation(Implementation):
    """An implementation of ``draft_attention``: writes ``call.out``."""

    op = ATTENTION
    MAX_QUERIES_PER_KV: ClassVar[int | None] = None
    SUPPORTS_SINKS: ClassVar[bool] = True
    SUPPORTS_SLIDING_WINDOW: ClassVar[bool] = True

    @classmethod
    def not_supported_reasons(cls, call: AttentionCall, platform: Platform) -> list[str]:
        reasons = cls.common_reasons(platform, call.dtype, call.cache_dtype, call.head_dim, call.packing, "query")
        if cls.MAX_QUERIES_PER_KV is not None and call.num_queries_per_kv > cls.MAX_QUERIES_PER_KV:
            reasons.append(f"GQA ratio {call.num_queries_per_kv} > {cls.MAX_QUERIES_PER_KV}")
        if call.sinks is not None and not cls.SUPPORTS_SINKS:
            reasons.append("attention sinks not supported")
        if call.sliding_window is not None and not cls.SUPPORTS_SLIDING_WINDOW:
            reasons.append("sliding window not supported")
        return reasons


class PrecomputeImplementation(Implementation):
    """An implementation of ``precompute_and_store_context_kv``: writes the caches and
    returns ``(k, v)`` iff ``call.return_kv``."""

    op = PRECOMPUTE
    # The fp8 formats of quantized K/V rows (ContextKVWeights.kv_weight_scale) the
    # implementation reads; none: it serves float rows only.
    WEIGHT_FP8_DTYPES: ClassVar[tuple[torch.dtype, ...]] = ()

    @classmethod
    def not_supported_reasons(cls, call: PrecomputeCall, platform: Platform) -> list[str]:
        reasons = cls.common_reasons(platform, call.dtype, call.cache_dtype, call.weights.head_dim, call.packing,
                                     "context_states")
        if call.weights.quantized:
            reasons += cls.weight_reasons(call.weights.dtype, platform)
        return reasons

    @classmethod
    def weight_reasons(cls, weight_dtype: torch.dtype, platform: Platform) -> list[str]:
        """Why fp8 K/V rows of ``weight_dtype`` are not read here (empty: they are)."""
        if weight_dtype in cls.WEIGHT_FP8_DTYPES:
            return []
        return [f"{dtype_name(weight_dtype)} K/V weights (kv_weight_scale) not supported: dequantize them to "
                "float rows for this backend"]

    @classmethod
    def slower_weight_reasons(cls, weight_dtype: torch.dtype, platform: Platform) -> list[str]:
        """Why rows of ``weight_dtype``, though read (:meth:`weight_reasons` empty), are
        slower here than dense float rows (empty: they are not). A cost, not a capability:
        calls with such rows are served; whoever chooses the rows to hold (the vLLM plugin)
        holds dense ones instead."""
        return []


class Backend:
    """A backend: its implementations, what it needs of the device, its hooks."""

    name: ClassVar[str] = "?"
    description: ClassVar[str] = ""
    implementations: ClassVar[tuple[type[Implementation], ...]] = ()  # at most one per op

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        ops = [impl.op.name for impl in cls.implementations]
        if len(set(ops)) != len(ops):
            raise TypeError(f"{cls.__name__}: one implementation per op (got {ops})")

    @classmethod
    def implementation(cls, op: Op) -> type[Implementation] | None:
        """This backend's implementation of ``op`` (None: it does not implement it)."""
        for impl in cls.implementations:
            if impl.op is op:
                return impl
        return None

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform,
                                     switches: Switches) -> list[str]:
        """Reasons that hold for every call on ``device`` (no GPU, library missing)."""
        return []

    @classmethod
    def not_supported_reasons(cls, op: Op, call, platform: Platform, switches: Switches) -> list[str]:
        """Why this backend cannot serve ``call`` of ``op`` on ``platform`` under the planning
        ``switches`` (empty: it can): the device's reasons first (what a user can act on),
        then the implementation's (every one, so that ``explain`` says all a user would have
        to change)."""
        reasons = cls.device_not_supported_reasons(call.device, platform, switches)
        impl = cls.implementation(op)
        if impl is None:
            return reasons + [f"does not implement {op.name}"]
        return reasons + impl.not_supported_reasons(call, platform)

    # -- hooks for the tools above ---------------------------------------------------------
    @classmethod
    def configure(cls, **settings: Any) -> None:
        """What a serving engine knows (names in ``SETTINGS``); ignored unless used."""

    @classmethod
    def warm_up(cls, op: Op, spec: Any, device: torch.device) -> None:
        """Startup work for a layer about to be served with ``spec`` (the op's spec: an
        :class:`~dflash_rocm.ops.attention.AttentionSpec` for attention): this backend's
        implementation of ``op`` does it (:meth:`Implementation.warm_up`); none, nothing.
        Raises only for bugs; an optimisation that fails is logged and skipped."""
        impl = cls.implementation(op)
        if impl is not None:
            impl.warm_up(spec, device)

    @classmethod
    def tune(cls, op: Op, spec: Any, device: torch.device, *,
             progress: Callable[[int, int, Any], None] | None = None):
        """Run the tuner of this backend's implementation of ``op`` for ``spec`` now and
        return its table (:meth:`Implementation.tune`); None when it has none."""
        impl = cls.implementation(op)
        return None if impl is None else impl.tune(spec, device, progress=progress)

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
