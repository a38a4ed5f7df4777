"""A kernel that applies the precompute's ``divide`` to a tensor, for its test (Triton
resolves a kernel's names in its module's globals, so it lives in a module of its own,
imported only where the Triton interpreter or a GPU runs it)."""

import triton
import triton.language as tl

from dflash_rocm.backends.triton.precompute_kernels import divide


@triton.jit
def divide_kernel(x_ptr, divisor_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, divide(tl.load(x_ptr + i), tl.load(divisor_ptr)))
