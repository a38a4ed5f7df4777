"""Derived weight layouts follow their sources: in-place updates, rebinding, reused addresses."""

import pytest
import torch

import dflash_rocm
from checks import rel_err
from dflash_rocm.derived import DerivedCache
from strategies import make_generator, make_weights
from dflash_rocm.platform import simulate_platform
from support import SERVING_HERE, needs_interpreter


def test_a_cached_value_is_rebuilt_when_a_source_changes_in_place():
    cache, builds = DerivedCache(), []
    a, b = torch.ones(4), torch.zeros(2)

    def build():
        builds.append(1)
        return a.sum().item()

    assert cache.get((a, b, None), "t", build) == 4.0
    assert cache.get((a, b, None), "t", build) == 4.0 and len(builds) == 1
    a.mul_(2)  # in place: the version counter moves
    assert cache.get((a, b, None), "t", build) == 8.0 and len(builds) == 2
    assert cache.get((a, b, None), "other tag", build) == 8.0 and len(builds) == 3


def test_an_in_place_update_refills_the_derived_tensors_at_their_addresses():
    """A CUDA graph captured with a derived buffer reads that address on every replay:
    an in-place update of the sources must land there, not in a new tensor."""
    cache = DerivedCache()
    a = torch.ones(4)
    first = cache.get((a,), "t", lambda: (a * 2, a.sum().reshape(1), 3))
    a.mul_(5)
    second = cache.get((a,), "t", lambda: (a * 2, a.sum().reshape(1), 3))
    assert second is first
    assert torch.equal(second[0], torch.full((4,), 10.0)) and second[1].item() == 20.0


def test_a_derived_value_whose_structure_changed_is_replaced_not_refilled():
    cache = DerivedCache()
    a = torch.ones(4)
    first = cache.get((a,), "t", lambda: a[: int(a[0])].clone())
    a.fill_(2.0)
    second = cache.get((a,), "t", lambda: a[: int(a[0])].clone())
    assert second is not first and second.shape == (2,) and first.shape == (1,)
    rebound = torch.ones(4)  # another tensor: never refills the first one's value
    third = cache.get((rebound,), "t", lambda: rebound[:1].clone())
    assert third is not second and torch.equal(second, torch.full((2,), 2.0))


def test_a_dead_sources_address_is_never_mistaken_for_a_new_tensor(monkeypatch):
    """CPython reuses ids and the allocator reuses addresses: a new tensor can carry a dead
    one's (id, address, version). Simulate exactly that collision; the weak reference
    to the original source must refuse the stale entry."""
    from dflash_rocm import derived

    monkeypatch.setattr(derived, "_fingerprint", lambda t: (None,) if t is None else ("same",))
    cache = DerivedCache()
    first = torch.ones(4)
    assert cache.get((first,), "t", lambda: "first") == "first"
    assert cache.get((first,), "t", lambda: "rebuilt") == "first"  # alive and unchanged: reused
    del first
    second = torch.full((4,), 3.0)
    assert cache.get((second,), "t", lambda: "second") == "second"


def test_the_cache_is_bounded():
    cache = DerivedCache(capacity=2)
    tensors = [torch.ones(1) for _ in range(5)]
    for i, t in enumerate(tensors):
        cache.get((t,), "t", lambda i=i: i)
    assert len(cache._entries) == 2


@needs_interpreter
def test_triton_precompute_follows_weights_updated_in_place():
    g = make_generator(3, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=True, bias=True, v_scale=None,
                     dtype=torch.float32, max_position=64)
    states, positions = torch.randn(5, 24, generator=g), torch.arange(5)

    def run(backend):
        return dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                           return_kv=True, backend=backend)

    run("triton")
    with torch.no_grad():  # what RL frameworks do when they sync weights into a running server
        w.kv_weight.mul_(-1.5)
        w.hidden_norm_weight.add_(0.25)
        w.k_norm_weight.mul_(0.5)
        w.kv_bias.add_(1.0)
    k, v = run("triton")
    rk, rv = run("reference")
    assert rel_err(k, rk) < 2e-3 and rel_err(v, rv) < 2e-3


@pytest.mark.parametrize("source", ["kv_weight", "hidden_norm_weight", "kv_bias", "k_norm_weight", "cos_sin_cache"])
def test_a_kept_precompute_plan_sees_an_in_place_update_of_each_source(source):
    """The plan checks its derived weights by their sources' versions: an in-place write to
    any one of them (a reload's refill) reaches the next call through the same plan."""
    g = make_generator(5, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=True, bias=True, v_scale=None,
                     dtype=torch.float32, max_position=64)
    states, positions = torch.randn(5, 24, generator=g), torch.arange(5)
    plan = dflash_rocm.plan_context_kv(w, None, None, backend="triton")
    plan.run(states, positions, None, return_kv=True)
    with torch.no_grad():
        getattr(w, source).mul_(-0.75)
    k, v = plan.run(states, positions, None, return_kv=True)
    rk, rv = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                         backend="reference")
    assert rel_err(k, rk) < 2e-3 and rel_err(v, rv) < 2e-3


@needs_interpreter
def test_triton_fused_weights_keep_their_addresses_across_an_in_place_update():
    from dflash_rocm.backends.triton.precompute import _fuse, fused_weights
    g = make_generator(4, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=1, D=16, H=24, R=16, is_neox=False, bias=True, v_scale=None,
                     dtype=torch.float32, max_position=64)
    before = fused_weights(w)
    addresses = (before.weight.data_ptr(), before.bias.data_ptr(), before.k_norm.data_ptr())
    with torch.no_grad():
        w.kv_weight.mul_(-2.0)
    after = fused_weights(w)
    assert (after.weight.data_ptr(), after.bias.data_ptr(), after.k_norm.data_ptr()) == addresses
    fresh = _fuse(w)
    assert torch.equal(after.weight, fresh.weight) and torch.equal(after.bias, fresh.bias)


@pytest.mark.parametrize("backend", SERVING_HERE)
@pytest.mark.parametrize("source", ["kv_weight", "k_norm_weight", "cos_sin_cache"])
def test_weights_resized_in_place_are_refused_by_name_and_never_stop_another_models_refill(backend, source, caplog):
    """Calls with weights whose tensor was resized after they were built are refused naming
    it, before any write (a plan too); refill_derived() drops their derived layouts with a
    warning and still refills another model's in-place update (rocm: a simulated MI300)."""
    with simulate_platform("gfx942"):
        resized_weights_case(backend, source, caplog)


def resized_weights_case(backend, source, caplog):
    g = make_generator(3, "cpu")
    resized, other = (make_weights(g, "cpu", L=2, Hk=2, D=16, H=24, R=16, is_neox=True, bias=False, v_scale=None,
                                   dtype=torch.float32, max_position=64) for _ in range(2))
    states, positions, slots = torch.randn(5, 24, generator=g), torch.arange(5), torch.tensor([0, 5, -1, 11, 2])
    caches = [[torch.zeros(3, 4, 2, 16) for _ in range(2)] for _ in range(2)]
    plans = [dflash_rocm.plan_context_kv(w, *caches, backend=backend) for w in (resized, other)]
    for plan in plans:
        plan.run(states, positions, slots)
    tensor = getattr(resized, source)
    tensor.resize_(tensor.shape[0] - 1, *tensor.shape[1:])
    other.kv_weight.mul_(2)
    with caplog.at_level("WARNING", logger="dflash_rocm"):
        dflash_rocm.refill_derived()
    if backend != "reference":  # (the reference derives nothing)
        assert f"ContextKVWeights.{source}: resized in place" in caplog.text
    want = dflash_rocm.precompute_and_store_context_kv(states, positions, other, None, None, None, return_kv=True,
                                                       backend="reference")
    got = plans[1].run(states, positions, None, return_kv=True)
    assert rel_err(got[0], want[0]) < 1e-5 and rel_err(got[1], want[1]) < 1e-5
    before = [c.clone() for c in caches[0]]
    with pytest.raises(ValueError, match=f"ContextKVWeights.{source}: resized in place"):
        dflash_rocm.precompute_and_store_context_kv(states, positions, resized, *caches[0], slots, backend=backend)
    with pytest.raises(ValueError, match=f"ContextKVWeights.{source}: resized in place"):
        plans[0].run(states, positions, slots)
    assert all(torch.equal(b, c) for b, c in zip(before, caches[0]))
