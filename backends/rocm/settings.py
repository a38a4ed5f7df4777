"""Settings of the ROCm backend: query limit, tuning mode and the tuning space.

What the serving engine knows (DFlash's query limit is ``num_speculative_tokens + 1``,
the batch limit, the model length, the per-layer causal flags) is the package's engine
settings (:class:`dflash_rocm.planning.EngineSettings`, set through
:func:`dflash_rocm.dispatch.configure` or :func:`configure` here); an environment variable
the user set wins over it. Plans read both from their planning record
(:func:`planned_query_limit`, :func:`tuning_on`); the tuner and ``info`` read them now.
"""

from __future__ import annotations

from dflash_rocm import envs
from dflash_rocm.planning import EngineSettings, PlanningRecord, configure_engine, engine_settings
from dflash_rocm.platform import Platform

MAX_QUERY_LEN = 8192  # longest query the segmented path is compiled for without a limit

RocmSettings = EngineSettings  # the engine settings are the ROCm backend's settings
configure = configure_engine
current = engine_settings


def query_limit() -> int | None:
    """``DFLASH_ROCM_QUERY_LIMIT`` if set, else the configured limit (None: 8192)."""
    from_env = envs.QUERY_LIMIT.setting()
    return current().query_limit if from_env is None else from_env


def planned_query_limit(record: PlanningRecord) -> int | None:
    """:func:`query_limit` as the planning record holds it."""
    from_env = record.switches.query_limit
    return record.settings.query_limit if from_env is None else from_env


def effective_query_limit() -> int:
    return min(query_limit() or MAX_QUERY_LEN, MAX_QUERY_LEN)


def planned_effective_query_limit(record: PlanningRecord) -> int:
    """:func:`effective_query_limit` as the planning record holds it."""
    return min(planned_query_limit(record) or MAX_QUERY_LEN, MAX_QUERY_LEN)


def tuning_on(mode: bool | str, platform: Platform) -> bool:
    """Whether ``DFLASH_ROCM_TUNE``'s ``mode`` tunes on ``platform``: on, off, or auto (the
    default): on for RDNA gfx1x GPUs only."""
    if mode == "auto":
        return platform.family == "rdna" and not platform.simulated
    return mode


def tuning_enabled(platform: Platform) -> bool:
    """:func:`tuning_on` with ``DFLASH_ROCM_TUNE`` as it is now."""
    return tuning_on(envs.TUNE.setting(), platform)
