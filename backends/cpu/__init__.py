"""The CPU backend: meant to serve (vLLM on CPU), not to check (that is the reference).

Native-dtype pages and torch's CPU flash-attention kernel for the draft attention; one
GEMM for every layer and a short float32 epilogue for the precompute (see each module).
``auto`` takes it for CPU tensors; it refuses every other device.
"""

from __future__ import annotations

import torch

from dflash_rocm.backend import AttentionImplementation, Backend, PrecomputeImplementation
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.planning import Switches
from dflash_rocm.platform import Platform

from .attention import run_draft_attention
from .precompute import run_precompute


class CpuAttention(AttentionImplementation):
    """torch's CPU flash-attention kernel over the gathered pages."""

    @classmethod
    def run(cls, call: AttentionCall) -> None:
        run_draft_attention(call)


class CpuPrecompute(PrecomputeImplementation):
    """One GEMM for every layer and a vectorised float32 epilogue (fp8 rows: a dense copy
    of their dequantized rows, derived once)."""

    WEIGHT_FP8_DTYPES = FP8_DTYPES

    @classmethod
    def run(cls, call: PrecomputeCall):
        return run_precompute(call)


class CpuBackend(Backend):
    name = "cpu"
    description = "CPU: torch's flash-attention kernel over gathered pages; one GEMM and a vectorised epilogue"
    implementations = (CpuAttention, CpuPrecompute)

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform,
                                     switches: Switches) -> list[str]:
        if device.type != "cpu":
            return [f"serves CPU tensors only (these are on {device.type})"]
        return []
