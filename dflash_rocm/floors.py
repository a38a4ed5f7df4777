"""The hardware floor of each operation: bytes that must move, FLOPs that must run, and
the device peaks they are divided by (vendor figures; shared/NOTES.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .platform import Platform


@dataclass(frozen=True)
class DevicePeak:
    name: str
    arch: str
    name_hint: str  # substring of the device name that tells parts of one arch apart
    bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s


PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak("MI325X", "gfx942", "MI325", 6.0e12, 1307e12),
    DevicePeak("MI300X", "gfx942", "", 5.3e12, 1307e12),
    DevicePeak("MI355X", "gfx950", "", 8.0e12, 2500e12),
    DevicePeak("RX 7900 XTX", "gfx1100", "", 0.96e12, 123e12),
    DevicePeak("Radeon AI PRO R9700", "gfx1201", "", 0.64e12, 195e12),
    DevicePeak("H200", "sm_90", "H200", 4.8e12, 990e12),
    DevicePeak("H100 SXM", "sm_90", "", 3.35e12, 990e12),
)


def peak_for(platform: Platform) -> DevicePeak | None:
    """The first table entry for this arch whose name hint the device name contains."""
    for peak in PEAKS:
        if peak.arch == platform.arch and peak.name_hint.lower() in platform.name.lower():
            return peak
    return None


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float | None:
    """Copy bandwidth (bytes read + written per second) of ``device``'s memory: 512 MiB
    on a GPU, 64 MiB on a CPU (where it is the only floor there is)."""
    if device.type not in ("cuda", "cpu"):
        return None
    from .timing import median_seconds

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
                    elem_bytes: int, cache_bytes: int) -> Cost:
    """Weights once, states once, every layer's K and V written once (plus positions, slots)."""
    rows = layers * 2 * kv_heads * head_dim
    moved = (rows * hidden * elem_bytes + num_tokens * hidden * elem_bytes + 16 * num_tokens
             + rows * num_tokens * cache_bytes)
    return Cost(moved, 2.0 * num_tokens * hidden * rows)


def attention_cost(*, batch: int, query_len: int, seq_len: int, q_heads: int, kv_heads: int, head_dim: int,
                   elem_bytes: int, cache_bytes: int, sliding_window: int | None = None) -> Cost:
    """The visible K/V once, the queries read and the output written once."""
    visible = seq_len if sliding_window is None else min(seq_len, sliding_window + query_len - 1)
    moved = batch * visible * kv_heads * head_dim * 2 * cache_bytes + 2 * batch * query_len * q_heads * head_dim * elem_bytes
    return Cost(moved, 4.0 * batch * query_len * visible * q_heads * head_dim)
