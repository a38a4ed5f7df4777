"""Every registered implementation of every op against the reference (xformers' way:
the test enumerates the registry, and an implementation that cannot run here is skipped
with its own reasons).

Each implementation runs where some platform this machine can present serves it: CPU
tensors as they are, then under a simulated AMD and NVIDIA platform (named backends run
simulated platforms' code paths on CPU tensors, through the Triton interpreter).
"""

import contextlib

import pytest

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


@pytest.mark.parametrize("name,op_name", registered())
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
