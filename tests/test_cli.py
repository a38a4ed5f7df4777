"""The dflash-rocm command: info, check (table, JSON, exit codes), help."""

import csv
import io
import json
import subprocess
import sys

import pytest
import torch

from dflash_rocm import cli, registry
from dflash_rocm.ops import OPS
from dflash_rocm.backends.reference import ReferenceAttention, ReferenceBackend, ReferencePrecompute
from support import needs_interpreter


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_info_lists_every_backend_with_reasons(capsys):
    rc, out, _ = run_cli(capsys, "info", "--json")
    info = json.loads(out)
    assert rc == 0
    assert set(info["backends"]) == set(registry.NAMES)
    assert info["backends"]["reference"]["available"]
    for entry in info["backends"].values():
        assert entry["available"] == (not entry["reasons"])
    assert "DFLASH_ROCM_BACKEND" in info["environment"]
    assert info["packages"]["torch"].startswith(torch.__version__.split("+")[0])


def test_info_table(capsys):
    rc, out, _ = run_cli(capsys, "info")
    assert rc == 0 and "backend" in out and "auto order: " + " > ".join(registry.PRIORITIES["cpu"]) in out


@pytest.mark.parametrize("name,value", [("DFLASH_ROCM_TUNE", "sometimes"), ("DFLASH_ROCM_QUERY_LIMIT", "-3"),
                                        ("DFLASH_ROCM_QUERY_LIMIT", "16x"), ("DFLASH_ROCM_BACKEND", "tritn"),
                                        ("DFLASH_ROCM_VLLM", "maybe")])
def test_info_marks_a_bad_environment_value_not_valid_and_exits_1(capsys, monkeypatch, name, value):
    """The report is printed whole (info shows a bad value, it does not fail on it), the
    variable's row says the value is not valid, a line under the table says why, and the
    exit status is 1, as for --json."""
    monkeypatch.setenv(name, value)
    rc, out, _ = run_cli(capsys, "info", "--wide")
    row = next(line for line in out.splitlines() if line.startswith(name + " "))
    assert rc == 1 and f"{value} (not valid)" in row, row
    assert f"not valid: {name}={value!r}" in out and "backend" in out
    rc, out, _ = run_cli(capsys, "info", "--json")
    entry = json.loads(out)["environment"][name]
    assert rc == 1 and entry["valid"] is False and name in entry["problem"]


@pytest.mark.vllm
def test_info_says_what_the_plugin_serves_of_each_family_member(capsys):
    from dflash_rocm.vllm_plugin import family

    rc, out, _ = run_cli(capsys, "info", "--json")
    rows = {r["architecture"]: r for r in json.loads(out)["vllm_family"]}
    assert rc == 0 and set(rows) == set(family.candidate_architectures())
    for arch, row in rows.items():
        cls = family.vllm_class(arch)
        assert row["vllm_class"] == f"{cls.__module__}.{cls.__name__}"
    assert rows["DFlashDraftModel"]["precompute"] is None and rows["DFlashDraftModel"]["attention"] is None
    laguna = rows["DFlashLagunaForCausalLM"]
    assert laguna["precompute"] is None  # its per-layer input norms are a variant the contract names
    assert laguna["attention"] == "its draft layers use LagunaAttention, not DFlashQwen3Attention"
    gemma = rows["Gemma4DSparkModel"]
    assert "Gemma4DSparkModel overrides _project_context_kv" in gemma["precompute"]
    rc, out, _ = run_cli(capsys, "info", "--wide")
    line = next(line for line in out.splitlines() if line.startswith("DFlashLagunaForCausalLM "))
    assert "vLLM's: its draft layers use LagunaAttention" in line and "dflash_rocm" in line
    assert "dflash_rocm  " in next(line for line in out.splitlines() if line.startswith("DFlashDraftModel "))


@pytest.mark.vllm
def test_info_says_how_the_plugin_serves_each_quantization_method_of_this_vllm(capsys):
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    rc, out, _ = run_cli(capsys, "info", "--json")
    rows = {r["method"]: r["served"] for r in json.loads(out)["vllm_quantization"]}
    assert rc == 0 and set(rows) == set(QUANTIZATION_METHODS)
    assert rows["compressed-tensors"].startswith("dequantized") and rows["gptq"].startswith("dequantized")
    assert rows["torchao"].startswith("steps aside")
    rc, out, _ = run_cli(capsys, "info", "--wide")
    awq = next(line for line in out.splitlines() if line.startswith("awq "))
    assert awq.split(None, 1)[1].startswith("dequantized")
    assert "Beside an MLA target: " in out and "speculative_config.kv_cache_dtype" in out


@pytest.mark.vllm
def test_info_turns_every_family_failure_into_a_reason(capsys, monkeypatch):
    from dflash_rocm.vllm_plugin import family

    real = family.candidate_architectures()
    monkeypatch.setattr(family, "candidate_architectures",
                        lambda: {**real, "GoneDraftModel": ("dflash_rocm_no_such_module", "Gone")})
    monkeypatch.setattr(family, "_built", lambda cls, base: 1 / 0)
    rc, out, _ = run_cli(capsys, "info", "--json")
    rows = {r["architecture"]: r for r in json.loads(out)["vllm_family"]}
    assert rc == 0
    assert rows["GoneDraftModel"]["precompute"].startswith("cannot import dflash_rocm_no_such_module.Gone")
    assert rows["DFlashDraftModel"]["attention"] == "cannot read DFlashQwen3ForCausalLM (ZeroDivisionError: " \
                                                    "division by zero)"

    def unreadable():
        raise KeyError("registry moved")
    monkeypatch.setattr(family, "candidate_architectures", unreadable)
    rc, out, _ = run_cli(capsys, "info", "--json")
    (row,) = json.loads(out)["vllm_family"]
    assert rc == 0 and row["architecture"] is None and "registry moved" in row["precompute"]


@needs_interpreter
def test_check_passes_and_reports_every_backend(capsys):
    rc, out, _ = run_cli(capsys, "check", "--json")
    report = json.loads(out)
    assert rc == 0 and report["ok"]
    rows = {(r["op"], r["backend"]): r for r in report["rows"]}
    for op in OPS:
        assert rows[(op, "reference")]["status"] == "ORACLE"
        for name in ("triton", "cpu"):
            assert rows[(op, name)]["status"] == "PASS"
            assert rows[(op, name)]["rel_err"] <= rows[(op, name)]["tolerance"]
        for name in ("rocm", "aiter", "cuda"):
            assert rows[(op, name)]["status"] == "SKIP" and rows[(op, name)]["note"]


class ZeroAttention(ReferenceAttention):
    @classmethod
    def run(cls, call):
        call.out.zero_()


class AlwaysZero(ReferenceBackend):
    """A backend that computes something else: check must catch it."""
    name = "triton"
    implementations = (ZeroAttention, ReferencePrecompute)


def test_check_exits_1_when_a_backend_disagrees(capsys, monkeypatch):
    monkeypatch.setitem(registry._classes, "triton", AlwaysZero)
    rc, out, _ = run_cli(capsys, "check", "--backend", "triton")
    assert rc == 1
    assert "FAILED: draft_attention/triton" in out
    lines = [line for line in out.splitlines() if line.startswith("draft_attention") and " triton " in line]
    assert lines and "FAIL" in lines[0]


@pytest.mark.parametrize("command", [("check",), ("bench", "--quick")])
@pytest.mark.parametrize("name,value", [("DFLASH_ROCM_BACKEND", "rocmm"), ("DFLASH_ROCM_VLLM", "maybe")])
def test_check_and_bench_refuse_a_bad_value_of_a_variable_that_decides_what_runs_in_one_line(
        capsys, monkeypatch, command, name, value):
    """As the README states for the variables that decide what runs: a ValueError naming
    the variable, printed as one line (no traceback), exit status 2; nothing runs."""
    monkeypatch.setenv(name, value)
    rc, out, err = run_cli(capsys, *command)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"dflash-rocm {command[0]}: {name}={value!r}: "), err


def test_check_of_a_backend_that_cannot_run_here_fails_saying_why(capsys):
    """check --backend cuda on a CPU never ran the one backend asked for: exit 1, and the
    verdict (and --json's not_run) says why, instead of 'all backends ... agree'."""
    rc, out, _ = run_cli(capsys, "check", "--backend", "cuda")
    assert rc == 1 and "FAILED: cuda cannot run here (needs an NVIDIA GPU" in out and "agree" not in out
    rc, out, _ = run_cli(capsys, "check", "--backend", "cuda", "--json")
    report = json.loads(out)
    assert rc == 1 and not report["ok"] and "NVIDIA" in report["not_run"]["cuda"]


def test_check_on_a_checkpoint(tmp_path, capsys):
    from test_checkpoint import write_draft
    write_draft(tmp_path, layers=2, heads=4, kv_heads=2, head_dim=16, hidden=32)
    rc, out, _ = run_cli(capsys, "check", "--checkpoint", str(tmp_path), "--backend", "reference", "--json")
    report = json.loads(out)
    assert rc == 0 and "hidden 32, 2 layers, 4/2 heads, head dim 16" in report["plan"]


def test_bad_backend_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("DFLASH_ROCM_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="valid names: auto, aiter, cpu, cuda, reference, rocm, triton"):
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


# -- every CLI error is one line on stderr and exit status 2 (issue 16) --------------------------

BAD_ARGUMENTS = [
    (["bench", "--device", "foo"], "argument --device: expected cpu, cuda or cuda:N, got 'foo'"),
    (["check", "--device", "cuda:99"], "argument --device: 'cuda:99'"),
    (["bench", "--device", "meta"], "argument --device"),
    (["bench", "--tokens", "0"], "argument --tokens: expected comma-separated positive integers, got '0'"),
    (["bench", "--tokens", "-3"], "argument --tokens: expected comma-separated positive integers"),
    (["bench", "--tokens", "4,,x"], "argument --tokens"),
    (["bench", "--context", "1e8"], "argument --context: expected comma-separated positive integers, got '1e8'"),
    (["bench", "--batch", "0"], "argument --batch"),
    (["bench", "--repeats", "-1"], "argument --repeats: expected a positive integer, got '-1'"),
    (["bench", "--repeats", "0"], "argument --repeats"),
    (["bench", "--shape", "nonsense"], "argument --shape: invalid choice"),
    (["tune", "--batch-limit", "0"], "argument --batch-limit: expected a positive integer, got '0'"),
    (["tune", "--block-size", "0"], "argument --block-size: expected a positive integer"),
    (["tune", "--max-model-len", "-1"], "argument --max-model-len: expected a positive integer, got '-1'"),
    (["tune", "--query-limit", "0"], "argument --query-limit"),
    (["nonsense"], "invalid choice"),
]


@pytest.mark.parametrize("argv,words", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_and_exit_2(capsys, argv, words):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def one_line_refusal(capsys, *argv) -> str:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_bench_refuses_sizes_whose_cache_cannot_be_allocated(capsys):
    err = one_line_refusal(capsys, "bench", "--op", "attention", "--batch", "64", "--context", "100000000")
    assert "every attention case needs more than 2097152 cached tokens" in err


def test_bench_says_which_cases_it_leaves_out():
    from dflash_rocm import bench

    plan = bench.default_plan(torch.device("cpu"), ops=["draft_attention"], batches=[1, 64],
                              contexts=[1024, 100000])
    left_out = [n for n in plan.notes if "left out" in n]
    assert len(left_out) == 1 and "B=64 ctx=100000" in left_out[0] and "B=1 ctx=1024" not in left_out[0]


def test_bench_refuses_a_token_count_past_its_limit(capsys):
    assert "at most 65536 context tokens" in one_line_refusal(capsys, "bench", "--op", "precompute",
                                                              "--tokens", "100000")


def test_check_refuses_a_quantised_checkpoint_in_one_line(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from test_checkpoint import write_draft

    write_draft(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["layers.0.self_attn.k_proj.weight"] = tensors["layers.0.self_attn.k_proj.weight"].to(torch.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    err = one_line_refusal(capsys, "check", "--checkpoint", str(tmp_path), "--backend", "reference")
    assert "layers.0.self_attn.k_proj.weight is I8" in err


def test_check_refuses_a_truncated_checkpoint_in_one_line(tmp_path, capsys):
    from test_checkpoint import write_draft

    write_draft(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:100])
    assert "not a readable safetensors file" in one_line_refusal(capsys, "check", "--checkpoint", str(tmp_path))


def _never_run(*args, **kwargs):
    raise AssertionError("the run started before its outputs were checked")


def _unwritable(tmp_path, kind: str) -> str:
    (tmp_path / "a_file").write_text("")
    return str({"missing folder": tmp_path / "missing" / "out",
                "a folder": tmp_path,
                "under a file": tmp_path / "a_file" / "out"}[kind])


@pytest.mark.parametrize("kind", ["missing folder", "a folder", "under a file"])
@pytest.mark.parametrize("flag", ["--json", "--csv", "--plot"])
def test_an_unwritable_output_path_is_refused_in_one_line_before_the_run(tmp_path, capsys, monkeypatch, flag, kind):
    from dflash_rocm import bench

    monkeypatch.setattr(bench, "run_bench", _never_run)
    err = one_line_refusal(capsys, "bench", "--quiet", flag, _unwritable(tmp_path, kind))
    assert f"dflash-rocm bench: {flag} " in err


@pytest.mark.parametrize("argv", [["bench", "--json", "-", "--csv", "-"], ["bench", "--plot", "-"],
                                  ["bench", "--host", "--json", "-", "--csv", "out.csv"]])
def test_outputs_that_cannot_all_be_written_are_refused_before_the_run(capsys, monkeypatch, argv):
    from dflash_rocm import bench, host_bench

    monkeypatch.setattr(bench, "run_bench", _never_run)
    monkeypatch.setattr(host_bench, "host_rows", _never_run)
    assert "dflash-rocm bench: " in one_line_refusal(capsys, *argv)


@pytest.mark.parametrize("argv", [["bench", "--json", ""], ["bench", "--csv", " "], ["bench", "--plot", ""],
                                  ["bench", "--host", "--json", ""], ["inspect", "--json", ""]])
def test_an_empty_output_path_is_refused_before_the_run(capsys, monkeypatch, argv):
    from dflash_rocm import bench, host_bench
    from dflash_rocm.audit import run

    for module, name in ((bench, "run_bench"), (host_bench, "host_rows"), (run, "run_audit")):
        monkeypatch.setattr(module, name, _never_run)
    err = one_line_refusal(capsys, *argv)
    assert f"{argv[-2]}: expected a file path" in err and f"got {argv[-1]!r}" in err, err


def _csv_rows(text: str) -> list[dict]:
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows and all(set(r) == set(rows[0]) and r["op"] == "draft_attention" for r in rows), text
    return rows


@pytest.mark.parametrize("flag,parse", [("--json", json.loads), ("--csv", _csv_rows)])
def test_an_output_to_stdout_is_all_that_stdout_holds(capsys, monkeypatch, flag, parse):
    from dflash_rocm import bench
    from dflash_rocm.bench import BenchRow

    rows = [BenchRow(op="draft_attention", shape="s", case="B=1", backend="cpu", us=12.5)]
    monkeypatch.setattr(bench, "run_bench", lambda plan, progress=None: (rows, "header"))
    rc, out, _ = run_cli(capsys, "bench", "--quiet", "--op", "attention", flag, "-")
    assert rc == 0 and parse(out)


def test_bench_host_json_to_stdout_parses(capsys, monkeypatch):
    from dflash_rocm import host_bench

    row = host_bench.HostRow("draft_attention", "triton", False, "call", 10.0, 1, None, None, 25.0)
    monkeypatch.setattr(host_bench, "host_rows", lambda *a, **k: [row])
    rc, out, _ = run_cli(capsys, "bench", "--host", "--json", "-")
    assert rc == 0 and json.loads(out)[0]["host_us"] == 10.0
