"""Every backend, one record each, and the order ``auto`` tries them per platform.

Backend classes are imported on first use by dotted path (as vLLM's attention registry
does), so a broken or absent vendor stack only costs that backend: its import error
becomes its reason. Adding a backend is a folder under the top-level ``backends/``
(installed as ``dflash_rocm.backends``) plus a record here (and its place in the priority
lists where ``auto`` should consider it).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

from . import backend_names
from .backend import Backend
from .platform import Platform


@dataclass(frozen=True)
class BackendRecord:
    name: str
    class_path: str  # "module:Class"


# Each backend's folder holds its Backend class, named after it: backends/rocm -> RocmBackend.
RECORDS: tuple[BackendRecord, ...] = tuple(
    BackendRecord(name, f"dflash_rocm.backends.{name}:{name.capitalize()}Backend") for name in backend_names.NAMES)
BY_NAME: dict[str, BackendRecord] = {r.name: r for r in RECORDS}
NAMES: tuple[str, ...] = tuple(BY_NAME)

# auto's order per platform vendor. Vendor kernels never appear for CPU tensors: on a
# CPU (simulated architectures included) only a backend named explicitly runs them.
PRIORITIES: dict[str, tuple[str, ...]] = {
    "rocm": ("aiter", "rocm", "triton", "reference"),
    "cuda": ("cuda", "triton", "reference"),
    "cpu": ("cpu", "triton", "reference"),
}
DEFAULT_PRIORITY: tuple[str, ...] = ("triton", "reference")


def priority_for(platform: Platform, device_type: str) -> tuple[str, ...]:
    """The names ``auto`` tries, in order, for tensors of ``device_type`` on ``platform``."""
    if device_type == "cpu":
        return PRIORITIES["cpu"]
    return PRIORITIES.get(platform.vendor, DEFAULT_PRIORITY)


_lock = threading.Lock()
_classes: dict[str, type[Backend]] = {}
_import_errors: dict[str, str] = {}


def load(name: str) -> type[Backend] | None:
    """The backend class, or None when its module cannot be imported (see :func:`import_error`)."""
    record = BY_NAME.get(name)
    if record is None:
        raise ValueError(f"unknown backend {name!r}; valid names: auto, {', '.join(NAMES)}")
    with _lock:
        if name in _classes:
            return _classes[name]
        if name in _import_errors:
            return None
    module_name, _, attr = record.class_path.partition(":")
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
    with _lock:
        return _import_errors.get(name)


def loaded() -> list[type[Backend]]:
    """The backends imported so far (hooks go to these; importing others is not free)."""
    with _lock:
        return list(_classes.values())
