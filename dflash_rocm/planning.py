"""One planning record: everything a plan may read, built before planning, and the key
of dispatch's plan cache.

A backend's :meth:`~dflash_rocm.backend.Implementation.plan` does the host work for
every call of one structure once and returns a :class:`~dflash_rocm.backend.Runner`;
dispatch hands later calls with an equal record to that runner. So the record must hold
everything a plan may read, and a plan must read nothing else: the call's structure
(every argument's shape, strides, dtype and device, and the scalars), its host bounds,
the alignment and storage sizes (or addresses) of the tensors plans specialise on, the device and
the platform CPU tensors are simulated as (from which a plan finds its platform), the
environment switches planning reads (:data:`PLANNING_SWITCHES`, the tuning cache directory
among them), what the serving engine configured (:class:`EngineSettings`), the generation
of the tuned tables (:mod:`dflash_rocm.tuning`) and whether torch asks for deterministic
algorithms.

:func:`planning_record` builds the record on every call (a tuple of values already at
hand: the structure is hashed once per call structure; the environment variables are
held raw and parsed only when a plan is made); it is a NamedTuple, so it is immutable
and hashes as a tuple. When dispatch has no plan for it, the plan receives the record and, beside it, the call's facts
(:func:`call_facts`: the call with every tensor replaced by its :class:`TensorFacts`:
shape, strides, dtype, device, and the address, alignment or storage size only where the
record holds them), never the tensors. Besides those two a plan may read only what
:mod:`dflash_rocm.process` declares (facts fixed for the life of the process, and whether
a graph is being captured: a plan made then is never kept); ``tests/test_planning.py``
walks every implementation's ``plan()``, every backend's reasons and dispatch's choice
(and what they call) and refuses any other read of the environment, the settings, the
platform or torch's global flags.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import threading
from typing import Any, NamedTuple

import torch

from . import envs, tuning
from .paged import PackedCache
from .platform import Platform, platform_of, simulated_platform

# Every environment switch a plan may depend on (in this order) and, first, the backend's
# name for calls that name none: what a record holds of the environment, raw.
PLANNING_SWITCHES = (envs.TAIL_MERGE, envs.QUERY_LIMIT, envs.TUNE, envs.AITER, envs.CACHE_DIR)
PLANNING_VARIABLES = (envs.BACKEND, *PLANNING_SWITCHES)
_VARIABLE_NAMES = tuple(var.name for var in PLANNING_VARIABLES)


class Switches(NamedTuple):
    """The parsed values of :data:`PLANNING_SWITCHES` (see :mod:`dflash_rocm.envs`)."""

    tail_merge: bool  # DFLASH_ROCM_TAIL_MERGE
    query_limit: int | None  # DFLASH_ROCM_QUERY_LIMIT (None: unset)
    tune: bool | str  # DFLASH_ROCM_TUNE: True, False or "auto"
    aiter: bool | str  # DFLASH_ROCM_AITER: True, False or "auto" (the aiter backend's reasons read it)
    cache_dir: str  # DFLASH_ROCM_CACHE_DIR ("": the default location): where tuned tables are kept


def environment() -> tuple[str | None, ...]:
    """The raw values of :data:`PLANNING_VARIABLES` now (None: unset): read on every call
    of the public functions and once per plan object (``plan_draft_attention``,
    ``plan_context_kv``), parsed only when a plan is made (:func:`parse_switches`). The six
    reads cost about 4.5 us (each unset variable raises and catches ``KeyError`` inside
    ``os.environ``; docs/benchmarks.md "Host path"): paid by the one-shot calls, not by a
    plan's runs."""
    return tuple([os.environ.get(name) for name in _VARIABLE_NAMES])


def parse_switches(raw: tuple[str | None, ...]) -> Switches:
    """The switches of ``raw`` (:func:`environment`'s values); a bad value is refused with
    one warning and its default applies (:meth:`dflash_rocm.envs.EnvVar.setting_of`)."""
    _, tail_merge, query_limit, tune, aiter, cache_dir = raw
    return Switches(tail_merge=envs.TAIL_MERGE.setting_of(tail_merge),
                    query_limit=envs.QUERY_LIMIT.setting_of(query_limit), tune=envs.TUNE.setting_of(tune),
                    aiter=envs.AITER.setting_of(aiter), cache_dir=envs.CACHE_DIR.setting_of(cache_dir))


def backend_variable(raw: tuple[str | None, ...]) -> str | None:
    """``DFLASH_ROCM_BACKEND`` as :func:`environment`'s ``raw`` holds it (None: unset)."""
    return raw[0]


def switches() -> Switches:
    """The planning switches now (tools, and hooks that act now: warm-up, tuning, ``info``)."""
    return parse_switches(environment())


class EngineSettings(NamedTuple):
    """What a serving engine told the package (:func:`dflash_rocm.dispatch.configure`):
    DFlash's query limit (``num_speculative_tokens + 1``), the batch limit, the model
    length, the draft layers' causal flags. A NamedTuple: immutable, and hashed as a
    tuple with every planning record."""

    query_limit: int | None = None
    batch_limit: int = 64
    max_model_len: int = 32768
    layer_causal: tuple[bool, ...] | None = None  # scopes tuning to what the draft runs


SETTINGS = EngineSettings._fields
_settings_lock = threading.Lock()
_settings = EngineSettings()


def configure_engine(**changes) -> EngineSettings:
    """Update the engine settings (unknown names and bad values are refused, nothing changed)."""
    global _settings
    for key, value in changes.items():
        if key not in SETTINGS:
            raise ValueError(f"unknown setting {key!r}; known: {', '.join(SETTINGS)}")
        if key in ("query_limit", "batch_limit", "max_model_len") and value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{key}: expected a positive int, got {value!r}")
    if "layer_causal" in changes and changes["layer_causal"] is not None:
        changes["layer_causal"] = tuple(changes["layer_causal"])
    with _settings_lock:
        _settings = _settings._replace(**changes)
    return _settings


def engine_settings() -> EngineSettings:
    return _settings


class TensorFacts:
    """What a plan may know of a tensor: shape, strides, dtype, device, and of its memory as
    much as the record holds: its address (``"address"``: the precompute's caches, whose
    addresses are part of its structure), or its residue modulo 16 and its storage's size
    (``"memory"``: the attention's caches), or nothing (``data_ptr()`` and
    ``untyped_storage()`` then raise: a plan that needs them must put them in the record)."""

    __slots__ = ("shape", "_strides", "dtype", "device", "_address", "_storage")

    def __init__(self, t: torch.Tensor, address: str | None):
        self.shape, self._strides, self.dtype, self.device = t.shape, t.stride(), t.dtype, t.device
        self._address = t.data_ptr() if address == "address" else t.data_ptr() & 15 if address else None
        self._storage = StorageFacts(t.untyped_storage().nbytes()) if address == "memory" else None

    def stride(self, dim: int | None = None):
        return self._strides if dim is None else self._strides[dim]

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def numel(self) -> int:
        return math.prod(self.shape)

    def data_ptr(self) -> int:
        if self._address is None:
            raise TypeError("the planning record holds no address for this tensor (only its shape, strides, dtype "
                            "and device): a plan that depends on it must add it to the record")
        return self._address

    def untyped_storage(self) -> "StorageFacts":
        if self._storage is None:
            raise TypeError("the planning record holds no storage size for this tensor: a plan that depends on it "
                            "must add it to the record")
        return self._storage


class StorageFacts(NamedTuple):
    """A storage as a plan may know it: its size."""

    size: int

    def nbytes(self) -> int:
        return self.size


def _facts(value: Any, address: str | None, seen: dict[int, Any]) -> Any:
    """``value`` with every tensor replaced by its :class:`TensorFacts` (one per tensor
    object: which arguments are the same tensor is part of a structure)."""
    if isinstance(value, torch.Tensor):
        found = seen.get(id(value))
        if found is None:
            found = seen[id(value)] = TensorFacts(value, address)
        return found
    if type(value) is PackedCache:
        packed = copy.copy(value)
        packed.view = _facts(value.view, address, seen)
        return packed
    if type(value) is tuple:
        return tuple(_facts(v, address, seen) for v in value)
    if dataclasses.is_dataclass(value) and any(isinstance(getattr(value, f.name), torch.Tensor)
                                               for f in dataclasses.fields(value)):
        return _with_facts(value, {}, seen)  # a dataclass of tensors (the weights): the same fields, as facts
    return value


def _with_facts(value: Any, addresses: dict[str, str], seen: dict[int, Any]) -> Any:
    """A shallow copy of the dataclass ``value`` (checked when it was built, on its tensors)
    with every field replaced by its facts, each set through ``object.__setattr__``, as a
    frozen dataclass's own ``__init__`` sets fields (the weights are frozen)."""
    facts = copy.copy(value)
    for field in dataclasses.fields(value):
        object.__setattr__(facts, field.name, _facts(getattr(value, field.name), addresses.get(field.name), seen))
    return facts


def call_facts(call) -> Any:
    """``call`` (an op's call type) with every tensor replaced by its :class:`TensorFacts`;
    its fields named in ``PLANNED_ADDRESSES`` keep the memory facts named there: what a
    plan receives beside its record."""
    return _with_facts(call, getattr(type(call), "PLANNED_ADDRESSES", {}), {})


class PlanningRecord(NamedTuple):
    """Everything planning may read (see the module), built by keyword: every field is part
    of the cache key. Equal records get the same plan. A NamedTuple: immutable (no
    attribute can be set on one), hashed as a tuple."""

    op: str  # the op's name
    backend: str | None  # the backend= argument as given (None: DFLASH_ROCM_BACKEND's, in environment)
    structure: Any  # the call's structure (validation's Structure; None: built outside validation)
    bounds: tuple  # host bounds that size launches
    memory: tuple  # of the tensors plans specialise on: 16-byte alignment residues, storage sizes
    device: torch.device  # the call's device: with ``simulated``, its platform (the property)
    simulated: Platform | None  # what simulate_platform pins for CPU tensors (None: nothing)
    environment: tuple  # the raw values of PLANNING_VARIABLES (None: unset)
    settings: EngineSettings
    tuning: int  # generation of the tuned tables (dflash_rocm.tuning)
    deterministic: bool  # torch.are_deterministic_algorithms_enabled()

    @property
    def switches(self) -> Switches:
        """The planning switches this record holds, parsed (when a plan is made)."""
        return parse_switches(self.environment)

    @property
    def platform(self) -> Platform:
        """The platform of the record's device (worked out when a plan is made: a call's
        record holds only the device and the simulated platform, so a repeat call never
        looks a GPU's platform up)."""
        return platform_of(self.device, self.simulated)

    @property
    def keepable(self) -> bool:
        """Whether a plan of this record may be kept (a call built outside validation
        carries no structure)."""
        return self.structure is not None


def planning_record(op: str, backend: str | None, call, variables: tuple | None = None) -> PlanningRecord:
    """The record of ``call`` (of ``op``, for the backend asked for): see the module.
    ``variables``: :func:`environment`'s values as read earlier (a plan object reads them
    once, when it is made); None: read now."""
    structure, bounds, memory = call.planning_parts()
    return PlanningRecord(op=op, backend=backend, structure=structure, bounds=bounds, memory=memory,
                          device=call.device, simulated=simulated_platform(),
                          environment=environment() if variables is None else variables,
                          settings=_settings,
                          tuning=tuning.generation(), deterministic=torch.are_deterministic_algorithms_enabled())


def on_platform(record: PlanningRecord, platform: Platform) -> PlanningRecord:
    """``record`` as planning on ``platform`` would see it: the record of CPU tensors
    simulated as ``platform`` (tools that ask what a backend would plan for a GPU they do
    not run on: ``inspect``, ``bench --assumptions``)."""
    return record._replace(device=torch.device("cpu"), simulated=platform)


class Planning(NamedTuple):
    """A record and the call's facts: the two arguments of a plan, for a plan made
    outside dispatch (``plan(*record_for(...))``)."""

    record: PlanningRecord
    facts: Any


def record_for(op: str, backend: str, call) -> Planning:
    """The record of ``call`` and its facts: what a plan made outside dispatch (a tool, a
    tuner, a test that picks a configuration) receives."""
    return Planning(record=planning_record(op, backend, call), facts=call_facts(call))
