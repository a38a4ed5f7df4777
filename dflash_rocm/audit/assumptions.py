"""``dflash-rocm bench --assumptions``: the three figures the modelled goals rest on, each
measured on the GPU at hand and printed beside what the model assumed or predicted.

1. **Per-rank precompute** (``tp8``): the precompute of one rank of a TP8 deployment (one KV
   head) under the table's launch and under the what-if launches the table was chosen
   against (no hidden-size split; 8-way split of 128-token tiles; half and twice the
   table's split). The table's choice rests on the model ranking these; the measured
   times say whether the GPU ranks them alike.
2. **The TP1 precompute at N = 256** (``l2``): measured against the model, with the L2
   bandwidth the measured time implies (the model's bytes through L2 over the measured
   time) beside the assumed one: the model says this launch is bound by L2.
3. **The dependent-launch gap under a replayed CUDA graph** (``gap``): a graph of ``n``
   dependent one-element kernels, replayed and timed, per launch over ``2n`` minus ``n``
   launches; the model charges every launch the target's eager-stream gap.

GPU kernels are timed with device events, the L2 flushed before each timed call, the
median of interleaved repeats (:mod:`dflash_rocm.timing`). On a CPU (``gpu_check.sh --dry``)
every row runs at scaled-down shapes through the Triton interpreter, eagerly and timed by
the host clock: a rehearsal of the code, no figure of any GPU, and no model (it compiles
for a GPU target). Each row catches its own error and says it, so one failure spoils no
other row.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from dflash_rocm.bench import l2_flush
from dflash_rocm.floors import peak_for
from dflash_rocm.ops import PRECOMPUTE
from dflash_rocm.planning import record_for
from dflash_rocm.platform import Platform, platform_for
from dflash_rocm.report import format_table, wrap
from dflash_rocm.timing import interleaved_median_seconds, synchronize
from dflash_rocm.workloads import SHAPES, DraftShape, precompute_inputs

SHAPE = SHAPES["qwen3-8b-dflash-b16"]
TP = 8
TP_TOKENS = (256, 1024)  # per-rank precompute cases
L2_TOKENS = 256
GAP_LAUNCHES = 50  # a graph of n and one of 2n dependent launches


@dataclass
class AssumptionRow:
    check: str  # "tp8" | "l2" | "gap"
    case: str
    config: str  # which launch: "table" or the what-if's name
    measured_us: float | None = None
    model_us: float | None = None
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def what_if_configs(table, hidden: int, tokens: int) -> dict[str, object]:
    """The table's precompute config and the what-ifs it was chosen against, by name: no
    hidden-size split (one head row a program, and past one token tile also K and V paired,
    as the portable table paired them before), 8-way split of 128-token tiles (heads 1), and
    half and twice the table's split (each part keeping at least one ``block_k`` step of the
    hidden size)."""
    unsplit = replace(table, split_k=1, whole_tiles=0, heads=1)
    configs = {"table": table, "no split": unsplit}
    if tokens > table.block_t:
        configs["no split, K and V paired"] = replace(unsplit, heads=2)
    configs["128-token tiles, 8-way"] = replace(unsplit, block_t=128, num_warps=8,
                                                split_k=min(8, max(1, hidden // table.block_k)))
    if table.split_k > 1 and not table.whole_tiles:
        for name, split in (("half the split", table.split_k // 2), ("twice the split", table.split_k * 2)):
            if hidden // split >= table.block_k:
                configs[name] = replace(table, split_k=split)
    unique = {}
    for name, config in configs.items():
        if config not in unique.values():
            unique[name] = config
    return unique


def table_precompute_config(call, platform: Platform):
    """The launch the backend serving ``platform`` picks: the ROCm table on AMD, else the
    portable one."""
    if platform.vendor == "rocm":
        from dflash_rocm.backends import rocm

        record, facts = record_for(PRECOMPUTE.name, "rocm", call)
        return rocm.precompute_choice(record._replace(platform=platform), facts)
    from dflash_rocm.backends.triton.precompute import precompute_config_for

    return precompute_config_for(call, platform)


def _model_us(shape: DraftShape, tokens: int, platform: Platform, config) -> tuple[float | None, dict]:
    """(modelled us, the launch's model facts) of the precompute under ``config`` on
    ``platform``'s audit target; (None, {}) on a CPU or an unmodelled architecture."""
    from . import run, sweep
    from .compiler import FactsCache, default_cache_dir

    target = run.target_for(platform, peak_for(platform))
    if target is None:
        return None, {}
    result = run.model_case(sweep.Case("precompute", shape, False, tokens=tokens), target,
                            FactsCache(default_cache_dir()), config=config)
    seconds = result.modelled_s
    launch = result.launches[0].model if result.launches else None
    return (None if seconds is None else seconds * 1e6), (launch.as_dict() if launch else {})


def _time_us(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    runnable = {name: (lambda i, fn=fn: fn()) for name, fn in fns.items()}
    seconds = interleaved_median_seconds(runnable, device, warmup=0 if device.type == "cpu" else 3,
                                         repeats=repeats, setup=l2_flush(device))
    return {name: s * 1e6 for name, s in seconds.items()}


def _precompute_runs(call, configs: dict) -> dict:
    """name -> a call of the precompute under that config (planned once, run once: compiled
    and warm), or the error that stopped it."""
    from dflash_rocm.backends.triton.precompute import precompute_runner

    record, facts = record_for(PRECOMPUTE.name, "triton", call)
    runs = {}
    for name, config in configs.items():
        try:
            runner = precompute_runner(record, facts, config)
            runner.run(call)
            runs[name] = lambda runner=runner: runner.run(call)
        except Exception as exc:  # this launch's row says why; the others run
            runs[name] = f"ERROR {type(exc).__name__}: {exc}"[:160]
    return runs


def _describe(config) -> str:
    return f"t{config.block_t} w{config.num_warps} split {config.split_k}" + (" h2" if config.heads == 2 else "")


def precompute_rows(check: str, shape: DraftShape, tokens: int, device: torch.device, platform: Platform,
                    repeats: int, what_ifs: bool) -> list[AssumptionRow]:
    """One row per launch (the table's, and with ``what_ifs`` the others of
    :func:`what_if_configs`): measured and modelled microseconds."""
    case = f"{shape.name} N={tokens}"
    try:
        inputs = precompute_inputs(shape, tokens, torch.bfloat16, torch.bfloat16, device)
        call = PRECOMPUTE.build_call(*inputs.args(), **inputs.kwargs(), validate=False)
        table = table_precompute_config(call, platform)
        configs = what_if_configs(table, shape.hidden, tokens) if what_ifs else {"table": table}
        runs = _precompute_runs(call, configs)
        measured = _time_us({n: fn for n, fn in runs.items() if callable(fn)}, device, repeats)
    except Exception as exc:
        return [AssumptionRow(check, case, "table", note=f"ERROR {type(exc).__name__}: {exc}"[:160])]
    rows = []
    for name, config in configs.items():
        row = AssumptionRow(check, case, f"{name} ({_describe(config)})", measured.get(name))
        if isinstance(runs[name], str):
            row.note = runs[name]
        elif device.type == "cpu":
            row.note = "CPU rehearsal: scaled shape, interpreter"
        try:
            row.model_us, facts = _model_us(shape, tokens, platform, config)
            if check == "l2" and facts and row.measured_us:
                implied = facts["requested_bytes"] / (row.measured_us * 1e-6) / 1e12
                row.note = (f"model bound {facts['bound']}; {facts['requested_bytes'] / 1e6:.0f} MB through L2: "
                            f"{implied:.1f} TB/s measured vs {_target_l2(platform):.1f} assumed")
        except Exception as exc:  # the model is an aid: its failure leaves the measurement
            row.note = (row.note + "; " if row.note else "") + f"model: {type(exc).__name__}: {exc}"[:120]
        rows.append(row)
    return rows


def _target_l2(platform: Platform) -> float:
    from .targets import TARGETS

    return TARGETS[platform.arch].l2_bandwidth / 1e12


def launch_gap_row(device: torch.device, platform: Platform, launches: int = GAP_LAUNCHES,
                   repeats: int = 20) -> AssumptionRow:
    """The gap between dependent launches under a replayed CUDA graph: graphs of ``n`` and
    ``2n`` dependent one-element adds, each replay timed; (t(2n) - t(n)) / n per launch.
    On a CPU the same chains run eagerly (host clock): a rehearsal of the arithmetic."""
    from .targets import TARGETS

    target = TARGETS.get(platform.arch)
    row = AssumptionRow("gap", f"{launches} vs {2 * launches} dependent launches", "graph replay",
                        model_us=None if target is None else target.launch_gap_s * 1e6)
    try:
        x = torch.zeros(1, device=device)

        def chain(n):
            for _ in range(n):
                x.add_(1)

        if device.type == "cuda":
            replays = {}
            for n in (launches, 2 * launches):
                chain(n)  # warm
                synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    chain(n)
                replays[n] = graph.replay
            times = _time_us({n: fn for n, fn in replays.items()}, device, repeats)
            row.note = "eager-stream gap modelled; graph replay measured"
        else:
            times = {}
            for n in (launches, 2 * launches):
                start = time.perf_counter()
                chain(n)
                times[n] = (time.perf_counter() - start) * 1e6
            row.note = "CPU rehearsal: eager host ops, no graph"
        row.measured_us = max(0.0, (times[2 * launches] - times[launches]) / launches)
    except Exception as exc:
        row.note = f"ERROR {type(exc).__name__}: {exc}"[:160]
    return row


def assumption_rows(device: torch.device, repeats: int | None = None,
                    progress: Callable[[AssumptionRow], None] | None = None) -> list[AssumptionRow]:
    """Every row: the per-rank precompute at TP8 (table and what-ifs), the TP1 precompute at
    N = 256 against the model's L2, and the graph's launch gap. A CPU runs scaled shapes.
    ``progress`` sees each row as it is made (a run cut short still leaves those)."""
    platform = platform_for(device)
    cpu = device.type == "cpu"
    repeats = repeats or (1 if cpu else 20)
    shape, tp_tokens, l2_tokens = SHAPE, TP_TOKENS, L2_TOKENS
    if cpu:
        shape, tp_tokens, l2_tokens = SHAPE.scaled_for_cpu(), (16,), 16
    batches = [lambda n=n: precompute_rows("tp8", shape.per_rank(TP), n, device, platform, repeats, what_ifs=True)
               for n in tp_tokens]
    batches += [lambda: precompute_rows("l2", shape, l2_tokens, device, platform, repeats, what_ifs=False),
                lambda: [launch_gap_row(device, platform, repeats=repeats)]]
    rows = []
    for batch in batches:
        for row in batch():
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def format_rows(rows: list[AssumptionRow], platform: Platform, width: int | None = None) -> str:
    """The rows as a table: measured beside modelled, MODELLED marked as such."""
    def us(value):
        return "-" if value is None else f"{value:.1f}"

    head = wrap(f"the model's assumptions on {platform.name} ({platform.arch}): measured (device events, L2 "
                "flushed, median; host clock on a CPU) beside modelled (dflash-rocm inspect's model; not measured)",
                width)
    table = format_table(["check", "case", "launch", "measured us", "model us", "note"],
                         [(r.check, r.case, r.config, us(r.measured_us), us(r.model_us), r.note) for r in rows],
                         width=width, wrap_columns=["case", "launch", "note"])
    return head + "\n" + table
