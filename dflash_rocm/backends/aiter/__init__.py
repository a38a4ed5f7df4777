"""The aiter backend: aiter's CK paged varlen attention on CDNA, where it is installed and
serves the call. Attention only: the precompute is not an aiter kernel.

Tried before ``rocm`` on AMD; every call signature's first call is checked against the
rocm backend's Triton kernel and a disagreement hands that signature to it for good.
"""

from __future__ import annotations

import torch

from dflash_rocm.backend import Backend
from dflash_rocm.backends.rocm import RocmBackend
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.platform import Platform, platform_for

from . import attention


class AiterBackend(Backend):
    name = "aiter"
    description = "AMD CDNA: aiter's CK paged attention (checked against the Triton kernel on first use)"
    OPS = frozenset({"draft_attention"})

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform) -> list[str]:
        reasons = attention.platform_reasons(platform)
        if device.type != "cuda":
            reasons.append(f"aiter runs on GPU tensors only (tensors on {device.type})")
        return reasons

    @classmethod
    def attention_not_supported_reasons(cls, call: AttentionCall) -> list[str]:
        reasons = cls.device_not_supported_reasons(call.device, platform_for(call.device))
        return reasons or attention.call_reasons(call)

    @classmethod
    def draft_attention(cls, call: AttentionCall) -> None:
        attention.run(call, RocmBackend.draft_attention)

    @classmethod
    def status(cls) -> dict[str, str]:
        features, why = attention.probe()
        if why:
            return {"aiter": why}
        return {"aiter": "usable (paged CK attention" + (", sinks" if features.sinks else ", no sinks") + ")"}

