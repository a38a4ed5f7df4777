"""CUDA (HIP) graph capture: the one predicate every backend asks, what each runner
declares about being captured, and the one rule for state a call keeps.

vLLM's FULL CUDA graphs record a call's launches once and replay them over new values
written in place. Work issued while a graph is captured is recorded, not run: it holds no
data before the first replay, and what it allocates is the graph's. So:

- :func:`graph_capturing` says whether a graph is being captured on a device's stream.
- :class:`CaptureSupport`: what a runner (:class:`dflash_rocm.backend.Runner`) declares it
  may be captured under, as vLLM's attention backends declare ``_cudagraph_support``.
  Dispatch applies the declaration when a capture asks for a call structure it holds no
  plan for (:func:`dflash_rocm.dispatch.planned`).
- :func:`keep_unless_captured`: the rule for everything a call makes for later calls (a
  plan, a structure's checked form, scratch per stream), written once.
- :func:`refuse_in_capture`: the rule for work that must never be recorded (deriving
  weight layouts).
"""

from __future__ import annotations

import enum
from typing import Any, Hashable, Iterable, MutableMapping

import torch


def graph_capturing(device: torch.device) -> bool:
    """Whether a CUDA (HIP) graph is being captured on ``device``'s current stream. While
    it holds, no backend reads the device on the host, runs a first-call check, or keeps
    for later calls anything the capture allocated or filled. Ask it through
    :func:`keep_unless_captured` or :func:`refuse_in_capture`; the few callers that decide
    something else say why beside the call (``tests/test_capture.py`` lists them)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CaptureSupport(enum.Enum):
    """What a runner declares about being recorded into a CUDA graph."""

    ALWAYS = "always"
    """A run launches only over memory the plan and the call hold (derived weight layouts
    aside: every backend derives them eagerly, :mod:`dflash_rocm.derived`), and the plan
    holds no device memory of its own: capturable any time, and a plan made inside a
    capture is kept like any other."""

    AFTER_EAGER_CALL = "after an eager call"
    """The first call of a structure or stream makes state later calls share (scratch, a
    device table, a first-use check). Made eagerly, it is kept; made inside a capture, it
    serves that graph alone (:func:`keep_unless_captured`) and is made again by the next
    call, and dispatch says so once: make one eager call of each structure before
    capturing (vLLM runs every captured size eagerly first)."""

    NEVER = "never"
    """A run reads the call's tensors on the host or synchronises with the device: it
    cannot be recorded. Dispatch refuses it inside a capture (``BackendUnavailable``,
    before anything is written), so a serving engine steps aside instead of recording a
    broken graph."""


def keep_unless_captured(store: MutableMapping, key: Hashable, value: Any, device: torch.device) -> bool:
    """Keep ``value`` in ``store`` under ``key`` for later calls, unless a graph is being
    captured on ``device``; returns whether it was kept.

    The rule, for every plan, checked structure and scratch a call makes for the calls
    after it: made inside a capture, it may hold memory the graph allocated and values
    that exist only once the graph replays, so it serves that graph alone and the next
    call makes its own."""
    if graph_capturing(device):
        return False
    store[key] = value
    return True


def refuse_in_capture(tensors: Iterable[torch.Tensor | None], refusal: Exception) -> None:
    """Raise ``refusal`` if a graph is being captured on the device of any of ``tensors``
    (None entries are skipped): for work that must never be recorded into a graph, refused
    before anything is written."""
    if any(t is not None and graph_capturing(t.device) for t in tensors):
        raise refusal
