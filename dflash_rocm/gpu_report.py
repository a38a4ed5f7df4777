"""The verdict and summary of one ``scripts/gpu_check.sh`` run, from the files its steps wrote.

    python -m dflash_rocm.gpu_report LOGS OUT [--dry]

``LOGS`` holds each step's output (``assumptions.json``, ``bench.json``, ``host.json``,
``pytest.xml``, ``info.out``: ``info --json``'s, and with ``--peer`` ``peer.json``, else
``peer.none``: why vLLM's kernels were not timed) and ``steps.tsv`` (one line per step: name, exit status,
seconds taken, seconds allowed). Writes ``OUT/summary.txt`` (also printed; at most
:data:`SUMMARY_LIMIT` characters: every measured figure beside its modelled one and their
ratio) and ``OUT/figures.json`` (every figure). Exits 1 when a step failed or made nothing,
naming each: an exit status alone cannot say that a table came out empty.

The rules (:func:`problems`): every step exits 0 within its time; the assumptions have rows
and none says ``ERROR`` (on a GPU every row is measured); the bench has a measured row of the
backend the model covers (``rocm`` on AMD, ``triton`` elsewhere) and no row whose model
failed; the host table has rows of both operations; pytest ran tests, none failed, and on a
GPU at least one passed; where vLLM's kernels were asked for (``--peer``), the peer step made
rows and every case was measured on both sides without an ``ERROR`` (asked for, its failure
fails the run; not asked for, the summary says in one line that they were not timed, and why).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from .ops import OPS

SUMMARY_LIMIT = 10_000


@dataclass(frozen=True)
class Step:
    name: str
    exit_status: int
    seconds: float
    budget: float

    def describe(self) -> str:
        state = "ok" if self.exit_status == 0 else ("timed out" if self.exit_status == 124 else
                                                     f"exit {self.exit_status}")
        return f"{self.name} {state} {self.seconds:.0f}/{self.budget:.0f} s"


def read_steps(logs: Path) -> list[Step]:
    path = logs / "steps.tsv"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        name, status, seconds, budget = line.split("\t")
        steps.append(Step(name=name, exit_status=int(status), seconds=float(seconds), budget=float(budget)))
    return steps


def _text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _json(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def junit_counts(path: Path) -> dict[str, int]:
    """tests, failures, errors, skipped (and passed) of a JUnit file; zeros when absent."""
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {**counts, "passed": 0}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}


def modelled_backend(info: dict) -> str:
    """The backend ``dflash-rocm inspect`` models on the device ``info`` describes."""
    from .audit.targets import modelled_backend as for_vendor

    return for_vendor(info.get("device", {}).get("vendor", ""))


@dataclass
class Figures:
    info: dict
    steps: list[Step]
    assumptions: list[dict]
    bench: list[dict]
    host: list[dict]
    tests: dict[str, int]
    dry: bool
    peer: list[dict]  # bench --peer's rows (empty: not asked for, or it made none)
    peer_not_timed: str  # why vLLM's kernels were not timed ("": they were asked for)

    @classmethod
    def read(cls, logs: Path, dry: bool) -> "Figures":
        return cls(info=_json(logs / "info.out", {}), steps=read_steps(logs),
                   assumptions=_json(logs / "assumptions.json", []),
                   bench=_json(logs / "bench.json", {}).get("rows", []), host=_json(logs / "host.json", []),
                   tests=junit_counts(logs / "pytest.xml"), dry=dry,
                   peer=_json(logs / "peer.json", {}).get("rows", []), peer_not_timed=_text(logs / "peer.none"))

    def as_dict(self) -> dict:
        return {"dry": self.dry, "info": self.info, "steps": [s.__dict__ for s in self.steps],
                "assumptions": self.assumptions, "bench": self.bench, "host": self.host, "tests": self.tests,
                "peer": self.peer, "peer_not_timed": self.peer_not_timed, "problems": problems(self)}


def problems(figures: Figures) -> list[str]:
    """Why the run is not a success, one line each (empty: it is)."""
    found = [f"step {s.describe()}" for s in figures.steps if s.exit_status != 0]
    if not figures.steps:
        found.append("no step ran (steps.tsv missing)")
    if not figures.assumptions:
        found.append("bench --assumptions made no row")
    for row in figures.assumptions:
        if "ERROR" in row.get("note", ""):
            found.append(f"bench --assumptions: {row['check']} {row['case']} {row['config']}: {row['note']}")
        elif row.get("measured") is None and not (figures.dry and row.get("check") == "gap-graph"):
            found.append(f"bench --assumptions: {row['check']} {row['case']} {row['config']}: nothing measured")
    backend = modelled_backend(figures.info)
    if not any(r.get("backend") == backend and r.get("us") for r in figures.bench):
        found.append(f"bench made no measured {backend} row (the backend the model covers here)")
    found += [f"bench: {r['op']} {r['case']} {r['backend']}: {r['note']}" for r in figures.bench
              if "ERROR model" in r.get("note", "")]
    missing = sorted(set(OPS) - {r.get("op") for r in figures.host})
    if missing:
        found.append(f"bench --host made no row of {', '.join(missing)}")
    t = figures.tests
    if t["tests"] == 0:
        found.append("pytest ran no test")
    if t["failures"] or t["errors"]:
        found.append(f"pytest: {t['failures']} failed, {t['errors']} errors")
    if not figures.dry and t["passed"] == 0:
        found.append("pytest passed no test on the GPU")
    return found + _peer_problems(figures)


def _peer_problems(figures: Figures) -> list[str]:
    """vLLM's kernels, where ``--peer`` asked for them (a peer step in steps.tsv)."""
    if not any(s.name == "peer" for s in figures.steps):
        return []
    if not figures.peer:
        return ["bench --peer made no row"]
    found = [f"bench --peer: {r['case']}: {r['note']}" for r in figures.peer if "ERROR" in r.get("note", "")]
    return found + [f"bench --peer: {r['case']}: not measured on both sides" for r in figures.peer
                    if "ERROR" not in r.get("note", "") and (r.get("ours_us") is None or r.get("vllm_us") is None)]


def _num(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _ratio(measured, model) -> str:
    return "-" if measured is None or not model else f"{measured / model:.2f}"


def _op(name: str) -> str:
    return OPS[name].short if name in OPS else name


def _lines_assumptions(rows: list[dict]) -> list[str]:
    out = ["== the model's assumptions (measured beside modelled; ratio = measured / model)",
           f"{'check':<10} {'case':<34} {'launch':<34} {'unit':<4} {'measured':>9} {'model':>8} {'ratio':>6}"]
    for r in rows:
        spec = ".1f" if r["unit"] == "us" else ".2f"
        out.append(f"{r['check']:<10} {r['case'][:34]:<34} {r['config'][:34]:<34} {r['unit']:<4} "
                   f"{_num(r['measured'], spec):>9} {_num(r['model'], spec):>8} {_ratio(r['measured'], r['model']):>6}")
        if "ERROR" in r.get("note", ""):
            out.append(f"    {r['note'][:160]}")
    return out


def _lines_bench(rows: list[dict]) -> list[str]:
    out = ["== bench at real shapes (us measured; model = dflash-rocm inspect's; % of the hardware floor)",
           f"{'op':<16} {'case':<22} {'backend':<16} {'us':>9} {'model':>8} {'ratio':>6} {'%floor':>6}"]
    for r in rows:
        if r.get("us") is None:
            out.append(f"{_op(r['op']):<16} {r['case'][:22]:<22} {r['backend'][:16]:<16} not run: "
                       f"{r.get('note', '')[:60]}")
            continue
        out.append(f"{_op(r['op']):<16} {r['case'][:22]:<22} {r['backend'][:16]:<16} {_num(r['us']):>9} "
                   f"{_num(r.get('model_us')):>8} {_ratio(r['us'], r.get('model_us')):>6} "
                   f"{_num(r.get('pct_floor'), '.0f'):>6}")
    return out


def _lines_host(rows: list[dict]) -> list[str]:
    out = ["== host microseconds per call (launches captured; the driver call not included)",
           f"{'op':<16} {'backend':<8} {'path':<9} {'validate':<8} {'host':>7} {'total':>7} {'target':>7}"]
    out += [f"{_op(r['op']):<16} {r['backend']:<8} {r['path']:<9} {str(r['validate']):<8} {r['host_us']:>7.1f} "
            f"{r['total_us']:>7.1f} {r['target_us']:>7.1f}" for r in rows]
    return out


def _lines_peer(figures: Figures) -> list[str]:
    if not figures.peer:
        return [f"== vLLM's own kernels: not timed ({figures.peer_not_timed})"] if figures.peer_not_timed else []
    out = ["== vLLM's TRITON_ATTN kernel beside ours (bench --peer: us measured; ratio = ours / vLLM's; "
           "m = model, x = measured / model)",
           f"{'case':<16} {'ours':>9} {'vLLM':>9} {'ratio':>6} {'ours m':>8} {'x':>5} {'vLLM m':>8} {'x':>5}"]
    for r in figures.peer:
        out.append(f"{r['case'][:16]:<16} {_num(r.get('ours_us')):>9} {_num(r.get('vllm_us')):>9} "
                   f"{_num(r.get('ratio'), '.2f'):>6} {_num(r.get('ours_model_us')):>8} "
                   f"{_num(r.get('ours_vs_model'), '.2f'):>5} {_num(r.get('vllm_model_us')):>8} "
                   f"{_num(r.get('vllm_vs_model'), '.2f'):>5}")
        if r.get("note"):
            out.append(f"    {r['note'][:160]}")
    return out


def summary(figures: Figures) -> str:
    """The printed summary, cut to :data:`SUMMARY_LIMIT` characters (figures.json has all)."""
    info = figures.info
    device = info.get("device", {})
    packages = info.get("packages", {})
    head = [f"gpu_check {'dry rehearsal (CPU, interpreter: no figure of any GPU)' if figures.dry else 'GPU run'}: "
            f"{device.get('name', '?')} ({device.get('arch', '?')}); torch {packages.get('torch')}, "
            f"triton {packages.get('triton')}; dflash_rocm {info.get('dflash_rocm')}",
            "steps: " + " | ".join(s.describe() for s in figures.steps),
            "pytest: {tests} run, {passed} passed, {skipped} skipped, {failures} failed, {errors} errors".format(
                **figures.tests)]
    found = problems(figures)
    verdict = ["== verdict: " + ("OK" if not found else f"FAILED ({len(found)})")] + [f"- {p}"[:300] for p in found]
    body = (_lines_assumptions(figures.assumptions) + _lines_bench(figures.bench) + _lines_peer(figures)
            + _lines_host(figures.host))
    room = SUMMARY_LIMIT - len("\n".join(head + verdict)) - 200
    kept, used = [], 0
    for line in body:
        if used + len(line) + 1 > room:
            kept.append(f"... {len(body) - len(kept)} more lines in figures.json")
            break
        kept.append(line)
        used += len(line) + 1
    return "\n".join(head + kept + verdict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_rocm.gpu_report", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", type=Path, help="the folder the steps wrote to")
    parser.add_argument("out", type=Path, help="where summary.txt and figures.json go")
    parser.add_argument("--dry", action="store_true", help="a CPU rehearsal: no GPU test has to pass")
    args = parser.parse_args(argv)
    figures = Figures.read(args.logs, args.dry)
    text = summary(figures)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.txt").write_text(text + "\n")
    (args.out / "figures.json").write_text(json.dumps(figures.as_dict(), indent=2))
    print(text)
    return 1 if problems(figures) else 0


if __name__ == "__main__":
    sys.exit(main())
