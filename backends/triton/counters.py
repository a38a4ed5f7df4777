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

While a graph is captured on a stream with no kept buffer large enough, the buffer is
zeroed inside the graph (one memset node each replay) and not kept: what a capture
allocates is the graph's, and holds no zeros before the first replay. The launch is the
same either way, so a plan's merge never depends on whether a graph is being captured.
"""

from __future__ import annotations

import torch

from dflash_rocm import launches

from .common import next_pow2

_KEPT: dict[tuple, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # never freed (see the module docstring)


def kept_zeroed(device: torch.device, count: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """At least ``count`` zeroed elements of ``dtype`` on ``device`` for the current stream,
    which the launch using them must leave zero (see the module docstring for a graph
    capture that finds none kept)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (device, stream, dtype)
    kept = _KEPT.get(key)
    if kept is None or kept.numel() < count:
        if launches.graph_capturing(device):
            return torch.zeros(count, dtype=dtype, device=device)  # recorded into the graph, not kept
        if kept is not None:
            _OUTGROWN.append(kept)
        kept = torch.zeros(max(next_pow2(count), 4096), dtype=dtype, device=device)
        _KEPT[key] = kept
    return kept


def split_scratch(dummy: torch.Tensor, partials: tuple[tuple[int, torch.dtype], ...], counters: int,
                  kept_sums: bool = False) -> tuple[torch.Tensor, ...]:
    """The scratch of a launch whose work is split: a buffer per ``(elements, dtype)`` of
    ``partials`` and ``counters`` int32 arrival counters, ``dummy`` for any not needed (0).
    The partials are new buffers, or (``kept_sums``: float32 sums the parts add into)
    slices of one buffer every launch leaves zero."""
    device = dummy.device
    if kept_sums:
        kept = kept_zeroed(device, sum(n for n, _ in partials), torch.float32)
        starts = [sum(n for n, _ in partials[:i]) for i in range(len(partials))]
        buffers = tuple(dummy if not n else kept[start:start + n]
                        for (n, _), start in zip(partials, starts))
    else:
        buffers = tuple(torch.empty(n, dtype=dtype, device=device) if n else dummy for n, dtype in partials)
    return (*buffers, kept_zeroed(device, counters) if counters else dummy)
