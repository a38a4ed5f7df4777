"""scripts/gpu_check.sh rehearsed as the lent GPU machine runs it, so the one GPU call a task
may get is not lost: a clean copy of the checkout, an interpreter where this package is not
installed (``python -S``: no ``.pth`` file, hence no editable import hook), ``--dry``. And the
judge that reads its steps' files (:mod:`dflash_rocm.gpu_report`), on made-up runs."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_rocm import gpu_report
from dflash_rocm.ops import ATTENTION, PRECOMPUTE
from dflash_rocm.peer import source
from peer_tree import write_attention_tree
from support import HAS_GPU, HAS_TRITON, bare_interpreter

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path("scripts") / "gpu_check.sh"
GPU_MACHINE_FILES = 8  # what comes back from the GPU machine's $OUT


def clean_copy(dest: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """The checkout's tracked files as they are on disk (a clean clone of the working tree;
    links kept), less the top-level entries in ``leave_out``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if name.split("/")[0] in leave_out or not os.path.lexists(ROOT / name):
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target, follow_symlinks=False)
    return dest


def bare_python(tmp_path: Path) -> tuple[str, dict]:
    """(an executable that runs this Python with ``-S``, the environment giving it this
    environment's site-packages): what ``PYTHON=`` hands the script."""
    prefix, env = bare_interpreter(tmp_path)
    wrapper = tmp_path / "python-bare"
    wrapper.write_text("#!/bin/sh\nexec " + " ".join(prefix) + ' "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper), env


def run_script(checkout: Path, tmp_path: Path, timeout: int, *args: str) -> subprocess.CompletedProcess:
    python, env = bare_python(tmp_path)
    env.update(OUT=str(tmp_path / "out"), PYTHON=python)
    env.pop("DFLASH_PEER", None)
    return subprocess.run(["bash", str(checkout / SCRIPT), "--dry", *args], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=timeout)


needs_git_and_cpu = pytest.mark.skipif(HAS_GPU or not HAS_TRITON or shutil.which("git") is None
                                       or not (ROOT / ".git").exists(),
                                       reason="the dry rehearsal runs on machines without a GPU, from a git checkout")


@pytest.mark.slow
@needs_git_and_cpu
def test_the_dry_rehearsal_makes_every_row_within_the_budget(tmp_path):
    """With ``--peer`` (the stand-in vLLM tree of :mod:`peer_tree`): vLLM's kernel timed too."""
    checkout = clean_copy(tmp_path / "clone")
    tree = write_attention_tree(tmp_path / "vllm-tree")
    result = run_script(checkout, tmp_path, 600, "--peer", str(tree))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    budget = re.fullmatch(r"budget (\d+) s \((.*)\)", result.stdout.splitlines()[0])
    assert budget and int(budget.group(1)) <= 540
    assert sum(int(n) for n in re.findall(r"(\d+)", budget.group(2))) == int(budget.group(1))
    assert re.search(r"imports from the scratch install: /\S+/site/dflash_rocm/backends/", result.stdout)
    out = tmp_path / "out"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench.png", "figures.json", "logs.tar.gz", "summary.txt"]
    assert len(files) <= GPU_MACHINE_FILES
    figures = json.loads((out / "figures.json").read_text())
    assert figures["problems"] == []
    assert {r["check"] for r in figures["assumptions"]} == {"gap-eager", "gap-graph", "l2-read", "dram-read", "tp8",
                                                           "l2", "tp-ratio"}
    assert all(r["measured"] is not None for r in figures["assumptions"] if r["check"] != "gap-graph")
    assert any(r["backend"] == "triton" and r["us"] for r in figures["bench"])
    assert {r["op"] for r in figures["host"]} == {ATTENTION.name, PRECOMPUTE.name}
    assert figures["tests"]["tests"] > 0 and figures["tests"]["failures"] == 0
    assert [(r["case"], r["note"]) for r in figures["peer"]] == [("b1 24 bf16", "")]
    assert figures["peer"][0]["ours_us"] > 0 and figures["peer"][0]["vllm_us"] > 0
    summary = (out / "summary.txt").read_text()
    assert "== vLLM's TRITON_ATTN kernel beside ours" in summary and "not timed" not in summary
    assert len(summary) <= gpu_report.SUMMARY_LIMIT
    assert result.stdout.rstrip().endswith(summary.rstrip())  # the summary is printed last
    assert summary.rstrip().endswith("== verdict: OK")


@pytest.mark.slow
@needs_git_and_cpu
def test_the_rehearsal_fails_at_once_on_a_copy_without_backends(tmp_path):
    checkout = clean_copy(tmp_path / "clone", leave_out=("backends",))
    result = run_script(checkout, tmp_path, timeout=300)
    assert result.returncode != 0
    assert "gpu_check: " in result.stdout
    assert "== assumptions" not in result.stdout  # nothing measured from a broken install


def tree_without_helpers(tmp_path: Path) -> Path:
    tree = write_attention_tree(tmp_path / "tree")
    (tree / source.ATTENTION_OPS / "triton_attention_helpers.py").unlink()
    return tree


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp / "absent", "no such folder"),
    (tree_without_helpers, "vllm/v1/attention/ops/triton_attention_helpers.py not found"),
], ids=["no-folder", "missing-file"])
@pytest.mark.skipif(shutil.which("bash") is None, reason="the script is a bash script")
def test_a_bad_peer_path_is_refused_in_one_line_before_anything_runs(tmp_path, make, expected):
    result = run_script(ROOT, tmp_path, 60, "--peer", str(make(tmp_path)))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith("budget 540 s") and len(lines) == 2, result.stdout
    assert lines[1].startswith("gpu_check: --peer ") and expected in lines[1]
    assert not (tmp_path / "out").exists()  # refused before anything ran


# --- the judge, on made-up runs ---------------------------------------------------------

def good_run(tmp_path: Path) -> Path:
    """The files of a GPU run where every step made its rows."""
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = [("install", 0, 5, 35), ("info", 0, 9, 40), ("assumptions", 0, 90, 150), ("bench", 0, 60, 100),
             ("host", 0, 20, 60), ("tests", 0, 80, 135)]
    (logs / "steps.tsv").write_text("".join(f"{n}\t{s}\t{t}\t{b}\n" for n, s, t, b in steps))
    (logs / "info.out").write_text(json.dumps({"device": {"vendor": "cuda", "arch": "sm_90", "name": "H200"},
                                               "packages": {"torch": "2.11.0"}, "dflash_rocm": "0.2.0"}))
    row = dict(check="tp8", case="N=256", config="table", unit="us", measured=10.0, model=8.0, note="")
    (logs / "assumptions.json").write_text(json.dumps([row, {**row, "check": "gap-graph", "unit": "us"}]))
    bench = dict(op=ATTENTION.name, shape="s", case="B=1 ctx=8192", backend="triton", us=20.0, model_us=15.0,
                 pct_floor=50.0, note="")
    (logs / "bench.json").write_text(json.dumps({"rows": [bench]}))
    host = dict(op=ATTENTION.name, backend="triton", path="call", validate=False, host_us=10.0, total_us=12.0,
                target_us=25.0)
    (logs / "host.json").write_text(json.dumps([host, {**host, "op": PRECOMPUTE.name}]))
    (logs / "pytest.xml").write_text('<testsuites><testsuite tests="5" failures="0" errors="0" skipped="1"/>'
                                     '</testsuites>')
    return logs


def test_the_judge_passes_a_run_that_made_every_row(tmp_path):
    figures = gpu_report.Figures.read(good_run(tmp_path), dry=False)
    assert gpu_report.problems(figures) == []
    text = gpu_report.summary(figures)
    assert re.search(r" 10\.0 +8\.0 +1\.25\n", text)  # measured, model, ratio side by side
    assert re.search(r" 20\.0 +15\.0 +1\.33 ", text)
    assert text.endswith("== verdict: OK")


def _edit_json(path: Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize("spoil, expected", [
    (lambda logs: (logs / "host.json").write_text("[]"), "bench --host made no row"),
    (lambda logs: _edit_json(logs / "assumptions.json", lambda rows: [{**rows[0], "note": "ERROR model: x"}]),
     "ERROR model: x"),
    (lambda logs: _edit_json(logs / "assumptions.json", lambda rows: [{**rows[0], "measured": None}]),
     "nothing measured"),
    (lambda logs: (logs / "assumptions.json").unlink(), "bench --assumptions made no row"),
    (lambda logs: _edit_json(logs / "bench.json", lambda b: {"rows": [{**b["rows"][0], "backend": "cuda"}]}),
     "no measured triton row"),
    (lambda logs: _edit_json(logs / "bench.json", lambda b: {"rows": [{**b["rows"][0], "model_us": None,
                                                                       "note": "ERROR model: broke"}]}),
     "ERROR model: broke"),
    (lambda logs: (logs / "pytest.xml").write_text('<testsuite tests="0"/>'), "pytest ran no test"),
    (lambda logs: (logs / "pytest.xml").write_text('<testsuite tests="3" skipped="3"/>'), "passed no test"),
    (lambda logs: (logs / "pytest.xml").write_text('<testsuite tests="3" failures="1"/>'), "1 failed"),
    (lambda logs: (logs / "steps.tsv").write_text("bench\t124\t100\t100\n"), "step bench timed out"),
], ids=["empty-host", "error-row", "unmeasured-row", "no-assumptions", "no-modelled-backend", "model-failed",
        "no-tests", "all-skipped-on-gpu", "failed-test", "timed-out"])
def test_the_judge_names_a_step_that_made_nothing(tmp_path, spoil, expected):
    logs = good_run(tmp_path)
    spoil(logs)
    found = gpu_report.problems(gpu_report.Figures.read(logs, dry=False))
    assert any(expected in problem for problem in found), found


def test_the_summary_fits_the_limit_however_many_rows(tmp_path):
    logs = good_run(tmp_path)
    _edit_json(logs / "bench.json", lambda b: {"rows": b["rows"] * 2000})
    text = gpu_report.summary(gpu_report.Figures.read(logs, dry=False))
    assert len(text) <= gpu_report.SUMMARY_LIMIT
    assert "more lines in figures.json" in text and text.endswith("== verdict: OK")


def test_the_report_command_writes_two_files_and_exits_1_on_a_problem(tmp_path):
    logs = good_run(tmp_path)
    assert gpu_report.main([str(logs), str(tmp_path / "a")]) == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["figures.json", "summary.txt"]
    (logs / "host.json").write_text("[]")
    assert gpu_report.main([str(logs), str(tmp_path / "b")]) == 1
    assert json.loads((tmp_path / "b" / "figures.json").read_text())["problems"]


# --- vLLM's kernels beside ours (bench --peer) in the judge ------------------------------

PEER_ROW = dict(case="b8 128k bf16", backend="triton", vllm_runs="kernel_unified_attention", ours_us=300.0,
                vllm_us=1200.0, ours_model_us=250.0, vllm_model_us=1000.0, ours_error=0.004, vllm_error=0.005,
                note="", ratio=0.25, ours_vs_model=1.2, vllm_vs_model=1.2)


def with_peer(logs: Path, rows=(PEER_ROW,), status: int = 0) -> Path:
    """``logs`` with a peer step (``--peer`` given) that wrote ``rows``."""
    with (logs / "steps.tsv").open("a") as f:
        f.write(f"peer\t{status}\t40\t90\n")
    (logs / "peer.json").write_text(json.dumps({"device": "H200", "rows": list(rows)}))
    return logs


def test_the_judge_tables_vllms_kernel_beside_ours(tmp_path):
    figures = gpu_report.Figures.read(with_peer(good_run(tmp_path)), dry=False)
    assert gpu_report.problems(figures) == []
    text = gpu_report.summary(figures)
    assert re.search(r"b8 128k bf16 +300\.0 +1200\.0 +0\.25 +250\.0 +1\.20 +1000\.0 +1\.20\n", text)
    assert text.endswith("== verdict: OK")


def test_without_peer_the_summary_says_vllms_kernels_were_not_timed_and_why(tmp_path):
    logs = good_run(tmp_path)
    (logs / "peer.none").write_text("no vLLM tree given (--peer PATH or DFLASH_PEER=PATH)\n")
    figures = gpu_report.Figures.read(logs, dry=False)
    assert gpu_report.problems(figures) == []  # not asked for: no failure
    text = gpu_report.summary(figures)
    assert "== vLLM's own kernels: not timed (no vLLM tree given (--peer PATH or DFLASH_PEER=PATH))" in text
    assert json.loads(json.dumps(figures.as_dict()))["peer_not_timed"].startswith("no vLLM tree given")


@pytest.mark.parametrize("spoil, expected", [
    (lambda logs: with_peer(logs, status=1), "step peer exit 1"),
    (lambda logs: with_peer(logs, rows=()), "bench --peer made no row"),
    (lambda logs: with_peer(logs, rows=[{**PEER_ROW, "vllm_us": None, "note": "ERROR output differs from the "
                                                                                "reference beyond 0.02: vLLM 0.9"}]),
     "bench --peer: b8 128k bf16: ERROR output differs"),
    (lambda logs: with_peer(logs, rows=[{**PEER_ROW, "vllm_us": None}]), "b8 128k bf16: not measured on both sides"),
], ids=["step-failed", "no-rows", "wrong-output", "unmeasured"])
def test_a_failed_peer_step_fails_the_run(tmp_path, spoil, expected):
    """Asked for (a peer step ran), vLLM's kernels beside ours are part of the verdict."""
    logs = good_run(tmp_path)
    spoil(logs)
    found = gpu_report.problems(gpu_report.Figures.read(logs, dry=False))
    assert any(expected in problem for problem in found), found
