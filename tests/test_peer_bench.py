"""``bench --peer``: vLLM's kernel (here the stand-in tree of :mod:`peer_tree`, whose
``unified_attention`` has vLLM 0.34's signature and computes attention) run on the device
beside ours with the arguments TRITON_ATTN passes, checked against the reference, timed."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_rocm import cli
from dflash_rocm.contract import TOLERANCES
from peer_tree import UNIFIED, write_attention_tree
from support import HAS_GPU, HAS_TRITON

needs_cpu_triton = pytest.mark.skipif(HAS_GPU or not HAS_TRITON,
                                      reason="the CPU smoke run: Triton's interpreter, no GPU")


@needs_cpu_triton
def test_bench_peer_times_vllms_kernel_beside_ours_on_the_cpu(tmp_path, capsys):
    tree = write_attention_tree(tmp_path / "tree")
    out = tmp_path / "peer.json"
    assert cli.main(["bench", "--peer", str(tree), "--device", "cpu", "--quiet", "--json", str(out)]) == 0
    assert "vLLM's TRITON_ATTN kernel" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["b1 24 bf16"]
    row = rows[0]
    assert row["backend"] == "triton" and row["vllm_runs"] == "kernel_unified_attention"
    assert row["ours_us"] > 0 and row["vllm_us"] > 0
    assert row["ratio"] == pytest.approx(row["ours_us"] / row["vllm_us"])
    assert row["ours_error"] <= TOLERANCES[torch.float16] and row["vllm_error"] <= TOLERANCES[torch.float16]
    assert row["ours_model_us"] is None and row["vllm_model_us"] is None  # a CPU: nothing modelled
    assert row["note"] == ""


@needs_cpu_triton
def test_a_wrong_vllm_launch_is_an_error_row_not_a_time(tmp_path, capsys):
    """The stand-in with its softmax scale doubled: the reference check catches it, the row
    carries no time and the command exits 1."""
    tree = write_attention_tree(tmp_path / "tree", unified=UNIFIED.replace("* scale\n", "* scale * 2\n"))
    out = tmp_path / "peer.json"
    assert cli.main(["bench", "--peer", str(tree), "--device", "cpu", "--quiet", "--json", str(out)]) == 1
    row = json.loads(out.read_text())["rows"][0]
    assert row["note"].startswith("ERROR output differs from the reference") and "vLLM" in row["note"]
    assert row["vllm_us"] is None and row["ours_error"] <= 5e-3


def test_bench_peer_refuses_a_folder_without_vllms_kernels(tmp_path, capsys):
    assert cli.main(["bench", "--peer", str(tmp_path), "--device", "cpu"]) == 2
    assert "triton_unified_attention.py not found" in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--batch", "64", "--context", "131072"], "B=64 ctx=131072 needs more than 2097152 cached tokens"),
    (["--shape", "gemma-swa-sinks"], "--shape do not apply"),
    (["--kv-cache-dtype", "fp8", "--op", "attention"], "--op, --kv-cache-dtype do not apply"),
], ids=["too-large", "shape", "dtype-and-op"])
def test_bench_peer_refuses_what_it_cannot_time_before_any_work(tmp_path, capsys, argv, expected):
    tree = write_attention_tree(tmp_path / "tree")
    assert cli.main(["bench", "--peer", str(tree), "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
