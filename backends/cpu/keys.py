"""Which gathered keys the cpu backend's attention kernel may read, and which it scores
on the side.

torch's CPU flash-attention kernel *adds* its mask to the scores and multiplies every
value row by its weight, so a key it masks still reaches the output: NaN or +-Inf there
(or a finite key whose score overflows) makes the row's sum NaN, and a masked value row
is still multiplied by its zero weight. The keys of each request, in the gathered pages,
are therefore split three ways:

* **shared**: keys every query of the request sees. The kernel's, under a per-request
  mask (0 on them, -inf elsewhere).
* **band**: keys only some of its queries see, the last ``q - 1`` under causality and the
  first ``q - 1`` of the first query's window (a key past those is seen by every query).
  At most ``2 (q - 1)`` per request, scored on the side, where a key a query cannot see
  is selected out of that query's scores (not added to), then merged by log-sum-exp.
* **hidden**: every other gathered row (past ``seq_len``, pages past the request's own,
  before the first query's window, and the band's rows, which the kernel must not
  score): zeroed in the gathered copy, so the kernel's mask adds -inf to a finite score
  and weighs a zero value.

A band value row seen by some query of the request still meets the others' zero weights
in the side product, as in every backend's tiles: SPEC.md states the rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeySplit:
    """The split of a batch layout's ``[B, S]`` gathered keys (``Q`` the longest query)."""

    mask: torch.Tensor | None  # additive [B, 1, 1, S] (kernel dtype); None when every gathered key is shared
    hidden: tuple[torch.Tensor, torch.Tensor] | None  # (request, key) of the rows to zero
    band: tuple[torch.Tensor, torch.Tensor] | None  # gathered (request [B, 1], key [B, K]) of the band
    band_valid: torch.Tensor | None  # bool [B, K, 1, 1]: slots that hold a band key (the others read key 0)
    band_visible: torch.Tensor | None  # bool [B, 1, 1, Q, K]: which query sees which band key
    no_shared: torch.Tensor | None  # bool [B, 1, 1, 1]: requests without a shared key (the kernel saw none)


@functools.lru_cache(maxsize=8)
def split_keys(seq_lens: tuple, q_lens: tuple, first_page: tuple, key_len: int, block_size: int, causal: bool,
               window: int | None, dtype: torch.dtype) -> KeySplit:
    """The split for active requests ``(seq_len, q_len)`` whose gathered key ``t`` is key
    ``first_page * block_size + t``; built once per batch layout (a step's layers share it)."""
    s = torch.tensor(seq_lens)[:, None]
    q = torch.tensor(q_lens)[:, None]
    offset = torch.tensor(first_page)[:, None] * block_size
    Q = max(q_lens)
    lo = (s - q - window + 1).clamp(min=0) if window is not None else torch.zeros_like(s)  # first key seen
    shared_lo = lo + (q - 1) if window is not None else lo
    shared_hi = s - (q - 1) if causal else s
    key = offset + torch.arange(key_len)[None, :]
    shared = (key >= shared_lo) & (key < shared_hi)

    band = band_valid = band_visible = None
    spans = []  # (first key, end) of the band's head (window) and tail (causality)
    if window is not None:
        spans.append((lo, torch.minimum(shared_lo, s)))
    if causal:
        spans.append((torch.maximum(shared_hi, shared_lo), s))
    if spans and Q > 1:
        steps = torch.arange(Q - 1)[None, :]
        keys = torch.cat([start + steps for start, _ in spans], dim=1)  # [B, K]
        valid = torch.cat([start + steps < end for start, end in spans], dim=1)
        pos = (s - q + torch.arange(Q)[None, :])[:, :, None]  # [B, Q, 1]
        seen = valid[:, None, :].expand(-1, Q, -1)
        if causal:
            seen = seen & (keys[:, None, :] <= pos)
        if window is not None:
            seen = seen & (keys[:, None, :] > pos - window)
        band = (torch.arange(len(seq_lens))[:, None], torch.where(valid, keys - offset, 0))
        band_valid = valid[:, :, None, None]
        band_visible = seen[:, None, None]

    empty = ~shared.any(dim=1)
    hidden = (~shared).nonzero(as_tuple=True) if not bool(shared.all()) else None
    mask = None
    if hidden is not None:
        mask = torch.zeros(shared.shape, dtype=dtype).masked_fill_(~shared, float("-inf"))[:, None, None, :]
    return KeySplit(mask=mask, hidden=hidden, band=band, band_valid=band_valid, band_visible=band_visible,
                    no_shared=empty.view(-1, 1, 1, 1) if bool(empty.any()) else None)
