"""Choosing a backend per call: a lazy registry, a priority walk, reasons for every no.

Backend classes are imported on first use by dotted path (as vLLM's attention
registry does), so a broken or absent vendor stack only costs that backend: its
import error becomes its reason. ``auto`` takes the first backend of
``AUTO_ORDER`` that supports the call; a named backend that cannot serve raises
:class:`BackendUnavailable` with its reasons. Each new (op, backend, call signature)
is logged once with the reasons of the backends passed over, and every served call
is counted (``dispatch_counts()``), which is how tests and users confirm what ran.
"""

from __future__ import annotations

import collections
import importlib
import logging
import threading
from typing import Callable, Mapping

import torch

from . import envs
from .backend import Backend
from .calls import AttentionCall, PrecomputeCall
from .platform import platform_for

logger = logging.getLogger("dflash_rocm")

BACKEND_PATHS: dict[str, str] = {
    "reference": "dflash_rocm.reference:ReferenceBackend",
    "triton": "dflash_rocm.backends.triton:TritonBackend",
    "rocm": "dflash_rocm.backends.rocm:RocmBackend",
    "cuda": "dflash_rocm.backends.cuda:CudaBackend",
    "cpu": "dflash_rocm.backends.cpu:CpuBackend",
}
# rocm and cuda never serve CPU tensors under auto and cpu refuses every other device, so
# this one order puts cpu first for CPU tensors and never chooses it for GPU tensors.
AUTO_ORDER: tuple[str, ...] = ("rocm", "cuda", "cpu", "triton", "reference")
VALID_NAMES: tuple[str, ...] = ("auto", *BACKEND_PATHS)
VENDOR_BACKENDS = frozenset({"rocm", "cuda"})

ATTENTION = "draft_attention"
PRECOMPUTE = "precompute_and_store_context_kv"
OPS = (ATTENTION, PRECOMPUTE)


class BackendUnavailable(RuntimeError):
    """The requested backend (or every backend, for ``auto``) cannot serve this call."""

    def __init__(self, backend: str, op: str, reasons: Mapping[str, list[str]]):
        self.backend, self.op, self.reasons = backend, op, dict(reasons)
        lines = [f"{name}: {'; '.join(r)}" for name, r in self.reasons.items()]
        super().__init__(f"backend {backend!r} cannot serve {op}:\n  " + "\n  ".join(lines))


_lock = threading.Lock()
_classes: dict[str, type[Backend]] = {}
_import_errors: dict[str, str] = {}
_logged: set[tuple[str, str, str]] = set()
_counts: collections.Counter = collections.Counter()


def load_backend(name: str) -> type[Backend] | None:
    """The backend class, or None when its module cannot be imported (see ``import_error``)."""
    if name not in BACKEND_PATHS:
        raise ValueError(f"unknown backend {name!r}; valid names: {', '.join(VALID_NAMES)}")
    with _lock:
        if name in _classes:
            return _classes[name]
        if name in _import_errors:
            return None
    module_name, _, attr = BACKEND_PATHS[name].partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # a vendor stack can fail in many ways; it only costs this backend
        with _lock:
            _import_errors[name] = f"cannot import {module_name}: {type(exc).__name__}: {exc}"
        return None
    with _lock:
        _classes[name] = cls
    return cls


def import_error(name: str) -> str | None:
    return _import_errors.get(name)


def resolve_name(backend: str | None) -> str:
    """``backend=`` wins, else ``DFLASH_ROCM_BACKEND``, else ``auto``; unknown names are refused."""
    source = "backend="
    if backend is None:
        backend, source = envs.BACKEND.get(), envs.BACKEND.name
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name not in VALID_NAMES:
        raise ValueError(f"{source} {backend!r} is not a backend; valid names: {', '.join(VALID_NAMES)}")
    return name


def reasons_for(name: str, op: str, call: AttentionCall | PrecomputeCall, *, auto: bool = False) -> list[str]:
    """Why backend ``name`` cannot serve ``call`` (empty: it can)."""
    cls = load_backend(name)
    if cls is None:
        return [import_error(name) or "cannot import"]
    if op == ATTENTION:
        reasons = cls.attention_not_supported_reasons(call)
    else:
        reasons = cls.precompute_not_supported_reasons(call)
    if not reasons and auto and name in VENDOR_BACKENDS and call.device.type == "cpu":
        reasons = [f"auto never runs the {name} kernels on CPU tensors (name the backend to simulate a GPU)"]
    return reasons


_choices: dict[tuple, str] = {}


def choose(op: str, call: AttentionCall | PrecomputeCall, backend: str | None) -> type[Backend]:
    """The backend for ``call``. The choice is remembered per (op, requested name, the
    call's support key), so a hot loop of same-shaped calls (the vLLM plugin's, once per
    layer and step) walks the reasons once instead of every time."""
    name = resolve_name(backend)
    key = (op, name, call.support_key())
    chosen = _choices.get(key)
    if chosen is None:
        chosen = _choose(op, call, name).name
        with _lock:
            _choices[key] = chosen
    return load_backend(chosen)


def forget_choices() -> None:
    """Drop remembered choices (after changing what backends can see, e.g. in tests)."""
    with _lock:
        _choices.clear()


def _choose(op: str, call: AttentionCall | PrecomputeCall, name: str) -> type[Backend]:
    if name != "auto":
        reasons = reasons_for(name, op, call)
        if reasons:
            raise BackendUnavailable(name, op, {name: reasons})
        _log_choice(op, name, call, {}, explicit=True)
        return load_backend(name)
    passed_over: dict[str, list[str]] = {}
    for candidate in AUTO_ORDER:
        reasons = reasons_for(candidate, op, call, auto=True)
        if not reasons:
            _log_choice(op, candidate, call, passed_over, explicit=False)
            return load_backend(candidate)
        passed_over[candidate] = reasons
    raise BackendUnavailable("auto", op, passed_over)


def _log_choice(op: str, name: str, call, passed_over: dict[str, list[str]], explicit: bool) -> None:
    key = (op, name, call.signature())
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    why = "named explicitly" if explicit else "auto"
    skipped = "".join(f"; {n} passed over: {', '.join(r)}" for n, r in passed_over.items())
    logger.info("%s [%s] -> %s (%s)%s", op, key[2], name, why, skipped)


def run(op: str, call, backend: str | None, invoke: Callable[[type[Backend]], object]):
    """Choose a backend for ``call``, run ``invoke(cls)`` and count who served it."""
    cls = choose(op, call, backend)
    result = invoke(cls)
    with _lock:
        _counts[(op, cls.name)] += 1
    return result


def explain_call(op: str, call: AttentionCall | PrecomputeCall) -> dict[str, list[str]]:
    """Every backend's reasons for ``call`` in ``AUTO_ORDER`` (empty list: would serve)."""
    return {name: reasons_for(name, op, call, auto=True) for name in AUTO_ORDER}


def device_reasons(device: torch.device | str | None = None) -> dict[str, list[str]]:
    """Every backend's device-level reasons (no call needed): what ``info`` prints."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    platform = platform_for(device)
    result = {}
    for name in AUTO_ORDER:
        cls = load_backend(name)
        result[name] = [import_error(name)] if cls is None else cls.device_not_supported_reasons(device, platform)
    return result


def dispatch_counts() -> dict[tuple[str, str], int]:
    """How many calls each (op, backend) served since start or the last reset."""
    with _lock:
        return dict(_counts)


def reset_dispatch_counts() -> None:
    with _lock:
        _counts.clear()
