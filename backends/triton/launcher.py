"""Every Triton launch of this package goes through :func:`launch`.

It turns a launch configuration into compiler options (the AMD-only ones only where the
AMD backend understands them), reports each launch to :mod:`dflash_rocm.launches`
(``bench`` reads launches per call there), and inside :func:`dflash_rocm.launches.capture`
records each launch instead of running it: that is how ``dflash-rocm inspect``,
``bench --host`` and ``tests/aot_compile.py`` see exactly what the host code would launch,
at real shapes, without a GPU.

Hot launches skip Triton's JIT prelude. ``kernel[grid](...)`` binds every argument,
specialises it through the compiler backend (about 1 us per argument on ROCm), builds a
cache key and looks the compiled kernel up, on every call. A launch plan's
:class:`Launcher` does that once: it keeps the compiled kernel the JIT returned, and later
calls whose arguments specialise the same way (:func:`specialization`, Triton 3.9's rules:
16-byte alignment of pointers, 32-bit buffer ranges on AMD, ints equal to 1, multiples
of 16, 32- or 64-bit) launch it directly through ``CompiledKernel[grid]``, Triton's own
entry point for compiled kernels. That entry point takes what the JIT would hand its
launcher and nothing else: a grid of exactly three dimensions (:func:`launch_grid`) and
the arguments the kernel was compiled to take (:func:`launch_tail`).
"""

from __future__ import annotations

import operator
from types import SimpleNamespace
from typing import Any, Callable

import torch

from dflash_rocm import launches
from dflash_rocm.process import HIP
from dflash_rocm.timing import host_median_seconds

from .common import INTERPRETING

# Compiler options only Triton's AMD backend accepts (the NVIDIA backend rejects them).
AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim")


def compiler_options(config: Any) -> dict[str, int]:
    """The Triton compiler options a launch configuration stands for (0 means "the
    compiler's choice" for the AMD-only options and is left out)."""
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


def tensor_specialization(tensors: tuple, amd: bool) -> tuple | None:
    """:func:`specialization` of arguments that are all tensors (a launch plan's per-call
    arguments), in one comprehension: this runs for every launch."""
    try:
        if amd:
            return tuple([(t.dtype, not t.data_ptr() & 15, t.untyped_storage().nbytes() <= _TWO_GIB)
                          for t in tensors])
        return tuple([(t.dtype, not t.data_ptr() & 15, False) for t in tensors])
    except AttributeError:  # not all tensors after all
        return specialization(tensors, amd)


def launch_grid(grid: tuple[int, ...]) -> tuple[int, int, int]:
    """``grid`` as the three dimensions a compiled kernel's entry indexes (``grid[0]``,
    ``grid[1]``, ``grid[2]``: a shorter tuple raises IndexError there, in every Triton 3.x);
    the JIT fills the missing ones with 1 itself, so both paths launch the same programs."""
    grid = tuple(grid)
    if not 1 <= len(grid) <= 3:
        raise ValueError(f"a Triton grid has 1 to 3 dimensions, not {len(grid)}: {grid}")
    return grid + (1,) * (3 - len(grid))


def launch_tail(compiled, params, constexprs: dict) -> tuple | None:
    """What a compiled kernel's launcher takes after the runtime arguments, read from the
    signature the JIT compiled it with (``compiled.src.signature``: one entry, by parameter
    name, per argument its launcher parses). Triton 3.3 and later put every parameter there
    and pass every one, constexprs included (their launchers skip them): the tail is the
    constexprs in order. Triton 3.0-3.2 put only the runtime parameters there and pass only
    those: no tail. None where the signature is missing or names something else: that
    launcher's arguments are unknown, so only the JIT may launch the kernel."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    names = list(signature)
    constexpr_params = [p for p in params if p.is_constexpr]
    if names == [p.name for p in params]:
        return tuple(constexprs[p.name] for p in constexpr_params)
    if names == [p.name for p in params if not p.is_constexpr]:
        return ()
    return None


class Launcher:
    """One launch plan's kernel launches with fixed constexprs and compiler options: the
    kernel compiled for the arguments' specialisation (and the current device) is kept in
    one slot and called directly, with the arguments :func:`launch_tail` reads from it,
    over a grid of three dimensions (:func:`launch_grid`); a call that specialises another
    way goes through Triton's JIT, which compiles or finds its kernel (Triton's own cache),
    and that kernel takes the slot. A plan's calls specialise one way in serving (its
    record holds the caches' alignment; the rest are the engine's own buffers), so the
    slot is a plan's compiled kernel, not a table of them."""

    def __init__(self, kernel, constexprs: dict, options: dict):
        self.kernel, self.constexprs, self.options = kernel, dict(constexprs), dict(options)
        params = kernel.params
        num_runtime = sum(1 for p in params if not p.is_constexpr)
        if any(p.is_constexpr for p in params[:num_runtime]):
            raise TypeError(f"{kernel.__name__}: declare constexpr parameters after the runtime ones")
        self.current_device = torch.cuda.current_device  # compiled kernels are loaded per device
        self.compiled: tuple = (None, None, ())  # (device and specialisation, compiled kernel, launch_tail)

    def run(self, grid: tuple[int, int, int], args: tuple, spec) -> None:
        """Launch over ``grid`` (three dimensions: :func:`launch_grid`) with ``spec``:
        :func:`specialization` of ``args``, or any key that changes whenever it would (None:
        only the JIT may launch)."""
        if spec is not None:
            spec = (self.current_device(), spec)
            kept_spec, compiled, tail = self.compiled
            if spec == kept_spec:
                compiled[grid](*args, *tail)
                return
        compiled = self.kernel[grid](*args, **self.constexprs, **self.options)
        if spec is not None and compiled is not None:
            self.keep(spec, compiled)

    def keep(self, spec: tuple, compiled) -> None:
        """Launch later calls of ``spec`` (device, specialisation) through ``compiled``
        directly, if :func:`launch_tail` knows its launcher's arguments; otherwise they keep
        going through the JIT."""
        tail = launch_tail(compiled, self.kernel.params, self.constexprs)
        if tail is not None:
            self.compiled = (spec, compiled, tail)  # one assignment: a racing thread sees the old or the new


_parameters: dict = {}


def kernel_parameters(kernel) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(runtime parameter names, constexpr names) of ``kernel`` in declaration order (kept
    per kernel function: a plan is made more often than a kernel is defined; a JITFunction's
    own hash walks its dependencies, which fails for the interpreter's). The interpreter's
    kernels carry no parameter kinds; they are read from the function as the JIT would."""
    key = getattr(kernel, "fn", kernel)
    found = _parameters.get(key)
    if found is None:
        params = getattr(kernel, "params", None)
        if params is None:
            from triton.runtime.jit import JITFunction
            params = JITFunction(kernel.fn).params
        found = (tuple(p.name for p in params if not p.is_constexpr), tuple(p.name for p in params if p.is_constexpr))
        _parameters[key] = found
    return found


def bound_names(kernel, per_call, static_args: dict, constexprs: dict) -> tuple[tuple[str, ...], tuple]:
    """(the per-call parameter names in the kernel's order, ``static_args`` in the kernel's
    order), after checking every name against the kernel's signature: ``per_call`` must
    name the kernel's leading runtime parameters (in any order: calls pass them by name;
    the kernels declare them first so that a launch only prepends them to the fixed
    arguments), ``static_args`` (runtime arguments by parameter name) the rest of the
    runtime parameters and ``constexprs`` every constexpr. A missing, unknown or misplaced
    name is a TypeError naming it, raised when the plan is made (calls then only pass
    tensors)."""
    runtime, constexpr_names = kernel_parameters(kernel)
    leading = runtime[:len(per_call)]
    expected = runtime[len(per_call):]
    if (sorted(per_call) != sorted(leading) or static_args.keys() != set(expected)
            or constexprs.keys() != set(constexpr_names)):
        _refuse_names(kernel.__name__, runtime, constexpr_names, tuple(per_call), static_args, constexprs)
    return leading, tuple([static_args[n] for n in expected])


def _names(names) -> str:
    return ", ".join(repr(n) for n in names)


def _refuse_names(name: str, runtime: tuple, constexpr_names: tuple, per_call: tuple, static_args: dict,
                  constexprs: dict) -> None:
    """The TypeError :func:`bound_names` raises, naming the first wrong name."""
    leading = runtime[:len(per_call)]
    if sorted(per_call) != sorted(leading):
        wrong = [n for n in per_call if n not in leading] or [n for n in leading if n not in per_call]
        raise TypeError(f"{name}: per-call arguments must be the kernel's leading parameters {_names(leading)}, "
                        f"each once; {wrong[0]!r} is {'not one of them' if wrong[0] not in leading else 'missing'}")
    for given, wanted, what in ((static_args, runtime[len(per_call):], "runtime argument"),
                                (constexprs, constexpr_names, "constexpr")):
        unknown = [n for n in given if n not in wanted]
        if unknown:
            raise TypeError(f"{name}: unknown {what}(s) {_names(unknown)} (expected {_names(wanted)})")
        missing = [n for n in wanted if n not in given]
        if missing:
            raise TypeError(f"{name}: missing {what}(s) {_names(missing)}")


class LaunchPlan:
    """One launch of a call structure (FlashInfer's "plan once, run many"): the kernel, its
    grid, constexprs, options and scalar arguments are fixed when the plan is made, by
    parameter name (checked and put in the kernel's order then, once); each call passes
    only the tensors named ``per_call``, by name, to :meth:`launch`, and only their
    specialisation is checked.

    ``kept``: the per-call parameters that always get tensors the caller keeps and never
    re-points (its own derived weights, tables, scratch): their specialisation is worked
    out again only when one of them is another tensor object than the last call's."""

    def __init__(self, kernel, grid: tuple[int, ...], options: dict, per_call: tuple[str, ...], static_args: dict,
                 constexprs: dict, *, amd: bool | None = None, direct: Launcher | None = None,
                 kept: tuple[str, ...] = ()):
        self.kernel, self.grid, self.name = kernel, tuple(grid), kernel.__name__
        self.launch_grid = launch_grid(self.grid)
        self.per_call, self.static_args = bound_names(kernel, tuple(per_call), static_args, constexprs)
        unknown = [n for n in kept if n not in self.per_call]
        if unknown:
            raise TypeError(f"{self.name}: kept {_names(unknown)} are not per-call parameters")
        self.kept = tuple(n for n in self.per_call if n in kept)
        kept_at = tuple(i for i, n in enumerate(self.per_call) if n in kept)
        dynamic_at = tuple(i for i, n in enumerate(self.per_call) if n not in kept)
        self._kept_at = kept_at
        self._pick_kept = _picker(kept_at)
        self._pick_dynamic = _picker(dynamic_at)
        self._kept_spec: tuple = ((), ())  # (the kept tensors last seen, their specialisation)
        self.requested = dict(options)
        self.amd = HIP if amd is None else amd
        self.options = options_for(self.requested, amd=self.amd)
        self.constexprs = dict(constexprs)
        self.static_spec = specialization(self.static_args, self.amd)
        if direct is None and not INTERPRETING:
            direct = Launcher(kernel, self.constexprs, self.options)
        self.direct = direct  # None: the interpreter, which has no compiled kernels
        self.launching = launches.launching(self.name)
        self._in_order = _picker(self.per_call)

    def launch(self, **tensors: torch.Tensor) -> None:
        """Launch with the per-call tensors, each by its parameter name: every name of
        :attr:`per_call` once and no other (else a TypeError naming the first wrong one)."""
        try:
            ordered = self._in_order(tensors)
        except KeyError:
            ordered = None
        if ordered is None or len(tensors) != len(self.per_call):
            self._refuse_tensors(tensors)
        args = ordered + self.static_args
        captured = launches.capturing()
        if captured is not None:
            captured.append(launches.Launch(kernel=self.kernel, grid=self.grid, args=args, constexprs=self.constexprs,
                                            options=self.requested, per_call=len(ordered), kept=self.kept))
            return
        with self.launching:
            if self.direct is None:  # every launch runs the Python
                self.kernel[self.grid](*args, **self.constexprs, **self.options)
            else:
                self.direct.run(self.launch_grid, args, self.specialization(ordered))

    def _refuse_tensors(self, tensors: dict) -> None:
        """The TypeError :meth:`launch` raises, naming an unknown name first, as Python's
        own argument binding does, then a missing one."""
        unknown = [n for n in tensors if n not in self.per_call]
        if unknown:
            raise TypeError(f"{self.name}.launch() got an unexpected per-call tensor {unknown[0]!r}")
        missing = [n for n in self.per_call if n not in tensors]
        raise TypeError(f"{self.name}.launch() missing the per-call tensor {missing[0]!r}")

    def specialization(self, tensors: tuple):
        """The key of the per-call tensors' specialisation with the fixed arguments' (None:
        only the JIT may launch): the kept tensors' is reused while they are the same
        objects (the partition is part of the key, so plans that keep different
        parameters never share an entry)."""
        if self.static_spec is None:
            return None
        if not self._kept_at:
            dynamic = tensor_specialization(tensors, self.amd)
            return None if dynamic is None else (dynamic, self.static_spec)
        kept = self._pick_kept(tensors)
        seen, kept_spec = self._kept_spec
        if len(seen) != len(kept) or any(map(operator.is_not, kept, seen)):
            kept_spec = tensor_specialization(kept, self.amd)
            self._kept_spec = (kept, kept_spec)
        dynamic = tensor_specialization(self._pick_dynamic(tensors), self.amd)
        return None if dynamic is None or kept_spec is None else (self._kept_at, dynamic, kept_spec,
                                                                  self.static_spec)


def _picker(keys: tuple) -> Callable[[Any], tuple]:
    """A function giving the items at ``keys`` (of a tuple: indices; of a dict: names, a
    KeyError for a missing one), in that order, as a tuple (C speed)."""
    if not keys:
        return lambda t: ()
    get = operator.itemgetter(*keys)
    return get if len(keys) > 1 else (lambda t: (get(t),))


def prelude_seconds(launch, arch: str, repeats: int = 2000) -> tuple[float, float]:
    """What one captured launch costs the host before the driver call on a GPU of ``arch``,
    measured here without one: ``(Triton's JIT entry, the direct path)``.

    The JIT entry is timed as ``JITFunction.run`` does its work: the generated binder
    (binding and specialising every argument through the compiler backend of ``arch``)
    and the cache-key lookup. The direct path is the launch's :class:`LaunchPlan` (its
    per-call arguments specialised, the rest fixed) over a :class:`Launcher` whose compiled
    kernel is a no-op. Neither includes the driver call itself (argument packing in C, the
    launch), which needs the GPU."""
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

    amd = target[0] == "hip"
    direct = Launcher(jit, launch.constexprs, options)
    direct.current_device = lambda: 0
    per_call = len(launch.args) if launch.per_call is None else launch.per_call
    tensors = launch.args[:per_call]
    names = kernel_parameters(jit)[0]
    plan = LaunchPlan(jit, launch.grid, launch.options, names[:per_call],
                      dict(zip(names[per_call:], launch.args[per_call:])), launch.constexprs, amd=amd, direct=direct,
                      kept=launch.kept)
    direct.keep((0, plan.specialization(tensors)), _NoopCompiled(jit.params))
    named = dict(zip(names, tensors))

    def through_launcher():
        plan.launch(**named)

    return host_median_seconds(through_jit, repeats), host_median_seconds(through_launcher, repeats)


class _NoopCompiled:
    """A compiled kernel whose launch does nothing (host-cost measurement), compiled as
    Triton 3.3 and later compile (every parameter in its signature)."""

    def __init__(self, params):
        self.src = SimpleNamespace(signature={p.name: None for p in params})

    def __getitem__(self, grid):
        return _noop


def _noop(*args) -> None:
    return None
