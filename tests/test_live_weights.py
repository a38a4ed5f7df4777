"""Weights taken from a live model's modules (``ContextKVWeights.from_layers``): parameters
that require grad are read without grad, fp8 projections come with their scales, and
malformed layers are refused by name."""

import re
from contextlib import nullcontext

import pytest
import torch

import dflash_rocm
from dflash_rocm.contract import TOLERANCES, dtype_name, relative_error
from dflash_rocm.platform import simulate_platform
from dflash_rocm.rope import build_cos_sin_cache
from support import SERVING_HERE

L, HK, D, H = 2, 2, 16, 32


def layer_tensors(seed=11):
    """Per-layer ``k_proj``/``v_proj`` weights and biases, ``k_norm`` and hidden norm weights."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_norm_weight=[1 + 0.2 * torch.randn(H, generator=g) for _ in range(L)],
        k_proj_weights=[torch.randn(HK * D, H, generator=g) * H ** -0.5 for _ in range(L)],
        v_proj_weights=[torch.randn(HK * D, H, generator=g) * H ** -0.5 for _ in range(L)],
        k_proj_biases=[0.1 * torch.randn(HK * D, generator=g) for _ in range(L)],
        v_proj_biases=[0.1 * torch.randn(HK * D, generator=g) for _ in range(L)],
        k_norm_weights=[1 + 0.3 * torch.randn(D, generator=g) for _ in range(L)])


def from_layers(tensors, **overrides):
    return dflash_rocm.ContextKVWeights.from_layers(
        **{**tensors, **overrides}, cos_sin_cache=build_cos_sin_cache(D, 64, {"rope_theta": 1e4}), is_neox=True,
        eps=1e-6, num_kv_heads=HK, head_dim=D)


@pytest.mark.parametrize("backend", SERVING_HERE)
def test_parameters_that_require_grad_are_read_without_grad(backend):
    """Every tensor an ``nn.Parameter`` of the modules (the ``[L, H]`` norm and ``kv_weight``
    stacked from them require grad) and states that require grad: K/V equal those of the
    same values without grad, the caches written take no autograd history, and a second
    call writes them again."""
    plain = layer_tensors()
    params = {name: [torch.nn.Parameter(t.clone()) for t in ts] for name, ts in plain.items()}
    live = from_layers(params)
    assert live.kv_weight.requires_grad and live.hidden_norm_weight.requires_grad
    g = torch.Generator().manual_seed(12)
    states, positions = torch.randn(5, H, generator=g).requires_grad_(), torch.arange(5)
    key_caches = [torch.zeros(4, 4, HK, D) for _ in range(L)]
    value_caches = [torch.zeros(4, 4, HK, D) for _ in range(L)]
    slots = torch.tensor([0, 3, 5, -1, 9])
    with simulate_platform("gfx942") if backend == "rocm" else nullcontext():
        for _ in range(2):
            k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, live, key_caches, value_caches,
                                                               slots, return_kv=True, backend=backend)
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states.detach(), positions, from_layers(plain), None,
                                                               None, None, return_kv=True, backend="reference")
    assert not (k.requires_grad or v.requires_grad)
    assert not any(c.requires_grad for c in key_caches + value_caches)
    assert relative_error(k, ref_k) < TOLERANCES[torch.float32]
    assert relative_error(v, ref_v) < TOLERANCES[torch.float32]
    assert relative_error(key_caches[1].view(-1, HK, D)[9], ref_k[1, 4]) < TOLERANCES[torch.float32]


@pytest.mark.parametrize("name,layer,shape", [
    ("hidden_norm_weight", 1, (H + 1,)),
    ("k_proj_weights", 1, (HK * D, H + 2)),
    ("k_proj_weights", 0, (HK * D - 1, H)),
    ("v_proj_weights", 1, (HK * D, H - 1)),
    ("k_norm_weights", 1, (D + 2,)),
    ("k_proj_biases", 0, (HK * D + 1,)),
    ("v_proj_biases", 1, (1, HK * D)),
])
def test_a_malformed_layer_is_refused_naming_the_layer_and_tensor(name, layer, shape):
    tensors = layer_tensors()
    tensors[name][layer] = torch.zeros(shape)
    got = re.escape(str(list(shape)))
    with pytest.raises(ValueError, match=rf"from_layers: {name}\[{layer}\]: expected .*, got {got}"):
        from_layers(tensors)


def test_layers_on_another_device_or_not_tensors_are_refused_by_name():
    tensors = layer_tensors()
    tensors["k_norm_weights"][1] = torch.ones(D, device="meta")
    with pytest.raises(ValueError, match=r"from_layers: k_norm_weights\[1\]: on meta, k_proj_weights\[0\] on cpu"):
        from_layers(tensors)
    tensors = layer_tensors()
    tensors["v_proj_weights"][0] = tensors["v_proj_weights"][0].tolist()
    with pytest.raises(TypeError, match=r"from_layers: v_proj_weights\[0\]: expected a torch.Tensor, got list"):
        from_layers(tensors)


def fp8_layers(tensors):
    """``tensors`` with fp8 projections: layer 0 per-tensor scales (``[]``), layer 1
    per-channel (``[rows, 1]``, as quantized modules hold them); and the float rows they
    stand for (codes times scales)."""
    quantized, dense = dict(tensors), dict(tensors)
    for proj in ("k", "v"):
        codes, scales, rows = [], [], []
        for layer, w in enumerate(tensors[f"{proj}_proj_weights"]):
            amax = w.abs().amax() if layer == 0 else w.abs().amax(1, keepdim=True)
            scale = (amax / 448).float()
            code = (w / scale).to(torch.float8_e4m3fn)
            codes.append(code)
            scales.append(scale)
            rows.append(code.float() * scale)
        quantized[f"{proj}_proj_weights"], quantized[f"{proj}_proj_scales"] = codes, scales
        dense[f"{proj}_proj_weights"] = rows
    return quantized, dense


@pytest.mark.parametrize("backend", SERVING_HERE)
def test_fp8_projections_with_their_scales_are_fp8_rows_with_one_scale_a_row(backend):
    quantized, dense = fp8_layers(layer_tensors())
    w = from_layers(quantized)
    assert w.kv_weight.dtype == torch.float8_e4m3fn and w.kv_weight_scale.shape == (L * 2 * HK * D,)
    assert torch.equal(w.dense_kv_weight(), from_layers(dense).kv_weight)
    g = torch.Generator().manual_seed(13)
    states, positions = torch.randn(5, H, generator=g), torch.arange(5)
    with simulate_platform("gfx942") if backend == "rocm" else nullcontext():
        k, v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                           backend=backend)
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states, positions, from_layers(dense), None, None,
                                                               None, return_kv=True, backend="reference")
    assert relative_error(k, ref_k) < TOLERANCES[torch.float32]
    assert relative_error(v, ref_v) < TOLERANCES[torch.float32]


def test_fp8_projection_scales_are_checked_by_name():
    quantized, _ = fp8_layers(layer_tensors())
    with pytest.raises(ValueError, match=r"give both k_proj_scales and v_proj_scales"):
        from_layers({k: v for k, v in quantized.items() if k != "v_proj_scales"})
    bad = dict(quantized, v_proj_scales=[quantized["v_proj_scales"][0], torch.ones(HK * D + 1)])
    with pytest.raises(ValueError, match=rf"from_layers: v_proj_scales\[1\]: expected .*, got \[{HK * D + 1}\]"):
        from_layers(bad)
    bad = dict(quantized, k_proj_scales=[quantized["k_proj_scales"][0].double(), quantized["k_proj_scales"][1]])
    with pytest.raises(TypeError, match=r"from_layers: k_proj_scales\[0\]: expected float32"):
        from_layers(bad)
    with pytest.raises(ValueError, match=r"kv_weight_scale: kv_weight is .*expected a float32 scale"):
        from_layers({k: v for k, v in quantized.items() if not k.endswith("_scales")})


@pytest.mark.parametrize("first,second", [(torch.float8_e4m3fn, torch.bfloat16),
                                          (torch.float8_e4m3fn, torch.float8_e4m3fnuz),
                                          (torch.float32, torch.float16)])
def test_layers_of_mixed_k_v_formats_are_refused_naming_the_layer_and_both_formats(first, second):
    """torch.cat promoted float rows silently and refused fp8 ones with its own error."""
    tensors = layer_tensors()
    tensors["k_proj_weights"] = [t.to(first) for t in tensors["k_proj_weights"]]
    tensors["v_proj_weights"] = [tensors["v_proj_weights"][0].to(first), tensors["v_proj_weights"][1].to(second)]
    if first in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        tensors.update(k_proj_scales=[torch.ones(1)] * L, v_proj_scales=[torch.ones(1)] * L)
    with pytest.raises(ValueError, match=re.escape(f"from_layers: v_proj_weights[1] is {dtype_name(second)}, "
                                                   f"k_proj_weights[0] is {dtype_name(first)}")):
        from_layers(tensors)
