"""``dflash-rocm bench --host``: the host microseconds of one call, per backend and op.

At DFlash's batch sizes one draft-attention call is 10-20 us of GPU work, so the host
work around it decides whether the GPU waits. This measures that work on any machine,
a CPU one included: each call runs its real host code with the kernel launches captured
instead of run (:func:`dflash_rocm.launches.capture`), and each captured launch's own
host cost before the driver call is measured separately by its backend
(:meth:`~dflash_rocm.backend.Backend.launch_overhead`): through the compiler's generic
JIT entry, and through the backend's direct path. The driver call itself needs a GPU
and is not included.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch

from . import dispatch, launches, registry
from .api import draft_attention, precompute_and_store_context_kv
from .plan import plan_context_kv, plan_draft_attention
from .ops import ATTENTION, OPS, PRECOMPUTE
from .platform import platform_for, simulate_platform
from .timing import host_median_seconds
from .workloads import SHAPES, attention_inputs, precompute_inputs

# Host time a call may take on a 2-core CPU, launches included (the GPU work a call
# launches is 10-20 us, modelled), by (op, path): a plan's run, what serving pays every
# layer and step, has the tighter goal.
TARGET_US = {(ATTENTION.name, "call"): 25.0, (PRECOMPUTE.name, "call"): 30.0,
             (ATTENTION.name, "plan.run"): 15.0, (PRECOMPUTE.name, "plan.run"): 25.0}


@dataclass
class HostRow:
    op: str
    backend: str
    validate: bool
    path: str  # "call": the public function; "plan.run": one layer of a planned batch
    host_us: float  # the package's own work, launches captured
    launches: int
    jit_launch_us: float | None  # + Triton's JIT entry for every launch
    direct_launch_us: float | None  # + the backend's direct path for every launch
    target_us: float

    @property
    def total_us(self) -> float:
        return self.host_us + (self.direct_launch_us or 0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "total_us": self.total_us}


def _median_us(fn, repeats: int) -> float:
    return host_median_seconds(fn, repeats) * 1e6


def host_rows(device: torch.device, *, arch: str, shape: str = "qwen3-8b-dflash-b16", backends=None,
              repeats: int = 1000) -> list[HostRow]:
    """One row per (op, path, backend, validate) for one DFlash step's calls: attention at batch
    1 over 8k keys, the precompute of 16 context tokens. On CPU tensors ``arch`` is the
    architecture the vendor backends are simulated as (their host code is what runs)."""
    s = SHAPES[shape]
    simulate = simulate_platform(arch) if device.type == "cpu" else contextlib.nullcontext()
    rows = []
    with simulate:
        a = attention_inputs(s, 1, 8192, torch.bfloat16, torch.bfloat16, device)
        p = precompute_inputs(s, 16, torch.bfloat16, torch.bfloat16, device)

        def planned_attention(b, v):  # what the vLLM plugin runs for a step's second and later draft layers
            plan = plan_draft_attention(*a.args(), **a.kwargs, backend=b, validate=v)
            return lambda: plan.run(a.query, a.key_cache, a.value_cache)

        def planned_precompute(b, v):  # what the vLLM plugin runs every step
            plan = plan_context_kv(p.weights, p.key_caches, p.value_caches, **p.kwargs(), backend=b)
            return lambda: plan.run(p.states, p.positions, p.slot_mapping, validate=v)

        calls = {(ATTENTION.name, "call"): lambda b, v: lambda: draft_attention(*a.args(), **a.kwargs, backend=b,
                                                                                validate=v),
                 (ATTENTION.name, "plan.run"): planned_attention,
                 (PRECOMPUTE.name, "call"): lambda b, v: lambda: precompute_and_store_context_kv(
                     *p.args(), **p.kwargs(), backend=b, validate=v),
                 (PRECOMPUTE.name, "plan.run"): planned_precompute}
        for (op_name, path), make in calls.items():
            op = OPS[op_name]
            call = op.build_call(*(a.args() if op is ATTENTION else p.args()),
                                 **(a.kwargs if op is ATTENTION else p.kwargs()), validate=False)
            for name in backends or [n for n in registry.NAMES if n != "reference"]:
                if dispatch.reasons_for(name, op, call):
                    continue
                cls = dispatch.backend(name)
                for validate in (False, True):
                    run = make(name, validate)
                    with launches.capture() as made:
                        run()  # one-time work (derived weights, tables) happens here
                    per_call = len(made)
                    if not per_call:  # a backend that computes on the host (cpu): no host path to time
                        break
                    with launches.capture() as sink:  # emptied per call: a growing list would time the GC
                        host = _median_us(lambda: (run(), sink.clear()), repeats)
                    costs = [cls.launch_overhead(launch, arch) for launch in made]
                    known = all(c is not None for c in costs)
                    rows.append(HostRow(op_name, name, validate, path, host, per_call,
                                        sum(c[0] for c in costs) * 1e6 if known and costs else None,
                                        sum(c[1] for c in costs) * 1e6 if known and costs else None,
                                        TARGET_US[op_name, path]))
    return rows


def platform_arch(device: torch.device, default: str = "gfx942") -> str:
    """The GPU architecture to cost launches for: the device's, else ``default``."""
    platform = platform_for(device)
    return platform.arch if platform.arch_info is not None else default


def format_host_rows(rows: list[HostRow], arch: str, width: int | None, busy: str | None = None) -> str:
    """The table and what it measured; ``busy``: the warning that the machine looked busy
    (:func:`dflash_rocm.timing.busy_machine_note`, taken before the run), printed last."""
    from .report import format_table, wrap

    def us(value) -> str:
        return "" if value is None else f"{value:.1f}"

    table = format_table(
        ["op", "path", "backend", "validate", "host us", "launches", "+ JIT us", "+ direct us", "total us", "target"],
        [(OPS[r.op].label, r.path, r.backend, "yes" if r.validate else "no", us(r.host_us), r.launches,
          us(r.jit_launch_us), us(r.direct_launch_us), us(r.total_us), f"<= {r.target_us:.0f}") for r in rows],
        width=width)
    note = (f"Measured on this machine's CPU: the package's host work per call with its kernel launches "
            f"captured, plus each launch's host cost before the driver call for {arch} (through Triton's "
            f"JIT entry, and through the direct path the backends use); total = host + direct. The driver "
            f"call itself needs a GPU and is not included. plan.run: through a plan, as the vLLM plugin "
            f"calls: attention for a step's second and later draft layers (plan_draft_attention), the "
            f"precompute every step (plan_context_kv).")
    return "\n".join([table, "", wrap(note, width), *([wrap(f"Warning: {busy}", width)] if busy else [])])
