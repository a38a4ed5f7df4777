"""fp8 K/V rows with float32 scales (ContextKVWeights.kv_weight_scale): the contract's
checks, the reference's dequantization, and which backends say they read them."""

from dataclasses import replace

import pytest
import torch

import dflash_rocm
from checks import rel_err
from dflash_rocm.contract import FP8_DTYPES
from strategies import make_generator, make_weights, quantize_rows

FN, FNUZ = FP8_DTYPES


def fp8_weights(dtype=FN, granularity="channel", states_dtype=torch.float32, **kw):
    args = dict(L=2, Hk=2, D=16, H=24, R=16, is_neox=True, bias=True, v_scale=None, dtype=states_dtype,
                max_position=64)
    return make_weights(make_generator(3, "cpu"), "cpu", **{**args, **kw}, weight_format=(dtype, granularity))


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_the_reference_projects_with_the_dequantized_rows(dtype, granularity):
    """fp8 rows times their scale are the effective weight: the result equals the one of
    float32 rows holding those values (per layer norms too)."""
    w = fp8_weights(dtype, granularity, per_layer_norm=True)
    assert w.quantized and w.kv_weight.dtype == dtype
    expected_scale_shape = (1,) if granularity == "tensor" else (w.kv_weight.shape[0],)
    assert tuple(w.kv_weight_scale.shape) == expected_scale_shape
    dense = replace(w, kv_weight=w.dense_kv_weight(), kv_weight_scale=None)
    assert torch.equal(dense.kv_weight, w.kv_weight.float() * w.kv_weight_scale.view(-1, 1))
    g = make_generator(4, "cpu")
    states, positions = torch.randn(5, 24, generator=g), torch.arange(5)
    got = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                      backend="reference")
    want = dflash_rocm.precompute_and_store_context_kv(states, positions, dense, None, None, None, return_kv=True,
                                                       backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_scalar_scale_is_per_tensor():
    w = fp8_weights(granularity="tensor")
    scalar = replace(w, kv_weight_scale=w.kv_weight_scale.reshape(()))
    assert torch.equal(scalar.dense_kv_weight(), w.dense_kv_weight())


@pytest.mark.parametrize("states_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp8_rows_take_states_of_any_float_dtype_and_float_rows_only_their_own(states_dtype):
    w = fp8_weights(states_dtype=torch.float32)
    states, positions = torch.randn(3, 24).to(states_dtype), torch.arange(3)
    k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                       backend="cpu")
    assert k.dtype == v.dtype == states_dtype
    dense = replace(w, kv_weight=w.dense_kv_weight(), kv_weight_scale=None)  # float32 rows
    if states_dtype != torch.float32:
        with pytest.raises(TypeError, match="context_states"):
            dflash_rocm.precompute_and_store_context_kv(states, positions, dense, None, None, None, return_kv=True,
                                                        backend="cpu")


BAD_SCALES = [
    ("missing", lambda w: dict(kv_weight_scale=None), ValueError, "expected a float32 scale"),
    ("not a tensor", lambda w: dict(kv_weight_scale=0.5), TypeError, "torch.Tensor"),
    ("float16", lambda w: dict(kv_weight_scale=w.kv_weight_scale.half()), TypeError, "float32"),
    ("rows short", lambda w: dict(kv_weight_scale=w.kv_weight_scale[:-1]), ValueError, r"\[128\]"),
    ("2-d", lambda w: dict(kv_weight_scale=w.kv_weight_scale.view(-1, 1)), ValueError, "per-channel"),
    ("zero", lambda w: dict(kv_weight_scale=torch.zeros_like(w.kv_weight_scale)), ValueError, "positive"),
    ("negative", lambda w: dict(kv_weight_scale=-w.kv_weight_scale), ValueError, "positive"),
    ("nan", lambda w: dict(kv_weight_scale=w.kv_weight_scale.clone().index_fill_(0, torch.tensor([3]), float("nan"))),
     ValueError, "finite"),
    ("inf", lambda w: dict(kv_weight_scale=w.kv_weight_scale.clone().fill_(float("inf"))), ValueError, "finite"),
    ("scale on float rows", lambda w: dict(kv_weight=w.dense_kv_weight()), TypeError, "scales go with fp8 rows"),
    ("e5m2 rows", lambda w: dict(kv_weight=w.dense_kv_weight().to(torch.float8_e5m2)), TypeError, "kv_weight"),
]


@pytest.mark.parametrize("name, change, error, match", BAD_SCALES, ids=[b[0] for b in BAD_SCALES])
def test_bad_weight_scales_are_refused_when_the_weights_are_built(name, change, error, match):
    w = fp8_weights()
    with pytest.raises(error, match=match):
        replace(w, **change(w))


def test_to_keeps_the_fp8_rows_and_their_scale():
    w = fp8_weights(FNUZ).to(dtype=torch.bfloat16)
    assert w.kv_weight.dtype == FNUZ and w.kv_weight_scale.dtype == torch.float32
    assert w.hidden_norm_weight.dtype == torch.bfloat16


def test_a_backend_that_does_not_read_fp8_rows_says_so():
    w = fp8_weights()
    reasons = dflash_rocm.explain("precompute_and_store_context_kv", torch.randn(3, 24), torch.arange(3), w,
                                  None, None, None)
    assert reasons["reference"] == [] and reasons["cpu"] == []
    assert any("K/V weights (kv_weight_scale) not supported" in r for r in reasons["cuda"]), reasons["cuda"]


def test_quantize_rows_round_trips_within_fp8_precision():
    rows = torch.randn(8, 32, generator=make_generator(5, "cpu"))
    for dtype in FP8_DTYPES:
        for granularity in ("tensor", "channel"):
            codes, scale = quantize_rows(rows, dtype, granularity)
            assert rel_err(codes.float() * scale.view(-1, 1), rows) < 0.05
