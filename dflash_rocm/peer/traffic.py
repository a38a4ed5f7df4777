"""What every program of vLLM's own attention launches reads and writes.

The counterpart of :mod:`dflash_rocm.audit.traffic` for vLLM 0.34's kernels: each
function mirrors its kernel's indexing (the q-block search, early exits, the tile-loop
bounds of ``compute_tile_loop_bounds`` with sliding-window pruning and 3D segments, the
prefix kernel's full context scan) for a sweep case and returns the programs in dispatch
order, for the audit's model (:func:`dflash_rocm.audit.model.model_launch`). Arguments
are read from the recorded launch by name (:mod:`.capture` keeps every parameter).
"""

from __future__ import annotations

import bisect
import math
from typing import Callable

from dflash_rocm.audit.sweep import BLOCK_SIZE, Case
from dflash_rocm.audit.traffic import Program
from dflash_rocm.launches import Launch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _order(launch: Launch):
    g = tuple(launch.grid) + (1, 1)
    for z in range(g[2]):
        for y in range(g[1]):
            for x in range(g[0]):
                yield x, y, z


def _search_chain(case: Case) -> int:
    """Dependent loads before the first streaming load: the binary search over
    ``query_start_loc``, the request's lengths, the block table."""
    return 2 + math.ceil(math.log2(case.batch + 1))


def _kv_bytes(launch: Launch, name: str) -> int:
    return launch.arg(name).element_size()


def tile_bounds(case: Case, launch: Launch, q_local: int, segment: int) -> tuple[int, int]:
    """``compute_tile_loop_bounds`` of one program: its [first, last) key tile."""
    arg = launch.arg
    tile, block_q, block_m, G = arg("TILE_SIZE"), arg("BLOCK_Q"), arg("BLOCK_M"), arg("num_queries_per_kv")
    window, causal = arg("SLIDING_WINDOW"), arg("USE_CAUSAL")
    q_len, seq_len = case.query_len, case.seq_len
    context = seq_len - q_len
    prefix = seq_len if not causal else min(context + q_local * block_q + (block_m - 1) // G + 1, seq_len)
    num_tiles = _cdiv(prefix, tile)
    start, end = 0, num_tiles
    if window > 0:
        q_lo = q_local * block_q
        q_hi = min(q_lo + (block_m - 1) // G, q_len - 1)
        first = context + q_lo - window + 1
        last = min(context + q_hi + (window - 1 if not causal else 0), seq_len - 1)
        start, end = max(0, first // tile), min(last // tile + 1, num_tiles)
    if arg("IS_3D"):
        per_segment = _cdiv(seq_len, arg("NUM_SEGMENTS_PER_SEQ") * tile)
        start, end = max(segment * per_segment, start), min((segment + 1) * per_segment, end)
    return start, end


def unified_programs(case: Case, launch: Launch) -> list[Program]:
    """``kernel_unified_attention``: one program per (q block, KV head[, segment])."""
    arg = launch.arg
    tile, block_q, G, D = arg("TILE_SIZE"), arg("BLOCK_Q"), arg("num_queries_per_kv"), arg("HEAD_SIZE")
    padded, is_3d = arg("HEAD_SIZE_PADDED"), arg("IS_3D")
    kv = _kv_bytes(launch, "key_cache_ptr")
    q_len, seq_len = case.query_len, case.seq_len
    first = [r * q_len // block_q + r for r in range(case.batch)]
    chain = _search_chain(case)
    programs = []
    for x, head, segment in _order(launch):
        r = bisect.bisect_right(first, x) - 1
        q_local = x - first[r]
        per_segment = _cdiv(seq_len, arg("NUM_SEGMENTS_PER_SEQ") * tile) if is_3d else 0
        if q_local * block_q >= q_len or (is_3d and segment * per_segment * tile >= seq_len):
            programs.append(Program(0, (), 0, chain, active=False))
            continue
        lo, hi = tile_bounds(case, launch, q_local, segment)
        trips = max(0, hi - lo)
        keys = max(0, min(seq_len, hi * tile) - lo * tile)
        rows = min(block_q, q_len - q_local * block_q) * G
        reads = ((("q", r, q_local, head), rows * D * 2), (("kv", r, head, lo, hi), 2 * keys * D * kv),
                 (("bt", r, lo, hi), 4 * _cdiv(keys, BLOCK_SIZE)))
        written = rows * (padded * 4 + 8) if is_3d else rows * D * 2
        programs.append(Program(trips, reads, written, chain))
    return programs


def reduce_programs(case: Case, launch: Launch) -> list[Program]:
    """``reduce_segments``: one program per (query token, query head), merging the
    segments that ran (``act_num_segments``) from the partials the 3D launch wrote."""
    arg = launch.arg
    tile, segments, D, padded = arg("TILE_SIZE"), arg("NUM_SEGMENTS_PER_SEQ"), arg("HEAD_SIZE"), arg("HEAD_SIZE_PADDED")
    per_segment = _cdiv(case.seq_len, segments * tile)
    active = _cdiv(case.seq_len, per_segment * tile)
    chain = 1 + math.ceil(math.log2(case.batch + 1))
    programs = []
    for token, head, _ in _order(launch):
        reads = tuple((("segm", token, head, s), padded * 4 + 8) for s in range(active))
        programs.append(Program(0, reads, D * 2, chain, remote_chain=1))
    return programs


def prefix_programs(case: Case, launch: Launch) -> list[Program]:
    """``prefix_prefill._fwd_kernel``: one program per (request, query head, 128-row
    block); each scans the whole cached context in ``BLOCK_SIZE``-key trips (a sliding
    window only masks), then the block's own keys; the query heads of one KV head read
    the same keys."""
    arg = launch.arg
    block_m, step, D = arg("BLOCK_M"), arg("BLOCK_SIZE"), arg("BLOCK_DMODEL")
    G, block_n = arg("num_queries_per_kv"), arg("BLOCK_N")
    kv = _kv_bytes(launch, "K_cache")
    q_len, context = case.query_len, case.context
    programs = []
    for b, head, m in _order(launch):  # a block past the queries still scans the context
        rows = max(0, min(block_m, q_len - m * block_m))
        kv_head = head // G
        trips = _cdiv(context, step) + _cdiv(q_len, block_n)
        reads = ((("q", b, head, m), rows * D * 2), (("kv", b, kv_head), 2 * context * D * kv),
                 (("new", b, kv_head), 2 * q_len * D * 2), (("bt", b), 4 * _cdiv(context, BLOCK_SIZE)))
        programs.append(Program(trips, reads, rows * D * 2, 2))
    return programs


def filtered_programs(case: Case, launch: Launch) -> list[Program]:
    """``kernel_paged_attention_2d`` with ``filter_by_query_len``: every program of a
    request with more than one query row returns after reading its query range."""
    return [Program(0, (), 0, 1, active=False) for _ in _order(launch)]


PROGRAMS: dict[str, Callable[[Case, Launch], list[Program]]] = {
    "kernel_unified_attention": unified_programs,
    "reduce_segments": reduce_programs,
    "_fwd_kernel": prefix_programs,
    "kernel_paged_attention_2d": filtered_programs,
}


def trip_matrix_flops(launch: Launch) -> int:
    """Matrix FLOPs of one hot-loop trip (QK^T and PV of one key tile); 0 without a loop."""
    if launch.name == "kernel_unified_attention":
        return 4 * launch.arg("BLOCK_M") * launch.arg("TILE_SIZE") * launch.arg("HEAD_SIZE_PADDED")
    if launch.name == "_fwd_kernel":
        return 4 * launch.arg("BLOCK_M") * launch.arg("BLOCK_SIZE") * launch.arg("BLOCK_DMODEL_PADDED")
    return 0
