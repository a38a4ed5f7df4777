"""The portable Triton backend: any GPU Triton targets, and CPU through the interpreter."""

from __future__ import annotations

import torch

from dflash_rocm.backend import Backend
from dflash_rocm.calls import AttentionCall, PrecomputeCall, dtype_name
from dflash_rocm.platform import Platform

from .attention import run_draft_attention
from .common import INTERPRETING
from .precompute import run_precompute

# Which fp8 cache format each AMD architecture converts in hardware (NOTES.md: MI300 is
# fnuz; gfx950 and RDNA4 are OCP e4m3fn); NVIDIA Triton has no fnuz at all.
_AMD_FP8 = {"gfx940": torch.float8_e4m3fnuz, "gfx941": torch.float8_e4m3fnuz, "gfx942": torch.float8_e4m3fnuz,
            "gfx950": torch.float8_e4m3fn, "gfx1200": torch.float8_e4m3fn, "gfx1201": torch.float8_e4m3fn}


def fp8_reason(platform: Platform, dtype: torch.dtype) -> str | None:
    """Why ``platform`` cannot hold an fp8 cache of ``dtype`` (None: it can)."""
    if platform.vendor == "cpu" or platform.simulated:
        return None  # the interpreter converts every format
    if platform.vendor == "cuda" and dtype == torch.float8_e4m3fnuz:
        return "float8_e4m3fnuz caches exist on AMD CDNA3 only"
    if platform.vendor == "cuda" and platform.arch.startswith("sm_") and int(platform.arch[3:]) < 89:
        return f"Triton's e4m3 conversions need sm_89 or newer ({platform.arch})"
    if platform.vendor == "rocm" and _AMD_FP8.get(platform.arch) != dtype:
        native = _AMD_FP8.get(platform.arch)
        return (f"{platform.arch} has no {dtype_name(dtype)} conversion"
                + (f" (it uses {dtype_name(native)})" if native else ""))
    return None


class TritonBackend(Backend):
    name = "triton"
    description = "portable Triton kernels: split-KV paged attention, fused context-KV precompute"
    MAX_HEAD_DIM = 256
    HEAD_DIM_MULTIPLE = 16
    MAX_QUERIES_PER_KV = 16

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
    def draft_attention(cls, call: AttentionCall) -> None:
        run_draft_attention(call)

    @classmethod
    def precompute(cls, call: PrecomputeCall):
        return run_precompute(call)
