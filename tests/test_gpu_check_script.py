"""scripts/gpu_check.sh --dry: the prepared GPU script rehearsed on CPU so it cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

from support import HAS_GPU, HAS_TRITON

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(HAS_GPU or not HAS_TRITON, reason="the dry rehearsal is for machines without a GPU")
def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for name in ("info.json", "pytest.log", "pytest.xml", "bench.json", "bench.csv", "bench.png", "bench.txt",
                 "bench_host.txt", "bench_assumptions.txt", "bench_assumptions.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "skipped" in (tmp_path / "pytest.log").read_text()
    host = (tmp_path / "bench_host.txt").read_text()
    assert all(any(line.startswith(f"{op} ") for line in host.splitlines()) for op in ("draft_attention", "precompute"))
    assumed = json.loads((tmp_path / "bench_assumptions.json").read_text())
    assert {r["check"] for r in assumed} == {"tp8", "l2", "gap"}
    assert all(r["measured_us"] is not None and "ERROR" not in r["note"] for r in assumed), assumed
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert any(r["backend"] == "triton" and r["us"] for r in rows)
    table = (tmp_path / "bench.txt").read_text()
    assert result.stdout.rstrip().endswith(table.rstrip())  # the table comes last
    assert any(line.startswith("draft_attention, ") for line in table.splitlines())
