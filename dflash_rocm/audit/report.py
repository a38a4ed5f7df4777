"""The audit as a table (100 columns), JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import textwrap
from itertools import groupby

from .run import Audit, CaseResult, LaunchResult
from .sweep import PACKINGS
from .targets import TARGETS

WIDTH = 100
_SHORT = {"draft_attention_kernel": "attn", "merge_segments_kernel": "merge", "context_kv_kernel": "kv",
          "context_kv_split_epilogue_kernel": "kv-epi"}
COLUMNS = (("case", 9), ("2G", 3), ("kernel", 6), ("prog/slot", 10), ("regs", 7), ("spil", 4), ("scr", 4),
           ("lds", 3), ("occ", 3), ("mma/ex", 6), ("st", 2), ("MB req/dram", 11), ("us", 6), ("floor", 5),
           ("%fl", 3))
LEGEND = (
    "per launch, compiled with the launch's own specialisation: xK/xKV = the cases on vLLM ROCM_ATTN's packed "
    "pages (x-packed K with plain/interleaved V); 2G = the attention's KV cache tensor is under "
    "or over 2 GiB (AMD buffer loads need under); prog/slot = programs that do work / programs resident at "
    "once; regs = VGPR/AGPR (AMD) or registers per thread (sm_90); spil = VGPR spills (AMD) or spill stores "
    "(sm_90); scr = scratch bytes per lane; lds = shared memory KiB per workgroup; occ = resident waves per "
    "SIMD; mma/ex = matrix and exp instructions per hot-loop trip of one wave (per source trip where the "
    "compiler unrolled the loop); st = store width in bytes "
    "(the most frequent); MB req/dram = "
    "bytes the programs move through L2 / bytes the model sends to DRAM; us = modelled launch time with its "
    "bound (i issue, d DRAM, l L2, c Infinity Cache; a launch whose merger programs wait on the rest is "
    "modelled in two phases, one after the other, the bound that of the summed terms); floor = us the "
    "floor bytes take at peak bandwidth; %fl = floor / modelled time of the whole case.")
NOTICE = "MODELLED, NOT MEASURED: no figure here ran on a GPU."


def short_kernel(name: str) -> str:
    return _SHORT.get(name, name.removesuffix("_kernel")[:6])


def _case_label(r: CaseResult) -> str:
    c = r.case
    pages = f" {PACKINGS[c.packing]}" if c.packing != "plain" else ""
    if c.op == "precompute":
        return f"N={c.tokens}{pages}"
    ctx = f"{c.context // 1024}k" if c.context % 1024 == 0 else str(c.context)
    span = f"/{c.table_span // 1024}k" if c.table_span else ""
    return f"b{c.batch} {ctx}{span}{pages}"


def _store_width(facts: dict) -> str:
    widths = facts.get("store_widths") or {}
    return max(widths, key=lambda w: (widths[w], int(w))) if widths else ""


def _num(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _launch_cells(launch: LaunchResult) -> list[str]:
    f, m = launch.facts, launch.model
    if launch.error:
        return [short_kernel(launch.kernel), "compile error: " + launch.error[:60]]
    loop = f.get("hot_loop") or {}
    regs = f"{f['vgpr']}/{f['agpr']}" if "registers" not in f else str(f["registers"])
    mma = f"{loop.get('matrix', 0) // m.unroll}/{loop.get('exp', 0) // m.unroll}" if loop else ""
    bound = {"issue": "i", "DRAM": "d", "L2": "l", "IC": "c"}[m.bound]
    return [short_kernel(launch.kernel), f"{m.active_programs}/{m.slots}", regs,
            str(f["vgpr_spills"]), str(f["scratch_bytes"]),
            f"{f['shared_bytes'] // 1024}", f"{m.occupancy.waves_per_simd:g}", mma, _store_width(f),
            f"{_num(m.requested_bytes / 1e6)}/{_num(m.dram_bytes / 1e6)}", f"{_num(m.seconds * 1e6)}{bound}"]


def _line(cells: list[str]) -> str:
    out = []
    for (_, width), cell in zip(COLUMNS, cells):
        out.append(cell.rjust(width) if cell[:1].isdigit() else cell.ljust(width))
    return " ".join(out).rstrip()


def format_results(audit: Audit) -> str:
    results = audit.cases
    lines = [f"{audit.specialisations} compiled kernels ({audit.compiled_now} compiled now, the rest cached)"]
    lines += textwrap.wrap(LEGEND, WIDTH) + [NOTICE]
    for (arch, op, kv), group in groupby(results, key=lambda r: (r.target.arch, r.case.op, r.case.fp8)):
        group = list(group)
        target = TARGETS[arch]
        lines.append("")
        lines.append(f"== {arch} {op} {'fp8' if kv else 'bf16'} KV")
        lines += ["   " + w for w in textwrap.wrap("model: " + target.assumptions(), WIDTH - 3)]
        lines.append(_line([name for name, _ in COLUMNS]))
        for r in group:
            head = [_case_label(r), r.cache_variant]
            if r.skipped:
                lines.append(_line(head) + " skipped: " + r.skipped)
                continue
            for i, launch in enumerate(r.launches):
                cells = (head if i == 0 else ["", ""]) + _launch_cells(launch)
                if i == 0:
                    pct = r.pct_floor
                    cells += [_num(r.floor_s * 1e6), "" if pct is None else f"{pct:.0f}"]
                lines.append(_line(cells))
    return "\n".join(lines)


def results_to_json(audit: Audit) -> str:
    targets = sorted({r.target.arch for r in audit.cases})
    return json.dumps({"measured": False, "note": "compiled facts and a model; nothing here ran on a GPU",
                       "assumptions": {a: TARGETS[a].assumptions() for a in targets},
                       "specialisations": audit.specialisations, "compiled_now": audit.compiled_now,
                       "cases": [r.as_dict() for r in audit.cases]}, indent=1)


CSV_FIELDS = ("target", "op", "kv", "label", "cache", "config_name", "kernel", "grid", "programs",
              "active_programs", "slots", "vgpr", "agpr", "registers", "vgpr_spills", "sgpr_spills", "scratch_bytes",
              "shared_bytes", "waves_per_simd", "groups_per_unit", "matrix_per_iter", "exp_per_iter", "store_width",
              "requested_bytes", "dram_bytes", "reread_bytes", "write_bytes", "launch_us", "bound", "case_floor_us",
              "case_modelled_us", "case_pct_floor")


def results_to_csv(audit: Audit) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for r in audit.cases:
        base = {"target": r.target.arch, "op": r.case.op, "kv": "fp8" if r.case.fp8 else "bf16",
                "label": r.case.label, "cache": r.cache_variant, "config_name": r.config_name,
                "case_floor_us": r.floor_s * 1e6,
                "case_modelled_us": None if r.modelled_s is None else r.modelled_s * 1e6,
                "case_pct_floor": r.pct_floor}
        for launch in r.launches:
            f, m = launch.facts, launch.model
            row = dict(base, kernel=launch.kernel, grid="x".join(map(str, launch.grid)))
            if m is not None:
                loop = f.get("hot_loop") or {}
                row.update(programs=m.programs, active_programs=m.active_programs, slots=m.slots, vgpr=f["vgpr"],
                           agpr=f["agpr"], registers=f.get("registers"), vgpr_spills=f["vgpr_spills"],
                           sgpr_spills=f.get("sgpr_spills"), scratch_bytes=f["scratch_bytes"],
                           shared_bytes=f["shared_bytes"], waves_per_simd=m.occupancy.waves_per_simd,
                           groups_per_unit=m.occupancy.groups_per_unit,
                           matrix_per_iter=loop["matrix"] // m.unroll if loop else None,
                           exp_per_iter=loop["exp"] // m.unroll if loop else None, store_width=_store_width(f),
                           requested_bytes=m.requested_bytes, dram_bytes=m.dram_bytes, reread_bytes=m.reread_bytes,
                           write_bytes=m.write_bytes, launch_us=m.seconds * 1e6, bound=m.bound)
            writer.writerow(row)
    return out.getvalue()
