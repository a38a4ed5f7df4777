"""The audit end to end: capture every launch of the sweep, compile each distinct
specialisation once per target, model each launch, sum per case against the floor."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from dflash_rocm.workloads import DraftShape

from . import sweep
from .compiler import FactsCache, Specialisation, compile_all, specialise
from .model import LaunchModel, model_launch
from .targets import TARGETS, Target
from .traffic import programs_of, role_variants, trip_matrix_flops


@dataclass
class LaunchResult:
    kernel: str
    grid: tuple[int, ...]
    options: dict
    constexprs: dict
    spec_key: str
    flags: dict
    facts: dict
    model: LaunchModel | None
    error: str | None = None

    def as_dict(self) -> dict:
        return {"kernel": self.kernel, "grid": list(self.grid), "options": self.options,
                "constexprs": {k: repr(v) if not isinstance(v, (int, float, bool, str)) else v
                               for k, v in self.constexprs.items()},
                "specialisation": self.spec_key, "flags": self.flags, "facts": self.facts,
                "model": self.model.as_dict() if self.model else None, "error": self.error}


@dataclass
class CaseResult:
    target: Target
    case: sweep.Case
    config_name: str
    config: dict
    launches: list[LaunchResult] = field(default_factory=list)
    skipped: str | None = None

    @property
    def floor_s(self) -> float:
        return self.case.cost().floor_seconds(self.target.peak.bandwidth, self.target.peak.bf16_flops)

    @property
    def modelled_s(self) -> float | None:
        if self.skipped or any(launch.model is None for launch in self.launches):
            return None
        return sum(launch.model.seconds for launch in self.launches)

    def required_us(self) -> float:
        """The modelled microseconds; raises ``ValueError`` saying why there are none (a
        skipped case, a launch that failed to compile or to fit): for callers that print a
        model beside a measurement and must not drop it silently."""
        if self.modelled_s is None:
            reasons = [launch.error for launch in self.launches if launch.error] or [self.skipped or "no launch"]
            raise ValueError(f"not modelled: {reasons[0]}")
        return self.modelled_s * 1e6

    @property
    def pct_floor(self) -> float | None:
        total = self.modelled_s
        return None if not total else 100 * self.floor_s / total

    @property
    def cache_variant(self) -> str:
        if self.case.op != "attention" or not self.target.amd:
            return ""
        return ">2G" if self.case.large_cache else "<2G"

    def as_dict(self) -> dict:
        c = self.case
        return {"target": self.target.arch, "part": self.target.peak.name, "op": c.op, "shape": c.shape.name,
                "kv": "fp8" if c.fp8 else "bf16", "weights": "fp8" if c.fp8_weights else "bf16",
                "packing": c.packing, "batch": c.batch, "context": c.context,
                "planned_span": c.planned_span, "tokens": c.tokens, "cache": self.cache_variant, "label": c.label,
                "config_name": self.config_name,
                "config": self.config, "skipped": self.skipped, "floor_bytes": c.cost().bytes,
                "floor_us": self.floor_s * 1e6,
                "modelled_us": None if self.modelled_s is None else self.modelled_s * 1e6,
                "pct_floor": self.pct_floor, "launches": [launch.as_dict() for launch in self.launches]}


@dataclass(frozen=True)
class AuditPlan:
    shapes: tuple[DraftShape, ...]
    targets: tuple[str, ...] = tuple(TARGETS)
    ops: tuple[str, ...] = ("attention", "precompute")
    kv: tuple[str, ...] = ("bf16", "fp8")
    batches: tuple[int, ...] = sweep.ATTENTION_BATCHES
    contexts: tuple[int, ...] = sweep.ATTENTION_CONTEXTS
    tokens: tuple[int, ...] = sweep.PRECOMPUTE_TOKENS
    extras: bool = True  # the issues' extra attention cases (b64 4k, the captured plans of sweep.PLANNED_ATTENTION)
    packed: bool = True  # the ROCM_ATTN packed-page cases (AMD targets)
    planned: tuple[int, ...] = ()  # spans every attention case is also planned for (see sweep.default_cases)
    weights: tuple[str, ...] = ("bf16",)  # the precompute's K/V rows: "bf16" and/or "fp8" (see sweep.default_cases)

    def cases(self) -> list[tuple[Target, sweep.Case]]:
        out = []
        for arch in self.targets:
            target = TARGETS[arch]
            for shape in self.shapes:
                for case in sweep.default_cases(shape, ops=self.ops, batches=self.batches, contexts=self.contexts,
                                                tokens=self.tokens, kv=self.kv, extras=self.extras,
                                                packed=self.packed, planned=self.planned, weights=self.weights):
                    out += [(target, variant) for variant in sweep.cache_variants(case, target)]
        return out


@dataclass
class Audit:
    cases: list[CaseResult]
    specialisations: int  # distinct compiled kernels behind the cases
    compiled_now: int  # of which compiled by this run (the rest were cached)


def target_for(platform, peak=None) -> Target | None:
    """The audit's model of ``platform`` (its own CU count and, when known, its own part's
    peaks), or None when the audit has no target for its architecture."""
    from dataclasses import replace

    target = TARGETS.get(platform.arch)
    if target is None or platform.vendor == "cpu":
        return None
    return replace(target, units=platform.compute_units, peak=peak or target.peak)


@dataclass(frozen=True)
class _Pending:
    """A launch, its specialisation and those of its role variants (see
    :func:`.traffic.role_variants`)."""

    launch: object
    spec: Specialisation
    variants: dict[str, Specialisation]

    @classmethod
    def of(cls, launch, target: Target) -> "_Pending":
        return cls(launch, specialise(launch, target),
                   {role: specialise(variant, target) for role, variant in role_variants(launch).items()})

    def specs(self) -> list[Specialisation]:
        return [self.spec, *self.variants.values()]

    def facts(self, compiled: dict[str, dict]) -> dict:
        """The launch's facts, with each role's straight-line cycles (``whole_straight_cycles``...)
        and hot loop (``merger_hot_loop``...)."""
        facts = dict(compiled[self.spec.key])
        for role, spec in self.variants.items():
            variant = compiled[spec.key]
            if "error" not in variant:
                facts[f"{role}_straight_cycles"] = variant["straight_cycles"]
                facts[f"{role}_unpeeled_straight_cycles"] = variant.get("unpeeled_straight_cycles")
                facts[f"{role}_hot_loop"] = variant.get("hot_loop")
        return facts


def model_case(case: sweep.Case, target: Target, cache: FactsCache, config=None) -> CaseResult:
    """One case, captured with ``config`` (None: the table's), compiled (or read from the
    cache) and modelled."""
    captured = sweep.capture_case(case, target, config)
    result = CaseResult(target, case, captured.config_name, captured.config, skipped=captured.skipped)
    pending = [_Pending.of(launch, target) for launch in captured.launches]
    facts, _ = compile_all([spec for p in pending for spec in p.specs()], cache)
    result.launches = [_launch_result(case, target, p.launch, p.spec, p.facts(facts)) for p in pending]
    return result


def _launch_result(case: sweep.Case, target: Target, launch, spec: Specialisation, facts: dict) -> LaunchResult:
    error, model = facts.get("error"), None
    if error is None:
        try:
            model = model_launch(programs_of(case, launch), facts, target, launch.options.get("num_stages", 1),
                                 trip_matrix_flops(launch))
        except ValueError as exc:  # e.g. a workgroup that fits nowhere: a finding, reported
            error = str(exc)
    return LaunchResult(launch.name, launch.grid, launch.options, launch.constexprs, spec.key, spec.flags, facts,
                        model, error)


def run_audit(plan: AuditPlan, cache: FactsCache, jobs: int | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> Audit:
    results: list[CaseResult] = []
    pending: list[tuple[CaseResult, _Pending]] = []
    for target, case in plan.cases():
        captured = sweep.capture_case(case, target)
        result = CaseResult(target, case, captured.config_name, captured.config, skipped=captured.skipped)
        results.append(result)
        pending += [(result, _Pending.of(launch, target)) for launch in captured.launches]
    jobs = jobs or min(8, os.cpu_count() or 1)
    facts, compiled_now = compile_all((spec for _, p in pending for spec in p.specs()), cache, jobs=jobs,
                                      progress=progress)
    for result, p in pending:
        result.launches.append(_launch_result(result.case, result.target, p.launch, p.spec, p.facts(facts)))
    return Audit(results, len(facts), compiled_now)
