"""The default path never waits for the device.

On a GPU a host read of a device tensor (``.item()``, ``bool(t)``, a data-dependent shape)
drains the stream and cannot be captured in a CUDA/HIP graph. The CPU test runs the
public calls with their value checks in device mode (asynchronous asserts, as on a GPU)
and records every torch op outside kernel launches: none may be one that synchronises
on a GPU, and none may create a host tensor (a pageable copy on a GPU). The GPU tests
(``cuda``/``rocm`` markers) run the same calls under torch's sync debug mode.
"""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dflash_rocm
from dflash_rocm import launches, validation
from support import needs_interpreter, to_device
from test_validation import attention_args, precompute_args

# Ops that make the host wait for a GPU (their result's value or shape is read on the host),
# and ops that build a tensor from host data (a pageable host-to-device copy on a GPU).
SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique", "_unique2",
           "unique_consecutive", "equal", "repeat_interleave"}
HOST_DATA = {"lift_fresh", "lift_fresh_copy", "scalar_tensor"}


class Recorder(TorchDispatchMode):
    """Records syncing ops; also ``Tensor.tolist``, which reads CPU memory without any op."""

    def __init__(self):
        super().__init__()
        self.flagged = []

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        recorder = self

        def tolist(t):
            if not launches.in_flight():
                recorder.flagged.append("tolist")
            return recorder._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                             for i in (args[1] if len(args) > 1 else []) if i is not None)
        if not launches.in_flight() and (name in SYNCING or name in HOST_DATA or bool_index):
            self.flagged.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def device_mode_checks(monkeypatch):
    """Value checks as they run for GPU tensors: asynchronous asserts, no host reads."""
    monkeypatch.setattr(validation.IndexChecks, "__init__", lambda self, device: setattr(self, "on_host", False))


def recorded(fn):
    fn()  # first call: derived weights, cache tables, compilation (one-time, outside capture)
    with Recorder() as rec:
        fn()
    return rec.flagged


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "rocm"])
@pytest.mark.parametrize("variants", [False, True])
def test_default_calls_make_no_host_reads(device_mode_checks, backend, variants):
    """``variants``: the DFlash family's precompute variants (per-layer hidden norms, a NoPE
    layer, K rounded before RoPE) are settled once per weights, not per call."""
    from dflash_rocm.platform import simulate_platform

    with simulate_platform("gfx942"):
        a, p = attention_args(), precompute_args()
        if variants:
            p["weights"] = dataclasses.replace(p["weights"], hidden_norm_weight=torch.rand(2, 24) + 0.5,
                                               rope_layers=(False, True), round_k_before_rope=True)
        assert recorded(lambda: dflash_rocm.draft_attention(**a, backend=backend)) == []
        assert recorded(lambda: dflash_rocm.precompute_and_store_context_kv(**p, backend=backend)) == []


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "rocm"])
@pytest.mark.parametrize("mapping", ["shared", "per_layer"])
@pytest.mark.parametrize("packing", ["plain", "rocm_attn_interleaved_v"])
def test_the_precompute_copies_no_host_data_once_it_knows_the_caches(device_mode_checks, backend, mapping, packing):
    """vLLM hands the precompute new slot-mapping and state tensors every step, over the
    same caches: after the first call for a cache set no call builds a tensor from host
    data (a pageable host-to-device copy, not allowed under graph capture)."""
    from dflash_rocm.platform import simulate_platform
    from strategies import pack_caches

    p = precompute_args()
    packed = [pack_caches(k, v, packing) for k, v in zip(p["key_caches"], p["value_caches"])]
    p["key_caches"], p["value_caches"] = [k for k, _ in packed], [v for _, v in packed]
    if mapping == "per_layer":
        p["slot_mapping"] = [p["slot_mapping"], p["slot_mapping"].flip(0)]

    def fresh_step():  # new tensors, as a serving step makes them
        slots = p["slot_mapping"]
        return dict(p, context_states=p["context_states"].clone(),
                    slot_mapping=slots.clone() if mapping == "shared" else [s.clone() for s in slots])

    with simulate_platform("gfx942"):
        dflash_rocm.precompute_and_store_context_kv(**fresh_step(), backend=backend)
        step = fresh_step()
        with Recorder() as rec:
            dflash_rocm.precompute_and_store_context_kv(**step, backend=backend)
    assert rec.flagged == []


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "rocm"])
def test_a_planned_layer_makes_no_host_reads(device_mode_checks, backend):
    """A plan's run (what vLLM's draft layers call) neither reads the device nor copies
    host data, with the next layer's tensors and fp8 scales."""
    from dflash_rocm.platform import simulate_platform

    a = attention_args()
    a.update(key_cache=a["key_cache"].to(torch.float8_e4m3fn), value_cache=a["value_cache"].to(torch.float8_e4m3fn))
    with simulate_platform("gfx942"):
        plan = dflash_rocm.plan_draft_attention(**a, k_scale=torch.tensor([0.5]), v_scale=torch.tensor([0.5]),
                                                backend=backend)
        layer = dict(query=a["query"].clone(), key_cache=a["key_cache"].clone(), value_cache=a["value_cache"].clone(),
                     out=a["out"].clone(), k_scale=torch.tensor([0.25]), v_scale=torch.tensor([2.0]))
        assert recorded(lambda: plan.run(**layer)) == []


def test_the_recorder_sees_host_reads(device_mode_checks):
    """The recorder is not blind: the reference backend reads ``seq_lens`` on the host
    (it loops over requests), and a bad index still fails in device mode."""
    a = attention_args()
    assert "tolist" in recorded(lambda: dflash_rocm.draft_attention(**a, backend="reference"))
    a["block_table"][0, 0] = 99
    with pytest.raises(RuntimeError, match="block_table"):  # CPU tensors: the assert fires at once
        dflash_rocm.draft_attention(**a, backend="reference")


GPUS = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("rocm", marks=pytest.mark.rocm)]


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("op", ["attention", "precompute"])
def test_no_device_sync_on_the_gpu(gpu, op):
    args = to_device(attention_args() if op == "attention" else precompute_args(), "cuda")
    fn = dflash_rocm.draft_attention if op == "attention" else dflash_rocm.precompute_and_store_context_kv
    fn(**args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(**args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


class DirectStandIn:
    """Stands in for a plan's direct launcher (:class:`~dflash_rocm.backends.triton.launcher.Launcher`,
    the GPU path, absent under the interpreter): records the frames from the public entry
    to it, where the real one calls the compiled kernel."""

    def __init__(self, entry):
        self.entry, self.stacks = entry, []

    def run(self, grid, args, spec):
        import inspect

        frames = [f.frame for f in inspect.stack(0)[:30]]
        self.stacks.append(frames[:next(i for i, f in enumerate(frames) if f.f_code is self.entry) + 1])


@needs_interpreter
@pytest.mark.parametrize("path,most", [("call", 5), ("plan.run", 5), ("precompute", 6)])
def test_a_repeat_call_reaches_its_launch_through_the_plan_alone(monkeypatch, path, most):
    """A call of a known structure is "get the kept plan, run it": from the public entry
    to the launch on the GPU path (the direct launcher) it passes through at most 5 frames
    for the attention, 6 for the precompute, each a function written in a file (no
    generated code), and builds no plan."""
    from dflash_rocm import dispatch

    monkeypatch.setattr(dispatch, "_plans", {})
    if path == "precompute":
        args = precompute_args()
        entry = dflash_rocm.api.precompute_and_store_context_kv
        run = lambda: entry(**args, backend="triton")  # noqa: E731
    else:
        args = {**attention_args(), "query": attention_args()["query"].half(),
                "key_cache": attention_args()["key_cache"].half(),
                "value_cache": attention_args()["value_cache"].half(), "out": None}
        plan = dflash_rocm.plan_draft_attention(**args, backend="triton")
        entry = dflash_rocm.api.draft_attention if path == "call" else dflash_rocm.DraftAttentionPlan.run
        run = (lambda: dflash_rocm.draft_attention(**args, backend="triton")) if path == "call" else (
            lambda: plan.run(args["query"], args["key_cache"], args["value_cache"]))
    run()  # the first call of the structure makes its plan
    (planned,) = dispatch._plans.values()
    runner = planned.run.__self__
    direct = DirectStandIn(entry.__code__)
    for launch_plan in (runner.main, getattr(runner, "merge", None)):
        if launch_plan is not None:
            monkeypatch.setattr(launch_plan, "direct", direct)
    made = []
    monkeypatch.setattr(dispatch, "choose", lambda *a: made.append(a))
    run()
    assert direct.stacks and not made
    for stack in direct.stacks:
        assert len(stack) <= most, [f.f_code.co_name for f in stack]  # the entry and the launcher counted
        assert all(f.f_code.co_filename.endswith(".py") for f in stack), [f.f_code.co_filename for f in stack]


class _StandInJIT:
    """Triton's JIT entry for a kernel, standing in on a machine without a GPU: it
    "compiles" a kernel whose launch does nothing, so a plan's direct launcher keeps it."""

    def __init__(self, kernel):
        from triton.runtime.jit import JITFunction

        self.params, self.__name__ = JITFunction(kernel.fn).params, kernel.__name__

    def __getitem__(self, grid):
        from dflash_rocm.backends.triton.launcher import _NoopCompiled

        return lambda *args, **kwargs: _NoopCompiled(self.params)


@needs_interpreter
@pytest.mark.parametrize("path,most", [("call", 3), ("plan.run", 3), ("precompute", 4)])
def test_a_repeat_call_consults_few_memo_tables(monkeypatch, path, most):
    """On the GPU path (direct launchers holding their compiled kernels), a repeat call at
    a DFlash step's real shapes on a simulated MI300X (batch 1 over 8k keys: a split plan
    with its scratch; the precompute of 16 tokens) looks things up in at most 3 tables for the attention and 4
    for the precompute, and asks no ``lru_cache``: counted as the distinct objects whose
    ``get`` it calls (the validation memo, the plan cache, the scratch per stream)."""
    import functools
    import sys

    from dflash_rocm import dispatch, launches, platform
    from dflash_rocm.backends.triton.launcher import Launcher
    from dflash_rocm.workloads import SHAPES, attention_inputs, precompute_inputs

    monkeypatch.setattr(dispatch, "_plans", {})
    monkeypatch.setattr(platform, "_simulated", platform.platform_for_arch("gfx942", simulated=True))
    cpu, shape = torch.device("cpu"), SHAPES["qwen3-8b-dflash-b16"]
    if path == "precompute":
        p = precompute_inputs(shape, 16, torch.float16, torch.float16, cpu)
        run = lambda: dflash_rocm.precompute_and_store_context_kv(*p.args(), **p.kwargs(),  # noqa: E731
                                                                  backend="triton", validate=False)
    else:
        a = attention_inputs(shape, 1, 8192, torch.float16, torch.float16, cpu)
        plan = dflash_rocm.plan_draft_attention(*a.args(), **a.kwargs, backend="triton", validate=False)
        run = (lambda: dflash_rocm.draft_attention(*a.args(), **a.kwargs, backend="triton", validate=False)) if (
            path == "call") else (lambda: plan.run(a.query, a.key_cache, a.value_cache))
    with launches.capture():
        run()  # the structure's plan is made (nothing computed)
    (planned,) = dispatch._plans.values()
    runner = planned.run.__self__
    assert path == "precompute" or runner.scratch.get(cpu)[0] is not None, "the attention plan splits"
    for launch_plan in (runner.main, getattr(runner, "merge", None)):
        if launch_plan is not None:
            direct = Launcher(_StandInJIT(launch_plan.kernel), launch_plan.constexprs, launch_plan.options)
            monkeypatch.setattr(direct, "current_device", lambda: 0)
            monkeypatch.setattr(launch_plan, "direct", direct)
    run()  # through the stand-in JIT, whose kernel the launchers keep
    tables, caches = {}, []

    def profile(frame, event, arg):
        if event == "c_call" and isinstance(arg, functools._lru_cache_wrapper):
            caches.append(arg.__wrapped__.__qualname__)
        elif event == "c_call" and getattr(arg, "__name__", "") == "get" and isinstance(arg.__self__, dict):
            tables[id(arg.__self__)] = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_qualname}"

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    assert tables and len(tables) <= most and not caches, (sorted(tables.values()), caches)  # (empty: saw nothing)
