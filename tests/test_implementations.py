"""Every registered implementation of every op against the reference (xformers' way:
the test enumerates the registry, and an implementation that cannot run here is skipped
with its own reasons).

Each implementation runs where some platform this machine can present serves it: CPU
tensors as they are, then under a simulated AMD and NVIDIA platform (named backends run
simulated platforms' code paths on CPU tensors, through the Triton interpreter).
"""

import contextlib
import dataclasses

import pytest
import torch

from dflash_rocm import dispatch, registry
from dflash_rocm.contract import relative_error
from dflash_rocm.ops import OPS
from dflash_rocm.platform import simulate_platform
from test_validation import attention_args, precompute_args

PLATFORMS = (None, "gfx942", "sm_90")  # None: CPU tensors on the CPU platform


def registered() -> list[tuple[str, str]]:
    """(backend, op) for every implementation in the registry (a backend that does not
    import here is listed once per op, to be skipped with its import error)."""
    pairs = []
    for name in registry.NAMES:
        cls = registry.load(name)
        ops = [impl.op.name for impl in cls.implementations] if cls is not None else list(OPS)
        pairs += [(name, op) for op in ops]
    return pairs


def where_it_serves(name: str, op, args: dict):
    """The first platform under which backend ``name`` serves the call, with the reasons
    it gave under each platform tried."""
    reasons = {}
    for arch in PLATFORMS:
        with simulate_platform(arch) if arch else contextlib.nullcontext():
            why = dispatch.reasons_for(name, op, op.build_call(**args))
        if not why:
            return arch, reasons
        reasons[arch or "cpu"] = why
    return False, reasons


def run(op, args: dict, backend: str, arch: str | None):
    with simulate_platform(arch) if arch else contextlib.nullcontext():
        call = op.build_call(**args)
        result = dispatch.planned(op, call, backend)(call)
    return call, result


# The reference itself is held to SPEC's naive loops (test_reference.py): compared with
# itself here it would hold nothing.
AGAINST_THE_REFERENCE = [pair for pair in registered() if pair[0] != "reference"]


@pytest.mark.parametrize("name,op_name", AGAINST_THE_REFERENCE)
def test_every_implementation_agrees_with_the_reference(name, op_name):
    op = OPS[op_name]
    fresh = attention_args() if op_name == "draft_attention" else {**precompute_args(), "return_kv": True}
    arch, reasons = where_it_serves(name, op, fresh)
    if arch is False:
        pytest.skip(f"{name} cannot serve {op_name} here: {reasons}")
    written = {"out": fresh["out"].clone()} if "out" in fresh else {
        k: [c.clone() for c in fresh[k]] for k in ("key_caches", "value_caches")}
    expected = {**fresh, **written}  # the reference writes memory of its own
    call, result = run(op, fresh, name, arch)
    ref_call, ref = run(op, expected, "reference", None)
    tolerance = op.tolerance(call)
    if op_name == "draft_attention":
        assert relative_error(call.out, ref_call.out) <= tolerance
        return
    for got, want in zip(result, ref):
        assert relative_error(got, want) <= tolerance
    for got, want in zip(fresh["key_caches"] + fresh["value_caches"],
                         expected["key_caches"] + expected["value_caches"]):
        assert relative_error(got, want) <= tolerance


def test_the_registry_lists_both_ops_for_the_full_backends():
    pairs = set(registered())
    for name in ("reference", "triton", "rocm", "cpu"):
        assert {(name, op) for op in OPS} <= pairs
    assert ("aiter", "precompute_and_store_context_kv") not in pairs or registry.load("aiter") is None


PRECOMPUTES = [pair for pair in AGAINST_THE_REFERENCE if pair[1] == "precompute_and_store_context_kv"]


@pytest.mark.parametrize("name,op_name", PRECOMPUTES)
@pytest.mark.parametrize("per_layer_norm", [False, True])
def test_every_backends_derived_weights_follow_an_update_into_launches_recorded_before_it(
        name, op_name, per_layer_norm, monkeypatch):
    """The rule for every backend's derived state (fused rows, folded norms, row scales,
    float32 tables): one step's launches recorded, the weights updated in place,
    ``refill_derived()`` (where vLLM's post-load hook calls it), then the recorded launches
    replayed by hand write the new weights' K/V; a call made as if a CUDA graph were being
    captured derives nothing (it would be refused) and writes them too. A backend that
    kept derived state outside :class:`dflash_rocm.derived.DerivedCache` would replay
    stale values or re-derive while capturing."""
    from dflash_rocm import capture, derived, launches
    from dflash_rocm.capture import CaptureSupport
    from dflash_rocm.derived import refill_derived
    from support import refuse_every, replay

    op = OPS[op_name]
    args = precompute_args()
    w = args["weights"]
    g = torch.Generator().manual_seed(7)
    if per_layer_norm:  # Laguna's [L, H] hidden norm, folded into the rows by the backends that fold
        args["weights"] = w = dataclasses.replace(w, hidden_norm_weight=torch.rand(w.num_layers, w.hidden_size,
                                                                                   generator=g) + 0.5)
    arch, reasons = where_it_serves(name, op, args)
    if arch is False:
        pytest.skip(f"{name} cannot serve {op_name} here: {reasons}")
    run(op, args, name, arch)  # the eager step before any capture
    with launches.capture() as recorded:
        run(op, args, name, arch)
    with torch.no_grad():  # what a weight update does, in place
        w.kv_weight.mul_(-1.5)
        w.hidden_norm_weight.add_(0.25)
        w.k_norm_weight.mul_(0.5)
    refill_derived()
    caches = args["key_caches"] + args["value_caches"]
    for c in caches:  # rows the step writes hold the old weights' K/V: zero everything, then compare
        c.zero_()
    expected = {**args, **{k: [c.clone() for c in args[k]] for k in ("key_caches", "value_caches")}}
    run(op, expected, "reference", None)
    replays = {"by hand": lambda: replay(recorded)} if recorded else {}
    replays["in a capture"] = lambda: run(op, args, name, arch)
    with simulate_platform(arch) if arch else contextlib.nullcontext():
        runner = dispatch.planned(op, op.build_call(**args), name).runner  # the kept plan's
    for how, replayed in replays.items():
        for c in caches:
            c.zero_()
        with monkeypatch.context() as m:
            if how == "in a capture" and runner.capture_support is CaptureSupport.NEVER:
                m.setattr(derived, "refuse_in_capture", refuse_every)  # never captured: derives nothing all the same
            elif how == "in a capture":
                m.setattr(capture, "graph_capturing", lambda device: True)
            replayed()
        tolerance = op.tolerance(op.build_call(**args))
        for got, want in zip(caches, expected["key_caches"] + expected["value_caches"]):
            assert relative_error(got, want) <= tolerance, how
