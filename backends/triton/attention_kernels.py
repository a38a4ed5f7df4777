"""Triton kernels of the paged draft attention: a split-KV main kernel and a merge kernel.

Tile rows pack the ``G`` query heads that share one KV head (row ``r`` is query token
``r // G``, head ``kv_head * G + r % G``): a DFlash step has only ~16 queries per request,
and packing the group is what gives ``tl.dot`` enough rows. The grid is
(query tiles, KV heads, key segments). Query tiles are numbered as in vLLM's
unified attention: request ``b``'s tiles start at ``query_start_loc[b] // BLOCK_Q + b``,
so a program finds its request by binary search and no host sync sizes the grid.
Each segment covers an equal, ``BLOCK_N``-aligned share of the keys visible to its
tile; with one segment the kernel normalises and writes ``out`` itself, otherwise it
writes (max, sum, unnormalised accumulator) partials in log2 space that the merge
kernel combines with the attention sink.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


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
def draft_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    part_acc_ptr, part_ml_ptr, sinks_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, num_tokens, block_size, scale_log2, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_bt, stride_ot, stride_oh, stride_od,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, IS_FP8: tl.constexpr,
    FP32_MATH: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    b = _find_request(qsl_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    tile_q0 = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if tile_q0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context = seq_len - q_len  # position of the request's first query token

    rows = tl.arange(0, BLOCK_M)
    q_idx = tile_q0 + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (q_idx < q_len)
    pos = context + q_idx
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP32_MATH:
        q = q.to(tl.float32)

    # Keys visible to any row of this tile, then this segment's share of them.
    last_q = tl.minimum(tile_q0 + BLOCK_Q, q_len) - 1
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum(seq_len, context + last_q + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, context + tile_q0 - window + 1)
    per_segment = tl.cdiv(tl.cdiv(hi - lo, NUM_SEGMENTS), BLOCK_N) * BLOCK_N
    seg_lo = lo + segment * per_segment
    seg_hi = tl.minimum(hi, seg_lo + per_segment)

    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    qk_scale = scale_log2 * k_scale
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(seg_lo, seg_hi, BLOCK_N):
        j = start + n
        j_ok = j < seg_hi
        block = tl.load(block_table_ptr + b * stride_bt + j // block_size, mask=j_ok, other=0).to(tl.int64)
        row = (j % block_size).to(tl.int64)
        kv_mask = j_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + row[:, None] * stride_ks + kv_head * stride_kh
                    + d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + row[:, None] * stride_vs + kv_head * stride_vh
                    + d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if FP32_MATH:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        elif IS_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = j_ok[None, :]
        if CAUSAL:
            visible = visible & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            visible = visible & (j[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_all)
            l_i = l_i * alpha + tl.exp2(sink - m_all)
            acc = acc * alpha[:, None]
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_i[:, None] * v_scale
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (segment * num_tokens + token) * HQ + head
        tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def merge_segments_kernel(
    part_acc_ptr, part_ml_ptr, sinks_ptr, v_scale_ptr, out_ptr, num_tokens,
    stride_ot, stride_oh, stride_od,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    SEG_BLOCK: tl.constexpr, HAS_SINKS: tl.constexpr, IS_FP8: tl.constexpr,
):
    """One (token, head) per program: combine the segments' partials by log-sum-exp;
    the sink enters the denominator once, here."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SEG_BLOCK)
    s_ok = s < NUM_SEGMENTS
    part = (s * num_tokens + token) * HQ + head
    m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0)
    m_all = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
        m_all = tl.maximum(m_all, sink)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.exp2(m - m_safe)
    total = tl.sum(l * w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_safe)
    total = tl.where(total == 0.0, 1.0, total)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / total
    if IS_FP8:
        o = o * tl.load(v_scale_ptr)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)
