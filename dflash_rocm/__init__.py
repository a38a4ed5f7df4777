"""dflash_rocm: fused DFlash draft kernels behind one contract (docs/SPEC.md).

Public API::

    draft_attention(...)                    # paged, non-causal-by-default draft attention
    plan_draft_attention(...).run(...)      # the same, the batch's host work done once for all layers
    precompute_and_store_context_kv(...)    # fused context K/V -> every layer's cache
    plan_context_kv(...).run(...)           # the same, the model's weights and caches taken once
    ContextKVWeights                        # the draft tensors the precompute needs
    load_context_kv_weights(path)           # ... from a DFlash draft checkpoint
    PackedCache                             # caches packed beyond a strided view (vLLM ROCM_ATTN)
    refill_derived()                        # backends' derived weights refilled in place after an update
    BackendUnavailable, explain(...), available_backends(), dispatch_counts()
"""

from __future__ import annotations

import logging


def _configure_logging() -> None:
    """Library etiquette: no handler unless ``DFLASH_ROCM_LOG_LEVEL`` asks for output.

    A value that is not a level warns once (here, at import) and keeps WARNING: a typo in
    a logging knob must never stop the package from importing."""
    from . import envs

    if not envs.LOG_LEVEL.is_set():
        return
    logger = logging.getLogger(__name__)
    try:
        level, problem = envs.LOG_LEVEL.value(), None
    except ValueError as exc:
        level, problem = logging.WARNING, exc
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[dflash_rocm %(levelname)s] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    if problem is not None:
        logger.warning("%s; keeping WARNING", problem)


_configure_logging()

from .api import available_backends, draft_attention, explain, precompute_and_store_context_kv  # noqa: E402
from .checkpoint import load_context_kv_weights  # noqa: E402
from .derived import refill_derived  # noqa: E402
from .dispatch import BackendUnavailable, dispatch_counts, reset_dispatch_counts  # noqa: E402
from .paged import PackedCache  # noqa: E402
from .plan import ContextKVPlan, DraftAttentionPlan, PlanMismatch, plan_context_kv, plan_draft_attention  # noqa: E402
from .version import __version__  # noqa: E402
from .weights import ContextKVWeights  # noqa: E402

__all__ = [
    "BackendUnavailable", "ContextKVPlan", "ContextKVWeights", "DraftAttentionPlan", "PackedCache", "PlanMismatch",
    "available_backends", "dispatch_counts", "draft_attention", "explain", "load_context_kv_weights",
    "plan_context_kv", "plan_draft_attention", "precompute_and_store_context_kv", "refill_derived",
    "reset_dispatch_counts",
    "__version__",
]
