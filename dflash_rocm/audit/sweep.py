"""The shapes the launch tables serve, and every launch the host code makes for them.

Calls are built on the ``meta`` device at their real sizes (a vLLM per-layer cache of
several GiB allocates nothing), then the real host code (``run_draft_attention`` /
``run_precompute`` with the ROCm table's configuration on AMD targets and the portable
table's on NVIDIA) runs inside :func:`dflash_rocm.launches.capture`, which records each launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dflash_rocm.launches import Launch, capture
from dflash_rocm.ops import PRECOMPUTE
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.floors import Cost, attention_cost, precompute_cost
from dflash_rocm.planning import on_platform, record_for
from dflash_rocm.platform import platform_for_arch
from dflash_rocm.weights import ContextKVWeights
from dflash_rocm.workloads import DraftShape

from .targets import Target

META = torch.device("meta")
BLOCK_SIZE = 16
LARGE_CACHE_BYTES = 4 << 30  # a vLLM per-layer K+V cache on a 192 GB MI300X: several GiB
TWO_GIB = 2 ** 31 - 1

ATTENTION_BATCHES = (1, 8, 64)
ATTENTION_CONTEXTS = (1024, 8192, 32768)
PRECOMPUTE_TOKENS = (16, 32, 64, 256, 512, 1024, 4096)
# Captured plans: vLLM captures its CUDA graphs with max_seq_len = max_model_len, so real
# contexts run under a plan made for a far longer span. Batch 1 and 8 at 1k and 8k under
# plans for 32k and 128k are in the default sweep; `--planned` plans the
# cases of any other sweep for the spans it names.
PLANNED_SPANS = (32768, 131072)
PLANNED_ATTENTION = tuple((b, c, span) for b in (1, 8) for c in (1024, 8192) for span in PLANNED_SPANS)
# Extra attention cases: batch 64 at 4k (a large batch, DRAM-bound), and the captured plans.
EXTRA_ATTENTION = ((64, 4096, None),) + PLANNED_ATTENTION
# vLLM ROCM_ATTN's packed pages (its default backend on AMD; AMD targets only), short names
# for the tables: x-packed K with plain V, and with interleaved V. One attention and one
# precompute case each compile the packed kernels.
PACKINGS = {"rocm_attn": "xK", "rocm_attn_interleaved_v": "xKV"}
PACKED_ATTENTION = (1, 8192)  # batch, context
PACKED_TOKENS = 16


@dataclass(frozen=True)
class Case:
    """One workload of the sweep on one target."""

    op: str  # "attention" | "precompute"
    shape: DraftShape
    fp8: bool
    batch: int = 0  # attention
    context: int = 0  # attention: context tokens before the query block
    # attention: the longest sequence the plan was made for (its max_seq_len; the block table
    # spans it), as a CUDA graph is captured with max_seq_len = max_model_len; None: the real one
    planned_span: int | None = None
    large_cache: bool = False  # attention on AMD: the cache tensor spans more than 2 GiB
    tokens: int = 0  # precompute
    packing: str = "plain"  # or a key of PACKINGS: the caches are vLLM ROCM_ATTN's
    fp8_weights: bool = False  # precompute: fp8 K/V rows (the target's fp8 format) with per-channel scales

    @property
    def label(self) -> str:
        kv = "fp8" if self.fp8 else "bf16"
        pages = f" {PACKINGS[self.packing]}" if self.packing != "plain" else ""
        if self.op == "precompute":
            return f"pre N={self.tokens} {kv}{pages}{' w8' if self.fp8_weights else ''}"
        span = f" plan {kilo(self.planned_span)}" if self.planned_span else ""
        return f"attn b{self.batch} {kilo(self.context)}{span} {kv}{pages}"

    @property
    def query_len(self) -> int:
        return self.shape.block_tokens

    @property
    def seq_len(self) -> int:
        return self.context + self.shape.block_tokens

    def cost(self) -> Cost:
        """The floor's bytes and FLOPs (:mod:`dflash_rocm.floors`)."""
        s = self.shape
        cache_bytes = 1 if self.fp8 else 2
        if self.op == "precompute":
            return precompute_cost(hidden=s.hidden, layers=s.layers, kv_heads=s.kv_heads, head_dim=s.head_dim,
                                   num_tokens=self.tokens, elem_bytes=2, cache_bytes=cache_bytes,
                                   weight_bytes=1 if self.fp8_weights else 2)
        return attention_cost(batch=self.batch, query_len=self.query_len, seq_len=self.seq_len, q_heads=s.q_heads,
                              kv_heads=s.kv_heads, head_dim=s.head_dim, elem_bytes=2, cache_bytes=cache_bytes,
                              sliding_window=s.sliding_window)


def kilo(n: int) -> str:
    """A count of keys as the tables print it: ``8k`` for 8192, else the number."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


@dataclass
class CaseLaunches:
    case: Case
    target: Target
    config_name: str = ""
    config: dict = field(default_factory=dict)
    launches: list[Launch] = field(default_factory=list)
    skipped: str | None = None  # why the case does not apply to the target


def default_cases(shape: DraftShape, *, ops=("attention", "precompute"), batches=ATTENTION_BATCHES,
                  contexts=ATTENTION_CONTEXTS, tokens=PRECOMPUTE_TOKENS, kv=("bf16", "fp8"),
                  extras: bool = True, packed: bool = True, planned: tuple[int, ...] = (),
                  weights: tuple[str, ...] = ("bf16",)) -> list[Case]:
    """The sweep's cases; ``planned``: every attention case of the grid also planned for
    each of these spans that is longer than its sequence; ``weights``: the precompute's K/V
    rows, ``"bf16"`` and/or ``"fp8"`` (each precompute case once per entry)."""
    cases = []
    for fp8 in (k == "fp8" for k in kv):
        if "attention" in ops:
            grid = [(b, c, None) for b in batches for c in contexts]
            grid += [(b, c, span) for b, c, _ in grid for span in planned if span > c + shape.block_tokens]
            grid += [case for case in EXTRA_ATTENTION if extras and case not in grid]
            cases += [Case("attention", shape, fp8, batch=b, context=c, planned_span=span) for b, c, span in grid]
            if packed:
                batch, context = PACKED_ATTENTION
                cases += [Case("attention", shape, fp8, batch=batch, context=context, packing=p) for p in PACKINGS]
        for w8 in (w == "fp8" for w in weights):
            if "precompute" in ops:
                cases += [Case("precompute", shape, fp8, tokens=n, fp8_weights=w8) for n in tokens]
                if packed:
                    cases += [Case("precompute", shape, fp8, tokens=PACKED_TOKENS, packing=p, fp8_weights=w8)
                              for p in PACKINGS]
    return cases


def _cache_dtype(case: Case, target: Target) -> torch.dtype:
    return target.fp8_dtype if case.fp8 else torch.bfloat16


def cache_pair(shape: DraftShape, num_blocks: int, dtype: torch.dtype, packing: str = "plain"):
    """K and V of one per-layer tensor, the storage of both being the whole tensor: views of
    ``[2, blocks, block_size, Hk, D]`` (vLLM's FlashAttention layout), or ROCM_ATTN's
    ``[blocks, 2, block_size, Hk * D]`` split as the vLLM plugin splits it."""
    if packing == "plain":
        kv = torch.empty(2, num_blocks, BLOCK_SIZE, shape.kv_heads, shape.head_dim, dtype=dtype, device=META)
        return kv[0], kv[1]
    from dflash_rocm.vllm_plugin.cache_views import rocm_attn_caches

    kv = torch.empty(num_blocks, 2, BLOCK_SIZE, shape.kv_heads * shape.head_dim, dtype=dtype, device=META)
    return rocm_attn_caches(kv, shape.kv_heads, shape.head_dim, interleaved_v=packing == "rocm_attn_interleaved_v")


def attention_call(case: Case, target: Target) -> AttentionCall:
    s = case.shape
    dtype = _cache_dtype(case, target)
    span = case.planned_span or case.seq_len
    width = -(-span // BLOCK_SIZE)
    needed = case.batch * width + 1
    per_block = 2 * BLOCK_SIZE * s.kv_heads * s.head_dim * dtype.itemsize
    num_blocks = max(needed, LARGE_CACHE_BYTES // per_block) if case.large_cache else needed
    key_cache, value_cache = cache_pair(s, num_blocks, dtype, case.packing)
    tokens = case.batch * case.query_len
    query = torch.empty(tokens, s.q_heads, s.head_dim, dtype=torch.bfloat16, device=META)
    index = dict(dtype=torch.int32, device=META)
    scale = torch.empty(1, dtype=torch.float32, device=META) if case.fp8 else None
    sinks = torch.empty(s.q_heads, dtype=torch.float32, device=META) if s.sinks else None
    return AttentionCall(
        query=query, key_cache=key_cache, value_cache=value_cache,
        block_table=torch.empty(case.batch, width, **index), query_start_loc=torch.empty(case.batch + 1, **index),
        seq_lens=torch.empty(case.batch, **index), out=torch.empty_like(query), scale=s.head_dim ** -0.5,
        causal=s.causal, sliding_window=s.sliding_window, sinks=sinks, k_scale=scale, v_scale=scale,
        max_query_len=case.query_len, max_seq_len=span)


def precompute_call(case: Case, target: Target) -> PrecomputeCall:
    s = case.shape
    L, Hk, D, H, N = s.layers, s.kv_heads, s.head_dim, s.hidden, case.tokens
    dtype = _cache_dtype(case, target)
    empty = dict(dtype=torch.bfloat16, device=META)
    rows = L * 2 * Hk * D
    weight_dtype = target.fp8_dtype if case.fp8_weights else torch.bfloat16
    weights = ContextKVWeights(
        hidden_norm_weight=torch.empty(H, **empty), kv_weight=torch.empty(rows, H, dtype=weight_dtype, device=META),
        kv_weight_scale=torch.empty(rows, dtype=torch.float32, device=META) if case.fp8_weights else None,
        k_norm_weight=torch.empty(L, D, **empty),
        cos_sin_cache=torch.empty(1 << 15, s.rope_dim, dtype=torch.float32, device=META),
        is_neox=s.is_neox, eps=1e-6, num_layers=L, num_kv_heads=Hk, head_dim=D)
    caches = [cache_pair(s, -(-N // BLOCK_SIZE) + 1, dtype, case.packing) for _ in range(L)]
    slots = torch.empty(N, dtype=torch.int64, device=META)
    scales = torch.empty(L, dtype=torch.float32, device=META) if case.fp8 else None
    return PrecomputeCall(
        states=torch.empty(N, H, **empty), positions=torch.empty(N, dtype=torch.int64, device=META),
        weights=weights, key_caches=tuple(k for k, _ in caches), value_caches=tuple(v for _, v in caches),
        slot_mappings=(slots,) * L, k_scales=scales, v_scales=scales, return_kv=False)


def table_config(case: Case, target: Target, call):
    """(rule name, config) the backend serving ``target`` would pick: the ROCm table on
    AMD (query limit = the draft's block, as the vLLM plugin configures; no tuning), the
    portable table on NVIDIA."""
    platform = platform_for_arch(target.arch)
    if target.amd:
        from dflash_rocm.backends import rocm
        from dflash_rocm.backends.rocm import tables

        if case.op == "attention":
            return tables.attention_config(rocm.attention_workload(call, platform), case.query_len)
        record, facts = record_for(PRECOMPUTE.name, "rocm", call)
        return "rocm-table", rocm.precompute_choice(on_platform(record, platform), facts)
    from dflash_rocm.backends.triton.attention import attention_config_for
    from dflash_rocm.backends.triton.precompute import precompute_config_for

    if case.op == "attention":
        return "portable", attention_config_for(call, platform)
    return "portable", precompute_config_for(call, platform)


def capture_case(case: Case, target: Target, config=None) -> CaseLaunches:
    """Every launch the host code makes for ``case`` on ``target`` with ``config`` (None:
    the table's, :func:`table_config`)."""
    result = CaseLaunches(case, target)
    if (case.fp8 or case.fp8_weights) and target.fp8_dtype is None:
        result.skipped = f"{target.arch} has no fp8 conversion"
        return result
    from dflash_rocm.backends.triton.attention import run_draft_attention
    from dflash_rocm.backends.triton.precompute import run_precompute

    if case.op == "attention":
        call = attention_call(case, target)
        run = run_draft_attention
    else:
        call = precompute_call(case, target)
        run = run_precompute
    if config is None:
        result.config_name, config = table_config(case, target, call)
    else:
        result.config_name = "given"
    result.config = config.as_dict()
    with capture() as launches:
        run(call, config)
    result.launches = launches
    return result


def cache_variants(case: Case, target: Target) -> list[Case]:
    """On AMD the attention is compiled for both cache sizes: buffer (32-bit offset) loads
    only apply to tensors under 2 GiB. The workload's own cache comes first when it fits.
    Packed (ROCM_ATTN) caches exist on AMD only, and are compiled at the workload's size."""
    if case.packing != "plain":
        return [case] if target.amd else []
    if case.op != "attention" or not target.amd:
        return [case]
    s = case.shape
    own = 2 * case.batch * -(-(case.planned_span or case.seq_len) // BLOCK_SIZE) * BLOCK_SIZE * s.kv_heads * s.head_dim
    own *= 1 if case.fp8 else 2
    variants = [case] if own <= TWO_GIB else []
    return variants + [replace(case, large_cache=True)]
