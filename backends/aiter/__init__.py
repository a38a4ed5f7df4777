"""The aiter backend: aiter's CK paged varlen attention on CDNA, where it is installed and
serves the call. Attention only: the precompute is not an aiter kernel.

Tried before ``rocm`` on AMD; every call signature's first call is checked against the
rocm backend's Triton kernel and a disagreement hands that signature to it for good.
"""

from __future__ import annotations

import torch

from dflash_rocm import envs
from dflash_rocm.backend import AttentionImplementation, Backend, CallRunner, Runner
from dflash_rocm.capture import CaptureSupport
from dflash_rocm.backends.rocm import RocmAttention
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.planning import PlanningRecord, Switches
from dflash_rocm.platform import Platform

from . import attention


class CheckedAiterCall(CallRunner):
    """aiter's attention, checked against the Triton kernel on each signature's first call
    (:func:`attention.run`): a check a capture cannot run, so a signature first met inside
    a capture is served by the Triton kernel for that graph."""

    __slots__ = ()
    capture_support = CaptureSupport.AFTER_EAGER_CALL


class AiterAttention(AttentionImplementation):
    """aiter's CK paged varlen attention, with the rocm backend's plan of the same call
    behind it (the first-use check, and the calls that check hands back)."""

    @classmethod
    def not_supported_reasons(cls, call: AttentionCall, platform: Platform) -> list[str]:
        features, why = attention.installed()
        if why:
            return []  # aiter's own checks need its features: the backend's reasons say why there are none
        # the shared reasons first: CK's paged kernel reads plain pages, not ROCM_ATTN's packed ones
        return super().not_supported_reasons(call, platform) + attention.call_reasons(call, features)

    @classmethod
    def plan(cls, record: PlanningRecord, facts: AttentionCall) -> Runner:
        features, _ = attention.probe(record.switches.aiter)
        return CheckedAiterCall(attention.run, features=features, fallback=RocmAttention.plan(record, facts).run)


class AiterBackend(Backend):
    name = "aiter"
    description = "AMD CDNA: aiter's CK paged attention (checked against the Triton kernel on first use)"
    implementations = (AiterAttention,)

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform,
                                     switches: Switches) -> list[str]:
        reasons = attention.platform_reasons(platform, switches.aiter)
        if device.type != "cuda":
            reasons.append(f"aiter runs on GPU tensors only (tensors on {device.type})")
        return reasons

    @classmethod
    def status(cls) -> dict[str, str]:
        features, why = attention.probe(envs.AITER.setting())
        if why:
            return {"aiter": why}
        return {"aiter": "usable (paged CK attention" + (", sinks" if features.sinks else ", no sinks") + ")"}
