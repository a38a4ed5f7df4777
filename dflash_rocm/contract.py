"""The contract's constants (docs/SPEC.md): dtypes, tolerances and the error metric.

The bottom of the package: it imports nothing of dflash_rocm, so every layer above
(op packages, backends, tools) can share these without an import cycle.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
          torch.float8_e4m3fn: "fp8e4m3", torch.float8_e4m3fnuz: "fp8e4m3fnuz"}

# SPEC.md "What every backend guarantees": relative error against the reference.
TOLERANCES = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
FP8_TOLERANCE = 6e-2


def spec_tolerance(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> float:
    """The largest ``||out - ref|| / ||ref||`` SPEC.md allows for these dtypes."""
    return FP8_TOLERANCE if cache_dtype in FP8_DTYPES else TOLERANCES[dtype]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    diff, denom = (out - ref).norm().item(), ref.norm().item()
    return diff / denom if denom > 0 else diff


def dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else _SHORT.get(dtype, str(dtype).replace("torch.", ""))
