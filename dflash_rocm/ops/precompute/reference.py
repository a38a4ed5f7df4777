"""The context-KV precompute in plain torch, float32 throughout: the contract's executable form.

Every backend is tested against :func:`precompute`; it favours obviousness over speed
while staying vectorised (one loop over layers for the cache writes, never over tokens).
"""

from __future__ import annotations

import torch

from ...paged import write_rows
from .call import PrecomputeCall


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


def project(call: PrecomputeCall) -> torch.Tensor:
    """Steps 1-2: ``rms_norm(x, hidden_norm_weight) @ kv_weight.T + kv_bias``, float32
    ``[N, L, 2, Hk, D]``; a per-layer norm weight ``[L, H]`` normalises the states once per
    layer, literally (the backends fold it into the weight instead). fp8 rows are
    dequantized first, ``kv_weight.float() * kv_weight_scale`` per row, in float32."""
    w = call.weights
    N, L, Hk, D, H = call.num_tokens, w.num_layers, w.num_kv_heads, w.head_dim, w.hidden_size
    weight = w.dense_kv_weight().float()
    if w.per_layer_hidden_norm:
        xn = rms_norm(call.states.unsqueeze(0), w.hidden_norm_weight.view(L, 1, H), w.eps)  # [L, N, H]
        kv = torch.bmm(xn, weight.view(L, 2 * Hk * D, H).transpose(1, 2)).transpose(0, 1)
    else:
        kv = rms_norm(call.states, w.hidden_norm_weight, w.eps) @ weight.t()
    kv = kv.reshape(N, L * 2 * Hk * D)
    if w.kv_bias is not None:
        kv = kv + w.kv_bias.float()
    return kv.view(N, L, 2, Hk, D)


def context_kv(call: PrecomputeCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1-5 of SPEC.md section 2: float32 ``k, v`` of shape ``[L, N, Hk, D]``."""
    w = call.weights
    L, D = w.num_layers, w.head_dim
    kv = project(call)
    k = rms_norm(kv[:, :, 0], w.k_norm_weight.view(1, L, 1, D), w.eps)
    if w.round_k_before_rope:
        k = k.to(call.dtype).float()
    rotated = apply_rope(k, w.cos_sin_cache[call.positions.long()], w.is_neox)
    if w.rope_layers is None:
        k = rotated
    else:  # NoPE layers keep their normed K
        k = torch.where(torch.tensor(w.rope_layers, device=k.device).view(1, L, 1, 1), rotated, k)
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
            write_rows(cache, slots // bs, slots % bs, quantize_for_cache(values[layer][keep], cache.dtype, scale))


@torch.no_grad()  # inference-only: weights that require grad (live parameters) leave no history in the caches
def precompute(call: PrecomputeCall) -> tuple[torch.Tensor, torch.Tensor] | None:
    """SPEC.md section 2: write every layer's K/V; ``(k, v)`` in the states' dtype iff ``return_kv``."""
    k, v = context_kv(call)
    write_context_kv(call, k, v)
    if call.return_kv:
        return k.to(call.dtype), v.to(call.dtype)
    return None
