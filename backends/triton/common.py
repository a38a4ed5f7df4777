"""What every Triton kernel of this package shares: the interpreter switch, dtype names and
the packed-page addressing rule.

``FP32_MATH`` (a per-launch constexpr, :func:`fp32_math`): the Triton interpreter computes
bfloat16 arithmetic, ``tl.dot`` and ``tl.sum`` on raw bits (wrongly) while its bf16 loads,
stores and casts are right. Kernels therefore upcast bf16 operands to float32 right after
loading when interpreting, so their bf16 code paths (loads, stores, casts, masks,
addressing) still run in CI. float16 and float32 need no upcast (numpy computes them
natively), so for those the interpreter runs the GPU's own code path, casts included.
Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when this package is
imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_rocm.paged import PackedCache
from dflash_rocm.process import INTERPRETING


def fp32_math(dtype: torch.dtype) -> bool:
    """Whether a launch on ``dtype`` operands must compute in float32: bfloat16 under the
    interpreter only."""
    return INTERPRETING and dtype == torch.bfloat16


TL_DTYPES = {
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float32: tl.float32,
    torch.float8_e4m3fn: tl.float8e4nv,
    torch.float8_e4m3fnuz: tl.float8e4b8,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}


def packed_layout(cache: torch.Tensor | PackedCache) -> tuple[torch.Tensor, tuple[int, ...], int, int]:
    """(tensor, six strides, row pack, dim pack) of a plain or packed cache in the 6-D
    addressing of :mod:`dflash_rocm.paged`, without building a view (host path): a plain
    ``[blocks, bs, Hk, D]`` tensor has packs of 1 and in-pack strides of 0."""
    if isinstance(cache, PackedCache):
        view = cache.view
        return view, view.stride(), view.shape[2], view.shape[5]
    s0, s1, s2, s3 = cache.stride()
    return cache, (s0, s1, 0, s2, s3, 0), 1, 1


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def packed_offset(i, stride, stride_in_pack, PACK: tl.constexpr):
    """Offset of index ``i`` along a cache axis packed by ``PACK`` (see
    :mod:`dflash_rocm.paged`): ``(i // PACK) * stride + (i % PACK) * stride_in_pack``.
    ``PACK == 1`` is a plain stride, ``stride_in_pack`` unused (the host passes None)."""
    if PACK == 1:
        return i * stride
    else:
        return (i // PACK) * stride + (i % PACK) * stride_in_pack
