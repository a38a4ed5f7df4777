"""Every Triton launch of this package goes through :func:`launch`.

It applies a launch configuration's compiler options (``waves_per_eu`` only where the
AMD backend understands it) and reports each launch to :mod:`dflash_rocm.launches`,
which ``bench`` reads as launches per call.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_rocm import launches


def launch(kernel, grid: tuple[int, ...], config: Any, *args, **constexprs) -> None:
    options: dict[str, int] = {}
    if config is not None:
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        if config.waves_per_eu and getattr(torch.version, "hip", None):
            options["waves_per_eu"] = config.waves_per_eu
    with launches.launching(kernel.__name__):
        kernel[grid](*args, **constexprs, **options)
