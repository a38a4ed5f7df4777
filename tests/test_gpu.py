"""Every backend the GPU serves against the reference, on the GPU, at real sizes.

``pytest -m cuda`` on NVIDIA runs triton (compiled for real) and cuda; ``pytest -m rocm``
in a ROCm container runs triton and rocm. Elsewhere these skip with a reason. A backend
that should serve on this GPU but reports reasons fails rather than skips: on a GPU
machine "nothing ran" must not look like success.
"""

import pytest
import torch

from dflash_rocm.planning import record_for
from hypothesis import HealthCheck, assume, given, settings

import dflash_rocm
from checks import check_attention, check_precompute
from dflash_rocm import dispatch
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.ops.attention import attention_call
from dflash_rocm.ops.precompute import precompute_call
from dflash_rocm.workloads import SHAPES, attention_inputs, precompute_inputs
from strategies import GPU_SIZES, attention_cases, precompute_cases

BACKENDS = [
    pytest.param("triton", marks=pytest.mark.cuda, id="nvidia-triton"),
    pytest.param("cuda", marks=pytest.mark.cuda, id="nvidia-cuda"),
    pytest.param("triton", marks=pytest.mark.rocm, id="amd-triton"),
    pytest.param("rocm", marks=pytest.mark.rocm, id="amd-rocm"),
]
# Backends that must be available on that vendor's GPU (cuda needs vLLM's CUDA build).
REQUIRED = [pytest.param("triton", marks=pytest.mark.cuda, id="nvidia-triton"),
            pytest.param("triton", marks=pytest.mark.rocm, id="amd-triton"),
            pytest.param("rocm", marks=pytest.mark.rocm, id="amd-rocm")]
QWEN3_8B = SHAPES["qwen3-8b-dflash-b16"]
GPU_PROFILE = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.filter_too_much,
                                                                                 HealthCheck.too_slow])


def fp8_dtype():
    """The fp8 format this GPU converts natively (MI300: fnuz; others: OCP e4m3fn)."""
    from dflash_rocm.platform import platform_for
    return platform_for("cuda").arch_info.fp8_dtype


@pytest.mark.parametrize("backend", REQUIRED)
def test_backend_serves_this_gpu(backend):
    assert dflash_rocm.available_backends("cuda")[backend] == []


@pytest.mark.parametrize("backend", BACKENDS)
@GPU_PROFILE
@given(case=attention_cases(GPU_SIZES, dtypes=(torch.float16, torch.bfloat16),
                            cache_dtypes=("same", torch.float8_e4m3fn, torch.float8_e4m3fnuz)))
def test_attention_on_gpu(backend, case):
    call = attention_call(*case.args, **case.kwargs)
    assume(not dispatch.reasons_for(backend, ATTENTION, call))
    check_attention(case, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@GPU_PROFILE
@given(case=precompute_cases(GPU_SIZES, dtypes=(torch.float16, torch.bfloat16),
                             cache_dtypes=("same", torch.float8_e4m3fn, torch.float8_e4m3fnuz)))
def test_precompute_on_gpu(backend, case):
    call = precompute_call(*case.args, **case.kwargs)
    assume(not dispatch.reasons_for(backend, PRECOMPUTE, call))
    check_precompute(case, backend)


def _agree(backend, op, args, kwargs, run):
    call = op.build_call(*args, **kwargs)
    reasons = dispatch.reasons_for(backend, op, call)
    if reasons:
        pytest.skip(f"{backend} does not serve this call here: {reasons}")
    return run(backend), run("reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_qwen3_8b_precompute(backend, num_tokens, fp8):
    device = torch.device("cuda")
    cache_dtype = fp8_dtype() if fp8 else torch.bfloat16
    inputs = precompute_inputs(QWEN3_8B, num_tokens, torch.bfloat16, cache_dtype, device)

    def run(name):
        for c in inputs.key_caches + inputs.value_caches:
            c.zero_()
        k, v = dflash_rocm.precompute_and_store_context_kv(*inputs.args(), **inputs.kwargs(), return_kv=True,
                                                           backend=name)
        return k, v, [c.float() for c in inputs.key_caches]

    (k, v, caches), (rk, rv, rcaches) = _agree(backend, PRECOMPUTE, inputs.args(), inputs.kwargs(), run)
    assert dflash_rocm.contract.relative_error(k, rk) < 2e-2 and dflash_rocm.contract.relative_error(v, rv) < 2e-2
    tol = 6e-2 if fp8 else 2e-2
    for got, want in zip(caches, rcaches):
        assert dflash_rocm.contract.relative_error(got, want) < tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("context", [1024, 8192, 32768])
@pytest.mark.parametrize("shape", ["qwen3-8b-dflash-b16", "gemma-swa-sinks"])
@pytest.mark.parametrize("batch", [1, 4])  # one request's long context: merged by merger programs on MI300/H200
def test_real_shape_attention(backend, context, shape, batch):
    device = torch.device("cuda")
    inputs = attention_inputs(SHAPES[shape], batch, context, torch.bfloat16, torch.bfloat16, device)

    def run(name):
        return dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend=name).clone()

    out, ref = _agree(backend, ATTENTION, inputs.args(), inputs.kwargs, run)
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["qwen3-8b-dflash-b16", "gemma-swa-sinks"])
@pytest.mark.parametrize("batch", [1, 8])
def test_real_shape_attention_on_an_fp8_cache(backend, shape, batch):
    """This GPU's fp8 format at 8k context: the products in fp16 on NVIDIA (the query
    pre-scaled), in the query's dtype on AMD."""
    device = torch.device("cuda")
    inputs = attention_inputs(SHAPES[shape], batch, 8192, torch.bfloat16, fp8_dtype(), device)

    def run(name):
        return dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend=name).clone()

    out, ref = _agree(backend, ATTENTION, inputs.args(), inputs.kwargs, run)
    assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.rocm
def test_startup_tuning_end_to_end_on_the_gpu(tmp_path, monkeypatch):
    """Tune a small DFlash space on the real GPU, persist it, and serve from it."""
    from dflash_rocm.backends import rocm
    from dflash_rocm.backends.rocm import settings, tuner
    from dflash_rocm.platform import platform_for

    monkeypatch.setenv("DFLASH_ROCM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DFLASH_ROCM_TUNE", "1")
    tuner.forget_tables()
    previous = settings.current()
    settings.configure(batch_limit=2, max_model_len=4096, query_limit=16)
    try:
        inputs = attention_inputs(QWEN3_8B, 2, 4000, torch.bfloat16, torch.bfloat16, torch.device("cuda"))
        call = attention_call(*inputs.args(), **inputs.kwargs)
        table = tuner.tune_attention(platform_for("cuda"), call.spec, torch.device("cuda"))
        assert table.entries and all(e.speedup >= 1.0 for e in table.entries)
        assert list(tmp_path.glob("attention-*.json"))
        source, _ = rocm.attention_choice(*record_for("draft_attention", "rocm", call))
        out = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="rocm").clone()
        ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
        assert source in ("tuned",) + tuple(r.name for r in rocm.tables.rules_for(platform_for("cuda").arch))
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2
    finally:
        settings.configure(**previous.__dict__)
        tuner.forget_tables()


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ["qwen3-8b-dflash-b16", "gemma-swa-sinks"])
@pytest.mark.parametrize("batch", [1, 4])  # batch 1: a split merged in the same launch (counters zero again)
def test_attention_with_default_arguments_replays_from_a_graph(backend, shape, batch):
    """Captured once with default arguments (``validate=True``: the index checks are
    device asserts), replayed over new queries, caches and block tables: each replay
    agrees with the reference on that replay's inputs."""
    device = torch.device("cuda")
    inputs = attention_inputs(SHAPES[shape], batch, 2048, torch.bfloat16, torch.bfloat16, device)
    if dispatch.reasons_for(backend, ATTENTION, attention_call(*inputs.args(), **inputs.kwargs)):
        pytest.skip(f"{backend} does not serve this call here")
    out = torch.empty_like(inputs.query)
    graph = _captured(lambda: dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, out=out,
                                                          backend=backend))
    for seed in (1, 2):
        fresh = attention_inputs(SHAPES[shape], batch, 2048, torch.bfloat16, torch.bfloat16, device, seed=seed)
        for static, new in zip(inputs.args(), fresh.args()):
            static.copy_(new)
        graph.replay()
        ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_planned_layers_replay_from_a_graph(backend):
    """A plan made eagerly, its runs for two layers captured and replayed over new
    queries: each layer agrees with the reference on its own caches."""
    device = torch.device("cuda")
    shape = SHAPES["qwen3-8b-dflash-b16"]
    layers = [attention_inputs(shape, 4, 2048, torch.bfloat16, torch.bfloat16, device, seed=s) for s in (0, 1)]
    first = layers[0]
    if dispatch.reasons_for(backend, ATTENTION, attention_call(*first.args(), **first.kwargs)):
        pytest.skip(f"{backend} does not serve this call here")
    plan = dflash_rocm.plan_draft_attention(*first.args(), **first.kwargs, backend=backend)
    outs = [torch.empty_like(layer.query) for layer in layers]
    graph = _captured(lambda: [plan.run(*layer.args()[:3], out=out) for layer, out in zip(layers, outs)])
    fresh = attention_inputs(shape, 4, 2048, torch.bfloat16, torch.bfloat16, device, seed=2)
    for layer in layers:
        layer.query.copy_(fresh.query)
    graph.replay()
    for layer, out in zip(layers, outs):
        ref = dflash_rocm.draft_attention(*layer.args()[:3], *first.args()[3:], **first.kwargs, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_plan_made_for_max_model_len_replays_shorter_sequences_from_a_graph(backend):
    """vLLM's capture: a plan made with ``max_seq_len = max_model_len`` over tensors sized
    for it, captured, then replayed over batches of much shorter real sequences (and one
    at the span's end) written into the same tensors: each replay agrees with the reference."""
    from test_capture import write_replay

    device, max_model_len = torch.device("cuda"), 32768
    inputs = attention_inputs(QWEN3_8B, 4, max_model_len - QWEN3_8B.block_tokens, torch.bfloat16, torch.bfloat16,
                              device)
    kwargs = dict(inputs.kwargs, max_seq_len=max_model_len)
    if dispatch.reasons_for(backend, ATTENTION, attention_call(*inputs.args(), **kwargs)):
        pytest.skip(f"{backend} does not serve this call here")
    out = torch.empty_like(inputs.query)
    plan = dflash_rocm.plan_draft_attention(*inputs.args(), **kwargs, out=out, backend=backend, validate=False)
    graph = _captured(lambda: plan.run(inputs.query, inputs.key_cache, inputs.value_cache, out=out))
    for seed, contexts in enumerate(((0, 1000, 5000, 37), (max_model_len - QWEN3_8B.block_tokens, 1, 255, 8000))):
        write_replay(inputs, contexts, seed)
        out.fill_(float("nan"))
        graph.replay()
        ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
        assert dflash_rocm.contract.relative_error(out, ref) < 2e-2, contexts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_tokens", [16, 256])
def test_precompute_with_default_arguments_replays_from_a_graph(backend, num_tokens):
    """Captured once, replayed over new states, positions and slots: the caches hold what
    the reference writes for that replay's inputs."""
    device = torch.device("cuda")
    inputs = precompute_inputs(QWEN3_8B, num_tokens, torch.bfloat16, torch.bfloat16, device)
    if dispatch.reasons_for(backend, PRECOMPUTE, precompute_call(*inputs.args(), **inputs.kwargs())):
        pytest.skip(f"{backend} does not serve this call here")
    graph = _captured(lambda: dflash_rocm.precompute_and_store_context_kv(*inputs.args(), **inputs.kwargs(),
                                                                          backend=backend))
    caches = inputs.key_caches + inputs.value_caches
    for seed in (1, 2):
        fresh = precompute_inputs(QWEN3_8B, num_tokens, torch.bfloat16, torch.bfloat16, device, seed=seed,
                                  weights=inputs.weights)
        for static, new in ((inputs.states, fresh.states), (inputs.positions, fresh.positions),
                            (inputs.slot_mapping, fresh.slot_mapping)):
            static.copy_(new)
        for c in caches:
            c.zero_()
        graph.replay()
        expected = [torch.zeros_like(c) for c in caches]
        L = len(inputs.key_caches)
        dflash_rocm.precompute_and_store_context_kv(inputs.states, inputs.positions, inputs.weights, expected[:L],
                                                    expected[L:], inputs.slot_mapping, backend="reference")
        for got, want in zip(caches, expected):
            assert dflash_rocm.contract.relative_error(got.float(), want.float()) < 2e-2
