"""The RoPE ``cos_sin_cache`` table (cos in the first R/2 columns, sin in the last R/2).

The formulas follow vLLM's ``vllm/model_executor/layers/rotary_embedding`` for the
scaling types DFlash drafts use, so a table built here equals the draft's own.

The table is built whole (the kernels index it by position), so its length is bounded:
a config asking for more than :data:`MAX_ROPE_POSITIONS` rows is refused before anything
is allocated. 4M positions (2 GiB of float32 at rotary dim 128) is past every released
long-context model's range (1M for Qwen2.5-1M); ``max_position_embeddings: 1e9`` is a
broken config, not a model, and would otherwise try to allocate tens of GB.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MAX_ROPE_POSITIONS = 1 << 22


def _positive(p: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """``p[key]`` as a positive finite float (``default`` when absent); ValueError naming it."""
    value = p.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"rope parameter {key}: expected a positive number, got {value!r}")
    return float(value)


def rope_type_of(rope_parameters: Mapping[str, Any]) -> str:
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return rope_type


# The parameters each scaling type reads (beyond rope_theta), required (True) or not.
_TYPE_PARAMETERS = {
    "default": {},
    "linear": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True, "beta_fast": False, "beta_slow": False,
             "attention_factor": False},
}


def cos_sin_cache_rows(max_position: int, rope_parameters: Mapping[str, Any] | None = None) -> int:
    """How many positions :func:`build_cos_sin_cache` would build (vLLM's lengths: linear
    scaling multiplies ``max_position`` by its factor, YaRN uses its original length times
    its factor), after checking every parameter the build reads and the length against
    :data:`MAX_ROPE_POSITIONS`, without allocating anything."""
    p = dict(rope_parameters or {})
    if isinstance(max_position, bool) or not isinstance(max_position, int) or max_position < 1:
        raise ValueError(f"max_position: expected a positive int, got {max_position!r}")
    rope_type = rope_type_of(p)
    if _positive(p, "rope_theta", 10000.0) <= 1:  # frequencies base ** (-2i/R) must fall; YaRN divides by log(base)
        raise ValueError(f"rope parameter rope_theta: expected a number > 1, got {p['rope_theta']!r}")
    for key, required in _TYPE_PARAMETERS[rope_type].items():
        if required or p.get(key) is not None:
            _positive(p, key)
    if rope_type == "yarn" and p.get("mscale") and p.get("mscale_all_dim"):  # as the build reads them
        _positive(p, "mscale"), _positive(p, "mscale_all_dim")
    if rope_type == "yarn":
        rows = int(_positive(p, "original_max_position_embeddings") * _positive(p, "factor"))
    elif rope_type == "linear":
        rows = int(max_position * _positive(p, "factor"))
    else:
        rows = max_position
    if not 1 <= rows <= MAX_ROPE_POSITIONS:
        raise ValueError(f"the RoPE table would have {rows} positions (max_position_embeddings {max_position}, "
                         f"rope {rope_type}); refused above {MAX_ROPE_POSITIONS}, below 1")
    return rows


def rotary_dim_for(head_dim: int, rope_parameters: Mapping[str, Any]) -> int:
    """``rope_dim`` if given, else ``int(head_dim * partial_rotary_factor)`` as vLLM's get_rope."""
    if rope_parameters.get("rope_dim"):
        rope_dim = rope_parameters["rope_dim"]
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 2 <= rope_dim <= head_dim:
            raise ValueError(f"rope_dim: expected an int in 2..head_dim={head_dim}, got {rope_dim!r}")
        return rope_dim
    factor = _positive(rope_parameters, "partial_rotary_factor", 1.0)
    if factor > 1.0:
        raise ValueError(f"partial_rotary_factor: expected a value in (0, 1], got {factor}")
    return int(head_dim * factor)


def _inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: Mapping[str, Any]) -> torch.Tensor:
    factor, low, high = _positive(p, "factor"), _positive(p, "low_freq_factor"), _positive(p, "high_freq_factor")
    orig = _positive(p, "original_max_position_embeddings")
    wave_len = 2 * math.pi / inv_freq
    smooth = (orig / wave_len - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
    return torch.where(wave_len < orig / high, inv_freq,
                       torch.where(wave_len > orig / low, inv_freq / factor,
                                   (1 - smooth) * inv_freq / factor + smooth * inv_freq))


def _yarn_table(base: float, rotary_dim: int, p: Mapping[str, Any]) -> torch.Tensor:
    factor = _positive(p, "factor")
    orig = int(_positive(p, "original_max_position_embeddings"))
    beta_fast, beta_slow = _positive(p, "beta_fast", 32), _positive(p, "beta_slow", 1)

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
        mscale = _positive(p, "attention_factor")
    elif p.get("mscale") and p.get("mscale_all_dim"):
        mscale = get_mscale(factor, _positive(p, "mscale")) / get_mscale(factor, _positive(p, "mscale_all_dim"))
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
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number >= 2, got {rotary_dim}")
    rows = cos_sin_cache_rows(max_position, p)  # refuses absurd lengths before any allocation
    base = _positive(p, "rope_theta", 10000.0)
    rope_type = rope_type_of(p)
    if rope_type == "yarn":
        return _yarn_table(base, rotary_dim, p)
    inv_freq = _inv_freq(base, rotary_dim)
    t = torch.arange(rows, dtype=torch.float32)
    if rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, p)
    elif rope_type == "linear":
        t = t / _positive(p, "factor")
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
