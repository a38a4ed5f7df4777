"""Backend choice: names, the environment variable, auto's order, reasons, logs, counts."""

import logging

import pytest
import torch

import dflash_rocm
from dflash_rocm import dispatch, registry
from dflash_rocm.backend import Backend
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.platform import simulate_platform
from dflash_rocm.backends.reference import ReferenceBackend
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

    @classmethod
    def device_not_supported_reasons(cls, device, platform):
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
    fresh_registry.setitem(registry.BY_NAME, "cuda",
                           registry.BackendRecord("cuda", "dflash_rocm.no_such_module:Nothing"))
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
    class AttentionOnly(ReferenceBackend):
        name = "triton"
        OPS = frozenset({ATTENTION.name})
    fresh_registry.setitem(registry.PRIORITIES, "cpu", ("triton", "reference"))
    fresh_registry.setitem(registry._classes, "triton", AttentionOnly)
    reasons = dflash_rocm.explain("precompute_and_store_context_kv", **precompute_args())
    assert reasons["triton"] == ["does not implement precompute_and_store_context_kv"]
    assert dflash_rocm.explain("draft_attention", **attention_args())["triton"] == []
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.precompute_and_store_context_kv(**precompute_args())
    assert dflash_rocm.dispatch_counts() == {(PRECOMPUTE.name, "reference"): 1}
    with pytest.raises(dflash_rocm.BackendUnavailable, match="does not implement"):
        dflash_rocm.precompute_and_store_context_kv(**precompute_args(), backend="triton")


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


def test_choice_is_remembered_per_support_key(monkeypatch):
    walks = []
    original = dispatch.reasons_for
    monkeypatch.setattr(dispatch, "reasons_for", lambda *a, **k: (walks.append(a[0]), original(*a, **k))[1])
    args = attention_args()
    for _ in range(3):
        dflash_rocm.draft_attention(**args)
    first = len(walks)
    assert first > 0
    dflash_rocm.draft_attention(**args, causal=True)  # another support key: walked again
    assert len(walks) > first
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "reference")  # another requested name: walked again
    before = len(walks)
    dflash_rocm.draft_attention(**args)
    assert walks[before:] == ["reference"]


def test_remembered_choices_stay_bounded_as_caches_come_and_go():
    """The precompute's support key holds its caches' addresses: a server that re-creates
    its caches (or a test suite) makes a new key each time, and the memo of choices must
    not grow with them."""
    args = precompute_args()
    alive = []  # each set of caches at addresses of its own
    for _ in range(dispatch._CHOICES_KEPT + 40):
        alive.append([torch.zeros_like(c) for c in args["key_caches"] + args["value_caches"]])
        dflash_rocm.precompute_and_store_context_kv(**{**args, "key_caches": alive[-1][:2],
                                                       "value_caches": alive[-1][2:]}, backend="reference")
    assert 0 < len(dispatch._choices) <= dispatch._CHOICES_KEPT
