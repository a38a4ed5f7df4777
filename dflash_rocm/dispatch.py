"""Choosing a backend per call: a priority walk over the registry, reasons for every no.

``auto`` takes the first backend of the platform's priority list (``registry.PRIORITIES``)
that supports the call; a named backend that cannot serve raises
:class:`BackendUnavailable` with its reasons. The choice is remembered per (op, requested
name, the call's support key), so a hot loop of same-shaped calls walks the reasons
once; the memo is bounded, as the precompute's support keys hold cache addresses. Each
new (op, backend, call signature) is logged once with the reasons of the backends passed
over, and every served call is counted (``dispatch_counts()``), which is how tests and
users confirm what ran. All shared state is guarded by one lock.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Mapping

import torch

from . import envs, registry
from .backend import SETTINGS, Backend
from .ops import Op
from .ops.attention import AttentionSpec
from .platform import platform_for
from .validation import LayoutMemo

logger = logging.getLogger("dflash_rocm")


class BackendUnavailable(RuntimeError):
    """The requested backend (or every backend, for ``auto``) cannot serve this call."""

    def __init__(self, backend: str, op: str, reasons: Mapping[str, list[str]]):
        self.backend, self.op, self.reasons = backend, op, dict(reasons)
        lines = [f"{name}: {'; '.join(r)}" for name, r in self.reasons.items()]
        super().__init__(f"backend {backend!r} cannot serve {op}:\n  " + "\n  ".join(lines))


_lock = threading.Lock()
_logged: set[tuple[str, str, str]] = set()
_counts: collections.Counter = collections.Counter()
_CHOICES_KEPT = 1024
_choices = LayoutMemo(_CHOICES_KEPT)  # (op, requested name, support key) -> backend class


def resolve_name(backend: str | None) -> str:
    """``backend=`` wins, else ``DFLASH_ROCM_BACKEND``, else ``auto``; unknown names are refused."""
    source = "backend="
    if backend is None:
        backend, source = envs.BACKEND.get(), envs.BACKEND.name
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name != "auto" and name not in registry.BY_NAME:
        raise ValueError(f"{source} {backend!r} is not a backend; valid names: auto, {', '.join(registry.NAMES)}")
    return name


def reasons_for(name: str, op: Op, call) -> list[str]:
    """Why backend ``name`` cannot serve ``call`` of ``op`` (empty: it can)."""
    cls = registry.load(name)
    if cls is None:
        return [registry.import_error(name) or "cannot import"]
    return cls.not_supported_reasons(op, call)


def priority(call) -> tuple[str, ...]:
    return registry.priority_for(platform_for(call.device), call.device.type)


def choose(op: Op, call, backend: str | None) -> type[Backend]:
    """The backend class for ``call`` (remembered per support key)."""
    name = resolve_name(backend)
    key = (op.name, name, call.support_key())
    known = _choices.get(key)
    if known is not None:
        return known[1]
    chosen = _choose(op, call, name)
    with _lock:
        _choices.remember(key, chosen)
    return chosen


def forget_choices() -> None:
    """Drop remembered choices (after changing what backends can see, e.g. in tests)."""
    with _lock:
        _choices.forget()


def _choose(op: Op, call, name: str) -> type[Backend]:
    if name != "auto":
        reasons = reasons_for(name, op, call)
        if reasons:
            raise BackendUnavailable(name, op.name, {name: reasons})
        _log_choice(op, name, call, {}, explicit=True)
        return registry.load(name)
    passed_over: dict[str, list[str]] = {}
    for candidate in priority(call):
        reasons = reasons_for(candidate, op, call)
        if not reasons:
            _log_choice(op, candidate, call, passed_over, explicit=False)
            return registry.load(candidate)
        passed_over[candidate] = reasons
    raise BackendUnavailable("auto", op.name, passed_over)


def _log_choice(op: Op, name: str, call, passed_over: dict[str, list[str]], explicit: bool) -> None:
    key = (op.name, name, call.signature())
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    why = "named explicitly" if explicit else "auto"
    skipped = "".join(f"; {n} passed over: {', '.join(r)}" for n, r in passed_over.items())
    logger.info("%s [%s] -> %s (%s)%s", op.name, key[2], name, why, skipped)


def run(op: Op, call, backend: str | None):
    """Choose a backend for ``call``, run it and count who served it."""
    cls = choose(op, call, backend)
    result = cls.run(op, call)
    counted(op, cls.name)
    return result


def counted(op: Op, name: str) -> None:
    """Count one call of ``op`` served by backend ``name`` (``dispatch_counts()``)."""
    with _lock:
        _counts[(op.name, name)] += 1


def explain_call(op: Op, call) -> dict[str, list[str]]:
    """Every backend's reasons for ``call``: auto's candidates first, in its order, then
    the backends only a caller can name (empty list: would serve)."""
    order = priority(call)
    result = {name: reasons_for(name, op, call) for name in order}
    for name in registry.NAMES:
        if name not in result:
            reasons = reasons_for(name, op, call)
            result[name] = reasons + ([] if reasons else ["not in auto's order for these tensors; "
                                                         "serves when named"])
    return result


def device_reasons(device: torch.device | str | None = None) -> dict[str, list[str]]:
    """Every backend's device-level reasons (no call needed): what ``info`` prints."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    platform = platform_for(device)
    result = {}
    for name in registry.NAMES:
        cls = registry.load(name)
        result[name] = ([registry.import_error(name) or "cannot import"] if cls is None
                        else cls.device_not_supported_reasons(device, platform))
    return result


def backend(name: str) -> type[Backend] | None:
    """A backend class by name, for its hooks (None when it cannot be imported here)."""
    return registry.load(name)


def configure(device: torch.device | None = None, **settings: Any) -> None:
    """Pass what a serving engine knows to every backend ``auto`` may pick on ``device``."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(SETTINGS)}")
    for cls in _candidates(device):
        cls.configure(**settings)


def warm_up(op: Op, spec: AttentionSpec, device: torch.device) -> None:
    """Startup work (ROCm: tuning) by every backend ``auto`` may pick on ``device``. An
    optimisation that fails costs itself, never the caller."""
    for cls in _candidates(device):
        try:
            cls.warm_up(op, spec, device)
        except Exception as exc:  # warm-up is an optimisation
            logger.warning("%s warm-up failed for %s: %s", cls.name, spec, exc)


def _candidates(device: torch.device | None) -> list[type[Backend]]:
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    names = registry.priority_for(platform_for(device), device.type)
    return [cls for cls in (registry.load(n) for n in names) if cls is not None]


def dispatch_counts() -> dict[tuple[str, str], int]:
    """How many calls each (op name, backend) served since start or the last reset."""
    with _lock:
        return dict(_counts)


def reset_dispatch_counts() -> None:
    with _lock:
        _counts.clear()
