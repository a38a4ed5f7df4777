"""What makes an operation an operation: the record dispatch, ``explain`` and tools read.

Each op is a small package beside this module (``ops/attention``, ``ops/precompute``)
holding its call type, its validation (the only way to build a call), its plain-torch
reference and its tolerance; this record ties them together so dispatch is generic. A
backend implements an op with an implementation class whose ``op`` is this record
(:mod:`dflash_rocm.backend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Op:
    name: str  # the public function's name: "draft_attention"
    short: str  # for CLI flags: "attention"
    label: str  # in tables, where the precompute's full name would take a third of a row
    build_call: Callable[..., Any]  # the public arguments -> a validated call
    reference: Callable[[Any], Any]  # the contract in plain torch: what every backend is checked against
    tolerance: Callable[[Any], float]  # the relative error the contract allows for a call

    def __str__(self) -> str:
        return self.name


def describe_argument(value: Any) -> str:
    """One argument as an error shows it: a tensor's (or packed cache's, or what a plan
    knows of either: :class:`dflash_rocm.planning.TensorFacts`) shape and dtype, a
    sequence's entries, any other value as it is."""
    import torch

    from ..contract import dtype_name

    shape = getattr(value, "shape", None)
    if isinstance(value, torch.Tensor) or (shape is not None and hasattr(value, "dtype")):
        packed = hasattr(value, "view") and not isinstance(value, torch.Tensor)
        kind = f"{type(value).__name__} " if packed else ""
        return f"{kind}shape={tuple(shape)} ({dtype_name(value.dtype)}, {value.device.type})"
    if isinstance(value, tuple):
        distinct = {describe_argument(v) for v in value}
        if len(value) > 1 and len(distinct) == 1:
            return f"{len(value)} x {distinct.pop()}"
        return "[" + ", ".join(describe_argument(v) for v in value) + "]"
    return repr(value)


def describe_call(call, names: tuple[str, ...]) -> str:
    """``call``'s arguments ``names``, one line each (what :class:`BackendUnavailable`
    shows beside the reasons)."""
    return "\n".join(f"{name}: {describe_argument(getattr(call, name))}" for name in names)
