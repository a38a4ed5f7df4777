"""Which of vLLM's draft architectures the plugin serves, decided by structure.

vLLM ships a family of block drafters (DFlash, DFlash2, Muse Glimmer, DSpark, LiLiCorr,
XPress, Laguna, ...), most of them built on ``DFlashQwen3Model`` and so on the same two
operations. The plugin does not keep a list of names. At registration it wraps every
speculative-decoding architecture whose vLLM module builds on ``qwen3_dflash`` (a text
check of the module's source: nothing is imported); when vLLM resolves one, the ``__getattr__``
of :mod:`.model` imports vLLM's class and returns :func:`~.model.served_class` of it, or
vLLM's class itself when it has no DFlash precompute. On each built model,
:func:`precompute_support` and :func:`attention_support` say whether the instance's
precompute and attention are ``DFlashQwen3Model``'s: a class that overrides them keeps
vLLM's code for that operation, with one log line naming the class and the reason. A
future subclass that changes nothing is served without a code change. The same rules,
read from a class's code before anything is built (:func:`class_support`), answer
``dflash-rocm info`` for every architecture (:func:`family_support`).
"""

from __future__ import annotations

import dis
import importlib
import importlib.util
import inspect
import logging
from pathlib import Path

logger = logging.getLogger("dflash_rocm")

# What a family member's module names: DFlash's classes, or the modules it builds on
# (vLLM 0.34's ricursive_dflash2 imports only DFlash2's classes, from qwen3_dflash2).
_DFLASH_MARKS = ("DFlashQwen3", "qwen3_dflash")

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


def _source_file(module_name: str) -> Path | None:
    """Where a module's source is, found without importing anything: ``find_spec`` of a
    submodule imports its parent packages, and some of vLLM's model packages import heavy
    libraries (numba, ...) at import time, in every process the plugin registers in. Only
    the top-level name is looked up (which imports nothing); the rest is a path below it."""
    parts = module_name.split(".")
    try:
        top = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    if top is None:
        return None
    if len(parts) == 1:
        return Path(top.origin) if top.origin and top.origin.endswith(".py") else None
    for root in top.submodule_search_locations or ():
        base = Path(root).joinpath(*parts[1:])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _builds_on_dflash(module_name: str) -> bool:
    path = _source_file(module_name)
    if path is None:
        return False
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return False
    return any(mark in text for mark in _DFLASH_MARKS)


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


# The precompute variants the contract names as data (SPEC.md section 2), each recognised by the
# methods a DFlashQwen3Model subclass overrides:
# - NOPE: ``_apply_context_rope`` overridden and some layers' rotary modules are the identity
#   (vLLM 0.34's Ricursive restores those layers' un-rotated K after the fused RoPE):
#   ``rope_layers`` false at those layers (:func:`rope_layers`).
# - PER_LAYER_NORM: ``_build_context_kv_buffers`` and ``_project_context_kv`` are vLLM's
#   ``DFlashLagunaModel``'s (each layer's ``input_layernorm`` on the context, then a bmm):
#   an ``[L, H]`` hidden norm weight, folded into the stacked K/V weight.
NOPE, PER_LAYER_NORM = "nope-layers", "per-layer-hidden-norm"
_PER_LAYER_NORM_METHODS = ("_build_context_kv_buffers", "_project_context_kv")


def _same_code(fn, other) -> bool:
    """Whether two functions are written the same (docstrings aside): an override that
    repeats the base method's body (Laguna's delegating ``precompute_and_store_context_kv``,
    its ``_normalize_context_k``) changes nothing. Compared instruction by instruction,
    with the values they use, so a docstring's slot among the constants does not count."""
    if fn is other:
        return True
    a, b = getattr(fn, "__code__", None), getattr(other, "__code__", None)
    return a is not None and b is not None and _instructions(a) == _instructions(b)


def _instructions(code) -> list[tuple]:
    """A code object's instructions as (operation, value), nested code compared the same way."""
    return [(i.opname, _instructions(i.argval) if hasattr(i.argval, "co_code") else repr(i.argval))
            for i in dis.get_instructions(code)]


def _per_layer_norm_methods() -> dict[str, object]:
    """vLLM's ``DFlashLagunaModel`` methods that make the per-layer hidden norm (empty
    where this vLLM has no Laguna draft)."""
    try:
        from vllm.model_executor.models.laguna_dflash import DFlashLagunaModel
    except Exception:  # noqa: BLE001 - a vLLM without Laguna: the variant is never recognised
        return {}
    return {name: vars(DFlashLagunaModel)[name] for name in _PER_LAYER_NORM_METHODS if name in vars(DFlashLagunaModel)}


def _covered(inner: type, changed: list[str]) -> tuple[set[str], list[str]]:
    """The variants that explain the ``changed`` methods of ``inner``, and the methods they leave."""
    variants, left = set(), list(changed)
    if "_apply_context_rope" in left:
        variants.add(NOPE)
        left.remove("_apply_context_rope")
    if not all(name in left for name in _PER_LAYER_NORM_METHODS):
        return variants, left
    laguna = _per_layer_norm_methods()  # imported only for a class that overrides both
    if len(laguna) == len(_PER_LAYER_NORM_METHODS) and all(
            _same_code(getattr(inner, name), fn) for name, fn in laguna.items()):
        variants.add(PER_LAYER_NORM)
        left = [name for name in left if name not in laguna]
    return variants, left


def _precompute_classes(top: type, inner: type | None) -> tuple[str | None, set[str]]:
    """The one rule, and the variants it found: the precompute is DFlashQwen3Model's when the
    top-level class's ``precompute_and_store_context_kv`` is ``DFlashQwen3ForCausalLM``'s
    (or written the same; the plugin's own classes skipped) and the inner model is a
    ``DFlashQwen3Model`` whose overrides of :data:`PRECOMPUTE_METHODS` are written as the
    base's or make a variant the contract names. A method the base class of this vLLM
    lacks counts too: a class that defines it was written for a precompute that calls it."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

    reasons, variants = [], set()
    owner = next((c for c in top.__mro__ if "precompute_and_store_context_kv" in vars(c)
                  and not getattr(c, "_dflash_rocm_served", False)), None)
    base_top = DFlashQwen3ForCausalLM.precompute_and_store_context_kv
    if owner is not None and not _same_code(vars(owner)["precompute_and_store_context_kv"], base_top):
        reasons.append(f"{owner.__name__} overrides precompute_and_store_context_kv")
    if inner is None:
        reasons.append("it has no DFlashQwen3Model inner model")
    elif not issubclass(inner, DFlashQwen3Model):
        reasons.append(f"its inner model {inner.__name__} is not a DFlashQwen3Model")
    else:
        changed = [name for name in PRECOMPUTE_METHODS
                   if not _same_code(getattr(inner, name, None), getattr(DFlashQwen3Model, name, None))]
        variants, changed = _covered(inner, changed)
        if changed:
            reasons.append(f"{inner.__name__} overrides {', '.join(changed)}")
    return "; ".join(reasons) or None, variants


def _rule_for_precompute(top: type, inner: type | None) -> str | None:
    return _precompute_classes(top, inner)[0]


def precompute_variants(draft) -> set[str]:
    """The contract variants (:data:`NOPE`, :data:`PER_LAYER_NORM`) the draft's precompute uses."""
    inner = getattr(draft, "model", None)
    return _precompute_classes(type(draft), None if inner is None else type(inner))[1]


def _is_identity_rotation(rope) -> bool:
    """Whether a layer's rotary module leaves K as it is: not vLLM's RoPE, and a probe at
    positions 1 and 2 comes back unchanged (vLLM 0.34's Ricursive ``_NoRope``)."""
    import torch
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    if isinstance(rope, RotaryEmbeddingBase) or not callable(rope):
        return False
    size = int(rope.head_size)
    device = rope.cos_sin_cache.device
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, size, generator=generator).to(device) for _ in range(2))
    try:
        with torch.no_grad():
            _, out = rope(torch.tensor([1, 2], device=device), q.clone(), k.clone())
    except Exception:  # noqa: BLE001 - a module that cannot take the probe is not known to be the identity
        return False
    return isinstance(out, torch.Tensor) and torch.equal(out.reshape(k.shape), k)


def rope_layers(inner) -> tuple[bool, ...] | str:
    """Per draft layer, whether its context K is rotated: False where the layer's rotary
    module is the identity (:func:`_is_identity_rotation`); or why the layers cannot say
    (a NoPE override with no identity layer, a rotary module that is neither)."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

    try:
        ropes = [layer.self_attn.rotary_emb for layer in inner.layers]
        mask = tuple(not _is_identity_rotation(r) for r in ropes)
    except (AttributeError, TypeError, RuntimeError) as exc:
        return f"its layers' rotary modules cannot be read ({type(exc).__name__}: {exc})"
    odd = sorted({type(r).__name__ for r, on in zip(ropes, mask) if on and not isinstance(r, RotaryEmbeddingBase)})
    if odd:
        return f"its layers' rotary modules {', '.join(odd)} are neither vLLM's RoPE nor the identity"
    if all(mask):
        return (f"{type(inner).__name__} overrides _apply_context_rope and none of its layers has an identity "
                f"rotation (NoPE layers) to explain it")
    return mask


# What a DFlashQwen3Attention subclass may hand vLLM's Attention layer that the draft
# attention contract (SPEC.md section 1) does not cover: the plugin replaces that layer's
# kernel, so the math would be lost. Read from the subclass's code (keyword and attribute
# names) and from the built layer's impl.
_UNCOVERED_MATH = {"soft_cap": "a logit softcap", "softcap": "a logit softcap", "alibi": "ALiBi slopes"}


def _code_strings(code) -> set[str]:
    """The names and string constants (call keywords among them) of a code object, nested code included."""
    found = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            found |= _code_strings(const)
        elif isinstance(const, str):
            found.add(const)
        elif isinstance(const, tuple):
            found |= {c for c in const if isinstance(c, str)}
    return found


def _uncovered_in_code(cls: type) -> list[str]:
    """What ``cls``'s own ``__init__`` code (up to ``DFlashQwen3Attention``) adds that the contract lacks."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Attention

    found = set()
    for c in cls.__mro__:
        if c is DFlashQwen3Attention or not issubclass(c, DFlashQwen3Attention):
            break
        for fn in _functions(vars(c).get("__init__")):
            for name in _code_strings(fn.__code__):
                found |= {what for mark, what in _UNCOVERED_MATH.items() if mark in name.lower()}
    return sorted(found)


def _uncovered_in_impl(impl) -> list[str]:
    """What a built layer's attention impl computes that the contract lacks."""
    found = []
    if getattr(impl, "logits_soft_cap", None):
        found.append("a logit softcap")
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("ALiBi slopes")
    return found


def _rule_for_attention(classes) -> str | None:
    """The one rule: the draft attention is DFlashQwen3Attention's when every draft
    layer's attention module is one (or a subclass: the plugin replaces only the kernel
    beneath it) and no subclass hands that kernel math the contract does not cover."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Attention

    classes = set(classes)
    if not classes:
        return "it has no attention layers"
    other = sorted({c.__name__ for c in classes if not issubclass(c, DFlashQwen3Attention)})
    if other:
        return f"its draft layers use {', '.join(other)}, not DFlashQwen3Attention"
    adds = sorted({f"{c.__name__} adds {what}" for c in classes for what in _uncovered_in_code(c)})
    if adds:
        return f"{'; '.join(adds)}, which the draft attention contract does not cover"
    return None


def precompute_support(draft) -> str | None:
    """Why the draft's context-KV precompute is not DFlashQwen3Model's or a variant the
    contract names (None: it is); a variant is checked on the built layers too."""
    inner = getattr(draft, "model", None)
    why, variants = _precompute_classes(type(draft), None if inner is None else type(inner))
    if why is None and NOPE in variants and isinstance(found := rope_layers(inner), str):
        return found
    if why is None and PER_LAYER_NORM in variants:
        try:
            [layer.input_layernorm.weight for layer in inner.layers]
        except AttributeError as exc:
            return f"its layers have no input_layernorm weight for the per-layer hidden norm ({exc})"
    return why


def attention_support(draft) -> str | None:
    """Why the draft layers' attention is not DFlashQwen3Attention's (None: it is)."""
    try:
        modules = [layer.self_attn for layer in draft.model.layers]
    except AttributeError as exc:
        return f"its layers cannot be read ({exc})"
    why = _rule_for_attention(type(m) for m in modules)
    if why is None:
        impls = {type(m).__name__: _uncovered_in_impl(getattr(getattr(m, "attn", None), "impl", None))
                 for m in modules}
        adds = sorted({f"{name}'s attention layer computes {what}" for name, found in impls.items() for what in found})
        if adds:
            why = f"{'; '.join(adds)}, which the draft attention contract does not cover"
    return why


# -- the same rules for a class, before anything is built --------------------------------------

def _code_names(code) -> set[str]:
    """Every global and attribute name a function's code (and the code nested in it) reads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _closure(fn) -> dict[str, object]:
    """The values of a function's free variables (``__class__``, zero-argument super's, left out)."""
    values = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            if name != "__class__":
                values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return values


def _functions(init) -> list:
    """``init`` and the functions it closes over, at any depth: vLLM's
    ``support_torch_compile`` replaces a class's ``__init__`` by one that calls the original."""
    found, todo = [], [init]
    while todo:
        fn = todo.pop()
        if inspect.isfunction(fn) and fn not in found:
            found.append(fn)
            todo.extend(_closure(fn).values())
    return found


def _built(cls: type, base: type) -> set[type]:
    """The classes deriving from ``base`` that ``cls.__init__`` builds, read from its code:
    the names it reads that are such classes in its module or closure, or attributes of
    ``cls`` (``self.model_cls``, ``self.decoder_layer_cls``), following
    ``super().__init__`` up the MRO. ``cls`` and its bases are not counted."""
    found: set[type] = set()
    for c in cls.__mro__:
        if "__init__" not in vars(c):
            continue
        calls_super = False
        for fn in _functions(vars(c)["__init__"]):
            names = _code_names(fn.__code__)
            calls_super |= "super" in names
            scope = {**fn.__globals__, **_closure(fn)}
            for name in names | set(scope) - set(fn.__globals__):
                for value in (scope.get(name), getattr(cls, name, None)):
                    if isinstance(value, type) and issubclass(value, base) and value not in cls.__mro__:
                        found.add(value)
        if not calls_super:
            break
    return found


def _attention_modules(cls: type) -> set[type]:
    """The attention modules a class builds, at any depth: the modules whose own
    ``__init__`` builds vLLM's ``Attention`` layer (the one that owns a KV cache)."""
    import torch
    from vllm.model_executor.models import qwen3_dflash

    found, seen, todo = set(), set(), [cls]
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        if c is not cls and _built(c, qwen3_dflash.Attention):
            found.add(c)
            continue
        todo.extend(_built(c, torch.nn.Module))
    return found


def class_support(vllm_cls: type) -> tuple[str | None, str | None]:
    """Why the plugin would not serve (the precompute, the draft attention) of drafts of
    vLLM's class (None: it would), decided from the class without building it: its inner
    model is the ``DFlashQwen3Model`` its ``__init__`` builds, its attention modules
    those the modules it builds build; the rules are those of :func:`precompute_support`
    and :func:`attention_support`. Never raises: a failure is the reason."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    if not hasattr(vllm_cls, "precompute_and_store_context_kv"):
        why = f"{vllm_cls.__name__} has no context-KV precompute"
        return why, why
    try:
        inner = sorted(_built(vllm_cls, DFlashQwen3Model), key=lambda c: c.__name__)
        if len(inner) > 1:
            precompute = f"{vllm_cls.__name__} builds several inner models ({', '.join(c.__name__ for c in inner)})"
        else:
            precompute = _rule_for_precompute(vllm_cls, inner[0] if inner else None)
    except Exception as exc:  # noqa: BLE001 - a reason, never a failure
        precompute = f"cannot read {vllm_cls.__name__} ({type(exc).__name__}: {exc})"
    try:
        attention = _rule_for_attention(_attention_modules(vllm_cls))
    except Exception as exc:  # noqa: BLE001
        attention = f"cannot read {vllm_cls.__name__} ({type(exc).__name__}: {exc})"
    return precompute, attention


def family_support() -> list[dict]:
    """Every draft architecture the plugin registers with this vLLM, with vLLM's class and
    why each operation would not be served (None: served). Never raises."""
    try:
        entries = candidate_architectures()
    except Exception as exc:  # noqa: BLE001
        return [{"architecture": None, "vllm_class": None, "precompute": f"cannot read vLLM's registry ({exc})",
                 "attention": f"cannot read vLLM's registry ({exc})"}]
    rows = []
    for arch, (module, name) in sorted(entries.items()):
        try:
            precompute, attention = class_support(getattr(importlib.import_module(module), name))
        except Exception as exc:  # noqa: BLE001 - a member whose module does not import here
            precompute = attention = f"cannot import {module}.{name} ({type(exc).__name__}: {exc})"
        rows.append({"architecture": arch, "vllm_class": f"{module}.{name}", "precompute": precompute,
                     "attention": attention})
    return rows
