"""The audit as a table (100 columns), JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import textwrap
from itertools import groupby

from .run import Audit, CaseResult, LaunchResult
from .sweep import PACKINGS, kilo
from .targets import TARGETS

WIDTH = 100
_SHORT = {"draft_attention_kernel": "attn", "merge_segments_kernel": "merge", "context_kv_kernel": "kv"}
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
        return f"N={c.tokens}{pages}{' w8' if c.fp8_weights else ''}"
    span = f"/{kilo(c.planned_span)}" if c.planned_span else ""
    return f"b{c.batch} {kilo(c.context)}{span}{pages}"


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
    several = len({r.case.shape.name for r in results}) > 1  # headings name the shape (e.g. per TP degree)
    for (arch, shape, op, kv), group in groupby(results, key=lambda r: (r.target.arch, r.case.shape.name, r.case.op,
                                                                        r.case.fp8)):
        group = list(group)
        target = TARGETS[arch]
        lines.append("")
        lines.append(f"== {arch} {op} {'fp8' if kv else 'bf16'} KV" + (f", {shape}" if several else ""))
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
    lines += format_captured_plans(captured_plans(audit))
    return "\n".join(lines)


CAPTURE_TARGET = 1.25  # a captured plan's modelled cost stays within this factor of the eager plan's (the wave64
# merge chunk made the eager b1 1k plans ~15 % faster; the captured plans' absolute cost did not change)


def captured_plans(audit: Audit) -> list[dict]:
    """Each case planned for a longer span (``planned_span``: a CUDA graph captured with
    ``max_seq_len = max_model_len``) beside the same case planned for its real length, as
    modelled: one row per case and cache variant whose eager case the audit has, with the
    modelled microseconds and ratio of each planned span."""
    eager = {(r.target.arch, r.case.shape.name, r.case.fp8, r.case.batch, r.case.context, r.case.packing,
              r.cache_variant): r for r in audit.cases if r.case.op == "attention" and not r.case.planned_span}
    rows: dict[tuple, dict] = {}
    for r in audit.cases:
        c = r.case
        key = (r.target.arch, c.shape.name, c.fp8, c.batch, c.context, c.packing, r.cache_variant)
        base = eager.get(key)
        if c.op != "attention" or not c.planned_span or base is None or None in (base.modelled_s, r.modelled_s):
            continue
        row = rows.setdefault(key, {"target": r.target.arch, "shape": c.shape.name, "kv": "fp8" if c.fp8 else "bf16",
                                    "label": _case_label(base), "cache": r.cache_variant,
                                    "eager_us": base.modelled_s * 1e6, "planned": {}})
        row["planned"][c.planned_span] = {"us": r.modelled_s * 1e6, "ratio": r.modelled_s / base.modelled_s}
    return list(rows.values())


def format_captured_plans(rows: list[dict]) -> list[str]:
    """The captured-plan table (see :func:`captured_plans`)."""
    if not rows:
        return []
    spans = sorted({span for row in rows for span in row["planned"]})
    title = (f"== captured plans: modelled us of each case under a plan made for a longer span (a CUDA graph "
             f"captured with max_seq_len = max_model_len) beside its plan for the real length (eager), and "
             f"their ratio (target: within {CAPTURE_TARGET}x)")
    head = f"{'target':<7} {'kv':<4} {'case':<10} {'2G':<3} {'eager us':>9}" + "".join(
        f" {'plan ' + kilo(span):>17}" for span in spans)
    lines = ["", *textwrap.wrap(title, WIDTH, subsequent_indent="   "), head]
    for row in rows:
        line = f"{row['target']:<7} {row['kv']:<4} {row['label']:<10} {row['cache']:<3} {_num(row['eager_us']):>9}"
        for span in spans:
            found = row["planned"].get(span)
            line += f" {'-':>17}" if found is None else f" {_num(found['us']):>10} {found['ratio']:5.2f}x"
        lines.append(line.rstrip())
    return lines


def results_to_json(audit: Audit) -> str:
    targets = sorted({r.target.arch for r in audit.cases})
    return json.dumps({"measured": False, "note": "compiled facts and a model; nothing here ran on a GPU",
                       "assumptions": {a: TARGETS[a].assumptions() for a in targets},
                       "specialisations": audit.specialisations, "compiled_now": audit.compiled_now,
                       "cases": [r.as_dict() for r in audit.cases], "captured_plans": captured_plans(audit)},
                      indent=1)


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
