"""From a call to its plan: a priority walk over the registry, reasons for every no, and
the one plan cache.

``auto`` takes the first backend of the platform's priority list (``registry.PRIORITIES``)
that supports the call; a named backend that cannot serve raises
:class:`BackendUnavailable` with its reasons. The chosen backend's implementation then
plans the call (:meth:`dflash_rocm.backend.Implementation.plan`) from its planning
record (:mod:`dflash_rocm.planning`: the op, the backend asked for, the call's structure,
host bounds and alignment, the platform, the planning switches, the engine settings, the
tuned tables' generation, determinism), and the plan is kept in one cache keyed by that
record: every call of :func:`dflash_rocm.draft_attention`,
:func:`dflash_rocm.plan_draft_attention` and their precompute pair is "get or make the
plan, run it". A plan first made while a CUDA graph is captured is kept, not kept or
refused as its runner declares (:func:`kept_from_capture`). The cache is bounded (the
precompute's keys hold cache addresses, the attention's its host bounds). Each new (op,
backend, call summary) is logged once with the reasons of the backends passed over, and
every served call is counted (``dispatch_counts()``), which is how tests and users confirm
what ran. All shared state is guarded by one lock.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any, Mapping

import torch

from . import capture, envs, planning, registry
from .backend import SETTINGS, Backend, Runner
from .capture import CaptureSupport
from .ops import Op
from .planning import PlanningRecord, Switches, backend_variable, call_facts, configure_engine, planning_record
from .platform import Platform, platform_for

logger = logging.getLogger("dflash_rocm")


class BackendUnavailable(RuntimeError):
    """The requested backend (or every backend, for ``auto``) cannot serve this call: the
    message shows the call (every argument's shape and dtype, the scalars: ``call``) beside
    each backend's reasons, as xformers' dispatch errors do."""

    def __init__(self, backend: str, op: str, reasons: Mapping[str, list[str]], call: str = ""):
        self.backend, self.op, self.reasons, self.call = backend, op, dict(reasons), call
        lines = [f"{name}: {'; '.join(r)}" for name, r in self.reasons.items()]
        shown = "".join(f"\n     {line}" for line in call.splitlines())
        super().__init__(f"backend {backend!r} cannot serve {op}" + (f" for the call{shown}" if call else "")
                         + "\n  reasons:\n  " + "\n  ".join(lines))


class Planned:
    """A call structure's plan: the backend that serves it and its runner (what runs one
    call, and what it declares about CUDA graph capture)."""

    __slots__ = ("backend", "op", "runner", "run", "_counted")

    def __init__(self, backend: str, op: Op, runner: Runner):
        self.backend, self.op, self.runner, self.run = backend, op, runner, runner.run
        self._counted = (op.name, backend)

    def __call__(self, call):
        """Run ``call`` (of the planned structure) and count who served it."""
        result = self.run(call)
        with _lock:
            _counts[self._counted] += 1
        return result


_lock = threading.Lock()
_logged: set[tuple[str, str, str]] = set()
_said_in_capture: set[tuple[str, str]] = set()  # (op, backend) whose plans were first made in a capture
_counts: collections.Counter = collections.Counter()
PLANS_KEPT = 1024
_plans: dict[tuple, Planned] = {}


def resolve_name(backend: str | None) -> str:
    """``backend=`` wins, else ``DFLASH_ROCM_BACKEND``, else ``auto``; unknown names are refused."""
    return named_backend(backend, os.environ.get(envs.BACKEND.name))


def named_backend(backend: str | None, from_env: str | None) -> str:
    """:func:`resolve_name` with ``from_env``, ``DFLASH_ROCM_BACKEND`` as read (None: unset)."""
    if backend is None:
        return envs.BACKEND.parse(envs.BACKEND.text(from_env))  # a bad value: the variable's ValueError
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name != "auto" and name not in registry.MODULES:
        raise ValueError(f"backend= {backend!r} is not a backend; valid names: auto, {', '.join(registry.NAMES)}")
    return name


def reasons_for(name: str, op: Op, call) -> list[str]:
    """Why backend ``name`` cannot serve ``call`` of ``op`` here, under the planning switches
    now (empty: it can)."""
    return planned_reasons(name, op, call, platform_for(call.device), planning.switches())


def planned_reasons(name: str, op: Op, call, platform: Platform, switches: Switches) -> list[str]:
    """Why backend ``name`` cannot serve ``call`` of ``op`` on ``platform`` under the
    planning ``switches`` (empty: it can)."""
    cls = registry.load(name)
    if cls is None:
        return [registry.import_error(name) or "cannot import"]
    return cls.not_supported_reasons(op, call, platform, switches)


def planned(op: Op, call, backend: str | None, environment: tuple | None = None) -> Planned:
    """The plan of ``call`` for the requested ``backend`` (``None``: the environment's
    choice, else ``auto``): kept per planning record, made on first use. ``environment``:
    the planning variables as a plan object read them when it was made
    (:func:`dflash_rocm.planning.environment`; None: read them now)."""
    if backend is not None and type(backend) is not str:
        named_backend(backend, None)  # refused before it reaches the key (unhashable, a TypeError naming it)
    record = planning_record(op.name, backend, call, environment)
    if record.keepable:
        found = _plans.get(record)
        if found is not None:
            if found.runner.capture_support is CaptureSupport.NEVER and capture.graph_capturing(call.device):
                raise refused_in_capture(op, found.backend, found.runner, call)  # kept from an eager call
            return found
    facts = call_facts(call)
    chosen = choose(op, record, facts, named_backend(record.backend, backend_variable(record.environment)))
    impl = chosen.implementation(op)
    runner = impl.plan(record, facts)
    if not isinstance(runner, Runner):
        raise TypeError(f"{impl.__qualname__}.plan returned {type(runner).__name__}; a plan is a "
                        "dflash_rocm.backend.Runner")
    made = Planned(chosen.name, op, runner)
    keep = record.keepable
    if capture.graph_capturing(call.device):  # more than keep-or-not: the runners' declarations are applied here
        keep = kept_from_capture(op, chosen.name, runner, call) and keep
    if keep:
        with _lock:
            if len(_plans) >= PLANS_KEPT:
                _plans.clear()
            _plans[record] = made
    return made


def refused_in_capture(op: Op, name: str, runner: Runner, call) -> BackendUnavailable:
    """The refusal of a ``NEVER`` runner's call inside a CUDA graph capture."""
    return BackendUnavailable(name, op.name, {name: [
        f"{type(runner).__name__} cannot run inside a CUDA graph capture (capture_support NEVER: it reads "
        "the call's tensors on the host)"]}, call.describe())


def kept_from_capture(op: Op, name: str, runner: Runner, call) -> bool:
    """Whether a plan first made while a CUDA graph is captured may be kept, by what its
    runner declares (:class:`~dflash_rocm.capture.CaptureSupport`): ``ALWAYS``, yes;
    ``AFTER_EAGER_CALL``, no (it serves that graph alone; said once per op and backend);
    ``NEVER``, the call is refused (:class:`BackendUnavailable`, before anything is
    written). Consulted when a plan is made; a call that finds a kept ``NEVER`` plan inside
    a capture is refused the same way (:func:`planned`)."""
    support = runner.capture_support
    if support is CaptureSupport.NEVER:
        raise refused_in_capture(op, name, runner, call)
    if support is CaptureSupport.ALWAYS:
        return True
    with _lock:
        first = (op.name, name) not in _said_in_capture
        _said_in_capture.add((op.name, name))
    if first:
        logger.warning("%s on %s was first planned inside a CUDA graph capture: that plan serves the graph alone; "
                       "make one eager call of each call structure before capturing", op.name, name)
    return False


def forget_plans() -> None:
    """Drop every kept plan (tests; what plans depend on is in their records, so nothing
    else needs this)."""
    with _lock:
        _plans.clear()


def choose(op: Op, record: PlanningRecord, call, name: str) -> type[Backend]:
    """The backend ``name`` (or ``auto``'s first that can) for ``call`` (the call's facts),
    with the reasons of every backend that cannot: part of planning, so it reads the
    record (platform, switches) and nothing else."""
    platform, switches = record.platform, record.switches
    if name != "auto":
        reasons = planned_reasons(name, op, call, platform, switches)
        if reasons:
            raise BackendUnavailable(name, op.name, {name: reasons}, call.describe())
        _log_choice(op, name, call, {}, explicit=True)
        return registry.load(name)
    passed_over: dict[str, list[str]] = {}
    for candidate in registry.priority_for(platform, call.device.type):
        reasons = planned_reasons(candidate, op, call, platform, switches)
        if not reasons:
            _log_choice(op, candidate, call, passed_over, explicit=False)
            return registry.load(candidate)
        passed_over[candidate] = reasons
    raise BackendUnavailable("auto", op.name, passed_over, call.describe())


def _log_choice(op: Op, name: str, call, passed_over: dict[str, list[str]], explicit: bool) -> None:
    key = (op.name, name, call.summary())
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    why = "named explicitly" if explicit else "auto"
    skipped = "".join(f"; {n} passed over: {', '.join(r)}" for n, r in passed_over.items())
    logger.info("%s [%s] -> %s (%s)%s", op.name, key[2], name, why, skipped)


def explain_call(op: Op, call) -> dict[str, list[str]]:
    """Every backend's reasons for ``call``: auto's candidates first, in its order, then
    the backends only a caller can name (empty list: would serve)."""
    platform, now = platform_for(call.device), planning.switches()
    order = registry.priority_for(platform, call.device.type)
    result = {name: planned_reasons(name, op, call, platform, now) for name in order}
    for name in registry.NAMES:
        if name not in result:
            reasons = planned_reasons(name, op, call, platform, now)
            result[name] = reasons + ([] if reasons else ["not in auto's order for these tensors; "
                                                         "serves when named"])
    return result


def device_reasons(device: torch.device | str | None = None) -> dict[str, list[str]]:
    """Every backend's device-level reasons (no call needed): what ``info`` prints."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    platform, now = platform_for(device), planning.switches()
    result = {}
    for name in registry.NAMES:
        cls = registry.load(name)
        result[name] = ([registry.import_error(name) or "cannot import"] if cls is None
                        else cls.device_not_supported_reasons(device, platform, now))
    return result


def implemented_ops(name: str) -> list[str]:
    """The ops backend ``name`` implements (none when it cannot be imported here)."""
    cls = registry.load(name)
    return [] if cls is None else [impl.op.name for impl in cls.implementations]


def backend(name: str) -> type[Backend] | None:
    """A backend class by name, for its hooks (None when it cannot be imported here)."""
    return registry.load(name)


def configure(device: torch.device | None = None, **settings: Any) -> None:
    """Keep what a serving engine knows (:class:`~dflash_rocm.planning.EngineSettings`:
    part of every planning record, so plans made under other settings are not handed out)
    and pass it to every backend ``auto`` may pick on ``device``."""
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}; known: {', '.join(SETTINGS)}")
    configure_engine(**settings)
    for cls in candidates(device):
        cls.configure(**settings)


def warm_up(op: Op, spec: Any, device: torch.device) -> None:
    """Startup work for ``op`` (ROCm attention: tuning) by every backend ``auto`` may pick
    on ``device`` (tuned tables that change move the planning records' generation). An
    optimisation that fails costs itself, never the caller."""
    for cls in candidates(device):
        try:
            cls.warm_up(op, spec, device)
        except Exception as exc:  # warm-up is an optimisation
            logger.warning("%s warm-up failed for %s: %s", cls.name, spec, exc)


def candidates(device: torch.device | None) -> list[type[Backend]]:
    """The backends ``auto`` may pick on ``device``, in its order (those importable here)."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    names = registry.priority_for(platform_for(device), device.type)
    return [cls for cls in (registry.load(n) for n in names) if cls is not None]


def dispatch_counts() -> dict[tuple[str, str], int]:
    """How many calls each (op name, backend) served since start or the last reset."""
    with _lock:
        return dict(_counts)


def reset_dispatch_counts() -> None:
    with _lock:
        _counts.clear()
