"""The DFlash draft model class the plugin registers for ``DFlashDraftModel``.

A subclass of vLLM's ``DFlashQwen3ForCausalLM`` (the proposer checks ``isinstance``):
vLLM builds and loads it as usual; afterwards its context-KV precompute and its draft
layers' attention go through dflash_rocm. Everything vLLM already knows (the fused K/V
weight it stacks at load time, cache scales, per-layer causality, the query limit) is
taken from the loaded model, never recomputed.
"""

from __future__ import annotations

import logging

import torch
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

from .. import dispatch
from ..plan import ContextKVPlan, plan_context_kv
from ..contract import FP8_DTYPES
from ..ops import ATTENTION
from ..ops.attention import AttentionSpec
from ..platform import platform_for
from ..weights import ContextKVWeights
from . import attention
from .cache_views import kv_cache_views
from .compat import incompatibility, missing_internals, vllm_version

logger = logging.getLogger("dflash_rocm")


def context_kv_weights(model) -> ContextKVWeights | str:
    """vLLM's loaded draft tensors as ContextKVWeights, or why they cannot be used."""
    if getattr(model, "_fused_kv_weight", None) is None:
        methods = {type(p.quant_method).__name__ for p in getattr(model, "_context_qkv_projs", [])}
        return f"the draft's K/V projections are quantised ({', '.join(sorted(methods)) or 'unknown'})"
    return ContextKVWeights(
        hidden_norm_weight=model._hidden_norm_weight, kv_weight=model._fused_kv_weight,
        kv_bias=model._fused_kv_bias, k_norm_weight=model._k_norm_weights,
        cos_sin_cache=model._rope_cos_sin_cache, is_neox=bool(model._rope_is_neox),
        eps=float(model._rms_norm_eps), v_scale=model.layers[0].self_attn.v_scale,
        num_layers=model._num_attn_layers, num_kv_heads=model._num_kv_heads, head_dim=model._head_dim)


def _layer_cache(attn_layer) -> torch.Tensor:
    cache = attn_layer.kv_cache
    return cache[0] if isinstance(cache, (list, tuple)) else cache


class DFlashRocmQwen3ForCausalLM(DFlashQwen3ForCausalLM):
    """vLLM's DFlash draft with both hot operations dispatched through dflash_rocm."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        problem = incompatibility()
        if problem is None and (missing := missing_internals()):
            problem = f"vLLM {vllm_version()} lacks {', '.join(missing)}"
        if problem:
            raise RuntimeError(f"dflash_rocm cannot serve this DFlash draft: {problem}. "
                               "Set DFLASH_ROCM_VLLM=0 to run vLLM's own DFlash path.")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._dflash_weights: ContextKVWeights | None = None
        self._dflash_views_key: tuple | None = None
        self._dflash_plans: dict[bool, ContextKVPlan | str] = {}  # writes caches -> plan (or why not)
        self._dflash_vllm_config = vllm_config
        self._dflash_attention_layers = attention.install(self)
        _configure_backends(vllm_config, self.get_draft_attn_causal(), _model_device(vllm_config))

    def load_weights(self, weights):
        loaded = super().load_weights(weights)
        found = context_kv_weights(self.model)
        if isinstance(found, str):
            logger.warning("context-KV precompute stays on vLLM's path: %s", found)
        else:
            self._dflash_weights = found
            self._dflash_plans = {}  # new weights: new plans
            logger.info("context-KV precompute of this draft runs through dflash_rocm (%d layers)",
                        found.num_layers)
        _warm_up(self, self._dflash_vllm_config)
        return loaded

    def _context_kv_plan(self, writes: bool) -> ContextKVPlan | str:
        """The precompute's plan (weights, every layer's cache views, fp8 scales taken once),
        or why the caches cannot be read; made again only when vLLM rebinds its caches."""
        if not writes:
            plan = self._dflash_plans.get(False)
            if plan is None:
                plan = self._dflash_plans[False] = plan_context_kv(self._dflash_weights, None, None)
            return plan
        layers = self.model._attn_layers
        caches = [_layer_cache(a) for a in layers]
        key = tuple((c.data_ptr(), tuple(c.shape), c.stride()) for c in caches)
        if self._dflash_views_key != key or True not in self._dflash_plans:
            views = [kv_cache_views(a.impl, a, c) for a, c in zip(layers, caches)]
            bad = next((v for v in views if isinstance(v, str)), None)
            if bad:
                plan = bad
            else:
                key_caches, value_caches = [v[0] for v in views], [v[1] for v in views]
                k_scales = v_scales = None
                if key_caches[0].dtype in FP8_DTYPES:  # vLLM sets the scales at load time
                    k_scales = torch.cat([a._k_scale.reshape(1).float() for a in layers])
                    v_scales = torch.cat([a._v_scale.reshape(1).float() for a in layers])
                plan = plan_context_kv(self._dflash_weights, key_caches, value_caches, k_scales=k_scales,
                                       v_scales=v_scales)
            self._dflash_plans[True], self._dflash_views_key = plan, key
        return self._dflash_plans[True]

    def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
        if self._dflash_weights is None:
            return super().precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)
        plan = self._context_kv_plan(context_slot_mapping is not None)
        if isinstance(plan, str):
            attention._warn_once("precompute:" + plan, "context-KV precompute stays on vLLM's path: %s", plan)
            return super().precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)
        # vLLM built the positions and slots; checking them would sync with the device.
        plan.run(context_states, context_positions, context_slot_mapping, validate=False)


def _model_device(vllm_config) -> torch.device:
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


def _configure_backends(vllm_config, layer_causal, device: torch.device) -> None:
    """DFlash queries never exceed num_speculative_tokens + 1: pass that and the engine's
    limits to the backends (the ROCm backend bounds its compiled query capacity and tuning
    space by them; DFLASH_ROCM_QUERY_LIMIT still wins)."""
    spec = vllm_config.speculative_config
    dispatch.configure(
        device,
        query_limit=(spec.num_speculative_tokens + 1) if spec and spec.num_speculative_tokens else None,
        batch_limit=int(vllm_config.scheduler_config.max_num_seqs),
        max_model_len=int(vllm_config.model_config.max_model_len),
        layer_causal=tuple(bool(c) for c in layer_causal))


def attention_specs(draft_model, vllm_config, device: torch.device) -> set[AttentionSpec]:
    """The distinct attention setups of the draft's layers."""
    dtype = vllm_config.model_config.dtype
    cache_dtype = dtype
    if str(vllm_config.cache_config.cache_dtype).startswith("fp8"):
        info = platform_for(device).arch_info
        cache_dtype = info.fp8_dtype if info and info.fp8_dtype else torch.float8_e4m3fn
    specs = set()
    for decoder_layer in draft_model.model.layers:
        module = decoder_layer.self_attn
        specs.add(AttentionSpec(module.num_heads, module.num_kv_heads, module.head_dim,
                                int(vllm_config.cache_config.block_size), dtype, cache_dtype,
                                bool(module.causal), module.sliding_window,
                                module.attention_sink_bias is not None))
    return specs


def _warm_up(draft_model, vllm_config) -> None:
    """Backends' startup work (ROCm: tuning, on by default for RDNA) for exactly what this
    draft runs, before serving starts. A failure costs the optimisation, never the server."""
    device = draft_model.model._hidden_norm_weight.device
    for spec in attention_specs(draft_model, vllm_config, device):
        dispatch.warm_up(ATTENTION, spec, device)
