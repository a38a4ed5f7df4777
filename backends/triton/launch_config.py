"""Launch configurations of the Triton kernels and the portable default tables.

Every launch decision is a pure function of the call's shape and the platform, so the
ROCm backend can swap in its own per-architecture table and its tuner can search
around it, and tests can pin any configuration.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflash_rocm.platform import Platform

from .common import next_pow2

MAX_SEGMENTS = 64
MIN_KEYS_PER_SEGMENT = 256
IN_KERNEL_MERGE_SEGMENTS = 8  # more partials than the last segment should read alone (see merge_for)
# How a split tile's partials are merged: by the last segment to finish ("last"), by merger
# programs at the end of the same grid that wait for the segments ("tail"), or by a second
# launch ("launch").
MERGES = ("last", "tail", "launch")


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tiles and split of the paged draft-attention kernel.

    ``block_m`` rows of a tile hold ``block_m // G`` query tokens times the ``G`` query
    heads that share one KV head; ``block_n`` keys per loop step; ``num_segments`` splits
    each tile's key range across programs, each segment at least ``min_segment_keys``
    long (the device decides from the real sequence length how many segments have keys);
    ``merge`` says how a split tile's partials are merged (see :data:`MERGES`); a merge
    program (merger or second launch) merges ``merge_rows`` rows of a tile (0: one query
    token's heads); ``wave_size``: the lanes of a warp on the table's target, which size
    the last segment's merge (:func:`last_merge_chunk`). ``fp16_dots``: with an fp8 cache
    and 16-bit queries, both products take fp16 operands (the query pre-scaled by the
    softmax scale, fp8 widened exactly, P with 3 more bits than bf16) instead of the
    query's dtype: on NVIDIA an e4m3 pair widens to fp16 in one instruction, to bf16 in
    several; on AMD the opposite holds. ``fp8_k_at_load``: with an fp8 cache, each K tile is
    widened in the layout it was loaded in (each lane its own share) rather than in the dot
    operand's (every warp the whole tile), for the widened tile's registers (the kernel's
    ``_in_load_layout``).
    """

    block_m: int = 64
    block_n: int = 64
    num_segments: int = 1
    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int = 0  # AMD only; 0 leaves the compiler's choice
    min_segment_keys: int = 0
    merge: str = "last"
    merge_rows: int = 0
    matrix_instr_nonkdim: int = 0  # AMD only: 16 picks 16x16 MFMA tiles; 0 the compiler's choice
    fp16_dots: bool = False
    fp8_k_at_load: bool = False
    wave_size: int = 32

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
        if not 1 <= self.num_segments <= MAX_SEGMENTS:
            raise ValueError(f"num_segments: expected 1..{MAX_SEGMENTS}, got {self.num_segments}")
        if self.merge not in MERGES:
            raise ValueError(f"merge: expected one of {MERGES}, got {self.merge!r}")
        if self.merge_rows < 0 or self.merge_rows & (self.merge_rows - 1) or self.merge_rows > self.block_m:
            raise ValueError(f"merge_rows: expected 0 or a power of two up to block_m, got {self.merge_rows}")
        if self.wave_size not in (32, 64):
            raise ValueError(f"wave_size: expected 32 or 64, got {self.wave_size}")

    def queries_per_tile(self, queries_per_kv: int) -> int:
        return self.block_m // queries_per_kv

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PrecomputeLaunchConfig:
    """Tiles of the fused context-KV kernel: ``block_t`` tokens by one head (``head_dim``
    columns) per program, ``block_k`` of the hidden size per step; the hidden size of every
    tile past the first ``whole_tiles`` split ``split_k`` ways (the last part to finish, or a
    second launch, sums the parts): all tiles when the grid is too small to fill the
    device, the last partial round's when it fills it a few times over; ``num_xcds`` > 1
    renumbers programs so each of that many XCDs (separate L2s) runs neighbouring ones;
    ``square_group`` columns of ``x`` a lane sums before adding them to its share of the
    hidden RMSNorm's sums of squares (8: one 16-byte load's worth, fewest registers; 1: one
    fused multiply-add a value, ``block_t * block_k / threads`` fp32 registers more);
    ``heads`` 2: a program computes the K and the V tile of one KV head from the same loads
    of the states (their reads through L2 halve; twice the accumulators; never split)."""

    block_t: int = 32
    block_k: int = 64
    split_k: int = 1
    whole_tiles: int = 0
    num_warps: int = 4
    num_stages: int = 2
    waves_per_eu: int = 0
    matrix_instr_nonkdim: int = 0
    num_xcds: int = 1
    square_group: int = 8
    heads: int = 1

    def __post_init__(self) -> None:
        for name in ("block_t", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {value}")
        if self.heads not in (1, 2):
            raise ValueError(f"heads: expected 1 or 2, got {self.heads}")
        if self.heads == 2 and self.split_k != 1:
            raise ValueError("heads: 2 head rows per program only without a split hidden size")
        if self.square_group not in (1, 8):
            raise ValueError(f"square_group: expected 1 or 8, got {self.square_group}")
        if self.split_k < 1:
            raise ValueError(f"split_k: expected >= 1, got {self.split_k}")
        if self.whole_tiles < 0:
            raise ValueError(f"whole_tiles: expected >= 0, got {self.whole_tiles}")

    def as_dict(self) -> dict:
        return asdict(self)


def merge_program_rows(config: AttentionLaunchConfig, queries_per_kv: int) -> int:
    """Rows a merge program merges (second launch or merger at the grid's end): the
    config's ``merge_rows``, else one query token's heads."""
    return config.merge_rows or min(config.block_m, next_pow2(queries_per_kv))


def merge_load_segments(rows: int, num_segments: int) -> int:
    """Segments whose partials a merge program of ``rows`` rows loads at once: 256 rows'
    worth (64 for one token of a 4-head group), so that the load's registers do not grow
    with the rows (8-row mergers with 64 segments a load spill on RDNA3), and no more than
    the launch has (a load's lanes past them would always be masked, yet cost their
    instructions)."""
    return max(1, min(64, 256 // rows, next_pow2(num_segments)))


def last_merge_chunk(block_m: int, block_d: int, num_warps: int, wave_size: int = 32) -> int:
    """Segments per load of the last segment's merge (the whole tile): at most 64 values a
    lane, a power of two from 1 to 4. A wave64 lane holds a 64-row, 128-dim tile's partials of
    two segments where a 32-lane warp's holds one: half the merge's dependent round trips
    (CDNA; the compiled VGPRs stay those of the attention loop)."""
    chunk = 64 * num_warps * wave_size // (block_m * block_d)
    return max(1, min(4, 1 << max(0, chunk.bit_length() - 1)))


def dispatch_partitions(platform: Platform) -> int:
    """Partitions the hardware deals a grid's programs to round-robin, each with its own
    share of the compute units: MI300/MI355 deal program ``i`` to XCD ``i % 8`` (at most 8
    XCDs); 1 elsewhere."""
    return 8 if platform.family == "cdna" else 1


def tail_merge_fits(mergers: int, platform: Platform) -> bool:
    """Whether a split launch may merge by ``mergers`` merger programs at the end of its
    grid. Mergers wait for segment programs; with fewer mergers dealt to every dispatch
    partition than it has compute units, some unit of each always has room that no waiting
    merger holds, so the segments progress whatever order the hardware dispatches programs
    in."""
    parts = dispatch_partitions(platform)
    return -(-mergers // parts) < platform.compute_units // parts


def merge_for(num_segments: int, tiles_heads: int, block_m: int, queries_per_kv: int, platform: Platform,
              last_merges: bool = True) -> tuple[str, int]:
    """(merge, merge_rows) the tables choose for a split tile: its last segment merges when
    there are few partials (and ``last_merges``: the kernel has the registers for that
    merge); else merger programs where they fit, each merging one query token's heads, or
    the fewest times more rows (2, 4, ... up to the tile) that cuts the mergers enough to
    fit (no second launch, and no single program reads every partial when a smaller share
    fits); else a second launch. (RDNA4's fp8 batch 1, a tile of 16 tokens x 4 heads on 64
    CUs: 4 tokens' rows a merger, 32 mergers, one launch: 43.4 us at 8k against 45.4 with the
    second launch, modelled gfx1201.)"""
    if num_segments <= IN_KERNEL_MERGE_SEGMENTS and last_merges:
        return "last", 0
    base = min(block_m, next_pow2(queries_per_kv))
    rows = base
    while rows <= block_m:
        if tail_merge_fits(tiles_heads * (block_m // rows), platform):
            return "tail", 0 if rows == base else rows
        rows *= 2
    return "launch", 0


def attention_grid_tiles(num_seqs: int, query_len: int, queries_per_tile: int) -> int:
    """Query tiles a batch needs (each request's tiles start fresh)."""
    return num_seqs * max(1, -(-query_len // queries_per_tile))


def choose_segments(base_programs: int, key_span: int, target_programs: int, min_keys: int,
                    max_segments: int = MAX_SEGMENTS) -> int:
    """A power of two: enough key segments to reach ``target_programs``, at most
    ``max_segments``, and not more than twice the count of ``min_keys``-long segments the
    span holds (the kernel packs segments to at least ``min_keys`` keys on the device)."""
    segments = 1
    while (base_programs * segments < target_programs and segments * 2 <= max_segments
           and key_span // (segments * 2) >= min_keys // 2):
        segments *= 2
    return segments


def tail_split(tiles: int, units: int) -> tuple[int, int]:
    """(whole tiles, split) for a grid of ``tiles`` equal tiles on ``units`` compute units:
    the tiles of the full rounds run whole, and when a last round would leave at most half
    the units busy (each unit then waits on a few that run one tile more), the hidden size
    of its tiles is split 4 ways (2 when that already gives more than 1.75 parts per unit;
    16 when the round holds at most ``units / 16`` tiles: a part per unit at most, and the
    parts' sum costs the merge one tile's read) so every unit takes a share; ``(0, 1)`` when
    nothing is split. Chosen by `dflash-rocm inspect`'s model (its figures: docs/performance.md)."""
    whole = tiles // units * units
    tail = tiles - whole
    if not whole or not tail or 2 * tail > units:
        return 0, 1
    split = 16 if 16 * tail <= units else 4 if 4 * tail <= 1.75 * units else 2
    return whole, split


def fill_split(tiles: int, hidden: int, block_k: int, target_programs: int) -> int:
    """A power of two for a grid of ``tiles`` too small to fill one round of the device (a
    rank's share of the heads under tensor parallelism): the hidden size of every tile split
    at least 2 ways, and further while the parts stay within ``target_programs`` (what the
    units hold at once, per the table), each part keeping 4 ``block_k`` steps (1: too narrow
    to split). The parts add into one float32 sum, as a last round's do."""
    split = 1
    while hidden // (split * 2) >= 4 * block_k and (split == 1 or tiles * split * 2 <= target_programs):
        split *= 2
    return split


def split_k_for(num_heads_total: int, hidden: int, block_k: int, compute_units: int) -> int:
    """A power of two: split the hidden size of a single token tile until the programs
    (heads x parts) would pass two per compute unit, keeping 4 key steps per part."""
    split_k = 1
    while num_heads_total * split_k * 2 <= 2 * compute_units and hidden // (split_k * 2) >= 4 * block_k:
        split_k *= 2
    return split_k


def default_attention_config(platform: Platform, *, num_seqs: int, query_len: int, key_span: int,
                             num_q_heads: int, num_kv_heads: int, head_dim: int,
                             fp8: bool) -> AttentionLaunchConfig:
    """The portable table: a request's query block in one tile where it fits (G x
    query_len rows, at most 64), key segments (powers of two, so only the segment count,
    a runtime argument, varies) until the grid covers every compute unit once, merged by
    the last segment when there are few. fp8 caches on NVIDIA take fp16 products (an e4m3
    pair widens to fp16 in one instruction there: :class:`AttentionLaunchConfig`)."""
    G = num_q_heads // num_kv_heads
    block_m = max(16, min(next_pow2(G * max(1, query_len)), 64 if head_dim <= 128 else 32), next_pow2(G))
    block_n = 64 if head_dim <= 128 else 32
    if platform.vendor == "cpu":
        # Interpreter: every loop step is Python; a larger key tile means fewer steps.
        block_n = 32
    tiles = attention_grid_tiles(num_seqs, query_len, block_m // G)
    segments = choose_segments(tiles * num_kv_heads, key_span, platform.compute_units, MIN_KEYS_PER_SEGMENT)
    merge, merge_rows = merge_for(num_segments=segments, tiles_heads=tiles * num_kv_heads, block_m=block_m,
                                  queries_per_kv=G, platform=platform)
    return AttentionLaunchConfig(block_m=block_m, block_n=block_n, num_segments=segments,
                                 num_warps=4 if head_dim <= 128 else 8, num_stages=2,
                                 wave_size=64 if platform.wave_size == 64 else 32,
                                 min_segment_keys=MIN_KEYS_PER_SEGMENT, merge=merge, merge_rows=merge_rows,
                                 fp16_dots=fp8 and platform.vendor == "cuda")


PAIRED_KV_ARCHS = ("sm_90", "sm_100")  # where the portable table puts a KV head's K and V in one program
# A grid of 128-token tiles that fills at most half the SMs splits every tile, up to one part an SM
# (the 8-warp tile's registers hold one); between half and one round it runs unsplit (modelled
# H200: 80 tiles 32.5 us unsplit, 36.3 split 2 ways).
FILL_UNDER = 0.5
FILL_PER_SM = 1


def default_precompute_config(platform: Platform, *, num_tokens: int, hidden: int, num_heads_total: int,
                              head_dim: int) -> PrecomputeLaunchConfig:
    """Up to 64 tokens in one tile, the hidden size split until the heads fill the
    device; larger N in 128-token tiles (fewer re-reads of the weight through L2), on
    Hopper and Blackwell with a KV head's K and V in one program once there are two token
    tiles (the states read half as often; with one token tile the halved grid would leave
    SMs idle). The two accumulators fit sm_90's and sm_100's registers (0 spills, compiled)
    but spill on sm_80 and sm_89 (60 spill stores, bf16), which keep one head row a program.
    Tiles too few for half a round of the SMs (a rank's heads under tensor parallelism) split
    the hidden size instead (:func:`fill_split`; modelled H200, TP8 N = 256: 39.8 -> 10.3 us), and
    K and V pair only where the unpaired tiles fill a round (TP8 N = 1024, 80 tiles: 39.8 us
    paired, 32.5 not)."""
    block_k = 64 if head_dim <= 128 else 32
    if num_tokens <= 64:
        block_t = max(16, next_pow2(num_tokens))
        return PrecomputeLaunchConfig(block_t=block_t, block_k=block_k,
                                      split_k=split_k_for(num_heads_total, hidden, block_k, platform.compute_units),
                                      num_warps=4, num_stages=2)
    block_t = 128 if head_dim <= 128 else 64
    tiles = -(-num_tokens // block_t) * num_heads_total
    if tiles < FILL_UNDER * platform.compute_units:
        split = fill_split(tiles, hidden, block_k, FILL_PER_SM * platform.compute_units)
        return PrecomputeLaunchConfig(block_t=block_t, block_k=block_k, split_k=split, num_warps=8, num_stages=2)
    heads = 2 if (platform.arch in PAIRED_KV_ARCHS and head_dim <= 128 and num_tokens > block_t
                  and tiles >= platform.compute_units) else 1
    return PrecomputeLaunchConfig(block_t=block_t, block_k=block_k, num_warps=8, num_stages=2, heads=heads)
