"""The reference backend: SPEC.md in plain torch, float32 throughout, any device.

It is the oracle every other backend is tested against, so it favours obviousness
over speed while staying vectorised (one loop over requests for attention and over
layers for cache writes; never over tokens).
"""

from __future__ import annotations

import torch

from .backend import Backend
from .calls import AttentionCall, PrecomputeCall


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * w`` over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first ``R`` dims of ``x [N, ..., D]`` by ``cos_sin [N, R]``; the rest pass."""
    R = cos_sin.shape[-1]
    shape = (cos_sin.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos = cos_sin[:, : R // 2].float().reshape(shape)
    sin = cos_sin[:, R // 2:].float().reshape(shape)
    rot, rest = x[..., :R], x[..., R:]
    if is_neox:
        x1, x2 = rot[..., : R // 2], rot[..., R // 2:]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1)


def quantize_for_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """What a cache of ``dtype`` stores for ``x``: ``x / scale`` in fp8 (saturating at the
    format's largest finite value, as vLLM's ``reshape_and_cache_flash`` does), else ``x``."""
    if scale is None:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def context_kv(call: PrecomputeCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-5 of SPEC.md section 2: float32 ``k, v`` of shape ``[L, N, Hk, D]``."""
    w = call.weights
    N, L, Hk, D = call.num_tokens, w.num_layers, w.num_kv_heads, w.head_dim
    xn = rms_norm(call.states, w.hidden_norm_weight, w.eps)
    kv = xn @ w.kv_weight.float().t()
    if w.kv_bias is not None:
        kv = kv + w.kv_bias.float()
    kv = kv.view(N, L, 2, Hk, D)
    k = rms_norm(kv[:, :, 0], w.k_norm_weight.view(1, L, 1, D), w.eps)
    k = apply_rope(k, w.cos_sin_cache[call.positions.long()], w.is_neox)
    v = kv[:, :, 1]
    if w.v_scale is not None:
        v = v * w.v_scale
    return k.transpose(0, 1), v.transpose(0, 1)


def write_context_kv(call: PrecomputeCall, k: torch.Tensor, v: torch.Tensor) -> None:
    """Step 6: store every layer's K/V rows at their slots (slot -1 is skipped)."""
    for layer in call.written_layers:
        slots = call.slot_mappings[layer].long()
        keep = slots >= 0
        slots = slots[keep]
        for caches, values, scales in ((call.key_caches, k, call.k_scales),
                                       (call.value_caches, v, call.v_scales)):
            cache = caches[layer]
            bs = cache.shape[1]
            scale = None if scales is None else scales[layer]
            cache[slots // bs, slots % bs] = quantize_for_cache(values[layer][keep], cache.dtype, scale)


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
        keys = torch.arange(seq_len, device=call.device)
        blocks, rows = table[b, keys // bs], keys % bs
        k = call.key_cache[blocks, rows].float()
        v = call.value_cache[blocks, rows].float()
        if call.is_fp8:
            k, v = k * call.k_scale, v * call.v_scale
        q = call.query[q0:q1].float().view(q_len, Hk, G, D)
        scores = torch.einsum("qhgd,shd->hgqs", q, k) * call.scale
        pos = seq_len - q_len + torch.arange(q_len, device=call.device)
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=call.device)
        if call.causal:
            visible &= keys[None, :] <= pos[:, None]
        if call.sliding_window is not None:
            visible &= keys[None, :] > pos[:, None] - call.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if call.sinks is not None:
            sink = call.sinks.float().view(Hk, G, 1, 1).expand(Hk, G, q_len, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :seq_len]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hgqs,shd->qhgd", probs, v).reshape(q_len, Hk * G, D)
        call.out[q0:q1] = out.to(call.out.dtype)


class ReferenceBackend(Backend):
    name = "reference"
    description = "plain torch, float32; the executable form of SPEC.md (any device)"

    @classmethod
    def draft_attention(cls, call: AttentionCall) -> None:
        attention(call)

    @classmethod
    def precompute(cls, call: PrecomputeCall):
        k, v = context_kv(call)
        write_context_kv(call, k, v)
        if call.return_kv:
            return k.to(call.dtype), v.to(call.dtype)
        return None
