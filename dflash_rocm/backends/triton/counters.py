"""Buffers every launch leaves zero: arrival counters, and sums split parts add into.

A tile split across programs (key segments of the attention, hidden-size parts of the
precompute) is finished in the same launch: each program writes its partial (or adds it
into the tile's one sum), then increments the tile's counter (acquire-release). Either
the one that sees ``parts - 1`` merges and resets the counter (and the sum) to zero, or
(attention merger programs) the mergers wait for ``parts`` arrivals, merge, count
themselves, and the last of them resets it. So these buffers are zero between launches
and no launch pays a memset; they are kept per device, stream and dtype. A buffer
outgrown by a larger launch is kept too: a CUDA graph captured with it still uses it on
every replay, so its memory must never serve another tensor.
"""

from __future__ import annotations

import torch

from dflash_rocm import launches

from .common import next_pow2

_KEPT: dict[tuple, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # never freed (see the module docstring)


def kept_zeroed(device: torch.device, count: int, dtype: torch.dtype = torch.int32) -> torch.Tensor | None:
    """At least ``count`` zeroed elements of ``dtype`` on ``device`` for the current stream,
    which the launch using them must leave zero. None while a CUDA graph is captured and
    the kept buffer is too small: memory allocated during capture belongs to the graph,
    so the caller merges in a second launch instead."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, dtype)
    kept = _KEPT.get(key)
    if kept is None or kept.numel() < count:
        if launches.graph_capturing(device):
            return None
        if kept is not None:
            _OUTGROWN.append(kept)
        kept = torch.zeros(max(next_pow2(count), 4096), dtype=dtype, device=device)
        _KEPT[key] = kept
    return kept


def split_scratch(dummy: torch.Tensor, partials: tuple[tuple[int, torch.dtype], ...], counters: int,
                  kept_sums: bool = False) -> tuple[torch.Tensor | None, ...]:
    """The scratch of a launch whose work is split: a buffer per ``(elements, dtype)`` of
    ``partials`` and ``counters`` int32 arrival counters, ``dummy`` for any not needed (0).
    The partials are new buffers, or (``kept_sums``: float32 sums the parts add into)
    slices of one buffer every launch leaves zero. A kept buffer is None when a graph
    capture leaves none free (see :func:`kept_zeroed`)."""
    device = dummy.device
    if kept_sums:
        kept = kept_zeroed(device, sum(n for n, _ in partials), torch.float32)
        starts = [sum(n for n, _ in partials[:i]) for i in range(len(partials))]
        buffers = tuple(dummy if not n else None if kept is None else kept[start:start + n]
                        for (n, _), start in zip(partials, starts))
    else:
        buffers = tuple(torch.empty(n, dtype=dtype, device=device) if n else dummy for n, dtype in partials)
    return (*buffers, kept_zeroed(device, counters) if counters else dummy)
