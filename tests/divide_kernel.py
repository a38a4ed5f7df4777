"""Kernels that apply the precompute epilogue's helpers (``divide``, the interpreter's fp8
rounding) to a tensor, for their tests (Triton resolves a kernel's names in its module's
globals, so they live in a module of their own, imported only where the Triton interpreter
or a GPU runs them)."""

import triton
import triton.language as tl

from dflash_rocm.backends.triton.precompute_kernels import _round_to_fp8_grid, divide


@triton.jit
def divide_kernel(x_ptr, divisor_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, divide(tl.load(x_ptr + i), tl.load(divisor_ptr)))


@triton.jit
def fp8_round_kernel(x_ptr, out_ptr, MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _round_to_fp8_grid(tl.load(x_ptr + i), MIN_EXP).to(out_ptr.dtype.element_ty))
