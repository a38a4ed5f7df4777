"""Arrival counters for merging split work in the same launch.

A tile split across programs (key segments of the attention, hidden-size parts of the
precompute) is finished in the same launch: each program writes its partial, then
increments the tile's counter (acquire-release). Either the one that sees ``parts - 1``
merges the partials and resets the counter to zero, or (attention merger programs) the
mergers wait for ``parts`` arrivals, merge, count themselves, and the last of them resets
it. So the counters are zero between launches and no launch pays a memset; they are kept
per device and stream. A buffer outgrown by a larger launch is kept too: a CUDA graph
captured with it still increments it on every replay, so its memory must never serve
another tensor.
"""

from __future__ import annotations

import torch

from .common import next_pow2

_COUNTERS: dict[tuple, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # never freed (see the module docstring); a few KiB each


def arrival_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """At least ``count`` zeroed int32 counters on ``device`` for the current stream.
    None while a CUDA graph is captured and the kept buffer is too small: memory
    allocated during capture belongs to the graph, so the caller merges in a second
    launch instead."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    counters = _COUNTERS.get((device, stream))
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if counters is not None:
            _OUTGROWN.append(counters)
        counters = torch.zeros(max(next_pow2(count), 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, stream)] = counters
    return counters


def split_scratch(dummy: torch.Tensor, partials: tuple[tuple[int, torch.dtype], ...], counters: int
                  ) -> tuple[torch.Tensor | None, ...]:
    """The scratch of a launch whose work is split: a new buffer per ``(elements, dtype)``
    of ``partials`` and ``counters`` arrival counters, ``dummy`` for any not needed (0);
    the counters are None when a graph capture leaves none free (see
    :func:`arrival_counters`)."""
    device = dummy.device
    buffers = tuple(torch.empty(n, dtype=dtype, device=device) if n else dummy for n, dtype in partials)
    return (*buffers, arrival_counters(device, counters) if counters else dummy)
