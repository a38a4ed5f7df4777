"""Draft shapes of real DFlash checkpoints and the inputs of one decode step for them.

``check`` and ``bench`` build their calls here, so both measure the same workloads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .checkpoint import DraftDims, config_flag, layer_attention_modes, read_draft_config, rope_setup
from .contract import FP8_DTYPES, as_dtype
from .rope import build_cos_sin_cache
from .weights import ContextKVWeights


@dataclass(frozen=True)
class DraftShape:
    name: str
    hidden: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int | None = None  # None: the whole head
    block_tokens: int = 16  # query tokens per request: num_speculative_tokens + 1
    sliding_window: int | None = None
    sinks: bool = False
    causal: bool = False
    is_neox: bool = True
    note: str = ""

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def per_rank(self, tp: int) -> "DraftShape":
        """The shape one rank of a ``tp``-way tensor-parallel deployment runs: its share of the
        query heads and of the KV heads (vLLM's ``QKVParallelLinear``; with fewer KV heads than
        ranks each rank holds one, replicated). vLLM's own conditions: ``tp`` divides the query
        heads, and divides the KV heads or is a multiple of them. TP 1 is the shape itself."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tp: expected a positive int, got {tp!r}")
        if tp == 1:
            return self
        if self.q_heads % tp or (self.kv_heads % tp and tp % self.kv_heads):
            raise ValueError(f"tp {tp}: {self.name} has {self.q_heads} query and {self.kv_heads} KV heads; "
                             "tensor parallelism needs tp to divide the query heads and to divide or be a "
                             "multiple of the KV heads")
        return replace(self, name=f"{self.name}@tp{tp}", q_heads=self.q_heads // tp,
                       kv_heads=max(1, self.kv_heads // tp))

    def tp_degrees(self, largest: int = 8) -> tuple[int, ...]:
        """The tensor-parallel degrees up to ``largest`` this shape splits into (:meth:`per_rank`)."""
        return tuple(tp for tp in range(1, largest + 1)
                     if not self.q_heads % tp and (not self.kv_heads % tp or not tp % self.kv_heads))

    def scaled_for_cpu(self) -> "DraftShape":
        """Same heads and features, fewer layers and a narrower hidden size: the Triton
        interpreter runs every program in Python."""
        return replace(self, hidden=min(self.hidden, 256), layers=min(self.layers, 2),
                       sliding_window=None if self.sliding_window is None else min(self.sliding_window, 24),
                       note=(self.note + "; " if self.note else "") + "scaled down for CPU")


SHAPES: dict[str, DraftShape] = {s.name: s for s in (
    DraftShape("qwen3-8b-dflash-b16", 4096, 5, 32, 8, 128, note="z-lab/Qwen3-8B-DFlash-b16"),
    DraftShape("qwen3-4b-dflash-b16", 2560, 5, 32, 8, 128, note="z-lab/Qwen3-4B-DFlash-b16"),
    DraftShape("qwen3.5-9b-dflash", 4096, 5, 16, 4, 256, rotary_dim=64,
               note="Qwen3.5-style heads (head_dim 256, partial rotary 0.25)"),
    DraftShape("gemma-swa-sinks", 3072, 5, 16, 8, 256, sliding_window=512, sinks=True, causal=True,
               note="gemma-style draft: sliding-window causal layers with attention sinks"),
)}
DEFAULT_SHAPE = "qwen3-8b-dflash-b16"


def shape_named(name: str) -> DraftShape:
    """A preset by name, or one rank's share of it as :meth:`DraftShape.per_rank` names it
    (``qwen3-8b-dflash-b16@tp8``)."""
    base, _, tp = name.partition("@tp")
    if base not in SHAPES or (tp and not tp.isdigit()):
        raise ValueError(f"unknown draft shape {name!r}: expected one of {sorted(SHAPES)}, optionally with @tpN")
    return SHAPES[base].per_rank(int(tp)) if tp else SHAPES[base]


def draft_shape(path: str | os.PathLike):
    """The :class:`DraftShape` of a checkpoint (its first layer's attention mode; sinks
    when ``dflash_config.attention_sink_bias`` is set)."""
    path = Path(path)
    config = read_draft_config(path)
    dims = DraftDims.of(config, path)
    rope = rope_setup(config, dims, path)
    try:
        window, causal = layer_attention_modes(config)[0]
    except ValueError as exc:
        raise ValueError(f"config {str(path / 'config.json')!r}: {exc}") from None
    dflash = config.get("dflash_config") or {}
    return DraftShape(
        name=path.name, hidden=dims.hidden, layers=dims.layers, q_heads=dims.q_heads, kv_heads=dims.kv_heads,
        head_dim=dims.head_dim, rotary_dim=rope.rotary_dim, sliding_window=window, causal=causal,
        sinks=bool(dflash.get("attention_sink_bias", config.get("add_swa_attention_sink_bias", False))),
        is_neox=config_flag(config, "is_neox_style", path / "config.json", True), note=f"checkpoint {path}")


def _generator(seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def random_weights(shape: DraftShape, dtype: torch.dtype | str, device: torch.device | str, seed: int = 0,
                   max_position: int = 1 << 15) -> ContextKVWeights:
    """Random K/V weights of ``shape`` (``dtype``: a torch dtype or a name such as "bf16")."""
    dtype = as_dtype(dtype)
    g = _generator(seed, device)
    L, Hk, D, H = shape.layers, shape.kv_heads, shape.head_dim, shape.hidden

    def randn(*size, std=1.0):
        return (torch.randn(size, generator=g, device=device) * std).to(dtype)

    return ContextKVWeights(
        hidden_norm_weight=1 + randn(H, std=0.1), kv_weight=randn(L * 2 * Hk * D, H, std=H ** -0.5),
        k_norm_weight=1 + randn(L, D, std=0.1),
        cos_sin_cache=build_cos_sin_cache(shape.rope_dim, max_position, {"rope_theta": 1e6}).to(device),
        is_neox=shape.is_neox, eps=1e-6, num_layers=L, num_kv_heads=Hk, head_dim=D)


@dataclass
class PrecomputeInputs:
    states: torch.Tensor
    positions: torch.Tensor
    weights: ContextKVWeights
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None

    def args(self) -> tuple:
        return (self.states, self.positions, self.weights, self.key_caches, self.value_caches, self.slot_mapping)

    def kwargs(self) -> dict:
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


def precompute_inputs(shape: DraftShape, num_tokens: int, dtype: torch.dtype | str, cache_dtype: torch.dtype | str,
                      device: torch.device | str, *, block_size: int = 16, seed: int = 0,
                      weights: ContextKVWeights | None = None) -> PrecomputeInputs:
    """Context states of one step, written to fresh slots of a shuffled paged cache (dtypes:
    torch dtypes or names such as "bf16", "fp8")."""
    dtype, cache_dtype = as_dtype(dtype), as_dtype(cache_dtype, "cache_dtype")
    g = _generator(seed + 1, device)
    weights = weights if weights is not None else random_weights(shape, dtype, device, seed)
    L, Hk, D = weights.num_layers, weights.num_kv_heads, weights.head_dim
    num_blocks = -(-num_tokens // block_size) + 1
    caches = [torch.zeros(num_blocks, block_size, Hk, D, device=device, dtype=cache_dtype) for _ in range(2 * L)]
    slots = torch.randperm(num_blocks * block_size, generator=g, device=device)[:num_tokens]
    fp8 = cache_dtype in FP8_DTYPES
    scales = torch.full((L,), 0.5, device=device) if fp8 else None
    return PrecomputeInputs(
        states=torch.randn(num_tokens, weights.hidden_size, generator=g, device=device).to(dtype),
        positions=torch.randint(0, min(weights.max_position, 1 << 14), (num_tokens,), generator=g, device=device),
        weights=weights, key_caches=caches[:L], value_caches=caches[L:], slot_mapping=slots,
        k_scales=scales, v_scales=None if scales is None else scales.clone())


@dataclass
class AttentionInputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    kwargs: dict

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.query_start_loc,
                self.seq_lens)


def attention_inputs(shape: DraftShape, batch: int, context_len: int, dtype: torch.dtype | str,
                     cache_dtype: torch.dtype | str, device: torch.device | str, *, block_size: int = 16,
                     seed: int = 0) -> AttentionInputs:
    """``batch`` requests, each a query block of ``shape.block_tokens`` at the end of a
    ``context_len + block_tokens`` sequence, in a cache with shuffled blocks (dtypes: torch
    dtypes or names such as "bf16", "fp8")."""
    dtype, cache_dtype = as_dtype(dtype), as_dtype(cache_dtype, "cache_dtype")
    g = _generator(seed + 2, device)
    q_len = shape.block_tokens
    seq_len = context_len + q_len
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_seq + 1
    fp8 = cache_dtype in FP8_DTYPES

    def cache():
        x = torch.randn(num_blocks, block_size, shape.kv_heads, shape.head_dim, generator=g, device=device)
        return x.to(cache_dtype)

    table = torch.randperm(num_blocks, generator=g, device=device)[:batch * blocks_per_seq]
    kwargs = dict(causal=shape.causal, sliding_window=shape.sliding_window,
                  sinks=torch.randn(shape.q_heads, generator=g, device=device) if shape.sinks else None,
                  k_scale=0.5 if fp8 else None, v_scale=0.5 if fp8 else None,
                  max_query_len=q_len, max_seq_len=seq_len)
    return AttentionInputs(
        query=torch.randn(batch * q_len, shape.q_heads, shape.head_dim, generator=g, device=device).to(dtype),
        key_cache=cache(), value_cache=cache(),
        block_table=table.view(batch, blocks_per_seq).to(torch.int32),
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len,
        seq_lens=torch.full((batch,), seq_len, device=device, dtype=torch.int32), kwargs=kwargs)
