"""Compile a captured launch for a GPU target exactly as Triton's JIT would specialise it.

A real launch is not compiled from the bare signature: the JIT marks pointers whose
address is 16-byte aligned and ints divisible by 16 (``tt.divisibility``), turns ints
equal to 1 into constants, and on AMD marks tensors under 2 GiB for 32-bit buffer
addressing (``tt.pointer_range``). Compiling without those attributes gives scalar
loads, more registers and scratch that no real launch has. So the specialisation is
made by Triton's own binder (``create_function_from_signature`` + ``_pack_args``) from
the captured arguments: tensors may be ``meta`` tensors, whose address (0) is aligned
and whose storage size decides the 2 GiB attribute, just as a real allocation would.

Compiled facts are cached on disk (one JSON per kernel source hash, specialisation,
options, target and Triton version), so a rerun of the sweep only parses JSON.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from dflash_rocm.backends.triton.launcher import options_for
from dflash_rocm.launches import Launch

from .targets import TARGETS, Target

FACTS_VERSION = 4  # bump when the facts read from the ISA change


@dataclass(frozen=True)
class Specialisation:
    """What ``triton.compile`` needs for one launch on one target, and its cache key."""

    module: str
    kernel: str
    arch: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str
    flags: dict  # runtime parameter -> "D" (16-divisible/aligned), "S" (under 2 GiB: 32-bit offsets), "=1", "none"


def _jit_function(kernel):
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{kernel!r} is not a compilable Triton kernel: the kernel modules were imported with "
                           "TRITON_INTERPRET=1 (run the audit in a process without it)")
    return kernel


# The compilation knobs ``JITFunction.run`` adds to a launch's options: Triton 3.6-3.8 add
# ``instrumentation_mode``, 3.9 also ``fpsan_homomorphic_casts``. Only the installed Triton's
# are passed: ``_pack_args`` refuses an option its backend does not know (a KeyError).
_JIT_RUN_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")


def _jit_run_knobs(knobs) -> dict:
    return {name: getattr(knobs.compilation, name) for name in _JIT_RUN_KNOBS if hasattr(knobs.compilation, name)}


def specialise(launch: Launch, target: Target) -> Specialisation:
    """The signature, constexprs, attributes and options Triton's launcher derives from
    ``launch``'s arguments for ``target``."""
    import triton
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel = _jit_function(launch.kernel)
    backend = make_backend(target.triton_target())
    kwargs = {**launch.constexprs, **options_for(launch.options, target.amd), "debug": False,
              **_jit_run_knobs(knobs)}
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, options)
    options = dict(options.__dict__)
    flags = {}
    for param in kernel.params:
        if param.is_constexpr:
            continue
        found = {a for a, _ in attrs.get((param.num,), [])}
        if signature[param.name] == "constexpr":  # an int equal to 1, or None (an unused packed-page stride)
            flags[param.name] = "none" if launch.arg(param.name) is None else "=1"
        else:
            flags[param.name] = ("D" if "tt.divisibility" in found else "") + \
                ("S" if "tt.pointer_range" in found else "")
    ident = json.dumps([kernel.cache_key, target.arch, signature, sorted(map(repr, constexprs.items())),
                        sorted(map(repr, attrs.items())), sorted(map(repr, options.items())),
                        triton.__version__, FACTS_VERSION], default=repr)
    return Specialisation(kernel.fn.__module__, kernel.fn.__name__, target.arch, signature, constexprs, attrs,
                          options, hashlib.sha256(ident.encode()).hexdigest()[:32], flags)


def compile_specialisation(spec: Specialisation):
    """``triton.compile`` of one specialisation (the CompiledKernel, with every stage's text)."""
    import triton
    from triton.compiler import ASTSource

    kernel = _jit_function(getattr(importlib.import_module(spec.module), spec.kernel))
    src = ASTSource(kernel, spec.signature, spec.constexprs, spec.attrs)
    return triton.compile(src, target=TARGETS[spec.arch].triton_target(), options=spec.options)


def _facts_of(spec: Specialisation) -> dict:
    from .isa import compiled_facts

    return compiled_facts(compile_specialisation(spec), TARGETS[spec.arch])


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # kernels must import as compilable JIT functions
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


def _facts_or_error(spec: Specialisation) -> dict:
    try:
        return _facts_of(spec)
    except Exception as exc:  # one failing compile is a finding of the audit, not a crash of it
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


class FactsCache:
    """Compiled facts on disk, one JSON file per specialisation key (None: no disk cache)."""

    def __init__(self, directory: Path | None):
        self.directory = directory

    def get(self, key: str) -> dict | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, facts: dict) -> None:
        if self.directory is None or "error" in facts:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(facts))
        os.replace(tmp, self.directory / f"{key}.json")


def default_cache_dir() -> Path:
    from dflash_rocm.tuning import cache_dir

    return cache_dir() / "audit"


def compile_all(specs: Iterable[Specialisation], cache: FactsCache, jobs: int = 1,
                progress: Callable[[int, int, str], None] | None = None) -> dict[str, dict]:
    """Facts for every distinct specialisation (key -> facts), compiling what the cache
    lacks on ``jobs`` worker processes."""
    unique = {s.key: s for s in specs}
    facts: dict[str, dict] = {}
    todo = []
    for key, spec in unique.items():
        cached = cache.get(key)
        if cached is not None:
            facts[key] = cached
        else:
            todo.append(spec)
    done = len(facts)
    total = len(unique)
    if progress and done:
        progress(done - 1, total, f"{done} cached")

    def finished(spec: Specialisation, result: dict) -> None:
        nonlocal done
        facts[spec.key] = result
        cache.put(spec.key, result)
        done += 1
        if progress:
            progress(done - 1, total, f"{spec.arch} {spec.kernel}")

    if jobs <= 1 or len(todo) <= 1:
        for spec in todo:
            finished(spec, _facts_or_error(spec))
        return facts, len(todo)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context,
                                                initializer=_worker_init) as pool:
        futures = {pool.submit(_facts_or_error, spec): spec for spec in todo}
        for future in concurrent.futures.as_completed(futures):
            finished(futures[future], future.result())
    return facts, len(todo)
