"""Every backend, found from its folder, and the order ``auto`` tries them per platform.

A backend is a folder under the top-level ``backends/`` (the package
``dflash_rocm.backends``) whose ``__init__.py`` defines its implementation classes (one per
op) and one :class:`~dflash_rocm.backend.Backend` subclass named as the folder. The
folders are listed without importing them (:func:`find_backends`), and a backend's module
is imported on its first use (as vLLM's attention registry does), so a broken or absent
vendor stack only costs that backend: its import error becomes its reason. Adding a
backend is a folder (and its place in the priority lists where ``auto`` should consider
it); the package list in ``pyproject.toml`` names it for the wheel (``tests/test_layout.py``
checks that list against the folders).
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Iterable

from . import backend_names
from .backend import Backend
from .platform import Platform


def find_backends(folders: Iterable[str] = (backend_names.FOLDER,)) -> dict[str, str]:
    """Backend name -> module name: every package in ``folders`` (by default the backends'
    folder; the package ``dflash_rocm.backends`` is not imported)."""
    return {name: f"dflash_rocm.backends.{name}" for name in backend_names.names_in(folders)}


MODULES: dict[str, str] = find_backends()
NAMES: tuple[str, ...] = tuple(MODULES)

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
    module_name = MODULES.get(name)
    if module_name is None:
        raise ValueError(f"unknown backend {name!r}; valid names: auto, {', '.join(NAMES)}")
    with _lock:
        if name in _classes:
            return _classes[name]
        if name in _import_errors:
            return None
    try:
        cls = backend_class(importlib.import_module(module_name), name)
    except Exception as exc:  # a vendor stack can fail in many ways; it only costs this backend
        with _lock:
            _import_errors[name] = f"cannot import {module_name}: {type(exc).__name__}: {exc}"
        return None
    with _lock:
        _classes[name] = cls
    return cls


def backend_class(module: ModuleType, name: str) -> type[Backend]:
    """The one :class:`Backend` subclass ``module`` defines, which must be named ``name``."""
    defined = [value for value in vars(module).values() if isinstance(value, type) and issubclass(value, Backend)
               and value.__module__ == module.__name__]
    if len(defined) != 1 or defined[0].name != name:
        raise TypeError(f"{module.__name__} must define one Backend subclass named {name!r} (found "
                        f"{', '.join(f'{c.__name__} ({c.name!r})' for c in defined) or 'none'})")
    return defined[0]


def import_error(name: str) -> str | None:
    with _lock:
        return _import_errors.get(name)


def loaded() -> list[type[Backend]]:
    """The backends imported so far (hooks go to these; importing others is not free)."""
    with _lock:
        return list(_classes.values())
