"""Per-architecture launch tables of the ROCm backend.

The kernels are the Triton backend's; what differs per architecture is how they are
launched. CDNA (gfx942/gfx950, wave64, 64 KiB LDS on gfx942 and 160 KiB on gfx950,
256-304 CUs) wants wide tiles and many key segments to fill the device; RDNA (gfx11/gfx12,
wave32, 128 KiB LDS, 32-96 CUs) wants smaller tiles and few segments (vLLM's segmented
table, tuned on gfx1201, is the starting point). Every table is data: a tuple of named
rows tried in order, each with condition fields (all must hold) and launch fields, so each
row can be listed, tested and reported by name; one small function per table picks the row.

All functions here are pure: (architecture, call shape) -> launch configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_rocm.backends.triton.common import next_pow2
from dflash_rocm.backends.triton.launch_config import (AttentionLaunchConfig, PrecomputeLaunchConfig,
                                                       attention_grid_tiles, choose_segments, dispatch_partitions,
                                                       fill_split, merge_for, split_k_for, tail_split)
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
    buffer_loads: bool = True  # the caches are under 2 GiB: AMD buffer (32-bit offset) loads

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def platform(self) -> Platform:
        return platform_for_arch(self.arch, compute_units=self.compute_units)


@dataclass(frozen=True, kw_only=True)
class TileRule:
    """One row of an attention table: the conditions under which it applies (all must hold;
    a condition left at its default always holds) and the launch it gives."""

    name: str
    # Conditions
    archs: tuple[str, ...] = ()  # architecture name prefixes ("gfx11", "gfx950"); empty: any of the table's
    min_head_dim: int = 0
    fp8: bool | None = None  # True: an fp8 cache only; False: a 16-bit cache only; None: either
    max_query_rows: int | None = None  # longest query x group (a request's rows of one KV head)
    min_key_span: int = 0  # the longest sequence's keys
    # Launch
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 1
    matrix_instr_nonkdim: int = 0  # CDNA: 16 gives 16-row MFMA tiles: 4 warps share a 64-row tile, none replicated
    min_keys_per_segment: int = 256  # below this a segment's merge costs more than it saves
    programs_per_cu: float = 1.0  # how many (tile, head, segment) programs to aim for per CU
    fp8_k_at_load: bool = False  # an fp8 K tile widened in its load layout (AttentionLaunchConfig)
    # The last segment may merge a split tile: "always", "large cache" (only without buffer loads:
    # with them its merge code spills), or "never".
    last_merges: str = "always"

    def merges_last(self, w: AttentionWorkload) -> bool:
        """Whether the last segment may merge ``w``'s split tiles (see ``last_merges``)."""
        return self.last_merges == "always" or self.last_merges == "large cache" and not w.buffer_loads

    def applies(self, w: AttentionWorkload) -> bool:
        return ((not self.archs or w.arch.startswith(self.archs)) and w.head_dim >= self.min_head_dim
                and (self.fp8 is None or w.fp8 == self.fp8)
                and (self.max_query_rows is None or w.query_len * w.group <= self.max_query_rows)
                and w.key_span >= self.min_key_span)


# Every rule compiles without spills for the sweep `dflash-rocm inspect` audits (tests/test_audit.py).
# CDNA: one 64-row tile (16 queries x 4 heads) per request on 4 warps with 16x16 MFMA; one program
# per CU (a second one per CU only shares the SIMDs). gfx950 with an fp8 cache takes the two-stage
# loop, whose LDS layout takes the fp8 tiles in words, not bytes (a sixth of the LDS instructions a
# trip, compiled). An fp8 K tile is widened at its load (``fp8_k_at_load``: each lane its share,
# not each warp the whole tile) on gfx950, on RDNA4, and on gfx942 from 4096 keys, where the two-
# stage loop keeps the widened tile in 218 VGPRs (one stage: 256-266, a second workgroup per CU
# no longer fits; below 4096 keys the pipeline's prologue costs more than the widening saves:
# modelled MI300X fp8 b8 2k 19.3 us unchanged, 20.2 so; b8 4k 25.2 -> 23.2, b1 8k 13.1 -> 12.9).
# RDNA3's WMMA keeps operands twice in registers: 8 warps and 16-key tiles stay under 256 VGPRs.
# RDNA4 takes 32-key tiles, and 16-key tiles on 4 warps for fp8: every warp widens the V tiles it
# reads, so 4 warps widen half as often as 8; their split tiles are merged by their last segment
# only in a cache over 2 GiB (248 VGPRs, 0 spills; with buffer loads that merge code spills,
# compiled gfx1201): else by merger programs of 4 tokens' rows (32 on 64 CUs, 213 VGPRs).
CDNA_RULES = (
    TileRule(name="cdna-d256", min_head_dim=129, block_m=32, block_n=32, num_warps=2, matrix_instr_nonkdim=16),
    TileRule(name="cdna-gfx942-fp8-long", archs=("gfx942",), fp8=True, min_key_span=4096, block_m=64, block_n=64,
             num_warps=4, num_stages=2, matrix_instr_nonkdim=16, fp8_k_at_load=True),
    TileRule(name="cdna-gfx950-fp8", archs=("gfx950",), fp8=True, block_m=64, block_n=64, num_warps=4, num_stages=2,
             matrix_instr_nonkdim=16, fp8_k_at_load=True),
    TileRule(name="cdna-default", block_m=64, block_n=64, num_warps=4, matrix_instr_nonkdim=16),
)
RDNA_RULES = (
    TileRule(name="rdna-d256", min_head_dim=129, block_m=16, block_n=16, num_warps=4),
    TileRule(name="rdna-short-query", max_query_rows=16, block_m=16, block_n=32, num_warps=4,
             min_keys_per_segment=128),
    TileRule(name="rdna3-default", archs=("gfx11",), block_m=64, block_n=16, num_warps=8),
    TileRule(name="rdna4-fp8", fp8=True, block_m=64, block_n=16, num_warps=4, last_merges="large cache",
             fp8_k_at_load=True),
    TileRule(name="rdna4-default", block_m=64, block_n=32, num_warps=4),
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
    merge, merge_rows = merge_for(segments, tiles_heads, block_m, w.group, w.platform, rule.merges_last(w))
    return rule.name, AttentionLaunchConfig(
        block_m=block_m, block_n=rule.block_n, num_segments=segments, num_warps=warps, num_stages=rule.num_stages,
        min_segment_keys=rule.min_keys_per_segment, merge=merge, merge_rows=merge_rows,
        matrix_instr_nonkdim=rule.matrix_instr_nonkdim, fp8_k_at_load=rule.fp8_k_at_load and w.fp8,
        wave_size=w.platform.wave_size)


def unsegmented_config(w: AttentionWorkload) -> tuple[str, AttentionLaunchConfig]:
    """Queries past the query limit (prefill-like): enough query tiles already, one segment."""
    cdna = w.platform.family == "cdna"
    block_m = max(64 if cdna else 32, next_pow2(w.group))
    return "unsegmented", AttentionLaunchConfig(
        block_m=block_m, block_n=32 if w.head_dim > 128 else 64 if cdna else 16, num_segments=1,
        num_warps=max(1, min(4, block_m // 16)) if cdna else 8, num_stages=1,
        matrix_instr_nonkdim=16 if cdna else 0)


def attention_config(w: AttentionWorkload, query_limit: int | None) -> tuple[str, AttentionLaunchConfig]:
    if query_limit is not None and w.query_len > query_limit:
        return unsegmented_config(w)
    return segmented_config(w)


@dataclass(frozen=True)
class PrecomputeWorkload:
    """What a precompute launch decision may depend on."""

    arch: str
    num_tokens: int
    hidden: int
    num_heads_total: int  # K and V head rows of every layer
    head_dim: int
    compute_units: int | None = None  # the device's own count (None: the architecture's flagship)

    @property
    def platform(self) -> Platform:
        return platform_for_arch(self.arch, compute_units=self.compute_units)

    @property
    def block_k(self) -> int:
        """Hidden columns a loop step: 64, or 32 past head_dim 128 (the tile's registers)."""
        return 64 if self.head_dim <= 128 else 32

    def tiles(self, block_t: int) -> int:
        return -(-self.num_tokens // block_t) * self.num_heads_total

    def tail(self, block_t: int) -> tuple[int, int]:
        """(whole tiles, split) of ``block_t``-token tiles (:func:`tail_split`)."""
        return tail_split(self.tiles(block_t), self.platform.compute_units)


# How a row splits the hidden size: "heads": a single token tile's, until the heads fill the CUs
# (:func:`split_k_for`); "tail": a last partial round's tiles (:func:`tail_split`); "none": never.
# Beyond one token tile, a grid under ``fill_under`` rounds of the CUs (a rank's heads under
# tensor parallelism) splits every tile whatever the row's split (:func:`fill_split`, up to the
# row's ``fill_per_cu`` parts per CU).
SPLITS = ("heads", "tail", "none")


@dataclass(frozen=True, kw_only=True)
class PrecomputeRule:
    """One row of a precompute table: the conditions under which it applies (all must hold;
    a condition left at its default always holds), judged on the row's own ``block_t``-token
    tiles, and the launch it gives."""

    name: str
    # Conditions
    min_tokens: int = 0
    max_tokens: int | None = None
    max_head_dim: int | None = None
    max_rounds: int | None = None  # the tiles fill at most this many rounds of the CUs
    tail_ways: tuple[int, ...] = ()  # the last round's split is one of these (1: none); empty: any
    full_tiles: bool = False  # the tokens fill the last token tile
    # Launch
    block_t: int
    num_warps: int
    num_stages: int
    matrix_instr_nonkdim: int = 0
    heads: int = 1
    split: str = "tail"
    fill_under: float = 1.0  # a grid of fewer tiles than this many rounds of the CUs splits every tile
    fill_per_cu: int = 2  # its split parts per CU at most (:func:`fill_split`)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {self.split!r}")

    def applies(self, w: PrecomputeWorkload) -> bool:
        return (self.min_tokens <= w.num_tokens and (self.max_tokens is None or w.num_tokens <= self.max_tokens)
                and (self.max_head_dim is None or w.head_dim <= self.max_head_dim)
                and (self.max_rounds is None or w.tiles(self.block_t) <= self.max_rounds * w.platform.compute_units)
                and (not self.tail_ways or w.tail(self.block_t)[1] in self.tail_ways)
                and (not self.full_tiles or w.num_tokens % self.block_t == 0))

    def split_for(self, w: PrecomputeWorkload) -> tuple[int, int]:
        """(whole tiles, split_k) of the launch."""
        units = w.platform.compute_units
        if self.split == "heads":
            return 0, split_k_for(w.num_heads_total, w.hidden, w.block_k, units)
        if w.tiles(self.block_t) < self.fill_under * units:
            return 0, fill_split(w.tiles(self.block_t), w.hidden, w.block_k, self.fill_per_cu * units)
        return w.tail(self.block_t) if self.split == "tail" else (0, 1)


@dataclass(frozen=True)
class PrecomputeTable:
    """An architecture's precompute rows, tried in order, and what holds for all of them:
    ``square_group`` columns of ``x`` a lane sums before adding them to the hidden RMSNorm's
    squares (see :class:`PrecomputeLaunchConfig`)."""

    rules: tuple[PrecomputeRule, ...]
    square_group: int = 8


# Up to 64 tokens: one token tile (its token count rounded up), the hidden size split until
# the heads fill the CUs. On CDNA a 32-token tile runs on 4 warps (8 would split its rows below
# the 16 rows of a matrix instruction); 16- and 64-token tiles keep 8 (more waves).
CDNA_SINGLE_TILE = (
    PrecomputeRule(name="cdna-one-tile-16", max_tokens=16, block_t=16, num_warps=8, num_stages=2, split="heads"),
    PrecomputeRule(name="cdna-one-tile-32", max_tokens=32, block_t=32, num_warps=4, num_stages=2, split="heads"),
    PrecomputeRule(name="cdna-one-tile-64", max_tokens=64, block_t=64, num_warps=8, num_stages=2, split="heads"),
)
# Beyond one tile, CDNA: 32-token tiles with 16x16 MFMAs while the grid is small enough to
# need them to balance the CUs, unless 64-token tiles leave a last round of a few full tiles
# split 16 ways (a part per CU at most; they read the weight half as often). A loop prefetches
# a step ahead (two stages) only while its grid fills few rounds: with more programs per CU the
# others hide the loads. The last partial round of tiles is split across every CU (:func:`tail_split`).
GFX942_RULES = CDNA_SINGLE_TILE + (
    PrecomputeRule(name="gfx942-64-few-tail-prefetch", max_tokens=352, tail_ways=(16,), full_tiles=True,
                   max_rounds=2, block_t=64, num_warps=8, num_stages=2, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx942-64-few-tail", max_tokens=352, tail_ways=(16,), full_tiles=True,
                   block_t=64, num_warps=8, num_stages=1, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx942-32-prefetch", max_tokens=352, max_rounds=3,
                   block_t=32, num_warps=4, num_stages=2, matrix_instr_nonkdim=16, fill_per_cu=3),
    PrecomputeRule(name="gfx942-32", max_tokens=352, block_t=32, num_warps=4, num_stages=1, matrix_instr_nonkdim=16,
                   fill_per_cu=3),
    # No split tile below 1024 tokens: 4 warps (the split path's registers would leave 2 waves).
    PrecomputeRule(name="gfx942-64-unsplit", max_tokens=1023, tail_ways=(1,),
                   block_t=64, num_warps=4, num_stages=1, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx942-64-split-prefetch", tail_ways=(2, 4, 16), max_rounds=2,
                   block_t=64, num_warps=8, num_stages=2, matrix_instr_nonkdim=16),
    # 8 warps with 16x16 MFMAs: with 32x32 ones LLVM unrolls the loop and the registers allow
    # 5 waves, not 7 (compiled).
    PrecomputeRule(name="gfx942-64", block_t=64, num_warps=8, num_stages=1, matrix_instr_nonkdim=16, fill_per_cu=4),
)
# gfx950: 4-warp tiles keep its matrix cores fed at 4 waves a SIMD; 16x16 MFMAs where the loop
# prefetches; from 640 tokens 128-token tiles (its 160 KiB LDS holds them), which read the
# weight half as often.
GFX950_RULES = CDNA_SINGLE_TILE + (
    PrecomputeRule(name="gfx950-64-few-tail-prefetch", max_tokens=224, tail_ways=(16,), full_tiles=True,
                   max_rounds=2, block_t=64, num_warps=4, num_stages=2, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx950-64-few-tail", max_tokens=224, tail_ways=(16,), full_tiles=True,
                   block_t=64, num_warps=4, num_stages=1),
    PrecomputeRule(name="gfx950-32-prefetch", max_tokens=224, max_rounds=3,
                   block_t=32, num_warps=4, num_stages=2, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx950-32", max_tokens=224, block_t=32, num_warps=4, num_stages=1, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx950-128", min_tokens=640, block_t=128, num_warps=4, num_stages=1),
    PrecomputeRule(name="gfx950-64-prefetch", max_rounds=2,
                   block_t=64, num_warps=4, num_stages=2, matrix_instr_nonkdim=16),
    PrecomputeRule(name="gfx950-64", block_t=64, num_warps=4, num_stages=1),
)
# RDNA: 8 warps, 64-token tiles beyond one tile, no split (few CUs to fill) unless the tiles
# fill at most half the CUs (a rank's heads under TP): then split up to one part a CU (its
# DRAM is slow enough that the parts' float32 sums cost more than idle CUs above that; modelled
# R9700 TP8 N = 128: 28.4 -> 24.8 us, N = 256 unsplit 26.3 against 31.2 split). RDNA4 takes one
# stage (:func:`stage_limit`) and from 1024 tokens puts a KV head's K and V in one program,
# reading the states half as often (RDNA3's registers would spill: 54 VGPRs, compiled gfx1100).
RDNA3_RULES = (
    PrecomputeRule(name="rdna3-one-tile-16", max_tokens=16, block_t=16, num_warps=8, num_stages=2, split="heads"),
    PrecomputeRule(name="rdna3-one-tile-32", max_tokens=32, block_t=32, num_warps=8, num_stages=2, split="heads"),
    PrecomputeRule(name="rdna3-one-tile-64", max_tokens=64, block_t=64, num_warps=8, num_stages=2, split="heads"),
    PrecomputeRule(name="rdna3-64", block_t=64, num_warps=8, num_stages=2, split="none", fill_under=0.5,
                   fill_per_cu=1),
)
RDNA4_RULES = (
    PrecomputeRule(name="rdna4-one-tile-16", max_tokens=16, block_t=16, num_warps=8, num_stages=1, split="heads"),
    PrecomputeRule(name="rdna4-one-tile-32", max_tokens=32, block_t=32, num_warps=8, num_stages=1, split="heads"),
    PrecomputeRule(name="rdna4-one-tile-64", max_tokens=64, block_t=64, num_warps=8, num_stages=1, split="heads"),
    PrecomputeRule(name="rdna4-64-paired", min_tokens=1024, max_head_dim=128,
                   block_t=64, num_warps=8, num_stages=1, heads=2, split="none", fill_under=0.5, fill_per_cu=1),
    PrecomputeRule(name="rdna4-64", block_t=64, num_warps=8, num_stages=1, split="none", fill_under=0.5,
                   fill_per_cu=1),
)
# Keyed by architecture name prefix. gfx950 sums the hidden RMSNorm's squares a value at a time
# (its loop is bound by the vector work); the others keep 8-column groups (fewer registers).
PRECOMPUTE_TABLES = {
    "gfx950": PrecomputeTable(GFX950_RULES, square_group=1),
    "gfx942": PrecomputeTable(GFX942_RULES),
    "gfx12": PrecomputeTable(RDNA4_RULES),
    "gfx11": PrecomputeTable(RDNA3_RULES),
}
FAMILY_PRECOMPUTE_TABLES = {"cdna": "gfx942", "rdna": "gfx11"}  # for an architecture no key prefixes


def precompute_table(arch: str) -> PrecomputeTable:
    """The table of the key ``arch`` starts with, else its family's."""
    key = next((k for k in PRECOMPUTE_TABLES if arch.startswith(k)), None)
    key = key or FAMILY_PRECOMPUTE_TABLES.get(platform_for_arch(arch).family)
    if key is None:
        raise ValueError(f"no ROCm precompute table for {arch}")
    return PRECOMPUTE_TABLES[key]


def select_precompute_rule(w: PrecomputeWorkload) -> PrecomputeRule:
    return next(rule for rule in precompute_table(w.arch).rules if rule.applies(w))


def precompute_config(arch: str, *, num_tokens: int, hidden: int, num_heads_total: int,
                      head_dim: int, compute_units: int | None = None) -> PrecomputeLaunchConfig:
    """The launch of the first row of ``arch``'s table that applies to the call. On CDNA the
    program order keeps a head's tiles on one XCD (``num_xcds``)."""
    w = PrecomputeWorkload(arch, num_tokens, hidden, num_heads_total, head_dim, compute_units)
    rule = select_precompute_rule(w)
    whole, split = rule.split_for(w)
    return PrecomputeLaunchConfig(
        block_t=rule.block_t, block_k=w.block_k, split_k=split, whole_tiles=whole, num_warps=rule.num_warps,
        num_stages=rule.num_stages, num_xcds=dispatch_partitions(w.platform),
        matrix_instr_nonkdim=rule.matrix_instr_nonkdim, square_group=precompute_table(arch).square_group,
        heads=rule.heads if split == 1 else 1)


def stage_limit(arch: str) -> int:
    """The most pipeline stages a loop may take on ``arch``: one on gfx12, where Triton's
    pipelined loops over buffer loads gave wrong results on hardware (vLLM sets
    ``num_stages=1`` on gfx12 for that reason, vLLM #62697; a cache under 2 GiB gets buffer
    loads, and no gfx12 run of this package has cleared it); tables, tuning candidates and
    tuned entries keep to it. Elsewhere the tables' own choice (at most 2)."""
    return 1 if arch.startswith("gfx12") else 2
