"""Timing a call the way GPU kernel libraries do: warm-up, device events, median."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[int], object], device: torch.device, *, warmup: int = 2,
                   repeats: int = 10, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn(i)`` over ``repeats`` calls (``i`` lets callers rotate
    input buffers so caches do not flatter small shapes); CUDA/HIP events on a GPU.
    ``setup`` runs before each timed call, outside the timed span (e.g. an L2 flush)."""
    for i in range(warmup):
        fn(i)
    synchronize(device)
    samples = []
    for i in range(repeats):
        if setup is not None:
            setup()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn(i)
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)
