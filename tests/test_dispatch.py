"""Backend choice: names, the environment variable, auto's order, reasons, logs, counts."""

import logging
import sys

import pytest
import torch

import dflash_rocm
from dflash_rocm import dispatch, registry
from dflash_rocm.backend import Backend
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.platform import simulate_platform
from dflash_rocm.backends.reference import ReferenceAttention, ReferenceBackend
from test_validation import attention_args, precompute_args


@pytest.fixture
def fresh_registry(monkeypatch):
    """Isolate the registry's caches so fake backends do not leak into other tests."""
    monkeypatch.setattr(registry, "_classes", {})
    monkeypatch.setattr(registry, "_import_errors", {})
    monkeypatch.setattr(dispatch, "_logged", set())
    return monkeypatch


class Refuses(Backend):
    name = "cuda"
    implementations = ReferenceBackend.implementations

    @classmethod
    def device_not_supported_reasons(cls, device, platform, switches):
        return ["no NVIDIA GPU here (test double)"]


class ServesEverything(ReferenceBackend):
    """Computes like the reference but reports a vendor name: proves auto's order."""
    name = "triton"


def test_unknown_backend_name_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "nonsense")
    with pytest.raises(ValueError) as info:
        dflash_rocm.draft_attention(**attention_args())
    message = str(info.value)
    assert "DFLASH_ROCM_BACKEND" in message and "nonsense" in message
    for name in ("auto", *registry.NAMES):
        assert name in message
    with pytest.raises(ValueError, match="valid names"):
        dflash_rocm.draft_attention(**attention_args(), backend="flash")


def test_keyword_wins_over_environment(monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "nonsense")
    out = dflash_rocm.draft_attention(**attention_args(), backend="reference")
    assert torch.isfinite(out).all()


def test_environment_selects_backend(monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "Reference ")
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.draft_attention(**attention_args())
    assert dflash_rocm.dispatch_counts() == {(ATTENTION.name, "reference"): 1}


def test_named_backend_that_cannot_serve_raises_with_reason(fresh_registry):
    fresh_registry.setitem(registry._classes, "cuda", Refuses)
    with pytest.raises(dflash_rocm.BackendUnavailable) as info:
        dflash_rocm.draft_attention(**attention_args(), backend="cuda")
    assert info.value.reasons == {"cuda": ["no NVIDIA GPU here (test double)"]}
    assert "no NVIDIA GPU here" in str(info.value)


def test_unavailable_shows_the_call_beside_the_reasons(fresh_registry):
    """As xformers' dispatch errors do: every argument's shape and dtype, the scalars."""
    fresh_registry.setitem(registry._classes, "cuda", Refuses)
    with pytest.raises(dflash_rocm.BackendUnavailable) as info:
        dflash_rocm.draft_attention(**attention_args(), backend="cuda")
    message = str(info.value)
    assert "query: shape=(6, 4, 16) (fp32, cpu)" in message and "key_cache: shape=(8, 4, 2, 16)" in message
    assert "block_table: shape=(2, 3) (int32, cpu)" in message and "causal: False" in message
    assert message.index("query:") < message.index("no NVIDIA GPU here")
    with pytest.raises(dflash_rocm.BackendUnavailable) as info:
        dflash_rocm.precompute_and_store_context_kv(**precompute_args(), backend="cuda")
    assert "states: shape=(5, 24)" in str(info.value) and "key_caches: 2 x shape=(3, 4, 2, 16)" in str(info.value)
    assert "ContextKVWeights(L=2, Hk=2, D=16, H=24" in info.value.call


def test_hooks_are_per_op(monkeypatch):
    """``warm_up``/``tune`` reach the backend's implementation of the op asked for, with
    that op's spec; a backend without one does nothing."""
    seen = []

    class TunedPrecompute(ReferenceBackend.implementation(PRECOMPUTE)):
        @classmethod
        def warm_up(cls, spec, device):
            seen.append(("warm_up", spec, device))

        @classmethod
        def tune(cls, spec, device, *, progress=None):
            return ("table", spec)

    class PrecomputeTuner(Backend):
        name = "fake"
        implementations = (TunedPrecompute,)

    device = torch.device("cpu")
    PrecomputeTuner.warm_up(PRECOMPUTE, "a precompute spec", device)
    PrecomputeTuner.warm_up(ATTENTION, "an attention spec", device)  # no attention implementation: nothing
    assert seen == [("warm_up", "a precompute spec", device)]
    assert PrecomputeTuner.tune(PRECOMPUTE, "spec", device) == ("table", "spec")
    assert PrecomputeTuner.tune(ATTENTION, "spec", device) is None
    from dflash_rocm.backends.rocm import RocmBackend, RocmPrecompute
    assert RocmBackend.tune(PRECOMPUTE, "any spec", device) is None  # no precompute tuner: the default
    assert "warm_up" not in vars(RocmBackend) and "tune" not in vars(RocmBackend) and "tune" not in vars(RocmPrecompute)


def test_auto_walks_the_priority_order(fresh_registry):
    fresh_registry.setitem(registry.PRIORITIES, "cpu", ("cuda", "triton", "reference"))
    fresh_registry.setitem(registry._classes, "triton", ServesEverything)
    fresh_registry.setitem(registry._classes, "cuda", Refuses)
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.draft_attention(**attention_args(), backend="auto")
    assert dflash_rocm.dispatch_counts() == {(ATTENTION.name, "triton"): 1}


def test_priority_lists_are_per_platform():
    from dflash_rocm.platform import platform_for_arch
    assert registry.priority_for(platform_for_arch("gfx942"), "cuda")[:2] == ("aiter", "rocm")
    assert registry.priority_for(platform_for_arch("sm_90"), "cuda")[0] == "cuda"
    # CPU tensors, simulated architectures included: no vendor kernels for auto
    cpu_order = registry.priority_for(platform_for_arch("gfx942", simulated=True), "cpu")
    assert not {"rocm", "aiter", "cuda"} & set(cpu_order) and cpu_order[-1] == "reference"
    for order in registry.PRIORITIES.values():
        assert set(order) <= set(registry.NAMES)


def test_auto_never_picks_vendor_kernels_for_cpu_tensors(fresh_registry):
    class VendorServes(ReferenceBackend):
        name = "rocm"
    fresh_registry.setitem(registry._classes, "rocm", VendorServes)
    with simulate_platform("gfx942"):
        reasons = dflash_rocm.explain("draft_attention", **attention_args())
        assert "not in auto's order" in reasons["rocm"][0]
        assert reasons["reference"] == []
        dflash_rocm.reset_dispatch_counts()
        dflash_rocm.draft_attention(**attention_args())
        assert (ATTENTION.name, "rocm") not in dflash_rocm.dispatch_counts()
        out = dflash_rocm.draft_attention(**attention_args(), backend="rocm")  # named: allowed
    assert torch.isfinite(out).all()


def test_import_failure_becomes_the_backends_reason(fresh_registry):
    fresh_registry.setitem(registry.MODULES, "cuda", "dflash_rocm.no_such_module")
    reasons = dflash_rocm.explain("draft_attention", **attention_args())
    assert reasons["cuda"] and "cannot import dflash_rocm.no_such_module" in reasons["cuda"][0]
    assert dflash_rocm.available_backends("cpu")["cuda"] == [reasons["cuda"][0]]


def test_explain_covers_every_backend_for_both_ops():
    for op, args in (("draft_attention", attention_args()),
                     ("precompute_and_store_context_kv", precompute_args())):
        reasons = dflash_rocm.explain(op, **args)
        assert set(reasons) == set(registry.NAMES)
        assert list(reasons)[:len(registry.PRIORITIES["cpu"])] == list(registry.PRIORITIES["cpu"])
        assert reasons["reference"] == []
    with pytest.raises(ValueError, match="op"):
        dflash_rocm.explain("matmul")


def test_a_backend_that_does_not_implement_an_op_says_so_and_is_passed_over(fresh_registry):
    class AttentionOnly(Backend):
        name = "triton"
        implementations = (ReferenceAttention,)
    fresh_registry.setitem(registry.PRIORITIES, "cpu", ("triton", "reference"))
    fresh_registry.setitem(registry._classes, "triton", AttentionOnly)
    reasons = dflash_rocm.explain("precompute_and_store_context_kv", **precompute_args())
    assert reasons["triton"] == ["does not implement precompute_and_store_context_kv"]
    assert dflash_rocm.explain("draft_attention", **attention_args())["triton"] == []
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.precompute_and_store_context_kv(**precompute_args())
    dflash_rocm.draft_attention(**attention_args())
    assert dflash_rocm.dispatch_counts() == {(PRECOMPUTE.name, "reference"): 1, (ATTENTION.name, "triton"): 1}
    with pytest.raises(dflash_rocm.BackendUnavailable, match="does not implement"):
        dflash_rocm.precompute_and_store_context_kv(**precompute_args(), backend="triton")
    with pytest.raises(dflash_rocm.BackendUnavailable, match="does not implement"):
        dflash_rocm.plan_context_kv(**{k: v for k, v in precompute_args().items() if k in (
            "weights", "key_caches", "value_caches")}, backend="triton").run(
            *(precompute_args()[k] for k in ("context_states", "positions", "slot_mapping")))


def test_a_new_attention_only_backend_is_one_folder(fresh_registry, tmp_path, monkeypatch):
    """What backends/README.md promises: a folder beside the others whose ``__init__.py``
    defines a Backend naming one implementation is found by the registry with no line
    anywhere else; ``auto`` never gives it the op it does not implement."""
    import dflash_rocm.backends

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "from dflash_rocm.backend import AttentionImplementation, Backend\n"
        "from dflash_rocm.ops.attention import reference\n\n\n"
        "class MyAttention(AttentionImplementation):\n"
        "    @classmethod\n"
        "    def run(cls, call):\n"
        "        reference(call)\n\n\n"
        "class MyBackend(Backend):\n"
        "    name = 'mine'\n"
        "    implementations = (MyAttention,)\n")
    monkeypatch.setattr(dflash_rocm.backends, "__path__", [*dflash_rocm.backends.__path__, str(tmp_path)])
    monkeypatch.setitem(sys.modules, "dflash_rocm.backends.mine", None)
    monkeypatch.delitem(sys.modules, "dflash_rocm.backends.mine")  # (imported below; gone after the test)
    found = registry.find_backends(dflash_rocm.backends.__path__)
    assert found["mine"] == "dflash_rocm.backends.mine" and set(found) == {*registry.NAMES, "mine"}
    fresh_registry.setattr(registry, "MODULES", found)
    fresh_registry.setattr(registry, "NAMES", tuple(found))
    fresh_registry.setitem(registry.PRIORITIES, "cpu", ("mine", "reference"))
    dflash_rocm.reset_dispatch_counts()
    out = dflash_rocm.draft_attention(**attention_args())
    dflash_rocm.precompute_and_store_context_kv(**precompute_args())
    assert dflash_rocm.dispatch_counts() == {(ATTENTION.name, "mine"): 1, (PRECOMPUTE.name, "reference"): 1}
    assert torch.isfinite(out).all()
    assert dflash_rocm.explain("precompute_and_store_context_kv", **precompute_args())["mine"] == [
        "does not implement precompute_and_store_context_kv"]


def test_a_folder_without_its_backend_class_says_so(fresh_registry, tmp_path, monkeypatch):
    import dflash_rocm.backends

    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "__init__.py").write_text("from dflash_rocm.backends.reference import ReferenceBackend\n")
    monkeypatch.setattr(dflash_rocm.backends, "__path__", [*dflash_rocm.backends.__path__, str(tmp_path)])
    monkeypatch.setitem(sys.modules, "dflash_rocm.backends.stray", None)
    monkeypatch.delitem(sys.modules, "dflash_rocm.backends.stray")
    fresh_registry.setattr(registry, "MODULES", registry.find_backends(dflash_rocm.backends.__path__))
    fresh_registry.setattr(registry, "NAMES", tuple(registry.MODULES))
    assert registry.load("stray") is None
    assert "must define one Backend subclass named 'stray' (found none)" in registry.import_error("stray")


def test_one_implementation_per_op():
    with pytest.raises(TypeError, match="one implementation per op"):
        class Twice(Backend):
            implementations = (ReferenceAttention, ReferenceAttention)


def test_aiter_is_a_backend_with_its_own_reasons():
    reasons = dflash_rocm.explain("draft_attention", **attention_args())
    assert reasons["aiter"]  # no aiter on this machine, and CPU tensors
    reasons = dflash_rocm.explain("precompute_and_store_context_kv", **precompute_args())["aiter"]
    assert reasons[-1] == "does not implement precompute_and_store_context_kv"


def test_choice_is_logged_once_per_signature(fresh_registry, caplog):
    fresh_registry.setitem(registry.PRIORITIES, "cpu", ("cuda", "reference"))
    fresh_registry.setitem(registry._classes, "cuda", Refuses)
    caplog.set_level(logging.INFO, logger="dflash_rocm")
    for _ in range(3):
        dflash_rocm.draft_attention(**attention_args(), backend="auto")
    records = [r for r in caplog.records if r.name == "dflash_rocm" and "draft_attention" in r.getMessage()]
    assert len(records) == 1
    message = records[0].getMessage()
    assert "cuda passed over" in message and "no NVIDIA GPU here" in message and "Hq=4 Hk=2 D=16" in message
    dflash_rocm.draft_attention(**attention_args(), backend="auto", causal=True)
    records = [r for r in caplog.records if r.name == "dflash_rocm" and "draft_attention" in r.getMessage()]
    assert len(records) == 2 and " causal" in records[1].getMessage()


def test_counts_both_ops():
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.draft_attention(**attention_args(), backend="reference")
    dflash_rocm.precompute_and_store_context_kv(**precompute_args(), backend="reference")
    dflash_rocm.precompute_and_store_context_kv(**precompute_args(), backend="reference")
    assert dflash_rocm.dispatch_counts() == {(ATTENTION.name, "reference"): 1,
                                             (PRECOMPUTE.name, "reference"): 2}


def test_a_call_structure_is_planned_once(monkeypatch):
    """The plan cache is behind both the function and the plan: one walk over the reasons
    and one plan per (op, requested name, plan key)."""
    walks, plans = [], []
    original = dispatch.planned_reasons
    monkeypatch.setattr(dispatch, "planned_reasons", lambda *a, **k: (walks.append(a[0]), original(*a, **k))[1])
    plan = ReferenceAttention.plan
    monkeypatch.setattr(ReferenceAttention, "plan", classmethod(
        lambda cls, record, facts: (plans.append(facts), plan(record, facts))[1]))
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "reference")
    args = attention_args()
    for _ in range(3):
        dflash_rocm.draft_attention(**args)
    dflash_rocm.plan_draft_attention(**args).run(args["query"], args["key_cache"], args["value_cache"])
    assert walks == ["reference"] and len(plans) == 1
    dflash_rocm.draft_attention(**args, causal=True)  # another structure: planned again
    assert len(plans) == 2
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "auto")  # another requested name: walked again
    before = len(walks)
    dflash_rocm.draft_attention(**args)
    assert len(walks) > before


def test_kept_plans_stay_bounded_as_caches_come_and_go():
    """The precompute's plan key holds its caches' addresses: a server that re-creates
    its caches (or a test suite) makes a new key each time, and the plan cache must not
    grow with them."""
    args = precompute_args()
    alive = []  # each set of caches at addresses of its own
    for _ in range(dispatch.PLANS_KEPT + 40):
        alive.append([torch.zeros_like(c) for c in args["key_caches"] + args["value_caches"]])
        dflash_rocm.precompute_and_store_context_kv(**{**args, "key_caches": alive[-1][:2],
                                                       "value_caches": alive[-1][2:]}, backend="reference")
    assert 0 < len(dispatch._plans) <= dispatch.PLANS_KEPT
