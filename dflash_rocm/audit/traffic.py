"""What every program of a launch reads and writes, kernel by kernel.

Each function mirrors its kernel's indexing (tiles, segments, split-K, early exits) for a
sweep case and returns the programs in dispatch order (``program_id(0)`` fastest, as the
hardware dispatcher walks the grid). A program names the chunks it reads (so the model
can tell a re-read served by a cache from a first read) and counts the bytes it writes.
A kernel without an entry here cannot be modelled: the audit says so instead of guessing.
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Hashable

from dflash_rocm.backends.triton.attention_kernels import merge_segments_kernel
from dflash_rocm.launches import Launch

from .sweep import BLOCK_SIZE, Case


@dataclass(frozen=True)
class Program:
    iterations: int  # hot-loop trips
    reads: tuple[tuple[Hashable, int], ...]  # (chunk, bytes): a chunk read twice is one datum read twice
    write_bytes: int
    chain: int = 1  # dependent loads of cached index data before the first streaming load
    active: bool = True  # False: exits at once (an empty tile)
    remote_chain: int = 0  # dependent round trips to data other programs just wrote (merges)
    skips_peeled_trip: bool = False  # the kernel peels a masked last trip after the loop; this program has none
    role: str = ""  # "whole"/"part"/"merger": runs only the code of its role_variants() variant ("": all of it)
    remote_trips: bool = False  # each hot-loop trip waits on data other programs just wrote (a merge's loads)
    phase: int = 0  # a later phase runs after every program of the earlier ones ended (it waits on their work)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(launch: Launch) -> tuple[int, int, int]:
    g = tuple(launch.grid) + (1, 1)
    return g[0], g[1], g[2]


def _order(launch: Launch):
    """(x, y, z) program ids in dispatch order."""
    gx, gy, gz = _grid(launch)
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                yield x, y, z


def _tile_keys(case: Case, c: dict, tile: int) -> tuple[int, int, int, int] | None:
    """(request, first query of the tile, lo, hi) as the kernel's ``_tile_keys``; None for
    a tile past its request's queries."""
    q_len, seq_len = case.query_len, case.seq_len
    if c["ONE_TILE"]:
        b, tile_q0 = tile, 0
    else:
        first = [r * q_len // c["BLOCK_Q"] + r for r in range(case.batch)]
        b = bisect.bisect_right(first, tile) - 1
        tile_q0 = (tile - first[b]) * c["BLOCK_Q"]
    if b >= case.batch or tile_q0 >= q_len:
        return None
    context = seq_len - q_len
    hi = min(seq_len, context + min(tile_q0 + c["BLOCK_Q"], q_len)) if c["CAUSAL"] else seq_len
    lo = 0
    if c["HAS_WINDOW"]:  # rounded down to a key tile, as the kernel does
        lo = max(0, context + tile_q0 - case.shape.sliding_window + 1) // c["BLOCK_N"] * c["BLOCK_N"]
    return b, tile_q0, lo, hi


def _segment_plan(lo: int, hi: int, segments: int, min_keys: int, block_n: int) -> tuple[int, int]:
    per_segment = _cdiv(max(_cdiv(hi - lo, segments), min_keys), block_n) * block_n
    return per_segment, _cdiv(hi - lo, per_segment)


def _index_chain(case: Case, c: dict, block_table: bool = True) -> int:
    """Dependent loads before the first streaming load: the request search (unless one tile
    per request), seq_len/query_start_loc, the block table (the merge reads none)."""
    return 1 + block_table + (0 if c["ONE_TILE"] else math.ceil(math.log2(case.batch + 1)))


def attention_programs(case: Case, launch: Launch) -> list[Program]:
    c = launch.constexprs
    block_q, block_n, G, D = c["BLOCK_Q"], c["BLOCK_N"], c["G"], c["D"]
    segments, min_keys = launch.arg("num_segments"), launch.arg("min_segment_keys")
    kv_bytes = 1 if c["IS_FP8"] else 2
    chain = _index_chain(case, c)
    mergers = c["MERGERS"]
    programs = []
    for tile, head, segment in _order(launch):
        keys = _tile_keys(case, c, tile)
        if keys is None:
            programs.append(Program(0, (), 0, chain, active=False))
            continue
        b, tile_q0, lo, hi = keys
        per_segment, active = _segment_plan(lo, hi, segments, min_keys, block_n) if c["SPLIT"] else (hi - lo, 1)
        if segment >= segments:  # a merger at the grid's end: after the segments, it merges its rows
            group_rows = c["BLOCK_M"] // mergers
            rows = max(0, min(group_rows, (case.query_len - tile_q0) * G - (segment - segments) * group_rows))
            if active == 1:
                programs.append(Program(0, (), 0, chain, active=False))
                continue
            # It has found its tile while the segments ran; then it sees the last arrival (one
            # round trip) and loads MERGE_CHUNK segments a trip (a merger without rows only waits).
            part = rows * (2 * D + 4)
            programs.append(Program(_cdiv(active, c["MERGE_CHUNK"]) if rows else 0,
                                    tuple((("part", tile, head, s, segment), part) for s in range(active) if rows),
                                    rows * D * 2, 0, remote_chain=1, role="merger", remote_trips=True, phase=1))
            continue
        if segment >= active:
            programs.append(Program(0, (), 0, chain, active=False))
            continue
        rows = min(block_q, case.query_len - tile_q0) * G
        seg_lo = lo + segment * per_segment
        n = min(hi, seg_lo + per_segment) - seg_lo
        reads = [(("q", b, tile, head), rows * D * 2), (("kv", b, head, seg_lo, n), 2 * n * D * kv_bytes),
                 (("bt", b, seg_lo // BLOCK_SIZE), 4 * _cdiv(n, BLOCK_SIZE))]
        part = rows * (2 * D + 4)
        written, remote = (rows * D * 2, 0) if active == 1 else (part, 0)
        last_merges = active > 1 and c["MERGE_IN_KERNEL"]
        if last_merges and segment == active - 1:  # modelled as the last to arrive
            reads += [(("part", tile, head, s), part) for s in range(active)]
            written, remote = part + rows * D * 2, _cdiv(active, c["MERGE_CHUNK"])  # one round trip per load
        programs.append(Program(n // block_n, tuple(reads), written, chain, remote_chain=remote,
                                skips_peeled_trip=n % block_n == 0,
                                role="part" if active > 1 and (mergers or last_merges and segment < active - 1)
                                else ""))
    return programs


def merge_programs(case: Case, launch: Launch) -> list[Program]:
    c = launch.constexprs
    segments, min_keys = launch.arg("num_segments"), launch.arg("min_segment_keys")
    chain = _index_chain(case, c, block_table=False)
    programs = []
    for tile, head, group in _order(launch):
        keys = _tile_keys(case, c, tile)
        active = 1 if keys is None else _segment_plan(keys[2], keys[3], segments, min_keys, c["BLOCK_N"])[1]
        rows = 0 if keys is None else min(c["ROWS"], case.query_len * c["G"] - keys[1] * c["G"] - group * c["ROWS"])
        if active == 1 or rows <= 0:
            programs.append(Program(0, (), 0, chain, active=False))
            continue
        part = rows * (2 * c["D"] + 4)
        programs.append(Program(_cdiv(active, c["MERGE_CHUNK"]),  # one trip per load of MERGE_CHUNK segments
                                tuple((("part", tile, head, group, s), part) for s in range(active)),
                                rows * c["D"] * 2, chain, remote_trips=True))
    return programs


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


def xcd_order(pid: int, num_programs: int, xcds: int) -> int:
    """The kernels' ``_xcd_order``: the logical program hardware program ``pid`` runs."""
    if xcds == 1:
        return pid
    per, extra = divmod(num_programs, xcds)
    xcd, local = pid % xcds, pid // xcds
    return xcd * (per + 1) + local if xcd < extra else extra * (per + 1) + (xcd - extra) * per + local


def precompute_tile(pid: int, num_programs: int, whole_tiles: int, split: int, xcds: int) -> tuple[int, int, int]:
    """The kernels' ``_program_tile``: (tile, part, parts) hardware program ``pid`` runs."""
    if split == 1:
        return xcd_order(pid, num_programs, xcds), 0, 1
    if pid < whole_tiles:
        return xcd_order(pid, whole_tiles, xcds), 0, 1
    q = xcd_order(pid - whole_tiles, num_programs - whole_tiles, xcds)
    return whole_tiles + q // split, q % split, split


def precompute_programs(case: Case, launch: Launch) -> list[Program]:
    c = launch.constexprs
    H, D, split, block_t, block_k = case.shape.hidden, c["D"], c["SPLIT_K"], c["BLOCK_T"], c["BLOCK_K"]
    grid_t, whole, total = launch.arg("grid_t"), launch.arg("whole_tiles"), launch.grid[0]
    programs = []
    heads = c["HEADS"]
    for pid in range(total):  # hardware dispatch order
        tile, k, parts = precompute_tile(pid, total, whole, split, c["NUM_XCDS"])
        t, head_row = tile % grid_t, tile // grid_t
        rows_of = [head_row]
        if heads == 2:  # K and V of one KV head
            head_row = head_row // case.shape.kv_heads * 2 * case.shape.kv_heads + head_row % case.shape.kv_heads
            rows_of = [head_row, head_row + case.shape.kv_heads]
        k_per = _cdiv(_cdiv(H, parts), block_k) * block_k
        rows = _tokens_in(case, t, block_t)
        k_len = max(0, min(H, (k + 1) * k_per) - k * k_per)
        reads = [(("x", t, k, parts), rows * k_len * 2)]
        if c.get("FP8_WEIGHTS"):  # fp8 rows (1 byte), and the float32 norm weight's columns per trip
            reads += [(("w", r, k, parts), D * k_len) for r in rows_of]
            layer = head_row // (2 * case.shape.kv_heads) if c.get("NORM_ROWS", 1) > 1 else 0
            reads.append((("norm", layer, k, parts), k_len * 4))
        else:
            reads += [(("w", r, k, parts), D * k_len * 2) for r in rows_of]
        remote = 0
        if parts == 1:
            written = 0
            for r in rows_of:
                extra, cache_written = _epilogue_io(case, c, t, r)
                reads += extra
                written += cache_written
        else:
            part_bytes = block_t * (c["BLOCK_D"] + 1) * 4  # a part writes (or adds) whole tiles
            written = part_bytes
            if c["MERGE_IN_KERNEL"] and k == parts - 1:  # modelled as the last part to arrive
                extra, cache_written = _epilogue_io(case, c, t, head_row)
                if c["ATOMIC_SUM"]:  # the parts' one sum, read and zeroed
                    reads += extra + [(("sum", tile), part_bytes)]
                    written += part_bytes
                else:
                    reads += extra + [(("part", tile, s), part_bytes) for s in range(parts)]
                written += cache_written
                remote = 1
        role = "whole" if parts == 1 else "part" if c["MERGE_IN_KERNEL"] and k < parts - 1 else ""
        programs.append(Program(_cdiv(k_len, block_k), tuple(reads), written, remote_chain=remote, role=role))
    return programs


PROGRAMS: dict[str, Callable[[Case, Launch], list[Program]]] = {
    "draft_attention_kernel": attention_programs,
    "merge_segments_kernel": merge_programs,
    "context_kv_kernel": precompute_programs,
}


def role_variants(launch: Launch) -> dict[str, Launch]:
    """The launch compiled as the programs of each role (see :class:`Program`) run it, where
    a program runs less than the launch's longest path: a split part that does not merge
    runs the kernel without the in-kernel merge and the merger programs ("part"); a
    precompute tile ahead of the split ones runs the kernel without the split ("whole").
    A merger program at the end of the attention grid runs the merge kernel's code (plus
    the wait): its variant is the merge kernel with the merger's rows ("merger"). The
    model charges each program the straight-line code and hot loop of its role's variant
    (each variant leaves out the other roles' code too)."""
    c, variants = launch.constexprs, {}
    if launch.name == "draft_attention_kernel" and c["SPLIT"] and (c["MERGE_IN_KERNEL"] or c["MERGERS"]):
        variants["part"] = dataclasses.replace(launch, constexprs={**c, "MERGE_IN_KERNEL": False, "MERGERS": 0})
    if launch.name == "draft_attention_kernel" and c["SPLIT"] and c["MERGERS"]:
        variants["merger"] = _merger_launch(launch)
    if launch.name == "context_kv_kernel" and c["SPLIT_K"] > 1:
        alone = {"MERGE_IN_KERNEL": False, "HAS_WHOLE": False}
        if c["MERGE_IN_KERNEL"]:
            variants["part"] = dataclasses.replace(launch, constexprs={**c, **alone})
        if c["HAS_WHOLE"]:
            variants["whole"] = dataclasses.replace(launch, constexprs={**c, "SPLIT_K": 1, **alone})
    return variants


def trip_matrix_flops(launch: Launch) -> int:
    """The matrix FLOPs one hot-loop trip of a program does (0: a kernel without matrix
    work): the precompute's ``[BLOCK_T, BLOCK_K] x [BLOCK_K, BLOCK_D]`` step per head row, the
    attention's two ``BLOCK_M x BLOCK_N x BLOCK_D`` products."""
    c = launch.constexprs
    if launch.name == "context_kv_kernel":
        return 2 * c["BLOCK_T"] * c["BLOCK_K"] * c["BLOCK_D"] * c["HEADS"]
    if launch.name == "draft_attention_kernel":
        return 2 * 2 * c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_D"]
    return 0


def _merger_launch(launch: Launch) -> Launch:
    """The merge kernel launched as the attention launch's merger programs run it: the
    same arguments by name, ``ROWS`` the merger's rows."""
    constexprs = {**launch.constexprs, "ROWS": launch.constexprs["BLOCK_M"] // launch.constexprs["MERGERS"]}
    names = inspect.signature(merge_segments_kernel.fn).parameters
    return Launch(merge_segments_kernel, launch.grid, tuple(launch.arg(n) for n in names if n not in constexprs),
                  {n: constexprs[n] for n in names if n in constexprs}, launch.options)


def programs_of(case: Case, launch: Launch, models: dict | None = None) -> list[Program]:
    """The programs of ``launch`` by its kernel's traffic model in ``models`` (default:
    this package's kernels, :data:`PROGRAMS`; ``dflash_rocm.peer.traffic`` has vLLM's)."""
    models = PROGRAMS if models is None else models
    try:
        model = models[launch.name]
    except KeyError:
        raise KeyError(f"no traffic model for kernel {launch.name}: add one beside the others "
                       f"({', '.join(sorted(models))})") from None
    return model(case, launch)
