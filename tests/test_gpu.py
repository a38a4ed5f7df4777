"""Every backend the GPU serves against the reference, on the GPU, at real sizes.

``pytest -m cuda`` on NVIDIA runs triton (compiled for real) and, where vLLM is installed,
cuda; ``pytest -m rocm`` in a ROCm container runs triton, rocm and, where aiter is
installed on CDNA, aiter (auto's first choice there). Elsewhere these skip with a reason,
at setup, before hypothesis draws a case. A backend this GPU should serve (its vendor
stack installed) that reports reasons fails the test rather than skips: on a GPU machine
"nothing ran" must not look like success. The one exception is named in
:data:`STACK_LIMITS`: what the installed vendor library lacks, not this package.

Beyond the kernels at Qwen3-8B and sliding-window-with-sinks shapes, this covers what an
MI300X serves in vLLM: ROCM_ATTN's packed pages (``strategies.pack_caches``), fp8 K/V weight
rows, batch 64 at 32k context, graphs replayed after an in-place weight update, and a
tuned table reloaded from disk serving no slower than the table it replaces.
"""

import dataclasses
import logging
import logging.handlers

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

import dflash_rocm
from checks import check_attention, check_precompute
from dflash_rocm import dispatch
from dflash_rocm.backends.aiter.attention import AITER_PAGE_MULTIPLE
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.ops.attention import attention_call
from dflash_rocm.ops.precompute import precompute_call
from dflash_rocm.planning import record_for
from dflash_rocm.platform import platform_for
from dflash_rocm.workloads import SHAPES, attention_inputs, precompute_inputs, random_weights
from strategies import (GPU_SIZES, AttentionCase, PrecomputeCase, attention_cases, pack_caches, precompute_cases,
                        quantize_rows)
from support import HAS_AITER, HAS_VLLM

needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="the cuda backend composes vLLM's CUDA ops and FlashAttention: "
                                                     "vLLM is not installed here")
needs_aiter = pytest.mark.skipif(not HAS_AITER, reason="aiter is not installed here (where it is, auto tries it "
                                                       "first on CDNA)")
NVIDIA_TRITON = pytest.param("triton", marks=pytest.mark.cuda, id="nvidia-triton")
NVIDIA_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, needs_vllm], id="nvidia-cuda")
AMD_TRITON = pytest.param("triton", marks=pytest.mark.rocm, id="amd-triton")
AMD_ROCM = pytest.param("rocm", marks=pytest.mark.rocm, id="amd-rocm")
AMD_AITER = pytest.param("aiter", marks=[pytest.mark.rocm, needs_aiter], id="amd-aiter")

KERNELS = [NVIDIA_TRITON, AMD_TRITON, AMD_ROCM]  # this package's Triton kernels, compiled for the GPU
PRECOMPUTE_BACKENDS = KERNELS + [NVIDIA_CUDA]  # aiter has no precompute
ATTENTION_BACKENDS = PRECOMPUTE_BACKENDS + [AMD_AITER]
GPUS = [pytest.param("nvidia", marks=pytest.mark.cuda), pytest.param("amd", marks=pytest.mark.rocm)]

# Per-call refusals that come from the installed vendor library, not from this package: a
# test meeting one skips with it; any other reason of a backend this GPU serves fails.
STACK_LIMITS = ("sinks need FlashAttention 3 or 4", "this aiter has no sinks")

QWEN3_8B = SHAPES["qwen3-8b-dflash-b16"]
GEMMA = SHAPES["gemma-swa-sinks"]
# 8 examples per property on a GPU: every drawn shape compiles its own kernels (the budget
# of `pytest -m cuda tests/test_gpu.py tests/test_host_path.py` on an H100 is ~200 s).
# The backend fixture holds nothing an example changes.
GPU_PROFILE = settings(max_examples=8, deadline=None,
                       suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow,
                                              HealthCheck.function_scoped_fixture])


def fp8_dtype():
    """The fp8 format this GPU converts natively (MI300: fnuz; others: OCP e4m3fn); a GPU
    without fp8 conversion (RDNA3, A100) skips the test: the hardware's limit, not this package's."""
    platform = platform_for("cuda")
    if platform.arch_info.fp8_dtype is None:
        pytest.skip(f"{platform.arch} has no fp8 conversion")
    return platform.arch_info.fp8_dtype


def not_expected_here(name: str) -> str | None:
    """Why this GPU is not one backend ``name`` is built for (None: it should serve here)."""
    from dflash_rocm.backends.rocm import tables

    platform = platform_for("cuda")
    if name == "aiter" and platform.family != "cdna":
        return f"aiter's CK attention targets CDNA; this GPU ({platform.arch}) is {platform.family}"
    if name == "rocm" and platform.arch not in tables.SUPPORTED_ARCHS:
        return f"the rocm backend has no launch table for {platform.arch}; the triton backend serves it"
    return None


def page_rows(backend: str) -> int:
    """Rows per cache page in these tests: aiter's CK paged path takes multiples of 128."""
    return AITER_PAGE_MULTIPLE if backend == "aiter" else 16


@pytest.fixture
def backend(request):
    """The backend under test (parametrized indirectly). Runs before hypothesis draws a
    case: one this GPU should serve that reports device reasons fails the test here."""
    name = request.param
    why_not = not_expected_here(name)
    if why_not:
        pytest.skip(why_not)
    reasons = dispatch.device_reasons("cuda")[name]
    assert not reasons, f"{name} should serve this GPU ({platform_for('cuda').arch}) but reports: {reasons}"
    return name


@pytest.fixture(autouse=True)
def _aiter_keeps_its_signatures():
    """aiter hands a call signature to the Triton kernel for good when its first call
    disagrees with it (a warning, and the output stays right): on a GPU that is aiter
    failing, not a pass. The handler goes on the package's logger itself: the images set
    ``DFLASH_ROCM_LOG_LEVEL``, whose handler stops propagation to the root."""
    logger = logging.getLogger("dflash_rocm")
    seen = logging.handlers.BufferingHandler(capacity=1 << 16)
    logger.addHandler(seen)
    try:
        yield
    finally:
        logger.removeHandler(seen)
    disagreements = [r.getMessage() for r in seen.buffer if r.getMessage().startswith("aiter's attention disagrees")]
    assert not disagreements


def require_served(backend: str, op, call) -> None:
    """Fail unless ``backend`` serves ``call`` (skip on a :data:`STACK_LIMITS` reason alone)."""
    reasons = dispatch.reasons_for(backend, op, call)
    if reasons and all(r.startswith(STACK_LIMITS) for r in reasons):
        pytest.skip(f"the installed {backend} library cannot serve this call: {reasons}")
    assert not reasons, f"{backend} should serve this call on this GPU: {reasons}"


def attention_case(inputs, description: str, packing: str = "plain") -> AttentionCase:
    """A workload's attention inputs as a :class:`strategies.AttentionCase` (for
    :func:`checks.check_attention`), the caches in vLLM ROCM_ATTN's pages when ``packing`` says."""
    query, key_cache, value_cache, *rest = inputs.args()
    key_cache, value_cache = pack_caches(key_cache, value_cache, packing)
    return AttentionCase(args=(query, key_cache, value_cache, *rest), kwargs=dict(inputs.kwargs),
                         description=f"{description} packing={packing}")


def precompute_case(inputs, description: str, packing: str = "plain", *, return_kv: bool = False) -> PrecomputeCase:
    """A workload's precompute inputs as a :class:`strategies.PrecomputeCase` (for
    :func:`checks.check_precompute`), per-layer float scales, caches packed as ``packing`` says."""
    packed = [pack_caches(k, v, packing) for k, v in zip(inputs.key_caches, inputs.value_caches)]
    scales = {name: None if s is None else s.tolist() for name, s in inputs.kwargs().items()}
    return PrecomputeCase(args=(inputs.states, inputs.positions, inputs.weights, [k for k, _ in packed],
                                [v for _, v in packed], inputs.slot_mapping),
                          kwargs=dict(scales, return_kv=return_kv), description=f"{description} packing={packing}")


def with_fp8_rows(weights, dtype: torch.dtype, granularity: str):
    """``weights`` with its K/V rows quantized to ``dtype`` (per-tensor or per-row scale),
    as a checkpoint with fp8 ``k_proj``/``v_proj`` hands them over."""
    rows, scale = quantize_rows(weights.kv_weight.float(), dtype, granularity)
    return dataclasses.replace(weights, kv_weight=rows, kv_weight_scale=scale)


def first_choice(op) -> str:
    """The backend ``auto`` should pick on this GPU for a Qwen3-8B step at 128-row pages:
    the vendor library where installed (vLLM's ops on NVIDIA, aiter's attention on CDNA),
    else this package's kernels."""
    platform = platform_for("cuda")
    if platform.vendor == "cuda":
        return "cuda" if HAS_VLLM else "triton"
    if op is ATTENTION and HAS_AITER and not_expected_here("aiter") is None:
        return "aiter"
    return "rocm" if not_expected_here("rocm") is None else "triton"


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS, indirect=True)
def test_backend_serves_this_gpu(backend):
    assert dflash_rocm.available_backends("cuda")[backend] == []


@pytest.mark.parametrize("gpu", GPUS)
def test_auto_serves_a_qwen3_step_with_this_gpus_first_choice(gpu):
    """What a serving engine gets without naming a backend: the first choice of this GPU
    (``first_choice``) serves both ops, and agrees with the reference (aiter's second call
    of a signature, after its first-call check, runs aiter's own kernel alone). The same
    step over vLLM ROCM_ATTN's packed pages goes to a backend that reads them (not aiter)."""
    device = torch.device("cuda")
    inputs = attention_inputs(QWEN3_8B, 4, 4096, torch.bfloat16, torch.bfloat16, device,
                              block_size=AITER_PAGE_MULTIPLE)
    dflash_rocm.reset_dispatch_counts()
    for _ in range(2):
        out = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="auto")
    ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-2
    case = precompute_case(precompute_inputs(QWEN3_8B, 256, torch.bfloat16, torch.bfloat16, device), "qwen3-8b N=256")
    check_precompute(case, "auto")
    counts = dflash_rocm.dispatch_counts()
    assert counts == {("draft_attention", first_choice(ATTENTION)): 2,
                      ("precompute_and_store_context_kv", first_choice(PRECOMPUTE)): 1,
                      ("draft_attention", "reference"): 1, ("precompute_and_store_context_kv", "reference"): 1}
    check_attention(attention_case(inputs, "qwen3-8b batch=4 context=4096", "rocm_attn"), "auto")


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS, indirect=True)  # not aiter: no 128-row pages drawn
@GPU_PROFILE
@given(case=attention_cases(GPU_SIZES, dtypes=(torch.float16, torch.bfloat16),
                            cache_dtypes=("same", torch.float8_e4m3fn, torch.float8_e4m3fnuz)))
def test_attention_on_gpu(backend, case):
    call = attention_call(*case.args, **case.kwargs)
    assume(not dispatch.reasons_for(backend, ATTENTION, call))
    check_attention(case, backend)


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS, indirect=True)
@GPU_PROFILE
@given(case=precompute_cases(GPU_SIZES, dtypes=(torch.float16, torch.bfloat16),
                             cache_dtypes=("same", torch.float8_e4m3fn, torch.float8_e4m3fnuz)))
def test_precompute_on_gpu(backend, case):
    call = precompute_call(*case.args, **case.kwargs)
    assume(not dispatch.reasons_for(backend, PRECOMPUTE, call))
    check_precompute(case, backend)


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS, indirect=True)
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_qwen3_8b_precompute(backend, num_tokens, fp8):
    cache_dtype = fp8_dtype() if fp8 else torch.bfloat16
    inputs = precompute_inputs(QWEN3_8B, num_tokens, torch.bfloat16, cache_dtype, torch.device("cuda"))
    require_served(backend, PRECOMPUTE, precompute_call(*inputs.args(), **inputs.kwargs()))
    check_precompute(precompute_case(inputs, f"qwen3-8b N={num_tokens} cache={cache_dtype}", return_kv=True), backend)


def served_twice(case, backend: str) -> None:
    """:func:`checks.check_attention` after one call of the same signature: aiter checks a
    signature's first call against the Triton kernel and returns that kernel's output, so
    only a second call shows aiter's own (a repeat call for every other backend)."""
    kwargs = {k: v for k, v in case.kwargs.items() if k != "out"}
    dflash_rocm.draft_attention(*case.args, **kwargs, backend=backend)
    check_attention(case, backend)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS, indirect=True)
@pytest.mark.parametrize("context", [1024, 8192, 32768])
@pytest.mark.parametrize("shape", [QWEN3_8B, GEMMA], ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [1, 4])  # one request's long context: merged by merger programs on MI300/H200
def test_real_shape_attention(backend, context, shape, batch):
    inputs = attention_inputs(shape, batch, context, torch.bfloat16, torch.bfloat16, torch.device("cuda"),
                              block_size=page_rows(backend))
    require_served(backend, ATTENTION, attention_call(*inputs.args(), **inputs.kwargs))
    served_twice(attention_case(inputs, f"{shape.name} batch={batch} context={context}"), backend)


@pytest.mark.parametrize("backend", KERNELS, indirect=True)  # vLLM's FlashAttention and aiter: fp8 queries only
@pytest.mark.parametrize("shape", [QWEN3_8B, GEMMA], ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [1, 8])
def test_real_shape_attention_on_an_fp8_cache(backend, shape, batch):
    """This GPU's fp8 format at 8k context: the products in fp16 on NVIDIA (the query
    pre-scaled), in the query's dtype on AMD. Within bf16's bound, tighter than SPEC.md's
    fp8 one: the reference reads the same fp8 values."""
    inputs = attention_inputs(shape, batch, 8192, torch.bfloat16, fp8_dtype(), torch.device("cuda"))
    require_served(backend, ATTENTION, attention_call(*inputs.args(), **inputs.kwargs))
    err = check_attention(attention_case(inputs, f"{shape.name} batch={batch} context=8192 fp8"), backend)
    assert err < dflash_rocm.contract.TOLERANCES[torch.bfloat16]


@pytest.mark.parametrize("backend", KERNELS, indirect=True)
@pytest.mark.parametrize("packing", ["rocm_attn", "rocm_attn_interleaved_v"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_attention_reads_rocm_attn_pages(backend, packing, fp8):
    """vLLM's ROCM_ATTN (what a non-causal draft gets on MI300X) keeps K x-packed and V
    transposed or interleaved (docs/vllm-backends.md): read in place at 8k context, within
    bf16's bound for either cache (as on plain pages)."""
    cache_dtype = fp8_dtype() if fp8 else torch.bfloat16
    inputs = attention_inputs(QWEN3_8B, 4, 8192, torch.bfloat16, cache_dtype, torch.device("cuda"))
    case = attention_case(inputs, f"qwen3-8b batch=4 context=8192 cache={cache_dtype}", packing)
    require_served(backend, ATTENTION, attention_call(*case.args, **case.kwargs))
    assert check_attention(case, backend) < dflash_rocm.contract.TOLERANCES[torch.bfloat16]


@pytest.mark.parametrize("backend", KERNELS, indirect=True)
@pytest.mark.parametrize("packing", ["rocm_attn", "rocm_attn_interleaved_v"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_precompute_writes_rocm_attn_pages(backend, packing, fp8):
    """The precompute writes ROCM_ATTN's packed pages in place, and nothing outside the slots."""
    cache_dtype = fp8_dtype() if fp8 else torch.bfloat16
    inputs = precompute_inputs(QWEN3_8B, 256, torch.bfloat16, cache_dtype, torch.device("cuda"))
    case = precompute_case(inputs, f"qwen3-8b N=256 cache={cache_dtype}", packing)
    require_served(backend, PRECOMPUTE, precompute_call(*case.args, **case.kwargs))
    check_precompute(case, backend)


@pytest.mark.parametrize("backend", KERNELS, indirect=True)  # the cuda backend dequantizes nothing: float rows
@pytest.mark.parametrize("granularity,fp8_cache", [("tensor", False), ("channel", True)],
                         ids=["per-tensor-bf16-cache", "per-row-fp8-cache"])
def test_precompute_reads_fp8_weight_rows(backend, granularity, fp8_cache):
    """A draft checkpoint with fp8 K/V projections (``kv_weight`` in this GPU's fp8 format,
    a float32 per-tensor or per-row ``kv_weight_scale``) at Qwen3-8B, N = 256 (two pairs:
    each compile costs GPU time; the graph test below holds per-row scales with a bf16 cache)."""
    device = torch.device("cuda")
    cache_dtype = fp8_dtype() if fp8_cache else torch.bfloat16
    weights = with_fp8_rows(random_weights(QWEN3_8B, torch.bfloat16, device), fp8_dtype(), granularity)
    inputs = precompute_inputs(QWEN3_8B, 256, torch.bfloat16, cache_dtype, device, weights=weights)
    case = precompute_case(inputs, f"qwen3-8b N=256 fp8 rows per {granularity} cache={cache_dtype}")
    require_served(backend, PRECOMPUTE, precompute_call(*case.args, **case.kwargs))
    check_precompute(case, backend)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS, indirect=True)
def test_batch_64_at_32k_context(backend):
    """A full serving batch at long context: 64 requests of 32k tokens (each cache holds
    more than 2**31 elements, as a layer's view of vLLM's one KV buffer spans more). About
    16 GiB at the peak (modelled: two 4.0 GiB bf16 caches beside an 8 GiB fp32 draw or a
    copy of both): a GPU with less than 24 GiB skips, for want of memory the kernels do not need."""
    total = torch.cuda.get_device_properties(0).total_memory
    if total < 24 << 30:
        pytest.skip(f"needs 24 GiB of GPU memory for its inputs and their copies; this GPU has {total / 2**30:.1f}")
    inputs = attention_inputs(QWEN3_8B, 64, 32768, torch.bfloat16, torch.bfloat16, torch.device("cuda"),
                              block_size=page_rows(backend))
    require_served(backend, ATTENTION, attention_call(*inputs.args(), **inputs.kwargs))
    served_twice(attention_case(inputs, "qwen3-8b batch=64 context=32768"), backend)


def _captured(step):
    """``step`` captured in a CUDA/HIP graph after one eager warm-up on a side stream (the
    warm-up compiles, makes the launch plans, the cache table and the arrival counters:
    first-call work that graph capture forbids)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS, indirect=True)
@pytest.mark.parametrize("shape", [QWEN3_8B, GEMMA], ids=lambda s: s.name)
@pytest.mark.parametrize("batch", [1, 4])  # batch 1: a split merged in the same launch (counters zero again)
def test_attention_with_default_arguments_replays_from_a_graph(backend, shape, batch):
    """Captured once with default arguments (``validate=True``: the index checks are
    device asserts), replayed over new queries, caches and block tables: each replay
    agrees with the reference on that replay's inputs."""
    device = torch.device("cuda")
    inputs = attention_inputs(shape, batch, 2048, torch.bfloat16, torch.bfloat16, device, block_size=page_rows(backend))
    require_served(backend, ATTENTION, attention_call(*inputs.args(), **inputs.kwargs))
    out = torch.empty_like(inputs.query)
    graph = _captured(lambda: dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, out=out,
                                                          backend=backend))
    for seed in (1, 2):
        fresh = attention_inputs(shape, batch, 2048, torch.bfloat16, torch.bfloat16, device, seed=seed,
                                 block_size=page_rows(backend))
        for static, new in zip(inputs.args(), fresh.args()):
            static.copy_(new)
        graph.replay()
        ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS, indirect=True)
def test_planned_layers_replay_from_a_graph(backend):
    """A plan made eagerly, its runs for two layers captured and replayed over new
    queries: each layer agrees with the reference on its own caches."""
    device = torch.device("cuda")
    layers = [attention_inputs(QWEN3_8B, 4, 2048, torch.bfloat16, torch.bfloat16, device, seed=s,
                               block_size=page_rows(backend)) for s in (0, 1)]
    first = layers[0]
    require_served(backend, ATTENTION, attention_call(*first.args(), **first.kwargs))
    plan = dflash_rocm.plan_draft_attention(*first.args(), **first.kwargs, backend=backend)
    outs = [torch.empty_like(layer.query) for layer in layers]
    graph = _captured(lambda: [plan.run(*layer.args()[:3], out=out) for layer, out in zip(layers, outs)])
    fresh = attention_inputs(QWEN3_8B, 4, 2048, torch.bfloat16, torch.bfloat16, device, seed=2,
                             block_size=page_rows(backend))
    for layer in layers:
        layer.query.copy_(fresh.query)
    graph.replay()
    for layer, out in zip(layers, outs):
        ref = dflash_rocm.draft_attention(*layer.args()[:3], *first.args()[3:], **first.kwargs, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS, indirect=True)
def test_a_plan_made_for_max_model_len_replays_shorter_sequences_from_a_graph(backend):
    """vLLM's capture: a plan made with ``max_seq_len = max_model_len`` over tensors sized
    for it, captured, then replayed over batches of much shorter real sequences (and one
    at the span's end) written into the same tensors: each replay agrees with the reference."""
    from test_capture import write_replay

    device, max_model_len = torch.device("cuda"), 32768
    inputs = attention_inputs(QWEN3_8B, 4, max_model_len - QWEN3_8B.block_tokens, torch.bfloat16, torch.bfloat16,
                              device, block_size=page_rows(backend))
    kwargs = dict(inputs.kwargs, max_seq_len=max_model_len)
    require_served(backend, ATTENTION, attention_call(*inputs.args(), **kwargs))
    out = torch.empty_like(inputs.query)
    plan = dflash_rocm.plan_draft_attention(*inputs.args(), **kwargs, out=out, backend=backend, validate=False)
    graph = _captured(lambda: plan.run(inputs.query, inputs.key_cache, inputs.value_cache, out=out))
    for seed, contexts in enumerate(((0, 1000, 5000, 37), (max_model_len - QWEN3_8B.block_tokens, 1, 255, 8000))):
        write_replay(inputs, contexts, seed)
        out.fill_(float("nan"))
        graph.replay()
        ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2, contexts


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS, indirect=True)
@pytest.mark.parametrize("num_tokens", [16, 256])
def test_precompute_with_default_arguments_replays_from_a_graph(backend, num_tokens):
    """Captured once, replayed over new states, positions and slots: the caches hold what
    the reference writes for that replay's inputs."""
    device = torch.device("cuda")
    inputs = precompute_inputs(QWEN3_8B, num_tokens, torch.bfloat16, torch.bfloat16, device)
    require_served(backend, PRECOMPUTE, precompute_call(*inputs.args(), **inputs.kwargs()))
    graph = _captured(lambda: dflash_rocm.precompute_and_store_context_kv(*inputs.args(), **inputs.kwargs(),
                                                                          backend=backend))
    for seed in (1, 2):
        fresh = precompute_inputs(QWEN3_8B, num_tokens, torch.bfloat16, torch.bfloat16, device, seed=seed,
                                  weights=inputs.weights)
        for static, new in ((inputs.states, fresh.states), (inputs.positions, fresh.positions),
                            (inputs.slot_mapping, fresh.slot_mapping)):
            static.copy_(new)
        replayed_caches_agree(graph.replay, inputs)


def replayed_caches_agree(replay, inputs) -> None:
    """Zero the caches, ``replay()``, and compare every cache with what the reference writes
    for ``inputs`` as they are now (weights included)."""
    caches = inputs.key_caches + inputs.value_caches
    for c in caches:
        c.zero_()
    replay()
    expected = [torch.zeros_like(c) for c in caches]
    L = len(inputs.key_caches)
    dflash_rocm.precompute_and_store_context_kv(inputs.states, inputs.positions, inputs.weights, expected[:L],
                                                expected[L:], inputs.slot_mapping, **inputs.kwargs(),
                                                backend="reference")
    tol = dflash_rocm.contract.spec_tolerance(inputs.states.dtype, caches[0].dtype)
    for got, want in zip(caches, expected):
        assert dflash_rocm.contract.relative_error(got.float(), want.float()) < tol


def update_in_place(weights, new) -> None:
    """Write ``new``'s tensors into ``weights``' own (an RL framework's weight sync into a
    running server), then refill the backends' derived copies, as a serving engine does
    where it finishes an update (``dflash_rocm.refill_derived``)."""
    for field in ("hidden_norm_weight", "kv_weight", "kv_weight_scale", "kv_bias", "k_norm_weight"):
        old = getattr(weights, field)
        if old is not None:
            old.copy_(getattr(new, field))
    dflash_rocm.refill_derived()


def captured_plan_replays_after_a_weight_update(backend: str, *, quantize, shape, dtype: torch.dtype,
                                                device: torch.device) -> None:
    """A context-KV plan captured in a graph, the weights then updated in place: the replay
    writes the new weights' K/V (``quantize``: the weights as the draft holds them)."""
    inputs = precompute_inputs(shape, 64, dtype, dtype, device,
                               weights=quantize(random_weights(shape, dtype, device, seed=3)))
    require_served(backend, PRECOMPUTE, precompute_call(*inputs.args(), **inputs.kwargs()))
    plan = dflash_rocm.plan_context_kv(inputs.weights, inputs.key_caches, inputs.value_caches, backend=backend)
    graph = _captured(lambda: plan.run(inputs.states, inputs.positions, inputs.slot_mapping))
    update_in_place(inputs.weights, quantize(random_weights(shape, dtype, device, seed=4)))
    replayed_caches_agree(graph.replay, inputs)


@pytest.mark.parametrize("backend", PRECOMPUTE_BACKENDS, indirect=True)
def test_a_captured_precompute_replays_after_a_weight_update(backend):
    captured_plan_replays_after_a_weight_update(backend, quantize=lambda w: w, shape=QWEN3_8B, dtype=torch.bfloat16,
                                                device=torch.device("cuda"))


@pytest.mark.parametrize("backend", KERNELS, indirect=True)
def test_a_captured_precompute_with_fp8_rows_replays_after_a_weight_update(backend):
    captured_plan_replays_after_a_weight_update(backend, quantize=lambda w: with_fp8_rows(w, fp8_dtype(), "channel"),
                                                shape=QWEN3_8B, dtype=torch.bfloat16, device=torch.device("cuda"))


# The tuned config serves no slower than the table's config it replaces, within this
# fraction of the table's time (tuning promotes a config only on a 3 % win at its
# workload's bucket; the served call sits inside that bucket).
TUNED_MARGIN = 0.10


def reloaded_tuned_table_serves(inputs, platform, device: torch.device) -> None:
    """Tune the attention of ``inputs``' spec (under the engine settings now) and save the
    table; drop the tables (a fresh process's view) and reload it from disk without tuning
    again; the call then plans under the tuned config for its workload, agrees with the
    reference, and runs no slower than the architecture table's config by more than
    :data:`TUNED_MARGIN`."""
    from dflash_rocm.backends import rocm
    from dflash_rocm.backends.rocm import tuner
    from dflash_rocm.backends.triton.attention import plan_attention
    from dflash_rocm.timing import interleaved_median_seconds

    call = attention_call(*inputs.args(), **inputs.kwargs)
    tuned = tuner.tune_attention(platform, call.spec, device)
    assert tuned.entries and tuner.last_path(call.spec, platform).is_file()
    tuner.forget_tables()

    def tune_again(workload):
        raise AssertionError(f"tuned {workload} again instead of reading the saved table")

    reloaded = tuner.tune_attention(platform, call.spec, device, runner_for=tune_again)
    assert [e.as_dict() for e in reloaded.entries] == [e.as_dict() for e in tuned.entries]
    record, facts = record_for("draft_attention", "rocm", call)
    source, config = rocm.attention_choice(record, facts)
    w = rocm.attention_workload(call, platform)
    assert source == "tuned" and config.as_dict() == reloaded.lookup(w.batch, w.query_len, w.key_span)
    served_twice(attention_case(inputs, "tuned"), "rocm")
    tuned_plan = plan_attention(record, facts, config)
    table_plan = plan_attention(record, facts, rocm.table_choice(record, facts)[1])
    times = interleaved_median_seconds({"tuned": lambda _: tuned_plan.run(call),
                                        "table": lambda _: table_plan.run(call)}, device, warmup=3, repeats=30)
    assert times["tuned"] <= times["table"] * (1 + TUNED_MARGIN), times


@pytest.mark.rocm
def test_startup_tuning_serves_its_reloaded_table_no_slower(tmp_path, monkeypatch):
    """A small DFlash space (batch <= 2, 4k tokens) tuned on this GPU:
    :func:`reloaded_tuned_table_serves` at Qwen3-8B, batch 2, 4000 tokens of context."""
    from dflash_rocm.backends.rocm import settings as rocm_settings
    from dflash_rocm.backends.rocm import tuner

    monkeypatch.setenv("DFLASH_ROCM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_ROCM_TUNE", "1")
    device = torch.device("cuda")
    tuner.forget_tables()
    previous = rocm_settings.current()
    rocm_settings.configure(batch_limit=2, max_model_len=4096, query_limit=16)
    try:
        inputs = attention_inputs(QWEN3_8B, 2, 4000, torch.bfloat16, torch.bfloat16, device)
        reloaded_tuned_table_serves(inputs, platform_for("cuda"), device)
    finally:
        rocm_settings.configure(**previous._asdict())
        tuner.forget_tables()
