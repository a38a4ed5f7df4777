"""Facts of the process: fixed from import to exit, so a plan may read them beside its
planning record (:mod:`dflash_rocm.planning`) though the record does not hold them.

- :data:`INTERPRETING`: Triton runs kernels through its interpreter (``TRITON_INTERPRET``,
  which Triton reads when a kernel is decorated: at import).
- :data:`HIP`: this torch is a ROCm (HIP) build (AMD-only compiler options, buffer loads).
- Every function declared with :func:`process_constant`: a library probed once (aiter,
  vLLM's FlashAttention and custom ops), its answer kept for the process.

One more read is allowed beside the record, though it is not constant: whether a CUDA
(HIP) graph is being captured (:func:`dflash_rocm.capture.graph_capturing`): what a plan
reads of it serves that capture alone (dispatch keeps a plan made while capturing only
where its runner declares that safe, :class:`dflash_rocm.capture.CaptureSupport`).
``tests/test_planning.py`` lets plans, backends' reasons and dispatch's choice read exactly
these (:func:`read_beside_the_record`) and refuses every other read of the
environment, the settings, the platform or torch's global flags.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

import torch

from . import capture, envs

INTERPRETING: bool = envs.TRITON_INTERPRET.value()
HIP: bool = bool(getattr(torch.version, "hip", None))

T = TypeVar("T")
_constants: list[Callable[[], Any]] = []


def process_constant(probe: Callable[[], T]) -> Callable[[], T]:
    """Declare ``probe`` (no arguments) a fact of the process: run once, its answer kept
    (``functools.cache``: tests may ``cache_clear()`` it), and readable by plans."""
    cached = functools.cache(probe)
    _constants.append(cached)
    return cached


def read_beside_the_record(obj: object) -> bool:
    """Whether a plan may call ``obj`` though its record does not hold the answer: a
    :func:`process_constant`, or :func:`~dflash_rocm.capture.graph_capturing`."""
    return obj is capture.graph_capturing or any(obj is c for c in _constants)
