"""CUDA graph capture, on CPU: both operations planned with a capture's metadata and replayed.

A FULL CUDA graph (vLLM's V2 runner captures the draft's precompute and attention) replays
the same launches over new values written in place: new block tables, sequence lengths,
slots and positions. Here the capture is simulated by making
:func:`dflash_rocm.capture.graph_capturing`, the one predicate every backend asks, say
yes: then no first-call work may run or be kept for later calls. Then a plan made with
capture-time bounds (``max_seq_len = max_model_len``) is run over much shorter real
sequences written into the same tensors, as replays would, against the reference.
"""

import ast
import contextlib
import logging
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import dflash_rocm
from checks import poison, rel_err
from dflash_rocm import capture, dispatch, launches, registry
from dflash_rocm.backend import Runner
from dflash_rocm.capture import CaptureSupport
from dflash_rocm.contract import spec_tolerance
from dflash_rocm.derived import DerivedCache
from dflash_rocm.dispatch import BackendUnavailable
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.ops.attention import attention_call
from dflash_rocm.ops.precompute import precompute_call
from dflash_rocm.platform import simulate_platform
from dflash_rocm.workloads import DraftShape, attention_inputs, precompute_inputs
from strategies import make_generator
from support import needs_interpreter

SHAPE = DraftShape("capture", hidden=64, layers=2, q_heads=4, kv_heads=2, head_dim=32, block_tokens=4)
WINDOWED = replace(SHAPE, name="capture-swa-sinks", sliding_window=40, sinks=True, causal=True)
MAX_MODEL_LEN = 4096


@contextlib.contextmanager
def graph_capture(monkeypatch):
    """Inside the block every device counts as capturing a CUDA graph."""
    with monkeypatch.context() as m:
        m.setattr(capture, "graph_capturing", lambda device: True)
        yield


# ---- nothing first-call, nothing kept while capturing -------------------------------------

@needs_interpreter
def test_split_work_captured_without_kept_scratch_merges_in_the_same_launch(monkeypatch):
    """A capture on a stream with no kept arrival counters (or sums) zeroes them inside the
    graph and keeps nothing (what a capture allocates is the graph's): the launches are
    the ones an eager call makes, whatever the capture finds."""
    from dflash_rocm.backends.triton import counters, launcher, precompute
    from dflash_rocm.backends.triton.launch_config import PrecomputeLaunchConfig

    monkeypatch.setattr(counters, "_KEPT", {})
    inputs = attention_inputs(SHAPE, 1, 3000, torch.float16, torch.float16, torch.device("cpu"))
    ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
    pre = precompute_inputs(SHAPE, 40, torch.float16, torch.float16, torch.device("cpu"))
    pre_call = precompute_call(pre.states, pre.positions, pre.weights, None, None, None, return_kv=True)
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(pre.states, pre.positions, pre.weights, None, None,
                                                               None, return_kv=True, backend="reference")
    launched, run_launch = [], launcher.LaunchPlan.launch

    def recording(plan, **tensors):
        launched.append((plan.name, plan.constexprs))
        return run_launch(plan, **tensors)

    monkeypatch.setattr(launcher.LaunchPlan, "launch", recording)
    precompute.fused_weights(pre.weights)  # vLLM's eager run of each size before its capture
    with simulate_platform("gfx942"), graph_capture(monkeypatch):
        out = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="rocm")
        k, v = precompute.run_precompute(pre_call, PrecomputeLaunchConfig(block_t=16, block_k=16, split_k=2))
    assert counters._KEPT == {}
    assert [name for name, _ in launched] == ["draft_attention_kernel", "context_kv_kernel"]
    (_, attention), (_, context_kv) = launched
    assert attention["SPLIT"] and (attention["MERGE_IN_KERNEL"] or attention["MERGERS"]), "split, merged in launch"
    assert context_kv["SPLIT_K"] == 2 and context_kv["MERGE_IN_KERNEL"]
    assert rel_err(out, ref) <= spec_tolerance(torch.float16, torch.float16)
    assert max(rel_err(k, ref_k), rel_err(v, ref_v)) <= spec_tolerance(torch.float16, torch.float16)


@needs_interpreter
def test_a_precompute_first_called_in_a_capture_builds_its_cache_table_for_that_graph_alone(monkeypatch):
    """The cache table is a host-to-device copy, which a capture cannot record: the graph
    writes it by fills, and neither it nor the plan holding it is kept; the first eager
    call then builds the table that later calls share."""
    from dflash_rocm.backends.triton import precompute

    monkeypatch.setattr(precompute, "_TABLES", OrderedDict())
    inputs = precompute_inputs(SHAPE, 24, torch.float16, torch.float16, torch.device("cpu"))
    ref_k, ref_v = dflash_rocm.precompute_and_store_context_kv(inputs.states, inputs.positions, inputs.weights,
                                                               None, None, None, return_kv=True, backend="reference")
    precompute.fused_weights(inputs.weights)  # derived weights are never built in a capture
    with graph_capture(monkeypatch):
        dflash_rocm.precompute_and_store_context_kv(*inputs.args(), backend="triton")
    assert not precompute._TABLES
    bs = inputs.key_caches[0].shape[1]
    rows = inputs.slot_mapping.long()
    for layer in range(SHAPE.layers):
        for cache, ref in ((inputs.key_caches[layer], ref_k[layer]), (inputs.value_caches[layer], ref_v[layer])):
            assert rel_err(cache[rows // bs, rows % bs], ref) <= spec_tolerance(torch.float16, torch.float16)
    dflash_rocm.precompute_and_store_context_kv(*inputs.args(), backend="triton")
    assert len(precompute._TABLES) == 1


def test_a_capture_derives_nothing_it_finds_the_value_refilled_before_it(monkeypatch):
    """Nothing derives weights while a graph is captured: a capture that finds no current
    value is refused (a ValueError, before anything is written) and leaves the kept value
    as it was; after ``refill_derived()`` (where a weight update ends) the capture finds the
    kept value, refilled at its address."""
    from dflash_rocm.derived import DerivedNotReady, refill_derived

    cache, builds = DerivedCache(), []
    a = torch.ones(4)

    def build(source):
        builds.append(1)
        return source * 2

    kept = cache.get((a,), "t", build, a)
    a.mul_(5)  # an in-place update
    with graph_capture(monkeypatch), pytest.raises(DerivedNotReady):
        cache.get((a,), "t", build, a)
    assert len(builds) == 1 and torch.equal(kept, torch.full((4,), 2.0))
    assert refill_derived() >= 1 and len(builds) == 2
    with graph_capture(monkeypatch):
        assert cache.get((a,), "t", build, a) is kept
    assert len(builds) == 2 and torch.equal(kept, torch.full((4,), 10.0))


def test_a_structure_first_checked_in_a_capture_keeps_no_scale_tensor(monkeypatch):
    """fp8 scales given as floats become device tensors made once per call structure; made
    in a capture, such a tensor holds its value only once the graph replays."""
    g = make_generator(0, "cpu")
    query = torch.randn(4, 4, 16, generator=g)
    key_cache = torch.randn(3, 16, 2, 16, generator=g).to(torch.float8_e4m3fn)
    value_cache = torch.randn(3, 16, 2, 16, generator=g).to(torch.float8_e4m3fn)
    args = (query, key_cache, value_cache, torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32), torch.tensor([20], dtype=torch.int32))
    pre = precompute_inputs(SHAPE, 8, torch.float32, torch.float8_e4m3fn, torch.device("cpu"))
    calls = ((attention_call, args, dict(k_scale=0.37, v_scale=0.41), "k_scale"),
             (precompute_call, pre.args(), dict(k_scales=[0.5, 0.25], v_scales=[0.5, 0.25]), "k_scales"))
    for build, call_args, kwargs, name in calls:
        with graph_capture(monkeypatch):
            captured = getattr(build(*call_args, **kwargs), name)
        eager = getattr(build(*call_args, **kwargs), name)
        assert eager is not captured and getattr(build(*call_args, **kwargs), name) is eager, name


# ---- what each runner declares, applied where a capture meets a structure without a plan ----

def runner_classes() -> list[type[Runner]]:
    """Every Runner class of the package and of every backend that imports here."""
    for name in registry.NAMES:
        registry.load(name)
    found, todo = [], [Runner]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("dflash_rocm") and sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


@pytest.mark.parametrize("cls", runner_classes(), ids=lambda cls: cls.__qualname__)
def test_every_runner_declares_its_capture_support_itself(cls):
    """Declared in the class's own body, not inherited: a new runner must say what a
    capture may keep of it."""
    assert isinstance(cls.__dict__.get("capture_support"), CaptureSupport), cls


def test_the_docs_table_of_capture_support_is_the_runners_declarations():
    """docs/backends.md's table names every runner class once, with its declared value."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "backends.md").read_text()
    section = text.split("### CUDA graphs", 1)[1]
    documented = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("| `") and len(cells) == 3:
            for name in cells[0].replace("`", "").split(", "):
                documented[name] = cells[2]
    assert documented == {cls.__name__: cls.capture_support.value for cls in runner_classes()}


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """No kept plans, nothing said yet about plans made in a capture."""
    monkeypatch.setattr(dispatch, "_plans", {})
    monkeypatch.setattr(dispatch, "_said_in_capture", set())


@needs_interpreter
def test_always_a_plan_made_in_a_capture_is_kept(monkeypatch, fresh_dispatch):
    """A precompute that neither writes nor returns launches nothing (ALWAYS): the plan a
    capture makes is the one the next eager call finds."""
    pre = precompute_inputs(SHAPE, 8, torch.float16, torch.float16, torch.device("cpu"))
    call = precompute_call(pre.states, pre.positions, pre.weights, None, None, None)
    with graph_capture(monkeypatch):
        captured = dispatch.planned(PRECOMPUTE, call, "triton")
    assert type(captured.run.__self__).capture_support is CaptureSupport.ALWAYS
    assert dispatch.planned(PRECOMPUTE, call, "triton") is captured


@needs_interpreter
def test_after_eager_call_a_plan_made_in_a_capture_serves_it_alone_and_says_so_once(monkeypatch, caplog,
                                                                                     fresh_dispatch):
    """The Triton attention's plan makes its scratch on a stream's first call
    (AFTER_EAGER_CALL): planned in a capture, it is made again by the next call, and one
    log line asks for an eager call first; planned eagerly, a capture finds it."""
    inputs = attention_inputs(SHAPE, 1, 300, torch.float16, torch.float16, torch.device("cpu"))
    call = attention_call(*inputs.args(), **inputs.kwargs)
    with graph_capture(monkeypatch), caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        first = dispatch.planned(ATTENTION, call, "triton")
        second = dispatch.planned(ATTENTION, call, "triton")
    assert type(first.run.__self__).capture_support is CaptureSupport.AFTER_EAGER_CALL
    assert second is not first and caplog.text.count("make one eager call") == 1
    eager = dispatch.planned(ATTENTION, call, "triton")
    assert eager is not second
    with graph_capture(monkeypatch):
        assert dispatch.planned(ATTENTION, call, "triton") is eager


def test_never_a_capture_is_refused_before_anything_is_written(monkeypatch, fresh_dispatch):
    """The reference reads the call on the host (NEVER): inside a capture the call is
    refused by name and ``out`` keeps what it held."""
    inputs = attention_inputs(SHAPE, 1, 40, torch.float16, torch.float16, torch.device("cpu"))
    out = torch.full_like(inputs.query, 7.0)
    with graph_capture(monkeypatch), pytest.raises(BackendUnavailable, match="capture_support NEVER"):
        dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, out=out, backend="reference")
    assert torch.all(out == 7.0)
    dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, out=out, backend="reference")
    assert not torch.all(out == 7.0)



def test_never_a_capture_that_finds_a_plan_kept_from_an_eager_call_is_refused(monkeypatch, fresh_dispatch):
    """An eager call keeps the reference's plan; a capture that then finds it is refused
    all the same, before anything is written."""
    inputs = attention_inputs(SHAPE, 1, 40, torch.float16, torch.float16, torch.device("cpu"))
    out = torch.zeros_like(inputs.query)
    dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, out=out, backend="reference")
    out.fill_(7.0)
    with graph_capture(monkeypatch), pytest.raises(BackendUnavailable, match="capture_support NEVER"):
        dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, out=out, backend="reference")
    assert torch.all(out == 7.0)

# Where the predicate may be asked, and why (everyone else keeps through keep_unless_captured
# or refuses through refuse_in_capture).
ASKS_THE_PREDICATE = {
    "dflash_rocm/capture.py": "defines it and the two rules",
    "dflash_rocm/process.py": "names it as a read plans may make beside their record",
    "dflash_rocm/dispatch.py": "applies the runners' declarations (kept, not kept, refused)",
    "backends/triton/precompute.py": "a capture cannot record the cache table's host copy: written by fills",
    "backends/aiter/attention.py": "aiter's first-use check reads on the host: the Triton kernel serves the graph",
}


def test_only_the_listed_modules_ask_whether_a_graph_is_captured():
    """Code (not prose) naming ``graph_capturing`` sits only where ASKS_THE_PREDICATE says: a
    new ad-hoc branch fails here."""
    root = Path(__file__).resolve().parent.parent
    asking = set()
    for folder in ("dflash_rocm", "backends"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                named = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                         else node.name if isinstance(node, (ast.FunctionDef, ast.alias)) else None)
                if named == "graph_capturing":
                    asking.add(path.relative_to(root).as_posix())
    assert asking == set(ASKS_THE_PREDICATE)


# ---- a plan made with capture-time bounds, replayed over short real sequences ---------------

# (backend, simulated architecture): reference and cpu read the tensors on the host; the
# Triton kernels split keys into segments chosen for the planned span (sm_90's portable
# table, the ROCm tables) and decide on the device how many have keys.
TARGETS = [("reference", None), ("cpu", None), pytest.param("triton", None, marks=needs_interpreter),
           pytest.param("triton", "sm_90", marks=needs_interpreter),
           pytest.param("rocm", "gfx942", marks=needs_interpreter),
           pytest.param("rocm", "gfx1201", marks=needs_interpreter)]
# Real contexts per replay (requests of one captured batch): empty, short, on a segment
# edge, across a window, at the planned span's end.
REPLAYS = ((0, 37, 1000), (255, 256, 257), (MAX_MODEL_LEN - SHAPE.block_tokens, 5, 600))


def write_replay(inputs, contexts, seed: int) -> None:
    """One replay's batch written in place into the captured tensors, as a serving engine
    prepares its graph inputs: real sequence lengths, other cache blocks in the block
    table, new queries (every request keeps its query block: ``query_start_loc`` is
    rewritten with the same offsets)."""
    g = make_generator(seed, "cpu")
    q_len = inputs.query.shape[0] // len(contexts)
    inputs.seq_lens.copy_(torch.tensor(contexts) + q_len)
    inputs.query_start_loc.copy_(torch.arange(len(contexts) + 1) * q_len)
    table = inputs.block_table
    table.copy_(torch.randperm(inputs.key_cache.shape[0], generator=g)[:table.numel()].view(table.shape))
    inputs.query.copy_(torch.randn(inputs.query.shape, generator=g))


@pytest.mark.parametrize("shape", [SHAPE, WINDOWED], ids=lambda s: s.name)
@pytest.mark.parametrize("backend,arch", TARGETS)
def test_a_plan_made_for_max_model_len_serves_every_shorter_replay(backend, arch, shape):
    """Planned with vLLM's capture metadata (``max_seq_len = max_model_len``, ``max_query_len``
    the draft's block) over tensors sized for it, then run over several batches of much
    shorter real sequences written into the same tensors: each run agrees with the
    reference on that run's values, every output row written."""
    batch = len(REPLAYS[0])
    inputs = attention_inputs(shape, batch, MAX_MODEL_LEN - shape.block_tokens, torch.float16, torch.float16,
                              torch.device("cpu"))
    kwargs = dict(inputs.kwargs, max_seq_len=MAX_MODEL_LEN, max_query_len=shape.block_tokens)
    out = torch.empty_like(inputs.query)
    with simulate_platform(arch) if arch else contextlib.nullcontext():
        plan = dflash_rocm.plan_draft_attention(*inputs.args(), **kwargs, out=out, backend=backend)
        if arch and shape.sliding_window is None:  # split for the planned span: segments the replays leave empty
            with launches.capture() as recorded:
                plan.run(inputs.query, inputs.key_cache, inputs.value_cache, out=out)
            main = recorded[0]
            assert main.arg("num_segments") * main.arg("min_segment_keys") > max(REPLAYS[0]) + shape.block_tokens
        for seed, contexts in enumerate(REPLAYS):
            write_replay(inputs, contexts, seed)
            poison(out)
            plan.run(inputs.query, inputs.key_cache, inputs.value_cache, out=out)
            ref = dflash_rocm.draft_attention(*inputs.args(), **inputs.kwargs, backend="reference")
            err = rel_err(out, ref)
            assert err <= spec_tolerance(torch.float16, torch.float16), f"{backend} replay {contexts}: {err:.2e}"


@pytest.mark.parametrize("backend,arch", TARGETS)
def test_a_context_kv_plan_serves_replays_with_new_states_positions_and_slots(backend, arch):
    """The precompute's plan (weights and caches taken once) run over new states, positions
    and slot mappings written into the same tensors, padding rows on slot -1 as a captured
    batch pads them: each run writes what the reference writes, and nothing else."""
    inputs = precompute_inputs(SHAPE, 24, torch.float16, torch.float16, torch.device("cpu"))
    caches = inputs.key_caches + inputs.value_caches
    capacity = caches[0].shape[0] * caches[0].shape[1]
    with simulate_platform(arch) if arch else contextlib.nullcontext():
        plan = dflash_rocm.plan_context_kv(inputs.weights, inputs.key_caches, inputs.value_caches, backend=backend)
        for seed, padding in enumerate((0, 7, 24)):
            g = make_generator(seed + 100, "cpu")
            inputs.states.copy_(torch.randn(inputs.states.shape, generator=g))
            inputs.positions.copy_(torch.randint(0, 4096, inputs.positions.shape, generator=g))
            slots = torch.randperm(capacity, generator=g)[:inputs.slot_mapping.numel()]
            slots[slots.numel() - padding:] = -1
            inputs.slot_mapping.copy_(slots)
            for c in caches:
                c.zero_()
            plan.run(inputs.states, inputs.positions, inputs.slot_mapping)
            expected = [torch.zeros_like(c) for c in caches]
            dflash_rocm.precompute_and_store_context_kv(inputs.states, inputs.positions, inputs.weights,
                                                        expected[:SHAPE.layers], expected[SHAPE.layers:],
                                                        inputs.slot_mapping, backend="reference")
            for got, want in zip(caches, expected):
                assert rel_err(got, want) <= spec_tolerance(torch.float16, torch.float16), (backend, seed)
                assert torch.equal(got == 0, want == 0), (backend, seed)  # the same rows written
