"""Host side of the Triton draft attention: grid, partial buffers, launches."""

from __future__ import annotations

import math

import torch

from dflash_rocm.calls import AttentionCall
from dflash_rocm.platform import Platform, platform_for

from .attention_kernels import draft_attention_kernel, merge_segments_kernel
from .common import FP32_MATH, next_pow2
from .launch import launch
from .launch_config import AttentionLaunchConfig, default_attention_config


def attention_config_for(call: AttentionCall, platform: Platform | None = None) -> AttentionLaunchConfig:
    """The portable table's choice for ``call`` on ``platform`` (default: the call's
    device's; the ROCm backend brings its own table)."""
    return default_attention_config(
        platform or platform_for(call.device), num_seqs=call.num_seqs, query_len=call.query_len_bound,
        key_span=call.key_span_bound, num_q_heads=call.num_q_heads, num_kv_heads=call.num_kv_heads,
        head_dim=call.head_dim, fp8=call.is_fp8)


def run_draft_attention(call: AttentionCall, config: AttentionLaunchConfig | None = None) -> None:
    """Write ``call.out`` with the split-KV kernel (and the merge kernel if split)."""
    if call.num_tokens == 0:
        return
    config = config or attention_config_for(call)
    G = call.num_queries_per_kv
    if config.block_m < G:
        raise ValueError(f"block_m={config.block_m} cannot hold the {G} query heads of one KV head")
    block_q = config.queries_per_tile(G)
    num_tiles = call.num_tokens // block_q + call.num_seqs
    segments = config.num_segments
    device = call.device
    if segments > 1:
        part_acc = torch.empty(segments * call.num_tokens * call.num_q_heads * call.head_dim,
                               dtype=torch.float32, device=device)
        part_ml = torch.empty(segments * call.num_tokens * call.num_q_heads * 2, dtype=torch.float32,
                              device=device)
    else:
        part_acc = part_ml = call.out  # unused by the kernel
    sinks = call.sinks if call.sinks is not None else call.out
    k_scale = call.k_scale if call.k_scale is not None else call.out
    v_scale = call.v_scale if call.v_scale is not None else call.out
    q, kc, vc, out = call.query, call.key_cache, call.value_cache, call.out
    block_d = max(16, next_pow2(call.head_dim))
    launch(draft_attention_kernel, (num_tiles, call.num_kv_heads, segments), config,
           q, kc, vc, call.block_table, call.query_start_loc, call.seq_lens, out, part_acc, part_ml,
           sinks, k_scale, v_scale,
           call.num_seqs, call.num_tokens, call.block_size, call.scale * math.log2(math.e),
           call.sliding_window or 0,
           q.stride(0), q.stride(1), q.stride(2),
           kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
           vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
           call.block_table.stride(0), out.stride(0), out.stride(1), out.stride(2),
           HQ=call.num_q_heads, G=G, D=call.head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m,
           BLOCK_Q=block_q, BLOCK_N=config.block_n, NUM_SEGMENTS=segments, CAUSAL=call.causal,
           HAS_WINDOW=call.sliding_window is not None, HAS_SINKS=call.sinks is not None,
           IS_FP8=call.is_fp8, FP32_MATH=FP32_MATH)
    if segments > 1:
        launch(merge_segments_kernel, (call.num_tokens, call.num_q_heads), None,
               part_acc, part_ml, sinks, v_scale, out, call.num_tokens,
               out.stride(0), out.stride(1), out.stride(2),
               HQ=call.num_q_heads, D=call.head_dim, BLOCK_D=block_d, NUM_SEGMENTS=segments,
               SEG_BLOCK=next_pow2(segments), HAS_SINKS=call.sinks is not None, IS_FP8=call.is_fp8)
