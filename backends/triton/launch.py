"""Every Triton launch of this package goes through :func:`launch`.

It turns a launch configuration into compiler options (the AMD-only ones only where the
AMD backend understands them), reports each launch to :mod:`dflash_rocm.launches`
(``bench`` reads launches per call there), and inside :func:`dflash_rocm.launches.capture`
records each launch instead of running it: that is how ``dflash-rocm inspect``,
``bench --host`` and ``tests/aot_compile.py`` see exactly what the host code would launch,
at real shapes, without a GPU.

Hot launches skip Triton's JIT prelude. ``kernel[grid](...)`` binds every argument,
specialises it through the compiler backend (about 1 us per argument on ROCm), builds a
cache key and looks the compiled kernel up, on every call. A :class:`Launcher` does that
once per specialisation: it keeps the compiled kernel the JIT returned, and later calls
whose arguments specialise the same way (:func:`specialization`, Triton 3.9's rules:
16-byte alignment of pointers, 32-bit buffer ranges on AMD, ints equal to 1, multiples
of 16, 32- or 64-bit) launch it directly through ``CompiledKernel[grid]``, Triton's own
entry point for compiled kernels.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from dflash_rocm import launches

from .common import INTERPRETING

# Compiler options only Triton's AMD backend accepts (the NVIDIA backend rejects them).
AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim")


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


_TWO_GIB = 2 ** 31 - 1
_I32 = (-2 ** 31, 2 ** 31)


def specialization(args: tuple, amd: bool) -> tuple | None:
    """How Triton 3.9 specialises these runtime arguments, as a hashable key (None: an
    argument kind this does not model, so only the JIT may launch). Equal keys mean the
    same compiled kernel serves both argument lists (``native_specialize_impl``: pointer
    alignment to 16 bytes, storage within 2 GiB for AMD buffer ops, ints equal to 1 become
    constants, multiples of 16 get a divisibility hint, 32- or 64-bit int types)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            small = amd and a.untyped_storage().size() <= _TWO_GIB
            key.append((a.dtype, a.data_ptr() & 15 == 0, small))
        elif type(a) is int:
            key.append(1 if a == 1 else (a % 16 == 0, _I32[0] <= a < _I32[1]))
        elif type(a) is float or type(a) is bool:
            key.append(type(a))
        elif a is None:  # a constexpr to Triton (an unused stride): the compiled launcher skips it
            key.append(None)
        else:
            return None
    return tuple(key)


class Launcher:
    """Launches of one kernel with fixed constexprs and compiler options: the first launch
    of each argument specialisation (and device) goes through Triton's JIT, which compiles
    or finds the kernel; later ones call the compiled kernel directly."""

    def __init__(self, kernel, constexprs: dict, options: dict):
        self.kernel, self.constexprs, self.options = kernel, dict(constexprs), dict(options)
        params = kernel.params
        self.num_runtime = sum(1 for p in params if not p.is_constexpr)
        if any(p.is_constexpr for p in params[:self.num_runtime]):
            raise TypeError(f"{kernel.__name__}: declare constexpr parameters after the runtime ones")
        # Triton's compiled launcher takes every parameter in order, constexprs included.
        self.tail = tuple(constexprs[p.name] for p in params[self.num_runtime:])
        self.amd = bool(getattr(torch.version, "hip", None))
        self.current_device = torch.cuda.current_device  # compiled kernels are loaded per device
        self.compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, grid: tuple[int, ...], *args) -> None:
        spec = specialization(args, self.amd)
        if spec is not None:
            spec = (self.current_device(), spec)
            compiled = self.compiled.get(spec)
            if compiled is not None:
                compiled[grid](*args, *self.tail)
                return
        compiled = self.kernel[grid](*args, **self.constexprs, **self.options)
        if spec is not None and compiled is not None:
            with self._lock:
                self.compiled[spec] = compiled


_launchers: dict[tuple, Launcher] = {}
_launchers_lock = threading.Lock()


def launcher(kernel, constexprs: dict, options: dict) -> Launcher:
    """The :class:`Launcher` of ``kernel`` with these constexprs and options (kept)."""
    key = (kernel, tuple(constexprs.items()), tuple(options.items()))
    found = _launchers.get(key)
    if found is None:
        with _launchers_lock:
            found = _launchers.setdefault(key, Launcher(kernel, constexprs, options))
    return found


def launch(kernel, grid: tuple[int, ...], config: Any, *args, **constexprs) -> None:
    options = compiler_options(config)
    captured = launches.capturing()
    if captured is not None:
        captured.append(launches.Launch(kernel, tuple(grid), args, dict(constexprs), options))
        return
    options = options_for(options, amd=bool(getattr(torch.version, "hip", None)))
    with launches.launching(kernel.__name__):
        if INTERPRETING:  # the interpreter has no compiled kernels: every launch runs the Python
            kernel[grid](*args, **constexprs, **options)
        else:
            launcher(kernel, constexprs, options)(grid, *args)


def prelude_seconds(launch, arch: str, repeats: int = 2000) -> tuple[float, float]:
    """What one captured launch costs the host before the driver call on a GPU of ``arch``,
    measured here without one: ``(Triton's JIT entry, the direct path)``.

    The JIT entry is timed as ``JITFunction.run`` does its work: the generated binder
    (binding and specialising every argument through the compiler backend of ``arch``)
    and the cache-key lookup. The direct path is a :class:`Launcher` whose compiled kernel
    is a no-op. Neither includes the driver call itself (argument packing in C, the
    launch), which needs the GPU."""
    import statistics
    import time

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    from dflash_rocm.arch import arch_info

    jit = JITFunction(launch.kernel.fn)
    target = arch_info(arch).compile_target
    backend = make_backend(GPUTarget(*target))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    options = options_for(launch.options, amd=target[0] == "hip")
    key_cache: dict = {}

    def through_jit():
        _, spec, opts = binder(*launch.args, **launch.constexprs, **options)
        compute_cache_key(key_cache, spec, opts)

    direct = Launcher(jit, launch.constexprs, options)
    direct.amd = target[0] == "hip"
    direct.current_device = lambda: 0
    direct.compiled[(0, specialization(launch.args, direct.amd))] = _NoopCompiled()

    def through_launcher():
        direct(launch.grid, *launch.args)

    def median(fn) -> float:
        for _ in range(repeats // 10):
            fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    return median(through_jit), median(through_launcher)


class _NoopCompiled:
    """A compiled kernel whose launch does nothing (host-cost measurement)."""

    def __getitem__(self, grid):
        return _noop


def _noop(*args) -> None:
    return None
