"""The plugin's reload tee refuses every streamed K/V tensor that does not fit, by reason.

One table: each kind of tensor a reload streams into a draft's K/V rows (a plain draft's
float weight, bias and fused Laguna ``qkv_proj``; fp8 codes and their per-channel scale,
held as fp8 rows; int8 codes and scale, held dequantized; packed int4 codes' zero points)
times the ways a shard can be wrong (too few rows, too many, another dtype). Each gives its
reason string and writes nothing: not the held rows, not the shard sources kept for later
reloads. The fitting tensor of each kind is taken, so every row of the table could fail.
"""

from types import SimpleNamespace

import pytest
import torch

from dflash_rocm.vllm_plugin import draft_weights
from test_quantized_kv import K_IN, KV, N, Q, Linear, _Mapper, fp8_codes, g, int4_case, method, pack, param


def _inner(attn):
    inner = type("Inner", (), {"hf_to_vllm_mapper": _Mapper})()
    inner.layers = [SimpleNamespace(self_attn=attn)]
    return inner


def plain_draft():
    attn = SimpleNamespace(qkv_proj=SimpleNamespace(), q_size=Q, num_kv_heads=1, head_dim=KV)
    held = SimpleNamespace(kv_weight=torch.randn(2 * KV, K_IN, generator=g()), kv_bias=torch.randn(2 * KV),
                           num_layers=1, num_kv_heads=1, head_dim=KV, per_layer_hidden_norm=False, quantized=False)
    return _inner(attn), held


def quantized_draft(linear, keep_fp8):
    attn = SimpleNamespace(qkv_proj=linear, q_size=Q, num_kv_heads=1, head_dim=KV)
    inner = _inner(attn)
    setattr(inner, draft_weights.QUANTIZED_KV, source := draft_weights.QuantizedKV([attn]))
    if keep_fp8:
        codes, scale = source.fp8_kv(KV, torch.device("cpu"))
        held = SimpleNamespace(kv_weight=codes, kv_weight_scale=scale, dtype=codes.dtype, quantized=True,
                               num_layers=1, num_kv_heads=1, head_dim=KV, per_layer_hidden_norm=False, kv_bias=None)
    else:
        held = SimpleNamespace(kv_weight=source.kv_weight(torch.float32), num_layers=1, num_kv_heads=1, head_dim=KV,
                               per_layer_hidden_norm=False, quantized=False, kv_bias=None)
    return inner, held


def fp8_draft():
    gen = g()
    return quantized_draft(Linear(method("CompressedTensorsLinearMethod"), weight=param(fp8_codes(gen), 0),
                                  weight_scale=param(torch.rand(N, 1, generator=gen) + 0.5, 0)), keep_fp8=True)


def int8_draft():
    gen = g()
    return quantized_draft(Linear(method("CompressedTensorsLinearMethod"),
                                  weight=param(torch.randint(-127, 128, (N, K_IN), generator=gen, dtype=torch.int8), 0),
                                  weight_scale=param(torch.rand(N, 1, generator=gen) + 0.5, 0)), keep_fp8=False)


def zero_point_draft():
    codes, s, z = int4_case()
    scheme = type("CompressedTensorsWNA16", (), {"num_bits": 4, "symmetric": False})()
    return quantized_draft(Linear(method("CompressedTensorsLinearMethod"), scheme,
                                  weight_packed=param(pack(codes, 1), 0), weight_scale=param(s, 0),
                                  weight_zero_point=param(pack(z, 0), 0)), keep_fp8=False)


# kind: (draft, streamed name, a fitting tensor, rows along the output dimension, a wrong dtype)
KINDS = {
    "float weight": (plain_draft, "k_proj.weight", lambda: torch.randn(KV, K_IN), torch.int8),
    "float bias": (plain_draft, "v_proj.bias", lambda: torch.randn(KV), torch.float8_e4m3fn),
    "fused float qkv": (plain_draft, "qkv_proj.weight", lambda: torch.randn(N, K_IN), torch.int32),
    "fp8 codes": (fp8_draft, "k_proj.weight", lambda: fp8_codes(g())[:KV], torch.bfloat16),
    "fp8 scale": (fp8_draft, "v_proj.weight_scale", lambda: torch.rand(KV, 1) + 0.5, torch.int32),
    "int8 codes": (int8_draft, "k_proj.weight",
                   lambda: torch.randint(-127, 128, (KV, K_IN), dtype=torch.int8), torch.float16),
    "int8 scale": (int8_draft, "k_proj.weight_scale", lambda: torch.rand(KV, 1) + 0.5, torch.int8),
    "zero points": (zero_point_draft, "v_proj.weight_zero_point", lambda: pack(int4_case(KV)[2], 0),
                    torch.float32),
}


def streamed(tensor: torch.Tensor, how: str, wrong_dtype: torch.dtype) -> torch.Tensor:
    if how == "too few rows":
        return tensor[:-1]
    if how == "too many rows":
        return torch.cat([tensor, tensor[:1]])
    if how == "wrong dtype":
        return tensor.float().to(wrong_dtype)
    return tensor


def snapshot(inner, held) -> list[torch.Tensor]:
    tensors = [t for t in vars(held).values() if isinstance(t, torch.Tensor)]
    source = getattr(inner, draft_weights.QUANTIZED_KV, None)
    if source is not None:
        tensors += [t for shard in source.shards for part in shard.values() for t in part.values()]
    return [t.view(torch.uint8).clone() if t.dtype.itemsize == 1 else t.clone() for t in tensors]


@pytest.mark.parametrize("how", ["fits", "too few rows", "too many rows", "wrong dtype"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_streamed_tensor_that_does_not_fit_gives_its_reason_and_writes_nothing(kind, how):
    draft, name, fitting, wrong_dtype = KINDS[kind]
    inner, held = draft()
    tee = draft_weights.ReloadTee(inner)
    before = snapshot(inner, held)
    list(tee.watch([(f"layers.0.self_attn.{name}", streamed(fitting(), how, wrong_dtype))]))
    why = tee.refill(held)
    if how == "fits":
        assert why is None
        return
    assert isinstance(why, str) and name in why, why
    after = snapshot(inner, held)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before)), "written"
