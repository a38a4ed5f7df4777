"""The dflash-rocm command: info, check (table, JSON, exit codes), help."""

import json
import subprocess
import sys

import pytest
import torch

from dflash_rocm import cli, dispatch
from dflash_rocm.reference import ReferenceBackend
from support import needs_interpreter


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_info_lists_every_backend_with_reasons(capsys):
    rc, out, _ = run_cli(capsys, "info", "--json")
    info = json.loads(out)
    assert rc == 0
    assert set(info["backends"]) == set(dispatch.AUTO_ORDER)
    assert info["backends"]["reference"]["available"]
    for entry in info["backends"].values():
        assert entry["available"] == (not entry["reasons"])
    assert "DFLASH_ROCM_BACKEND" in info["environment"]
    assert info["packages"]["torch"].startswith(torch.__version__.split("+")[0])


def test_info_table(capsys):
    rc, out, _ = run_cli(capsys, "info")
    assert rc == 0 and "backend" in out and "auto order: rocm > cuda > cpu > triton > reference" in out


@needs_interpreter
def test_check_passes_and_reports_every_backend(capsys):
    rc, out, _ = run_cli(capsys, "check", "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"]
    rows = {(r["op"], r["backend"]): r for r in report["rows"]}
    for op in dispatch.OPS:
        assert rows[(op, "reference")]["status"] == "ORACLE"
        for name in ("triton", "cpu"):
            assert rows[(op, name)]["status"] == "PASS"
            assert rows[(op, name)]["rel_err"] <= rows[(op, name)]["tolerance"]
        for name in ("rocm", "cuda"):
            assert rows[(op, name)]["status"] == "SKIP" and rows[(op, name)]["note"]


class AlwaysZero(ReferenceBackend):
    """A backend that computes something else: check must catch it."""
    name = "triton"

    @classmethod
    def draft_attention(cls, call):
        call.out.zero_()


def test_check_exits_1_when_a_backend_disagrees(capsys, monkeypatch):
    monkeypatch.setitem(dispatch._classes, "triton", AlwaysZero)
    rc, out, _ = run_cli(capsys, "check", "--backend", "triton")
    assert rc == 1
    assert "FAILED: draft_attention/triton" in out
    lines = [line for line in out.splitlines() if line.startswith("draft_attention") and " triton " in line]
    assert lines and "FAIL" in lines[0]


def test_check_on_a_checkpoint(tmp_path, capsys):
    from test_checkpoint import write_draft
    write_draft(tmp_path, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=32)
    rc, out, _ = run_cli(capsys, "check", "--checkpoint", str(tmp_path), "--backend", "reference", "--json")
    report = json.loads(out)
    assert rc == 0 and "hidden 32, 2 layers, 4/2 heads, head dim 16" in report["plan"]


def test_bad_backend_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="valid names: auto, reference, triton, rocm, cuda"):
        import dflash_rocm
        from test_validation import attention_args
        dflash_rocm.draft_attention(**attention_args())


def test_module_entry_point_and_help():
    result = subprocess.run([sys.executable, "-m", "dflash_rocm", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0
    for command in ("info", "check"):
        assert command in result.stdout
    result = subprocess.run([sys.executable, "-m", "dflash_rocm", "check", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--checkpoint" in result.stdout and "--kv-cache-dtype" in result.stdout
