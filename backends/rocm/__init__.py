"""The ROCm backend: the Triton kernels launched from per-architecture tables, startup
tuning (on by default for RDNA) and a query limit. aiter is a backend of its own
(``backends/aiter``), tried before this one on ROCm."""

from __future__ import annotations

import logging

import torch

from dflash_rocm.backend import Backend, Runner
from dflash_rocm.capture import CaptureSupport
from dflash_rocm.backends.triton import INTERPRETING, TritonAttention, TritonPrecompute
from dflash_rocm.backends.triton.attention import AttentionPlan, attention_runner, plan_attention
from dflash_rocm.backends.triton.launcher import prelude_seconds
from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
from dflash_rocm.ops.attention import AttentionCall, AttentionSpec
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.paged import memory_of
from dflash_rocm.planning import PlanningRecord, Switches
from dflash_rocm.platform import Platform, platform_for
from dflash_rocm.tuning import cache_dir

from . import settings, tables, tuner

logger = logging.getLogger("dflash_rocm")
BUFFER_LOAD_BYTES = 2 ** 31 - 1  # AMD buffer (32-bit offset) loads: tensors up to this size (the launcher's test)


def attention_workload(call: AttentionCall, platform: Platform) -> tables.AttentionWorkload:
    """The table's view of ``call`` (or its facts: the caches' storage sizes are in the
    planning record) on ``platform``."""
    span = call.key_span_bound
    if call.sliding_window is not None:  # keys outside the window never load
        span = min(span, call.sliding_window + call.query_len_bound - 1)
    caches = (call.key_cache, call.value_cache)
    small = all(memory_of(c).untyped_storage().nbytes() <= BUFFER_LOAD_BYTES for c in caches)
    return tables.AttentionWorkload(platform.arch, call.num_seqs, call.query_len_bound, span, call.num_q_heads,
                                    call.num_kv_heads, call.head_dim, call.is_fp8, platform.compute_units,
                                    buffer_loads=small)


def table_choice(record: PlanningRecord, call: AttentionCall) -> tuple[str, AttentionLaunchConfig]:
    """(the table's rule, or ``unsegmented`` past the query limit; config) of the
    attention call ``record`` plans (``call``: its facts)."""
    return tables.attention_config(attention_workload(call, record.platform), settings.planned_query_limit(record))


def attention_choice(record: PlanningRecord, call: AttentionCall) -> tuple[str, AttentionLaunchConfig]:
    """(where it came from, config): the table's rule, ``unsegmented`` past the query
    limit, or ``tuned`` when startup tuning (``warm_up``, ``dflash-rocm tune``: never a
    plan) found a clear winner for this workload under the record's engine settings and
    cache directory (the tuned tables' generation is part of the record)."""
    platform = record.platform
    name, config = table_choice(record, call)
    if name != "unsegmented" and settings.tuning_on(record.switches.tune, platform):
        w = attention_workload(call, platform)
        tuned = tuner.tuned_config(tuner.planned_key(record, call.spec), w.batch, w.query_len, w.key_span)
        if tuned is not None:
            return "tuned", tuned
    return name, config


def precompute_choice(record: PlanningRecord, call: PrecomputeCall) -> PrecomputeLaunchConfig:
    """The ROCm table's precompute configuration for the call ``record`` plans (``call``:
    its facts)."""
    platform = record.platform
    w = call.weights
    return tables.precompute_config(platform.arch, num_tokens=call.num_tokens, hidden=w.hidden_size,
                                    num_heads_total=2 * w.num_layers * w.num_kv_heads, head_dim=w.head_dim,
                                    compute_units=platform.compute_units)


class TunedAttention(Runner):
    """A plan under a tuned configuration, with the table's behind it: a tuned config that
    fails to launch (a stale or crafted entry that passed the checks but does not compile
    here) is dropped for this process with a warning, and the call and every later one run
    under the table's configuration: the tuner must never fail a call. Rerunning is safe,
    the kernels write only ``out``. Its plan's scratch is made on a stream's first call."""

    __slots__ = ("plan", "tuned", "record", "facts")
    capture_support = CaptureSupport.AFTER_EAGER_CALL

    def __init__(self, plan: AttentionPlan, record: PlanningRecord, facts: AttentionCall):
        self.plan, self.tuned, self.record, self.facts = plan, True, record, facts

    def run(self, call: AttentionCall) -> None:
        if not self.tuned:
            self.plan.run(call)
            return
        try:
            self.plan.run(call)
        except Exception as exc:  # any launch failure of a tuned config
            logger.warning("tuned launch config %s failed (%s: %s); dropped, using the table's config",
                           self.plan.config, type(exc).__name__, exc)
            tuner.forget_config(tuner.planned_key(self.record, call.spec), call.spec, self.plan.config)
            self.tuned = False
            self.plan = plan_attention(self.record, self.facts, table_choice(self.record, self.facts)[1])
            self.plan.run(call)


class RocmAttention(TritonAttention):
    """The Triton attention kernel under the architecture's table (or a tuned config);
    startup tuning (``DFLASH_ROCM_TUNE``; on by default for RDNA) as its warm-up."""

    @classmethod
    def plan(cls, record: PlanningRecord, facts: AttentionCall) -> Runner:
        source, config = attention_choice(record, facts)
        if source == "tuned" and facts.num_tokens:
            return TunedAttention(plan_attention(record, facts, config), record, facts)
        return attention_runner(record, facts, config)

    @classmethod
    def warm_up(cls, spec: AttentionSpec, device: torch.device) -> None:
        platform = platform_for(device)
        if platform.vendor == "rocm" and settings.tuning_enabled(platform):
            tuner.tune_attention(platform, spec, device)

    @classmethod
    def tune(cls, spec: AttentionSpec, device: torch.device, *, progress=None):
        return tuner.tune_attention(platform_for(device), spec, device, progress=progress)


class RocmPrecompute(TritonPrecompute):
    """The fused context-KV kernel under the architecture's table."""

    @classmethod
    def launch_config(cls, record: PlanningRecord, facts: PrecomputeCall) -> PrecomputeLaunchConfig:
        return precompute_choice(record, facts)


class RocmBackend(Backend):
    """The Triton backend's kernels and limits, launched the AMD way."""

    name = "rocm"
    description = "AMD: Triton kernels with per-architecture tables and startup tuning"
    implementations = (RocmAttention, RocmPrecompute)

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform,
                                     switches: Switches) -> list[str]:
        if platform.vendor != "rocm":
            return [f"needs an AMD GPU with ROCm torch (tensors on {device.type}, platform {platform.vendor})"]
        if platform.arch not in tables.SUPPORTED_ARCHS:
            return [f"no launch table for {platform.arch} (tables: {', '.join(tables.SUPPORTED_ARCHS)}); "
                    "the triton backend serves it"]
        if device.type == "cpu" and not INTERPRETING:
            return ["a simulated AMD platform runs on CPU tensors only through the Triton interpreter"]
        if device.type == "cuda" and INTERPRETING:
            return ["TRITON_INTERPRET=1 is set, so Triton cannot compile for the GPU"]
        return []

    # -- hooks -----------------------------------------------------------------------------
    @classmethod
    def status(cls) -> dict[str, str]:
        limit = settings.query_limit()
        return {"rocm query limit": "none (8192)" if limit is None else str(limit),
                "rocm tuning cache": str(cache_dir())}

    @classmethod
    def launch_overhead(cls, launch, arch: str) -> tuple[float, float] | None:
        return prelude_seconds(launch, arch)
