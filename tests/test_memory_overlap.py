"""A tensor a call writes shares memory with nothing the call reads, judged by addresses:
two storages over one buffer (numpy views, ``torch.frombuffer``) overlap as surely as two
views of one storage. Every such call is refused before anything is written."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import dflash_rocm
from checks import bits
from dflash_rocm.ops.precompute.validation import row_offset
from dflash_rocm.platform import simulate_platform
from strategies import CPU_SIZES, attention_cases, overlapping, precompute_cases
from support import SERVING_HERE

ATTENTION_READS = ["query", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens", "sinks",
                   "k_scale"]
PRECOMPUTE_READS = ["context_states", "positions", "slot_mapping", "k_scales", "other cache"]


def refused_unchanged(call, tensors, needle):
    before = [bits(t).clone() for t in tensors]
    with simulate_platform("gfx942"), pytest.raises(ValueError, match=needle):
        call()
    assert all(torch.equal(b, bits(t)) for b, t in zip(before, tensors)), "written before the refusal"


@pytest.mark.parametrize("backend", SERVING_HERE)
@pytest.mark.parametrize("read", ATTENTION_READS)
@given(data=st.data())
def test_an_out_over_memory_the_attention_reads_is_refused(backend, read, data):
    case = data.draw(attention_cases(CPU_SIZES, packings=("plain",)))
    names = ["query", "key_cache", "value_cache", "block_table", "query_start_loc", "seq_lens"]
    args = dict(zip(names, case.args))
    kwargs = {k: v for k, v in case.kwargs.items() if k != "out"}
    if read == "k_scale":
        assume(args["key_cache"].dtype not in (torch.float16, torch.bfloat16, torch.float32))
        kwargs["k_scale"] = torch.tensor([kwargs["k_scale"]])
    read_tensor = args.get(read, kwargs.get(read))
    assume(read_tensor is not None and read_tensor.numel() and case.query.numel())
    read_tensor, out = data.draw(overlapping(read_tensor, case.query))
    (args if read in args else kwargs)[read] = read_tensor
    refused_unchanged(lambda: dflash_rocm.draft_attention(**args, **kwargs, out=out, backend=backend),
                      [read_tensor, out], f"out: shares memory with {read}")


@pytest.mark.parametrize("backend", SERVING_HERE)
@pytest.mark.parametrize("read", PRECOMPUTE_READS)
@given(data=st.data())
def test_a_written_cache_over_memory_the_precompute_reads_is_refused(backend, read, data):
    case = data.draw(precompute_cases(CPU_SIZES))
    states, positions, weights, key_caches, value_caches, slot_mapping = case.args
    layer = next((i for i, s in enumerate(case.slot_mappings) if s is not None), None)
    assume(layer is not None)
    key_caches, value_caches = list(key_caches), list(value_caches)
    args = dict(context_states=states, positions=positions, slot_mapping=slot_mapping)
    kwargs = dict(case.kwargs)
    if read == "k_scales":
        assume(kwargs["k_scales"] is not None)
        kwargs["k_scales"] = torch.tensor(kwargs["k_scales"])
    cache = data.draw(st.sampled_from([key_caches, value_caches]))
    if read == "other cache":  # K over V, or V over K, of one layer: two storages, one buffer
        other = value_caches if cache is key_caches else key_caches
        other[layer], cache[layer] = data.draw(overlapping(other[layer], cache[layer]))
        # views of one page layout whole rows apart are judged by the rows written (test_cache_apartness)
        assume(row_offset(other[layer], cache[layer]) is None)
        written, needle = [other[layer], cache[layer]], "shares memory with"
    elif read == "slot_mapping" and not isinstance(slot_mapping, torch.Tensor):  # per-layer: the written layer's
        mappings = list(slot_mapping)
        mappings[layer], cache[layer] = data.draw(overlapping(mappings[layer], cache[layer]))
        args["slot_mapping"] = mappings
        written = [mappings[layer], cache[layer]]
        needle = f"a written cache: shares memory with slot_mapping\\[{layer}\\]"
    else:
        source = args if read in args else kwargs
        source[read], cache[layer] = data.draw(overlapping(source[read], cache[layer]))
        written, needle = [source[read], cache[layer]], f"a written cache: shares memory with {read}"
    refused_unchanged(lambda: dflash_rocm.precompute_and_store_context_kv(
        weights=weights, key_caches=key_caches, value_caches=value_caches, **args, **kwargs, backend=backend),
        written, needle)


def test_separate_buffers_in_one_numpy_array_are_accepted():
    """Overlap is judged by memory, not by storage: neighbouring, disjoint views of one numpy
    buffer (each its own storage) are served."""
    import numpy as np

    from test_validation import attention_args

    args = attention_args()
    q = args["query"]
    buffer = np.zeros(2 * q.numel(), dtype=np.float32)
    query = torch.from_numpy(buffer[:q.numel()]).view(q.shape)
    out = torch.from_numpy(buffer[q.numel():]).view(q.shape)
    query.copy_(q)
    want = dflash_rocm.draft_attention(**{**args, "out": None}, backend="reference")
    dflash_rocm.draft_attention(**{**args, "query": query, "out": out}, backend="reference")
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", SERVING_HERE)
def test_a_plan_run_whose_out_holds_the_planned_sinks_is_refused(backend):
    from test_validation import attention_args

    args = attention_args()
    out = torch.zeros(args["query"].shape)
    sinks = out[0, 0, :4]  # the planned sinks live in the first row of the run's out
    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_draft_attention(**{**args, "out": None, "sinks": sinks.clone()}, backend=backend)
        plan_with_sinks_in_out = dflash_rocm.plan_draft_attention(**{**args, "out": None, "sinks": sinks},
                                                                  backend=backend)
        plan.run(args["query"], args["key_cache"], args["value_cache"], out=out)  # its own sinks: served
    refused_unchanged(lambda: plan_with_sinks_in_out.run(args["query"], args["key_cache"], args["value_cache"],
                                                         out=out), [out], "out: shares memory with sinks")
