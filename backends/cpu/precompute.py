"""The context-KV precompute on CPU: one GEMM for every layer, a short vectorised epilogue.

Measured on an AVX2 CPU (2 cores, torch 2.13, no AVX512-BF16/AMX): a bf16 or fp16 GEMM
there runs through torch's slow non-oneDNN path, 4-7x slower than float32 at these sizes,
so the GEMM runs in float32 from a float32 copy of the weight unless oneDNN has native
kernels for the dtype (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` and the fp16
twin: AVX512-BF16/AMX CPUs), where it runs in the states' dtype
(:func:`dflash_rocm.platform.cpu_gemm_dtype`).

Values are rounded to the states' dtype where vLLM's own sequence rounds them (the
normed states, the GEMM's output, the normed keys, RoPE's cos/sin table and output; norm
statistics and every product in float32), so they track vLLM's to a unit in the last
place. (Not bit for bit: vLLM's AVX2 CPU kernels truncate float32 to bf16 where torch
rounds to nearest, so a random draft's near-tied proposals can still differ.) The normed
keys are rounded before RoPE in every case, which is what ``round_k_before_rope`` asks
for. Per-layer hidden norm weights are folded into the GEMM operand
(:meth:`~dflash_rocm.weights.ContextKVWeights.folded_kv_weight`: rows past 65504 scaled
by powers of two, taken back after the GEMM); the states are then normalised without a
weight. Where the weights allow the normed states or the projected K to pass the states'
dtype (bounds from the weights, once: ``|xn_c| <= sqrt(H) |w_c|``, ``|kv_r| <= sqrt(H)
||w * W_r|| + |b_r|``), those stay float32 instead of being rounded there (vLLM's
sequence would overflow; SPEC's order does not).

The GEMM reads the weight as stored, ``[L*2*Hk*D, H]`` (``F.linear``, as vLLM's sequence):
oneDNN's bf16 GEMM for the Qwen3-8B draft's 16 x 4096 x 10240 took 11.4 ms that way against
17.6 ms from a transposed contiguous copy (measured on the AVX-512 EPYC of benchmarks.md's
Machines, one thread, busy machine).

The epilogue works on all layers at once: K-norm, RoPE written straight into the output
dtype, then one indexed copy per layer and cache. ``torch.compile`` was measured as an
alternative: 20 s to compile, then 30% faster at draft sizes (tens of microseconds a
call), which vLLM's steps do not repay.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_rocm.contract import FP8_DTYPES, QUERY_DTYPES
from dflash_rocm.derived import DerivedCache
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.platform import cpu_gemm_dtype
from dflash_rocm.weights import ContextKVWeights


@dataclass(frozen=True)
class PreparedWeights:
    weight: torch.Tensor  # [L*2*Hk*D, H] in gemm dtype (per-layer hidden norm weights folded in)
    bias: torch.Tensor | None  # [L*2*Hk*D] in gemm dtype
    hidden_norm: torch.Tensor | None  # [H] float32; None when folded into weight
    row_scale: torch.Tensor | None  # [L*2*Hk*D] float32: the folded rows' scales; None when all 1
    wide_states: bool  # the normed states may pass the dtype's range: kept float32, GEMM in float32
    wide_keys: bool  # the projected K may pass the dtype's range: kept float32 until the K RMSNorm
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
    if is_neox:  # the halves swapped: one roll by half the width
        return torch.roll(y, y.shape[-1] // 2, dims=-1)
    return y.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


_PREPARED = DerivedCache()


def prepared_weights(w: ContextKVWeights, states_dtype: torch.dtype | None = None) -> PreparedWeights:
    """The GEMM operand and float32 tables for states of ``states_dtype`` (default: the
    weights' own dtype; fp8 rows serve states of any float dtype, each with its own), built
    once per weights (and refilled after an in-place update)."""
    states_dtype = states_dtype or w.dtype
    if states_dtype not in QUERY_DTYPES:
        raise TypeError(f"prepared_weights: fp8 K/V rows serve states of a float dtype; name it (got {states_dtype})")
    sources = (w.kv_weight, w.hidden_norm_weight, w.kv_bias, w.k_norm_weight, w.cos_sin_cache, w.kv_weight_scale)
    return _PREPARED.get(sources, (w.is_neox, w.eps, w.num_layers, w.head_dim, states_dtype),
                         functools.partial(_prepare, states_dtype=states_dtype), w)


def _prepare(w: ContextKVWeights, states_dtype: torch.dtype) -> PreparedWeights:
    """fp8 rows are dequantized here (float32, exact) into the GEMM operand: this backend's
    GEMM has no fp8 kernel, so it keeps the dense rows the weights' scales give."""
    L, Hk, D, H = w.num_layers, w.num_kv_heads, w.head_dim, w.hidden_size
    folded = w.per_layer_hidden_norm
    rows, scale = w.folded_kv_weight()
    limit = torch.finfo(states_dtype).max
    # |rms_norm(x, w)_c| <= sqrt(H) |w_c|, and |kv_r| <= sqrt(H) ||w * W_r|| (+ |bias_r|).
    wide_states = not folded and H ** 0.5 * float(w.hidden_norm_weight.detach().float().abs().max()) > limit
    key_bound = H ** 0.5 * (rows.double().norm(dim=1) * scale).view(L, 2, Hk * D)[:, 0]
    if w.kv_bias is not None:
        key_bound = key_bound + w.kv_bias.detach().double().abs().view(L, 2, Hk * D)[:, 0]
    wide_keys = float(key_bound.max()) > limit
    # A GEMM in the states' dtype (oneDNN's, on AVX512-FP16/AMX CPUs) rounds its output to
    # that dtype: K that may pass its range is projected in float32.
    dtype = torch.float32 if wide_states or wide_keys else cpu_gemm_dtype(states_dtype)
    # Detached: parameters that require grad (a live model's) are read without grad.
    return PreparedWeights(
        weight=(rows if folded else w.dense_kv_weight()).detach().to(dtype).contiguous(),
        bias=None if w.kv_bias is None else w.kv_bias.detach().to(dtype).contiguous(),
        hidden_norm=None if folded else w.hidden_norm_weight.detach().float().contiguous(),
        row_scale=scale if folded and bool((scale != 1).any()) else None,
        wide_states=wide_states, wide_keys=wide_keys,
        k_norm=w.k_norm_weight.detach().float().view(1, L, 1, D).contiguous(),
        # vLLM's rotary kernel reads the table in the activations' dtype.
        rope=_rope_table(w.cos_sin_cache.to(states_dtype), w.is_neox), eps=torch.tensor(float(w.eps)))


def _rms_factor(x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dim, float32, in three ops."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1]).rsqrt_()


def _projected(call: PrecomputeCall, prep: PreparedWeights) -> torch.Tensor:
    """``rms_norm(x) @ kv_weight.T + kv_bias``, ``[N, L, 2, Hk, D]``, in the states' dtype
    (float32 where the weights' bounds say the K projection may pass the dtype's range)."""
    w, x = call.weights, call.states
    if x.requires_grad:  # inference-only: read without grad, as the weights are
        x = x.detach()
    # x * r (* w unless folded) in float32 (type promotion: the caller's states stay
    # untouched), rounded once as it is written.
    normed = torch.empty(x.shape, dtype=torch.float32 if prep.wide_states else call.dtype)
    if prep.hidden_norm is None:
        torch.mul(x, _rms_factor(x, prep.eps), out=normed)
    else:
        torch.mul(torch.mul(x, _rms_factor(x, prep.eps)), prep.hidden_norm, out=normed)
    normed = normed.to(prep.weight.dtype)
    if prep.row_scale is not None:  # folded rows past the limit: their scale back, then the bias
        kv = F.linear(normed, prep.weight).mul_(prep.row_scale)
        if prep.bias is not None:
            kv.add_(prep.bias)
    else:
        kv = F.linear(normed, prep.weight, prep.bias)
    kv = kv.to(torch.float32 if prep.wide_keys else call.dtype)
    kv = kv.view(call.num_tokens, w.num_layers, 2, w.num_kv_heads, w.head_dim)
    if w.v_scale is not None:
        kv[:, :, 1] *= w.v_scale
    return kv


def _normed_rotated_keys(call: PrecomputeCall, k: torch.Tensor, prep: PreparedWeights) -> torch.Tensor:
    """Per-layer K RMSNorm then RoPE of ``k`` (``[N, L, Hk, D]``), in the states' dtype."""
    w = call.weights
    R = w.rotary_dim
    normed = torch.empty(k.shape, dtype=call.dtype)
    torch.mul(torch.mul(k, _rms_factor(k, prep.eps)), prep.k_norm, out=normed)
    cos, sin = prep.rope.index_select(0, call.positions).view(-1, 1, 1, 2 * R).chunk(2, dim=-1)
    out = torch.empty(k.shape, dtype=call.dtype)
    if R == w.head_dim and not w.nope_layers:  # the whole head of every layer rotates: no slices
        return torch.addcmul(normed * cos, _rotate_pairs(normed, w.is_neox), sin, out=out)
    y = normed[..., :R]
    torch.addcmul(y * cos, _rotate_pairs(y, w.is_neox), sin, out=out[..., :R])
    if R < w.head_dim:
        out[..., R:] = normed[..., R:]
    for layer in w.nope_layers:  # NoPE layers keep their normed K
        out[:, layer] = normed[:, layer]
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
    prep = prepared_weights(call.weights, call.dtype)
    k, v = _projected(call, prep).unbind(2)
    k, v = _normed_rotated_keys(call, k, prep), v.to(call.dtype)
    k_store, v_store = k, v
    if call.is_fp8:
        k_store = _quantized(k, call.cache_dtype, call.k_scales)
        v_store = _quantized(v, call.cache_dtype, call.v_scales)
    k_layers, v_layers = k_store.unbind(1), v_store.unbind(1)
    resolved: dict[int, _Slots] = {}
    for layer in call.written_layers:
        mapping = call.slot_mappings[layer]
        slots = resolved.get(id(mapping))
        if slots is None:
            slots = resolved[id(mapping)] = _Slots(mapping)
        slots.write(call.key_caches[layer], k_layers[layer])
        slots.write(call.value_caches[layer], v_layers[layer])
    return (k.transpose(0, 1), v.transpose(0, 1)) if call.return_kv else None
