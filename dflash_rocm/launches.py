"""Kernel launches as the tools above the backends see them, without importing any
backend's internals.

A backend calls :func:`launching` around each launch it issues itself (``bench`` reads
launches per call from :func:`counts`; while one is in flight, tools that count torch
ops know those ops belong to the launch: the Triton interpreter issues torch ops of its
own). Inside :func:`capture` a backend records each launch as a :class:`Launch` instead
of running it: the host code runs unchanged (tensors may be on the ``meta`` device), so
``dflash-rocm inspect`` sees exactly what a GPU run would launch, and ``bench --host``
times the host work of a call without a GPU. (Whether a CUDA graph is being captured is
:mod:`dflash_rocm.capture`'s.)
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Iterator


_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_local = threading.local()
_capture: contextvars.ContextVar[list | None] = contextvars.ContextVar("dflash_rocm_capture", default=None)


@dataclass(slots=True)
class Launch:
    """One launch as the host code made it: the kernel, its grid, the positional
    arguments (tensors as given), the constexpr keywords and every compiler option the
    configuration asks for. Read-only by convention, not frozen: ``bench --host`` times
    the host path with launches recorded, and a frozen dataclass's ``__init__`` (each
    field through ``object.__setattr__``) would cost it more than the launch it stands for."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict
    options: dict
    per_call: int | None = None  # how many leading arguments change from call to call (None: all)
    kept: tuple[str, ...] = ()  # the per-call parameters whose tensors the plan keeps (see LaunchPlan)

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def arg(self, name: str):
        """A positional argument by its parameter name."""
        return self.args[list(inspect.signature(self.kernel.fn).parameters).index(name)]


@contextlib.contextmanager
def capture() -> Iterator[list[Launch]]:
    """Record every launch made inside the block instead of running it (not counted)."""
    captured: list[Launch] = []
    token = _capture.set(captured)
    try:
        yield captured
    finally:
        _capture.reset(token)


def capturing() -> list[Launch] | None:
    """Where a backend records its launches instead of running them (None: run them)."""
    return _capture.get()


class launching:
    """Wrap one kernel launch: counted once it returns. A plain class, not a generator
    context manager: it sits on the hot path of every launch (a backend may keep one per
    kernel and reuse it)."""

    __slots__ = ("kernel_name",)

    def __init__(self, kernel_name: str):
        self.kernel_name = kernel_name

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.depth -= 1
        if exc_type is None:
            with _lock:
                _counts[self.kernel_name] += 1


def in_flight() -> bool:
    """True while this thread is inside :func:`launching`."""
    return getattr(_local, "depth", 0) > 0


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def total() -> int:
    with _lock:
        return sum(_counts.values())
