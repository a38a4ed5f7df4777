"""Triton kernels of the fused context-KV precompute: one launch for all layers.

One program computes a ``[BLOCK_T tokens, head_dim]`` tile of one (layer, K or V, KV
head): the GEMM against the K/V weight rows with the hidden RMSNorm folded in (the
norm weight is pre-multiplied into the rows; the per-token inverse RMS, accumulated from
the same loads of ``x``, scales the tile), then the epilogue: bias, the K head's RMSNorm
and RoPE, the value scale, and the store straight into that layer's paged cache slot.
The DFlash family's variants cost no other kernel: per-layer hidden norm weights are
folded into the rows too, ``NOPE_LAYERS`` leaves the K of its layers unrotated and
``K_ROUND_DTYPE`` rounds the normed K before RoPE (both off by default: the kernel without them).
With ``HEADS = 2`` it computes the K and the V tile of one (layer, KV head) from the same
loads of ``x`` (the reads of ``x`` through L2 halve; no split then).
``FP8_WEIGHTS``: the rows are fp8 (half the bytes of bf16 rows), which cannot take the norm
weight without being quantized again: each trip multiplies the loaded states by the norm
weight's columns (of the program's layer when ``NORM_ROWS`` is the layer count) in
float32, rounds them to the dot's dtype, widens the fp8 tile to it, and the row scale the
epilogue applies is the rows' weight scale (:func:`_normalised`). The norm weight's
``NORM_ROWS`` rows of ``H`` sit right before the row scales in one table (so the kernel
keeps its parameters). Off, the kernel is the one without it.
Tiles (a token tile of one head row, or pair) are numbered token tile fastest, then head rows.
The first ``whole_tiles`` run whole, one program each; the hidden size of every later
tile is split ``SPLIT_K`` ways, one program per part. Splitting all tiles serves a
single token tile whose heads alone cannot fill the device; splitting only the tiles
past the last full round of the device (a few) spreads that partial round over every
unit instead of leaving most idle while a few run a third tile. The last part of a
split tile to finish sums the parts and runs the epilogue (an arrival counter, see
``counters.py``). The parts add into one float32 sum per split tile (``ATOMIC_SUM``: the
merge reads one tile, and leaves it zero), or, in an order fixed run to run, keep a tile
each.

Program order: whole tiles, then the parts of the split tiles, each tile's parts
together, so neighbours share a head's weight rows. On MI300/MI355 the hardware deals
consecutive programs round-robin to 8 XCDs, each with its own L2; ``NUM_XCDS`` renumbers
the programs of each kind so that each XCD runs a contiguous range of it and the sharing
happens inside one L2.

RoPE without shuffles: the K rows of every head are permuted once (host side) so that
each rotation pair sits in adjacent columns; ``reshape`` + ``split`` then give the two
halves of every pair. With a full-width neox rotation the two halves are the first and
second half of the head, so each is stored as one contiguous run; V rows (and GPT-J
pairs) keep their order and are stored contiguously too.

Caches of different layers are separate tensors: a small int64 table holds, per layer,
the K and V cache base addresses, the layer's row of the slot mapping (-1: layer not
written), the block size and both caches' six strides in the packed-page addressing of
:mod:`dflash_rocm.paged` (``[blocks, bs // R, R, Hk, D // C, C]``; every written layer
shares one packing per K and V, so the factors are constexprs and a plain cache takes
the one-stride path). The table depends only on the caches, so it is built once; the
slot mapping is a kernel argument (one ``[N]`` tensor with layer stride 0, or written
layers' mappings stacked on the device).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .common import packed_offset

META_COLS = 16  # per layer: k_ptr, v_ptr, slot row, block_size, 6 K-cache strides, 6 V-cache strides
_META_COLS: tl.constexpr = tl.constexpr(META_COLS)


# Groups the kernel builds once and the helpers read by name. Constexpr groups are
# annotated ``tl.constexpr`` where the kernel builds them (a plain assignment would turn
# their members into runtime values); their members are constexprs wherever they are read.

class Epilogue(NamedTuple):
    """Constexprs of the epilogue (:func:`_epilogue`): the kernel's, by their names there."""

    HK: tl.constexpr
    D: tl.constexpr
    R: tl.constexpr
    BLOCK_T: tl.constexpr
    BLOCK_D: tl.constexpr
    HAS_BIAS: tl.constexpr
    IS_NEOX: tl.constexpr
    HAS_V_SCALE: tl.constexpr
    NOPE_LAYERS: tl.constexpr
    K_ROUND_DTYPE: tl.constexpr
    K_ROW_PACK: tl.constexpr
    K_DIM_PACK: tl.constexpr
    K_ALIGNED: tl.constexpr
    V_ROW_PACK: tl.constexpr
    V_DIM_PACK: tl.constexpr
    V_ALIGNED: tl.constexpr


class Store(NamedTuple):
    """Constexprs of how a tile is stored (:func:`_cache_rows`, :func:`_store_cols`): the
    kernel's, by their names there."""

    HK: tl.constexpr
    D: tl.constexpr
    IS_FP8: tl.constexpr
    FP8_MAX: tl.constexpr
    FP8_MIN_EXP: tl.constexpr
    RETURN_KV: tl.constexpr
    EXACT_FP8_ROUND: tl.constexpr
    SLOTS_I32: tl.constexpr
    CACHE_BLOCK: tl.constexpr
    CACHE_DTYPE: tl.constexpr


class EpilogueInputs(NamedTuple):
    """What the epilogue reads besides the tile: the kernel's parameters of these names."""

    positions_ptr: tl.tensor
    bias_ptr: tl.tensor
    k_norm_ptr: tl.tensor
    cos_sin_ptr: tl.tensor
    stride_cs: tl.tensor
    v_scale: tl.tensor
    eps: tl.tensor


class CacheTarget(NamedTuple):
    """Where a tile goes: the kernel's parameters of these names."""

    meta_ptr: tl.tensor
    slots_ptr: tl.tensor
    stride_slot_layer: tl.tensor
    k_scales_ptr: tl.tensor
    v_scales_ptr: tl.tensor
    out_k_ptr: tl.tensor
    out_v_ptr: tl.tensor
    N: tl.tensor


class TileRows(NamedTuple):
    """The rows of one tile of one head row."""

    t: tl.tensor  # [BLOCK_T] tokens
    t_ok: tl.tensor  # which are real
    layer: tl.tensor
    kind: tl.tensor  # 0: K, 1: V
    kv_head: tl.tensor


class CacheRows(NamedTuple):
    """What :func:`_cache_rows` finds for a tile's rows in one kind's caches."""

    ok: tl.tensor  # [BLOCK_T] rows to write
    row_base: tl.tensor  # their offsets in the layer's cache
    strides: tl.tensor  # the kind's strides in the cache table


@triton.jit
def _xcd_order(pid, num_programs, NUM_XCDS: tl.constexpr):
    """The logical program hardware program ``pid`` runs: XCD ``x`` (which gets ``pid % NUM_XCDS``)
    runs a contiguous range of logical programs."""
    if NUM_XCDS == 1:
        return pid
    per = num_programs // NUM_XCDS
    extra = num_programs % NUM_XCDS
    xcd = pid % NUM_XCDS
    local = pid // NUM_XCDS
    return tl.where(xcd < extra, xcd * (per + 1) + local, extra * (per + 1) + (xcd - extra) * per + local)


@triton.jit
def _round_to_fp8_grid(x, MIN_EXP: tl.constexpr):
    """Round float32 ``x`` to the nearest e4m3 value (3 mantissa bits; normals down to
    2**MIN_EXP, subnormals below). Interpreter only: its float->fp8 conversion drops the
    carry when rounding crosses a power of two (1.94 becomes 1.0, not 2.0); a value already
    on the grid converts exactly. A value that rounds to zero is +0: the fnuz formats have no
    -0 (their 0x80 is NaN), and Triton 3.8's interpreter converts -0.0 to 0x80."""
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), MIN_EXP)
    step = tl.exp2(e - 3)
    r = tl.floor(a / step + 0.5) * step
    return tl.where((x < 0) & (r > 0), -r, r)


@triton.jit
def divide(x, divisor):
    """``x / divisor`` rounded once, as a division rounds it, for a ``divisor`` the whole tile
    shares: its reciprocal once, then per value a product and one FMA correction (Markstein:
    with the reciprocal correctly rounded and the product within an ulp of the quotient,
    ``q + (x - q * divisor) / divisor`` rounded once is the rounded quotient). A float32
    division is a dozen-instruction sequence on AMD, and the fp8 epilogue divides every
    stored value. An infinite or NaN product is returned as it is (the correction would
    turn infinity into NaN)."""
    inv = 1.0 / divisor
    q = x * inv
    return tl.where(tl.abs(q) < float("inf"), tl.fma(tl.fma(-q, divisor, x), inv, q), q)


@triton.jit
def _table_offset(i, strides, PACK: tl.constexpr):
    """Offset of index ``i`` along a cache axis packed by ``PACK`` whose stride and in-pack
    stride the table holds at ``strides`` (the latter read only when packed)."""
    if PACK == 1:
        return i * tl.load(strides)
    else:
        return packed_offset(i, tl.load(strides), tl.load(strides + 1), PACK)


@triton.jit
def _cache_rows(rows, cache, ROW_PACK: tl.constexpr, STORE):
    """(rows to write, their offsets in the layer's cache of this kind, the kind's strides
    in the table) of the tile's tokens: once per tile, however many column groups it
    stores (each store then adds only its dims). A layer not written has no rows to write.
    ``rows``: the :class:`TileRows`; ``cache``: the :class:`CacheTarget`; ``STORE``: the
    :class:`Store` constexprs. ``CACHE_BLOCK``: the block size
    every written cache shares, a constant divisor (a shift for a power of two; a division
    by a runtime value is a few dozen vector instructions on AMD); 0: read per layer."""
    t = rows.t
    SLOTS_I32: tl.constexpr = STORE.SLOTS_I32
    CACHE_BLOCK: tl.constexpr = STORE.CACHE_BLOCK
    meta = cache.meta_ptr + rows.layer * _META_COLS
    slot_row = tl.load(meta + 2)
    written = slot_row + tl.zeros_like(t) >= 0  # per row: the interpreter takes no scalar in a mask
    slots = tl.load(cache.slots_ptr + slot_row * cache.stride_slot_layer + t, mask=rows.t_ok & written, other=-1)
    ok = rows.t_ok & (slots >= 0)
    if SLOTS_I32:  # every cache has under 2**31 slots: 32-bit division
        slots = slots.to(tl.int32)
    if CACHE_BLOCK != 0:
        block = slots // CACHE_BLOCK
        in_block = slots % CACHE_BLOCK
    else:
        block_size = tl.maximum(tl.load(meta + 3), 1)  # 0 in the row of a layer not written
        if SLOTS_I32:
            block_size = block_size.to(tl.int32)
        block = slots // block_size
        in_block = slots - block * block_size
    strides = meta + 4 + 6 * rows.kind  # [block, row, row in pack, head, dim, dim in pack]
    row_base = block.to(tl.int64) * tl.load(strides) + _table_offset(in_block, strides + 1,
                                                                     ROW_PACK) + rows.kv_head * tl.load(strides + 3)
    return CacheRows(ok=ok, row_base=row_base, strides=strides)


@triton.jit
def _store_cols(value, dim, dim_ok, rows, target, cache, ALIGNED: tl.constexpr, DIM_PACK: tl.constexpr, STORE):
    """Store ``value`` (columns = original dims ``dim``) into the cache rows ``target``
    (the :class:`CacheRows` :func:`_cache_rows` found) and into the returned K/V;
    ``DIM_PACK`` is this cache kind's dim pack factor. ``ALIGNED``: the host checked that
    every cache of this kind has contiguous dim runs (the whole head dim, or the
    ``DIM_PACK`` dims of a pack) that start 16-byte aligned, so contiguous dims become
    vector stores. ``rows``, ``cache``, ``STORE``: see :func:`_cache_rows`."""
    layer = rows.layer
    kind = rows.kind
    row_base = target.row_base
    strides = target.strides
    CACHE_DTYPE: tl.constexpr = STORE.CACHE_DTYPE
    FP8_MAX: tl.constexpr = STORE.FP8_MAX
    base = tl.load(cache.meta_ptr + layer * _META_COLS + kind).to(tl.pointer_type(CACHE_DTYPE))
    stored = value
    if STORE.IS_FP8:
        if kind == 0:
            scale = tl.load(cache.k_scales_ptr + layer)
        else:
            scale = tl.load(cache.v_scales_ptr + layer)
        stored = tl.minimum(tl.maximum(divide(stored, scale), -FP8_MAX), FP8_MAX)
        if STORE.EXACT_FP8_ROUND:
            stored = _round_to_fp8_grid(stored, STORE.FP8_MIN_EXP)
    if ALIGNED and DIM_PACK == 1:  # every row starts 16-byte aligned and its dims are contiguous
        ptrs = tl.multiple_of(base + row_base[:, None] + dim[None, :], [16, 16])
    elif ALIGNED:  # every pack of DIM_PACK dims is contiguous and starts 16-byte aligned
        dims = packed_offset(dim, tl.load(strides + 4), 1, DIM_PACK)
        ptrs = tl.multiple_of(base + row_base[:, None] + dims[None, :], [16, 16])
    else:
        ptrs = base + row_base[:, None] + _table_offset(dim, strides + 4, DIM_PACK)[None, :]
    tl.store(ptrs, stored.to(CACHE_DTYPE), mask=target.ok[:, None] & dim_ok[None, :])
    if STORE.RETURN_KV:
        out = ((layer * cache.N + rows.t.to(tl.int64))[:, None] * STORE.HK + rows.kv_head) * STORE.D + dim[None, :]
        mask = rows.t_ok[:, None] & dim_ok[None, :]
        if kind == 0:
            tl.store(cache.out_k_ptr + out, value.to(cache.out_k_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(cache.out_v_ptr + out, value.to(cache.out_v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normalised(acc, inv_rms, row_scale_ptr, head_row, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The GEMM tile of ``head_row`` (un-normalised states times folded rows) as SPEC's
    ``rms_norm(x, w) @ W.T``: times each token's ``1 / rms(x)`` first, then each column's
    row scale, the power of two its folded row was divided by
    (``ContextKVWeights.folded_kv_weight``). In that order the tile overflows only where
    SPEC's order does (the other order passes ``rms(x)`` times the result)."""
    c = tl.arange(0, BLOCK_D)
    return acc * inv_rms[:, None] * tl.load(row_scale_ptr + head_row * D + c, mask=c < D, other=1.0)[None, :]


@triton.jit
def _epilogue(acc, pid_t, head_row, inputs, cache, EPILOGUE, STORE, KIND: tl.constexpr = -1):
    """Bias, the K head's RMSNorm and RoPE, the value scale, and the stores of token tile
    ``pid_t`` of head row ``head_row`` (``acc``: its projection, :func:`_normalised`). The
    kernel groups what it needs once: ``inputs``, the :class:`EpilogueInputs`; ``cache``,
    the :class:`CacheTarget` (where the tile goes); the constexprs ``EPILOGUE``
    (:class:`Epilogue`) and ``STORE`` (:class:`Store`, how a tile is stored). ``KIND``: 0
    (K) or 1 (V) when the caller knows it (only that kind's code is compiled), -1: read from
    ``head_row``. A NoPE layer's K rotates by the identity (its cos/sin loads are masked to
    1 and 0, as the pass-through dims' are)."""
    N = cache.N
    HK: tl.constexpr = EPILOGUE.HK
    D: tl.constexpr = EPILOGUE.D
    R: tl.constexpr = EPILOGUE.R
    BLOCK_T: tl.constexpr = EPILOGUE.BLOCK_T
    BLOCK_D: tl.constexpr = EPILOGUE.BLOCK_D
    IS_NEOX: tl.constexpr = EPILOGUE.IS_NEOX
    NOPE_LAYERS: tl.constexpr = EPILOGUE.NOPE_LAYERS
    K_ROUND_DTYPE: tl.constexpr = EPILOGUE.K_ROUND_DTYPE
    layer = head_row // (2 * HK)
    if KIND == -1:
        kind = (head_row // HK) % 2  # 0: K, 1: V
    else:
        kind = KIND
    kv_head = head_row % HK
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    rows = TileRows(t=t, t_ok=t_ok, layer=layer, kind=kind, kv_head=kv_head)
    if EPILOGUE.HAS_BIAS:
        acc += tl.load(inputs.bias_ptr + head_row * D + c, mask=c_ok, other=0.0)[None, :]
    if kind == 0:
        # Column c holds original dim k_dim (K rows were permuted so RoPE pairs are adjacent).
        pair = c // 2
        if IS_NEOX:
            k_dim = tl.where(pair < R // 2, pair + (c % 2) * (R // 2), c)
        else:
            k_dim = c
        inv_k = tl.rsqrt(tl.sum(acc * acc, 1) / D + inputs.eps)
        acc = acc * inv_k[:, None] * tl.load(inputs.k_norm_ptr + layer * D + k_dim, mask=c_ok, other=0.0)[None, :]
        if K_ROUND_DTYPE is not None:
            acc = acc.to(K_ROUND_DTYPE).to(tl.float32)
        pos = tl.load(inputs.positions_ptr + t, mask=t_ok, other=0).to(tl.int64)
        i = tl.arange(0, BLOCK_D // 2)
        rot = t_ok[:, None] & (i < R // 2)[None, :]
        if NOPE_LAYERS != 0:
            rotated = ((NOPE_LAYERS >> layer.to(tl.int64)) & 1) + tl.zeros_like(t) == 0  # per row: no scalar mask
            rot = rot & rotated[:, None]
        cs = inputs.cos_sin_ptr + pos[:, None] * inputs.stride_cs + i[None, :]
        cos = tl.load(cs, mask=rot, other=1.0)
        sin = tl.load(cs + R // 2, mask=rot, other=0.0)
        x1, x2 = tl.split(tl.reshape(acc, (BLOCK_T, BLOCK_D // 2, 2)))
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        target = _cache_rows(rows, cache, EPILOGUE.K_ROW_PACK, STORE)
        if IS_NEOX and R == D and D == BLOCK_D:  # the halves are dims [0, D/2) and [D/2, D)
            _store_cols(value=o1, dim=i, dim_ok=i < D // 2, rows=rows, target=target, cache=cache,
                        ALIGNED=EPILOGUE.K_ALIGNED, DIM_PACK=EPILOGUE.K_DIM_PACK, STORE=STORE)
            _store_cols(value=o2, dim=i + D // 2, dim_ok=i < D // 2, rows=rows, target=target, cache=cache,
                        ALIGNED=EPILOGUE.K_ALIGNED, DIM_PACK=EPILOGUE.K_DIM_PACK, STORE=STORE)
        else:
            _store_cols(value=tl.reshape(tl.join(o1, o2), (BLOCK_T, BLOCK_D)), dim=k_dim, dim_ok=c_ok, rows=rows,
                        target=target, cache=cache, ALIGNED=EPILOGUE.K_ALIGNED and not IS_NEOX,
                        DIM_PACK=EPILOGUE.K_DIM_PACK, STORE=STORE)
    else:
        if EPILOGUE.HAS_V_SCALE:
            acc = acc * inputs.v_scale
        target = _cache_rows(rows, cache, EPILOGUE.V_ROW_PACK, STORE)
        _store_cols(value=acc, dim=c, dim_ok=c_ok, rows=rows, target=target, cache=cache, ALIGNED=EPILOGUE.V_ALIGNED,
                    DIM_PACK=EPILOGUE.V_DIM_PACK, STORE=STORE)


@triton.jit
def _part_tiles(part_acc_ptr, part_ss_ptr, slot, part, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                PARTS: tl.constexpr):
    """Pointers to the ``[BLOCK_T, BLOCK_D]`` tile and ``[BLOCK_T]`` sums of squares of part
    ``part`` of split tile ``slot``, which keeps ``PARTS`` of them (one: the parts add
    into it). Every part writes whole tiles, so they are read without masks."""
    rows = tl.arange(0, BLOCK_T)
    first = (slot * PARTS + part).to(tl.int64) * BLOCK_T
    acc = part_acc_ptr + first * BLOCK_D + rows[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    return acc, part_ss_ptr + first + rows


@triton.jit
def _sum_parts(part_acc_ptr, part_ss_ptr, slot, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
               SPLIT_K: tl.constexpr, ATOMIC_SUM: tl.constexpr):
    """Split tile ``slot``'s GEMM result and sum of squares. ``ATOMIC_SUM``: its parts added
    themselves into one tile; it is read and left zero for the next launch. Otherwise
    part ``k`` of the tile is at ``slot * SPLIT_K + k``, summed in that order (all loads
    issued together)."""
    if ATOMIC_SUM:
        acc_ptrs, ss_ptrs = _part_tiles(part_acc_ptr=part_acc_ptr, part_ss_ptr=part_ss_ptr, slot=slot, part=0,
                                        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, PARTS=1)
        acc = tl.load(acc_ptrs, cache_modifier=".cg")
        sum_sq = tl.load(ss_ptrs, cache_modifier=".cg")
        tl.store(acc_ptrs, tl.zeros_like(acc))
        tl.store(ss_ptrs, tl.zeros_like(sum_sq))
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        sum_sq = tl.zeros([BLOCK_T], tl.float32)
        for k in tl.static_range(SPLIT_K):
            acc_ptrs, ss_ptrs = _part_tiles(part_acc_ptr=part_acc_ptr, part_ss_ptr=part_ss_ptr, slot=slot, part=k,
                                            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, PARTS=SPLIT_K)
            acc += tl.load(acc_ptrs, cache_modifier=".cg")
            sum_sq += tl.load(ss_ptrs, cache_modifier=".cg")
    return acc, sum_sq


@triton.jit
def _fp8_operands(xf, norm, dtype: tl.constexpr, FP32_MATH: tl.constexpr):
    """The dot's states operand for fp8 rows: float32 states ``xf [BLOCK_T, BLOCK_K]`` times
    the norm weight's columns ``norm [BLOCK_K]``, in the states' ``dtype`` (float32 under
    ``FP32_MATH``); the fp8 tile is widened to the same dtype by the caller."""
    xn = xf * norm[None, :]
    if FP32_MATH:
        return xn
    return xn.to(dtype)


@triton.jit
def _program_tile(pid, num_programs, whole_tiles, NUM_XCDS: tl.constexpr, SPLIT_K: tl.constexpr,
                  HAS_WHOLE: tl.constexpr):
    """(tile, part, parts) of hardware program ``pid``: whole tiles first (``HAS_WHOLE``: if
    any), then split tiles' parts, each kind renumbered for the XCDs on its own (in step
    with the hardware's dealing when ``whole_tiles`` is a multiple of ``NUM_XCDS``, as the
    tables make it; otherwise only the L2 sharing suffers)."""
    if SPLIT_K == 1:
        tile = _xcd_order(pid, num_programs, NUM_XCDS)
        part = 0
        parts = 1
    elif not HAS_WHOLE:
        q = _xcd_order(pid, num_programs, NUM_XCDS)
        tile = q // SPLIT_K
        part = q % SPLIT_K
        parts = SPLIT_K
    else:
        whole = pid < whole_tiles
        first = tl.where(whole, 0, whole_tiles)
        q = _xcd_order(pid - first, tl.where(whole, whole_tiles, num_programs - whole_tiles), NUM_XCDS)
        tile = tl.where(whole, q, whole_tiles + q // SPLIT_K)
        part = tl.where(whole, 0, q % SPLIT_K)
        parts = tl.where(whole, 1, SPLIT_K)
    return tile, part, parts


@triton.jit
def context_kv_kernel(
    # Tensors, passed per call. N context tokens, H hidden size, L layers, HK KV heads per layer, D head dims.
    x_ptr,  # [N, H] context states: float16, bfloat16 or float32
    w_ptr,  # [L * 2 * HK * D, H] the states' dtype: K/V weight rows, hidden norm folded in, K rows permuted
    #   (FP8_WEIGHTS: fp8 rows, K rows permuted, no norm folded in)
    row_scale_ptr,  # [L * 2 * HK * D] float32: the power of two each folded row was divided by (fp8: its scale;
    #   FP8_WEIGHTS: preceded in memory by the [NORM_ROWS, H] float32 hidden norm weight)
    part_acc_ptr,  # [split tiles * (1 or SPLIT_K) * BLOCK_T, BLOCK_D] float32: split tiles' partial sums
    part_ss_ptr,  # [split tiles * (1 or SPLIT_K) * BLOCK_T] float32: their partial sums of squares
    counters_ptr,  # [split tiles] int32: arrivals per split tile, left zero (MERGE_IN_KERNEL)
    positions_ptr,  # [N] int64: the tokens' positions
    bias_ptr,  # [L * 2 * HK * D] float32: the K/V bias, K rows permuted as the weights' (HAS_BIAS)
    k_norm_ptr,  # [L, D] float32: the K heads' RMSNorm weight per layer
    cos_sin_ptr,  # [max_position, R] float32: cos then sin per position
    meta_ptr,  # [L, META_COLS] int64: the cache table (module docstring)
    slots_ptr,  # [N] or [written layers, N] int: slot of each token in its layer's cache (-1: not written)
    k_scales_ptr,  # [L] float32: each layer's K cache scale (IS_FP8)
    v_scales_ptr,  # [L] float32: each layer's V cache scale (IS_FP8)
    out_k_ptr,  # [L, N, HK, D] the states' dtype: the returned K (RETURN_KV)
    out_v_ptr,  # [L, N, HK, D] the states' dtype: the returned V (RETURN_KV)
    # Scalars, fixed per plan.
    stride_slot_layer,  # slots: layer stride (0: one mapping for every layer)
    N,  # context tokens
    H,  # hidden size
    stride_xt,  # x: token stride
    stride_xh,  # x: hidden stride
    stride_cs,  # cos_sin: position stride
    v_scale,  # the scale V takes (HAS_V_SCALE)
    eps,  # the RMSNorms' epsilon
    grid_t,  # token tiles per head row: cdiv(N, BLOCK_T)
    whole_tiles,  # tiles computed whole, one program each; the tiles after them are split
    # Constexprs.
    HK: tl.constexpr,  # KV heads per layer
    D: tl.constexpr,  # head dims
    R: tl.constexpr,  # rotary dims (the first R of a K head rotate)
    BLOCK_T: tl.constexpr,  # tokens per tile
    BLOCK_K: tl.constexpr,  # hidden columns per trip of the GEMM loop
    BLOCK_D: tl.constexpr,  # D rounded up to a power of two (at least 16)
    SPLIT_K: tl.constexpr,  # parts a split tile's hidden size is cut into (1: no tile split)
    HAS_WHOLE: tl.constexpr,  # some tiles run whole (whole_tiles > 0) beside split ones
    MERGE_IN_KERNEL: tl.constexpr,  # the last part of a split tile to arrive sums the parts and runs the epilogue
    #   (on whenever SPLIT_K > 1; off compiles a part alone, as the audit's model charges one)
    ATOMIC_SUM: tl.constexpr,  # the parts add into one float32 sum per split tile (else one tile each)
    NUM_XCDS: tl.constexpr,  # XCDs the hardware deals programs to (1: no renumbering)
    SQUARE_GROUP: tl.constexpr,  # contiguous columns a lane sums the squares of per trip (1 or 8)
    HEADS: tl.constexpr,  # head rows per program: 1, or 2 (a KV head's K and V from the same loads of x)
    HAS_BIAS: tl.constexpr,  # bias_ptr holds a bias per row
    IS_NEOX: tl.constexpr,  # neox RoPE (pairs i, i + R/2) rather than GPT-J's (2i, 2i + 1)
    HAS_V_SCALE: tl.constexpr,  # V takes the scale v_scale
    IS_FP8: tl.constexpr,  # the caches are fp8: stored values are divided by their layer's scale and clamped
    FP8_MAX: tl.constexpr,  # the fp8 cache dtype's largest value (0.0: not fp8)
    FP8_MIN_EXP: tl.constexpr,  # its smallest normal exponent (EXACT_FP8_ROUND)
    CACHE_DTYPE: tl.constexpr,  # the caches' dtype
    RETURN_KV: tl.constexpr,  # also write out_k/out_v
    K_ALIGNED: tl.constexpr,  # every K cache stores a row's dims in 16-byte aligned contiguous runs
    V_ALIGNED: tl.constexpr,  # every V cache likewise
    K_ROW_PACK: tl.constexpr,  # K cache rows per pack (1: not packed)
    K_DIM_PACK: tl.constexpr,  # K cache dims per pack (1: not packed)
    V_ROW_PACK: tl.constexpr,  # V cache rows per pack
    V_DIM_PACK: tl.constexpr,  # V cache dims per pack
    SLOTS_I32: tl.constexpr,  # every cache has under 2**31 slots: 32-bit slot arithmetic
    CACHE_BLOCK: tl.constexpr,  # the block size every written cache shares (0: they differ, read per layer)
    FP32_MATH: tl.constexpr,  # compute in float32 (the interpreter's bfloat16: see common.py)
    EXACT_FP8_ROUND: tl.constexpr,  # round to the fp8 grid by arithmetic (the interpreter's conversion cannot)
    NOPE_LAYERS: tl.constexpr = 0,  # bit l set: layer l's K is not rotated (0: every layer's is)
    K_ROUND_DTYPE: tl.constexpr = None,  # dtype the normed K is rounded to before RoPE (None: kept float32)
    FP8_WEIGHTS: tl.constexpr = False,  # w_ptr holds fp8 rows: the norm weight multiplies the states per trip
    NORM_ROWS: tl.constexpr = 0,  # FP8_WEIGHTS: rows of the norm weight, 1 ([H]) or L ([L, H]: each layer its own)
):
    tile, pid_k, parts = _program_tile(pid=tl.program_id(0), num_programs=tl.num_programs(0), whole_tiles=whole_tiles,
                                       NUM_XCDS=NUM_XCDS, SPLIT_K=SPLIT_K, HAS_WHOLE=HAS_WHOLE)
    pid_t = tile % grid_t
    head_row = tile // grid_t  # (layer * 2 + kind) * HK + kv_head
    if HEADS == 2:  # tile // grid_t = layer * HK + kv_head: its K head row, the V row HK rows on
        head_row = head_row // HK * 2 * HK + head_row % HK
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    x_rows = x_ptr + t.to(tl.int64) * stride_xt
    w_rows = w_ptr + (head_row * D + c).to(tl.int64) * H
    if FP8_WEIGHTS:  # the norm weight's rows end where the row scales begin
        if NORM_ROWS == 1:
            norm_row = row_scale_ptr - H
        else:  # every head row of the program is of one layer
            norm_row = row_scale_ptr - (NORM_ROWS - head_row // (2 * HK)).to(tl.int64) * H
    k_per = tl.cdiv(tl.cdiv(H, parts), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(H, k_lo + k_per)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    if HEADS == 2:  # the V head's tile, from the same loads of x
        acc_v = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    # The hidden RMSNorm's sums of squares: each trip adds the squares of a lane's SQUARE_GROUP
    # contiguous columns in the lane; the sum across lanes waits for the loop's end (a
    # cross-lane reduction per trip would cost the loop vector cycles). Groups of 8 (one
    # 16-byte load) keep the accumulator small; groups of 1 (an FMA a value, a
    # [BLOCK_T, BLOCK_K] accumulator) save the in-lane sums where registers allow but halve
    # RDNA3's waves.
    squares = tl.zeros([BLOCK_T, BLOCK_K // SQUARE_GROUP], tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_hi
        x = tl.load(x_rows[:, None] + k[None, :] * stride_xh, mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows[:, None] + k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        if SQUARE_GROUP == 1:
            squares += xf * xf
        else:
            squares += tl.sum(tl.reshape(xf * xf, (BLOCK_T, BLOCK_K // SQUARE_GROUP, SQUARE_GROUP)), 2)
        if FP8_WEIGHTS:  # the norm weight on the states (rounded once to the dot's dtype), fp8 rows widened
            x = _fp8_operands(xf, tl.load(norm_row + k, mask=k_ok, other=0.0), x.dtype, FP32_MATH)
            w = w.to(x.dtype)
        elif FP32_MATH:
            x = xf
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
        if HEADS == 2:
            w_v = tl.load(w_rows[:, None] + HK * D * H + k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
            if FP32_MATH or FP8_WEIGHTS:
                w_v = w_v.to(x.dtype)
            acc_v += tl.dot(x, tl.trans(w_v))
    sum_sq = tl.sum(squares, 1)
    finish = parts == 1  # this program runs the epilogue: a whole tile, or the last part of a split one
    if parts != 1:
        slot = tile - whole_tiles
        if ATOMIC_SUM:  # add into the tile's one sum (fp32 adds in arrival order: not bitwise reproducible)
            acc_ptrs, ss_ptrs = _part_tiles(part_acc_ptr=part_acc_ptr, part_ss_ptr=part_ss_ptr, slot=slot, part=0,
                                            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, PARTS=1)
            tl.atomic_add(acc_ptrs, acc, sem="relaxed", scope="gpu")
            tl.atomic_add(ss_ptrs, sum_sq, sem="relaxed", scope="gpu")
        else:
            acc_ptrs, ss_ptrs = _part_tiles(part_acc_ptr=part_acc_ptr, part_ss_ptr=part_ss_ptr, slot=slot, part=pid_k,
                                            BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, PARTS=SPLIT_K)
            tl.store(acc_ptrs, acc)
            tl.store(ss_ptrs, sum_sq)
        if MERGE_IN_KERNEL:  # the last part of the tile to finish sums them
            tl.debug_barrier()  # every wave's partial stores precede the release below
            counter = counters_ptr + slot
            finish = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
            if finish:
                acc, sum_sq = _sum_parts(part_acc_ptr=part_acc_ptr, part_ss_ptr=part_ss_ptr, slot=slot, BLOCK_T=BLOCK_T,
                                         BLOCK_D=BLOCK_D, SPLIT_K=SPLIT_K, ATOMIC_SUM=ATOMIC_SUM)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # every part arrived: ready for the next launch
    if finish:
        inv_rms = tl.rsqrt(sum_sq / H + eps)
        inputs = EpilogueInputs(positions_ptr=positions_ptr, bias_ptr=bias_ptr, k_norm_ptr=k_norm_ptr,
                                cos_sin_ptr=cos_sin_ptr, stride_cs=stride_cs, v_scale=v_scale, eps=eps)
        cache = CacheTarget(meta_ptr=meta_ptr, slots_ptr=slots_ptr, stride_slot_layer=stride_slot_layer,
                            k_scales_ptr=k_scales_ptr, v_scales_ptr=v_scales_ptr, out_k_ptr=out_k_ptr,
                            out_v_ptr=out_v_ptr, N=N)
        EPILOGUE: tl.constexpr = Epilogue(HK=HK, D=D, R=R, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, HAS_BIAS=HAS_BIAS,
                                          IS_NEOX=IS_NEOX, HAS_V_SCALE=HAS_V_SCALE, NOPE_LAYERS=NOPE_LAYERS,
                                          K_ROUND_DTYPE=K_ROUND_DTYPE, K_ROW_PACK=K_ROW_PACK, K_DIM_PACK=K_DIM_PACK,
                                          K_ALIGNED=K_ALIGNED, V_ROW_PACK=V_ROW_PACK, V_DIM_PACK=V_DIM_PACK,
                                          V_ALIGNED=V_ALIGNED)
        STORE: tl.constexpr = Store(HK=HK, D=D, IS_FP8=IS_FP8, FP8_MAX=FP8_MAX, FP8_MIN_EXP=FP8_MIN_EXP,
                                    RETURN_KV=RETURN_KV, EXACT_FP8_ROUND=EXACT_FP8_ROUND, SLOTS_I32=SLOTS_I32,
                                    CACHE_BLOCK=CACHE_BLOCK, CACHE_DTYPE=CACHE_DTYPE)
        if HEADS == 2:  # the V head first: its light epilogue runs while the K tile waits in registers
            acc_v = _normalised(acc=acc_v, inv_rms=inv_rms, row_scale_ptr=row_scale_ptr, head_row=head_row + HK, D=D,
                                BLOCK_D=BLOCK_D)
            _epilogue(acc=acc_v, pid_t=pid_t, head_row=head_row + HK, inputs=inputs, cache=cache, EPILOGUE=EPILOGUE,
                      STORE=STORE, KIND=1)
        acc = _normalised(acc=acc, inv_rms=inv_rms, row_scale_ptr=row_scale_ptr, head_row=head_row, D=D,
                          BLOCK_D=BLOCK_D)
        _epilogue(acc=acc, pid_t=pid_t, head_row=head_row, inputs=inputs, cache=cache, EPILOGUE=EPILOGUE, STORE=STORE,
                  KIND=0 if HEADS == 2 else -1)
