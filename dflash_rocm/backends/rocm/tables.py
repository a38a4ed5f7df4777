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
                                                       attention_grid_tiles, choose_segments, dispatch_partitions,
                                                       merge_for, split_k_for, tail_split)
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
    matrix_instr_nonkdim: int  # CDNA: 16 gives 16-row MFMA tiles, so 4 warps share a 64-row tile without replication
    min_keys_per_segment: int  # below this a segment's merge costs more than it saves
    programs_per_cu: float  # how many (tile, head, segment) programs to aim for per CU
    last_merges: bool = True  # the last segment may merge a split tile (False: its merge code would spill)


def _rdna3(w: AttentionWorkload) -> bool:
    return w.arch.startswith("gfx11")


# Every rule compiles without spills for the sweep `dflash-rocm inspect` audits (tests/test_audit.py).
# CDNA: one 64-row tile (16 queries x 4 heads) per request on 4 warps with 16x16 MFMA; aim for one
# program per CU (a second one per CU only shares the SIMDs). RDNA3's WMMA keeps operands twice in
# registers: 8 warps and 16-key tiles stay under 256 VGPRs; RDNA4 takes 32-key tiles, and 16-key
# tiles on 4 warps for fp8 (every warp widens the fp8 tiles it reads: 4 warps widen half as often
# as 8; compiled gfx1201, 8 x 840 -> 4 x 1035 vector cycles a trip; modelled b8 8k 36 -> 58 %,
# b1 8k 34 -> 49 %), whose split tiles are not merged by their last segment (20 VGPRs spill).
# gfx950 with an fp8 cache: the two-stage loop's LDS layout takes the fp8 tiles in words, not
# bytes (compiled for gfx950: 142 -> 24 LDS instructions per loop trip; modelled fp8 b64 4k
# 55 -> 86 % of the floor).
CDNA_RULES = (
    TileRule("cdna-d256", lambda w: w.head_dim > 128, 32, 32, 2, 1, 16, 256, 1.0),
    TileRule("cdna-gfx950-fp8", lambda w: w.fp8 and w.arch == "gfx950", 64, 64, 4, 2, 16, 256, 1.0),
    TileRule("cdna-default", lambda w: True, 64, 64, 4, 1, 16, 256, 1.0),
)
RDNA_RULES = (
    TileRule("rdna-d256", lambda w: w.head_dim > 128, 16, 16, 4, 1, 0, 256, 1.0),
    TileRule("rdna-short-query", lambda w: w.query_len * w.group <= 16, 16, 32, 4, 1, 0, 128, 1.0),
    TileRule("rdna3-default", _rdna3, 64, 16, 8, 1, 0, 256, 1.0),
    TileRule("rdna4-fp8", lambda w: w.fp8, 64, 16, 4, 1, 0, 256, 1.0, last_merges=False),
    TileRule("rdna4-default", lambda w: True, 64, 32, 4, 1, 0, 256, 1.0),
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
    """Key segments (a power of two) for ``programs_per_cu`` x CUs programs."""
    platform = w.platform
    programs = attention_grid_tiles(w.batch, w.query_len, block_m // w.group) * w.num_kv_heads
    return choose_segments(programs, w.key_span, int(rule.programs_per_cu * platform.compute_units),
                           rule.min_keys_per_segment, MAX_SEGMENTS[platform.family])


def _tile_rows(w: AttentionWorkload, rule: TileRule) -> tuple[int, int]:
    """(block_m, num_warps): the rule's tile, shrunk to the query block when that is
    smaller (a CDNA warp owns 16 rows, so fewer rows take fewer warps)."""
    block_m = max(min(rule.block_m, next_pow2(w.group * w.query_len)), next_pow2(w.group), 16)
    warps = rule.num_warps
    if rule.matrix_instr_nonkdim:
        warps = max(1, min(warps, block_m // rule.matrix_instr_nonkdim))
    return block_m, warps


def segmented_config(w: AttentionWorkload) -> tuple[str, AttentionLaunchConfig]:
    """The table's (rule name, config) for a workload within the query limit."""
    rule = select_rule(w)
    block_m, warps = _tile_rows(w, rule)
    segments = segments_for(w, rule, block_m)
    tiles_heads = attention_grid_tiles(w.batch, w.query_len, block_m // w.group) * w.num_kv_heads
    merge, merge_rows = merge_for(segments, tiles_heads, block_m, w.group, w.platform, rule.last_merges)
    return rule.name, AttentionLaunchConfig(
        block_m=block_m, block_n=rule.block_n, num_segments=segments, num_warps=warps, num_stages=rule.num_stages,
        min_segment_keys=rule.min_keys_per_segment, merge=merge, merge_rows=merge_rows,
        matrix_instr_nonkdim=rule.matrix_instr_nonkdim)


def unsegmented_config(w: AttentionWorkload) -> tuple[str, AttentionLaunchConfig]:
    """Queries past the query limit (prefill-like): enough query tiles already, one segment."""
    cdna = w.platform.family == "cdna"
    block_m = max(64 if cdna else 32, next_pow2(w.group))
    return "unsegmented", AttentionLaunchConfig(
        block_m=block_m, block_n=32 if w.head_dim > 128 else 64 if cdna else 16, num_segments=1,
        num_warps=max(1, min(4, block_m // 16)) if cdna else 8, num_stages=1,
        matrix_instr_nonkdim=16 if cdna else 0)


@functools.lru_cache(maxsize=1024)  # pure, and asked once per layer and step
def attention_config(w: AttentionWorkload, query_limit: int | None) -> tuple[str, AttentionLaunchConfig]:
    if query_limit is not None and w.query_len > query_limit:
        return unsegmented_config(w)
    return segmented_config(w)


@functools.lru_cache(maxsize=1024)
def precompute_config(arch: str, *, num_tokens: int, hidden: int, num_heads_total: int,
                      head_dim: int, compute_units: int | None = None) -> PrecomputeLaunchConfig:
    """Up to 64 tokens in one tile, the hidden size split until the heads fill the CUs (the
    device's own count; None: the flagship's); beyond, 32-token tiles on CDNA up to 352
    tokens (224 on gfx950; enough programs to balance the CUs) and 64-token tiles otherwise,
    or sooner where their last round is a few tiles split 16 ways (128-token tiles on gfx950
    from 640 tokens); a last partial round of tiles split across every CU (:func:`tail_split`).

    Choices judged by `dflash-rocm inspect`'s model over N = 16..16384, not only the sweep's
    points (all figures modelled):

    - on CDNA a 32-token single tile runs on 4 warps (8 split its rows below the 16 rows of
      a matrix instruction: gfx942 N = 32 68 -> 80 %, gfx950 45 -> 76 %); 16- and 64-token
      tiles keep 8 (as fast in the model, more waves; a 64-token tile of 4 warps spills on
      RDNA3);
    - gfx942 takes 16x16 MFMAs and, below 1024 tokens where no tile is split, 4-warp
      64-token tiles (the split path's registers would leave 2 waves): N = 416..960 +1 to +9
      points, one point 0.6 lower;
    - with split parts adding into one sum (the merge reads one tile, not one per part),
      a last round of at most CUs / 16 tiles splits 16 ways, and gfx942 takes 64-token
      tiles where that happens even below 352 tokens, prefetching a step ahead within two
      rounds: N = 256 64.3 -> 66.3 %, N = 384 62.9 -> 65.7 %, N = 1472 78.6 -> 81.2 %;
      none of 72 points of N = 96..8192 lower (gfx950 N = 1664 with 128-token tiles: 72.4 ->
      77.3 %);
    - gfx950's 64-token tiles start at 224 tokens, prefetching a step ahead while they fill
      at most two rounds (N = 256..512: 37-48 -> 47-60 %, at 2-3 waves per SIMD), and its
      128-token tiles (4 warps, one stage) at 640: they read the weight half as often
      (N = 1024 56 -> 66 %, N = 4096 65 -> 85 %; mean over 56 points of N = 96..16384
      60 -> 66 %, the most lost 1.4 points at N = 800). Before the parts of a split tile
      added into one sum they lost up to 15 points where their count did not fill whole
      rounds (N = 1280, now +3.5);
    - gfx950 sums the hidden RMSNorm's squares a value at a time (its loop was bound by the
      vector work: N = 1024 52 -> 56 %; gfx942 and RDNA3 lose a little).

    No ``waves_per_eu`` cap (it only padded the register allocation): gfx942's configs leave
    room for >= 4 waves per SIMD (a two-stage loop's LDS buffer may hold it to 3 workgroups
    per CU). On CDNA the program order keeps a head's tiles on one XCD."""
    platform = platform_for_arch(arch, compute_units=compute_units)
    cdna = platform.family == "cdna"
    block_k = 64 if head_dim <= 128 else 32
    xcds = dispatch_partitions(platform)
    squares = 1 if arch == "gfx950" else 8

    def grid(block_t: int) -> tuple[int, int, int]:
        """(tiles, whole tiles, split) of ``block_t``-token tiles (:func:`tail_split`)."""
        tiles = -(-num_tokens // block_t) * num_heads_total
        return (tiles, *tail_split(tiles, platform.compute_units))

    if num_tokens <= 64:
        block_t = max(16, next_pow2(num_tokens))
        return PrecomputeLaunchConfig(
            block_t=block_t, block_k=block_k,
            split_k=split_k_for(num_heads_total, hidden, block_k, platform.compute_units),
            num_warps=4 if cdna and block_t == 32 else 8, num_stages=2 if cdna else stage_limit(arch),
            num_xcds=xcds, square_group=squares)
    tiles, whole, split = grid(64)
    # 64-token tiles whose last round is a few tiles split 16 ways (and none half empty) beat
    # 32-token ones: they read the weight half as often (MI300X N = 256: 64.3 -> 66.3 %).
    tiny_tail = split == 16 and num_tokens % 64 == 0
    if cdna and num_tokens <= (224 if arch == "gfx950" else 352) and not tiny_tail:  # 16x16 MFMAs: +2 points
        tiles, whole, split = grid(32)
        # With up to ~3 programs per CU a single-stage loop waits on every load: prefetch one
        # step ahead (W's buffer in LDS then limits gfx942 to 3 workgroups per CU, enough).
        stages = 2 if tiles <= 3 * platform.compute_units else 1
        return PrecomputeLaunchConfig(block_t=32, block_k=block_k, split_k=split, whole_tiles=whole, num_warps=4,
                                      num_stages=stages, num_xcds=xcds, matrix_instr_nonkdim=16,
                                      square_group=squares)
    # gfx950's 4-warp tiles keep its matrix cores fed at 4 waves/SIMD, prefetching a step ahead
    # (16x16 MFMAs) while the tiles fill at most two rounds; gfx942's 8-warp tiles take 16x16
    # MFMAs (with 32x32 ones LLVM unrolls the loop and the registers allow 5 waves, not 7:
    # N = 4096 81 vs 85 %). All modelled.
    if cdna:
        block_t = 64
        if arch == "gfx950" and num_tokens >= 640:  # 128-token tiles (its 160 KiB LDS holds them)
            block_t, warps, stages, nonkdim = 128, 4, 1, 0
            tiles, whole, split = grid(128)
        elif arch == "gfx950":
            warps, stages = 4, 2 if tiles <= 2 * platform.compute_units else 1
            nonkdim = 16 if stages == 2 else 0
        else:  # a split tail within two rounds prefetches a step ahead (N = 256: 52.5 -> 66.3 %, modelled)
            warps, nonkdim = (4 if split == 1 and num_tokens < 1024 else 8), 16
            stages = 2 if split > 1 and tiles <= 2 * platform.compute_units else 1
        return PrecomputeLaunchConfig(block_t=block_t, block_k=block_k, split_k=split, whole_tiles=whole,
                                      num_warps=warps, num_stages=stages, num_xcds=xcds,
                                      matrix_instr_nonkdim=nonkdim, square_group=squares)
    # RDNA4 from 1024 tokens: a KV head's K and V in one program, the states read half as often
    # (R9700 N = 1024 85 -> 92 %, N = 4096 86 -> 92 %, modelled; below, the rounds of its 64
    # CUs make it bumpy: N = 512 +6, N = 640 -3). RDNA3 would spill (54 VGPRs, gfx1100).
    heads = 2 if arch.startswith("gfx12") and num_tokens >= 1024 and head_dim <= 128 else 1
    return PrecomputeLaunchConfig(block_t=64, block_k=block_k, num_warps=8, num_stages=stage_limit(arch),
                                  heads=heads)


def stage_limit(arch: str) -> int:
    """The most pipeline stages a loop may take on ``arch``: one on gfx12, where Triton's
    pipelined loops over buffer loads gave wrong results on hardware (vLLM sets
    ``num_stages=1`` on gfx12 for that reason, vLLM #62697; a cache under 2 GiB gets buffer
    loads, and no gfx12 run of this package has cleared it); tables, tuning candidates and
    tuned entries keep to it. Elsewhere the tables' own choice (at most 2)."""
    return 1 if arch.startswith("gfx12") else 2
