"""Launch configurations of the Triton kernels and the portable default tables.

Every launch decision is a pure function of the call's shape and the platform, so the
ROCm backend can swap in its own per-architecture table and its tuner can search
around it, and tests can pin any configuration.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from dflash_rocm.platform import Platform

from .common import next_pow2

MAX_SEGMENTS = 64
MIN_KEYS_PER_SEGMENT = 256


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tiles and split of the paged draft-attention kernel.

    ``block_m`` rows of a tile hold ``block_m // G`` query tokens times the ``G`` query
    heads that share one KV head; ``block_n`` keys per loop step; ``num_segments`` splits
    each tile's key range across programs (merged by a second kernel when > 1).
    """

    block_m: int = 64
    block_n: int = 64
    num_segments: int = 1
    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int = 0  # AMD only; 0 leaves the compiler's choice

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
        if not 1 <= self.num_segments <= MAX_SEGMENTS:
            raise ValueError(f"num_segments: expected 1..{MAX_SEGMENTS}, got {self.num_segments}")

    def queries_per_tile(self, queries_per_kv: int) -> int:
        return self.block_m // queries_per_kv

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrecomputeLaunchConfig:
    """Tiles of the fused context-KV kernel: ``block_t`` tokens by one head (``head_dim``
    columns) per program, ``block_k`` of the hidden size per step, the hidden size split
    ``split_k`` ways (a second launch sums the parts) when the grid is too small."""

    block_t: int = 32
    block_k: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int = 0

    def __post_init__(self) -> None:
        for name in ("block_t", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
        if self.split_k < 1:
            raise ValueError(f"split_k: expected >= 1, got {self.split_k}")

    def as_dict(self) -> dict:
        return asdict(self)


def attention_grid_tiles(num_seqs: int, query_len: int, queries_per_tile: int) -> int:
    """Query tiles a batch needs (each request's tiles start fresh)."""
    return num_seqs * max(1, -(-query_len // queries_per_tile))


def choose_segments(base_programs: int, key_span: int, target_programs: int) -> int:
    """Enough key segments to reach ``target_programs``, never below
    ``MIN_KEYS_PER_SEGMENT`` keys each (the merge would cost more than it wins)."""
    if base_programs >= target_programs:
        return 1
    wanted = -(-target_programs // max(1, base_programs))
    by_keys = max(1, key_span // MIN_KEYS_PER_SEGMENT)
    return max(1, min(wanted, by_keys, MAX_SEGMENTS))


@functools.lru_cache(maxsize=1024)  # pure, and asked once per layer and step
def default_attention_config(platform: Platform, *, num_seqs: int, query_len: int, key_span: int,
                             num_q_heads: int, num_kv_heads: int, head_dim: int,
                             fp8: bool) -> AttentionLaunchConfig:
    """The portable table: pack a request's query block into one tile where it fits
    (G x query_len rows, at most 64), split keys until the grid covers the device twice."""
    G = num_q_heads // num_kv_heads
    block_m = max(16, min(next_pow2(G * max(1, query_len)), 64 if head_dim <= 128 else 32))
    block_m = max(block_m, next_pow2(G))
    block_n = 64 if head_dim <= 128 else 32
    if platform.vendor == "cpu":
        # Interpreter: every loop step is Python; a larger key tile means fewer steps.
        block_n = 32
    tiles = attention_grid_tiles(num_seqs, query_len, block_m // G)
    segments = choose_segments(tiles * num_kv_heads, key_span, 2 * platform.compute_units)
    return AttentionLaunchConfig(block_m=block_m, block_n=block_n, num_segments=segments,
                                 num_warps=4 if head_dim <= 128 else 8, num_stages=2)


@functools.lru_cache(maxsize=1024)
def default_precompute_config(platform: Platform, *, num_tokens: int, hidden: int, num_heads_total: int,
                              head_dim: int) -> PrecomputeLaunchConfig:
    """Tokens per tile grow with N (the GEMM turns compute-bound); split the hidden size
    while the grid (token tiles x L*2*Hk heads) is under two programs per compute unit."""
    block_t = 16 if num_tokens <= 16 else 32 if num_tokens <= 256 else 64
    block_k = 64 if head_dim <= 128 else 32
    programs = -(-num_tokens // block_t) * num_heads_total
    split_k = 1
    target = 2 * platform.compute_units
    while programs * split_k < target and hidden // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return PrecomputeLaunchConfig(block_t=block_t, block_k=block_k, split_k=split_k,
                                  num_warps=4 if block_t * head_dim <= 4096 else 8, num_stages=2)
