"""The RoPE ``cos_sin_cache`` table (cos in the first R/2 columns, sin in the last R/2).

The formulas follow vLLM's ``vllm/model_executor/layers/rotary_embedding`` for the
scaling types DFlash drafts use, so a table built here equals the draft's own.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotary_dim_for(head_dim: int, rope_parameters: Mapping[str, Any]) -> int:
    """``rope_dim`` if given, else ``int(head_dim * partial_rotary_factor)`` as vLLM's get_rope."""
    if rope_parameters.get("rope_dim"):
        return int(rope_parameters["rope_dim"])
    factor = float(rope_parameters.get("partial_rotary_factor", 1.0))
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor: expected a value in (0, 1], got {factor}")
    return int(head_dim * factor)


def _inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    orig = float(p["original_max_position_embeddings"])
    wave_len = 2 * math.pi / inv_freq
    smooth = (orig / wave_len - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
    return torch.where(wave_len < orig / high, inv_freq,
                       torch.where(wave_len > orig / low, inv_freq / factor,
                                   (1 - smooth) * inv_freq / factor + smooth * inv_freq))


def _yarn_table(base: float, rotary_dim: int, p: Mapping[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    orig = int(p["original_max_position_embeddings"])
    beta_fast, beta_slow = p.get("beta_fast", 32), p.get("beta_slow", 1)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    extrapolation_mask = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_mask) + (1.0 / pos_freqs) * extrapolation_mask

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    if p.get("attention_factor") is not None:
        mscale = float(p["attention_factor"])
    elif p.get("mscale") and p.get("mscale_all_dim"):
        mscale = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
    else:
        mscale = get_mscale(factor)
    t = torch.arange(int(orig * factor), dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)


def build_cos_sin_cache(rotary_dim: int, max_position: int,
                        rope_parameters: Mapping[str, Any] | None = None) -> torch.Tensor:
    """float32 ``[positions, rotary_dim]`` table for ``rope_parameters`` (HF/vLLM keys:
    ``rope_theta``, ``rope_type``, ``factor``, ...). Unknown types are refused."""
    p = dict(rope_parameters or {})
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number >= 2, got {rotary_dim}")
    base = float(p.get("rope_theta", 10000.0))
    rope_type = p.get("rope_type", p.get("type", "default")) or "default"
    if rope_type == "yarn":
        return _yarn_table(base, rotary_dim, p)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    inv_freq = _inv_freq(base, rotary_dim)
    t = torch.arange(max_position, dtype=torch.float32)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, p)
    elif rope_type == "linear":
        factor = float(p["factor"])
        t = torch.arange(int(max_position * factor), dtype=torch.float32) / factor
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
