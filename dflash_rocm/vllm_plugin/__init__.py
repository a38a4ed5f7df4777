"""Drop-in for vLLM: DFlash-family drafts' context-KV precompute and draft attention through dflash_rocm.

Installed, the package exposes :func:`register` as a ``vllm.general_plugins`` entry
point; vLLM calls it in every process (user, engine core, workers). It points every
speculative architecture whose vLLM module builds on ``qwen3_dflash`` (:mod:`.family`) at
:mod:`.model`, which hands vLLM a subclass of vLLM's own class (the proposers check
``isinstance``) whose precompute and draft-layer attention dispatch through dflash_rocm
where the draft's structure is DFlash's, so ``DFLASH_ROCM_BACKEND`` picks the backend.
``DFLASH_ROCM_VLLM=0`` leaves vLLM untouched; so does a vLLM the plugin does not know
(:mod:`.compat`), with one warning saying why.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading

from .. import envs
from .compat import incompatibility, vllm_version

logger = logging.getLogger("dflash_rocm")

PLUGIN_NAME = "dflash_rocm"
SERVED_MODULE = "dflash_rocm.vllm_plugin.model"  # its __getattr__ resolves an architecture to the served class

_lock = threading.Lock()
_originals: dict[str, object] = {}  # architecture -> vLLM's registry entry, while ours is in place


def register() -> None:
    """The entry point: idempotent; a no-op when ``DFLASH_ROCM_VLLM=0`` or when this vLLM's
    internals are not known (then vLLM's own classes serve, and one warning says why). A
    bad value of ``DFLASH_ROCM_VLLM`` or ``DFLASH_ROCM_BACKEND`` (they decide what runs) is
    refused as everywhere (README), before vLLM builds anything: the plugin steps aside with
    one error line naming the variable and what it accepts (vLLM calls this without catching,
    so raising would stop ``LLM(...)`` with a traceback of vLLM's frames)."""
    try:
        envs.check_deciding()
    except ValueError as exc:
        logger.error("dflash_rocm steps aside, vLLM's own DFlash path serves: %s", exc)
        return
    if not envs.VLLM.value():
        logger.info("%s=%s: vLLM's own DFlash path stays in place", envs.VLLM.name, envs.VLLM.get())
        return
    if why := incompatibility():
        logger.warning("dflash_rocm steps aside, vLLM's own DFlash path serves: %s", why)
        return
    from vllm import ModelRegistry

    from . import family

    with _lock:
        if _originals:
            return
        try:
            candidates = family.candidate_architectures()
        except Exception as exc:  # noqa: BLE001 - a registry laid out otherwise: step aside
            logger.warning("dflash_rocm steps aside, vLLM's own DFlash path serves: cannot read vLLM's "
                           "speculative registry (%s: %s)", type(exc).__name__, exc)
            return
        for arch in candidates:
            _originals[arch] = ModelRegistry.models.get(arch)
            ModelRegistry.register_model(arch, f"{SERVED_MODULE}:{arch}")
        _forget_resolved_drafts()
    logger.info("dflash_rocm serves vLLM's DFlash-family drafts where their structure is DFlash's (%s)",
                ", ".join(sorted(candidates)))


def unregister() -> None:
    """Give every architecture back to vLLM's own class (tests compare both paths)."""
    from vllm import ModelRegistry

    with _lock:
        for arch, entry in _originals.items():
            if entry is not None:
                ModelRegistry.models[arch] = entry
        _originals.clear()
        _forget_resolved_drafts()


def _forget_resolved_drafts() -> None:
    """vLLM memoises the class it resolved per model path; drop the DFlash drafts' entries
    so a registration change takes effect in this process (a no-op at start-up)."""
    try:
        from vllm.model_executor.model_loader import utils
    except Exception:  # another layout of vLLM: nothing memoised where we look
        return
    cache = getattr(utils, "_MODEL_ARCH_BY_HASH", {})
    for key in [k for k, (cls, _) in cache.items() if hasattr(cls, "precompute_and_store_context_kv")]:
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
    problems = [problem for var in envs.DECIDING if (problem := var.problem())]  # register() refuses these
    reasons += problems
    if not problems and not envs.VLLM.value():
        reasons.append(f"{envs.VLLM.name}={envs.VLLM.get()}")
    if version is None:
        reasons.append("vLLM is not installed")
    elif why := incompatibility():
        reasons.append(why)
    return {"vllm": version, "entry_point": bool(entry), "will_load": not reasons, "reasons": reasons}
