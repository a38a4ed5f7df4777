"""fp8 scales in every form callers pass them (floats, one tensor, a list or tuple of
one-element tensors) are read at every call, direct or planned: new values written into
a tensor are used, and a zero or NaN one is refused before anything is written."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dflash_rocm
from checks import bits, check_attention, check_precompute
from dflash_rocm.contract import FP8_DTYPES
from dflash_rocm.platform import simulate_platform
from strategies import CPU_SIZES, attention_cases, precompute_cases, scale_forms
from support import SERVING_HERE

VALUES = st.sampled_from([0.25, 0.5, 1.0, 2.0])
BAD = st.sampled_from([0.0, -1.0, float("nan"), float("inf")])


def forms_for(data, planned: bool):
    """K and V scale forms; a plan holds tensors (floats are planned as values)."""
    kinds = ("tensor", "tensors") if planned else ("floats", "tensor", "tensors")
    return [data.draw(scale_forms(kinds)) for _ in range(2)]


def refused_form(data, forms) -> int | None:
    """K (0) or V (1): a form whose tensor can take a bad value in place; None if only floats."""
    tensors = [i for i, form in enumerate(forms) if form.kind != "floats"]
    return data.draw(st.sampled_from(tensors)) if tensors else None


@pytest.mark.parametrize("backend", SERVING_HERE)
@given(data=st.data())
def test_attention_reads_its_scales_at_every_call(backend, data):
    case = data.draw(attention_cases(CPU_SIZES, cache_dtypes=FP8_DTYPES))
    planned = data.draw(st.booleans())
    forms = forms_for(data, planned)
    scales = [form.make([1.0], "cpu") for form in forms]
    query, key_cache, value_cache = case.args[:3]

    def kwargs(k, v):
        return {**case.kwargs, "k_scale": k, "v_scale": v}

    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_draft_attention(*case.args, **kwargs(*scales), backend=backend) if planned else None

        def run(out):
            if plan is not None:
                return plan.run(query, key_cache, value_cache, out=out)  # the planned tensors, read again
            return dflash_rocm.draft_attention(*case.args, **{**kwargs(*scales), "out": out}, backend=backend)

        for _ in range(2):
            values = data.draw(VALUES), data.draw(VALUES)
            scales = [form.update(arg, [x]) for form, arg, x in zip(forms, scales, values)]
            check_attention(dataclasses.replace(case, kwargs=kwargs(*values)), backend, run=lambda call: run(call.out))
        which = refused_form(data, forms)
        if which is None:
            return
        scales[which] = forms[which].update(scales[which], [data.draw(BAD)])
        given_out = case.kwargs.get("out")  # laid out as the planned out
        out = (torch.empty_like(query) if given_out is None else
               torch.empty_strided(given_out.shape, given_out.stride(), dtype=query.dtype)).zero_()
        with pytest.raises(ValueError, match=("k_scale", "v_scale")[which]):
            run(out)
        assert not out.any(), "out was written before the refusal"


@pytest.mark.parametrize("backend", SERVING_HERE)
@given(data=st.data())
def test_the_precompute_reads_its_scales_at_every_call(backend, data):
    case = data.draw(precompute_cases(CPU_SIZES, cache_dtypes=FP8_DTYPES))
    states, positions, weights, key_caches, value_caches, slot_mapping = case.args
    L = weights.num_layers
    planned = data.draw(st.booleans())
    forms = forms_for(data, planned)
    scales = [form.make([1.0] * L, "cpu") for form in forms]
    layers = st.lists(VALUES, min_size=L, max_size=L)

    def kwargs(k, v):
        return {**case.kwargs, "k_scales": k, "v_scales": v}

    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_context_kv(weights, key_caches, value_caches, k_scales=scales[0],
                                           v_scales=scales[1], backend=backend) if planned else None

        def run():
            if plan is not None:
                return plan.run(states, positions, slot_mapping, return_kv=case.kwargs["return_kv"])
            return dflash_rocm.precompute_and_store_context_kv(*case.args, **kwargs(*scales), backend=backend)

        for _ in range(2):
            values = data.draw(layers), data.draw(layers)
            scales = [form.update(arg, x) for form, arg, x in zip(forms, scales, values)]
            check_precompute(dataclasses.replace(case, kwargs=kwargs(*values)), backend, run=lambda call: run())
        which = refused_form(data, forms)
        if which is None or all(s is None for s in case.slot_mappings):  # nothing written: no scale is read
            return
        bad = data.draw(layers)
        bad[data.draw(st.integers(0, L - 1))] = data.draw(BAD)
        scales[which] = forms[which].update(scales[which], bad)
        caches = list(key_caches) + list(value_caches)
        before = [bits(c).clone() for c in caches]
        with pytest.raises(ValueError, match=("k_scales", "v_scales")[which]):
            run()
        assert all(torch.equal(b, bits(c)) for b, c in zip(before, caches)), "a cache was written before the refusal"
