"""The hardware floor of each operation: bytes that must move, FLOPs that must run, and
the device peaks they are divided by (vendor figures, kept per product in ``arch.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arch import Product
from .platform import Platform
from .timing import median_seconds


def peak_for(platform: Platform) -> Product | None:
    """The product of ``platform``'s architecture its device name matches (None: unknown)."""
    info = platform.arch_info
    return info.product_for(platform.name) if info else None


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float | None:
    """Copy bandwidth (bytes read + written per second) of ``device``'s memory: 512 MiB
    on a GPU, 64 MiB on a CPU (where it is the only floor there is)."""
    if device.type not in ("cuda", "cpu"):
        return None
    nbytes = nbytes or (1 << 29 if device.type == "cuda" else 1 << 26)

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda _: dst.copy_(src), device, warmup=2, repeats=5)
    return 2 * nbytes / seconds


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float

    def floor_seconds(self, bandwidth: float, flops_per_second: float) -> float:
        return max(self.bytes / bandwidth, self.flops / flops_per_second)


def precompute_cost(*, hidden: int, layers: int, kv_heads: int, head_dim: int, num_tokens: int,
                    elem_bytes: int, cache_bytes: int, weight_bytes: int | None = None) -> Cost:
    """Weights once (``weight_bytes`` each: 1 for fp8 rows; default ``elem_bytes``), states
    once, every layer's K and V written once (plus positions, slots)."""
    rows = layers * 2 * kv_heads * head_dim
    moved = (rows * hidden * (elem_bytes if weight_bytes is None else weight_bytes)
             + num_tokens * hidden * elem_bytes + 16 * num_tokens + rows * num_tokens * cache_bytes)
    return Cost(moved, 2.0 * num_tokens * hidden * rows)


def attention_cost(*, batch: int, query_len: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
                   elem_bytes: int, cache_bytes: int, sliding_window: int | None = None) -> Cost:
    """The visible K/V once, the queries read and the output written once."""
    visible = seq_len if sliding_window is None else min(seq_len, sliding_window + query_len - 1)
    moved = (batch * visible * kv_heads * head_dim * 2 * cache_bytes
             + 2 * batch * query_len * q_heads * head_dim * elem_bytes)
    return Cost(moved, 4.0 * batch * query_len * visible * q_heads * head_dim)
