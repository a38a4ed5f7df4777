"""Command-line output a person can read: every command within 100 columns, a backend
that cannot run here named once with its reason, --wide keeping every row's note,
colour only on a terminal (and never with NO_COLOR), examples at the end of every --help."""

import re
import shlex
import sys

import pytest
import torch

from dflash_rocm import bench, check, cli, dispatch, report
from dflash_rocm.check import CheckRow
from dflash_rocm.ops import OPS
from dflash_rocm.workloads import SHAPES
from support import needs_interpreter

RED, GREEN, DIM = "\x1b[1;31m", "\x1b[32m", "\x1b[2m"


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().out


def as_terminal(monkeypatch):
    """stdout (capsys's, so call this inside the test) is a terminal; no colour variable is set."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)


def unavailable_here() -> dict[str, list[str]]:
    return {name: reasons for name, reasons in dispatch.device_reasons().items() if reasons}


def assert_fits(out: str, width: int = report.WIDTH):
    too_wide = [line for line in out.splitlines() if report.visible_len(line) > width]
    assert not too_wide, too_wide


def assert_each_reason_once(out: str, names_once: bool = True):
    """Each backend that cannot run here: its reason once, and (unless the text also
    names backends in prose, as info's settings do) its name once."""
    plain = " ".join(report.strip_ansi(out).split())  # wrapped lines may split a reason
    assert unavailable_here(), "this machine has a backend it cannot run"
    for name, reasons in unavailable_here().items():
        reason = report.short_reason(reasons[0])
        assert plain.count(reason) == 1, (name, reason)
        assert not names_once or len(re.findall(rf"\b{name}\b", plain)) == 1, name


def test_info_fits_and_names_each_unavailable_backend_once(capsys):
    rc, out = run_cli(capsys, "info")
    assert rc == 0
    assert_fits(out)
    assert_each_reason_once(out, names_once=False)
    assert "\x1b[" not in out  # not a terminal
    # the help is wrapped, not cut:
    assert "(checked against the rocm backend's Triton kernel on first use)" in " ".join(out.split())


@needs_interpreter
def test_check_table_fits_in_colour_with_each_unavailable_backend_once(capsys, monkeypatch):
    as_terminal(monkeypatch)
    rc, out = run_cli(capsys, "check")
    assert rc == 0
    assert_fits(out)
    assert_each_reason_once(out)
    rows = [line for line in out.splitlines() if " triton " in line]
    assert len(rows) == len(OPS) and all(f"{GREEN}PASS\x1b[0m" in line for line in rows)
    assert "FAIL" not in out


@needs_interpreter
def test_bench_tables_only_measured_rows_and_names_the_rest_once(capsys):
    rc, out = run_cli(capsys, "bench", "--tokens", "4", "--batch", "1", "--context", "32", "--repeats", "1",
                      "--quiet")
    assert rc == 0
    assert_fits(out)
    assert_each_reason_once(out)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    backend, us = lines[header].index("backend"), lines[header].index("us ")
    rows = [line for line in lines[header + 2:] if re.match(r"[NB]=\d", line)]  # cases: N=tokens, B=batch
    timed = {line[backend:us].strip(): float(line[us:].split()[0]) for line in rows}
    assert {"triton", "unfused-torch"} <= set(timed) and all(t > 0 for t in timed.values())


@pytest.mark.parametrize("command", [["check", "--backend", "rocm", "--backend", "aiter", "--backend", "cuda"],
                                     ["bench", "--op", "attention", "--batch", "1", "--context", "8", "--quiet",
                                      "--backend", "rocm", "--backend", "aiter", "--backend", "cuda"]])
def test_wide_keeps_every_row_with_its_full_note(capsys, command):
    rc, out = run_cli(capsys, *command, "--wide")
    assert rc == (1 if command[0] == "check" else 0)  # check fails when a backend it was asked for cannot run
    lines = out.splitlines()
    for name, reasons in unavailable_here().items():
        rows = [line for line in lines if re.search(rf"\s{name}\s", line)]
        assert rows and all(reasons[0] in line for line in rows), name  # the full reason, on every row


def test_colour_only_on_a_terminal_without_no_color(capsys, monkeypatch):
    as_terminal(monkeypatch)
    assert f"{GREEN}yes\x1b[0m" in run_cli(capsys, "info")[1]
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in run_cli(capsys, "info")[1]
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    monkeypatch.delenv("NO_COLOR")
    assert "\x1b[" not in run_cli(capsys, "info")[1]
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert "\x1b[" in run_cli(capsys, "info")[1]
    monkeypatch.setenv("FORCE_COLOR", "0")
    assert "\x1b[" not in run_cli(capsys, "info")[1]


def test_check_report_colours_results_and_aligns_them_as_plain_text():
    plan = check.default_plan(SHAPES["qwen3-8b-dflash-b16"], torch.bfloat16, torch.bfloat16, torch.device("cpu"))
    error = "RuntimeError: " + "the kernel failed " * 12
    rows = [CheckRow("draft_attention", "reference", "ORACLE", None, None, 1.0, ""),
            CheckRow("draft_attention", "triton", "FAIL", 0.5, 0.02, 2.0, ""),
            CheckRow("draft_attention", "rocm", "ERROR", None, 0.02, None, error),
            CheckRow("precompute_and_store_context_kv", "rocm", "PASS", 1e-3, 0.02, 3.0, ""),
            CheckRow("precompute_and_store_context_kv", "triton", "SKIP", None, None, None, "too many tokens"),
            CheckRow("precompute_and_store_context_kv", "cuda", "SKIP", None, None, None, "needs a CUDA GPU (x)"),
            CheckRow("draft_attention", "cuda", "SKIP", None, None, None, "needs a CUDA GPU (x); no FA")]
    coloured = check.format_report(plan, rows, report.WIDTH, report.Style(True))
    plain = check.format_report(plan, rows, report.WIDTH, report.Style(False))
    assert report.strip_ansi(coloured) == plain
    for word, colour in (("FAIL", RED), ("ERROR", RED), ("PASS", GREEN), ("SKIP", DIM)):
        assert f"{colour}{word}\x1b[0m" in coloured
    assert_fits(plain)
    assert plain.count(error[:30]) == 1 and "[1] " + error[:40] in plain  # the long error: a footnote
    assert "cuda — needs a CUDA GPU (in full: --wide)" in plain and plain.count("cuda") == 1
    assert any(" triton " in line and line.endswith("too many tokens") for line in plain.splitlines())


def test_table_wraps_its_free_text_column_and_groups_rows():
    rows = [("a", "x", "short"), ("a", "y", "word " * 40), ("b", "x", "")]
    text = report.format_table(["group", "name", "note"], rows, width=40, wrap_columns=["note"],
                               group_by=["group"])
    lines = text.splitlines()
    assert_fits(text, 40)
    assert lines[0].split() == ["name", "note"] and lines[2] == "a:" and lines.index("b:") > 4
    assert " ".join(text.split()).count("word") == 40
    wide = report.format_table(["group", "name", "note"], rows, omit_empty=["note"])
    assert len(wide.splitlines()) == 5 and "note" in wide
    assert "note" not in report.format_table(["name", "note"], [("x", "")], omit_empty=["note"])


def test_unavailable_backends_are_those_that_ran_nowhere():
    entries = [("rocm", "needs an AMD GPU (x); y"), ("rocm", "needs an AMD GPU (x); y"), ("triton", None),
               ("cuda", None), ("cuda", "no sinks"), ("rocm", "other")]
    assert report.never_ran(entries) == {"rocm": ["needs an AMD GPU (x); y", "other"]}
    assert report.short_reason("needs an AMD GPU (x); y") == "needs an AMD GPU"
    assert report.short_reason("z" * 80, limit=20) == "z" * 19 + "…"


def test_footnotes_number_each_long_note_once():
    notes = report.Footnotes(limit=5)
    assert [notes.cite(n) for n in ("ok", "a long note", "another one", "a long note")] == ["ok", "[1]", "[2]", "[1]"]
    assert notes.render(None) == "[1] a long note\n[2] another one"


def test_every_subcommand_help_ends_with_examples_that_parse():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "info" in a.choices).choices
    for name, sub in subparsers.items():
        help_text = sub.format_help()
        examples = help_text.split("examples:\n", 1)[1].splitlines()
        commands = [line.strip() for line in examples if line.strip().startswith("dflash-rocm ")]
        assert 2 <= len(commands) <= 3 and examples[-1].strip() == commands[-1], name
        for command in commands:
            args = parser.parse_args(shlex.split(command)[1:])
            assert args.command == name


def test_bench_report_lists_each_unmeasured_contender_once_with_its_cases():
    plan = bench.default_plan(torch.device("cpu"))
    attention = dict(op="draft_attention", shape="s")
    rows = [bench.BenchRow(**attention, case="B=1 ctx=32", backend="triton", us=5.0, launches=1),
            bench.BenchRow(**attention, case="B=2 ctx=32", backend="triton", note="ERROR RuntimeError: out of memory"),
            bench.BenchRow(**attention, case="B=4 ctx=32", backend="triton", note="ERROR RuntimeError: out of memory"),
            *[bench.BenchRow(**attention, case=f"B={b} ctx=32", backend="rocm", note="needs an AMD GPU (on cpu)")
              for b in (1, 2, 4)]]
    out = bench.format_report(rows, "device", plan, report.WIDTH, report.Style(True))
    plain = report.strip_ansi(out)
    assert_fits(plain)
    assert plain.count("rocm") == 1 and "rocm — needs an AMD GPU (in full: --wide)" in plain
    assert plain.count("out of memory") == 1  # once, with both cases, in red:
    assert f"{RED} triton — ERROR RuntimeError: out of memory (draft_attention s: B=2 ctx=32, B=4 ctx=32)" in (
        " ".join(out.split()))
    assert [line.split()[0] for line in plain.splitlines() if line.startswith("B=")] == ["B=1"]
    wide = bench.format_report(rows, "device", plan, None)
    assert wide.count("needs an AMD GPU (on cpu)") == 3 and wide.count("out of memory") == 2
