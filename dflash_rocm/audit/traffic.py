"""What every program of a launch reads and writes, kernel by kernel.

Each function mirrors its kernel's indexing (tiles, segments, split-K, early exits) for a
sweep case and returns the programs in dispatch order (``program_id(0)`` fastest, as the
hardware dispatcher walks the grid). A program names the chunks it reads (so the model
can tell a re-read served by a cache from a first read) and counts the bytes it writes.
A kernel without an entry here cannot be modelled: the audit says so instead of guessing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable

from dflash_rocm.backends.triton.launch import CapturedLaunch

from .sweep import BLOCK_SIZE, Case


@dataclass(frozen=True)
class Program:
    iterations: int  # hot-loop trips
    reads: tuple[tuple[Hashable, int], ...]  # (chunk, bytes): a chunk read twice is one datum read twice
    write_bytes: int
    chain: int = 1  # dependent global loads before the first streaming load (latency, not bandwidth)
    active: bool = True  # False: exits at once (an empty tile)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(launch: CapturedLaunch) -> tuple[int, int, int]:
    g = tuple(launch.grid) + (1, 1)
    return g[0], g[1], g[2]


def _order(launch: CapturedLaunch):
    """(x, y, z) program ids in dispatch order."""
    gx, gy, gz = _grid(launch)
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                yield x, y, z


def attention_programs(case: Case, launch: CapturedLaunch) -> list[Program]:
    c = launch.constexprs
    block_q, block_n, segments, G, D = c["BLOCK_Q"], c["BLOCK_N"], c["NUM_SEGMENTS"], c["G"], c["D"]
    kv_bytes = 1 if c["IS_FP8"] else 2
    q_len, seq_len, B = case.query_len, case.seq_len, case.batch
    window = case.shape.sliding_window
    context = seq_len - q_len
    first_tile = [b * q_len // block_q + b for b in range(B)]
    chain = 2 + math.ceil(math.log2(B + 1))  # binary search over query_start_loc, then seq_len, block table
    programs = []
    for tile, head, segment in _order(launch):
        b = max(i for i, first in enumerate(first_tile) if first <= tile) if tile >= first_tile[0] else 0
        tile_q0 = (tile - first_tile[b]) * block_q
        if tile_q0 >= q_len:
            programs.append(Program(0, (), 0, chain, active=False))
            continue
        rows = min(block_q, q_len - tile_q0) * G
        last_q = min(tile_q0 + block_q, q_len) - 1
        hi = min(seq_len, context + last_q + 1) if c["CAUSAL"] else seq_len
        lo = max(0, context + tile_q0 - window + 1) if c["HAS_WINDOW"] else 0
        per_segment = _cdiv(_cdiv(hi - lo, segments), block_n) * block_n
        seg_lo = lo + segment * per_segment
        keys = max(0, min(hi, seg_lo + per_segment) - seg_lo)
        reads = [(("q", b, tile, head), rows * D * 2)]
        if keys:
            reads += [(("kv", b, head, seg_lo, keys), 2 * keys * D * kv_bytes),
                      (("bt", b, seg_lo // BLOCK_SIZE), 4 * _cdiv(keys, BLOCK_SIZE))]
        written = rows * D * 2 if segments == 1 else rows * (4 * D + 8)
        programs.append(Program(_cdiv(keys, block_n), tuple(reads), written, chain))
    return programs


def merge_programs(case: Case, launch: CapturedLaunch) -> list[Program]:
    c = launch.constexprs
    D, S = c["D"], c["NUM_SEGMENTS"]
    return [Program(0, ((("part", token, head), S * (4 * D + 8)),), D * 2, 1) for token, head, _ in _order(launch)]


def _tokens_in(case: Case, t: int, block_t: int) -> int:
    return max(0, min(block_t, case.tokens - t * block_t))


def _epilogue_io(case: Case, c: dict, t: int, head_row: int) -> tuple[list, int]:
    """Reads (slots, positions, cos/sin) and cache writes of one finished tile."""
    s = case.shape
    rows = _tokens_in(case, t, c["BLOCK_T"])
    kind = (head_row // s.kv_heads) % 2
    cache_bytes = 1 if c["IS_FP8"] else 2
    reads = [(("slots", t), 8 * rows)]
    if kind == 0:
        reads += [(("pos", t), 8 * rows), (("cos_sin", t), 4 * rows * c["R"])]
    return reads, rows * c["D"] * cache_bytes


def precompute_programs(case: Case, launch: CapturedLaunch) -> list[Program]:
    c = launch.constexprs
    H, D, split, block_t, block_k = case.shape.hidden, c["D"], c["SPLIT_K"], c["BLOCK_T"], c["BLOCK_K"]
    k_per = _cdiv(_cdiv(H, split), block_k) * block_k
    programs = []
    for t, head_row, k in _order(launch):
        rows = _tokens_in(case, t, block_t)
        k_len = max(0, min(H, (k + 1) * k_per) - k * k_per)
        reads = [(("x", t, k), rows * k_len * 2), (("w", head_row, k), D * k_len * 2)]
        if split == 1:
            extra, written = _epilogue_io(case, c, t, head_row)
            reads += extra
        else:
            written = rows * D * 4 + (rows * 4 if head_row == 0 else 0)
        programs.append(Program(_cdiv(k_len, block_k), tuple(reads), written))
    return programs


def split_epilogue_programs(case: Case, launch: CapturedLaunch) -> list[Program]:
    c = launch.constexprs
    D, split = c["D"], c["SPLIT_K"]
    programs = []
    for t, head_row, _ in _order(launch):
        rows = _tokens_in(case, t, c["BLOCK_T"])
        extra, written = _epilogue_io(case, c, t, head_row)
        reads = [(("part", t, head_row), split * rows * D * 4), (("ss", t), split * rows * 4)] + extra
        programs.append(Program(0, tuple(reads), written))
    return programs


PROGRAMS: dict[str, Callable[[Case, CapturedLaunch], list[Program]]] = {
    "draft_attention_kernel": attention_programs,
    "merge_segments_kernel": merge_programs,
    "context_kv_kernel": precompute_programs,
    "context_kv_split_epilogue_kernel": split_epilogue_programs,
}


def programs_of(case: Case, launch: CapturedLaunch) -> list[Program]:
    try:
        model = PROGRAMS[launch.name]
    except KeyError:
        raise KeyError(f"no traffic model for kernel {launch.name}: add one to dflash_rocm.audit.traffic") from None
    return model(case, launch)
