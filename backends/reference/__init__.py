"""The reference backend: the op packages' plain-torch references, float32, any device.

It is the oracle every other backend is tested against, so it favours obviousness over
speed; ``auto`` takes it only when nothing else serves.
"""

from __future__ import annotations

from dflash_rocm.backend import AttentionImplementation, Backend, PrecomputeImplementation
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.ops import attention, precompute


class ReferenceAttention(AttentionImplementation):
    SUPPORTS_PACKED_CACHES = True

    @classmethod
    def run(cls, call: attention.AttentionCall) -> None:
        attention.reference(call)


class ReferencePrecompute(PrecomputeImplementation):
    SUPPORTS_PACKED_CACHES = True
    WEIGHT_FP8_DTYPES = FP8_DTYPES

    @classmethod
    def run(cls, call: precompute.PrecomputeCall):
        return precompute.reference(call)


class ReferenceBackend(Backend):
    name = "reference"
    description = "plain torch, float32; the executable form of SPEC.md (any device)"
    implementations = (ReferenceAttention, ReferencePrecompute)
