"""vLLM's precompute sequence, launch by launch, costed at each launch's roofline.

vLLM 0.34's ``precompute_and_store_context_kv`` (``qwen3_dflash.py``, fused-weight path):
hidden RMSNorm, one GEMM with every layer's K/V rows (``F.linear``: hipBLASLt/cuBLAS),
a permute copy to layer-major K and V, the grouped K RMSNorm, ``positions.repeat(L)``,
in-place RoPE over every layer, then one cache write per layer (``do_kv_cache_update``).
Only the cache write is Triton (TRITON_ATTN's ``reshape_and_cache_flash``; ROCM_ATTN's is
C++); the GEMM and the norm and RoPE ops are vendor libraries and C++ kernels, with no
compiled code to read here. So every launch is costed at its roofline: the launch gap
plus the longer of its bytes at the vendor's peak bandwidth and its FLOPs at the peak
bf16 rate. That is a lower bound of vLLM's time (no launch reaches the vendor peak), so
a ratio of ours over it is an upper bound: vLLM's side is never made slower than it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_rocm.audit.targets import Target
from dflash_rocm.workloads import DraftShape

ELEMENT = 2  # bf16 states, weights and intermediates


@dataclass(frozen=True)
class RooflineLaunch:
    name: str
    bytes: int
    flops: int = 0

    def seconds(self, target: Target) -> float:
        return target.launch_gap_s + max(self.bytes / target.peak.bandwidth, self.flops / target.peak.bf16_flops)


def unfused_sequence(shape: DraftShape, tokens: int, cache_bytes: int) -> list[RooflineLaunch]:
    """The launches of vLLM's precompute for ``tokens`` context tokens (``cache_bytes``: 2
    for a bf16 cache, 1 for fp8), each with the bytes it must move and its FLOPs."""
    N, H, L, Hk, D = tokens, shape.hidden, shape.layers, shape.kv_heads, shape.head_dim
    rows = L * 2 * Hk * D  # every layer's K and V rows
    k_elems = N * L * Hk * D
    launches = [
        RooflineLaunch("hidden rms_norm", 2 * N * H * ELEMENT + H * ELEMENT),
        RooflineLaunch("K/V GEMM", rows * H * ELEMENT + N * H * ELEMENT + N * rows * ELEMENT, 2 * N * H * rows),
        RooflineLaunch("permute copy", 2 * N * rows * ELEMENT),
        RooflineLaunch("grouped K rms_norm", 2 * k_elems * ELEMENT + L * D * ELEMENT),
        RooflineLaunch("positions.repeat", N * 8 + L * N * 8),
        RooflineLaunch("rotary_embedding", 2 * k_elems * ELEMENT + L * N * 8 + L * N * shape.rope_dim * ELEMENT),
    ]
    per_layer = 2 * N * Hk * D
    launches += [RooflineLaunch(f"cache write {i}", per_layer * ELEMENT + per_layer * cache_bytes + N * 8)
                 for i in range(L)]
    return launches


def unfused_seconds(shape: DraftShape, tokens: int, cache_bytes: int, target: Target) -> float:
    return sum(launch.seconds(target) for launch in unfused_sequence(shape, tokens, cache_bytes))
