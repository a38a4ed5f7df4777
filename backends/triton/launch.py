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


def launch(kernel, grid: tuple[int, ...], config: Any, *args, **constexprs) -> None:
    options: dict[str, int] = {}
    if config is not None:
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        if config.waves_per_eu and getattr(torch.version, "hip", None):
            options["waves_per_eu"] = config.waves_per_eu
    kernel[grid](*args, **constexprs, **options)
    _counts[kernel.__name__] += 1


def launch_counts() -> dict[str, int]:
    return dict(_counts)


def reset_launch_counts() -> None:
    _counts.clear()
