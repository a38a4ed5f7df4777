"""A count of the kernel launches backends make, so tools above them can report
launches per call (``bench``) without importing any backend's internals.

A backend calls :func:`launching` around each launch it issues itself; while one is in
flight, tools that count torch ops know those ops belong to the launch (the Triton
interpreter issues torch ops of its own).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator

_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_local = threading.local()


@contextlib.contextmanager
def launching(kernel_name: str) -> Iterator[None]:
    """Wrap one kernel launch: counted once it returns."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
    with _lock:
        _counts[kernel_name] += 1


def in_flight() -> bool:
    """True while this thread is inside :func:`launching`."""
    return getattr(_local, "depth", 0) > 0


def counts() -> dict[str, int]:
    with _lock:
        return dict(_counts)


def total() -> int:
    with _lock:
        return sum(_counts.values())
