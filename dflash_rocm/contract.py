"""The contract's constants (docs/SPEC.md): dtypes, tolerances and the error metric.

The bottom of the package: it imports nothing of dflash_rocm, so every layer above
(op packages, backends, tools) can share these without an import cycle.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

DTYPE_NAMES = {
    "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fnuz": torch.float8_e4m3fnuz,
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
}
"""The dtype names the docs and the command line use, and torch's own (``fp8`` is e4m3fn,
OCP's format; MI300's is ``fp8_e4m3fnuz``)."""

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


def as_dtype(value: torch.dtype | str, what: str = "dtype") -> torch.dtype:
    """``value`` as a torch dtype: a dtype as it is, or a name of :data:`DTYPE_NAMES` (any
    case). Anything else is refused naming what is accepted (a name passed on to torch's
    ``.to()`` would be read as a device: "Invalid device string")."""
    if isinstance(value, torch.dtype):
        return value
    accepted = f"a torch.dtype or one of {', '.join(DTYPE_NAMES)}"
    if not isinstance(value, str):
        raise TypeError(f"{what}: expected {accepted}, got {type(value).__name__} {value!r}")
    found = DTYPE_NAMES.get(value.lower())
    if found is None:
        raise ValueError(f"{what}: expected {accepted}, got {value!r}")
    return found


def dtype_name(dtype: torch.dtype | None) -> str:
    return "none" if dtype is None else _SHORT.get(dtype, str(dtype).replace("torch.", ""))
