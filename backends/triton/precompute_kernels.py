"""Triton kernels of the fused context-KV precompute: one launch for all layers (two when
the hidden size is split).

One program computes a ``[BLOCK_T tokens, head_dim]`` tile of one (layer, K or V, KV
head): the GEMM against the K/V weight rows with the hidden RMSNorm folded in (the
norm weight is pre-multiplied into the rows; the per-token inverse RMS, accumulated from
the same loads of ``x``, scales the tile), then the epilogue: bias, the K head's RMSNorm
and RoPE, the value scale, and the store straight into that layer's paged cache slot.

RoPE without shuffles: the K rows of every head are permuted once (host side) so that
each rotation pair sits in adjacent columns; ``reshape`` + ``split`` then give the two
halves of every pair, and the store scatters each column back to its original dim.

Caches of different layers are separate tensors: a small int64 table holds, per layer,
the K and V cache base addresses, the slot-mapping address (0: layer not written), the
block size and both caches' strides, so one launch addresses all of them.
"""

import triton
import triton.language as tl

META_COLS = 12  # per layer: k_ptr, v_ptr, slot_ptr, block_size, 4 K-cache strides, 4 V-cache strides
_META_COLS: tl.constexpr = tl.constexpr(META_COLS)


@triton.jit
def _round_to_fp8_grid(x, MIN_EXP: tl.constexpr):
    """Round float32 ``x`` to the nearest e4m3 value (3 mantissa bits; normals down to
    2**MIN_EXP, subnormals below). Interpreter only: its float->fp8 conversion drops the
    carry when rounding crosses a power of two (1.94 becomes 1.0, not 2.0); a value already
    on the grid converts exactly."""
    a = tl.abs(x)
    e = tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), MIN_EXP)
    step = tl.exp2(e - 3)
    r = tl.floor(a / step + 0.5) * step
    return tl.where(x < 0, -r, r)


@triton.jit
def _store_tile(acc, t, t_ok, layer, kind, kv_head, dim, c_ok, N, meta_ptr, k_scales_ptr, v_scales_ptr,
                out_k_ptr, out_v_ptr, HK: tl.constexpr, D: tl.constexpr, IS_FP8: tl.constexpr,
                FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, CACHE_DTYPE: tl.constexpr,
                SLOT_DTYPE: tl.constexpr, RETURN_KV: tl.constexpr, FP32_MATH: tl.constexpr):
    meta = meta_ptr + layer * _META_COLS
    slot_addr = tl.load(meta + 2)
    if slot_addr != 0:
        slots = tl.load(slot_addr.to(tl.pointer_type(SLOT_DTYPE)) + t, mask=t_ok, other=-1).to(tl.int64)
        ok = t_ok & (slots >= 0)
        block_size = tl.load(meta + 3)
        block = slots // block_size
        row = slots % block_size
        strides = meta + 4 + 4 * kind
        offset = (block[:, None] * tl.load(strides) + row[:, None] * tl.load(strides + 1)
                  + kv_head * tl.load(strides + 2) + dim[None, :] * tl.load(strides + 3))
        value = acc
        if IS_FP8:
            if kind == 0:
                scale = tl.load(k_scales_ptr + layer)
            else:
                scale = tl.load(v_scales_ptr + layer)
            value = tl.minimum(tl.maximum(value / scale, -FP8_MAX), FP8_MAX)
            if FP32_MATH:
                value = _round_to_fp8_grid(value, FP8_MIN_EXP)
        base = tl.load(meta + kind).to(tl.pointer_type(CACHE_DTYPE))
        tl.store(base + offset, value.to(CACHE_DTYPE), mask=ok[:, None] & c_ok[None, :])
    if RETURN_KV:
        out = ((layer * N + t.to(tl.int64))[:, None] * HK + kv_head) * D + dim[None, :]
        mask = t_ok[:, None] & c_ok[None, :]
        if kind == 0:
            tl.store(out_k_ptr + out, acc.to(out_k_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_v_ptr + out, acc.to(out_v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(acc, inv_rms, pid_t, head_row, N, positions_ptr, bias_ptr, k_norm_ptr, cos_sin_ptr, stride_cs,
              meta_ptr, k_scales_ptr, v_scales_ptr, out_k_ptr, out_v_ptr, v_scale, eps,
              HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
              HAS_BIAS: tl.constexpr, IS_NEOX: tl.constexpr, HAS_V_SCALE: tl.constexpr, IS_FP8: tl.constexpr,
              FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, CACHE_DTYPE: tl.constexpr,
              SLOT_DTYPE: tl.constexpr, RETURN_KV: tl.constexpr, FP32_MATH: tl.constexpr):
    layer = head_row // (2 * HK)
    kind = (head_row // HK) % 2  # 0: K, 1: V
    kv_head = head_row % HK
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    acc = acc * inv_rms[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + head_row * D + c, mask=c_ok, other=0.0)[None, :]
    # Column c holds original dim `dim` (K rows were permuted so RoPE pairs are adjacent).
    pair = c // 2
    if IS_NEOX:
        k_dim = tl.where(pair < R // 2, pair + (c % 2) * (R // 2), c)
    else:
        k_dim = c
    dim = tl.where(kind == 0, k_dim, c)
    if kind == 0:
        inv_k = tl.rsqrt(tl.sum(acc * acc, 1) / D + eps)
        acc = acc * inv_k[:, None] * tl.load(k_norm_ptr + layer * D + k_dim, mask=c_ok, other=0.0)[None, :]
        pos = tl.load(positions_ptr + t, mask=t_ok, other=0).to(tl.int64)
        i = tl.arange(0, BLOCK_D // 2)
        rot = t_ok[:, None] & (i < R // 2)[None, :]
        cs = cos_sin_ptr + pos[:, None] * stride_cs + i[None, :]
        cos = tl.load(cs, mask=rot, other=1.0)
        sin = tl.load(cs + R // 2, mask=rot, other=0.0)
        x1, x2 = tl.split(tl.reshape(acc, (BLOCK_T, BLOCK_D // 2, 2)))
        acc = tl.reshape(tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin), (BLOCK_T, BLOCK_D))
    else:
        if HAS_V_SCALE:
            acc = acc * v_scale
    _store_tile(acc, t, t_ok, layer, kind, kv_head, dim, c_ok, N, meta_ptr, k_scales_ptr, v_scales_ptr,
                out_k_ptr, out_v_ptr, HK, D, IS_FP8, FP8_MAX, FP8_MIN_EXP, CACHE_DTYPE, SLOT_DTYPE, RETURN_KV,
                FP32_MATH)


@triton.jit
def context_kv_kernel(
    x_ptr, w_ptr, part_acc_ptr, part_ss_ptr, positions_ptr, bias_ptr, k_norm_ptr, cos_sin_ptr,
    meta_ptr, k_scales_ptr, v_scales_ptr, out_k_ptr, out_v_ptr,
    N, H, stride_xt, stride_xh, stride_cs, v_scale, eps,
    HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_NEOX: tl.constexpr, HAS_V_SCALE: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, CACHE_DTYPE: tl.constexpr, SLOT_DTYPE: tl.constexpr,
    RETURN_KV: tl.constexpr, FP32_MATH: tl.constexpr,
):
    pid_t = tl.program_id(0)
    head_row = tl.program_id(1)  # (layer * 2 + kind) * HK + kv_head
    pid_k = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < N
    c = tl.arange(0, BLOCK_D)
    c_ok = c < D
    w_rows = (head_row * D + c).to(tl.int64)
    k_per = tl.cdiv(tl.cdiv(H, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(H, k_lo + k_per)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    sum_sq = tl.zeros([BLOCK_T], tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + kk
        k_ok = k < k_hi
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :] * stride_xh,
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + w_rows[:, None] * H + k[None, :], mask=c_ok[:, None] & k_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        sum_sq += tl.sum(xf * xf, 1)
        if FP32_MATH:
            x = xf
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w))
    if SPLIT_K == 1:
        _epilogue(acc, tl.rsqrt(sum_sq / H + eps), pid_t, head_row, N, positions_ptr, bias_ptr, k_norm_ptr,
                  cos_sin_ptr, stride_cs, meta_ptr, k_scales_ptr, v_scales_ptr, out_k_ptr, out_v_ptr, v_scale,
                  eps, HK, D, R, BLOCK_T, BLOCK_D, HAS_BIAS, IS_NEOX, HAS_V_SCALE, IS_FP8, FP8_MAX, FP8_MIN_EXP,
                  CACHE_DTYPE, SLOT_DTYPE, RETURN_KV, FP32_MATH)
    else:
        t64 = t.to(tl.int64)
        part = (pid_k * N + t64)[:, None] * (ROWS * D) + head_row * D + c[None, :]
        tl.store(part_acc_ptr + part, acc, mask=t_ok[:, None] & c_ok[None, :])
        if head_row == 0:
            tl.store(part_ss_ptr + pid_k * N + t64, sum_sq, mask=t_ok)


@triton.jit
def context_kv_split_epilogue_kernel(
    part_acc_ptr, part_ss_ptr, positions_ptr, bias_ptr, k_norm_ptr, cos_sin_ptr,
    meta_ptr, k_scales_ptr, v_scales_ptr, out_k_ptr, out_v_ptr,
    N, H, stride_cs, v_scale, eps,
    HK: tl.constexpr, D: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, IS_NEOX: tl.constexpr, HAS_V_SCALE: tl.constexpr, IS_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, CACHE_DTYPE: tl.constexpr, SLOT_DTYPE: tl.constexpr,
    RETURN_KV: tl.constexpr, FP32_MATH: tl.constexpr,
):
    """Second launch when the hidden size was split: sum the parts, then the same epilogue."""
    pid_t = tl.program_id(0)
    head_row = tl.program_id(1)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < N
    c = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (c < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    sum_sq = tl.zeros([BLOCK_T], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_acc_ptr + (s * N + t)[:, None] * (ROWS * D) + head_row * D + c[None, :],
                       mask=mask, other=0.0)
        sum_sq += tl.load(part_ss_ptr + s * N + t, mask=t_ok, other=0.0)
    _epilogue(acc, tl.rsqrt(sum_sq / H + eps), pid_t, head_row, N, positions_ptr, bias_ptr, k_norm_ptr,
              cos_sin_ptr, stride_cs, meta_ptr, k_scales_ptr, v_scales_ptr, out_k_ptr, out_v_ptr, v_scale, eps,
              HK, D, R, BLOCK_T, BLOCK_D, HAS_BIAS, IS_NEOX, HAS_V_SCALE, IS_FP8, FP8_MAX, FP8_MIN_EXP,
              CACHE_DTYPE, SLOT_DTYPE, RETURN_KV, FP32_MATH)
