"""Buffers every launch leaves zero: arrival counters, and sums split parts add into; and
the scratch split parts write their partials to.

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
zeroed inside the graph (one memset node each replay) and not kept
(:func:`dflash_rocm.capture.keep_unless_captured`): what a capture allocates is the
graph's, and holds no zeros before the first replay. The launch is the
same either way, so a plan's merge never depends on whether a graph is being captured.

Partials that need no zeros (the attention's per-segment outputs, the precompute's parts
kept apart) are slices of a scratch buffer kept the same way (per device, stream and
dtype; outgrown ones kept): launches on one stream run one after another, so calls of
every plan share it. A plan keeps its slices per stream (:class:`PlanScratch`), so a call
pays a dictionary lookup for its scratch, not an allocation or a slice.
"""

from __future__ import annotations

import torch

from dflash_rocm.capture import keep_unless_captured

from .common import next_pow2

_KEPT: dict[tuple, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # never freed (see the module docstring)


def stream_of(device: torch.device) -> int | None:
    """The current stream of ``device`` (None off the GPU): what kept buffers are per."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


def kept_zeroed(device: torch.device, count: int, dtype: torch.dtype = torch.int32, *,
                zeroed: bool = True) -> torch.Tensor:
    """At least ``count`` zeroed elements of ``dtype`` on ``device`` for the current stream,
    which the launch using them must leave zero (see the module docstring for a graph
    capture that finds none kept). ``zeroed=False``: scratch, kept apart, any values."""
    key = (device, stream_of(device), dtype, zeroed)
    kept = _KEPT.get(key)
    if kept is None or kept.numel() < count:
        make = torch.zeros if zeroed else torch.empty
        made = make(max(next_pow2(count), 4096), dtype=dtype, device=device)
        if keep_unless_captured(_KEPT, key, made, device) and kept is not None:
            _OUTGROWN.append(kept)
        return made
    return kept


def split_scratch(device: torch.device, partials: tuple[tuple[int, torch.dtype], ...], counters: int,
                  kept_sums: bool = False) -> tuple[torch.Tensor | None, ...]:
    """The scratch of a launch whose work is split: a buffer per ``(elements, dtype)`` of
    ``partials`` and ``counters`` int32 arrival counters, None for any not needed (0).
    The partials are slices of the kept scratch of their dtype (one buffer for all of
    them), or (``kept_sums``: float32 sums the parts add into) of one buffer every launch
    leaves zero."""
    by_dtype: dict[torch.dtype, int] = {}
    for n, dtype in partials:
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    kept = {dtype: kept_zeroed(device, n, dtype, zeroed=kept_sums) for dtype, n in by_dtype.items() if n}
    buffers, start = [], dict.fromkeys(by_dtype, 0)
    for n, dtype in partials:
        buffers.append(kept[dtype][start[dtype]:start[dtype] + n] if n else None)
        start[dtype] += n
    return (*buffers, kept_zeroed(device, counters) if counters else None)


class PlanScratch:
    """One plan's :func:`split_scratch`, made on the plan's first call on each stream and
    handed to every later call on it (kept buffers are never freed, and outgrown ones stay
    as they were: a slice stays valid). While a graph is captured the scratch is made for
    that capture alone and not kept."""

    __slots__ = ("partials", "counters", "kept_sums", "_by_stream", "_none")

    def __init__(self, partials: tuple[tuple[int, torch.dtype], ...], counters: int, kept_sums: bool = False):
        self.partials, self.counters, self.kept_sums = partials, counters, kept_sums
        self._by_stream: dict = {}
        # A plan that splits nothing needs no scratch on any stream: every call gets this.
        needed = counters or any(n for n, _ in partials)
        self._none = None if needed else (None,) * (len(partials) + 1)

    def get(self, device: torch.device) -> tuple[torch.Tensor | None, ...]:
        """The scratch for a call on ``device``'s current stream (None where not needed)."""
        if self._none is not None:
            return self._none
        key = stream_of(device) if device.type == "cuda" else device
        found = self._by_stream.get(key)
        if found is None:
            found = split_scratch(device, self.partials, self.counters, self.kept_sums)
            keep_unless_captured(self._by_stream, key, found, device)
        return found
