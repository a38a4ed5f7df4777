"""The plans: ``plan_draft_attention`` (one batch, every layer) and ``plan_context_kv`` (one
model's caches, every step), each run checked against the reference."""

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dflash_rocm
from checks import check_attention, check_precompute, clone_arg, poison, rel_err
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.contract import spec_tolerance as tolerance
from dflash_rocm.paged import PackedCache
from dflash_rocm.platform import simulate_platform
from strategies import CPU_SIZES, PACKINGS, attention_cases, make_generator, plan_copies, precompute_cases
from support import needs_interpreter
from test_validation import attention_args, precompute_args

BACKENDS = ["reference", "cpu", pytest.param("triton", marks=needs_interpreter),
            pytest.param("rocm", marks=needs_interpreter)]


def another_like(t, g):
    """A tensor laid out exactly as ``t`` (shape, strides, dtype, device) with other values:
    the next layer's tensor."""
    if isinstance(t, PackedCache):
        return PackedCache(another_like(t.view, g))
    new = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
    values = torch.randn(new.shape, generator=g, device=t.device)
    new.copy_(values if t.dtype.is_floating_point else values.to(t.dtype))
    return new


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_every_layer_run_from_one_plan_matches_the_reference(backend, data):
    packings = ("plain",) if backend == "cpu" else PACKINGS  # cpu reads strided pages only
    case = data.draw(attention_cases(CPU_SIZES, packings=packings))
    query, key_cache, value_cache, *batch = case.args
    kwargs = dict(case.kwargs)
    kwargs.pop("out", None)
    g = make_generator(data.draw(st.integers(0, 2 ** 31 - 1)), "cpu")
    fp8 = key_cache.dtype in FP8_DTYPES
    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_draft_attention(query, key_cache, value_cache, *batch, **kwargs, backend=backend)
        layers = [(query, key_cache, value_cache, kwargs["sinks"], None, None)]
        for scale in (0.5, 0.25):  # two more layers: new tensors, same layout
            sinks = kwargs["sinks"]
            layers.append((another_like(query, g), another_like(key_cache, g), another_like(value_cache, g),
                           None if sinks is None else another_like(sinks, g),
                           torch.tensor([scale]) if fp8 else None, torch.tensor(2 * scale) if fp8 else None))
        for q, kc, vc, sinks, k_scale, v_scale in layers:
            out = torch.empty_like(q)
            poison(out)
            assert plan.run(q, kc, vc, out=out, sinks=sinks, k_scale=k_scale, v_scale=v_scale) is out
            ref_kwargs = dict(kwargs, sinks=clone_arg(sinks) if sinks is not None else kwargs["sinks"])
            if k_scale is not None:
                ref_kwargs.update(k_scale=float(k_scale), v_scale=float(v_scale))
            ref = dflash_rocm.draft_attention(*clone_arg((q, kc, vc, *batch)), **ref_kwargs, backend="reference")
            if out.numel():
                err = rel_err(out, ref)
                assert err <= tolerance(q.dtype, kc.dtype), f"{backend}: rel err {err:.2e} for {case.description}"


@pytest.mark.parametrize("name,change", [
    ("query", lambda a: a["query"][:, :, :8]),
    ("query", lambda a: a["query"].transpose(0, 1).contiguous().transpose(0, 1)),
    ("key_cache", lambda a: a["key_cache"].half()),
    ("value_cache", lambda a: torch.zeros(9, 4, 2, 16)),
    ("out", lambda a: torch.zeros(6, 4, 16).transpose(0, 1).contiguous().transpose(0, 1)),
])
def test_a_tensor_not_laid_out_as_planned_is_refused_before_anything_is_written(name, change):
    a = attention_args()
    plan = dflash_rocm.plan_draft_attention(**a, backend="reference")
    run = dict(query=a["query"], key_cache=a["key_cache"], value_cache=a["value_cache"], out=a["out"].clone())
    run[name] = change(a)
    before = run["out"].clone()
    with pytest.raises(dflash_rocm.PlanMismatch, match=name):
        plan.run(**run)
    assert torch.equal(run["out"], before)


def test_an_out_that_shares_memory_with_the_query_is_refused():
    a = attention_args()
    plan = dflash_rocm.plan_draft_attention(**a, backend="reference")
    q = a["query"].clone()
    with pytest.raises(ValueError, match="out: shares memory with query"):
        plan.run(q, a["key_cache"], a["value_cache"], out=q)


def test_scales_are_value_checked_when_the_plan_validates():
    a = attention_args()
    kc, vc = a["key_cache"].to(torch.float8_e4m3fn), a["value_cache"].to(torch.float8_e4m3fn)
    a.update(key_cache=kc, value_cache=vc, query=a["query"], k_scale=0.5, v_scale=0.5)
    plan = dflash_rocm.plan_draft_attention(**a, backend="reference")
    with pytest.raises(ValueError, match="k_scale: expected positive finite"):
        plan.run(a["query"], kc, vc, k_scale=torch.tensor([-1.0]))
    unchecked = dflash_rocm.plan_draft_attention(**a, backend="reference", validate=False)
    unchecked.run(a["query"], kc, vc, k_scale=torch.tensor([2.0]))  # the caller vouched for its values


def test_runs_are_counted_for_the_planned_backend():
    a = attention_args()
    dflash_rocm.reset_dispatch_counts()
    plan = dflash_rocm.plan_draft_attention(**a)
    assert plan.backend == "cpu"  # auto on CPU tensors
    for _ in range(3):
        plan.run(a["query"], a["key_cache"], a["value_cache"])
    assert dflash_rocm.dispatch_counts() == {("draft_attention", "cpu"): 3}


def test_the_vllm_plugin_plans_once_per_step_and_anew_for_new_batch_tensors():
    from types import SimpleNamespace

    from dflash_rocm.vllm_plugin.attention import _StepPlans

    step_plans, made = _StepPlans(), []

    def make():
        made.append(object())
        return made[-1]

    def batch():
        return SimpleNamespace(block_table=torch.zeros(1, 1), query_start_loc=torch.zeros(2), seq_lens=torch.zeros(1))

    metadata = batch()
    first = [step_plans.plan(metadata, ("non-causal",), make) for _ in range(5)]  # five draft layers
    assert len(made) == 1 and all(p is made[0] for p in first)
    assert step_plans.plan(metadata, ("causal",), make) is made[1]  # another kind of layer: its own plan
    metadata.seq_lens = torch.zeros(1)  # the same metadata object with a new batch: a new step
    assert step_plans.plan(metadata, ("non-causal",), make) is made[2]
    assert step_plans.plan(batch(), ("non-causal",), make) is made[3]


PRECOMPUTE_BACKENDS = ["reference", "cpu", pytest.param("triton", marks=needs_interpreter),
                       pytest.param("rocm", marks=needs_interpreter)]


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS)
@given(data=st.data())
def test_every_step_run_from_one_precompute_plan_matches_the_reference(backend, data):
    packings = ("plain",) if backend == "cpu" else PACKINGS
    case = data.draw(precompute_cases(CPU_SIZES, packings=packings))
    states, positions, weights, key_caches, value_caches, slot_mapping = case.args
    kwargs = dict(case.kwargs)
    return_kv = kwargs.pop("return_kv", False)
    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_context_kv(weights, key_caches, value_caches, **kwargs, backend=backend)
        g = make_generator(data.draw(st.integers(0, 2 ** 31 - 1)), "cpu")
        step = case
        for _ in range(2):  # the planned step, then the next one: new states and positions, same caches
            args = step.args
            check_precompute(step, backend, run=lambda call, a=args: plan.run(a[0], a[1], a[5], return_kv=return_kv))
            new_states = another_like(states, g)
            new_positions = torch.randint(0, weights.max_position, positions.shape, generator=g).to(positions.dtype)
            step = dataclasses.replace(case, args=(new_states, new_positions, *args[2:]))


def test_a_precompute_plan_keeps_its_caches_when_the_callers_list_changes():
    p = precompute_args()
    key_caches, value_caches = list(p["key_caches"]), list(p["value_caches"])
    plan = dflash_rocm.plan_context_kv(p["weights"], key_caches, value_caches, backend="reference")
    planned = [c.clone() for c in p["key_caches"]]
    key_caches[0] = torch.zeros_like(key_caches[0])  # the caller reuses its list
    plan.run(p["context_states"], p["positions"], p["slot_mapping"])
    assert torch.equal(key_caches[0], torch.zeros_like(key_caches[0]))
    assert not torch.equal(p["key_caches"][0], planned[0])  # the planned cache was written


def test_a_plan_reads_the_planning_variables_when_it_is_made(monkeypatch):
    """Both plans read ``DFLASH_ROCM_*`` once, when made: a variable set later reaches the
    plans made after it, not a plan already made; a plan's
    runs never look the environment up."""
    monkeypatch.delenv("DFLASH_ROCM_BACKEND", raising=False)
    p = precompute_args()
    run = (p["context_states"], p["positions"], p["slot_mapping"])
    before = dflash_rocm.plan_context_kv(p["weights"], p["key_caches"], p["value_caches"])
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "reference")
    after = dflash_rocm.plan_context_kv(p["weights"], p["key_caches"], p["value_caches"])
    dflash_rocm.reset_dispatch_counts()
    reads = []
    monkeypatch.setattr(dflash_rocm.planning, "environment", lambda: reads.append("read"))
    before.run(*run)
    after.run(*run)
    assert reads == []
    counts = dflash_rocm.dispatch_counts()
    assert counts.get(("precompute_and_store_context_kv", "reference")) == 1 and sum(counts.values()) == 2


def test_a_precompute_plan_refuses_states_that_share_memory_with_a_cache():
    p = precompute_args()
    plan = dflash_rocm.plan_context_kv(p["weights"], p["key_caches"], p["value_caches"], backend="reference")
    cache = p["key_caches"][1]
    states = cache.view(-1)[:p["context_states"].numel()].view_as(p["context_states"])
    with pytest.raises(ValueError, match="shares memory with context_states"):
        plan.run(states, p["positions"], p["slot_mapping"])


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS)
@given(data=st.data())
def test_a_plan_refuses_to_be_copied_or_pickled_and_the_original_keeps_serving(backend, data):
    """A plan is bound to its tensors' memory: a deep copy wrote the original's caches
    (its key holds their addresses), and some backends' plans could not be pickled at all."""
    case = data.draw(precompute_cases(CPU_SIZES))
    states, positions, weights, key_caches, value_caches, slot_mapping = case.args
    kwargs = dict(case.kwargs)
    return_kv = kwargs.pop("return_kv")
    attention = data.draw(attention_cases(CPU_SIZES))
    with simulate_platform("gfx942"):
        precompute_plan = dflash_rocm.plan_context_kv(weights, key_caches, value_caches, **kwargs, backend=backend)
        attention_plan = dflash_rocm.plan_draft_attention(*attention.args, **attention.kwargs, backend=backend)
        for plan in (precompute_plan, attention_plan):
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                data.draw(plan_copies())(plan)
        check_precompute(case, backend, run=lambda call: precompute_plan.run(states, positions, slot_mapping,
                                                                             return_kv=return_kv))
        query, key_cache, value_cache = attention.args[:3]
        check_attention(attention, backend, run=lambda call: attention_plan.run(query, key_cache, value_cache,
                                                                                out=call.out))


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_a_plan_reads_the_batch_written_into_its_tensors_strided_or_not(backend, data):
    """The next batch written in place into the planned block table, sequence lengths and
    sinks (within the planned bounds) is what the next run attends over, whether those
    tensors are contiguous or strided views (which validation copies)."""
    # index tensors contiguous, padded or column-major; the new batch may read any row, so none is poisoned
    case = data.draw(attention_cases(CPU_SIZES, invisible_fills=(None,)))
    query, key_cache, value_cache, block_table, _, seq_lens = case.args
    g = make_generator(data.draw(st.integers(0, 2 ** 31 - 1)), "cpu")
    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_draft_attention(*case.args, **case.kwargs, backend=backend)
        block_table.copy_(torch.randint(0, key_cache.shape[0], block_table.shape, generator=g))
        shorter = [q + int(torch.randint(0, s - q + 1, (), generator=g)) for q, s in zip(case.q_lens, case.seq_lens)]
        seq_lens.copy_(torch.tensor(shorter))
        if case.kwargs["sinks"] is not None:
            case.kwargs["sinks"].copy_(torch.randn(case.kwargs["sinks"].shape, generator=g))
        check_attention(case, backend, run=lambda call: plan.run(query, key_cache, value_cache, out=call.out))


@pytest.mark.parametrize("backend,arch", [("cpu", None), pytest.param("rocm", "gfx942", marks=needs_interpreter)])
def test_eager_steps_whose_max_seq_len_differs_share_one_plan(backend, arch):
    """vLLM 0.34 hands each eager step its own ``max_seq_len``: the plan is keyed by its
    bucket (the next power of two, at most the block table's capacity), so steps with
    maxima 130-256 share one plan, each reading its exact lengths from ``seq_lens`` (it
    matches the reference), and a longer one gets its own."""
    from dflash_rocm.ops.attention.call import seq_len_bucket
    from dflash_rocm.workloads import DraftShape, attention_inputs

    shape = DraftShape("eager", hidden=64, layers=1, q_heads=4, kv_heads=2, head_dim=16, block_tokens=4)
    inputs = attention_inputs(shape, 2, 400, torch.float32, torch.float32, torch.device("cpu"))
    capacity = inputs.block_table.shape[1] * inputs.key_cache.shape[1]
    assert 257 < capacity < 512
    buckets = [seq_len_bucket(n, capacity) for n in (0, 5, 17, 130, 256, 257)]
    assert buckets == [16, 16, 32, 256, 256, capacity]
    plans = []
    with simulate_platform(arch) if arch else contextlib.nullcontext():
        for longest in (130, 200, 256, 300):
            inputs.seq_lens.copy_(torch.tensor([longest - 7, longest]))
            kwargs = {**inputs.kwargs, "max_seq_len": longest}
            plan = dflash_rocm.plan_draft_attention(*inputs.args(), **kwargs, backend=backend, validate=False)
            out = plan.run(inputs.query, inputs.key_cache, inputs.value_cache)
            ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
            assert rel_err(out, ref) <= 2e-3, longest
            plans.append(plan._plan)
    assert plans[0] is plans[1] is plans[2] and plans[3] is not plans[0]
