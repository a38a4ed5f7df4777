"""Host side of the Triton draft attention: a call structure's plan (grids, constexprs,
scalar arguments, partial-buffer sizes, the merge decision), made from its planning
record (:mod:`dflash_rocm.planning`), and the launches of each call."""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from dflash_rocm.backend import Runner
from dflash_rocm.capture import CaptureSupport
from dflash_rocm.ops import ATTENTION
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.paged import memory_of
from dflash_rocm.planning import PlanningRecord, record_for
from dflash_rocm.platform import Platform

from .attention_kernels import draft_attention_kernel, merge_segments_kernel
from .common import fp32_math, next_pow2, packed_layout
from .counters import PlanScratch
from .launcher import LaunchPlan, compiler_options
from .launch_config import (AttentionLaunchConfig, default_attention_config, last_merge_chunk, merge_load_segments,
                            merge_program_rows, tail_merge_fits)


def attention_config_for(call: AttentionCall, platform: Platform) -> AttentionLaunchConfig:
    """The portable table's choice for ``call`` (or its facts) on ``platform`` (the ROCm
    backend brings its own table)."""
    return default_attention_config(
        platform, num_seqs=call.num_seqs, query_len=call.query_len_bound,
        key_span=call.key_span_bound, num_q_heads=call.num_q_heads, num_kv_heads=call.num_kv_heads,
        head_dim=call.head_dim, fp8=call.is_fp8)


def merge_chunk(config: AttentionLaunchConfig, block_d: int) -> int:
    """Segments per load of the last segment's merge, for the config's wave size
    (:func:`last_merge_chunk`). A merge program's: :func:`merge_load_segments`."""
    return last_merge_chunk(config.block_m, block_d, config.num_warps, config.wave_size)


def stride_unit(cache) -> int:
    """The unit, in elements, of the strides the kernel takes for ``cache`` (see
    ``attention_kernels``): 16 bytes for a cache packed along one axis into contiguous
    runs of whole 16-byte units at 16-byte aligned offsets (vLLM's ROCM_ATTN pages: x-packed
    K, interleaved V), so that the compiler can prove each run aligned; else 1."""
    tensor, (s0, s1, s2, s3, s4, s5), rows, dims = packed_layout(cache)
    if (rows > 1) == (dims > 1):  # plain, or packed both ways
        return 1
    unit = 16 // tensor.element_size()
    pack, in_pack = (rows, s2) if rows > 1 else (dims, s5)
    aligned = in_pack == 1 and pack % unit == 0 and tensor.data_ptr() % 16 == 0
    return unit if aligned and all(s % unit == 0 for s in (s0, s1, s3, s4)) else 1


def cache_addressing(cache) -> tuple[torch.Tensor, tuple, dict]:
    """(tensor, six strides, constexprs) of a plain or packed cache for the kernel: the
    in-pack stride of an axis that is not packed is None (a constexpr, not a launch
    argument); the block, row and dim strides come in units of ``UNIT`` elements."""
    tensor, (s0, s1, s2, s3, s4, s5), rows, dims = packed_layout(cache)
    unit = stride_unit(cache)
    strides = (s0 // unit, s1 // unit, s2 if rows > 1 else None, s3, s4 // unit, s5 if dims > 1 else None)
    return tensor, strides, dict(ROW_PACK=rows, DIM_PACK=dims, UNIT=unit)


@dataclass(frozen=True)
class AttentionPlan(Runner):
    """Everything about launching one call structure with one configuration that does not
    change from call to call: grids, constexprs, strides and the other scalar arguments,
    the partials (kept: :class:`~.counters.PlanScratch`). Calls then pass only their tensors.
    The partials are made on a stream's first call: captured, they serve that graph alone."""

    capture_support = CaptureSupport.AFTER_EAGER_CALL
    config: AttentionLaunchConfig
    main: LaunchPlan
    merge: LaunchPlan | None  # a split tile's merge, when the plan gives it a second launch
    scratch: PlanScratch  # the partials (the output's dtype, and float32 log-sum-exps) and arrival counters

    def run(self, call: AttentionCall) -> None:
        out = call.out  # stands in for the scratch a call that is not split leaves unread
        part_out, part_lse, counters = self.scratch.get(out.device)
        if part_out is None:
            part_out = part_lse = out
        if counters is None:
            counters = out
        sinks = call.sinks if call.sinks is not None else out
        k_scale = call.k_scale if call.k_scale is not None else out
        v_scale = call.v_scale if call.v_scale is not None else out
        self.main.launch(q_ptr=call.query, k_cache_ptr=memory_of(call.key_cache),
                         v_cache_ptr=memory_of(call.value_cache), block_table_ptr=call.block_table,
                         qsl_ptr=call.query_start_loc, seq_lens_ptr=call.seq_lens, out_ptr=out, part_out_ptr=part_out,
                         part_lse_ptr=part_lse, counters_ptr=counters, sinks_ptr=sinks, k_scale_ptr=k_scale,
                         v_scale_ptr=v_scale)
        if self.merge is not None:
            self.merge.launch(part_out_ptr=part_out, part_lse_ptr=part_lse, qsl_ptr=call.query_start_loc,
                              seq_lens_ptr=call.seq_lens, sinks_ptr=sinks, out_ptr=out)


def plan_attention(record: PlanningRecord, call: AttentionCall, config: AttentionLaunchConfig) -> AttentionPlan:
    """The plan of the call structure ``record`` holds (``call``: its facts) under
    ``config``, its merge decided
    here once: the configuration's, unless merger programs are switched off
    (``DFLASH_ROCM_TAIL_MERGE``) or could wait on segments that find no room (then a
    second launch)."""
    G = call.num_queries_per_kv
    if config.block_m < G:
        raise ValueError(f"block_m={config.block_m} cannot hold the {G} query heads of one KV head")
    block_q = config.queries_per_tile(G)
    one_tile = call.query_len_bound <= block_q  # every request's query block is one tile
    num_tiles = call.num_seqs if one_tile else call.num_tokens // block_q + call.num_seqs
    segments = config.num_segments
    split = segments > 1
    rows = merge_program_rows(config, G)
    merge = config.merge
    if merge == "tail" and (not record.switches.tail_merge or call.device.type == "cuda" and not tail_merge_fits(
            num_tiles * call.num_kv_heads * (config.block_m // rows), record.platform)):
        merge = "launch"  # switched off, or too many mergers to be sure the segments they wait on progress
    # (The interpreter runs programs one at a time in grid order, a tile's segments before
    # its mergers; a captured launch does not run.)
    mergers = config.block_m // rows if split and merge == "tail" else 0
    q, out = call.query, call.out
    _, k_strides, k_pack = cache_addressing(call.key_cache)
    _, v_strides, v_pack = cache_addressing(call.value_cache)
    block_d = max(16, next_pow2(call.head_dim))
    tiles = dict(G=G, D=call.head_dim, BLOCK_D=block_d, BLOCK_M=config.block_m, BLOCK_Q=block_q,
                 BLOCK_N=config.block_n, ONE_TILE=one_tile, CAUSAL=call.causal,
                 HAS_WINDOW=call.sliding_window is not None, HAS_SINKS=call.sinks is not None)
    # the kernels' parameters by name (see attention_kernels)
    segment_args = dict(num_seqs=call.num_seqs, num_tokens=call.num_tokens, window=call.sliding_window or 0,
                        num_segments=segments, min_segment_keys=config.min_segment_keys)
    out_strides = dict(stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2))
    counters = 0 if not split or merge == "launch" else num_tiles * call.num_kv_heads
    # the plan's own scratch (PlanScratch): specialised once
    kept_scratch = (("part_out_ptr", "part_lse_ptr") if split else ()) + (("counters_ptr",) if counters else ())
    cache_strides = {f"stride_{kind}{axis}": stride for kind, strides in (("k", k_strides), ("v", v_strides))
                     for axis, stride in zip(("b", "s", "s_in", "h", "d", "d_in"), strides)}
    main = LaunchPlan(
        draft_attention_kernel, (num_tiles, call.num_kv_heads, segments + mergers), compiler_options(config),
        ("q_ptr", "k_cache_ptr", "v_cache_ptr", "block_table_ptr", "qsl_ptr", "seq_lens_ptr", "out_ptr",
         "part_out_ptr", "part_lse_ptr", "counters_ptr", "sinks_ptr", "k_scale_ptr", "v_scale_ptr"),
        dict(segment_args, scale_log2=call.scale * math.log2(math.e), stride_qt=q.stride(0), stride_qh=q.stride(1),
             stride_qd=q.stride(2), **cache_strides, stride_bt=call.block_table.stride(0), **out_strides),
        dict(HQ=call.num_q_heads, BLOCK_SIZE=call.block_size, SPLIT=split, MERGE_IN_KERNEL=split and merge == "last",
             MERGERS=mergers,
             MERGE_CHUNK=merge_load_segments(rows, segments) if mergers else merge_chunk(config, block_d),
             IS_FP8=call.is_fp8, FP32_MATH=fp32_math(q.dtype),
             FP16_DOTS=config.fp16_dots and call.is_fp8 and q.dtype in (torch.float16, torch.bfloat16)
             and not fp32_math(q.dtype), K_AT_LOAD=config.fp8_k_at_load and call.is_fp8 and not fp32_math(q.dtype),
             **tiles,
             **{f"K_{k}": v for k, v in k_pack.items()}, **{f"V_{k}": v for k, v in v_pack.items()}),
        kept=kept_scratch)
    second = None
    if split and merge == "launch":
        second = LaunchPlan(
            merge_segments_kernel, (num_tiles, call.num_kv_heads, config.block_m // rows),
            compiler_options(config),
            ("part_out_ptr", "part_lse_ptr", "qsl_ptr", "seq_lens_ptr", "sinks_ptr", "out_ptr"),
            dict(segment_args, **out_strides),
            dict(HQ=call.num_q_heads, ROWS=rows, MERGE_CHUNK=merge_load_segments(rows, segments), **tiles),
            kept=("part_out_ptr", "part_lse_ptr"))
    partials = ((segments * call.num_tokens * call.num_q_heads * call.head_dim if split else 0, out.dtype),
                (segments * call.num_tokens * call.num_q_heads if split else 0, torch.float32))
    return AttentionPlan(config, main, second, PlanScratch(partials, counters))


def attention_runner(record: PlanningRecord, call: AttentionCall, config: AttentionLaunchConfig) -> Runner:
    """What runs every call of the structure ``record`` holds (``call``: its facts) under
    ``config``: its plan (nothing, for a batch without queries)."""
    if call.num_tokens == 0:
        return NO_QUERIES
    return plan_attention(record, call, config)


class _NoQueries(Runner):
    """A batch without queries: nothing to write."""

    __slots__ = ()
    capture_support = CaptureSupport.ALWAYS

    def run(self, call: AttentionCall) -> None:
        return None


NO_QUERIES = _NoQueries()


def run_draft_attention(call: AttentionCall, config: AttentionLaunchConfig | None = None) -> None:
    """Write ``call.out`` under ``config`` (default: the portable table's), planned for
    this call alone: for tools and tests that pick a configuration. Served calls go
    through dispatch's plan cache."""
    record, facts = record_for(ATTENTION.name, "triton", call)
    attention_runner(record, facts, config or attention_config_for(facts, record.platform)).run(call)
