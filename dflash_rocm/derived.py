"""Derived copies of user tensors (fused weights, float32 tables), rebuilt when a source changes.

Backends keep their own layouts of ``ContextKVWeights`` (a fused, permuted K/V weight;
float32 norms and cos/sin). Users may update weights in place between calls (RL
frameworks sync weights into a running server), so a derived copy is keyed by each
source tensor's identity, storage address and version counter: an in-place write bumps
the version, a rebinding changes the address, and a weak reference to every source
makes sure a dead tensor's address reused by a new one is never mistaken for it.

What cannot be seen: a write through ``tensor.data`` (a detached alias with its own
version counter) leaves the version unchanged. Callers that update weights that way
(vLLM's weight loaders do) must build a new ``ContextKVWeights``; the vLLM plugin does
after every ``load_weights``.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import torch


def _fingerprint(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    return id(t), t.data_ptr(), t._version


class DerivedCache:
    """A small LRU of values derived from source tensors (one per backend)."""

    def __init__(self, capacity: int = 8):
        self._capacity = capacity
        self._entries: OrderedDict[Hashable, tuple[tuple, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sources: Sequence[torch.Tensor | None], tag: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``'s value for these sources, reused while none of them changed."""
        key = (tag, tuple(_fingerprint(t) for t in sources))
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and all(ref is None or ref() is t for ref, t in zip(entry[0], sources)):
                self._entries.move_to_end(key)
                return entry[1]
        value = build()
        refs = tuple(None if t is None else weakref.ref(t) for t in sources)
        with self._lock:
            self._entries[key] = (refs, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
