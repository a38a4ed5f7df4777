"""Every Triton launch of this package goes through :func:`launch`.

It turns a launch configuration into compiler options (the AMD-only ones only where the
AMD backend understands them), reports each launch to :mod:`dflash_rocm.launches`
(``bench`` reads launches per call there), and inside :func:`capture_launches` records
each launch instead of running it: that is how ``dflash-rocm inspect`` and
``tests/aot_compile.py`` see exactly what the host code would launch, at real shapes,
without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from dflash_rocm import launches

# Compiler options only Triton's AMD backend accepts (the NVIDIA backend rejects them).
AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim")

_capture: contextvars.ContextVar[list | None] = contextvars.ContextVar("dflash_rocm_capture", default=None)


@dataclass(frozen=True)
class CapturedLaunch:
    """One launch as the host code made it: the kernel, its grid, the positional
    arguments (tensors as given), the constexpr keywords and every compiler option the
    configuration asks for (AMD-only ones included; :func:`options_for` filters)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    options: dict

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def arg(self, name: str):
        """A positional argument by its parameter name."""
        return self.args[list(inspect.signature(self.kernel.fn).parameters).index(name)]


def compiler_options(config: Any) -> dict[str, int]:
    """The Triton compiler options a launch configuration stands for (0 means "the
    compiler's choice" for the AMD-only options and is left out)."""
    if config is None:
        return {}
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    for name in AMD_ONLY_OPTIONS:
        value = getattr(config, name, 0)
        if value:
            options[name] = value
    return options


def options_for(options: dict, amd: bool) -> dict:
    """``options`` without the AMD-only ones unless the target is AMD."""
    return dict(options) if amd else {k: v for k, v in options.items() if k not in AMD_ONLY_OPTIONS}


@contextlib.contextmanager
def capture_launches() -> Iterator[list[CapturedLaunch]]:
    """Record every :func:`launch` made inside the block instead of running it.

    The host code runs unchanged (tensors may be on the ``meta`` device: nothing is
    read or written), so the captured grids, arguments and constexprs are exactly the
    ones a GPU run would use. Captured launches are not counted.
    """
    captured: list[CapturedLaunch] = []
    token = _capture.set(captured)
    try:
        yield captured
    finally:
        _capture.reset(token)


def launch(kernel, grid: tuple[int, ...], config: Any, *args, **constexprs) -> None:
    options = compiler_options(config)
    captured = _capture.get()
    if captured is not None:
        captured.append(CapturedLaunch(kernel, tuple(grid), args, dict(constexprs), options))
        return
    options = options_for(options, amd=bool(getattr(torch.version, "hip", None)))
    with launches.launching(kernel.__name__):
        kernel[grid](*args, **constexprs, **options)
