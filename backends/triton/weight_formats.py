"""Where reading fp8 K/V rows as they are makes the fused precompute slower than bf16 rows.

The fused kernel reads fp8 rows (``FP8_WEIGHTS``) correctly on every platform that converts
their format: that is capability (``TritonPrecompute.weight_reasons``). Whether the vLLM
plugin should *hold* them instead of dense bf16 rows is a cost question: the rows are held
for the draft's lifetime and serve every call, so they are held only where the kernel
reading them is modelled no slower than reading bf16 rows at every one of the draft
shapes' usual context-token counts per call (:data:`FP8_ROWS_TOKENS`); elsewhere the
plugin dequantizes them once, as before ("the plugin must never make vLLM worse").

The rule is declared, not computed at load time: :data:`FP8_ROWS_SLOWER` names the
architectures (name prefixes) where it fails, with the figures. They are modelled, not
measured: ``dflash-rocm inspect --op precompute --kv bf16 --weight-dtype bf16
--weight-dtype fp8 --tokens 16,64,256`` (Qwen3-8B draft, bf16 states and cache, each
target's table, compiled for the target, 0 spills); tests/test_audit.py holds the table
to the model. Per trip of the GEMM loop every program multiplies its states tile by the
norm weight and rounds it, and widens the fp8 tile in the dot's operand layout: on CDNA
and RDNA that vector work passes the matrix work once a token tile is larger than a few
rows, and the halved weight bytes no longer pay for it (docs/performance.md).
"""

from __future__ import annotations

from dflash_rocm.platform import Platform

FP8_ROWS_TOKENS = (16, 64, 256)  # context tokens per call the rule compares at
# Architecture prefix -> modelled us, bf16 rows -> fp8 rows, at FP8_ROWS_TOKENS.
FP8_ROWS_SLOWER: dict[str, str] = {
    "gfx942": "N=16 18.7 -> 14.6 us, N=64 21.2 -> 25.9, N=256 26.1 -> 45.0 (MI300X)",
    "gfx950": "N=16 13.0 -> 13.0 us, N=64 14.7 -> 19.9, N=256 22.6 -> 30.9 (MI355X)",
    "gfx12": "N=16 134 -> 101 us, N=64 136 -> 180, N=256 145 -> 473 (R9700)",
}


def fp8_rows_slower(platform: Platform) -> str | None:
    """Why holding fp8 rows on ``platform`` would be slower than bf16 rows (the modelled
    figures), or None: not modelled slower (the interpreter, an architecture not in
    :data:`FP8_ROWS_SLOWER`)."""
    if platform.vendor == "cpu" or platform.simulated:
        return None
    figures = next((v for k, v in FP8_ROWS_SLOWER.items() if platform.arch.startswith(k)), None)
    if figures is None:
        return None
    return (f"fp8 K/V rows are modelled slower than bf16 rows on {platform.arch} at "
            f"{'/'.join(map(str, FP8_ROWS_TOKENS))} context tokens ({figures})")
