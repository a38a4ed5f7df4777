"""The direct launch of compiled kernels: what skips Triton's JIT prelude on hot calls.

A stand-in kernel records how it was launched: through the JIT (``kernel[grid](...)``,
which returns the compiled kernel) or through the compiled kernel (``compiled[grid](...)``
with the arguments its compiled signature names, in order, over three grid dimensions).
The real launch needs a GPU; its mechanics, Triton's specialisation rules, and Triton's own
``CompiledKernel[grid]`` entry over the signature Triton's JIT builds are checked here.
"""

from types import SimpleNamespace as NS

import pytest
import torch

from dflash_rocm.backends.triton import launcher as launching
from dflash_rocm.backends.triton.attention_kernels import draft_attention_kernel, merge_segments_kernel
from dflash_rocm.backends.triton.precompute_kernels import context_kv_kernel


class FakeKernel:
    __name__ = "fake_kernel"

    def __init__(self, *param_kinds):
        self.params = [NS(name=f"p{i}", is_constexpr=c) for i, c in enumerate(param_kinds)]
        self.log = []

    def __getitem__(self, grid):
        def jit(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return FakeCompiled(self.log, self.compiled_signature())
        return jit

    def compiled_signature(self) -> dict:
        """What Triton 3.3+ compiles into ``src.signature``: every parameter, by name."""
        return {p.name: "constexpr" if p.is_constexpr else "i32" for p in self.params}


class FakeCompiled:
    """A compiled kernel: its entry indexes three grid dimensions, as Triton's does."""

    def __init__(self, log, signature):
        self.log, self.src = log, NS(signature=signature)

    def __getitem__(self, grid):
        grid = (grid[0], grid[1], grid[2])
        return lambda *args: self.log.append(("compiled", grid, args))


def plan_of(kernel, grid, config, **constexprs):
    """A launch plan whose every runtime argument is per call (each call's specialisation
    checked: the general path)."""
    runtime = tuple(p.name for p in kernel.params if not p.is_constexpr)
    return launching.LaunchPlan(kernel, grid, launching.compiler_options(config) if config else {}, runtime, {},
                                constexprs)


def launch(plan, *args):
    plan.launch(**{f"p{i}": a for i, a in enumerate(args)})


@pytest.fixture
def on_a_gpu(monkeypatch):
    monkeypatch.setattr(launching, "INTERPRETING", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_a_second_launch_with_the_same_specialisation_calls_the_compiled_kernel(on_a_gpu):
    kernel = FakeKernel(False, False, True)
    plan = plan_of(kernel, (4,), None, p2=5)
    launch(plan, torch.zeros(64), 7)
    launch(plan, torch.zeros(64), 23)
    assert [entry[0] for entry in kernel.log] == ["jit", "compiled"]
    assert kernel.log[0][3] == {"p2": 5}
    assert kernel.log[1][1] == (4, 1, 1) and kernel.log[1][2][1:] == (23, 5)  # runtime args, then constexprs


@pytest.mark.parametrize("grid", [(5,), (5, 2), (5, 2, 3)])
def test_a_grid_of_fewer_dimensions_reaches_the_compiled_kernel_as_three(on_a_gpu, grid):
    """Triton's compiled entry reads ``grid[0..2]`` (an IndexError for a shorter tuple, seen
    on an H200 for the precompute's one-dimensional grid); the JIT pads the same way."""
    kernel = FakeKernel(False, True)
    plan = plan_of(kernel, grid, None, p1=0)
    launch(plan, 3)
    launch(plan, 3)
    padded = grid + (1,) * (3 - len(grid))
    assert [(entry[0], entry[1]) for entry in kernel.log] == [("jit", padded), ("compiled", padded)]


@pytest.mark.parametrize("grid", [(), (1, 2, 3, 4)])
def test_a_grid_triton_cannot_launch_is_refused_when_the_plan_is_made(on_a_gpu, grid):
    kernel = FakeKernel(False)
    with pytest.raises(ValueError, match="1 to 3 dimensions"):
        launching.LaunchPlan(kernel, grid, {}, (), {"p0": 1}, {})
    assert kernel.log == []


@pytest.mark.parametrize("compiled_with,expected", [
    ("every parameter", [("jit", (7, 1)), ("compiled", (7, 1, 5))]),  # Triton 3.3 and later
    ("runtime parameters", [("jit", (7, 1)), ("compiled", (7, 1))]),  # Triton 3.0-3.2
    ("something else", [("jit", (7, 1)), ("jit", (7, 1))]),  # unknown: the JIT launches every time
    ("no signature", [("jit", (7, 1)), ("jit", (7, 1))]),
])
def test_the_direct_arguments_follow_the_compiled_kernels_signature(on_a_gpu, monkeypatch, compiled_with, expected):
    """The compiled launcher takes one argument per entry of the signature the JIT compiled
    the kernel with: every parameter (constexprs too) on Triton 3.3+, only the runtime ones
    on 3.0-3.2; a signature that is neither is not trusted."""
    kernel = FakeKernel(False, False, True)
    signature = {"every parameter": {"p0": "i32", "p1": "i32", "p2": "constexpr"},
                 "runtime parameters": {"p0": "i32", "p1": "i32"},
                 "something else": {"p0": "i32"}, "no signature": None}[compiled_with]
    monkeypatch.setattr(kernel, "compiled_signature", lambda: signature)
    plan = plan_of(kernel, (1,), None, p2=5)
    for _ in range(2):
        launch(plan, 7, 1)
    assert [(entry[0], entry[2]) for entry in kernel.log] == expected


@pytest.mark.parametrize("first,second", [(2, 1), (2, 16), (16, 2), (5, 2 ** 31), (0.5, 1)],
                         ids=["becomes-one", "becomes-multiple-of-16", "stops-being-one", "becomes-64-bit",
                              "float-then-int"])
def test_a_new_specialisation_goes_through_the_jit(on_a_gpu, first, second):
    kernel = FakeKernel(False, True)
    plan = plan_of(kernel, (1,), None, p1=0)
    launch(plan, first)
    launch(plan, second)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


def test_pointer_alignment_and_dtype_are_part_of_the_specialisation(on_a_gpu):
    """A plan keeps the kernel compiled for its last specialisation (one slot): each new
    one goes through the JIT, a repeat of the kept one calls it directly."""
    kernel = FakeKernel(False)
    plan = plan_of(kernel, (1,), None)
    base = torch.zeros(64)
    launch(plan, base)
    launch(plan, base[1:])  # 4 bytes off: not 16-byte aligned
    launch(plan, base.to(torch.float16))
    launch(plan, base[4:])  # 16 bytes off: aligned again, but the slot holds the float16 kernel
    launch(plan, base[8:])  # aligned float32 again: the kept kernel
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit", "jit", "compiled"]


def test_each_plan_keeps_its_own_compiled_kernel(on_a_gpu):
    """Plans of one kernel with other constexprs or options never share a compiled kernel:
    each keeps the one its own first launch compiled."""
    kernel = FakeKernel(False, True)
    plans = [plan_of(kernel, (1,), None, p1=0), plan_of(kernel, (1,), None, p1=1),
             plan_of(kernel, (1,), NS(num_warps=8, num_stages=1), p1=1)]
    for plan in plans + plans:
        launch(plan, 3)
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit", "compiled", "compiled", "compiled"]
    assert [entry[3] for entry in kernel.log[:3]] == [{"p1": 0}, {"p1": 1}, {"p1": 1, "num_warps": 8,
                                                                            "num_stages": 1}]


def test_the_specialisation_matches_tritons_own():
    """Two argument lists get the same key exactly when Triton's specialisation agrees."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    t = torch.zeros(64)
    values = [0, 1, 2, 15, 16, 48, -16, 2 ** 31 - 1, 2 ** 31, 0.5, True, None, t, t[1:], t[4:], t.half()]
    for target, amd in ((GPUTarget("cuda", 90, 32), False), (GPUTarget("hip", "gfx942", 64), True)):
        backend = type(make_backend(target))
        for a in values:
            for b in values:
                ours = launching.specialization((a,), amd) == launching.specialization((b,), amd)
                theirs = (native_specialize_impl(backend, a, False, True, True)
                          == native_specialize_impl(backend, b, False, True, True))
                assert ours == theirs, (target.backend, a if not isinstance(a, torch.Tensor) else "tensor", b)


@pytest.mark.parametrize("amd", [False, True])
def test_the_tensor_fast_path_keys_as_the_general_specialisation(amd):
    t = torch.zeros(64)
    tensors = (t, t[1:], t[4:], t.half(), torch.zeros(3, dtype=torch.int32))
    assert launching.tensor_specialization(tensors, amd) == launching.specialization(tensors, amd)
    mixed = (t, 16, None)  # not all tensors: the general path answers
    assert launching.tensor_specialization(mixed, amd) == launching.specialization(mixed, amd)


@pytest.mark.parametrize("kernel", [draft_attention_kernel, merge_segments_kernel, context_kv_kernel],
                         ids=lambda k: k.__name__)
def test_every_kernel_declares_its_constexprs_last(kernel):
    from triton.runtime.jit import JITFunction
    params = JITFunction(kernel.fn).params  # what a GPU run decorates (the interpreter wraps it)
    first = next(i for i, p in enumerate(params) if p.is_constexpr)
    assert all(p.is_constexpr for p in params[first:]), kernel.__name__


def test_a_plan_orders_its_arguments_by_parameter_name(on_a_gpu):
    """Per-call tensors first, in the kernel's order whatever order they were named in,
    then the static arguments likewise, then (compiled path) the constexprs."""
    kernel = FakeKernel(False, False, False, True)
    x, y, z = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    plan = launching.LaunchPlan(kernel, (2,), {}, ("p1", "p0"), {"p2": 9}, {"p3": 5})
    plan.launch(p1=y, p0=x)
    plan.launch(p0=z, p1=x)
    assert kernel.log[0][2] == (x, y, 9) and kernel.log[0][3] == {"p3": 5}
    assert kernel.log[1][0] == "compiled" and kernel.log[1][2] == (z, x, 9, 5)


@pytest.mark.parametrize("named,wrong", [({"p0": 0}, "p1"), ({"p0": 0, "p1": 1, "p2": 2}, "p2"),
                                         ({"p0": 0, "q": 1}, "q")], ids=["missing", "static", "unknown"])
def test_a_launch_refuses_a_wrong_tensor_name_naming_it(on_a_gpu, named, wrong):
    kernel = FakeKernel(False, False, False, True)
    plan = launching.LaunchPlan(kernel, (1,), {}, ("p0", "p1"), {"p2": 2}, {"p3": 0})
    with pytest.raises(TypeError, match=wrong):
        plan.launch(**named)
    assert kernel.log == []


# ---- Triton's own compiled entry over the signature Triton's JIT builds ---------------------

def _accepts(ty: str, value) -> bool:
    """Whether a launcher compiled for signature type ``ty`` takes ``value`` (Triton's C
    launchers: an object for pointers and constexprs, which they skip; C ints and floats)."""
    if ty == "constexpr":
        return True
    if ty.startswith("*"):
        return isinstance(value, torch.Tensor)
    if ty in ("i32", "i64", "u64"):
        low, high = {"i32": (-2 ** 31, 2 ** 31), "i64": (-2 ** 63, 2 ** 63), "u64": (0, 2 ** 64)}[ty]
        return type(value) is int and low <= value < high
    if ty in ("fp32", "fp64"):
        return type(value) is float
    return ty == "i1" and type(value) is bool


def _captured_launches():
    """The launches of a precompute (one-dimensional grid) and of an attention call with a
    separate merge launch, recorded from the real host code on CPU tensors."""
    from dflash_rocm import launches
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig, PrecomputeLaunchConfig
    from dflash_rocm.backends.triton.precompute import run_precompute
    from dflash_rocm.ops.attention import attention_call
    from dflash_rocm.ops.precompute import precompute_call
    from dflash_rocm.workloads import DraftShape, attention_inputs, precompute_inputs

    shape = DraftShape("launch", hidden=256, layers=2, q_heads=8, kv_heads=2, head_dim=128)
    cpu = torch.device("cpu")
    pre = precompute_inputs(shape, 40, torch.bfloat16, torch.bfloat16, cpu)
    att = attention_inputs(shape, 2, 700, torch.bfloat16, torch.bfloat16, cpu)
    with launches.capture() as captured:
        run_precompute(precompute_call(*pre.args(), **pre.kwargs()),
                       PrecomputeLaunchConfig(block_t=16, block_k=64, split_k=2))
        run_draft_attention(attention_call(*att.args(), **att.kwargs),
                            AttentionLaunchConfig(block_m=64, block_n=32, num_segments=4, merge="launch"))
    return captured


def test_the_direct_path_launches_through_tritons_compiled_entry_with_the_arguments_it_compiled_for(monkeypatch):
    """Every kernel's captured launch, planned as the GPU path plans it, goes the second time
    through Triton's real ``CompiledKernel.__getitem__`` for a kernel compiled with the
    signature Triton's own binder and ``_pack_args`` build for those arguments (sm_90): the
    launcher gets three grid dimensions and exactly one argument of the right kind per
    signature entry."""
    import triton.compiler.compiler as triton_compiler
    from triton.runtime.jit import JITFunction

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))

    launched = []

    class CompiledLikeTriton(triton_compiler.CompiledKernel):
        """Triton's CompiledKernel, loaded (no driver): only its launcher is a check."""

        def __init__(self, fn, signature):
            self.src, self.name, self.module, self.function = NS(signature=signature, fn=fn), fn.__name__, 1, 0
            self._module_pid, self.packed_metadata = None, (1, 1, 0)
            self._run = lambda *a: launched.append((self.name, signature, a))

        def __del__(self):
            pass

    captured = _captured_launches()  # as this machine runs them (the interpreter, if it is on)
    on_a_gpu.__wrapped__(monkeypatch)
    monkeypatch.setattr(triton_compiler, "driver", NS(active=NS(get_current_device=lambda: 0,
                                                                   get_current_stream=lambda device: 0)))
    assert sorted({c.kernel.__name__ for c in captured}) == ["context_kv_kernel", "draft_attention_kernel",
                                                              "merge_segments_kernel"]
    assert any(len(c.grid) < 3 for c in captured), "a grid of fewer dimensions than three is covered"
    for c in captured:
        jit = JITFunction(c.kernel.fn)
        kwargs = {**c.constexprs, **launching.options_for(c.options, amd=False)}
        bound, spec, options = create_function_from_signature(jit.signature, jit.params, backend)(*c.args, **kwargs)
        signature = jit._pack_args(backend, kwargs, bound, spec, options)[1]  # what the JIT compiles with

        class Kernel:  # Triton's JIT entry: returns the kernel compiled for these arguments
            __name__, params = jit.__name__, jit.params

            def __getitem__(self, grid):
                return lambda *args, **kwargs: CompiledLikeTriton(jit, signature)

        names = launching.kernel_parameters(jit)[0]
        per_call = c.per_call if c.per_call is not None else len(c.args)
        plan = launching.LaunchPlan(Kernel(), c.grid, c.options, names[:per_call],
                                    dict(zip(names[per_call:], c.args[per_call:])), c.constexprs)
        named = dict(zip(names[:per_call], c.args[:per_call]))
        launched.clear()
        plan.launch(**named)  # through the JIT, which keeps the compiled kernel
        plan.launch(**named)  # through Triton's compiled entry
        assert len(launched) == 1, c.kernel.__name__
        _, signature, call = launched[0]
        grid, args = call[:3], call[9:]
        assert grid == c.grid + (1,) * (3 - len(c.grid)), c.kernel.__name__
        assert len(args) == len(signature), (c.kernel.__name__, len(args), len(signature))
        wrong = [(name, ty) for (name, ty), value in zip(signature.items(), args) if not _accepts(ty, value)]
        assert not wrong, (c.kernel.__name__, wrong)


@pytest.mark.parametrize("per_call,static,constexprs,named", [
    (("p0",), {"p1": 1}, {"p3": 0}, "'p2'"),  # a runtime argument missing
    (("p0",), {"p1": 1, "p2": 2, "q": 3}, {"p3": 0}, "'q'"),  # an unknown one
    (("p0",), {"p1": 1, "p2": 2}, {}, "'p3'"),  # a constexpr missing
    (("p0",), {"p1": 1, "p2": 2}, {"p3": 0, "P4": 1}, "'P4'"),  # an unknown constexpr
    (("p0",), {"p1": 1, "p2": 2, "p3": 3}, {}, "'p3'"),  # a constexpr passed as a runtime argument
    (("p1",), {"p0": 1, "p2": 2}, {"p3": 0}, "'p1'"),  # per-call tensors not the leading parameters
    (("p0", "p0"), {"p2": 2}, {"p3": 0}, "'p1'"),  # a per-call name twice
    (("p0",), {"p0": 0, "p1": 1, "p2": 2}, {"p3": 0}, "'p0'"),  # a per-call name given a static value too
], ids=["missing", "unknown", "missing-constexpr", "unknown-constexpr", "constexpr-as-runtime", "per-call-order",
        "per-call-doubled", "per-call-twice"])
def test_a_plan_refuses_a_wrong_argument_name_naming_it(on_a_gpu, per_call, static, constexprs, named):
    kernel = FakeKernel(False, False, False, True)
    with pytest.raises(TypeError, match=named):
        launching.LaunchPlan(kernel, (1,), {}, per_call, static, constexprs)
    assert kernel.log == []


@pytest.mark.parametrize("kernel", [draft_attention_kernel, merge_segments_kernel, context_kv_kernel],
                         ids=lambda k: k.__name__)
def test_parameter_names_are_read_as_the_jit_declares_them(kernel):
    from triton.runtime.jit import JITFunction
    params = JITFunction(kernel.fn).params
    runtime, constexprs = launching.kernel_parameters(kernel)
    assert runtime + constexprs == tuple(p.name for p in params)
    assert all(not p.is_constexpr for p in params[:len(runtime)])


def test_kept_tensors_are_specialised_again_only_when_another_object_comes(on_a_gpu, monkeypatch):
    """A plan's kept tensors (its own weights, tables, scratch) are specialised once per
    object; a different object (here misaligned) is specialised again."""
    kernel = FakeKernel(False, False, True)
    plan = launching.LaunchPlan(kernel, (1,), {}, ("p0", "p1"), {}, {"p2": 0}, kept=("p1",))
    w = torch.zeros(64)
    calls = []
    real = launching.tensor_specialization
    monkeypatch.setattr(launching, "tensor_specialization", lambda t, amd: calls.append(len(t)) or real(t, amd))
    plan.launch(p0=torch.zeros(64), p1=w)
    plan.launch(p0=torch.zeros(64), p1=w)
    plan.launch(p0=torch.zeros(64), p1=w[1:])  # another object, 4 bytes off 16: another kernel
    plan.launch(p0=torch.zeros(64), p1=w[1:])  # another object again, specialised as the last
    assert [entry[0] for entry in kernel.log] == ["jit", "compiled", "jit", "compiled"]
    assert calls == [1, 1, 1, 1, 1, 1, 1]  # kept: on calls 1, 3 and 4; the dynamic tensor on every call


def test_plans_keeping_different_parameters_never_share_a_specialisation(on_a_gpu):
    kernel = FakeKernel(False, False, True)
    a, b = torch.zeros(64), torch.zeros(64).half()
    first = launching.LaunchPlan(kernel, (1,), {}, ("p0", "p1"), {}, {"p2": 0}, kept=("p1",))
    second = launching.LaunchPlan(kernel, (1,), {}, ("p0", "p1"), {}, {"p2": 0}, kept=("p0",))
    assert first.specialization((a, b)) != second.specialization((b, a))
    with pytest.raises(TypeError, match="'p2'"):
        launching.LaunchPlan(kernel, (1,), {}, ("p0", "p1"), {}, {"p2": 0}, kept=("p2",))
