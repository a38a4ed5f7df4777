"""Record the launches vLLM's own host code makes, instead of running them.

vLLM launches its kernels as ``kernel[grid](...)`` from module-level names. While
:func:`recording` is active, each Triton kernel of the loaded module is replaced by a
:class:`Recorder` that binds the call to the kernel's signature (defaults applied), takes
out the compiler options (``num_warps``, ``num_stages``, ``waves_per_eu`` ...) and keeps a
:class:`dflash_rocm.launches.Launch` with every parameter's value in signature order, so
the audit's compiler specialises it as Triton's JIT would. The grid may be a function of
the launch's arguments, as vLLM's prefix kernel passes it.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from typing import Iterator

from dflash_rocm.launches import Launch


class Recorder:
    """Stands for one Triton kernel: ``recorder[grid](...)`` appends a Launch to ``launches``."""

    def __init__(self, kernel, launches: list[Launch]):
        self.kernel = kernel
        self.launches = launches
        self.signature = inspect.signature(kernel.fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = set(self.signature.parameters)
            options = {k: v for k, v in kwargs.items() if k not in names}
            bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
            bound.apply_defaults()
            values = dict(bound.arguments)
            shape = grid(values) if callable(grid) else grid
            self.launches.append(Launch(kernel=self.kernel, grid=tuple(int(g) for g in shape),
                                        args=tuple(values.values()), constexprs={}, options=options))
        return launch


@contextlib.contextmanager
def recording(*modules: types.ModuleType) -> Iterator[list[Launch]]:
    """Every Triton kernel launched from ``modules`` inside the block is recorded, not run
    (compiled kernels, and those Triton's interpreter runs under ``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    replaced = []
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, (JITFunction, InterpretedFunction)):
                replaced.append((module, name, value))
    for module, name, kernel in replaced:
        setattr(module, name, Recorder(kernel, launches))
    try:
        yield launches
    finally:
        for module, name, kernel in replaced:
            setattr(module, name, kernel)
