"""Host side of the fused context-KV precompute: derived weights, the per-layer cache
table, and one launch for all layers (a second only to sum a split hidden size while a
CUDA graph is captured with too few arrival counters)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from dflash_rocm import capture
from dflash_rocm.backend import Runner
from dflash_rocm.derived import DerivedCache
from dflash_rocm.ops import PRECOMPUTE
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.paged import PackedCache
from dflash_rocm.planning import PlanningRecord, record_for
from dflash_rocm.platform import Platform
from dflash_rocm.weights import ContextKVWeights

from .common import INTERPRETING, TL_DTYPES, fp32_math, next_pow2, packed_layout
from .counters import PlanScratch
from .launcher import LaunchPlan, compiler_options
from .launch_config import PrecomputeLaunchConfig, default_precompute_config
from .precompute_kernels import META_COLS, context_kv_kernel

logger = logging.getLogger("dflash_rocm")


@dataclass(frozen=True)
class FusedKVWeights:
    """The K/V rows with their layer's hidden norm weight folded in and each K head's rows
    permuted so RoPE pairs are adjacent; bias permuted alike; float32 norm weight and cos/sin.

    fp8 rows cannot take the norm weight without being quantized again: they are kept as
    they are (permuted alike, still fp8, half the bytes of bf16 rows), ``row_scale`` holds
    their weight scales, and the kernel applies the hidden norm weight to the states it
    loads. That weight sits in ``scale_table`` right before the row scales (``row_scale``
    is a view of its tail), so the kernel finds it at ``row_scale_ptr - NORM_ROWS * H``: the
    float rows' kernel keeps its parameters, and its compiled code, unchanged."""

    weight: torch.Tensor  # [L*2*Hk*D, H], states dtype (fp8 rows: their fp8 dtype), contiguous
    row_scale: torch.Tensor  # [L*2*Hk*D] float32: the power of two each folded row was divided by (fp8: its scale)
    bias: torch.Tensor | None  # [L*2*Hk*D] float32
    k_norm: torch.Tensor  # [L, D] float32, original dim order
    cos_sin: torch.Tensor  # [max_position, R] float32, contiguous
    # fp8 rows: float32 [(1 or L) * H + L*2*Hk*D], the hidden norm weight's rows then the row scales
    scale_table: torch.Tensor | None = None


def rope_pair_order(head_dim: int, rotary_dim: int, is_neox: bool, device: torch.device) -> torch.Tensor:
    """``order[c]`` = the original dim stored in column ``c``: neox pairs ``(i, i + R/2)``
    become columns ``(2i, 2i + 1)``; GPT-J pairs and pass-through dims are already adjacent.
    Made on ``device`` (no host data crosses: a graph being captured may record it)."""
    order = torch.arange(head_dim, device=device)
    if is_neox:
        half = rotary_dim // 2
        i = torch.arange(half, device=device)
        order[0:rotary_dim:2] = i
        order[1:rotary_dim:2] = i + half
    return order


_FUSED = DerivedCache()


def fused_weights(w: ContextKVWeights) -> FusedKVWeights:
    """This backend's layout of ``w``, rebuilt whenever a source tensor changes."""
    return _FUSED.get(derived_sources(w), (w.num_layers, w.num_kv_heads, w.head_dim, w.is_neox), _fuse, w)


def derived_sources(w: ContextKVWeights) -> tuple:
    """The tensors :func:`fused_weights` derives from."""
    return (w.kv_weight, w.hidden_norm_weight, w.kv_bias, w.k_norm_weight, w.cos_sin_cache, w.kv_weight_scale)


def _fuse(w: ContextKVWeights) -> FusedKVWeights:
    L, Hk, D = w.num_layers, w.num_kv_heads, w.head_dim
    order = rope_pair_order(D, w.rotary_dim, w.is_neox, w.device)
    table = None
    if w.quantized:  # fp8 rows stay fp8 (permuted as bytes: torch indexes no fp8); the norm applies to the states
        rows = w.kv_weight.detach().view(torch.uint8).clone().view(L, 2, Hk, D, -1)
        norm = w.hidden_norm_weight.detach().float().reshape(-1)
        table = torch.cat((norm, w.row_scales().float()))
        row_scale = table[norm.numel():].view(L, 2, Hk, D)
    else:
        rows, row_scale = w.folded_kv_weight()
        rows, row_scale = rows.view(L, 2, Hk, D, -1), row_scale.view(L, 2, Hk, D)
    rows[:, 0] = rows[:, 0, :, order]
    row_scale[:, 0] = row_scale[:, 0, :, order]
    bias = None
    if w.kv_bias is not None:
        bias = w.kv_bias.float().view(L, 2, Hk, D).clone()
        bias[:, 0] = bias[:, 0, :, order]
        bias = bias.reshape(-1).contiguous()
    rows = rows.reshape(L * 2 * Hk * D, -1)
    return FusedKVWeights(weight=(rows.view(w.dtype) if w.quantized else rows.to(w.dtype)).contiguous(),
                          row_scale=row_scale.reshape(-1) if w.quantized else row_scale.reshape(-1).contiguous(),
                          bias=bias, k_norm=w.k_norm_weight.float().contiguous(),
                          cos_sin=w.cos_sin_cache.float().contiguous(), scale_table=table)


# Smallest normal exponent of each fp8 cache format (e4m3fn bias 7, e4m3fnuz bias 8).
_FP8_MIN_NORMAL_EXP = {torch.float8_e4m3fn: -6, torch.float8_e4m3fnuz: -7}

_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_KEPT = 32
# Callers on several threads (a server's workers) share the tables: a lookup's
# move_to_end must not meet another's eviction of the same key. The table is built
# outside the lock; two threads building the same one keep the first.
_TABLES_LOCK = threading.Lock()


def cache_table(call: PrecomputeCall) -> torch.Tensor:
    """int64 ``[L, META_COLS]`` per-layer cache addresses, slot-mapping rows and strides on
    the device. It depends only on the caches and on which layers are written, so a table
    built once is reused (vLLM's caches never move): only the first call for a cache set
    copies host data to the device. While a CUDA graph is captured, which cannot record a
    copy from host memory, a table not built yet is written by one fill per entry, which
    the graph repeats at every replay, and is not kept (it holds nothing before the first
    replay); one eager call for the cache set before capture avoids that."""
    rows = []
    written = call.written_layers
    for layer in range(call.num_layers):
        if layer not in written:
            rows.append((0, 0, -1) + (0,) * (META_COLS - 3))
            continue
        kc, k_strides, _, _ = packed_layout(call.key_caches[layer])
        vc, v_strides, _, _ = packed_layout(call.value_caches[layer])
        rows.append((kc.data_ptr(), vc.data_ptr(), written.index(layer), call.key_caches[layer].shape[1],
                     *k_strides, *v_strides))
    key = (call.device, tuple(rows))
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is not None:
            _TABLES.move_to_end(key)
            return table
    if capture.graph_capturing(call.device):  # not a keep-or-not: a capture cannot record the host copy below
        return _table_in_graph(rows, call.device)
    table = torch.tensor(rows, dtype=torch.int64).to(call.device, non_blocking=True)
    with _TABLES_LOCK:
        table = _TABLES.setdefault(key, table)
        _TABLES.move_to_end(key)
        if len(_TABLES) > _TABLES_KEPT:
            _TABLES.popitem(last=False)
    return table


def _table_in_graph(rows: list[tuple], device: torch.device) -> torch.Tensor:
    """The cache table written by fills recorded into the graph being captured (see
    :func:`cache_table`)."""
    logger.warning("the precompute's cache table for these caches is first needed inside a CUDA graph capture: "
                   "the graph refills it at every replay (%d fills); run one eager call before capturing",
                   len(rows) * META_COLS)
    table = torch.empty(len(rows), META_COLS, dtype=torch.int64, device=device)
    for i, row in enumerate(rows):
        for j, value in enumerate(row):
            table[i, j].fill_(value)
    return table


def shared_slot_layer(call: PrecomputeCall) -> int | None:
    """The first written layer when every written layer shares its slot mapping (one
    object: validation makes equal views of one mapping one tensor, as vLLM 0.34's
    per-layer slices of a group's row are), passed as is, so a call inside a CUDA graph
    adds no copy; else None (:func:`stacked_slots`)."""
    written = call.written_layers
    if written and all(call.slot_mappings[i] is call.slot_mappings[written[0]] for i in written):
        return written[0]
    return None


def stacked_slots(call: PrecomputeCall) -> torch.Tensor | None:
    """The written layers' different mappings as the kernel reads them when they are not
    shared: row ``r`` of the table's written layer ``r`` at ``r * num_tokens``, stacked on
    the device (no host data), widened to int64 when their dtypes differ. None: no layer
    is written."""
    slots = [call.slot_mappings[i] for i in call.written_layers]
    if not slots:
        return None
    if len({s.dtype for s in slots}) > 1:
        slots = [s.to(torch.int64) for s in slots]
    return torch.stack(slots)


# The kernel's NoPE layers are the bits of one int64 constant.
MAX_NOPE_LAYER = 62


def variant_constexprs(call: PrecomputeCall) -> dict:
    """The DFlash family variants' switches: off (the kernels' defaults, which compile to the
    kernel without them) unless the weights ask for a variant. Passed always: the compiled
    launcher takes every constexpr."""
    w = call.weights
    rounds = w.round_k_before_rope and call.dtype != torch.float32  # rounding to float32 changes nothing
    return dict(NOPE_LAYERS=sum(1 << layer for layer in w.nope_layers),
                K_ROUND_DTYPE=TL_DTYPES[call.dtype] if rounds else None)


def weight_constexprs(w: ContextKVWeights) -> dict:
    """The fp8-row switches: off (the kernel's defaults, which compile to the kernel
    without them) for float rows. Passed always: the compiled launcher takes every constexpr."""
    return dict(FP8_WEIGHTS=w.quantized,
                NORM_ROWS=(w.num_layers if w.per_layer_hidden_norm else 1) if w.quantized else 0)


def precompute_config_for(call: PrecomputeCall, platform: Platform) -> PrecomputeLaunchConfig:
    """The portable table's choice for ``call`` (or its facts) on ``platform``."""
    w = call.weights
    return default_precompute_config(platform, num_tokens=call.num_tokens,
                                     hidden=w.hidden_size, num_heads_total=2 * w.num_layers * w.num_kv_heads,
                                     head_dim=w.head_dim)


def aligned_runs(cache: torch.Tensor | PackedCache) -> bool:
    """Whether the cache stores each row's head dim in contiguous runs (all of it, or each
    pack of ``C`` dims: vLLM's x-packed K) of whole 16-byte units that start 16-byte
    aligned (base address and every stride but the run's a multiple of 16 bytes): such a
    run loads or stores as vectors."""
    tensor, (s0, s1, s2, s3, s4, s5), rows, dims = packed_layout(cache)
    size = tensor.element_size()
    run_stride, outer = (s5, (s0, s1, s3, s4)) if dims > 1 else (s4, (s0, s1, s3))
    outer += (s2,) if rows > 1 else ()
    return (run_stride == 1 and tensor.data_ptr() % 16 == 0 and (dims == 1 or dims * size % 16 == 0)
            and all(s * size % 16 == 0 for s in outer))


def shared_block_size(call: PrecomputeCall) -> int:
    """The block size every written cache shares (the kernel then divides by a constant),
    or 0 when they differ (it reads each layer's from the cache table)."""
    sizes = {call.key_caches[layer].shape[1] for layer in call.written_layers}
    return sizes.pop() if len(sizes) == 1 else 0


def slots_fit_int32(call: PrecomputeCall) -> bool:
    """Whether every written cache has fewer than 2**31 slots (so slot arithmetic is 32-bit)."""
    return all(c.shape[0] * c.shape[1] < 2 ** 31 for layer in call.written_layers
               for c in (call.key_caches[layer], call.value_caches[layer]))


class PrecomputePlan(Runner):
    """Everything about launching one call structure (caches included: their addresses are
    part of it) with one configuration that does not change from call to call: the cache
    table, grids, constexprs and scalar arguments, the scratch. Calls then pass only their
    tensors; the derived weights are checked by their sources' versions (see :meth:`fused`).
    The cache table and the scratch are made by the first call: captured, they serve that
    graph alone."""

    __slots__ = ("config", "main", "atomic_sum", "table", "scratch", "slot_layer", "_fused")
    capture_support = capture.CaptureSupport.AFTER_EAGER_CALL

    def __init__(self, config: PrecomputeLaunchConfig, main: LaunchPlan, atomic_sum: bool, table: torch.Tensor,
                 scratch: PlanScratch, slot_layer: int | None):
        self.config, self.main, self.atomic_sum, self.table = config, main, atomic_sum, table
        self.scratch = scratch  # the split parts' sums and arrival counters
        self.slot_layer = slot_layer  # the one written layer whose mapping every layer shares (None: stacked)
        self._fused: tuple = (None, None, None)  # (weights, their sources' versions, fused_weights(weights))

    def fused(self, w: ContextKVWeights) -> FusedKVWeights:
        """:func:`fused_weights` of ``w``, checked by one test: ``w`` is the weights last
        seen and no source tensor's version moved since (an in-place update, a reload's
        refill, bumps it; then :func:`fused_weights` refills or rebuilds them)."""
        seen, versions, fused = self._fused
        now = source_versions(w)
        if seen is w and versions == now:
            return fused
        fused = fused_weights(w)  # never derived inside a capture (DerivedCache refuses): kept as found
        self._fused = (w, now, fused)
        return fused

    def run(self, call: PrecomputeCall):
        """Write the caches (and return ``(k, v)`` iff the call asks)."""
        out = _outputs(call) if call.return_kv else None
        self.launch(call, *(out or (None, None)))
        return out

    def launch(self, call: PrecomputeCall, out_k, out_v) -> None:
        """The launch for ``call``, returning K/V into ``out_k``/``out_v`` when given."""
        fused = self.fused(call.weights)
        dummy = call.states  # stands in for every optional tensor the kernel leaves unread
        if self.slot_layer is not None:
            slots = call.slot_mappings[self.slot_layer]
        else:
            slots = stacked_slots(call)
        part_acc, part_ss, counters = self.scratch.get(call.states.device)
        self.main.launch(
            x_ptr=call.states, w_ptr=fused.weight, row_scale_ptr=fused.row_scale,
            part_acc_ptr=part_acc if part_acc is not None else dummy,
            part_ss_ptr=part_ss if part_ss is not None else dummy,
            counters_ptr=counters if counters is not None else dummy, positions_ptr=call.positions,
            bias_ptr=fused.bias if fused.bias is not None else dummy, k_norm_ptr=fused.k_norm,
            cos_sin_ptr=fused.cos_sin, meta_ptr=self.table,
            slots_ptr=slots if slots is not None else call.positions,  # positions: never read
            k_scales_ptr=call.k_scales if call.k_scales is not None else dummy,
            v_scales_ptr=call.v_scales if call.v_scales is not None else dummy,
            out_k_ptr=out_k if out_k is not None else dummy, out_v_ptr=out_v if out_v is not None else dummy)


def source_versions(w: ContextKVWeights) -> tuple:
    """The version counters of the tensors :func:`fused_weights` derives from."""
    return tuple([None if t is None else t._version for t in derived_sources(w)])


def plan_precompute(record: PlanningRecord, call: PrecomputeCall, config: PrecomputeLaunchConfig) -> PrecomputePlan:
    """The plan of the call structure ``record`` holds (``call``: its facts) under
    ``config``: the grid split (the last part of a split tile to arrive sums the parts) and
    whether the parts add into one atomic sum, decided here once."""
    grid_t = -(-call.num_tokens // config.block_t)
    tiles = grid_t * 2 * call.weights.num_layers * call.weights.num_kv_heads // config.heads
    whole = min(config.whole_tiles, tiles) if config.split_k > 1 else tiles
    split_k = config.split_k if whole < tiles else 1
    # Parts add into one sum unless torch was asked for bitwise-reproducible results (fp32
    # atomics add in arrival order); the merge then reads one tile instead of split_k.
    atomic_sum = split_k > 1 and not record.deterministic
    w = call.weights
    N, L, Hk, D = call.num_tokens, w.num_layers, w.num_kv_heads, w.head_dim
    dtype = call.dtype
    (k_rows, k_dims), (v_rows, v_dims) = call.packing or ((1, 1), (1, 1))
    cache_dtype = call.cache_dtype or dtype
    rows = 2 * L * Hk // config.heads  # head rows, or pairs of them
    block_d = max(16, next_pow2(D))
    slot_layer = shared_slot_layer(call)
    x = call.states
    split_tiles = grid_t * rows - whole if split_k > 1 else 0
    parts = split_tiles * (1 if atomic_sum else split_k) * config.block_t  # rows of the partials
    # the tensors the plan (and the fused weights it checks) keeps: specialised once
    kept = ("w_ptr", "row_scale_ptr", "k_norm_ptr", "cos_sin_ptr", "meta_ptr") + (
        ("bias_ptr",) if w.kv_bias is not None else ()) + (
        ("part_acc_ptr", "part_ss_ptr", "counters_ptr") if split_tiles else ())
    main = LaunchPlan(
        context_kv_kernel, (whole + split_tiles * split_k,), compiler_options(config),
        # the kernel's tensor parameters, which PrecomputePlan.launch passes by name
        ("x_ptr", "w_ptr", "row_scale_ptr", "part_acc_ptr", "part_ss_ptr", "counters_ptr", "positions_ptr",
         "bias_ptr", "k_norm_ptr", "cos_sin_ptr", "meta_ptr", "slots_ptr", "k_scales_ptr", "v_scales_ptr",
         "out_k_ptr", "out_v_ptr"),
        dict(stride_slot_layer=0 if slot_layer is not None or not call.writes else N, N=N, H=w.hidden_size,
             stride_xt=x.stride(0), stride_xh=x.stride(1),
             stride_cs=w.rotary_dim,  # the fused float32 table is contiguous
             v_scale=float(w.v_scale) if w.v_scale is not None else 1.0, eps=w.eps, grid_t=grid_t,
             whole_tiles=whole),
        dict(HK=Hk, D=D, R=w.rotary_dim, BLOCK_T=config.block_t, BLOCK_K=config.block_k, BLOCK_D=block_d,
             SPLIT_K=split_k, HAS_WHOLE=split_k > 1 and whole > 0, MERGE_IN_KERNEL=split_k > 1,
             ATOMIC_SUM=atomic_sum, NUM_XCDS=config.num_xcds, SQUARE_GROUP=config.square_group, HEADS=config.heads,
             HAS_BIAS=w.kv_bias is not None, IS_NEOX=w.is_neox, HAS_V_SCALE=w.v_scale is not None,
             IS_FP8=call.is_fp8, FP8_MAX=float(torch.finfo(cache_dtype).max) if call.is_fp8 else 0.0,
             FP8_MIN_EXP=_FP8_MIN_NORMAL_EXP.get(cache_dtype, 0), CACHE_DTYPE=TL_DTYPES[cache_dtype],
             RETURN_KV=call.return_kv,
             K_ALIGNED=all(aligned_runs(call.key_caches[i]) for i in call.written_layers),
             V_ALIGNED=all(aligned_runs(call.value_caches[i]) for i in call.written_layers),
             K_ROW_PACK=k_rows, K_DIM_PACK=k_dims, V_ROW_PACK=v_rows, V_DIM_PACK=v_dims,
             SLOTS_I32=slots_fit_int32(call), CACHE_BLOCK=shared_block_size(call), EXACT_FP8_ROUND=INTERPRETING,
             FP32_MATH=fp32_math(dtype), **variant_constexprs(call), **weight_constexprs(w)), kept=kept)
    scratch = PlanScratch(((parts * block_d, torch.float32), (parts, torch.float32)), split_tiles,
                          kept_sums=atomic_sum)
    return PrecomputePlan(config, main, atomic_sum, cache_table(call), scratch, slot_layer)


def precompute_runner(record: PlanningRecord, call: PrecomputeCall, config: PrecomputeLaunchConfig) -> Runner:
    """What runs every call of the structure ``record`` holds (``call``: its facts) under
    ``config`` (nothing to launch when it has no tokens or neither writes nor returns)."""
    if call.num_tokens == 0 or not (call.writes or call.return_kv):
        return NOTHING_TO_LAUNCH
    return plan_precompute(record, call, config)


def _outputs(call: PrecomputeCall):
    """The ``(k, v)`` a call returns (uninitialised ``[L, N, Hk, D]``) iff it asks, else None."""
    if not call.return_kv:
        return None
    w = call.weights
    shape = (w.num_layers, call.num_tokens, w.num_kv_heads, w.head_dim)
    return (torch.empty(shape, dtype=call.dtype, device=call.device),
            torch.empty(shape, dtype=call.dtype, device=call.device))


class _NothingToLaunch(Runner):
    """No tokens, or nothing to write or return: only the outputs a call asks for."""

    __slots__ = ()
    capture_support = capture.CaptureSupport.ALWAYS

    def run(self, call: PrecomputeCall):
        return _outputs(call)


NOTHING_TO_LAUNCH = _NothingToLaunch()


def run_precompute(call: PrecomputeCall, config: PrecomputeLaunchConfig | None = None):
    """The precompute of ``call`` under ``config`` (default: the portable table's), planned
    for this call alone: for tools and tests that pick a configuration. Served calls go
    through dispatch's plan cache."""
    record, facts = record_for(PRECOMPUTE.name, "triton", call)
    return precompute_runner(record, facts, config or precompute_config_for(facts, record.platform)).run(call)
