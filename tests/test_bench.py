"""dflash-rocm bench: floors from first principles, and a CPU smoke run of the command."""

import csv
import json

import pytest
import torch

from dflash_rocm import bench, cli, floors
from dflash_rocm.platform import cpu_gemm_dtype, platform_for_arch
from support import needs_interpreter


def test_precompute_floor_of_the_qwen3_8b_draft_matches_the_field_notes():
    """NOTES.md: the fused K/V weight is 84 MB; its floor is ~16 us on MI300X, ~17.5 us on H200."""
    cost = floors.precompute_cost(hidden=4096, layers=5, kv_heads=8, head_dim=128, num_tokens=1, elem_bytes=2,
                                  cache_bytes=2)
    assert 83.8e6 < cost.bytes < 84.0e6
    mi300x = floors.peak_for(platform_for_arch("gfx942", name="AMD Instinct MI300X"))
    h200 = floors.peak_for(platform_for_arch("sm_90", name="NVIDIA H200"))
    assert mi300x.name == "MI300X" and h200.name == "H200"
    assert 15e-6 < cost.floor_seconds(mi300x.bandwidth, mi300x.bf16_flops) < 17e-6
    assert 17e-6 < cost.floor_seconds(h200.bandwidth, h200.bf16_flops) < 18e-6


def test_precompute_turns_compute_bound_at_large_n():
    small = floors.precompute_cost(hidden=4096, layers=5, kv_heads=8, head_dim=128, num_tokens=16, elem_bytes=2,
                                   cache_bytes=2)
    large = floors.precompute_cost(hidden=4096, layers=5, kv_heads=8, head_dim=128, num_tokens=8192, elem_bytes=2,
                                   cache_bytes=2)
    bw, peak = 5.3e12, 1307e12
    assert small.bytes / bw > small.flops / peak
    assert large.flops / peak > large.bytes / bw


def test_attention_floor_counts_visible_kv_once():
    cost = floors.attention_cost(batch=1, query_len=16, seq_len=8192, q_heads=32, kv_heads=8, head_dim=128,
                                 elem_bytes=2, cache_bytes=2)
    kv = 8192 * 8 * 128 * 2 * 2
    assert kv < cost.bytes < kv * 1.01
    windowed = floors.attention_cost(batch=1, query_len=16, seq_len=8192, q_heads=32, kv_heads=8, head_dim=128,
                                     elem_bytes=2, cache_bytes=2, sliding_window=512)
    assert windowed.bytes < cost.bytes / 10


@pytest.mark.parametrize("arch,name,expected", [("gfx942", "AMD Instinct MI325X", "MI325X"),
                                                ("gfx942", "AMD Instinct MI300X", "MI300X"),
                                                ("gfx950", "MI355X", "MI355X"), ("gfx1100", "Radeon RX 7900 XTX",
                                                                                  "RX 7900 XTX"),
                                                ("gfx1201", "AMD Radeon AI PRO R9700", "Radeon AI PRO R9700"),
                                                ("sm_90", "NVIDIA H100 80GB HBM3", "H100 SXM")])
def test_device_peaks_by_arch_and_name(arch, name, expected):
    assert floors.peak_for(platform_for_arch(arch, name=name)).name == expected


@needs_interpreter
def test_bench_smoke_writes_table_json_csv_and_plot(tmp_path, capsys):
    paths = {k: tmp_path / f"bench.{k}" for k in ("json", "csv", "png")}
    rc = cli.main(["bench", "--tokens", "4", "--batch", "1", "--context", "24", "--repeats", "1", "--quiet",
                   "--json", str(paths["json"]), "--csv", str(paths["csv"]), "--plot", str(paths["png"])])
    out = capsys.readouterr().out
    assert rc == 0
    out = " ".join(out.split())  # lines wrap at 100 columns
    assert "numbers say nothing about GPU speed" in out
    report = json.loads(paths["json"].read_text())
    rows = {(r["op"], r["backend"]): r for r in report["rows"]}
    fused = rows[("precompute_and_store_context_kv", "triton")]
    assert fused["us"] > 0 and fused["launches"] == 1 and fused["speedup_vs_unfused"] > 0
    assert fused["floor_us"] > 0 and fused["pct_floor"] > 0  # from the measured copy bandwidth here
    assert "floors from the measured copy bandwidth" in out
    assert rows[("precompute_and_store_context_kv", "unfused-torch")]["launches"] > 10
    assert rows[("draft_attention", "triton")]["launches"] == 1
    assert rows[("draft_attention", "cuda")]["note"]  # why it did not run
    assert len(list(csv.DictReader(paths["csv"].open()))) == len(report["rows"])
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_timings_warn_when_the_machine_looks_busy(monkeypatch):
    """A bench on CPU says so when other work shares the cores (load average over half of
    them), in the plan's notes (the report and --json); a quiet machine gets no warning."""
    from dflash_rocm import host_bench, timing

    assert timing.busy_machine_note(load=0.9, cores=2) is None
    assert "load average 3.5 on 2 cores" in timing.busy_machine_note(load=3.5, cores=2)
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (6.0, 1.0, 1.0))
    notes = bench.default_plan(torch.device("cpu")).notes
    assert any("looks busy (load average 6.0 on 4 cores)" in note for note in notes)
    assert f"torch on {torch.get_num_threads()} threads" in notes[0]
    assert "Warning: this machine looks busy" in host_bench.format_host_rows([], "gfx942", None, notes[-1])
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    assert not any("busy" in note for note in bench.default_plan(torch.device("cpu")).notes)


def test_bench_plan_on_gpu_covers_the_issue_sweep():
    plan = bench.default_plan(torch.device("cuda"))
    assert plan.tokens == [1, 16, 64, 256, 1024, 8192]
    assert plan.batches == [1, 4, 16, 64] and plan.contexts[0] == 1024 and plan.contexts[-1] == 131072
    assert {s.name for s in plan.shapes} == set(bench.SHAPES) and "reference" not in plan.backends


@needs_interpreter
def test_bench_host_measures_each_backends_host_work_and_launch_costs(capsys):
    """``bench --host`` runs the real host code with launches captured (no kernel runs),
    and prices each captured launch through Triton's JIT entry and the direct path."""
    from dflash_rocm import host_bench

    rows = host_bench.host_rows(torch.device("cpu"), arch="gfx942", backends=["triton", "rocm"], repeats=20)
    assert {(r.op, r.path, r.backend, r.validate) for r in rows} == {
        (op, path, b, v) for op in ("draft_attention", "precompute_and_store_context_kv")
        for path in ("call", "plan.run") for b in ("triton", "rocm") for v in (False, True)}
    for r in rows:
        assert r.host_us > 0 and r.launches >= 1
        assert r.jit_launch_us > r.direct_launch_us > 0  # the direct path skips the JIT's binding
    launches = {(r.op, r.path, r.backend, r.validate): r.launches for r in rows}
    for (op, path, b, v), n in launches.items():  # a plan launches what the call launches
        assert n == launches[(op, "call", b, v)]
    rc = cli.main(["bench", "--host", "--op", "attention", "--backend", "triton", "--repeats", "5"])
    out = capsys.readouterr().out
    assert rc == 0 and "draft_attention" in out and "+ direct us" in out and "needs a GPU" in " ".join(out.split())


@pytest.mark.vllm
def test_bench_times_the_cpu_backend_against_vllms_own_cpu_ops(tmp_path):
    path = tmp_path / "bench.json"
    rc = cli.main(["bench", "--backend", "cpu", "--tokens", "4", "--batch", "1", "--context", "24", "--repeats", "1",
                   "--quiet", "--json", str(path)])
    assert rc == 0
    rows = {(r["op"].replace("_and_store_context_kv", ""), r["backend"]): r
            for r in json.loads(path.read_text())["rows"]}
    for key in (("precompute", "cpu"), ("precompute", "unfused-vllm"), ("draft_attention", "cpu"),
                ("draft_attention", "vllm"), ("draft_attention", "cpu (vLLM pages)")):
        assert rows[key]["us"] > 0, key
    assert rows[("draft_attention", "vllm")]["speedup_vs_unfused"] == 1.0  # vLLM's kernel is the baseline
    assert rows[("draft_attention", "cpu")]["speedup_vs_unfused"] > 0


def plugin_reads_the_smoke_drafts_vllm_cpu_pages() -> bool:
    """Whether the plugin reads the pages vLLM's CPU attention binds for the bench's smoke
    draft here: vLLM picks their ISA (``_get_attn_isa``: ``amx``, packed for AMX tiles, for
    bf16 with head dims and block sizes multiples of 32 on CPUs with AMX; else plain
    ``vec``/``vec16``) and binds it to each layer, where the plugin's cache views read it.
    vLLM's CPU block sizes are multiples of 32 (``MultipleOf(32)``): 32 stands for any."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from dflash_rocm.tiny_models import HEAD_DIM, KV_HEADS
    from dflash_rocm.vllm_bench import SMOKE
    from dflash_rocm.vllm_plugin.cache_views import kv_cache_views

    class CPUAttentionBackendImpl:
        num_kv_heads, head_size, kv_cache_dtype = KV_HEADS, HEAD_DIM, "auto"

    dtype = getattr(torch, SMOKE.dtype)
    layer = SimpleNamespace(isa=_get_attn_isa(dtype, 32, HEAD_DIM, "auto"))
    kv_cache = torch.zeros(3, KV_HEADS, 32, 2 * HEAD_DIM, dtype=dtype)
    return not isinstance(kv_cache_views(CPUAttentionBackendImpl(), layer, kv_cache), str)


@pytest.mark.vllm
@pytest.mark.parametrize("amx", [False, True])
def test_the_plugin_reads_the_smoke_drafts_cpu_pages_exactly_where_vllm_does_not_pack_them_for_amx(amx, monkeypatch):
    """Both ISAs on this machine: vLLM's choice with AMX tiles present or absent."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert plugin_reads_the_smoke_drafts_vllm_cpu_pages() != amx


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_vllm_smoke_reports_the_ratios_and_identical_output(tmp_path, capsys):
    """One short pair end to end (the ratio is reported, not asserted: this is a smoke test).
    The plugin serves the precompute where it reads vLLM's CPU pages and the CPU has no
    native bf16 GEMM (AVX2); with one (AVX512-BF16), or on AMX CPUs, where vLLM packs the bf16
    pages, it leaves both operations to vLLM (docs/vllm.md, "On CPU")."""
    path = tmp_path / "e2e.json"
    rc = cli.main(["bench", "--vllm", "--quick", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and "generate time plugin/vLLM: median" in out
    report = json.loads(path.read_text())
    summary = report["summary"]
    assert summary["pairs"] == 1 and summary["generate_ratio"] > 0 and summary["outputs_match"]
    vllm_run, plugin_run = sorted(report["runs"], key=lambda r: r["plugin"])
    assert vllm_run["served_by"] == {}
    served = {"precompute_and_store_context_kv/cpu": plugin_run["precompute_calls"]}
    serves = plugin_reads_the_smoke_drafts_vllm_cpu_pages() and cpu_gemm_dtype(torch.bfloat16) != torch.bfloat16
    assert plugin_run["served_by"] == (served if serves else {})
    assert plugin_run["precompute_calls"] > 0 and plugin_run["attention_calls"] > 0


def test_bench_vllm_draft_size_has_qwen3_8b_dflash_shapes_and_writes_them(tmp_path):
    """``bench --vllm --size draft``: the draft's dimensions are Qwen3-8B-DFlash-b16's (the
    repository's shape table and step model), its taps are layers of the target, and
    the writer puts the sizes it is given into both configs and the fc's width (checked
    on a small Sizes: the real ones are 4 GB)."""
    from safetensors import safe_open

    from dflash_rocm.peer.step import DRAFTS
    from dflash_rocm.tiny_models import DRAFT_SIZED, Sizes, write_random_models
    from dflash_rocm.vllm_bench import WORKLOADS
    from dflash_rocm.workloads import SHAPES

    shape, inter = DRAFTS["qwen3-8b"]
    assert shape == SHAPES["qwen3-8b-dflash-b16"]
    assert (DRAFT_SIZED.hidden, DRAFT_SIZED.heads, DRAFT_SIZED.kv_heads, DRAFT_SIZED.head_dim, DRAFT_SIZED.inter,
            DRAFT_SIZED.draft_layers) == (shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim, inter,
                                          shape.layers)
    assert len(DRAFT_SIZED.target_layer_ids) == 5 and max(DRAFT_SIZED.target_layer_ids) < DRAFT_SIZED.target_layers
    assert WORKLOADS["draft"].size == "draft" and WORKLOADS["tiny"].size == "tiny"

    small = Sizes(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, target_layers=3, draft_layers=2,
                  target_layer_ids=(0, 2))
    target, draft = write_random_models(str(tmp_path), small)
    for path, layers in ((target, 3), (draft, 2)):
        cfg = json.loads((tmp_path / path / "config.json").read_text())
        assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 4, 2, 16, 96, layers)
    assert json.loads((tmp_path / draft / "config.json").read_text())["dflash_config"]["target_layer_ids"] == [0, 2]
    with safe_open(f"{draft}/model.safetensors", "pt") as f:
        assert f.get_slice("fc.weight").get_shape() == [64, 128]
        assert f.get_slice("layers.1.self_attn.k_proj.weight").get_shape() == [32, 64]
        assert f.get_slice("layers.1.mlp.up_proj.weight").get_shape() == [96, 64]
        k_norms = [f.get_tensor(f"layers.{i}.self_attn.k_norm.weight") for i in range(2)]
    assert torch.equal(k_norms[0], k_norms[1])  # one K-norm for every layer: vLLM's CPU path computes the same
