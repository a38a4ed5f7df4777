"""Derived copies of user tensors (fused weights, float32 tables), refilled when a source changes.

Backends keep their own layouts of ``ContextKVWeights`` (a fused, permuted K/V weight;
float32 norms, row scales and cos/sin). Users may update weights in place between calls
(RL frameworks sync weights into a running server), so a derived copy is keyed by each
source tensor's identity, storage address and version counter: an in-place write bumps
the version, a rebinding changes the address, and a weak reference to every source
makes sure a dead tensor's address reused by a new one is never mistaken for it.

The rule every backend's derived state follows: it lives in a :class:`DerivedCache`
(each one registers itself), so :func:`refill_derived` reaches all of it. After an
in-place update of the sources, a value is recomputed *into its own tensors* (same
addresses), so launches recorded before the update (a CUDA graph captured with them:
vLLM captures the draft's precompute) write the new weights' K/V when replayed, as
vLLM's ``refill_derived`` keeps its own buffers. That happens at the latest at the next
eager call; a serving engine whose graphs replay without one calls
:func:`refill_derived` where it finishes a weight update (the vLLM plugin: in the draft's
post-load hook, outside any capture). Only a value whose structure changed (shapes,
dtypes) is replaced, and then said in one log line: graphs recorded with the old one
read stale values until captured again.

Nothing derives weights while a CUDA graph is captured: a capture that finds no current
value for its sources is refused (:class:`DerivedNotReady`, a ``ValueError``: callers
step aside before anything is written) rather than recording the derivation into the
graph, where it would run again at every replay. (vLLM runs each size eagerly right
before capturing it, so there the kept value is found.)

What cannot be seen: a write through ``tensor.data`` (a detached alias with its own
version counter) leaves the version unchanged. Callers that update weights that way
(vLLM's weight loaders do) must write the new values into the tensors a
``ContextKVWeights`` holds with an ordinary in-place op; the vLLM plugin does after every
``load_weights``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable, Hashable, Sequence

import torch

from .capture import refuse_in_capture
from .weights import ContextKVWeights

logger = logging.getLogger("dflash_rocm")


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
    # A leaf that is its source (or a view of it: a float32 table from float32 weights)
    # already holds the new values; copying it onto itself would only move its version.
    targets = [(a, b) for a, b in zip(before, after) if isinstance(a, torch.Tensor) and not _same_view(a, b)]
    # A value built inside a serving engine's inference mode holds inference tensors,
    # which only accept in-place writes there.
    with torch.no_grad(), torch.inference_mode(any(a.is_inference() for a, _ in targets)):
        for a, b in targets:
            a.copy_(b)
    return True


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape)


class DerivedNotReady(ValueError):
    """A derived value was needed while a CUDA graph is captured and none is current."""


_CACHES: "weakref.WeakSet[DerivedCache]" = weakref.WeakSet()


class DerivedCache:
    """A small LRU of values derived from source tensors (one per backend's layout);
    every instance is reached by :func:`refill_derived`."""

    def __init__(self, capacity: int = 8):
        self._capacity = capacity
        # key (tag, fingerprints) -> (weak refs to the sources, value, how to build it again)
        self._entries: OrderedDict[Hashable, tuple[tuple, Any, Callable[[], Any]]] = OrderedDict()
        self._lock = threading.Lock()
        _CACHES.add(self)

    def get(self, sources: Sequence[torch.Tensor | None], tag: Hashable, build: Callable[..., Any],
            owner: Any = None) -> Any:
        """``build()``'s value for these sources (``build(owner)`` when an owner is given),
        reused while none of them changed; after an in-place update of the same sources,
        the previous value refilled in place. The entry keeps ``build`` to refill the value
        later (:meth:`refill`): a backend passes the object the value is derived from as
        ``owner``, held by weak reference, and a ``build`` that holds no tensor, so a kept
        entry never keeps its sources alive."""
        rebuild = build if owner is None else _Rebuild(build, weakref.ref(owner))
        fingerprints = tuple(_fingerprint(t) for t in sources)
        key = (tag, fingerprints)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and _alive(entry[0], sources):
                self._entries.move_to_end(key)
                return entry[1]
            refuse_in_capture(sources, DerivedNotReady(
                "a derived weight layout is needed while a CUDA graph is captured and none is current for "
                "these weights: make one eager call before capturing, and call dflash_rocm.refill_derived() "
                "after updating the weights"))
            previous = self._updated_in_place(tag, fingerprints, sources)
        with torch.no_grad():  # derived layouts feed inference-only kernels: no autograd graph kept
            value = rebuild()
        if previous is not None and refill_in_place(previous, value):
            value = previous
        self._keep(tag, sources, value, rebuild)
        return value

    def refill(self) -> int:
        """Recompute, in place, every kept value whose sources were written in place since
        it was built; returns how many. A value whose structure changed is replaced (one
        warning: launches recorded with the old one read stale values); one whose sources
        or owner died is dropped. Refuses (:class:`DerivedNotReady`) while a CUDA graph is
        captured on a source's device, before anything is written. A value whose owner
        refuses to be derived again (weights resized in place: a ``ValueError`` naming them)
        is dropped with a warning, and the others are refilled: one model's weights never
        stop another's refill."""
        with self._lock:
            entries = list(self._entries.items())
        stale = []
        for key, (refs, value, rebuild) in entries:
            sources = tuple(None if ref is None else ref() for ref in refs)
            dead = any(ref is not None and t is None for ref, t in zip(refs, sources))
            if dead or (isinstance(rebuild, _Rebuild) and rebuild.owner() is None):
                with self._lock:
                    self._entries.pop(key, None)
                continue
            if tuple(_fingerprint(t) for t in sources) != key[1]:
                stale.append((key, sources, value, rebuild))
        refuse_in_capture((t for _, sources, *_ in stale for t in sources),
                          DerivedNotReady("refill_derived() was called while a CUDA graph is captured"))
        for key, sources, value, rebuild in stale:
            try:
                with torch.no_grad():
                    new = rebuild()
            except ValueError as refusal:  # this owner's sources cannot be derived again: the others still are
                with self._lock:
                    self._entries.pop(key, None)
                logger.warning("refill_derived: dropped a derived weight layout: %s", refusal)
                continue
            if refill_in_place(value, new):
                new = value
            else:
                logger.warning("a derived weight layout changed its structure (shapes or dtypes) with a weight "
                               "update: launches recorded before it read the old one until captured again")
            with self._lock:
                self._entries.pop(key, None)
            self._keep(key[0], sources, new, rebuild)
        return len(stale)

    def _keep(self, tag: Hashable, sources, value: Any, rebuild: Callable[[], Any]) -> None:
        """Keep ``value`` under the sources' fingerprints as they are now, after any refill."""
        key = (tag, tuple(_fingerprint(t) for t in sources))
        refs = tuple(None if t is None else weakref.ref(t) for t in sources)
        with self._lock:
            self._entries[key] = (refs, value, rebuild)
            self._entries.move_to_end(key)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def _updated_in_place(self, tag: Hashable, fingerprints: tuple, sources) -> Any:
        """The value derived from these very tensors (same objects, same addresses) before
        their versions moved, dropped from the cache; None if there is none."""
        identity = tuple(f[:2] for f in fingerprints)
        for key, (refs, value, _) in self._entries.items():
            if key[0] == tag and tuple(f[:2] for f in key[1]) == identity and _alive(refs, sources):
                del self._entries[key]
                return value
        return None

    def values(self) -> list[Any]:
        """The values kept now (for tests and tools that check every backend's derived state)."""
        with self._lock:
            return [entry[1] for entry in self._entries.values()]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


@dataclass(frozen=True)
class _Rebuild:
    """``build(owner)`` with the owner held weakly."""

    build: Callable[[Any], Any]
    owner: weakref.ref

    def __call__(self) -> Any:
        owner = self.owner()
        if owner is None:
            raise RuntimeError("the object a derived value was built from is gone")
        if isinstance(owner, ContextKVWeights):
            owner.check_shapes()  # resized in place since built: refused by name, not by torch mid-build
        return self.build(owner)


def caches() -> list[DerivedCache]:
    """Every live :class:`DerivedCache` (every backend's derived state)."""
    return list(_CACHES)


def refill_derived() -> int:
    """Recompute in place every derived value whose sources were updated in place, in
    every backend (:meth:`DerivedCache.refill`); returns how many. Call it where a weight
    update ends and outside any graph capture: launches recorded before the update then
    read the new weights when replayed."""
    return sum(cache.refill() for cache in caches())


def _alive(refs: tuple, sources: Sequence[torch.Tensor | None]) -> bool:
    """Whether every source an entry was built from is the very tensor given now."""
    return all(ref is None or ref() is t for ref, t in zip(refs, sources))
