"""Every Triton kernel path, with the launch configs the tables pick, compiles for real
GPU targets (sm_90, gfx942, gfx950, gfx1100, gfx1201) down to cubin/hsaco. The
interpreter tests check the math; this checks what only a real compile catches (types
in loops, fp8 conversions, pointer casts, layouts) without any GPU."""

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from support import HAS_TRITON

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_compile_for_every_gpu_target():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # this checkout's kernels (a script runs with its own folder first on the path, not the root)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "aot_compile.py")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in records if not r["ok"]]
    assert not failed, "\n\n".join(f"{r['arch']} {r['variant']} {r['kernel']}: {r['error']}" for r in failed[:3])
    assert result.returncode == 0, result.stderr[-2000:]
    kernels = defaultdict(set)
    for r in records:
        final = "cubin" if r["arch"].startswith("sm_") else "hsaco"
        assert final in r["stages"], r
        kernels[r["arch"]].add(r["kernel"])
    expected = {"draft_attention_kernel", "merge_segments_kernel", "context_kv_kernel"}
    assert set(kernels) == {"sm_90", "gfx942", "gfx950", "gfx1100", "gfx1201"}
    assert all(k == expected for k in kernels.values()), dict(kernels)
    packed = defaultdict(set)  # vLLM ROCM_ATTN's packed pages, on every AMD target
    for r in records:
        if "rocm_attn" in r["variant"]:
            packed[r["arch"]].add(r["kernel"])
    assert set(packed) == {"gfx942", "gfx950", "gfx1100", "gfx1201"}
    assert all(k == expected for k in packed.values()), dict(packed)
    # CDNA attention asks for 16x16 MFMA tiles; no table pads registers with waves_per_eu any more.
    assert all(r["options"].get("matrix_instr_nonkdim") == 16 for r in records
               if r["arch"] in ("gfx942", "gfx950") and r["kernel"] == "draft_attention_kernel")
    assert not any(r["options"].get("waves_per_eu") for r in records)
