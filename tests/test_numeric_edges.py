"""Numeric edges of the inputs: a hidden-norm weight that overflows float16 once folded
into the K/V weight, and bfloat16 values at and below the smallest normal (SPEC.md,
"Subnormal bfloat16 inputs")."""

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch

import dflash_rocm
from dflash_rocm.contract import TOLERANCES, relative_error
from dflash_rocm.ops.precompute import precompute_call
from dflash_rocm.platform import simulate_platform
from strategies import make_generator, make_weights
from support import needs_interpreter

BACKENDS = ["reference", "cpu", pytest.param("triton", marks=needs_interpreter),
            pytest.param("rocm", marks=needs_interpreter)]
SMALLEST_NORMAL = torch.finfo(torch.bfloat16).tiny  # 2**-126


def serve(fn, backend, *args, **kwargs):
    if backend == "rocm":
        with simulate_platform("gfx942"):
            return fn(*args, **kwargs, backend=backend)
    return fn(*args, **kwargs, backend=backend)


def large_norm_case(seed=3):
    """float16 weights whose hidden-norm column 3 (3e4) times its weight column (4) is
    1.2e5, past float16's 65504, while the states carry little in that column: the
    projected K/V stay in range (|v| about 10^2)."""
    g = make_generator(seed, "cpu")
    H = 64
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=H, R=16, is_neox=True, bias=True, v_scale=None,
                     dtype=torch.float16)
    norm, kv = w.hidden_norm_weight.clone(), w.kv_weight.clone()
    norm[3], kv[:, 3] = 3e4, 4.0
    states = torch.randn(9, H, generator=g).half()
    states[:, 3] = 1e-3
    return replace(w, hidden_norm_weight=norm, kv_weight=kv), states, torch.randint(0, 4096, (9,), generator=g)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_norm_weight_that_overflows_float16_once_folded_gives_finite_keys(backend):
    w, states, positions = large_norm_case()
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                               return_kv=True, backend="reference")
    k, v = serve(dflash_rocm.precompute_and_store_context_kv, backend, states, positions, w, None, None, None,
                 return_kv=True)
    assert torch.isfinite(ref_k).all() and torch.isfinite(ref_v).all()
    assert relative_error(k, ref_k) < TOLERANCES[torch.float16]
    assert relative_error(v, ref_v) < TOLERANCES[torch.float16]


@needs_interpreter
@pytest.mark.parametrize("split_k,heads,deterministic", [(1, 2, False), (2, 1, False), (2, 1, True)])
def test_the_folded_rows_scale_returns_in_every_epilogue(split_k, heads, deterministic):
    """Whole tiles (K and V heads together) and split tiles merged by their last part, from
    one atomic sum or (bitwise-reproducible mode) one partial each, all take the rows'
    scale back."""
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import fused_weights, plan_precompute
    from dflash_rocm.planning import record_for

    w, states, positions = large_norm_case()
    assert fused_weights(w).row_scale.max() > 1, "the case folds past float16's range"
    config = PrecomputeLaunchConfig(block_t=16, block_k=16, split_k=split_k, heads=heads)
    call = precompute_call(states, positions, w, None, None, None, return_kv=True)
    k, v = (torch.empty(2, 9, 2, 32, dtype=torch.float16) for _ in range(2))
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        plan = plan_precompute(*record_for("precompute_and_store_context_kv", "triton", call), config)
    finally:
        torch.use_deterministic_algorithms(before)
    assert plan.atomic_sum == (split_k > 1 and not deterministic)
    plan.launch(call, k, v)
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                               return_kv=True, backend="reference")
    assert relative_error(k, ref_k) < TOLERANCES[torch.float16]
    assert relative_error(v, ref_v) < TOLERANCES[torch.float16]


def test_rows_that_fit_are_folded_unscaled_and_others_scaled_by_powers_of_two():
    """Row scales from the folded rows' own magnitudes, whatever the dtype: 1 within
    65504, else the smallest power of two that brings the row there, past float32 too."""
    limit = 65504.0
    g = make_generator(8, "cpu")
    w = make_weights(g, "cpu", L=1, Hk=1, D=2, H=2, R=2, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    norm = torch.tensor([1e20, 1.0])
    kv = torch.tensor([[1e-20, -limit], [3 * limit * 1e-20, 0.5], [-5 * limit * 1e-20, 1.0], [1e20, 0.0]])
    rows, scale = replace(w, hidden_norm_weight=norm, kv_weight=kv).folded_kv_weight()
    exact = kv.double() * norm.double()
    assert scale[:3].tolist() == [1.0, 4.0, 8.0]
    assert scale[3] == 2.0 ** 117  # 1e40 / 2**117 = 6.0e4
    assert rows.abs().max() <= limit
    assert torch.allclose(rows.double() * scale.double()[:, None], exact, rtol=1e-7, atol=0)


def fold_range_case(dtype, per_layer, seed=4):
    """Weights whose hidden-norm column 3 (1e20) times its K/V weight column (1e20) is 1e40,
    past float32's range once folded, while the states carry 1e-30 of their RMS in that
    column: SPEC's order (the normed states 1e-10 there, times 1e20) gives K/V of about 1e10."""
    g = make_generator(seed, "cpu")
    H = 64
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=H, R=16, is_neox=True, bias=True, v_scale=None,
                     dtype=dtype, per_layer_norm=per_layer)
    norm, kv = w.hidden_norm_weight.clone(), w.kv_weight.clone()
    norm[..., 3], kv[:, 3] = 1e20, 1e20
    states = torch.randn(9, H, generator=g).to(dtype)
    states[:, 3] = 1e-30
    return replace(w, hidden_norm_weight=norm, kv_weight=kv), states, torch.randint(0, 4096, (9,), generator=g)


def served_like_the_reference(backend, w, states, positions):
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                               return_kv=True, backend="reference")
    assert torch.isfinite(ref_k).all() and torch.isfinite(ref_v).all(), "SPEC's order stays in range"
    k, v = serve(dflash_rocm.precompute_and_store_context_kv, backend, states, positions, w, None, None, None,
                 return_kv=True)
    assert relative_error(k, ref_k) < TOLERANCES[states.dtype]
    assert relative_error(v, ref_v) < TOLERANCES[states.dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_layer", [False, True], ids=["norm[H]", "norm[L,H]"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fold_past_float32_is_served_where_spec_order_stays_in_range(backend, per_layer, dtype):
    served_like_the_reference(backend, *fold_range_case(dtype, per_layer))


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_values_whose_fold_is_scaled_are_normalised_before_the_scale_returns(backend):
    """float32 states of RMS 1e10 and V rows of 1e28: the V projection (about 1e29) is in
    range, the un-normalised GEMM times the rows' scale (1e39) is not."""
    g = make_generator(9, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=64, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float32)
    kv = w.kv_weight.clone().view(2, 2, -1, 64)
    kv[:, 1] *= 1e28
    states = torch.randn(9, 64, generator=g) * 1e10
    served_like_the_reference(backend, replace(w, kv_weight=kv.view(-1, 64)), states,
                              torch.randint(0, 4096, (9,), generator=g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float16_normed_states_past_65504_are_served_where_spec_order_stays_in_range(backend):
    """A norm weight of 3e4 on a column the states fill (4x their RMS): the normed states
    pass float16's 65504 in float32, but times a weight column of 1e-3 the K/V do not."""
    w, states, positions = large_norm_case()
    kv = w.kv_weight.clone()
    kv[:, 3] = 1e-3
    states = states.clone()
    states[:, 3] = 4 * states.float().pow(2).mean(-1).sqrt().half()
    served_like_the_reference(backend, replace(w, kv_weight=kv), states, positions)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float16_k_projection_past_65504_before_its_norm_gives_finite_keys(backend):
    """K rows of 2000 (V rows as drawn): the projected K passes float16's range before the
    K RMSNorm brings it back; SPEC's order keeps the projection in float32."""
    w, states, positions = large_norm_case()
    kv = w.kv_weight.clone().view(2, 2, -1, 64)
    kv[:, 0] = torch.where(kv[:, 0] > 0, 2000.0, -2000.0).half()
    served_like_the_reference(backend, replace(w, kv_weight=kv.view(-1, 64)), states, positions)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float16_plan_after_its_hidden_norm_row_is_raised_in_place(backend):
    """A plan of per-layer float16 norms, run again after row 1 is raised in place 3e4-fold:
    its fold and its K projection pass 65504, SPEC's order (float32 after the states) does not
    overflow; the run reads the new weights."""
    g = make_generator(7, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=64, R=16, is_neox=True, bias=False, v_scale=None,
                     dtype=torch.float16, per_layer_norm=True)
    kv = w.kv_weight.clone().view(2, 2, -1, 64)
    kv[:, 0] *= 8
    kv[1, 1] *= 1e-3  # layer 1's V stays in range once its norm is raised
    w = replace(w, kv_weight=kv.view(-1, 64))
    states = torch.randn(9, 64, generator=g).half()
    positions = torch.randint(0, 4096, (9,), generator=g)
    with simulate_platform("gfx942") if backend == "rocm" else nullcontext():
        plan = dflash_rocm.plan_context_kv(w, None, None, backend=backend)
        plan.run(states, positions, None, return_kv=True)
        w.hidden_norm_weight[1].mul_(3e4)
        k, v = plan.run(states, positions, None, return_kv=True)
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None,
                                                               return_kv=True, backend="reference")
    assert torch.isfinite(ref_k).all() and torch.isfinite(ref_v).all()
    assert relative_error(k, ref_k) < TOLERANCES[torch.float16]
    assert relative_error(v, ref_v) < TOLERANCES[torch.float16]


def bf16_values(shape, g, magnitude):
    """bfloat16 values of ``magnitude`` times a factor in [1, 2): positive, so an average
    of them (attention's output) stays as large."""
    return ((1 + torch.rand(shape, generator=g)) * magnitude).to(torch.bfloat16)


def attention_inputs(magnitude, which):
    g = make_generator(5, "cpu")
    Hk, G, D, bs = 2, 2, 16, 4
    tensors = {"query": torch.randn(6, Hk * G, D, generator=g), "key": torch.randn(5, bs, Hk, D, generator=g),
               "value": torch.randn(5, bs, Hk, D, generator=g)}
    tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    tensors[which] = bf16_values(tensors[which].shape, g, magnitude)
    table = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    return (tensors["query"], tensors["key"], tensors["value"], table, torch.tensor([0, 4, 6], dtype=torch.int32),
            torch.tensor([10, 7], dtype=torch.int32))


def precompute_inputs(magnitude):
    g = make_generator(6, "cpu")
    w = make_weights(g, "cpu", L=2, Hk=2, D=32, H=64, R=16, is_neox=False, bias=False, v_scale=None,
                     dtype=torch.bfloat16)
    return bf16_values((7, 64), g, magnitude), torch.randint(0, 4096, (7,), generator=g), w


def outputs(backend, op, magnitude, which):
    if op == "attention":
        return (serve(dflash_rocm.draft_attention, backend, *attention_inputs(magnitude, which)),)
    states, positions, w = precompute_inputs(magnitude)
    return serve(dflash_rocm.precompute_and_store_context_kv, backend, states, positions, w, None, None, None,
                 return_kv=True)


CASES = [("attention", "query"), ("attention", "key"), ("attention", "value"), ("precompute", "states")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,which", CASES)
def test_bf16_inputs_from_the_smallest_normal_up_are_served_within_tolerance(backend, op, which):
    """Where bf16 dot products flush subnormal products (SPEC.md), values at the smallest
    normal weighted by softmax weights under 1 are such products: there the values start
    2^12 up, so that every weight down to 2^-12 keeps its product normal."""
    magnitude = SMALLEST_NORMAL * (2 ** 12 if which == "value" and flushes_bf16_products(backend) else 1)
    got = outputs(backend, op, magnitude, which)
    want = outputs("reference", op, magnitude, which)
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOLERANCES[torch.bfloat16]


def flushes_bf16_products(backend: str) -> bool:
    """Whether ``backend``'s bf16 dot products flush subnormal products to zero here: the
    cpu backend where oneDNN's bf16 kernels run (AVX512-BF16/AMX CPUs)."""
    return backend == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def widens_bf16_exactly(backend: str) -> bool:
    """Whether ``backend`` computes on subnormal bf16 operands widened to float32 exactly
    here: the reference always; the cpu backend unless oneDNN's bf16 kernels run (CPUs
    with AVX512-BF16/AMX, whose bf16 dot products read subnormal inputs as zero; this
    CI machine is AVX2); not the Triton interpreter, whose bf16 casts misread them."""
    return backend == "reference" or (backend == "cpu" and not flushes_bf16_products(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,which", CASES)
def test_subnormal_bf16_inputs_give_finite_results_and_exact_ones_where_widened_exactly(backend, op, which):
    """Outside the tolerance in general (SPEC.md), never NaN or Inf."""
    got = outputs(backend, op, SMALLEST_NORMAL / 16, which)
    want = outputs("reference", op, SMALLEST_NORMAL / 16, which)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        if widens_bf16_exactly(backend):
            assert relative_error(g, w) < TOLERANCES[torch.bfloat16]
