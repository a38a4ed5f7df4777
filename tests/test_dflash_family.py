"""The precompute variants of vLLM's DFlash family against vLLM's own sequences.

Laguna drafts (vLLM 0.34 ``laguna_dflash.py``) normalise the context states once per layer
with that layer's ``input_layernorm`` and project with a batched GEMM; the contract takes
those weights as a ``[L, H]`` hidden norm weight, which the fused backends fold into the
K/V rows. The two round differently; SPEC.md states the bound that holds on bf16.
"""

import pytest
import torch

import dflash_rocm
from dflash_rocm.contract import relative_error
from strategies import make_generator, make_weights
from support import INTERPRETING

# SPEC.md section 2: every backend's K and V against vLLM's Laguna sequence on bf16.
LAGUNA_BF16_BOUND = 1e-2


def vllm_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """vLLM's ``rms_norm`` kernel: ``(scalar_t)(x * inv_rms) * weight``, the product in the
    activations' dtype (torch's bf16 arithmetic rounds each op as ``c10::BFloat16`` does)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def laguna_context_kv(states: torch.Tensor, positions: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """``DFlashLagunaModel._project_context_kv`` then the inherited K norm and RoPE
    (``rotary_embedding`` computes in the activations' dtype), ``[L, N, Hk, D]`` each."""
    L, N, H, Hk, D, R = w.num_layers, states.shape[0], w.hidden_size, w.num_kv_heads, w.head_dim, w.rotary_dim
    normed = vllm_rms_norm(states.unsqueeze(0).expand(L, N, H), w.hidden_norm_weight.view(L, 1, H), w.eps)
    kv = torch.bmm(normed, w.kv_weight.view(L, 2 * Hk * D, H).transpose(1, 2))
    if w.kv_bias is not None:
        kv += w.kv_bias.view(L, 1, -1)
    k, v = kv.view(L, N, 2, Hk, D).permute(2, 0, 1, 3, 4).contiguous()
    k = vllm_rms_norm(k, w.k_norm_weight.view(L, 1, 1, D), w.eps)
    cos_sin = w.cos_sin_cache.to(states.dtype)[positions].view(1, N, 1, R)
    cos, sin = cos_sin[..., :R // 2], cos_sin[..., R // 2:]
    x1, x2 = k[..., :R // 2], k[..., R // 2:R]  # neox pairs
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, k[..., R:]), dim=-1), v


@pytest.mark.parametrize("backend", ["reference", "cpu", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETING, reason="the triton backend runs CPU tensors through the interpreter"))])
def test_per_layer_hidden_norms_agree_with_vllms_laguna_sequence_on_bf16(backend):
    g = make_generator(21, "cpu")
    L, H = 3, 256
    w = make_weights(g, "cpu", L=L, Hk=2, D=64, H=H, R=64, is_neox=True, bias=True, v_scale=None,
                     dtype=torch.bfloat16, per_layer_norm=True)
    states = (torch.randn(48, H, generator=g) * 3).to(torch.bfloat16)
    positions = torch.randint(0, w.max_position, (48,), generator=g)
    want_k, want_v = laguna_context_kv(states, positions, w)
    k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                       backend=backend)
    assert relative_error(k, want_k) < LAGUNA_BF16_BOUND and relative_error(v, want_v) < LAGUNA_BF16_BOUND
