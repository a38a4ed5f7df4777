"""The draft layers' attention through :func:`dflash_rocm.plan_draft_attention`: one plan
per step (the first draft layer's call), run by every draft layer.

vLLM keeps choosing the platform's attention backend, building its metadata, allocating
its cache and writing the query tokens' K/V (``do_kv_cache_update``); only the draft
layers' ``forward`` is replaced, by giving each draft layer's impl a subclass of its own
class. Target layers are untouched. Whatever dflash_rocm cannot read (an unknown cache
layout, per-sequence causality) goes back to the original ``forward``, logged once. Under
``auto``, draft layers on vLLM's CPU attention keep vLLM's kernel (see
:func:`handed_back_to_vllm`), and so does the context-KV precompute
(:func:`.model._left_to_vllms_cpu_ops`).
"""

from __future__ import annotations

import functools
import logging
import threading

import torch

from .. import dispatch
from ..plan import DraftAttentionPlan, PlanMismatch, plan_draft_attention
from ..contract import FP8_DTYPES
from ..dispatch import BackendUnavailable
from .cache_views import BACKENDS, backend_of, kv_cache_views

logger = logging.getLogger("dflash_rocm")
_warned: set[str] = set()


def warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
    base = self._dflash_base  # vLLM's impl class
    if attn_metadata is None:  # profiling and warm-up runs
        return base.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    reason = None
    causal = getattr(attn_metadata, "causal", self.dflash_causal)
    if args or any(v is not None for v in kwargs.values()):
        reason = "output quantisation (output_scale) is not a dflash_rocm feature"
    elif getattr(attn_metadata, "dynamic_causal", None) is not None or isinstance(causal, torch.Tensor):
        reason = "per-sequence causality (a causal tensor)"
    elif query.dtype in FP8_DTYPES:
        reason = "vLLM quantised the query to fp8 for this backend"
    views = None if reason else kv_cache_views(self, layer, kv_cache)
    if isinstance(views, str):
        reason = views
    if reason:
        warn_once(f"{base.__name__}:{reason}", "draft attention stays on vLLM's %s: %s", base.__name__, reason)
        return base.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    key_cache, value_cache = views
    n = attn_metadata.num_actual_tokens
    q = query[:n].view(n, self.num_heads, self.head_size)
    out = output[:n].view(n, self.num_heads, self.head_size)
    sinks = getattr(self, "sinks", None)
    bounds = _host_int(attn_metadata, "max_query_len"), _host_int(attn_metadata, "max_seq_len")

    def plan_this_layer() -> DraftAttentionPlan:
        return plan_draft_attention(
            q, key_cache, value_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, scale=self.scale, causal=bool(causal), sliding_window=self.dflash_sliding_window,
            sinks=sinks, k_scale=layer._k_scale, v_scale=layer._v_scale, out=out, max_query_len=bounds[0],
            max_seq_len=bounds[1], validate=False)  # vLLM built these indices; checking them would sync every layer

    try:
        kind = (bool(causal), self.dflash_sliding_window, self.scale, sinks is None, n, *bounds)
        plan = _STEP.plan(attn_metadata, kind, plan_this_layer)
        try:
            plan.run(q, key_cache, value_cache, out=out, sinks=sinks, k_scale=layer._k_scale, v_scale=layer._v_scale)
        except PlanMismatch:  # this layer's caches are laid out unlike the first layer's: its own plan
            plan_this_layer().run(q, key_cache, value_cache, out=out)
    except (BackendUnavailable, ValueError, TypeError) as exc:  # refused before anything is written
        warn_once(f"{base.__name__}:{type(exc).__name__}", "draft attention stays on vLLM's %s: %s", base.__name__, exc)
        return base.forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
    return output


class _StepPlans(threading.local):
    """The attention plans of the step being run. vLLM gives every draft layer of a KV-cache
    group the same metadata object for a step, so the first layer plans the batch (checks,
    backend choice, launch configuration) and the others only run (FlashInfer's plan/run
    split). A new metadata object, or new batch tensors in it, start a new step; the
    host bounds are part of each plan's key. Per thread, as vLLM's forward is."""

    def __init__(self):
        self.step, self.plans = (), {}

    def plan(self, metadata, key: tuple, make) -> DraftAttentionPlan:
        step = (metadata, metadata.block_table, metadata.query_start_loc, metadata.seq_lens)
        if len(step) != len(self.step) or any(a is not b for a, b in zip(step, self.step)):
            self.step, self.plans = step, {}
        found = self.plans.get(key)
        if found is None:
            found = self.plans[key] = make()
        return found


_STEP = _StepPlans()


def _host_int(metadata, name: str) -> int | None:
    """A host-side bound from vLLM's metadata, where this backend's metadata has one."""
    value = getattr(metadata, name, None)
    return int(value) if isinstance(value, int) else None


@functools.lru_cache(maxsize=None)
def draft_impl_class(base: type) -> type:
    """A direct subclass of vLLM's impl class with dflash_rocm's ``forward``: it adds no
    slots, so an existing impl object can take it (``__class__`` assignment)."""
    return type(f"DFlashRocm{base.__name__}", (base,), {"forward": _forward, "_dflash_base": base})


_VLLM_CPU_IMPL = "CPUAttentionBackendImpl"


def handed_back_to_vllm(impl) -> bool:
    """Whether ``auto`` leaves this layer's attention to vLLM: vLLM's CPU kernel (C++)
    serves every draft layer vLLM builds on CPU correctly (non-causal, causal, windows,
    sinks: its proposals equal dflash_rocm's) and, reading its own pages (K stored
    transposed), was measured faster than the cpu backend on them: inside vLLM on a 2-core
    CPU, the draft of ``dflash-rocm bench --vllm``, median 0.58 ms against 1.3 ms per
    draft-layer call. Naming a backend (``DFLASH_ROCM_BACKEND=cpu``) routes it anyway."""
    return (any(c.__name__ == _VLLM_CPU_IMPL for c in type(impl).__mro__)
            and dispatch.resolve_name(None) == "auto")


def restore(draft_model) -> None:
    """Give every draft layer vLLM's own attention back (the plugin steps aside)."""
    for decoder_layer in getattr(getattr(draft_model, "model", None), "layers", ()):
        impl = decoder_layer.self_attn.attn.impl
        base = getattr(type(impl), "_dflash_base", None)
        if base is not None:
            impl.__class__ = base


def install(draft_model) -> list[str]:
    """Route every draft layer's attention through dflash_rocm; returns the layer names.
    Logs one line saying which vLLM backend the layers got and whether dflash_rocm serves it."""
    names, backends = [], []
    for decoder_layer in draft_model.model.layers:
        module = decoder_layer.self_attn
        impl = module.attn.impl
        known = backend_of(impl)
        backends.append(known.name if known else type(impl).__name__)
        # vLLM keeps the flag on the backend class (v1/attention/backend.py), not on the impl.
        vllm_backend = getattr(module.attn, "attn_backend", None)
        if getattr(vllm_backend, "forward_includes_kv_cache_update", False):
            warn_once(type(impl).__name__, "draft attention stays on vLLM's %s: its forward writes the cache",
                       type(impl).__name__)
            continue
        if handed_back_to_vllm(impl):
            if _VLLM_CPU_IMPL not in _warned:
                _warned.add(_VLLM_CPU_IMPL)
                logger.info("draft attention stays on vLLM's %s: its CPU kernel serves draft layers correctly and "
                            "faster at draft sizes (DFLASH_ROCM_BACKEND=cpu routes it through dflash_rocm)",
                            type(impl).__name__)
            continue
        impl.__class__ = draft_impl_class(type(impl))
        # SPEC.md's window W counts the query's own position (HF meaning), as the draft config does.
        impl.dflash_sliding_window = module.sliding_window
        impl.dflash_causal = bool(module.causal)
        names.append(module.attn.layer_name)
    logger.info("draft attention: %d/%d layers via dflash_rocm (%s)", len(names), len(backends),
                ", ".join(f"{name}: {_served(name)}" for name in dict.fromkeys(backends)))
    return names


def _served(name: str) -> str:
    known = next((b for b in BACKENDS if b.name == name), None)
    return known.served if known else "unknown layout, stays on vLLM"
