"""The context-KV precompute on CPU: one GEMM for every layer, a short vectorised epilogue.

Measured on an AVX2 CPU (2 cores, torch 2.13, no AVX512-BF16/AMX): a bf16 or fp16 GEMM
there runs through torch's slow non-oneDNN path, 4-7x slower than float32 at these sizes,
so the GEMM runs in float32 from a float32 copy of the weight unless oneDNN has native
kernels for the dtype (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` and the fp16
twin: AVX512-BF16/AMX CPUs), where it runs in the states' dtype. Either way the copy has
the hidden RMSNorm weight folded into its columns and the value scale into its V rows,
so the GEMM's input is only scaled by each row's RMS factor.

The epilogue works on all layers at once in float32 (SPEC.md's norms are float32):
K-norm, RoPE written straight into the output dtype, values converted once, then one
indexed copy per layer and cache. ``torch.compile`` was measured as an alternative (see
README, Backends): its compile time per shape outweighs what it saves at draft sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_rocm.calls import FP8_DTYPES, PrecomputeCall
from dflash_rocm.weights import ContextKVWeights

from .derived import derived


def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the K/V GEMM runs in for states of ``dtype`` on this CPU."""
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return dtype
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return dtype
    return torch.float32


@dataclass(frozen=True)
class PreparedWeights:
    weight_t: torch.Tensor  # [H, L*2*Hk*D] in gemm dtype: hidden norm folded into rows, v_scale into V columns
    bias: torch.Tensor | None  # [L*2*Hk*D] in gemm dtype, v_scale folded in
    k_norm: torch.Tensor  # [1, L, 1, D] float32
    rope: torch.Tensor  # [max_position, 2R] float32: per position, the factor of k and of rotate(k)
    eps: torch.Tensor  # float32 scalar


def _rope_table(cos_sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """RoPE as ``k * c + rotate(k) * s`` with ``rotate`` swapping each pair: ``c`` repeats
    cos over both members of a pair, ``s`` carries -sin for the first and +sin for the
    second (neox pairs ``(i, i + R/2)``, GPT-J pairs ``(2i, 2i + 1)``)."""
    cos, sin = cos_sin.float().chunk(2, dim=-1)
    if is_neox:
        return torch.cat((cos, cos, -sin, sin), dim=-1).contiguous()
    pairs = lambda a, b: torch.stack((a, b), dim=-1).flatten(-2)  # noqa: E731
    return torch.cat((pairs(cos, cos), pairs(-sin, sin)), dim=-1).contiguous()


def _rotate_pairs(y: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        half = y.shape[-1] // 2
        return torch.cat((y[..., half:], y[..., :half]), dim=-1)
    return y.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def prepared_weights(w: ContextKVWeights) -> PreparedWeights:
    """The GEMM operand and float32 tables, built once per weights (and after an in-place update)."""
    def build() -> PreparedWeights:
        L, Hk, D = w.num_layers, w.num_kv_heads, w.head_dim
        dtype = gemm_dtype(w.dtype)
        rows = w.kv_weight.float() * w.hidden_norm_weight.float()[None, :]
        bias = None if w.kv_bias is None else w.kv_bias.float().clone()
        if w.v_scale is not None:
            rows.view(L, 2, Hk * D, -1)[:, 1] *= w.v_scale
            if bias is not None:
                bias.view(L, 2, Hk * D)[:, 1] *= w.v_scale
        return PreparedWeights(
            weight_t=rows.to(dtype).t().contiguous(), bias=None if bias is None else bias.to(dtype),
            k_norm=w.k_norm_weight.float().view(1, L, 1, D).contiguous(),
            rope=_rope_table(w.cos_sin_cache, w.is_neox), eps=torch.tensor(float(w.eps)))
    sources = (w.kv_weight, w.hidden_norm_weight, w.kv_bias, w.k_norm_weight, w.cos_sin_cache)
    return derived(f"cpu.precompute:v_scale={w.v_scale}:neox={w.is_neox}:eps={w.eps}", sources, build)


def _rms_factor(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dim, float32, in three ops."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1]).rsqrt_()


def _projected(call: PrecomputeCall, prep: PreparedWeights) -> torch.Tensor:
    """``rms_norm(x) @ kv_weight.T + kv_bias`` (value scale included): float32 ``[N, L, 2, Hk, D]``."""
    w, x = call.weights, call.states
    normed = torch.mul(x, _rms_factor(x, prep.eps))  # float32 (type promotion), the caller's states untouched
    normed = normed.to(prep.weight_t.dtype)
    if prep.bias is None:
        kv = torch.mm(normed, prep.weight_t)
    else:
        kv = torch.addmm(prep.bias, normed, prep.weight_t)
    return kv.float().view(call.num_tokens, w.num_layers, 2, w.num_kv_heads, w.head_dim)


def _normed_rotated_keys(call: PrecomputeCall, k: torch.Tensor, prep: PreparedWeights,
                         dtype: torch.dtype) -> torch.Tensor:
    """Per-layer K RMSNorm then RoPE of ``k`` (float32 ``[N, L, Hk, D]``), written in ``dtype``."""
    w = call.weights
    N, R = k.shape[0], w.rotary_dim
    k = torch.mul(k, _rms_factor(k, prep.eps)).mul_(prep.k_norm)
    rope = prep.rope.index_select(0, call.positions).view(N, 1, 1, 2 * R)
    y = k[..., :R]
    out = torch.empty(k.shape, dtype=dtype)
    torch.addcmul(y * rope[..., :R], _rotate_pairs(y, w.is_neox), rope[..., R:], out=out[..., :R])
    if R < w.head_dim:
        out[..., R:] = k[..., R:]
    return out


def _quantized(x: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor) -> torch.Tensor:
    """``x [N, L, Hk, D] / scale[l]`` saturated into fp8 ``dtype``, as vLLM's cache write stores it."""
    limit = torch.finfo(dtype).max
    return (x / scales.view(1, -1, 1, 1)).clamp_(-limit, limit).to(dtype)


class _Slots:
    """One slot mapping resolved once into the rows to keep and, per page size, their
    targets; shared by the layers that use the same mapping tensor."""

    def __init__(self, slots: torch.Tensor):
        self.slots = slots.long()
        self.rows = None
        if self.slots.numel() and int(self.slots.min()) < 0:
            self.rows = (self.slots >= 0).nonzero().squeeze(1)
            self.slots = self.slots.index_select(0, self.rows)
        self._pages: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, cache: torch.Tensor, values: torch.Tensor) -> None:
        """``values [N, Hk, D]`` (cache dtype) into ``cache [blocks, bs, Hk, D]`` at the kept slots."""
        if self.rows is not None:
            values = values.index_select(0, self.rows)
        if cache.dtype in FP8_DTYPES:  # torch's indexed copies have no fp8 kernels: move the bytes
            cache, values = cache.view(torch.uint8), values.view(torch.uint8)
        bs = cache.shape[1]
        if cache.stride(0) == bs * cache.stride(1):  # blocks and rows merge: one flat row index
            cache.view(-1, *cache.shape[2:]).index_copy_(0, self.slots, values)
            return
        if bs not in self._pages:
            self._pages[bs] = (self.slots // bs, self.slots % bs)
        cache.index_put_(self._pages[bs], values)


def run_precompute(call: PrecomputeCall):
    w = call.weights
    prep = prepared_weights(w)
    kv = _projected(call, prep)
    k_raw, v = kv[:, :, 0], kv[:, :, 1]
    fp8 = call.cache_dtype in FP8_DTYPES
    k = _normed_rotated_keys(call, k_raw, prep, torch.float32 if fp8 else call.dtype)
    if fp8:
        k_store = _quantized(k, call.cache_dtype, call.k_scales)
        v_store = _quantized(v, call.cache_dtype, call.v_scales)
    else:
        k_store, v_store = k, v.to(call.dtype)
    resolved: dict[int, _Slots] = {}
    for layer in call.written_layers:
        mapping = call.slot_mappings[layer]
        slots = resolved.get(id(mapping))
        if slots is None:
            slots = resolved[id(mapping)] = _Slots(mapping)
        slots.write(call.key_caches[layer], k_store[:, layer])
        slots.write(call.value_caches[layer], v_store[:, layer])
    if not call.return_kv:
        return None
    return k.to(call.dtype).transpose(0, 1), v.to(call.dtype).transpose(0, 1)
