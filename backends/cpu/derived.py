"""Derived copies of a caller's tensors (a folded GEMM weight, float32 tables), rebuilt
when a source changes.

A derived copy is keyed by its sources' identity and state (``data_ptr``, ``_version``,
shape, strides, dtype): an in-place update through the source tensor (or a view of it,
which shares its version counter) bumps ``_version`` and the next call rebuilds. Nothing
is stored in the caller's objects, and an entry dies with its sources (weak references).
An update made through a separate ``.data`` alias keeps the version counter of the
tensor seen here unchanged and is not noticed: rebuild the weights object after one.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch

# Single dict operations, atomic under the GIL; no lock: a weak reference's callback runs
# whenever the garbage collector frees a source, possibly inside this module's own code.
_entries: dict[tuple, tuple[tuple, tuple, Any]] = {}


def _stamp(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.dtype, t.device)


def derived(name: str, sources: Sequence[torch.Tensor | None], build: Callable[[], Any]) -> Any:
    """``build()``'s result for these ``sources`` (``None`` entries allowed), kept while
    every source lives and is unchanged."""
    present = [t for t in sources if t is not None]
    key = (name, tuple(id(t) if t is not None else None for t in sources))
    stamp = tuple(_stamp(t) for t in present)
    entry = _entries.get(key)
    if entry is not None and entry[1] == stamp and all(ref() is t for ref, t in zip(entry[0], present)):
        return entry[2]
    value = build()

    def forget(_ref, key=key):
        _entries.pop(key, None)

    _entries[key] = (tuple(weakref.ref(t, forget) for t in present), stamp, value)
    return value
