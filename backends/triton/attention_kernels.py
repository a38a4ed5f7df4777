"""Triton kernels of the paged draft attention: a split-KV main kernel and a merge kernel.

Tile rows pack the ``G`` query heads that share one KV head (row ``r`` is query token
``r // G``, head ``kv_head * G + r % G``): a DFlash step has only ~16 queries per request,
and packing the group is what gives ``tl.dot`` enough rows. The grid is
(query tiles, KV heads, key segments). When every request's query block fits one tile
(``ONE_TILE``) tile ``b`` is request ``b``; otherwise tiles are numbered as in vLLM's
unified attention (request ``b``'s tiles start at ``query_start_loc[b] // BLOCK_Q + b``)
and a program finds its request by binary search, so no host sync sizes the grid.

Key segments: the keys visible to a tile are cut into ``num_segments`` equal,
``BLOCK_N``-aligned shares of at least ``min_segment_keys`` keys, decided on the device
from the real sequence length, so segments past the end exit at once and a short
sequence in a table sized for long ones is not split at all. A split tile writes, per
segment, its normalised output in the output dtype and one float32 log2-sum-exp per row,
then counts its arrival on the tile's counter (one per tile and KV head). The partials are
merged (the launch config's ``merge``) by the last segment to finish (``MERGE_IN_KERNEL``:
one program reads every partial of the tile, so only for a few segments); or by
``MERGERS`` merger programs per tile at the end of the grid (``program_id(2) >=
num_segments``), each waiting on the counter and then merging one row group (the last
merger to finish resets the counter; the host launches this only where every dispatch
partition keeps a compute unit free of mergers, so segments always find room to run); or
by a second launch.

Packed pages (:mod:`dflash_rocm.paged`): K and V are each addressed as the 6-D view
``[blocks, bs // R, R, Hk, D // C, C]`` with constexpr pack factors (``K_ROW_PACK``,
``K_DIM_PACK``, ``V_ROW_PACK``, ``V_DIM_PACK``). A factor of 1 takes the one-stride path
and its in-pack stride is passed as ``None`` (a constexpr, not a launch argument), so a
plain cache compiles to the plain kernel. ``K_UNIT``/``V_UNIT``: a packed cache whose packs
are contiguous 16-byte runs at 16-byte aligned offsets (vLLM's ROCM_ATTN pages) has its
other strides passed in 16-byte units (``UNIT`` elements) and scaled back in the kernel:
the compiler then proves every run aligned and loads it as one vector, which it cannot
from a bf16 row stride of 8 elements (a ``multiple_of`` hint would not survive the AMD
backend's rewrite of the offsets into buffer loads). 1 = strides in elements.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .common import packed_offset

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


# Groups the kernels build once and the helpers read by name. Constexpr groups are
# annotated ``tl.constexpr`` where a kernel builds them (a plain assignment would turn
# their members into runtime values); their members are constexprs wherever they are read.

class CacheLayout(NamedTuple):
    """Constexprs: how one cache is packed (module docstring)."""

    ROW_PACK: tl.constexpr  # rows per pack (1: not packed)
    DIM_PACK: tl.constexpr  # dims per pack (1: not packed)
    UNIT: tl.constexpr  # elements per unit of the block, row and dim strides (1: elements)


class AttendMode(NamedTuple):
    """Constexprs of the key loop (:func:`_attend`): the kernel's, by their names there."""

    BLOCK_N: tl.constexpr
    BLOCK_SIZE: tl.constexpr
    CAUSAL: tl.constexpr
    HAS_WINDOW: tl.constexpr
    IS_FP8: tl.constexpr
    FP32_MATH: tl.constexpr
    K_AT_LOAD: tl.constexpr  # an fp8 K tile is widened in its load layout (:func:`_in_load_layout`)
    K_LAYOUT: tl.constexpr  # CacheLayout of the K cache
    V_LAYOUT: tl.constexpr  # CacheLayout of the V cache


class HeadDims(NamedTuple):
    """Constexprs of the merge (:func:`_merge_rows`): the kernels', by their names there."""

    HQ: tl.constexpr
    D: tl.constexpr
    BLOCK_D: tl.constexpr


class Query(NamedTuple):
    """A tile's queries as the key loop reads them."""

    q: tl.tensor  # [BLOCK_M, BLOCK_D] the queries
    qk_scale: tl.tensor  # the scale of their scores (log2 units)
    pos: tl.tensor  # [BLOCK_M] each row's position
    d: tl.tensor  # [BLOCK_D] the head-dim lanes
    d_ok: tl.tensor  # which of them are real
    window: tl.tensor  # the sliding window in keys
    first_key: tl.tensor  # the first key a row of the tile sees through it


class CacheHead(NamedTuple):
    """One cache at one KV head: its pointer there and its strides (see the kernel's)."""

    ptr: tl.tensor
    stride_b: tl.tensor  # block
    stride_s: tl.tensor  # row (of a pack when packed)
    stride_s_in: tl.tensor  # row in a pack (None: not packed)
    stride_d: tl.tensor  # dim (of a pack when packed)
    stride_d_in: tl.tensor  # dim in a pack (None: not packed)


class Output(NamedTuple):
    """The output tensor and its strides."""

    ptr: tl.tensor
    stride_t: tl.tensor  # token
    stride_h: tl.tensor  # head
    stride_d: tl.tensor  # dim


class Partials(NamedTuple):
    """A split tile's partials (see the kernel's ``part_out_ptr``/``part_lse_ptr``)."""

    out_ptr: tl.tensor
    lse_ptr: tl.tensor
    num_tokens: tl.tensor


@triton.jit
def _find_request(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The request owning query tile ``tile``: the last ``b`` whose first tile
    ``qsl[b] // BLOCK_Q + b`` is <= ``tile``."""
    lo: tl.int32 = 0  # loop-carried: typed so the compiled loop keeps one type
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tile_keys(qsl_ptr, seq_lens_ptr, num_seqs, tile, window, BLOCK_Q: tl.constexpr, ONE_TILE: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """(request, its first token, its query length, the tile's first query, the request's
    context length, and the key range [lo, hi) visible to some row of the tile). ``lo``
    is a multiple of ``BLOCK_N`` (a window's first key rounded down; the window mask hides
    the keys before it), so every key tile starts on a multiple of ``BLOCK_N``."""
    if ONE_TILE:
        b = tile
    else:
        b = _find_request(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    if ONE_TILE:
        tile_q0 = 0
    else:
        tile_q0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    context = tl.load(seq_lens_ptr + b) - q_len
    hi = context + q_len
    if CAUSAL:
        hi = tl.minimum(hi, context + tl.minimum(tile_q0 + BLOCK_Q, q_len))
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, context + tile_q0 - window + 1) // BLOCK_N * BLOCK_N
    return b, q_start, q_len, tile_q0, context, lo, hi


@triton.jit
def _segment_plan(lo, hi, num_segments, min_segment_keys, BLOCK_N: tl.constexpr):
    """(keys per segment, segments that have keys) for the key range [lo, hi)."""
    per_segment = tl.cdiv(tl.maximum(tl.cdiv(hi - lo, num_segments), min_segment_keys), BLOCK_N) * BLOCK_N
    return per_segment, tl.cdiv(hi - lo, per_segment)


@triton.jit
def _rows(tile_q0, q_start, q_len, kv_head, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Per tile row: its token (int64), query head, and whether it is a real query."""
    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_q0 + rows // G
    ok = (rows // G < BLOCK_Q) & (q_idx < q_len)
    return (q_start + q_idx).to(tl.int64), kv_head * G + rows % G, ok, q_idx


@triton.jit
def _finish(acc, m_i, l_i, head, row_ok, sinks_ptr, v_scale, HAS_SINKS: tl.constexpr):
    """The normalised output of one tile from its running max/sum (log2 space), the
    sink entering the denominator once."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m_all = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_all)
        l_i = l_i * alpha + tl.exp2(sink - m_all)
        acc = acc * alpha[:, None]
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    return acc * (v_scale / l_i)[:, None]


@triton.jit
def _wait_for(counter, count):
    """Spin until ``counter`` reaches ``count`` (acquire: what the arrivals wrote before
    their release is visible after)."""
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < count:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@triton.jit
def _out_ptrs(out, token, head, d):
    """Pointers to ``out[token, head, d]`` (``out``: an :class:`Output`)."""
    return out.ptr + token[:, None] * out.stride_t + head[:, None] * out.stride_h + d[None, :] * out.stride_d


@triton.jit
def _merge_rows(parts, out, sinks_ptr, token, head, row_ok, active, DIMS, ROWS: tl.constexpr,
                SEG_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr):
    """``out`` of ``ROWS`` tile rows from the ``active`` segments' normalised partials and
    log2-sum-exps, ``SEG_CHUNK`` segments per load (one round trip each). ``parts``: the
    :class:`Partials`; ``out``: the :class:`Output`; ``DIMS``: the :class:`HeadDims`."""
    HQ: tl.constexpr = DIMS.HQ
    D: tl.constexpr = DIMS.D
    d = tl.arange(0, DIMS.BLOCK_D)
    d_ok = d < D
    c = tl.arange(0, SEG_CHUNK)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    acc = tl.zeros([ROWS, DIMS.BLOCK_D], tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for s0 in range(0, active, SEG_CHUNK):
        seg_ok = (s0 + c < active)[:, None] & row_ok[None, :]
        part = ((s0 + c)[:, None] * parts.num_tokens + token[None, :]) * HQ + head[None, :]  # [SEG_CHUNK, ROWS]
        lse = tl.load(parts.lse_ptr + part, mask=seg_ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(parts.out_ptr + part[:, :, None] * D + d[None, None, :], mask=seg_ok[:, :, None] & d_ok,
                    other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_safe[None, :])
        alpha = tl.exp2(m - m_safe)
        acc = acc * alpha[:, None] + tl.sum(o.to(tl.float32) * w[:, :, None], 0)
        total = total * alpha + tl.sum(w, 0)
        m = m_new
    o = _finish(acc=acc, m_i=m, l_i=total, head=head, row_ok=row_ok, sinks_ptr=sinks_ptr, v_scale=1.0,
                HAS_SINKS=HAS_SINKS)
    tl.store(_out_ptrs(out, token, head, d), o.to(out.ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_group(parts, out, sinks_ptr, group, tile_q0, q_start, q_len, kv_head, active, DIMS, G: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_Q: tl.constexpr, MERGE_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Merge row group ``group`` (``ROWS`` rows) of a split tile."""
    r = group * ROWS + tl.arange(0, ROWS)
    q_idx = tile_q0 + r // G
    row_ok = (r // G < BLOCK_Q) & (q_idx < q_len)
    _merge_rows(parts=parts, out=out, sinks_ptr=sinks_ptr, token=(q_start + q_idx).to(tl.int64),
                head=kv_head * G + r % G, row_ok=row_ok, active=active, DIMS=DIMS, ROWS=ROWS, SEG_CHUNK=MERGE_CHUNK,
                HAS_SINKS=HAS_SINKS)


@triton.jit
def _row_base(cache, LAYOUT, block, j, row, BLOCK_SIZE: tl.constexpr):
    """Pointer to the first element of key ``j`` (row ``row`` of block ``block``) in
    ``cache`` (a :class:`CacheHead`; ``LAYOUT``: its :class:`CacheLayout`): one 64-bit base
    per block (block * block stride), everything inside a block 32-bit. Packed rows are
    split from ``j`` itself (the pack divides the block size): the compiler then sees runs
    of ``ROW_PACK`` contiguous rows and loads them as vectors (split from ``row``, it loads
    bytes). ``UNIT``: the strides but the in-pack one come in units of ``UNIT`` elements
    (16 bytes, see the module docstring)."""
    ROW_PACK: tl.constexpr = LAYOUT.ROW_PACK
    UNIT: tl.constexpr = LAYOUT.UNIT
    if ROW_PACK == 1 and UNIT == 1:
        return cache.ptr + block * cache.stride_b + row * cache.stride_s
    elif ROW_PACK == 1:
        return cache.ptr + block * cache.stride_b * UNIT + row * cache.stride_s * UNIT
    else:
        outer = j // ROW_PACK % (BLOCK_SIZE // ROW_PACK)
        return cache.ptr + block * cache.stride_b * UNIT + (outer * cache.stride_s * UNIT
                                                            + (j % ROW_PACK) * cache.stride_s_in)


@triton.jit
def _key_blocks(table, start, seg_hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """(cache block, row in it) of the keys ``start + arange(BLOCK_N)``, ``start`` a multiple
    of ``BLOCK_N``. A tile inside one block (``BLOCK_SIZE`` a multiple of ``BLOCK_N``) reads
    one table entry, a scalar; a tile of whole blocks reads one entry per block, with the
    row a constant of the lane; otherwise each key finds its own block."""
    a = tl.arange(0, BLOCK_N)
    if BLOCK_SIZE % BLOCK_N == 0:
        block = tl.load(table + start // BLOCK_SIZE).to(tl.int64)
        row = start % BLOCK_SIZE + a
    else:
        if BLOCK_N % BLOCK_SIZE == 0:
            index = start // BLOCK_SIZE + a // BLOCK_SIZE
            row = a % BLOCK_SIZE
        else:
            index = (start + a) // BLOCK_SIZE
            row = (start + a) % BLOCK_SIZE
        if MASKED:
            block = tl.load(table + index, mask=start + a < seg_hi, other=0).to(tl.int64)
        else:
            block = tl.load(table + index).to(tl.int64)
    return block, row


@triton.jit
def _dim_offset(cache, LAYOUT, d):
    """Offset of head dim ``d`` in ``cache`` (see :func:`_row_base` for ``UNIT``)."""
    DIM_PACK: tl.constexpr = LAYOUT.DIM_PACK
    UNIT: tl.constexpr = LAYOUT.UNIT
    if UNIT == 1:
        return packed_offset(d, cache.stride_d, cache.stride_d_in, DIM_PACK)
    elif DIM_PACK == 1:
        return d * cache.stride_d * UNIT
    else:
        return (d // DIM_PACK) * cache.stride_d * UNIT + (d % DIM_PACK) * cache.stride_d_in


@triton.jit
def _in_load_layout(x):
    """``x`` itself, through a select on ``program_id(2) >= 0`` (always true), so that what
    is computed from it stays in ``x``'s layout (the load's) rather than the dot operand's.

    Triton's layout pass moves the conversion of a dot operand up to the operand's load
    past every elementwise op whose leaves are loads or constants, so an fp8 tile's widening
    runs in the operand layout: once per warp, each warp holding the whole tile (4 times the
    work of widening the tile once on CDNA's 4-warp tiles). A splat of a runtime value is
    such a leaf no more: the conversion then stays at the dot, after the widening. The
    select costs nothing compiled on AMD: the fold-true-cmpi pass folds the comparison once
    the layouts are chosen (no select left in the loop, compiled gfx942/gfx950/gfx1201)."""
    return tl.where(tl.program_id(2) >= 0, x, 0.0)


@triton.jit
def _attend(acc, m_i, l_i, query, table, k_cache, v_cache, start, seg_hi, MASKED: tl.constexpr, MODE):
    """One key tile: load K/V through the block table, online-softmax update.

    ``query``: the tile's :class:`Query`. ``k_cache``/``v_cache``: each cache's
    :class:`CacheHead` at this KV head. ``MODE``: the :class:`AttendMode` (constexprs,
    each cache's :class:`CacheLayout` among them).

    ``MASKED`` only for a tile that reaches past the segment's end (the last one). With a
    window, the value rows before ``first_key`` (no row of the tile sees them) load as
    zeros: their weight is 0, and 0 times a NaN or Inf stored there would still reach the
    sum."""
    BLOCK_N: tl.constexpr = MODE.BLOCK_N
    BLOCK_SIZE: tl.constexpr = MODE.BLOCK_SIZE
    CAUSAL: tl.constexpr = MODE.CAUSAL
    HAS_WINDOW: tl.constexpr = MODE.HAS_WINDOW
    IS_FP8: tl.constexpr = MODE.IS_FP8
    FP32_MATH: tl.constexpr = MODE.FP32_MATH
    K_AT_LOAD: tl.constexpr = MODE.K_AT_LOAD
    q = query.q
    qk_scale = query.qk_scale
    pos = query.pos
    d = query.d
    d_ok = query.d_ok
    j = start + tl.arange(0, BLOCK_N)
    j_ok = j < seg_hi
    block, row = _key_blocks(table=table, start=start, seg_hi=seg_hi, BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE,
                             MASKED=MASKED)
    k_rows = _row_base(cache=k_cache, LAYOUT=MODE.K_LAYOUT, block=block, j=j, row=row, BLOCK_SIZE=BLOCK_SIZE)
    k_dims = _dim_offset(k_cache, MODE.K_LAYOUT, d)
    v_rows = _row_base(cache=v_cache, LAYOUT=MODE.V_LAYOUT, block=block, j=j, row=row, BLOCK_SIZE=BLOCK_SIZE)
    v_ptrs = v_rows[:, None] + _dim_offset(v_cache, MODE.V_LAYOUT, d)[None, :]
    key_ok = j_ok if MASKED else tl.full([BLOCK_N], 1, tl.int1)
    v_ok = key_ok & (j >= query.first_key) if HAS_WINDOW else key_ok
    v = tl.load(v_ptrs, mask=v_ok[:, None] & d_ok[None, :], other=0.0)
    if IS_FP8 and not FP32_MATH:
        # K loaded as K^T ([dims, keys]): the fp8 tile then goes to the dot like V, through
        # LDS as whole words, and is widened in the operand layout (loaded as [keys, dims]
        # and transposed, the compiler moves it through LDS byte by byte). K_AT_LOAD: widened
        # where it was loaded instead, each lane its own share, and through LDS in q's dtype
        # (K^T's contiguous dims are the product's reduction dim: read back in words): a
        # quarter of the conversions on 4 warps, for the registers of the widened tile. V
        # stays in the operand layout: widened at its load it would be read back from LDS
        # one element at a time (its contiguous dims are not the reduction dim).
        k_t = tl.load(k_rows[None, :] + k_dims[:, None], mask=d_ok[:, None] & key_ok[None, :], other=0.0)
        if K_AT_LOAD:
            k_t = _in_load_layout(k_t)
        s = tl.dot(q, k_t.to(q.dtype))
        v = v.to(q.dtype)
    else:
        k = tl.load(k_rows[:, None] + k_dims[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        if FP32_MATH:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k))
    if MASKED or CAUSAL or HAS_WINDOW:
        visible = tl.full([1, BLOCK_N], 1, tl.int1)
        if MASKED:
            visible = j_ok[None, :]
        if CAUSAL:
            visible = visible & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (j[None, :] > pos[:, None] - query.window)
        s = tl.where(visible, s, float("-inf"))
    # Scores and the running max stay unscaled (the scale is positive, so the max commutes
    # with it): the scale enters each exponent by one fused multiply-add.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2((m_i - m_safe) * qk_scale)
    # P is rounded toward zero to V's type (cheap) and the sum taken of the rounded values,
    # so the weights stay normalised.
    p = tl.exp2(s * qk_scale - (m_safe * qk_scale)[:, None])
    p = p.to(v.dtype, fp_downcast_rounding="rtz" if v.dtype != tl.float32 else None)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return acc, m_new, l_i


@triton.jit
def draft_attention_kernel(
    # Tensors, passed per call. T query tokens, HQ query heads, HK KV heads, D head dims.
    q_ptr,  # [T, HQ, D] query: float16, bfloat16 or float32
    k_cache_ptr,  # K cache, [blocks, BLOCK_SIZE, HK, D] or packed (module docstring): the query's dtype or fp8
    v_cache_ptr,  # V cache, as the K cache
    block_table_ptr,  # [num_seqs, blocks per request] int: request b's cache blocks in key order
    qsl_ptr,  # [num_seqs + 1] int: query_start_loc, request b's queries are tokens [qsl[b], qsl[b + 1])
    seq_lens_ptr,  # [num_seqs] int: request b's keys (its context, then its queries)
    out_ptr,  # [T, HQ, D] the query's dtype: the output (stands in for the tensors below left unread)
    part_out_ptr,  # [num_segments, T, HQ, D] the output's dtype: each segment's normalised output (SPLIT)
    part_lse_ptr,  # [num_segments, T, HQ] float32: each segment's log2-sum-exp per row (SPLIT)
    counters_ptr,  # [tiles, HK] int32: arrivals per split tile and KV head, left zero (MERGE_IN_KERNEL, MERGERS)
    sinks_ptr,  # [HQ] float: a sink logit per query head (HAS_SINKS)
    k_scale_ptr,  # [1] float32: the fp8 K cache's scale (IS_FP8)
    v_scale_ptr,  # [1] float32: the fp8 V cache's scale (IS_FP8)
    # Scalars, fixed per plan.
    num_seqs,  # requests
    num_tokens,  # T
    scale_log2,  # softmax scale times log2(e)
    window,  # sliding window in keys (HAS_WINDOW; else 0)
    num_segments,  # key segments per tile (programs of grid axis 2 past them are mergers)
    min_segment_keys,  # the fewest keys a segment takes
    stride_qt,  # q: token stride
    stride_qh,  # q: head stride
    stride_qd,  # q: dim stride
    stride_kb,  # K cache: block stride (in units of K_UNIT elements)
    stride_ks,  # K cache: row stride, of a pack of K_ROW_PACK rows when packed (K_UNIT elements)
    stride_ks_in,  # K cache: row stride inside a pack (None: K_ROW_PACK == 1)
    stride_kh,  # K cache: KV head stride (elements)
    stride_kd,  # K cache: dim stride, of a pack of K_DIM_PACK dims when packed (K_UNIT elements)
    stride_kd_in,  # K cache: dim stride inside a pack (None: K_DIM_PACK == 1)
    stride_vb,  # V cache: as the K cache's
    stride_vs,
    stride_vs_in,
    stride_vh,
    stride_vd,
    stride_vd_in,
    stride_bt,  # block table: request stride
    stride_ot,  # out: token stride
    stride_oh,  # out: head stride
    stride_od,  # out: dim stride
    # Constexprs.
    HQ: tl.constexpr,  # query heads
    G: tl.constexpr,  # query heads per KV head: HQ // HK
    D: tl.constexpr,  # head dims
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (at least 16)
    BLOCK_M: tl.constexpr,  # tile rows: BLOCK_Q tokens x G heads (and any rows left over)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per key tile
    BLOCK_SIZE: tl.constexpr,  # keys per cache block
    ONE_TILE: tl.constexpr,  # every request's queries fit one tile: tile b is request b
    SPLIT: tl.constexpr,  # tiles may be split into key segments (num_segments > 1)
    MERGE_IN_KERNEL: tl.constexpr,  # the last segment to arrive merges the tile
    MERGERS: tl.constexpr,  # merger programs per tile at the end of the grid (0: none)
    MERGE_CHUNK: tl.constexpr,  # segments per load of a merge
    CAUSAL: tl.constexpr,  # query i sees the keys up to its own position
    HAS_WINDOW: tl.constexpr,  # only the last `window` keys up to a query's position are seen
    HAS_SINKS: tl.constexpr,  # sinks_ptr holds a sink logit per head
    IS_FP8: tl.constexpr,  # the caches are fp8, scaled by k_scale/v_scale
    FP32_MATH: tl.constexpr,  # compute in float32 (the interpreter's bfloat16: see common.py)
    FP16_DOTS: tl.constexpr,  # fp8 caches under a 16-bit query: products in float16
    K_AT_LOAD: tl.constexpr,  # fp8 caches (not FP32_MATH): K widened in its load layout, not the dot operand's
    K_ROW_PACK: tl.constexpr,  # K cache rows per pack (1: not packed)
    K_DIM_PACK: tl.constexpr,  # K cache dims per pack (1: not packed)
    V_ROW_PACK: tl.constexpr,  # V cache rows per pack
    V_DIM_PACK: tl.constexpr,  # V cache dims per pack
    K_UNIT: tl.constexpr,  # elements per unit of the K cache's strides (module docstring; 1: elements)
    V_UNIT: tl.constexpr,  # elements per unit of the V cache's strides
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    b, q_start, q_len, tile_q0, context, lo, hi = _tile_keys(qsl_ptr=qsl_ptr, seq_lens_ptr=seq_lens_ptr,
                                                             num_seqs=num_seqs, tile=tile, window=window,
                                                             BLOCK_Q=BLOCK_Q, ONE_TILE=ONE_TILE, CAUSAL=CAUSAL,
                                                             HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    if tile_q0 >= q_len:
        return
    parts = Partials(out_ptr=part_out_ptr, lse_ptr=part_lse_ptr, num_tokens=num_tokens)
    out = Output(ptr=out_ptr, stride_t=stride_ot, stride_h=stride_oh, stride_d=stride_od)
    DIMS: tl.constexpr = HeadDims(HQ=HQ, D=D, BLOCK_D=BLOCK_D)
    seg_lo = lo
    seg_hi = hi
    active = 1
    if SPLIT:
        per_segment, active = _segment_plan(lo=lo, hi=hi, num_segments=num_segments, min_segment_keys=min_segment_keys,
                                            BLOCK_N=BLOCK_N)
        if MERGERS:
            if segment >= num_segments:  # merger program segment - num_segments of this tile
                if active > 1:
                    counter = counters_ptr + tile * tl.num_programs(1) + kv_head
                    _wait_for(counter, active)
                    _merge_group(parts=parts, out=out, sinks_ptr=sinks_ptr, group=segment - num_segments,
                                 tile_q0=tile_q0, q_start=q_start, q_len=q_len, kv_head=kv_head, active=active,
                                 DIMS=DIMS, G=G, ROWS=BLOCK_M // MERGERS, BLOCK_Q=BLOCK_Q, MERGE_CHUNK=MERGE_CHUNK,
                                 HAS_SINKS=HAS_SINKS)
                    if tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") == active + MERGERS - 1:
                        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                return
        if segment >= active:
            return
        seg_lo = lo + segment * per_segment
        seg_hi = tl.minimum(hi, seg_lo + per_segment)

    token, head, row_ok, q_idx = _rows(tile_q0=tile_q0, q_start=q_start, q_len=q_len, kv_head=kv_head, G=G,
                                       BLOCK_M=BLOCK_M, BLOCK_Q=BLOCK_Q)
    pos = context + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_MATH:
        q = q.to(tl.float32)

    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    qk_scale = scale_log2 * k_scale
    if FP16_DOTS:
        # fp16 products (fp8 caches, 16-bit queries): the query takes the softmax scale (in
        # log2 units) before it is rounded, so fp16's range holds |q| up to 65504 over that
        # scale, ~5e5 for head_dim 128 (beyond, it saturates), whatever the cache's k_scale,
        # which the loop still applies to the scores.
        q = tl.clamp(q.to(tl.float32) * scale_log2, -65504.0, 65504.0).to(tl.float16)
        qk_scale = k_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    table = block_table_ptr + b * stride_bt
    first_key = context + tile_q0 - window + 1  # the first key a row of the tile sees (with a window)
    query = Query(q=q, qk_scale=qk_scale, pos=pos, d=d, d_ok=d_ok, window=window, first_key=first_key)
    k_cache = CacheHead(ptr=k_head, stride_b=stride_kb, stride_s=stride_ks, stride_s_in=stride_ks_in,
                        stride_d=stride_kd, stride_d_in=stride_kd_in)
    v_cache = CacheHead(ptr=v_head, stride_b=stride_vb, stride_s=stride_vs, stride_s_in=stride_vs_in,
                        stride_d=stride_vd, stride_d_in=stride_vd_in)
    K_LAYOUT: tl.constexpr = CacheLayout(ROW_PACK=K_ROW_PACK, DIM_PACK=K_DIM_PACK, UNIT=K_UNIT)
    V_LAYOUT: tl.constexpr = CacheLayout(ROW_PACK=V_ROW_PACK, DIM_PACK=V_DIM_PACK, UNIT=V_UNIT)
    MODE: tl.constexpr = AttendMode(BLOCK_N=BLOCK_N, BLOCK_SIZE=BLOCK_SIZE, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                                    IS_FP8=IS_FP8, FP32_MATH=FP32_MATH, K_AT_LOAD=K_AT_LOAD, K_LAYOUT=K_LAYOUT,
                                    V_LAYOUT=V_LAYOUT)
    full_hi = seg_lo + (seg_hi - seg_lo) // BLOCK_N * BLOCK_N
    for start in range(seg_lo, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend(acc=acc, m_i=m_i, l_i=l_i, query=query, table=table, k_cache=k_cache, v_cache=v_cache,
                                start=start, seg_hi=seg_hi, MASKED=False, MODE=MODE)
    if full_hi < seg_hi:
        acc, m_i, l_i = _attend(acc=acc, m_i=m_i, l_i=l_i, query=query, table=table, k_cache=k_cache, v_cache=v_cache,
                                start=full_hi, seg_hi=seg_hi, MASKED=True, MODE=MODE)

    m_i = m_i * qk_scale  # the running max in the exponents' (log2) units
    mask = row_ok[:, None] & d_ok[None, :]
    if active == 1:
        o = _finish(acc=acc, m_i=m_i, l_i=l_i, head=head, row_ok=row_ok, sinks_ptr=sinks_ptr, v_scale=v_scale,
                    HAS_SINKS=HAS_SINKS)
        tl.store(_out_ptrs(out, token, head, d), o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (segment * num_tokens + token) * HQ + head
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc * (v_scale / l_safe)[:, None]
        tl.store(part_out_ptr + part[:, None] * D + d[None, :], o.to(part_out_ptr.dtype.element_ty), mask=mask)
        tl.store(part_lse_ptr + part, tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe)), mask=row_ok)
        if MERGE_IN_KERNEL or MERGERS:
            tl.debug_barrier()  # every wave's partial stores precede the release below
            counter = counters_ptr + tile * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if MERGE_IN_KERNEL:
                if arrived == active - 1:
                    _merge_rows(parts=parts, out=out, sinks_ptr=sinks_ptr, token=token, head=head, row_ok=row_ok,
                                active=active, DIMS=DIMS, ROWS=BLOCK_M, SEG_CHUNK=MERGE_CHUNK, HAS_SINKS=HAS_SINKS)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def merge_segments_kernel(
    # Tensors, passed per call (shapes as in draft_attention_kernel).
    part_out_ptr,  # [num_segments, T, HQ, D] the output's dtype: each segment's normalised output
    part_lse_ptr,  # [num_segments, T, HQ] float32: each segment's log2-sum-exp per row
    qsl_ptr,  # [num_seqs + 1] int: query_start_loc
    seq_lens_ptr,  # [num_seqs] int: keys per request
    sinks_ptr,  # [HQ] float: a sink logit per query head (HAS_SINKS; else any tensor)
    out_ptr,  # [T, HQ, D] the query's dtype: the output
    # Scalars, fixed per plan: those the main kernel split the tile's keys with.
    num_seqs,  # requests
    num_tokens,  # T
    window,  # sliding window in keys (HAS_WINDOW; else 0)
    num_segments,  # key segments per tile
    min_segment_keys,  # the fewest keys a segment takes
    stride_ot,  # out: token stride
    stride_oh,  # out: head stride
    stride_od,  # out: dim stride
    # Constexprs: as draft_attention_kernel's.
    HQ: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_TILE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    ROWS: tl.constexpr,  # tile rows per program (grid axis 2: BLOCK_M // ROWS row groups)
    MERGE_CHUNK: tl.constexpr,  # segments per load
):
    """Second launch of a split tile: program (tile, KV head, row group) merges ``ROWS``
    rows of the tile over the segments the main kernel found active (a tile with one
    active segment was written already)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    b, q_start, q_len, tile_q0, context, lo, hi = _tile_keys(qsl_ptr=qsl_ptr, seq_lens_ptr=seq_lens_ptr,
                                                             num_seqs=num_seqs, tile=tile, window=window,
                                                             BLOCK_Q=BLOCK_Q, ONE_TILE=ONE_TILE, CAUSAL=CAUSAL,
                                                             HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    if tile_q0 >= q_len:
        return
    per_segment, active = _segment_plan(lo=lo, hi=hi, num_segments=num_segments, min_segment_keys=min_segment_keys,
                                        BLOCK_N=BLOCK_N)
    if active > 1:
        DIMS: tl.constexpr = HeadDims(HQ=HQ, D=D, BLOCK_D=BLOCK_D)
        _merge_group(parts=Partials(out_ptr=part_out_ptr, lse_ptr=part_lse_ptr, num_tokens=num_tokens),
                     out=Output(ptr=out_ptr, stride_t=stride_ot, stride_h=stride_oh, stride_d=stride_od),
                     sinks_ptr=sinks_ptr, group=tl.program_id(2), tile_q0=tile_q0, q_start=q_start, q_len=q_len,
                     kv_head=kv_head, active=active, DIMS=DIMS, G=G, ROWS=ROWS, BLOCK_Q=BLOCK_Q,
                     MERGE_CHUNK=MERGE_CHUNK, HAS_SINKS=HAS_SINKS)
