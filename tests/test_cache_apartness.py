"""Written caches are kept apart by memory, never by which objects were passed.

Two layers' writes may share a cache only where they cannot reach the same bytes: caches
over common blocks of one page layout written at different rows (vLLM's hybrid KV-cache
groups). Equal views of one slot mapping, slices of one pool and copies are judged by their
addresses and values, on every backend and through plans, on every call.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dflash_rocm
from checks import bits
from dflash_rocm.platform import simulate_platform
from support import SERVING_HERE
from test_validation import precompute_args
BLOCKS, ROWS, HK, D = 3, 4, 2, 16  # precompute_args' caches: [3, 4, 2, 16] float32, 5 tokens


def shared_cache_args():
    args = precompute_args()
    kc, vc = torch.zeros(BLOCKS, ROWS, HK, D), torch.zeros(BLOCKS, ROWS, HK, D)
    args.update(key_caches=[kc, kc], value_caches=[vc, vc])
    return args


def refused_unwritten(args, backend, match="key_caches"):
    before = [bits(c).clone() for c in args["key_caches"] + args["value_caches"]]
    with simulate_platform("gfx942"), pytest.raises(ValueError, match=match):  # (rocm: a simulated MI300)
        dflash_rocm.precompute_and_store_context_kv(**args, backend=backend)
    assert all(torch.equal(b, bits(c)) for b, c in zip(before, args["key_caches"] + args["value_caches"]))


@pytest.mark.parametrize("backend", SERVING_HERE)
def test_equal_views_of_one_mapping_over_one_cache_are_refused_then_and_later(backend):
    """Two views of one slot mapping are one mapping: layers sharing it and a cache would
    write every slot twice. Refused; and a later call with the mapping object itself is
    refused too (an accepted structure once let it through)."""
    args = shared_cache_args()
    m = torch.tensor([0, 5, -1, 11, 2])
    refused_unwritten({**args, "slot_mapping": [m.view(5), m.view(5)]}, backend)
    refused_unwritten({**args, "slot_mapping": [m, m]}, backend)


@pytest.mark.parametrize("backend", SERVING_HERE)
def test_a_copy_of_one_mapping_over_one_cache_is_refused_by_its_values(backend):
    args = shared_cache_args()
    m = torch.tensor([0, 5, -1, 11, 2])
    refused_unwritten({**args, "slot_mapping": [m, m.clone()]}, backend, match="slot 0 at \\[0\\]")
    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_context_kv(args["weights"], args["key_caches"], args["value_caches"], backend=backend)
    with simulate_platform("gfx942"), pytest.raises(ValueError, match="slot_mapping"):
        plan.run(args["context_states"], args["positions"], [m, torch.tensor([1, 5, -1, -1, -1])])


def test_slices_of_one_pool_are_compared_by_the_rows_they_write():
    """Layers whose caches are block-shifted slices of one pool write the pool's row
    ``slot + shift``: apart when those rows differ, refused when one meets."""
    pool = torch.zeros(BLOCKS + 1, ROWS, HK, D)
    args = precompute_args()
    args.update(key_caches=[pool[:BLOCKS], pool[1:]], value_caches=[torch.zeros(BLOCKS, ROWS, HK, D) for _ in "kv"])
    apart = [torch.tensor([4, 5, -1, -1, -1]), torch.tensor([4, 5, -1, -1, -1])]  # pool rows 4, 5 and 8, 9
    dflash_rocm.precompute_and_store_context_kv(**{**args, "slot_mapping": apart}, backend="reference")
    met = [torch.tensor([4, 5, -1, -1, -1]), torch.tensor([0, -1, -1, -1, -1])]  # pool row 4 twice
    refused_unwritten({**args, "slot_mapping": met}, "reference", match="slot_mapping\\[0\\], slot_mapping\\[1\\]")


# -- the property: refused exactly when two layers' writes can reach the same bytes ------------

POOL_BLOCKS = 5


def cache_kinds():
    """One cache of [BLOCKS, ROWS, HK, D]: its own, a block-aligned slice of a shared pool
    (a fresh slice object, one shared object, or a slice of another storage over the pool's
    memory), a slice shifted by one row, or a copy of a pool slice."""
    return st.one_of(st.just(("own",)), st.tuples(st.just("slice"), st.integers(0, POOL_BLOCKS - BLOCKS)),
                     st.tuples(st.just("object"), st.integers(0, 1)), st.just(("row shifted",)),
                     st.tuples(st.just("other storage"), st.integers(0, POOL_BLOCKS - BLOCKS)),
                     st.just(("copy",)))


def make_cache(kind, pool, objects):
    if kind[0] == "own":
        return torch.zeros(BLOCKS, ROWS, HK, D)
    if kind[0] == "slice":
        return pool[kind[1]:kind[1] + BLOCKS]
    if kind[0] == "other storage":  # a second storage over the pool's memory: only addresses tell
        return torch.from_numpy(pool.numpy())[kind[1]:kind[1] + BLOCKS]
    if kind[0] == "object":
        return objects[kind[1]]
    if kind[0] == "row shifted":
        return pool.view(-1)[HK * D:HK * D + BLOCKS * ROWS * HK * D].view(BLOCKS, ROWS, HK, D)
    return pool[:BLOCKS].clone()


def slot_values():
    """5 distinct slots of [0, BLOCKS * ROWS) or -1, at least one written."""
    return st.lists(st.integers(-1, BLOCKS * ROWS - 1), min_size=5, max_size=5).filter(
        lambda s: max(s) >= 0 and len([v for v in s if v >= 0]) == len({v for v in s if v >= 0}))


def make_mapping(kind, base, table, own):
    return {"object": base, "view": base.view(5), "copy": base.clone(), "row 0": table[0], "row 1": table[1],
            "own": own}[kind]


def written_bytes(cache, mapping) -> set[int]:
    """The addresses of the bytes a layer writes into ``cache`` (rows named by ``mapping``)."""
    rows = set()
    for s in mapping.tolist():
        if s >= 0:
            row = cache[s // ROWS, s % ROWS]
            rows.update(range(row.data_ptr(), row.data_ptr() + row.numel() * row.element_size()))
    return rows


@given(data=st.data(), layers=st.integers(2, 3), backend=st.sampled_from(["reference", "cpu"]),
       planned=st.booleans())
def test_refused_exactly_when_two_layers_writes_can_reach_the_same_bytes(data, layers, backend, planned):
    args = precompute_args(L=layers)
    pool = torch.zeros(POOL_BLOCKS, ROWS, HK, D)
    objects = [pool[:BLOCKS], pool[1:BLOCKS + 1]]
    base = torch.tensor(data.draw(slot_values()))
    table = torch.tensor([data.draw(slot_values()), data.draw(slot_values())])
    mapping_kinds = st.sampled_from(["object", "view", "copy", "row 0", "row 1", "own"])
    slots = [make_mapping(data.draw(mapping_kinds), base, table, torch.tensor(data.draw(slot_values())))
             for _ in range(layers)]
    kcs = [make_cache(data.draw(cache_kinds()), pool, objects) for _ in range(layers)]
    vcs = [make_cache(data.draw(cache_kinds()), pool, objects) for _ in range(layers)]
    footprints = [written_bytes(c, s) for c, s in zip(kcs, slots)] + [written_bytes(c, s) for c, s in zip(vcs, slots)]
    meet = any(footprints[i] & footprints[j] for i in range(len(footprints)) for j in range(i + 1, len(footprints)))
    before = [bits(c).clone() for c in kcs + vcs]
    try:
        if planned:
            dflash_rocm.plan_context_kv(args["weights"], kcs, vcs, backend=backend).run(
                args["context_states"], args["positions"], slots)
        else:
            dflash_rocm.precompute_and_store_context_kv(**{**args, "key_caches": kcs, "value_caches": vcs,
                                                           "slot_mapping": slots}, backend=backend)
    except ValueError:
        assert meet, "refused, though no two layers' writes reach one byte"
        assert all(torch.equal(b, bits(c)) for b, c in zip(before, kcs + vcs)), "refused after writing"
        return
    assert not meet, "served, though two layers' writes reach one byte"
