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
    from .workloads import SHAPES

    device = _device(args.device)
    dtype = DTYPES[args.dtype]
    cache_dtype = CACHE_DTYPES[args.kv_cache_dtype] or dtype
    weights = None
    if args.checkpoint:
        from .checkpoint import draft_shape
        from .weights import ContextKVWeights

        shape = draft_shape(args.checkpoint)
        weights = ContextKVWeights.from_checkpoint(args.checkpoint, device=device, dtype=dtype)
    else:
        shape = SHAPES[args.shape]
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
    check.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="states/query dtype")
    check.add_argument("--kv-cache-dtype", choices=list(CACHE_DTYPES), default="auto",
                       help="cache dtype (auto: as --dtype)")
    check.add_argument("--backend", action="append", choices=sorted(BACKEND_PATHS),
                       help="check only this backend (repeatable)")
    check.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)
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
