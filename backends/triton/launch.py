"""Every Triton launch of this package goes through :func:`launch`.

It applies a launch configuration's compiler options (``waves_per_eu`` only where the
AMD backend understands it) and counts launches per kernel, which ``bench`` reports as
launches per call.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

_counts: collections.Counter = collections.Counter()
_in_flight = 0


def launch(kernel, grid: tuple[int, ...], config: Any, *args, **constexprs) -> None:
    global _in_flight
    options: dict[str, int] = {}
    if config is not None:
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        if config.waves_per_eu and getattr(torch.version, "hip", None):
            options["waves_per_eu"] = config.waves_per_eu
    _in_flight += 1
    try:
        kernel[grid](*args, **constexprs, **options)
    finally:
        _in_flight -= 1
    _counts[kernel.__name__] += 1


def launch_in_flight() -> bool:
    """True while a kernel launch runs (the interpreter issues torch ops of its own)."""
    return _in_flight > 0


def launch_counts() -> dict[str, int]:
    return dict(_counts)
