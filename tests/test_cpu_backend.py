"""The cpu backend against the reference, on the shared strategies and checks, and on
vLLM's CPU page layout (keys stored transposed), which it reads and writes inside vLLM."""

import pytest
import torch
from hypothesis import given

import dflash_rocm
from checks import check_attention, check_precompute
from dflash_rocm import dispatch
from dflash_rocm.contract import TOLERANCES, relative_error
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.planning import switches
from dflash_rocm.vllm_plugin.cache_views import cpu_page_views
from strategies import CPU_SIZES, WEIGHT_FORMATS, attention_cases, make_generator, make_weights, precompute_cases
from test_validation import attention_args, precompute_args


@given(attention_cases(CPU_SIZES))
def test_attention_matches_reference(case):
    check_attention(case, "cpu")


@given(precompute_cases(CPU_SIZES))
def test_precompute_matches_reference(case):
    check_precompute(case, "cpu")


@given(precompute_cases(CPU_SIZES, weight_formats=WEIGHT_FORMATS))
def test_precompute_with_fp8_weights_matches_reference(case):
    """fp8 K/V rows (e4m3fn, e4m3fnuz; per-tensor and per-channel scales) for states of
    every float dtype: the dequantized rows' result."""
    check_precompute(case, "cpu")


def test_auto_picks_cpu_for_cpu_tensors_and_cpu_refuses_other_devices():
    for op, args in ((ATTENTION.name, attention_args()), (PRECOMPUTE.name, precompute_args())):
        assert dflash_rocm.explain(op, **args)["cpu"] == []
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.draft_attention(**attention_args())
    dflash_rocm.precompute_and_store_context_kv(**precompute_args())
    assert dflash_rocm.dispatch_counts() == {(ATTENTION.name, "cpu"): 1, (PRECOMPUTE.name, "cpu"): 1}
    cpu = dispatch.backend("cpu")
    for device in ("cuda", "meta"):
        assert "serves CPU tensors only" in cpu.device_not_supported_reasons(torch.device(device), None, switches())[0]


def _vllm_cpu_pages(num_blocks, block_size, Hk, D, dtype, g):
    """A vLLM CPU_ATTN cache [blocks, Hk, bs, 2D] of random bytes, and its K/V views."""
    kv = torch.randn(num_blocks, Hk, block_size, 2 * D, generator=g).to(dtype)
    return (kv, *cpu_page_views(kv, Hk, D))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_precompute_writes_vllms_cpu_pages_and_nothing_else(dtype):
    g = make_generator(11, "cpu")
    L, Hk, D, N, bs = 2, 2, 32, 9, 4
    w = make_weights(g, "cpu", L=L, Hk=Hk, D=D, H=48, R=16, is_neox=True, bias=True, v_scale=0.5, dtype=dtype)
    states, positions = torch.randn(N, 48, generator=g).to(dtype), torch.randint(0, 4096, (N,), generator=g)
    slots = torch.tensor([3, 17, -1, 8, 0, 22, -1, 5, 12])
    ours = [_vllm_cpu_pages(6, bs, Hk, D, dtype, g) for _ in range(L)]
    copies = [kv.clone() for kv, _, _ in ours]
    want = [(kv, *cpu_page_views(kv, Hk, D)) for kv in copies]
    dflash_rocm.precompute_and_store_context_kv(states, positions, w, [k for _, k, _ in ours],
                                                [v for _, _, v in ours], slots, backend="cpu")
    dflash_rocm.precompute_and_store_context_kv(states, positions, w, [k for _, k, _ in want],
                                                [v for _, _, v in want], slots, backend="reference")
    written = torch.zeros(6, bs, dtype=torch.bool)
    kept = slots[slots >= 0]
    written[kept // bs, kept % bs] = True
    for (got, gk, gv), (ref, rk, rv) in zip(ours, want):
        for a, b in ((gk, rk), (gv, rv)):
            assert relative_error(a[written], b[written]) < TOLERANCES[dtype]
            assert torch.equal(a[~written], b[~written]), "wrote outside the mapped slots"


@pytest.mark.parametrize("block_size", [4, 16])  # 16: one page per request, gathered without a reordering copy
def test_attention_reads_vllms_cpu_pages_with_a_strided_query_and_out(block_size):
    g = make_generator(12, "cpu")
    Hk, G, D, bs = 2, 3, 32, block_size
    kv, key, value = _vllm_cpu_pages(9, bs, Hk, D, torch.bfloat16, g)
    table = torch.tensor([[4, 0, 7], [2, 8, 1]], dtype=torch.int32)
    qsl = torch.tensor([0, 5, 8], dtype=torch.int32)
    seq_lens = torch.tensor([11, 6], dtype=torch.int32)
    wide_q = torch.randn(8, Hk * G, 2 * D, generator=g).to(torch.bfloat16)
    query = wide_q[..., ::2]
    out_store = torch.full((8, 2 * D, Hk * G), float("nan"), dtype=torch.bfloat16)
    out = out_store[:, :D].transpose(1, 2)
    for causal, window in ((False, None), (True, 3)):
        ref = dflash_rocm.draft_attention(query.contiguous(), key.contiguous(), value.contiguous(), table, qsl,
                                          seq_lens, causal=causal, sliding_window=window, backend="reference")
        dflash_rocm.draft_attention(query, key, value, table, qsl, seq_lens, causal=causal, sliding_window=window,
                                    out=out, backend="cpu")
        assert relative_error(out, ref) < 2e-2
        assert torch.isnan(out_store[:, D:]).all(), "wrote outside out"


def test_the_prepared_weights_follow_an_in_place_update():
    """The folded GEMM weight is keyed by the source tensors' identity and version."""
    g = make_generator(13, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=False, bias=False, v_scale=None,
                     dtype=torch.float32)
    states, positions = torch.randn(5, 24, generator=g), torch.arange(5)

    def both():
        return [dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                            backend=name) for name in ("cpu", "reference")]
    (k0, v0), _ = both()
    w.kv_weight.mul_(-2.0)
    w.hidden_norm_weight.add_(1.0)
    (k1, v1), (ref_k, ref_v) = both()
    assert relative_error(k1, ref_k) < 2e-3 and relative_error(v1, ref_v) < 2e-3
    assert relative_error(v1, v0) > 0.5
