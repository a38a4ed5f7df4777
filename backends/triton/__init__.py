"""The portable Triton backend: any GPU Triton targets, and CPU through the interpreter."""

from __future__ import annotations

import torch

from dflash_rocm.backend import AttentionImplementation, Backend, PrecomputeImplementation, Runner
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.planning import PlanningRecord, Switches
from dflash_rocm.platform import Platform

from .attention import attention_config_for, attention_runner
from .common import INTERPRETING
from .launcher import prelude_seconds
from .launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
from .precompute import MAX_NOPE_LAYER, precompute_config_for, precompute_runner
from .weight_formats import fp8_rows_slower


def fp8_reason(platform: Platform, dtype: torch.dtype) -> str | None:
    """Why ``platform`` cannot hold an fp8 cache of ``dtype`` (None: it can). The
    interpreter (CPU, simulated architectures included) converts every format."""
    if platform.vendor == "cpu" or platform.simulated or platform.arch_info is None:
        return None
    return platform.arch_info.fp8_reason(dtype)


class TritonLimits:
    """What the Triton kernels of both ops support (mixed into their implementations)."""

    MAX_HEAD_DIM = 256
    HEAD_DIM_MULTIPLE = 16
    SUPPORTS_PACKED_CACHES = True  # the kernels address dflash_rocm.PackedCache pages in place

    @classmethod
    def fp8_cache_reasons(cls, cache_dtype: torch.dtype, platform: Platform) -> list[str]:
        why = fp8_reason(platform, cache_dtype)
        return super().fp8_cache_reasons(cache_dtype, platform) + ([why] if why else [])


class TritonAttention(TritonLimits, AttentionImplementation):
    """The split-KV paged attention kernel, configured by the portable table."""

    MAX_QUERIES_PER_KV = 16

    @classmethod
    def launch_config(cls, record: PlanningRecord, facts: AttentionCall) -> AttentionLaunchConfig:
        return attention_config_for(facts, record.platform)

    @classmethod
    def plan(cls, record: PlanningRecord, facts: AttentionCall) -> Runner:
        return attention_runner(record, facts, cls.launch_config(record, facts))


class TritonPrecompute(TritonLimits, PrecomputeImplementation):
    """The fused context-KV kernel, configured by the portable table; fp8 rows are read as
    they are (``FP8_WEIGHTS``) where the platform converts their format."""

    WEIGHT_FP8_DTYPES = FP8_DTYPES

    @classmethod
    def weight_reasons(cls, weight_dtype: torch.dtype, platform: Platform) -> list[str]:
        why = fp8_reason(platform, weight_dtype)
        return super().weight_reasons(weight_dtype, platform) + ([f"fp8 K/V weights: {why}"] if why else [])

    @classmethod
    def slower_weight_reasons(cls, weight_dtype: torch.dtype, platform: Platform) -> list[str]:
        """fp8 rows where the kernel reading them is modelled slower than bf16 rows
        (:func:`.weight_formats.fp8_rows_slower`)."""
        why = fp8_rows_slower(platform) if weight_dtype in cls.WEIGHT_FP8_DTYPES else None
        return super().slower_weight_reasons(weight_dtype, platform) + ([why] if why else [])

    @classmethod
    def not_supported_reasons(cls, call: PrecomputeCall, platform: Platform) -> list[str]:
        reasons = super().not_supported_reasons(call, platform)
        past = [layer for layer in call.weights.nope_layers if layer > MAX_NOPE_LAYER]
        if past:
            reasons.append(f"NoPE layers past layer {MAX_NOPE_LAYER} (rope_layers is False at {past}): the kernel "
                           "keeps the NoPE layers as the bits of one int64 constant")
        return reasons

    @classmethod
    def launch_config(cls, record: PlanningRecord, facts: PrecomputeCall) -> PrecomputeLaunchConfig:
        return precompute_config_for(facts, record.platform)

    @classmethod
    def plan(cls, record: PlanningRecord, facts: PrecomputeCall) -> Runner:
        return precompute_runner(record, facts, cls.launch_config(record, facts))


def triton_device_reasons(device: torch.device) -> list[str]:
    """Whether Triton can run kernels on ``device`` as this process is set up."""
    if device.type == "cpu":
        if not INTERPRETING:
            return ["CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing dflash_rocm"]
        return []
    if device.type != "cuda":
        return [f"no Triton target for {device.type} tensors"]
    if INTERPRETING:
        return ["TRITON_INTERPRET=1 is set, so Triton cannot compile for the GPU"]
    return []


class TritonBackend(Backend):
    name = "triton"
    description = "portable Triton kernels: split-KV paged attention, fused context-KV precompute"
    implementations = (TritonAttention, TritonPrecompute)

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform,
                                     switches: Switches) -> list[str]:
        return triton_device_reasons(device)

    @classmethod
    def launch_overhead(cls, launch, arch: str) -> tuple[float, float] | None:
        return prelude_seconds(launch, arch)
