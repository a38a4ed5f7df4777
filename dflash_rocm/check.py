"""``dflash-rocm check``: every backend that can run here against the reference.

One DFlash decode step of a real draft shape (scaled down on a CPU, where Triton runs
through the interpreter): the fused context-KV precompute and the draft attention,
each backend's result compared with the reference under SPEC.md's tolerances.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from . import dispatch, registry
from .api import draft_attention, precompute_and_store_context_kv
from .contract import FP8_DTYPES, dtype_name, relative_error
from .report import WIDTH, Footnotes, Style, format_table, join_blocks, never_ran, not_run_here, wrap
from .timing import median_seconds
from .ops import ATTENTION, OPS, PRECOMPUTE, Op
from .workloads import DraftShape, attention_inputs, precompute_inputs


@dataclass
class CheckRow:
    op: str
    backend: str
    status: str  # PASS, FAIL, ERROR, SKIP, ORACLE
    rel_err: float | None
    tolerance: float | None
    ms_per_call: float | None
    note: str

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CheckPlan:
    shape: DraftShape
    dtype: torch.dtype
    cache_dtype: torch.dtype
    device: torch.device
    batch: int
    context_len: int
    num_tokens: int
    repeats: int

    def describe(self) -> str:
        s = self.shape
        return (f"{s.name} ({s.note}): hidden {s.hidden}, {s.layers} layers, {s.q_heads}/{s.kv_heads} heads, "
                f"head dim {s.head_dim}, rotary {s.rope_dim}; {dtype_name(self.dtype)} states, "
                f"{dtype_name(self.cache_dtype)} cache; attention: {self.batch} requests x "
                f"{s.block_tokens} queries over {self.context_len} context tokens; precompute: "
                f"{self.num_tokens} context tokens; on {self.device}")


def default_plan(shape: DraftShape, dtype: torch.dtype, cache_dtype: torch.dtype,
                 device: torch.device, scale_shape: bool = True) -> CheckPlan:
    """Real sizes on a GPU; on a CPU a short step and (unless ``scale_shape`` is False)
    a scaled-down draft."""
    if device.type == "cpu":
        return CheckPlan(shape.scaled_for_cpu() if scale_shape else shape, dtype, cache_dtype, device,
                         batch=2, context_len=45, num_tokens=24, repeats=1)
    return CheckPlan(shape, dtype, cache_dtype, device, batch=4, context_len=4096, num_tokens=256, repeats=10)


def _dequantized(cache: torch.Tensor, scale) -> torch.Tensor:
    return cache.float() * (scale if cache.dtype in FP8_DTYPES else 1.0)


def _time(plan: CheckPlan, fn) -> float:
    warmup = 0 if plan.device.type == "cpu" else 3
    return median_seconds(lambda _: fn(), plan.device, warmup=warmup, repeats=plan.repeats) * 1e3


def _check_backends(op: Op, call, run_backend, compare, plan: CheckPlan, backends) -> list[CheckRow]:
    tol = op.tolerance(call)
    rows = [CheckRow(op.name, "reference", "ORACLE", None, None, _time(plan, lambda: run_backend("reference")), "")]
    for name in backends:
        reasons = dispatch.reasons_for(name, op, call)
        if reasons:
            rows.append(CheckRow(op.name, name, "SKIP", None, None, None, "; ".join(reasons)))
            continue
        try:
            err = compare(name)
            ms = _time(plan, lambda name=name: run_backend(name))
        except Exception as exc:  # a backend that crashes is reported, not fatal to the table
            rows.append(CheckRow(op.name, name, "ERROR", None, tol, None, f"{type(exc).__name__}: {exc}"))
            continue
        rows.append(CheckRow(op.name, name, "PASS" if err <= tol else "FAIL", err, tol, ms, ""))
    return rows


def check_precompute(plan: CheckPlan, backends, weights=None) -> list[CheckRow]:
    inputs = precompute_inputs(plan.shape, plan.num_tokens, plan.dtype, plan.cache_dtype, plan.device,
                               weights=weights)
    call = PRECOMPUTE.build_call(*inputs.args(), **inputs.kwargs())

    def run_backend(name: str):
        return precompute_and_store_context_kv(*inputs.args(), **inputs.kwargs(), return_kv=True, backend=name)

    def snapshot():
        return [_dequantized(c, 1.0 if inputs.k_scales is None else inputs.k_scales[i])
                for i, c in enumerate(inputs.key_caches)] + [
                _dequantized(c, 1.0 if inputs.v_scales is None else inputs.v_scales[i])
                for i, c in enumerate(inputs.value_caches)]

    ref_k, ref_v = run_backend("reference")
    ref_caches = snapshot()

    def compare(name: str) -> float:
        for c in inputs.key_caches + inputs.value_caches:
            c.zero_()
        k, v = run_backend(name)
        errors = [relative_error(k, ref_k), relative_error(v, ref_v)]
        errors += [relative_error(got, want) for got, want in zip(snapshot(), ref_caches)]
        return max(errors)

    return _check_backends(PRECOMPUTE, call, run_backend, compare, plan, backends)


def check_attention(plan: CheckPlan, backends) -> list[CheckRow]:
    inputs = attention_inputs(plan.shape, plan.batch, plan.context_len, plan.dtype, plan.cache_dtype, plan.device)
    call = ATTENTION.build_call(*inputs.args(), **inputs.kwargs)

    def run_backend(name: str):
        return draft_attention(*inputs.args(), **inputs.kwargs, backend=name)

    ref = run_backend("reference").clone()
    return _check_backends(ATTENTION, call, run_backend,
                           lambda name: relative_error(run_backend(name), ref), plan, backends)


def run_check(plan: CheckPlan, backends=None, weights=None) -> list[CheckRow]:
    backends = [b for b in (backends or registry.NAMES) if b != "reference"]
    return check_precompute(plan, backends, weights) + check_attention(plan, backends)


def not_run(rows: list[CheckRow], asked) -> dict[str, str]:
    """The backends of ``asked`` (named by the user) that ran no operation here, each with
    why (its first skip's note): a check that was asked for and not made is a failed one."""
    return {name: next((r.note for r in rows if r.backend == name), "not checked")
            for name in asked if name != "reference" and all(r.status == "SKIP" for r in rows if r.backend == name)}


def format_report(plan: CheckPlan, rows: list[CheckRow], width: int | None = WIDTH, style: Style = Style(),
                  asked=()) -> str:
    """The plan, one row per (op, backend) that ran or could have, and the verdict (failed
    where a backend of ``asked``, the ones the user named, could not run here).

    Within ``width`` columns a backend that runs nowhere here is named once under the
    table and long notes (errors, partial skips) become footnotes; ``width=None`` keeps
    every row and note inline."""
    absent = {} if width is None else never_ran((r.backend, r.note if r.status == "SKIP" else None) for r in rows)
    notes = Footnotes(limit=30)
    table = format_table(
        ["op", "backend", "result", "rel err", "tolerance", "ms/call", "note"],
        [(r.op if width is None else OPS[r.op].label, r.backend, style.status(r.status),
          "" if r.rel_err is None else f"{r.rel_err:.2e}", "" if r.tolerance is None else f"{r.tolerance:.0e}",
          "" if r.ms_per_call is None else f"{r.ms_per_call:.3f}", r.note if width is None else notes.cite(r.note))
         for r in rows if r.backend not in absent], width=width, omit_empty=["note"])
    cpu = "(CPU: Triton kernels run through the interpreter; times say nothing about GPU speed)"
    failed = [f"{r.op}/{r.backend}" for r in rows if r.status in ("FAIL", "ERROR")]
    failed += [f"{name} cannot run here ({why})" for name, why in not_run(rows, asked).items()]
    verdict = (style.paint("FAILED: " + ", ".join(failed), "red") if failed
               else style.paint("all backends that can run here agree with the reference", "green"))
    return join_blocks("\n".join([wrap(plan.describe(), width)] + ([cpu] if plan.device.type == "cpu" else [])),
                       "\n".join(filter(None, [table, not_run_here(absent, width), notes.render(width)])),
                       wrap(verdict, width))
