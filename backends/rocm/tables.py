"""Per-architecture launch tables of the ROCm backend.

The kernels are the Triton backend's; what differs per architecture is how they are
launched. CDNA (gfx942/gfx950, wave64, 64 KiB LDS on gfx942 and 160 KiB on gfx950,
256-304 CUs) wants wide tiles and many key segments to fill the device; RDNA (gfx11/gfx12,
wave32, 128 KiB LDS, 32-96 CUs) wants smaller tiles and few segments (vLLM's segmented
table, tuned on gfx1201, is the starting point). Every table is a list of named rules
tried in order, so each entry can be listed, tested and reported by name.

All functions here are pure: (architecture, call shape) -> launch configuration.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from dflash_rocm.backends.triton.common import next_pow2
from dflash_rocm.backends.triton.launch_config import (AttentionLaunchConfig, PrecomputeLaunchConfig,
                                                       attention_grid_tiles)
from dflash_rocm.platform import Platform, platform_for_arch

SUPPORTED_ARCHS = ("gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1151", "gfx1200", "gfx1201")


@dataclass(frozen=True)
class AttentionWorkload:
    """What a launch decision may depend on."""

    arch: str
    batch: int
    query_len: int  # longest query of the call (the compiled capacity is derived from it)
    key_span: int  # longest sequence (window-bounded where a window applies)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    fp8: bool
    compute_units: int | None = None  # the device's own count (None: the architecture's flagship)

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def platform(self) -> Platform:
        return platform_for_arch(self.arch, compute_units=self.compute_units)


@dataclass(frozen=True)
class TileRule:
    name: str
    applies: Callable[[AttentionWorkload], bool]
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    waves_per_eu: int
    min_keys_per_segment: int  # below this a segment's merge costs more than it saves
    programs_per_cu: float  # how many (tile, head, segment) programs to aim for per CU


def _gfx950(w: AttentionWorkload) -> bool:
    return w.arch == "gfx950"


CDNA_RULES = (
    TileRule("cdna-d256", lambda w: w.head_dim > 128, 32, 32, 4, 1, 2, 512, 2.0),
    TileRule("cdna-fp8", lambda w: w.fp8, 64, 64, 4, 1, 2, 256, 2.0),
    TileRule("cdna4-wide-lds", _gfx950, 64, 128, 8, 2, 2, 512, 2.0),
    TileRule("cdna-default", lambda w: True, 64, 64, 4, 1, 2, 256, 2.0),
)
RDNA_RULES = (
    TileRule("rdna-d256", lambda w: w.head_dim > 128, 16, 32, 4, 1, 2, 256, 1.5),
    TileRule("rdna-fp8", lambda w: w.fp8, 32, 32, 4, 2, 2, 128, 1.5),
    TileRule("rdna-short-query", lambda w: w.query_len * w.group <= 16, 16, 64, 4, 1, 2, 128, 1.5),
    TileRule("rdna-default", lambda w: True, 32, 64, 4, 1, 2, 128, 1.5),
)
MAX_SEGMENTS = {"cdna": 64, "rdna": 32}


def rules_for(arch: str) -> tuple[TileRule, ...]:
    family = platform_for_arch(arch).family
    if family == "cdna":
        return CDNA_RULES
    if family == "rdna":
        return RDNA_RULES
    raise ValueError(f"no ROCm table for {arch} (family {family})")


def select_rule(w: AttentionWorkload) -> TileRule:
    return next(rule for rule in rules_for(w.arch) if rule.applies(w))


def segments_for(w: AttentionWorkload, rule: TileRule, block_m: int) -> int:
    """Split keys until the grid reaches ``programs_per_cu`` x CUs, in powers of two, never
    below ``min_keys_per_segment`` keys per segment."""
    platform = w.platform
    programs = attention_grid_tiles(w.batch, w.query_len, block_m // w.group) * w.num_kv_heads
    target = int(rule.programs_per_cu * platform.compute_units)
    segments = 1
    while (programs * segments < target and segments * 2 <= MAX_SEGMENTS[platform.family]
           and w.key_span // (segments * 2) >= rule.min_keys_per_segment):
        segments *= 2
    return segments


def segmented_config(w: AttentionWorkload) -> tuple[str, AttentionLaunchConfig]:
    """The table's (rule name, config) for a workload within the query limit."""
    rule = select_rule(w)
    block_m = max(rule.block_m, next_pow2(w.group))
    return rule.name, AttentionLaunchConfig(
        block_m=block_m, block_n=rule.block_n, num_segments=segments_for(w, rule, block_m),
        num_warps=rule.num_warps, num_stages=rule.num_stages, waves_per_eu=rule.waves_per_eu)


def unsegmented_config(w: AttentionWorkload) -> tuple[str, AttentionLaunchConfig]:
    """Queries past the query limit (prefill-like): enough query tiles already, one segment."""
    wave64 = w.platform.family == "cdna"
    block_m = max(64 if wave64 else 32, next_pow2(w.group))
    return "unsegmented", AttentionLaunchConfig(
        block_m=block_m, block_n=32 if w.head_dim > 128 else 64, num_segments=1,
        num_warps=4, num_stages=1, waves_per_eu=2)


@functools.lru_cache(maxsize=1024)  # pure, and asked once per layer and step
def attention_config(w: AttentionWorkload, query_limit: int | None) -> tuple[str, AttentionLaunchConfig]:
    if query_limit is not None and w.query_len > query_limit:
        return unsegmented_config(w)
    return segmented_config(w)


@functools.lru_cache(maxsize=1024)
def precompute_config(arch: str, *, num_tokens: int, hidden: int, num_heads_total: int,
                      head_dim: int, compute_units: int | None = None) -> PrecomputeLaunchConfig:
    """Token tiles grow with N; split the hidden size until the grid covers the CUs (the
    device's own count; None: the flagship's). CDNA takes 64-token tiles sooner (wave64,
    MFMA 32x32) and 8 warps for them."""
    platform = platform_for_arch(arch, compute_units=compute_units)
    cdna = platform.family == "cdna"
    block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= (128 if cdna else 512) else 64
    block_k = 64 if head_dim <= 128 else 32
    programs = -(-num_tokens // block_t) * num_heads_total
    split_k = 1
    while programs * split_k < 2 * platform.compute_units and hidden // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return PrecomputeLaunchConfig(block_t=block_t, block_k=block_k, split_k=split_k,
                                  num_warps=8 if cdna and block_t * head_dim >= 8192 else 4,
                                  num_stages=1 if cdna else 2, waves_per_eu=2 if cdna else 0)
