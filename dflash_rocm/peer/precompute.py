"""Ours beside vLLM's precompute: the package's fused launch, modelled by the audit, and
vLLM's unfused sequence at its per-launch roofline (:mod:`.unfused`, a lower bound)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_rocm.audit import sweep
from dflash_rocm.audit.compiler import FactsCache
from dflash_rocm.audit.targets import TARGETS
from dflash_rocm.workloads import DraftShape

from . import unfused
from .compare import PEER_TARGETS, SHAPE, ours_us

PRECOMPUTE_TOKENS = (16, 128, 1024)  # batch 1, 8 and 64 with a whole 16-token block accepted


@dataclass
class PrecomputeRow:
    target: str
    tokens: int
    fp8: bool
    ours_us: float | None
    vllm_us: float  # the unfused sequence at its roofline (a lower bound of vLLM's time)
    vllm_launches: int
    ours_note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.ours_us is None else self.ours_us / self.vllm_us


def precompute_rows(cache: FactsCache, targets=PEER_TARGETS, tokens=PRECOMPUTE_TOKENS, kv=("bf16", "fp8"),
                    shape: DraftShape = SHAPE) -> list[PrecomputeRow]:
    """The package's precompute (modelled by the audit) beside vLLM's unfused sequence
    (:mod:`.unfused`) for each target, token count and cache dtype (fp8 where the target
    converts it)."""
    rows = []
    for arch in targets:
        target = TARGETS[arch]
        for fp8 in (k == "fp8" for k in kv if k != "fp8" or target.fp8_dtype is not None):
            for n in tokens:
                ours, note = ours_us(sweep.Case("precompute", shape, fp8, tokens=n), target, cache)
                cache_bytes = 1 if fp8 else 2
                rows.append(PrecomputeRow(
                    target=arch, tokens=n, fp8=fp8, ours_us=ours,
                    vllm_us=unfused.unfused_seconds(shape, n, cache_bytes, target) * 1e6,
                    vllm_launches=len(unfused.unfused_sequence(shape, n, cache_bytes)), ours_note=note))
    return rows
