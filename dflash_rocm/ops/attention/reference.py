"""Draft attention in plain torch, float32 throughout: the contract's executable form.

Every backend is tested against :func:`attention`; it loops over requests (each gets its
own key range) and is vectorised within one. It reads only the keys some query of the
request sees (from the first query's window to ``seq_len``) and selects, not adds, the
visibility of each: rows no query sees never reach the output, whatever they hold.
"""

from __future__ import annotations

import torch

from ...paged import read_rows
from .call import AttentionCall


@torch.no_grad()  # inference-only: sinks or scales that require grad (live parameters) leave no history
def attention(call: AttentionCall) -> None:
    """SPEC.md section 1, one request at a time, written into ``call.out``."""
    qsl = call.query_start_loc.tolist()
    lens = call.seq_lens.tolist()
    Hk, G, D, bs = call.num_kv_heads, call.num_queries_per_kv, call.head_dim, call.block_size
    table = call.block_table.long()
    for b, seq_len in enumerate(lens):
        q0, q1 = qsl[b], qsl[b + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        first = 0 if call.sliding_window is None else max(0, seq_len - q_len - call.sliding_window + 1)
        keys = torch.arange(first, seq_len, device=call.device)
        blocks, rows = table[b, keys // bs], keys % bs
        k = read_rows(call.key_cache, blocks, rows).float()
        v = read_rows(call.value_cache, blocks, rows).float()
        if call.is_fp8:
            k, v = k * call.k_scale, v * call.v_scale
        q = call.query[q0:q1].float().view(q_len, Hk, G, D)
        scores = torch.einsum("qhgd,shd->hgqs", q, k) * call.scale
        pos = seq_len - q_len + torch.arange(q_len, device=call.device)
        visible = torch.ones(q_len, len(keys), dtype=torch.bool, device=call.device)
        if call.causal:
            visible &= keys[None, :] <= pos[:, None]
        if call.sliding_window is not None:
            visible &= keys[None, :] > pos[:, None] - call.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if call.sinks is not None:
            sink = call.sinks.float().view(Hk, G, 1, 1).expand(Hk, G, q_len, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hgqs,shd->qhgd", probs, v).reshape(q_len, Hk * G, D)
        call.out[q0:q1] = out.to(call.out.dtype)
