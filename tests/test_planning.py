"""One planning record (dflash_rocm.planning): everything a plan may read, and the key of
dispatch's plan cache.

- Each field of the record, changed alone by what it stands for (the environment, the
  engine settings, torch's flag, the platform, ...), makes a new plan; the same call again
  makes none.
- No implementation's ``plan()``, no backend's reasons and not dispatch's choice (nor what
  they call, walked with ``ast``) reads the environment, the settings, torch's global
  flags, the device or the platform by itself; the only reads beside the record are what
  ``dflash_rocm.process`` declares (checked by identity, not by name).
- A plan receives the record and the call's facts, never its tensors, and returns a
  ``Runner``; a record cannot be changed once built.
"""

import ast
import dataclasses
import contextlib
import inspect
import os
import textwrap
import types

import pytest
import torch

from dflash_rocm import dispatch, envs, planning, platform, process, registry, tuning
from dflash_rocm.backend import Runner
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.ops.attention import attention_call
from dflash_rocm.ops.precompute import precompute_call
from dflash_rocm.planning import PlanningRecord, TensorFacts, record_for
from test_validation import attention_args, precompute_args


def attention(**changes):
    args = {**attention_args(), **changes}
    positional = [args.pop(n) for n in ("query", "key_cache", "value_cache", "block_table", "query_start_loc",
                                         "seq_lens")]
    return attention_call(*positional, **args)


def misaligned_caches() -> dict:
    """The caches of attention_args() at an address 4 bytes off 16 (same structure)."""
    args = attention_args()
    moved = {}
    for name in ("key_cache", "value_cache"):
        t = args[name]
        buffer = torch.empty(t.numel() + 4)
        moved[name] = buffer[1:1 + t.numel()].view(t.shape).copy_(t)
    return moved


@contextlib.contextmanager
def engine(**changes):
    before = planning.engine_settings()
    planning.configure_engine(**changes)
    try:
        yield
    finally:
        planning.configure_engine(**before._asdict())


@contextlib.contextmanager
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def env(name, value):
    with pytest.MonkeyPatch.context() as m:
        m.setenv(name, value)
        yield


# Each field of the record and a change of what it stands for (the same attention call otherwise).
CHANGES = {
    "op": lambda: (PRECOMPUTE, precompute_call(*precompute_args().values()), "triton", contextlib.nullcontext()),
    "backend": lambda: (ATTENTION, attention(), "reference", contextlib.nullcontext()),
    "structure": lambda: (ATTENTION, attention(scale=0.5), "triton", contextlib.nullcontext()),
    "bounds": lambda: (ATTENTION, attention(max_seq_len=16, validate=False), "triton", contextlib.nullcontext()),
    "memory": lambda: (ATTENTION, attention(**misaligned_caches()), "triton", contextlib.nullcontext()),
    "simulated": lambda: (ATTENTION, attention(), "triton", platform.simulate_platform("gfx942")),
    "environment": lambda: (ATTENTION, attention(), "triton", env(envs.TAIL_MERGE.name, "off")),
    "settings": lambda: (ATTENTION, attention(), "triton", engine(query_limit=7)),
    "tuning": lambda: (ATTENTION, attention(), "triton", _tables_changed()),
    "deterministic": lambda: (ATTENTION, attention(), "triton", deterministic()),
}


@contextlib.contextmanager
def _tables_changed():
    tuning.tables_changed()
    yield


def test_every_field_of_the_record_is_covered_below():
    # (the device is in the structure too: a call on another device changes both; its own test is below)
    assert set(CHANGES) | {"device"} == set(PlanningRecord._fields)


def test_the_record_finds_its_platform_from_its_device_and_the_simulated_one():
    """A record holds the call's device and the simulated platform, and its platform is
    found from those two when a plan reads it (never from what is simulated later)."""
    call = attention()
    plain = planning.planning_record(ATTENTION.name, "triton", call)
    with platform.simulate_platform("gfx942") as simulated:
        pinned = planning.planning_record(ATTENTION.name, "triton", call)
    assert plain.device == pinned.device == call.device
    assert plain.platform == platform.CPU_PLATFORM and pinned.platform == simulated
    elsewhere = plain._replace(device=torch.device("xpu"))
    assert elsewhere != plain and elsewhere.platform.vendor == "xpu"


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_changing_one_field_of_the_record_makes_a_new_plan(monkeypatch, field):
    monkeypatch.setattr(dispatch, "_plans", {})
    base = dispatch.planned(ATTENTION, attention(), "triton")
    assert dispatch.planned(ATTENTION, attention(), "triton") is base, "the same record: the kept plan"
    op, call, backend, context = CHANGES[field]()
    with context:
        record = planning.planning_record(op.name, backend, call)
        changed = [f for f in PlanningRecord._fields
                   if getattr(record, f) != getattr(next(iter(dispatch._plans)), f)]
        made = dispatch.planned(op, call, backend)
    assert field in changed, f"{field} did not change the record ({changed})"
    assert made is not base and len(dispatch._plans) == 2


def test_configure_and_tuning_need_no_forgetting(monkeypatch):
    """What ``configure`` sets and what tuning finds are in the record: a plan made before
    is not handed out after, though no plan was dropped."""
    monkeypatch.setattr(dispatch, "_plans", {})
    before = dispatch.planned(ATTENTION, attention(), "triton")
    with engine(batch_limit=3):
        assert dispatch.planned(ATTENTION, attention(), "triton") is not before
    tuning.tables_changed()
    assert dispatch.planned(ATTENTION, attention(), "triton") is not before
    assert len(dispatch._plans) == 3


# ---- a plan reads nothing but its record ----------------------------------------------

FORBIDDEN = {
    id(os.environ): "os.environ", id(os.getenv): "os.getenv", id(os.environ.get): "os.environ.get",
    id(torch.are_deterministic_algorithms_enabled): "torch.are_deterministic_algorithms_enabled",
    id(platform.platform_for): "platform_for", id(platform.simulated_platform): "simulated_platform",
    id(planning.switches): "planning.switches", id(planning.environment): "planning.environment",
    id(planning.engine_settings): "the engine settings",
    id(planning.planning_record): "planning_record", id(planning.record_for): "record_for",
    id(torch.cuda.get_device_capability): "the device's capability",
}


def _resolve(node, scope: dict, owner):
    """The object an ``ast.Name``/``ast.Attribute`` stands for in ``scope`` (None: a local)."""
    if isinstance(node, ast.Name):
        if node.id == "cls" and owner is not None:
            return owner
        return scope.get(node.id, getattr(__builtins__, node.id, None) if not isinstance(__builtins__, dict)
                         else __builtins__.get(node.id))
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope, owner)
        return None if base is None else getattr(base, node.attr, None)
    return None


def direct_reads(fn, owner=None, seen=None) -> list[str]:
    """What ``fn`` and every function of the package it calls read of the environment,
    the settings, torch's flags or the platform (see FORBIDDEN), as "where: what"."""
    seen = set() if seen is None else seen
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    if not isinstance(fn, types.FunctionType) or fn.__code__ in seen:
        return []
    seen.add(fn.__code__)
    if not fn.__module__.startswith("dflash_rocm"):
        return []
    scope = dict(fn.__globals__)
    if fn.__closure__:
        scope.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
    try:
        source = inspect.getsource(fn)
    except OSError:  # generated code (a dataclass's __init__): assignments of its arguments
        return []
    tree = ast.parse(textwrap.dedent(source))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Name, ast.Attribute)):
            continue
        obj = _resolve(node, scope, owner)
        where = f"{fn.__module__}.{fn.__qualname__}"
        if obj is None:
            continue
        if obj is envs or isinstance(obj, envs.EnvVar):
            found.append(f"{where}: {ast.unparse(node)}")
        elif id(obj) in FORBIDDEN:
            found.append(f"{where}: {FORBIDDEN[id(obj)]}")
        elif process.read_beside_the_record(obj):
            continue
        elif isinstance(obj, type) and obj.__module__.startswith("dflash_rocm"):
            found += direct_reads(obj.__init__, obj, seen)
        elif callable(obj):
            found += direct_reads(obj, owner if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "cls"
                                  else None, seen)
    return found


def implementations():
    found = []
    for name in registry.NAMES:
        cls = registry.load(name)
        if cls is not None:
            found += [(f"{name}.{impl.__name__}", impl) for impl in cls.implementations]
    return found


@pytest.mark.parametrize("name,impl", implementations(), ids=[n for n, _ in implementations()])
def test_no_plan_reads_the_environment_or_settings_itself(name, impl):
    assert direct_reads(impl.plan, impl) == []


def backends():
    return [cls for cls in map(registry.load, registry.NAMES) if cls is not None]


@pytest.mark.parametrize("cls", backends(), ids=lambda cls: cls.name)
def test_no_backend_reasons_read_beyond_the_record(cls):
    """The backend choice is planning too (its answer is kept under the record): every
    reason a backend gives reads the record's platform and switches, nothing else."""
    reads = direct_reads(cls.not_supported_reasons, cls) + direct_reads(cls.device_not_supported_reasons, cls)
    for impl in cls.implementations:
        reads += direct_reads(impl.not_supported_reasons, impl)
    assert reads == []


def test_the_choice_reads_only_the_record():
    assert direct_reads(dispatch.choose) == []


def test_the_walk_exempts_declared_reads_only():
    """The reads a plan may make beside its record are declared objects, not names: a
    function of the same name as a declared one is walked like any other."""
    from dflash_rocm.backends.cuda import flash_attention

    def load_flash_attention():
        return torch.are_deterministic_algorithms_enabled()

    load_flash_attention.__module__ = "dflash_rocm.fake"

    def plan(record):
        return load_flash_attention(), flash_attention.load_flash_attention()

    plan.__module__ = "dflash_rocm.fake"
    assert direct_reads(plan) == ["dflash_rocm.fake.test_the_walk_exempts_declared_reads_only.<locals>."
                                  "load_flash_attention: torch.are_deterministic_algorithms_enabled"]


def test_a_record_refuses_attribute_assignment():
    record = planning.planning_record(ATTENTION.name, "triton", attention())
    with pytest.raises(AttributeError):
        record.call = attention()
    with pytest.raises(AttributeError):
        record.platform = None
    assert hash(record) == hash(planning.planning_record(ATTENTION.name, "triton", attention()))


def test_a_changed_aiter_switch_reaches_the_choice(monkeypatch):
    """DFLASH_ROCM_AITER is read from the record: after a probe under ``auto``, ``0`` makes a
    choice that says aiter is disabled (the installed aiter is probed once per process)."""
    from dflash_rocm.backends.aiter import attention as aiter_attention

    monkeypatch.setattr(dispatch, "_plans", {})
    monkeypatch.setattr(aiter_attention.importlib.util, "find_spec", lambda name: None)
    aiter_attention.installed.cache_clear()
    try:
        with platform.simulate_platform("gfx942"):
            monkeypatch.setenv(envs.AITER.name, "auto")
            with pytest.raises(dispatch.BackendUnavailable) as auto:
                dispatch.planned(ATTENTION, attention(), "aiter")
            monkeypatch.setenv(envs.AITER.name, "0")
            with pytest.raises(dispatch.BackendUnavailable) as off:
                dispatch.planned(ATTENTION, attention(), "aiter")
    finally:
        aiter_attention.installed.cache_clear()
    assert "not installed" in str(auto.value) and "disabled" not in str(auto.value)
    assert "disabled" in str(off.value)


def test_the_walk_finds_a_read_however_deep():
    def helper():
        return envs.TAIL_MERGE.setting()

    def plan(record):
        return helper() and torch.are_deterministic_algorithms_enabled()

    plan.__module__ = helper.__module__ = "dflash_rocm.fake"
    reads = direct_reads(plan)
    assert any("TAIL_MERGE" in r for r in reads) and any("deterministic" in r for r in reads)


def test_a_plan_receives_facts_not_tensors():
    call = attention()
    record, facts = record_for(ATTENTION.name, "triton", call)
    assert isinstance(record, PlanningRecord) and isinstance(record, tuple)
    for name, value in ((f.name, getattr(facts, f.name)) for f in dataclasses.fields(facts)):
        assert not isinstance(value, torch.Tensor), name
    assert isinstance(facts.query, TensorFacts) and facts.query.stride() == call.query.stride()
    assert facts.num_tokens == call.num_tokens and facts.key_cache.data_ptr() == call.key_cache.data_ptr() & 15
    assert facts.key_cache.untyped_storage().nbytes() == call.key_cache.untyped_storage().nbytes()
    with pytest.raises(TypeError, match="no address"):
        facts.query.data_ptr()
    pre = precompute_call(*precompute_args().values())
    pre_facts = record_for(PRECOMPUTE.name, "triton", pre).facts
    assert pre_facts.key_caches[0].data_ptr() == pre.key_caches[0].data_ptr()  # the structure holds them
    assert not any(isinstance(v, torch.Tensor) for v in vars(pre_facts.weights).values())
    assert pre_facts.weights.hidden_size == pre.weights.hidden_size


def test_a_plan_that_is_not_a_runner_is_refused(monkeypatch):
    from dflash_rocm.backends.triton import TritonAttention

    monkeypatch.setattr(dispatch, "_plans", {})
    monkeypatch.setattr(TritonAttention, "plan", classmethod(lambda cls, record, facts: (lambda call: None)))
    with pytest.raises(TypeError, match="TritonAttention.plan returned function; a plan is a"):
        dispatch.planned(ATTENTION, attention(), "triton")


def test_every_implementation_plans_a_runner():
    for name, impl in implementations():
        if impl.op is ATTENTION and name.startswith(("reference", "cpu")):
            assert isinstance(impl.plan(*record_for(ATTENTION.name, name.split(".")[0], attention())), Runner)
