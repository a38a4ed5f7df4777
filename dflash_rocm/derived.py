"""Derived copies of user tensors (fused weights, float32 tables), rebuilt when a source changes.

Backends keep their own layouts of ``ContextKVWeights`` (a fused, permuted K/V weight;
float32 norms and cos/sin). Users may update weights in place between calls (RL
frameworks sync weights into a running server), so a derived copy is keyed by each
source tensor's identity, storage address and version counter: an in-place write bumps
the version, a rebinding changes the address, and a weak reference to every source
makes sure a dead tensor's address reused by a new one is never mistaken for it.

What cannot be seen: a write through ``tensor.data`` (a detached alias with its own
version counter) leaves the version unchanged. Callers that update weights that way
(vLLM's weight loaders do) must write the new values into the tensors a
``ContextKVWeights`` holds with an ordinary in-place op; the vLLM plugin does after every
``load_weights``.

An in-place update of the same source tensors refills the derived value in place: its
tensors keep their addresses, so a CUDA graph captured with them (vLLM captures the
draft's precompute) reads the new weights when replayed, as vLLM's ``refill_derived``
keeps its own buffers. Only a value whose structure changed (shapes, dtypes) is replaced.

While a CUDA graph is captured on the sources' device, a value that must be built (none
kept, or its sources changed) is built into the graph, which derives it again at every
replay, and is neither kept nor written into the kept value: what a capture records has
not run when the capture ends. (vLLM runs each size eagerly right before capturing it,
so there the kept value is found.)
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from . import launches


def _fingerprint(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    return id(t), t.data_ptr(), t._version


def _parts(value: Any) -> list | None:
    """The leaves of a derived value (tensors and plain values) in a fixed order, or None
    for a kind of value this module does not look into."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return [value]
    if is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in fields(value)]
    elif isinstance(value, (tuple, list)):
        items = list(value)
    else:
        return None
    leaves = []
    for item in items:
        sub = _parts(item)
        if sub is None:
            return None
        leaves += sub
    return leaves


def refill_in_place(old: Any, new: Any) -> bool:
    """Copy ``new``'s tensors into ``old``'s when both have the same structure (tensors of
    the same shape, dtype and device where ``old`` has tensors, equal plain values
    elsewhere); returns whether it did. Nothing is written unless everything matches."""
    if type(old) is not type(new):
        return False
    before, after = _parts(old), _parts(new)
    if before is None or after is None or len(before) != len(after):
        return False
    for a, b in zip(before, after):
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                    and a.device == b.device):
                return False
        elif isinstance(b, torch.Tensor) or a != b:
            return False
    targets = [(a, b) for a, b in zip(before, after) if isinstance(a, torch.Tensor) and a is not b]
    # A value built inside a serving engine's inference mode holds inference tensors,
    # which only accept in-place writes there.
    with torch.no_grad(), torch.inference_mode(any(a.is_inference() for a, _ in targets)):
        for a, b in targets:
            a.copy_(b)
    return True


class DerivedCache:
    """A small LRU of values derived from source tensors (one per backend)."""

    def __init__(self, capacity: int = 8):
        self._capacity = capacity
        self._entries: OrderedDict[Hashable, tuple[tuple, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, sources: Sequence[torch.Tensor | None], tag: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``'s value for these sources, reused while none of them changed; after
        an in-place update of the same sources, the previous value refilled in place."""
        fingerprints = tuple(_fingerprint(t) for t in sources)
        key = (tag, fingerprints)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and _alive(entry[0], sources):
                self._entries.move_to_end(key)
                return entry[1]
            capturing = any(t is not None and launches.graph_capturing(t.device) for t in sources)
            previous = None if capturing else self._updated_in_place(tag, fingerprints, sources)
        with torch.no_grad():  # derived layouts feed inference-only kernels: no autograd graph kept
            value = build()
        if capturing:  # recorded into the graph being captured (see the module)
            return value
        if previous is not None and refill_in_place(previous, value):
            value = previous
        refs = tuple(None if t is None else weakref.ref(t) for t in sources)
        with self._lock:
            self._entries[key] = (refs, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return value

    def _updated_in_place(self, tag: Hashable, fingerprints: tuple, sources) -> Any:
        """The value derived from these very tensors (same objects, same addresses) before
        their versions moved, dropped from the cache; None if there is none."""
        identity = tuple(f[:2] for f in fingerprints)
        for key, (refs, value) in self._entries.items():
            if key[0] == tag and tuple(f[:2] for f in key[1]) == identity and _alive(refs, sources):
                del self._entries[key]
                return value
        return None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _alive(refs: tuple, sources: Sequence[torch.Tensor | None]) -> bool:
    """Whether every source an entry was built from is the very tensor given now."""
    return all(ref is None or ref() is t for ref, t in zip(refs, sources))
