"""Timing a call the way GPU kernel libraries do: warm-up, device events, median."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Hashable, Mapping

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[int], object], device: torch.device, *, warmup: int = 2,
                   repeats: int = 10, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``fn(i)`` over ``repeats`` calls (``i`` lets callers rotate
    input buffers so caches do not flatter small shapes); CUDA/HIP events on a GPU.
    ``setup`` runs before each timed call, outside the timed span (e.g. an L2 flush)."""
    return interleaved_median_seconds({None: fn}, device, warmup=warmup, repeats=repeats, setup=setup)[None]


def interleaved_median_seconds(fns: Mapping[Hashable, Callable[[int], object]], device: torch.device, *,
                               warmup: int = 2, repeats: int = 10,
                               setup: Callable[[], object] | None = None) -> dict[Hashable, float]:
    """:func:`median_seconds` of several contenders, timed in turns (one call of each per
    round): load that comes and goes on a shared machine then hits every contender alike
    instead of whichever was being timed."""
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    synchronize(device)
    samples: dict[Hashable, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in fns.items():
            if setup is not None:
                setup()
            samples[name].append(_time_one(fn, i, device))
    return {name: statistics.median(s) for name, s in samples.items()}


def _time_one(fn: Callable[[int], object], i: int, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(i)
    return time.perf_counter() - t0


def host_median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` on the host (no device sync: for host-only work such as
    launch preludes with the launch stubbed), after ``repeats // 10`` (at least 10) warm-up calls."""
    for _ in range(max(10, repeats // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def l2_flush(device: torch.device):
    """What clears the GPU's caches before a timed call (a 256 MiB write); None off a GPU."""
    if device.type != "cuda":
        return None
    buffer = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    return buffer.zero_


BUSY_LOAD_PER_CORE = 0.5
"""A 1-minute load average above this share of the cores: other work shares them."""


def busy_machine_note(load: float | None = None, cores: int | None = None) -> str | None:
    """A warning for timings taken on this CPU when the machine looks busy (``load``: the
    1-minute load average, read from the system when not given; ``cores``: the CPU count),
    else ``None``. Other work on the cores moves CPU timings by tens of percent from run to
    run, so such figures must say they came from a busy machine."""
    if load is None:
        if not hasattr(os, "getloadavg"):  # no load average on this platform (Windows)
            return None
        load = os.getloadavg()[0]
    cores = cores or os.cpu_count() or 1
    if load <= BUSY_LOAD_PER_CORE * cores:
        return None
    return (f"this machine looks busy (load average {load:.1f} on {cores} cores): its timings move between runs; "
            "quote them as from a busy machine, or rerun when it is quiet")
