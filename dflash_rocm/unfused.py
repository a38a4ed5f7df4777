"""vLLM's unfused context-KV sequence (``qwen3_dflash.py``'s precompute), op for op.

hidden RMSNorm -> one GEMM for every layer's K/V -> permute copy -> grouped K RMSNorm
-> in-place RoPE over all layers -> value scale -> one cache write per layer. The cuda
backend runs it with vLLM's own ops (vLLM's fast path behind SPEC.md); ``bench`` also
runs it with plain torch ops, as the baseline the fused kernel has to beat.

The DFlash family's variants: NoPE layers keep their K as ``ricursive_dflash2.py`` does
(saved before the one RoPE call, restored after); per-layer hidden norm weights are
folded into the GEMM's rows (the states are then normalised with a weight of ones); the
normed K is stored in the states' dtype before RoPE in every case, which is what
``round_k_before_rope`` asks for.
"""

from __future__ import annotations

import importlib
import torch
import torch.nn.functional as F

from .contract import FP8_DTYPES
from .derived import DerivedCache
from .ops.precompute import PrecomputeCall
from .ops.precompute.reference import apply_rope, quantize_for_cache
from .weights import ContextKVWeights


class TorchOps:
    """The sequence's ops written with torch (several kernels each)."""

    name = "torch"

    def rms_norm(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        xf = x.float()
        out.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float())

    def grouped_rms_norm(self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """``x [L, N, Hk, D]``, one ``weight`` row per layer."""
        self.rms_norm(out, x, weight.view(weight.shape[0], 1, 1, -1), eps)

    def rotary(self, positions: torch.Tensor, k_flat: torch.Tensor, head_size: int, cos_sin: torch.Tensor,
               is_neox: bool) -> None:
        k = k_flat.view(k_flat.shape[0], -1, head_size)
        k.copy_(apply_rope(k.float(), cos_sin[positions], is_neox))

    def write_cache(self, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    slots: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
        keep = slots >= 0
        s = slots[keep].long()
        bs = key_cache.shape[1]
        key_cache[s // bs, s % bs] = quantize_for_cache(k[keep], key_cache.dtype, k_scale)
        value_cache[s // bs, s % bs] = quantize_for_cache(v[keep], value_cache.dtype, v_scale)


class VllmOps(TorchOps):
    """vLLM's custom ops (``vllm._custom_ops``) where the build has them, torch otherwise.

    vLLM's CPU ``rms_norm`` silently applies row 0 of a ``[L, D]`` weight to every
    layer, so off CUDA the grouped norm runs once per layer.
    """

    name = "vllm"

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else importlib.import_module("vllm._custom_ops")
        self.has_cache_op = _has_op("_C_cache_ops", "reshape_and_cache_flash")

    def rms_norm(self, out, x, weight, eps) -> None:
        self.ops.rms_norm(out, x, weight, eps)

    def grouped_rms_norm(self, out, x, weight, eps) -> None:
        if x.device.type == "cuda":
            self.ops.rms_norm(out, x, weight, eps)
            return
        for layer in range(x.shape[0]):
            self.ops.rms_norm(out[layer], x[layer], weight[layer], eps)

    def rotary(self, positions, k_flat, head_size, cos_sin, is_neox) -> None:
        self.ops.rotary_embedding(positions, k_flat, None, head_size, cos_sin, is_neox)

    def write_cache(self, k, v, key_cache, value_cache, slots, k_scale, v_scale) -> None:
        if not self.has_cache_op:
            super().write_cache(k, v, key_cache, value_cache, slots, k_scale, v_scale)
            return
        fp8 = key_cache.dtype in FP8_DTYPES
        one = None if fp8 else torch.ones(1, dtype=torch.float32, device=k.device)
        # vLLM allocates fp8 caches as uint8; its kernel reads them that way.
        self.ops.reshape_and_cache_flash(
            k, v, key_cache.view(torch.uint8) if fp8 else key_cache,
            value_cache.view(torch.uint8) if fp8 else value_cache, slots.long(),
            "fp8" if fp8 else "auto", k_scale if fp8 else one, v_scale if fp8 else one)


def _has_op(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


_COS_SIN = DerivedCache()
_FOLDED = DerivedCache()


def _projection(w: ContextKVWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden norm weight, K/V rows) of the GEMM: the weights' own, or, for per-layer norm
    weights, ones and the rows with each layer's weight folded in, rounded once to the
    weights' dtype (vLLM's sequence runs in that dtype: a fold past it overflows there)."""
    if not w.per_layer_hidden_norm:
        return w.hidden_norm_weight, w.kv_weight

    def fold() -> tuple[torch.Tensor, torch.Tensor]:
        rows, scale = w.folded_kv_weight()
        return torch.ones(w.hidden_size, dtype=w.dtype, device=w.device), (rows * scale[:, None]).to(w.dtype)
    return _FOLDED.get((w.kv_weight, w.hidden_norm_weight), "folded", fold)


def unfused_precompute(call: PrecomputeCall, ops: TorchOps):
    """SPEC.md section 2 the way vLLM computes it, with ``ops`` supplying each step."""
    w = call.weights
    N, L, Hk, D = call.num_tokens, w.num_layers, w.num_kv_heads, w.head_dim
    states = call.states.contiguous()  # vLLM's kernels index rows densely (no copy when already so)
    normed = torch.empty_like(states)
    norm_weight, kv_weight = _projection(w)
    ops.rms_norm(normed, states, norm_weight, w.eps)
    kv = F.linear(normed, kv_weight, w.kv_bias).view(N, L, 2, Hk, D)
    kv = kv.permute(2, 1, 0, 3, 4).contiguous()  # [2, L, N, Hk, D]: K and V layer-major
    k_raw, v = kv[0], kv[1]
    k = torch.empty_like(k_raw)
    ops.grouped_rms_norm(k, k_raw, w.k_norm_weight, w.eps)
    # vLLM's rotary kernel reads the table in the activations' dtype.
    cos_sin = _COS_SIN.get((w.cos_sin_cache,), call.dtype, lambda: w.cos_sin_cache.to(call.dtype))
    unrotated = [k[layer].clone() for layer in w.nope_layers]
    ops.rotary(call.positions.long().repeat(L), k.view(L * N, Hk * D), D, cos_sin, w.is_neox)
    for layer, saved in zip(w.nope_layers, unrotated):
        k[layer].copy_(saved)
    if w.v_scale is not None:
        v.mul_(w.v_scale)
    for layer in call.written_layers:
        k_scale = None if call.k_scales is None else call.k_scales[layer:layer + 1]
        v_scale = None if call.v_scales is None else call.v_scales[layer:layer + 1]
        ops.write_cache(k[layer], v[layer], call.key_caches[layer], call.value_caches[layer],
                        call.slot_mappings[layer], k_scale, v_scale)
    return (k, v) if call.return_kv else None
