"""Which of vLLM's draft architectures the plugin serves, decided by structure.

vLLM ships a family of block drafters (DFlash, DFlash2, Muse Glimmer, DSpark, LiLiCorr,
XPress, Laguna, ...), most of them built on ``DFlashQwen3Model`` and so on the same two
operations. The plugin does not keep a list of names. At registration it wraps every
speculative-decoding architecture whose vLLM module builds on ``qwen3_dflash`` (a text
check of the module's source: nothing is imported); when vLLM resolves one, this module's
``__getattr__`` imports vLLM's class and returns :func:`~.model.served_class` of it, or
vLLM's class itself when it has no DFlash precompute. On each built model,
:func:`precompute_support` and :func:`attention_support` say whether the instance's
precompute and attention are ``DFlashQwen3Model``'s: a class that overrides them keeps
vLLM's code for that operation, with one log line naming the class and the reason. A
future subclass that changes nothing is served without a code change.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

logger = logging.getLogger("dflash_rocm")

MODULE = __name__
_DFLASH_BASE = "DFlashQwen3"  # what a family member's module imports or defines

# The methods of DFlashQwen3Model that make up its precompute, in any of vLLM 0.32-0.34
# (a release lacks some; those it has must be DFlashQwen3Model's own).
PRECOMPUTE_METHODS = ("precompute_and_store_context_kv", "_project_context_kv", "_project_context_kv_token_major",
                      "_normalize_context_states", "_normalize_context_k", "_apply_context_rope",
                      "_build_context_kv_buffers", "_build_fused_kv_buffers")


def _speculative_entries() -> dict[str, tuple[str, str]]:
    """vLLM's speculative-decoding architectures: name -> (module, class)."""
    from vllm.model_executor.models import registry
    return {arch: (registry._resolve_module_name(module), cls)
            for arch, (module, cls) in registry._SPECULATIVE_DECODING_MODELS.items()}


def _builds_on_dflash(module_name: str) -> bool:
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    try:
        with open(spec.origin, encoding="utf-8") as f:
            return _DFLASH_BASE in f.read()
    except OSError:
        return False


def candidate_architectures() -> dict[str, tuple[str, str]]:
    """The speculative architectures whose vLLM module builds on qwen3_dflash."""
    entries = _speculative_entries()
    modules = {module for module, _ in entries.values()}
    builds = {module: _builds_on_dflash(module) for module in modules}
    return {arch: entry for arch, entry in entries.items() if builds[entry[0]]}


def vllm_class(arch: str) -> type:
    """vLLM's own class for a speculative architecture."""
    module, cls = _speculative_entries()[arch]
    return getattr(importlib.import_module(module), cls)


def __getattr__(arch: str):
    """What vLLM gets for ``dflash_rocm.vllm_plugin.family:<arch>``."""
    if arch.startswith("__"):
        raise AttributeError(arch)
    try:
        entries = _speculative_entries()
    except Exception as exc:  # vLLM moved its registry: nothing of ours to resolve
        raise AttributeError(f"{arch}: {exc}") from exc
    if arch not in entries:
        raise AttributeError(f"{MODULE} has no architecture {arch!r}")
    original = vllm_class(arch)
    if not hasattr(original, "precompute_and_store_context_kv"):
        return original
    from .model import served_class
    return served_class(original)


def _same_function(cls: type, base: type, name: str) -> bool:
    return getattr(cls, name, None) is getattr(base, name, None)


def precompute_support(draft) -> str | None:
    """Why the draft's context-KV precompute is not DFlashQwen3Model's (None: it is)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

    inner = getattr(draft, "model", None)
    if not isinstance(inner, DFlashQwen3Model):
        return f"its inner model {type(inner).__name__} is not a DFlashQwen3Model"
    cls = type(draft)
    top = next((c for c in cls.__mro__ if "precompute_and_store_context_kv" in vars(c)
                and not getattr(c, "_dflash_rocm_served", False)), None)
    if top is not None and top is not DFlashQwen3ForCausalLM:
        return f"{top.__name__} overrides precompute_and_store_context_kv"
    changed = [name for name in PRECOMPUTE_METHODS
               if hasattr(DFlashQwen3Model, name) and not _same_function(type(inner), DFlashQwen3Model, name)]
    if changed:
        return f"{type(inner).__name__} overrides {', '.join(changed)}"
    return None


def attention_support(draft) -> str | None:
    """Why the draft layers' attention is not DFlashQwen3Attention's (None: it is)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Attention

    try:
        modules = [layer.self_attn for layer in draft.model.layers]
    except AttributeError as exc:
        return f"its layers cannot be read ({exc})"
    other = sorted({type(m).__name__ for m in modules if not isinstance(m, DFlashQwen3Attention)})
    if other:
        return f"its draft layers use {', '.join(other)}, not DFlashQwen3Attention"
    return None
