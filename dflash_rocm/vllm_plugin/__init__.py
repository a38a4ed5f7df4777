"""Drop-in for vLLM: DFlash's context-KV precompute and draft attention through dflash_rocm.

Installed, the package exposes :func:`register` as a ``vllm.general_plugins`` entry
point; vLLM calls it in every process (user, engine core, workers). It replaces the
model class of the ``DFlashDraftModel`` architecture with a subclass of vLLM's
``DFlashQwen3ForCausalLM`` (the proposer checks ``isinstance``) whose precompute and
draft-layer attention dispatch through dflash_rocm, so ``DFLASH_ROCM_BACKEND`` picks the
backend. ``DFLASH_ROCM_VLLM=0`` leaves vLLM untouched.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading

from .. import envs
from .compat import incompatibility, vllm_version

logger = logging.getLogger("dflash_rocm")

ARCHITECTURE = "DFlashDraftModel"
PLUGIN_NAME = "dflash_rocm"
MODEL_CLASS = "dflash_rocm.vllm_plugin.model:DFlashRocmQwen3ForCausalLM"
VLLM_MODEL_CLASS = "vllm.model_executor.models.qwen3_dflash:DFlashQwen3ForCausalLM"

_lock = threading.Lock()
_registered = False


def register() -> None:
    """The entry point: idempotent, and a no-op when ``DFLASH_ROCM_VLLM=0``."""
    global _registered
    if not envs.VLLM.value():
        logger.info("%s=%s: vLLM's own DFlash path stays in place", envs.VLLM.name, envs.VLLM.get())
        return
    with _lock:
        if _registered:
            return
        from vllm import ModelRegistry

        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
        _forget_resolved_drafts()
        _registered = True
    logger.info("dflash_rocm serves vLLM's %s drafts (%s)", ARCHITECTURE, MODEL_CLASS)


def unregister() -> None:
    """Give ``DFlashDraftModel`` back to vLLM's own class (tests compare both paths)."""
    global _registered
    from vllm import ModelRegistry

    with _lock:
        ModelRegistry.register_model(ARCHITECTURE, VLLM_MODEL_CLASS)
        _forget_resolved_drafts()
        _registered = False


def _forget_resolved_drafts() -> None:
    """vLLM memoises the class it resolved per model path; drop the DFlash drafts' entries
    so a registration change takes effect in this process (a no-op at start-up)."""
    try:
        from vllm.model_executor.model_loader import utils
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
    except Exception:  # another layout of vLLM: nothing memoised where we look
        return
    cache = getattr(utils, "_MODEL_ARCH_BY_HASH", {})
    for key in [k for k, (cls, _) in cache.items() if issubclass(cls, DFlashQwen3ForCausalLM)]:
        del cache[key]


def plugin_status() -> dict:
    """Whether vLLM will load the plugin here, and why not (for ``dflash-rocm info``)."""
    entry = [ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == PLUGIN_NAME]
    allowed = os.environ.get("VLLM_PLUGINS")
    version = vllm_version()
    reasons = []
    if not entry:
        reasons.append("the vllm.general_plugins entry point is not installed (pip install dflash-rocm)")
    if allowed is not None and PLUGIN_NAME not in allowed.split(","):
        reasons.append(f"VLLM_PLUGINS={allowed!r} does not name {PLUGIN_NAME}")
    if problem := envs.VLLM.problem():
        reasons.append(problem)
    elif not envs.VLLM.value():
        reasons.append(f"{envs.VLLM.name}={envs.VLLM.get()}")
    if version is None:
        reasons.append("vLLM is not installed")
    elif why := incompatibility():
        reasons.append(why)
    return {"vllm": version, "entry_point": bool(entry), "will_load": not reasons, "reasons": reasons}
