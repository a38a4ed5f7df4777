"""Backend choice: names, the environment variable, auto's order, reasons, logs, counts."""

import logging

import pytest
import torch

import dflash_rocm
from dflash_rocm import dispatch
from dflash_rocm.backend import Backend
from dflash_rocm.reference import ReferenceBackend
from test_validation import attention_args, precompute_args


@pytest.fixture
def fresh_registry(monkeypatch):
    """Isolate the registry's caches so fake backends do not leak into other tests."""
    monkeypatch.setattr(dispatch, "_classes", {})
    monkeypatch.setattr(dispatch, "_import_errors", {})
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
    for name in dispatch.VALID_NAMES:
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
    assert dflash_rocm.dispatch_counts() == {(dispatch.ATTENTION, "reference"): 1}


def test_named_backend_that_cannot_serve_raises_with_reason(fresh_registry):
    fresh_registry.setitem(dispatch._classes, "cuda", Refuses)
    with pytest.raises(dflash_rocm.BackendUnavailable) as info:
        dflash_rocm.draft_attention(**attention_args(), backend="cuda")
    assert info.value.reasons == {"cuda": ["no NVIDIA GPU here (test double)"]}
    assert "no NVIDIA GPU here" in str(info.value)


def test_auto_walks_the_priority_order(fresh_registry):
    fresh_registry.setitem(dispatch._classes, "triton", ServesEverything)
    fresh_registry.setitem(dispatch._classes, "cuda", Refuses)
    fresh_registry.setitem(dispatch._classes, "cpu", Refuses)
    dflash_rocm.reset_dispatch_counts()
    dflash_rocm.draft_attention(**attention_args(), backend="auto")
    assert dflash_rocm.dispatch_counts() == {(dispatch.ATTENTION, "triton"): 1}


def test_auto_never_picks_vendor_kernels_for_cpu_tensors(fresh_registry):
    class VendorServes(ReferenceBackend):
        name = "rocm"
    fresh_registry.setitem(dispatch._classes, "rocm", VendorServes)
    reasons = dflash_rocm.explain("draft_attention", **attention_args())
    assert "auto never runs the rocm kernels on CPU tensors" in reasons["rocm"][0]
    assert reasons["reference"] == []
    out = dflash_rocm.draft_attention(**attention_args(), backend="rocm")  # named: allowed
    assert torch.isfinite(out).all()


def test_import_failure_becomes_the_backends_reason(fresh_registry):
    fresh_registry.setitem(dispatch.BACKEND_PATHS, "cuda", "dflash_rocm.no_such_module:Nothing")
    reasons = dflash_rocm.explain("draft_attention", **attention_args())
    assert reasons["cuda"] and "cannot import dflash_rocm.no_such_module" in reasons["cuda"][0]
    assert dflash_rocm.available_backends("cpu")["cuda"] == reasons["cuda"]


def test_explain_covers_every_backend_for_both_ops():
    for op, args in (("draft_attention", attention_args()),
                     ("precompute_and_store_context_kv", precompute_args())):
        reasons = dflash_rocm.explain(op, **args)
        assert list(reasons) == list(dispatch.AUTO_ORDER)
        assert reasons["reference"] == []
    with pytest.raises(ValueError, match="op"):
        dflash_rocm.explain("matmul")


def test_choice_is_logged_once_per_signature(fresh_registry, caplog):
    fresh_registry.setitem(dispatch._classes, "cuda", Refuses)
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
    assert dflash_rocm.dispatch_counts() == {(dispatch.ATTENTION, "reference"): 1,
                                             (dispatch.PRECOMPUTE, "reference"): 2}


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
