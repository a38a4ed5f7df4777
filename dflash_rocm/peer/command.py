"""``dflash-rocm inspect --peer PATH`` and ``--step``: the side-by-side report and the step model."""

from __future__ import annotations

import json
from typing import Callable

from dflash_rocm.audit.compiler import FactsCache, default_cache_dir

from . import compare, precompute, report, source, step


def run(args, emit: Callable, progress: Callable | None) -> int:
    """The command (``emit``: the CLI's table/JSON/CSV writer). The attention cases are
    bf16 KV, fp8 KV and a sliding window, or only the ``--kv`` dtypes given. Exit status 1
    when a kernel of either side did not compile."""
    acceptance = step.ACCEPTANCE if args.acceptance is None else args.acceptance
    block = step.DRAFTS["qwen3-8b"][0].block_tokens
    if not 1 <= acceptance <= block:
        raise ValueError(f"--acceptance: expected tokens per step from 1 to the block's {block}, got {acceptance:g}")
    root = source.resolve_tree(args.peer)
    version = report.peer_version(root)
    cache = FactsCache(None if args.no_cache else (args.cache_dir or default_cache_dir()))
    targets = tuple(args.target or compare.PEER_TARGETS)
    if args.step:
        rows = step.step_rows(root, cache, gpus=tuple(args.target or ("gfx942",)),
                              batches=tuple(args.batch or step.STEP_BATCHES),
                              contexts=tuple(args.context or (step.PLOT_CONTEXTS if args.plot else step.STEP_CONTEXTS)),
                              tp=(args.tp or [1])[0], acceptance=acceptance)
        emit(lambda: step.format_steps(rows), ((args.json, lambda: json.dumps(step.steps_as_dicts(rows), indent=1)),))
        if args.plot:
            for path in step.plot_steps(rows, args.plot):
                print(f"wrote {path}")
        return 1 if any(r.ours_us is None for r in rows) else 0
    cases = compare.peer_cases(targets=targets, batches=tuple(args.batch or compare.BATCHES),
                               contexts=tuple(args.context or compare.CONTEXTS),
                               variants=tuple(args.kv or compare.VARIANTS))
    attention = compare.compare(root, cases, cache, progress=progress)
    pre = precompute.precompute_rows(cache, targets=targets,
                                     tokens=tuple(args.tokens or precompute.PRECOMPUTE_TOKENS),
                                     kv=tuple(args.kv or ("bf16", "fp8")))
    emit(lambda: report.format_report(attention, pre, version),
         ((args.json, lambda: report.to_json(attention, pre, version)),
          (args.csv, lambda: report.to_csv(attention, pre))))
    failed = [r for r in attention if r.ours_us is None or any(
        p.note.startswith("compile error") for p in r.paths.values())]
    return 1 if failed or any(r.ours_us is None for r in pre) else 0
