"""The portable Triton backend: any GPU Triton targets, and CPU through the interpreter."""

from __future__ import annotations

import functools

import torch

from dflash_rocm.backend import Backend
from dflash_rocm.ops import ATTENTION, Op
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.platform import Platform

from .attention import PlannedAttention, attention_config_for, run_draft_attention
from .common import INTERPRETING
from .launch import prelude_seconds
from .precompute import MAX_NOPE_LAYER, precompute_config_for, run_precompute


def fp8_reason(platform: Platform, dtype: torch.dtype) -> str | None:
    """Why ``platform`` cannot hold an fp8 cache of ``dtype`` (None: it can). The
    interpreter (CPU, simulated architectures included) converts every format."""
    if platform.vendor == "cpu" or platform.simulated or platform.arch_info is None:
        return None
    return platform.arch_info.fp8_reason(dtype)


class TritonBackend(Backend):
    name = "triton"
    description = "portable Triton kernels: split-KV paged attention, fused context-KV precompute"
    MAX_HEAD_DIM = 256
    HEAD_DIM_MULTIPLE = 16
    MAX_QUERIES_PER_KV = 16
    SUPPORTS_PACKED_CACHES = True  # kernels address dflash_rocm.PackedCache pages in place

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform) -> list[str]:
        if device.type == "cpu":
            if not INTERPRETING:
                return ["CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before importing dflash_rocm"]
            return []
        if device.type != "cuda":
            return [f"no Triton target for {device.type} tensors"]
        if INTERPRETING:
            return ["TRITON_INTERPRET=1 is set, so Triton cannot compile for the GPU"]
        return []

    @classmethod
    def fp8_cache_reasons(cls, cache_dtype: torch.dtype, platform: Platform) -> list[str]:
        why = fp8_reason(platform, cache_dtype)
        return super().fp8_cache_reasons(cache_dtype, platform) + ([why] if why else [])

    @classmethod
    def precompute_not_supported_reasons(cls, call: PrecomputeCall) -> list[str]:
        reasons = super().precompute_not_supported_reasons(call)
        past = [layer for layer in call.weights.nope_layers if layer > MAX_NOPE_LAYER]
        if past:
            reasons.append(f"NoPE layers past layer {MAX_NOPE_LAYER} (rope_layers is False at {past}): the kernel "
                           "keeps the NoPE layers as the bits of one int64 constant")
        return reasons

    @classmethod
    def draft_attention(cls, call: AttentionCall) -> None:
        run_draft_attention(call)

    @classmethod
    def precompute(cls, call: PrecomputeCall):
        return run_precompute(call)

    @classmethod
    def plan(cls, op: Op, call):
        # The launch configuration depends on the call's structure alone (batch bounds included).
        if op is ATTENTION:
            return PlannedAttention(attention_config_for(call))
        return functools.partial(run_precompute, config=precompute_config_for(call))

    @classmethod
    def launch_overhead(cls, launch, arch: str) -> tuple[float, float] | None:
        return prelude_seconds(launch, arch)
