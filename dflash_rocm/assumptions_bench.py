"""``dflash-rocm bench --assumptions``: the figures the modelled goals rest on, each measured
on the device at hand and printed beside what the model assumed or predicted, with the ratio.

Rows, by ``check``:

- ``tp8``: the precompute of one rank of a TP8 deployment (one KV head) under the table's
  launch and the what-if launches the table was chosen against (no hidden-size split; an
  8-way split of 128-token tiles; half and twice the table's split). The table's choice rests
  on the model ranking these alike with the device.
- ``l2``: the TP1 precompute at N = 256, which the model says L2 binds.
- ``tp-ratio``: the TP1 time over the TP8 per-rank time at N = 256, measured beside the
  model's ratio (ideal scaling would be 8).
- ``gap-eager``: the cost of one more dependent launch of an empty kernel on one stream, no
  graph: the stream is held by a long kernel while ``n`` (then ``2n``) launches queue behind
  it, so the host's launch cost is hidden and the device's is timed. This is what the model
  charges every launch (``launch_gap_s``).
- ``gap-graph``: the same launches replayed from a captured graph (what vLLM's FULL graphs
  replay); not modelled, the model charges the eager gap.
- ``l2-read`` / ``dram-read``: the bandwidth a read kernel (:mod:`dflash_rocm.probe_kernels`)
  reaches over a buffer that fits in the L2 (half its size), then one that does not (1 GiB),
  beside the model's ``l2_bandwidth`` and the vendor's DRAM peak.

GPU kernels are timed with device events, the median of interleaved repeats
(:mod:`dflash_rocm.timing`; the L2 flushed before each timed precompute). On a CPU
(``gpu_check.sh --dry``) every row runs at scaled-down shapes through the Triton interpreter
and the host clock: a rehearsal of the code, no figure of any GPU, and no model (the model
compiles for a GPU target, which a process running the interpreter cannot; tests/test_audit.py
checks the model). A row whose measurement or model fails says ``ERROR`` in its note (one
failure spoils no other row); a model that does not apply says why.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from .audit.targets import Target
from .floors import peak_for
from .ops import PRECOMPUTE
from .planning import on_platform, record_for
from .platform import Platform, platform_for
from .report import format_table, wrap
from .timing import interleaved_median_seconds, l2_flush, synchronize
from .workloads import SHAPES, DraftShape, precompute_inputs

SHAPE = SHAPES["qwen3-8b-dflash-b16"]
TP = 8
TP_TOKENS = (256, 1024)  # per-rank precompute cases
L2_TOKENS = 256  # the TP1 case, and the tokens of the tp-ratio row
GAP_LAUNCHES = 50  # n and 2n dependent launches
DRAM_READ_BYTES = 1 << 30  # past every modelled L2 and Infinity Cache


@dataclass
class AssumptionRow:
    check: str  # see the module docstring
    case: str
    config: str  # which launch or probe
    unit: str = "us"  # of measured and model: "us", "TB/s" or "x" (a ratio)
    measured: float | None = None
    model: float | None = None
    note: str = ""

    @property
    def error(self) -> bool:
        return "ERROR" in self.note

    @property
    def ratio(self) -> float | None:
        """measured / model (None when either is missing)."""
        if self.measured is None or not self.model:
            return None
        return self.measured / self.model

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def _error(what: str, exc: Exception) -> str:
    return f"ERROR {what}{type(exc).__name__}: {exc}"[:200]


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
        from .backends import rocm

        record, facts = record_for(PRECOMPUTE.name, "rocm", call)
        return rocm.precompute_choice(on_platform(record, platform), facts)
    from .backends.triton.precompute import precompute_config_for

    return precompute_config_for(call, platform)


def _model_us(shape: DraftShape, tokens: int, target: Target, config) -> tuple[float, dict]:
    """(modelled us, the first launch's model facts) of the precompute under ``config`` on
    ``target``; raises when the model cannot be computed."""
    from .audit import run, sweep
    from .audit.compiler import FactsCache, default_cache_dir

    result = run.model_case(sweep.Case("precompute", shape, False, tokens=tokens), target,
                            FactsCache(default_cache_dir()), config=config)
    launch = result.launches[0].model if result.launches else None
    return result.required_us(), (launch.as_dict() if launch else {})


def _time_us(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int,
             flush: bool = True) -> dict[str, float]:
    runnable = {name: (lambda i, fn=fn: fn()) for name, fn in fns.items()}
    seconds = interleaved_median_seconds(runnable, device, warmup=0 if device.type == "cpu" else 3,
                                         repeats=repeats, setup=l2_flush(device) if flush else None)
    return {name: s * 1e6 for name, s in seconds.items()}


def _precompute_runs(call, configs: dict) -> dict:
    """name -> a call of the precompute under that config (planned once, run once: compiled
    and warm), or the error that stopped it."""
    from .backends.triton.precompute import precompute_runner

    record, facts = record_for(PRECOMPUTE.name, "triton", call)
    runs = {}
    for name, config in configs.items():
        try:
            runner = precompute_runner(record, facts, config)
            runner.run(call)
            runs[name] = lambda runner=runner: runner.run(call)
        except Exception as exc:  # this launch's row says why; the others run
            runs[name] = _error("", exc)
    return runs


def _describe(config) -> str:
    return f"t{config.block_t} w{config.num_warps} split {config.split_k}" + (" h2" if config.heads == 2 else "")


def precompute_rows(*, check: str, shape: DraftShape, tokens: int, device: torch.device, platform: Platform,
                    target: Target | None, repeats: int, what_ifs: bool) -> list[AssumptionRow]:
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
        return [AssumptionRow(check=check, case=case, config="table", note=_error("", exc))]
    rows = []
    for name, config in configs.items():
        row = AssumptionRow(check=check, case=case, config=f"{name} ({_describe(config)})",
                            measured=measured.get(name))
        notes = [runs[name]] if isinstance(runs[name], str) else []
        if device.type == "cpu":
            notes.append("CPU rehearsal: scaled shape, interpreter, host clock")
        if target is None:
            notes.append(f"not modelled: no audit target for {platform.arch}" if device.type != "cpu" else
                         "not modelled: a CPU rehearsal")
        else:
            try:
                row.model, facts = _model_us(shape, tokens, target, config)
                if check == "l2" and facts:
                    notes.append(f"model: bound {facts['bound']}, {facts['requested_bytes'] / 1e6:.0f} MB through L2 "
                                 f"at {target.l2_bandwidth / 1e12:.1f} TB/s assumed")
            except Exception as exc:
                notes.append(_error(f"model ({target.arch}): ", exc))
        row.note = "; ".join(notes)
        rows.append(row)
    return rows


def tp_ratio_row(tp1: AssumptionRow, tp8: AssumptionRow) -> AssumptionRow:
    """TP1's time over a TP8 rank's at the same tokens (table launches), measured and modelled."""
    def ratio(a, b):
        return None if a is None or not b else a / b

    notes = [f"ideal 1/TP scaling: {TP}"]
    if tp1.error or tp8.error:
        notes.append("ERROR: a row it divides failed")
    return AssumptionRow(check="tp-ratio", case=f"TP1 / TP{TP} rank, {tp1.case.rpartition(' ')[2]}", config="table",
                         unit="x", measured=ratio(tp1.measured, tp8.measured), model=ratio(tp1.model, tp8.model),
                         note="; ".join(notes))


def _hold(device: torch.device) -> Callable[[], object]:
    """A call that keeps ``device``'s stream busy for a while (matrix products), so launches
    queued behind it are timed by the device alone."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    return lambda: a @ a


def _eager_us(device: torch.device, launches: int, repeats: int) -> float:
    """Device microseconds per extra dependent launch of the empty kernel, no graph."""
    from .probe_kernels import launch_empty

    x = torch.zeros(1, device=device)
    launch_empty(x)  # compiled
    if device.type != "cuda":
        times = {}
        for n in (launches, 2 * launches):
            start = time.perf_counter()
            for _ in range(n):
                launch_empty(x)
            times[n] = (time.perf_counter() - start) * 1e6
        return (times[2 * launches] - times[launches]) / launches
    synchronize(device)
    start = time.perf_counter()
    for _ in range(2 * launches):
        launch_empty(x)
    enqueue_s = time.perf_counter() - start  # the host's time to queue the longer chain
    synchronize(device)
    hold = _hold(device)
    hold_us = _time_us({"hold": hold}, device, 5, flush=False)["hold"]
    holds = max(1, math.ceil(3 * enqueue_s * 1e6 / hold_us))  # the queue fills before the hold ends

    def queued(n):
        def run():
            for _ in range(holds):
                hold()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(n):
                launch_empty(x)
            end.record()
            end.synchronize()
            return begin.elapsed_time(end) * 1e3
        return run

    samples = {n: sorted(queued(n)() for _ in range(repeats)) for n in (launches, 2 * launches)}
    medians = {n: s[len(s) // 2] for n, s in samples.items()}
    return (medians[2 * launches] - medians[launches]) / launches


def _graph_us(device: torch.device, launches: int, repeats: int) -> float:
    """Device microseconds per extra launch of the empty kernel in a replayed graph."""
    from .probe_kernels import launch_empty

    x = torch.zeros(1, device=device)
    replays = {}
    for n in (launches, 2 * launches):
        launch_empty(x)
        synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                launch_empty(x)
        replays[n] = graph.replay
    times = _time_us(replays, device, repeats, flush=False)
    return (times[2 * launches] - times[launches]) / launches


def launch_gap_rows(device: torch.device, target: Target | None, launches: int = GAP_LAUNCHES,
                    repeats: int = 20) -> list[AssumptionRow]:
    """The eager gap (the model's ``launch_gap_s``) and the graph-replay gap."""
    case = f"{launches} vs {2 * launches} dependent empty launches"
    eager = AssumptionRow(check="gap-eager", case=case, config="one stream, no graph",
                          model=None if target is None else target.launch_gap_s * 1e6)
    graph = AssumptionRow(check="gap-graph", case=case, config="graph replay",
                          note="not modelled: the model charges every launch the eager gap")
    try:
        eager.measured = _eager_us(device, launches, repeats)
        eager.note = ("CPU rehearsal: interpreter launches, host clock" if device.type == "cpu" else
                      "stream held by a long kernel while the launches queue; includes the empty kernel's run")
    except Exception as exc:
        eager.note = _error("", exc)
    if device.type == "cuda":
        try:
            graph.measured = _graph_us(device, launches, repeats)
        except Exception as exc:
            graph.note = _error("", exc)
    else:
        graph.note = "CPU rehearsal: no graphs on a CPU; " + graph.note
    if target is None:
        eager.note += "; not modelled here"
    return [eager, graph]


def _read_tbps(device: torch.device, nbytes: int, repeats: int) -> float:
    from .probe_kernels import ReadKernel

    kernel = ReadKernel(torch.ones(nbytes // 4, dtype=torch.float32, device=device))
    kernel()  # compiled, and the buffer brought into the L2 where it fits
    us = _time_us({"read": kernel}, device, repeats, flush=False)["read"]
    return kernel.bytes_moved / (us * 1e-6) / 1e12


def device_l2_bytes(device: torch.device) -> int | None:
    """The L2 size the runtime reports (None off a GPU, or when it does not say)."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None) or None


def read_rows(device: torch.device, target: Target | None, repeats: int) -> list[AssumptionRow]:
    """Read bandwidth from the L2 (a buffer half its size) and from DRAM (1 GiB)."""
    reported = device_l2_bytes(device)
    modelled_l2 = None if target is None else target.l2_bytes * target.l2_domains
    fit = min(b for b in (reported, modelled_l2, 64 << 20) if b) // 2
    if device.type == "cpu":
        fit, big = 1 << 16, 1 << 20  # the interpreter: a rehearsal of the code
    else:
        big = DRAM_READ_BYTES
    sizes = f"L2 {reported / 2**20:.0f} MiB reported" if reported else "L2 size not reported"
    if modelled_l2:
        sizes += f", {modelled_l2 / 2**20:.0f} MiB modelled"
    peak = None if target is None else target.peak.bandwidth / 1e12
    rows = [AssumptionRow(check="l2-read", case=f"{fit / 2**20:.2f} MiB buffer", config="read kernel", unit="TB/s",
                          model=None if target is None else target.l2_bandwidth / 1e12, note=sizes),
            AssumptionRow(check="dram-read", case=f"{big / 2**20:.0f} MiB buffer", config="read kernel", unit="TB/s",
                          model=peak, note="" if peak is None else "model: the vendor's DRAM peak")]
    for row, nbytes in zip(rows, (fit, big)):
        try:
            row.measured = _read_tbps(device, nbytes, repeats)
        except Exception as exc:
            row.note = _error("", exc) + "; " + row.note
        if device.type == "cpu":
            row.note = "CPU rehearsal: interpreter, host clock; " + row.note
    return rows


def assumption_rows(device: torch.device, repeats: int | None = None,
                    progress: Callable[[AssumptionRow], None] | None = None) -> list[AssumptionRow]:
    """Every row (see the module docstring); a CPU runs scaled shapes. ``progress`` sees each
    row as it is made (a run cut short still leaves those)."""
    from .audit import run

    platform = platform_for(device)
    target = run.target_for(platform, peak_for(platform))  # None on a CPU
    cpu = device.type == "cpu"
    repeats = repeats or (1 if cpu else 20)
    shape, tp_tokens, l2_tokens = SHAPE, TP_TOKENS, L2_TOKENS
    if cpu:
        shape, tp_tokens, l2_tokens = SHAPE.scaled_for_cpu(), (16,), 16
    rows: list[AssumptionRow] = []

    def made(new: list[AssumptionRow]) -> list[AssumptionRow]:
        for row in new:
            rows.append(row)
            if progress is not None:
                progress(row)
        return new

    common = dict(device=device, platform=platform, target=target, repeats=repeats)
    made(launch_gap_rows(device, target, repeats=repeats))
    made(read_rows(device, target, repeats))
    tp8 = {n: made(precompute_rows(check="tp8", shape=shape.per_rank(TP), tokens=n, what_ifs=True, **common))
           for n in tp_tokens}
    tp1 = made(precompute_rows(check="l2", shape=shape, tokens=l2_tokens, what_ifs=False, **common))
    if l2_tokens in tp8:
        made([tp_ratio_row(tp1[0], tp8[l2_tokens][0])])
    return rows


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if unit != "us" else f"{value:.1f}"


def format_rows(rows: list[AssumptionRow], platform: Platform, width: int | None = None) -> str:
    """The rows as a table: measured beside modelled and their ratio."""
    head = wrap(f"the model's assumptions on {platform.name} ({platform.arch}): measured (device events, median; "
                "host clock on a CPU) beside modelled (dflash-rocm inspect's model and its targets' figures; not "
                "measured); ratio = measured / model", width)
    table = format_table(["check", "case", "launch", "unit", "measured", "model", "ratio", "note"],
                         [(r.check, r.case, r.config, r.unit, _figure(r.measured, r.unit), _figure(r.model, r.unit),
                           "-" if r.ratio is None else f"{r.ratio:.2f}", r.note) for r in rows],
                         width=width, wrap_columns=["case", "launch", "note"])
    return head + "\n" + table
