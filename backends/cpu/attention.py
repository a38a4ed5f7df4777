"""Draft attention on CPU: gather each request's visible pages once, in the cache's dtype,
and run torch's CPU flash-attention kernel (float32 accumulation) over the whole batch.

* GQA without copies of K/V: the ``G`` query heads of a KV head are folded into the query
  length (``[B, Hk, G*Q, D]``), so every KV head is read by one attention head.
* Only the pages a request can see are gathered: with a sliding window, the pages before
  the window of the request's first query are skipped.
* The kernel adds its mask, so it reads only keys every query of the request sees, and
  the other gathered rows are zeroed in the copy; keys only some queries see (causality,
  the window's edge) are scored on the side and merged by log-sum-exp (see ``keys``).
  Rows no query can see never reach the output, whatever they hold.
* Sinks use the log-sum-exp: a sink logit ``s`` scales a row by ``sigmoid(lse - s)``.
  fp8 pages are widened exactly to the query dtype; ``k_scale`` joins the softmax scale
  and ``v_scale`` multiplies the output.
"""

from __future__ import annotations

import functools

import torch

from dflash_rocm.ops.attention import AttentionCall

from .keys import KeySplit, split_keys

_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _gather_pages(cache: torch.Tensor, block_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """``cache [blocks, bs, Hk, D]`` pages ``block_ids [B*n]`` as ``[B, Hk, n*bs, D]``.

    The pages are copied whole in the cache's own memory order (``index_select`` along
    the block dimension moves contiguous runs); a layout whose keys are not rows of D
    contiguous elements (vLLM's CPU pages store K transposed) pays a second, reordering
    copy, as do pages whose rows do not follow each other once gathered."""
    inner = sorted((1, 2, 3), key=cache.stride, reverse=True)
    pages = torch.index_select(cache.permute(0, *inner), 0, block_ids)
    pages = pages.permute(0, *(inner.index(d) + 1 for d in (1, 2, 3)))  # [B*n, bs, Hk, D] view
    _, bs, Hk, D = pages.shape
    keys = pages.reshape(batch, -1, Hk, D)
    if keys.stride(-1) != 1:  # the kernel reads each key as D contiguous elements
        keys = keys.contiguous()
    return keys.transpose(1, 2)


class _Layout:
    """Host-side facts of one call: active requests, query and key spans, first pages."""

    def __init__(self, call: AttentionCall):
        bs, window = call.block_size, call.sliding_window
        starts = call.query_start_loc.tolist()
        seq_lens = call.seq_lens.tolist()
        active = [b for b in range(call.num_seqs) if starts[b + 1] > starts[b]]
        self.all_active = len(active) == call.num_seqs
        self.requests = tuple(active)
        self.q_lens = tuple(starts[b + 1] - starts[b] for b in active)
        self.seq_lens = tuple(seq_lens[b] for b in active)
        self.starts = tuple(starts[b] for b in active)
        self.q_max = max(self.q_lens, default=0)
        # Keys before the first query's window are invisible to every query of the request.
        self.first_page = tuple(max(0, s - q - window + 1) // bs if window else 0
                                for q, s in zip(self.q_lens, self.seq_lens))
        spans = [s - f * bs for s, f in zip(self.seq_lens, self.first_page)]
        self.key_len = max(spans, default=0)
        self.pages = -(-self.key_len // bs)
        self.padded = not (self.all_active and all(q == self.q_max for q in self.q_lens))


def _block_ids(call: AttentionCall, layout: _Layout) -> torch.Tensor:
    table = call.block_table
    if layout.all_active and not any(layout.first_page):
        ids = table[:, : layout.pages]
    else:
        rows = table.index_select(0, torch.tensor(layout.requests))
        cols = torch.arange(layout.pages)[None, :] + torch.tensor(layout.first_page)[:, None]
        ids = rows.gather(1, cols.clamp_(max=table.shape[1] - 1))
    # Columns past a request's own pages are zeroed after the gather; any id in range will do there.
    return ids.clamp(0, call.num_blocks - 1).view(-1)


@functools.lru_cache(maxsize=8)
def _padding(starts: tuple, q_lens: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a ragged batch: the token read into each padded query row, and which padded rows
    go back to which tokens."""
    Q = max(q_lens)
    read = torch.tensor([s + min(i, q - 1) for s, q in zip(starts, q_lens) for i in range(Q)])
    rows = torch.tensor([b * Q + i for b, q in enumerate(q_lens) for i in range(q)])
    tokens = torch.tensor([s + i for s, q in zip(starts, q_lens) for i in range(q)])
    return read, rows, tokens


def _side_scores(q: torch.Tensor, k: torch.Tensor, split: KeySplit, scale: float) -> torch.Tensor:
    """float32 ``[B, Hk, G, Q, K]`` scores of the band keys, -inf (selected) where a query
    cannot see the key."""
    B, Hk, _, D = q.shape
    Q = split.band_visible.shape[-2]
    request, key = split.band
    band = k[request, :, key].float()  # [B, K, Hk, D]
    scores = torch.einsum("bhgqd,bkhd->bhgqk", q.view(B, Hk, -1, Q, D).float(), band) * scale
    return scores.masked_fill_(~split.band_visible, float("-inf"))


def _merge(out: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, band_v: torch.Tensor, split: KeySplit):
    """The kernel's ``out``/``lse`` over the shared keys merged with the band's scores and
    values: float32 ``[B, Hk, G*Q, D]`` and the whole log-sum-exp ``[B, Hk, G*Q]``."""
    B, Hk, G, Q, _ = scores.shape
    lse = lse.view(B, Hk, G, Q)
    if split.no_shared is not None:  # the kernel saw no key of these requests: its 0 is no log-sum-exp
        lse = lse.masked_fill(split.no_shared, float("-inf"))
    total = torch.logaddexp(lse, torch.logsumexp(scores, dim=-1))
    side = torch.einsum("bhgqk,bkhd->bhgqd", torch.exp(scores - total[..., None]), band_v.float())
    merged = out.view(B, Hk, G, Q, -1).float() * torch.exp(lse - total)[..., None] + side
    return merged.view(B, Hk, G * Q, -1), total.view(B, Hk, G * Q)


def run_draft_attention(call: AttentionCall) -> None:
    layout = _Layout(call)
    if layout.q_max == 0:
        return
    B, Q, Hk, G, D = len(layout.requests), layout.q_max, call.num_kv_heads, call.num_queries_per_kv, call.head_dim
    ids = _block_ids(call, layout)
    # Fresh copies of the pages (index_select copies): the hidden rows are zeroed in them.
    k = _gather_pages(call.key_cache, ids, B)[:, :, : layout.key_len]
    v = _gather_pages(call.value_cache, ids, B)[:, :, : layout.key_len]
    scale = call.scale
    if call.is_fp8:
        k, v = k.to(call.dtype), v.to(call.dtype)
        scale *= call.k_scale.item()
    query = call.query
    if layout.padded:
        read, rows, tokens = _padding(layout.starts, layout.q_lens)
        query = query.index_select(0, read)
    q = query.view(B, Q, Hk, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, G * Q, D)
    if q.stride(-1) != 1:
        q = q.contiguous()
    split = split_keys(layout.seq_lens, layout.q_lens, layout.first_page, layout.key_len, call.block_size,
                       call.causal, call.sliding_window, call.dtype)
    if split.band is not None:
        request, key = split.band
        # An empty slot's 0 weight must not meet whatever key 0 holds.
        scores, band_v = _side_scores(q, k, split, scale), v[request, :, key].masked_fill_(~split.band_valid, 0)
    if split.hidden is not None:
        request, key = split.hidden
        k[request, :, key] = 0
        v[request, :, key] = 0
    out, lse = _flash_attention(q, k, v, 0.0, False, attn_mask=split.mask, scale=scale)
    if split.band is not None:
        out, lse = _merge(out, lse, scores, band_v, split)
    factor = None
    if call.sinks is not None:
        sinks = call.sinks.float().view(1, Hk, G, 1).expand(1, Hk, G, Q).reshape(1, Hk, G * Q)
        factor = torch.sigmoid(lse - sinks)[..., None]
    if call.is_fp8:
        factor = call.v_scale if factor is None else factor * call.v_scale
    if factor is not None:
        out = out * factor
    result = out.view(B, Hk, G, Q, D).permute(0, 3, 1, 2, 4)  # [B, Q, Hk, G, D]
    if not layout.padded:
        call.out.view(B, Q, Hk, G, D).copy_(result)
        return
    values = result.reshape(B * Q, Hk * G, D).index_select(0, rows)
    call.out[tokens] = values.to(call.out.dtype)
