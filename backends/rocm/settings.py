"""Settings of the ROCm backend: query limit, tuning mode and the tuning space.

The vLLM plugin calls :func:`configure` with what the engine knows (DFlash's query limit
is ``num_speculative_tokens + 1``, the batch limit, the model length, the per-layer
causal flags); an environment variable the user set wins over it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from dflash_rocm import envs
from dflash_rocm.platform import Platform

MAX_QUERY_LEN = 8192  # longest query the segmented path is compiled for without a limit


@dataclass(frozen=True)
class RocmSettings:
    query_limit: int | None = None
    batch_limit: int = 64
    max_model_len: int = 32768
    layer_causal: tuple[bool, ...] | None = None  # scopes tuning to what the draft runs


_lock = threading.Lock()
_configured = RocmSettings()


def configure(**changes) -> RocmSettings:
    """Update the settings (unknown names are refused)."""
    global _configured
    for key, value in changes.items():
        if key not in RocmSettings.__dataclass_fields__:
            raise ValueError(f"unknown ROCm setting {key!r}; known: {', '.join(RocmSettings.__dataclass_fields__)}")
        if key in ("query_limit", "batch_limit", "max_model_len") and value is not None and (
                not isinstance(value, int) or value < 1):
            raise ValueError(f"{key}: expected a positive int, got {value!r}")
    with _lock:
        _configured = replace(_configured, **changes)
    return _configured


def current() -> RocmSettings:
    return _configured


def query_limit() -> int | None:
    """``DFLASH_ROCM_QUERY_LIMIT`` if set, else the configured limit (None: 8192)."""
    from_env = envs.QUERY_LIMIT.setting()
    return _configured.query_limit if from_env is None else from_env


def effective_query_limit() -> int:
    return min(query_limit() or MAX_QUERY_LEN, MAX_QUERY_LEN)


def tuning_enabled(platform: Platform) -> bool:
    """``DFLASH_ROCM_TUNE``: on, off, or auto (default): on for RDNA gfx1x GPUs only."""
    mode = envs.TUNE.setting()
    if mode == "auto":
        return platform.family == "rdna" and not platform.simulated
    return mode
