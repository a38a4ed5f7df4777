"""The validated arguments of one ``precompute_and_store_context_kv`` call.

Only :func:`dflash_rocm.ops.precompute.validation.precompute_call` builds these; a
backend can rely on every shape, dtype and device relation stated here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...contract import FP8_DTYPES, dtype_name
from ...paged import PackedCache, cache_packing
from ..base import describe_call
from ...weights import ContextKVWeights


@dataclass(eq=False, slots=True)
class PrecomputeCall:
    """One validated call; read-only by convention, not frozen (see
    :class:`~dflash_rocm.ops.attention.AttentionCall`): a plan builds one per step."""

    # What a plan may know of each tensor's address (dflash_rocm.planning): the caches' (the
    # structure holds them).
    PLANNED_ADDRESSES = {"key_caches": "address", "value_caches": "address"}

    states: torch.Tensor  # [N, H]
    positions: torch.Tensor  # int [N]
    weights: ContextKVWeights
    key_caches: tuple[torch.Tensor | PackedCache | None, ...]  # L entries, None where the layer is skipped
    value_caches: tuple[torch.Tensor | PackedCache | None, ...]
    slot_mappings: tuple[torch.Tensor | None, ...]  # L entries; None: do not write that layer
    k_scales: torch.Tensor | None  # float32 [L] on the device; set iff the caches are fp8
    v_scales: torch.Tensor | None
    return_kv: bool
    structure: object = None  # the call's structure, as the structural checks read it (see AttentionCall)

    @property
    def num_tokens(self) -> int:
        return self.states.shape[0]

    @property
    def num_layers(self) -> int:
        return self.weights.num_layers

    @property
    def writes(self) -> bool:
        return any(s is not None for s in self.slot_mappings)

    @property
    def written_layers(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.slot_mappings) if s is not None)

    @property
    def cache_dtype(self) -> torch.dtype | None:
        for i in self.written_layers:
            return self.key_caches[i].dtype
        return None

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype in FP8_DTYPES

    @property
    def dtype(self) -> torch.dtype:
        return self.states.dtype

    @property
    def device(self) -> torch.device:
        return self.states.device

    @property
    def packing(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(row pack, dim pack) of the K and of the V caches (one each: validation makes every
        written layer agree) when either is a :class:`PackedCache`; None for plain caches."""
        for i in self.written_layers:
            return cache_packing(self.key_caches[i], self.value_caches[i])
        return None

    def planning_parts(self) -> tuple:
        """See :meth:`AttentionCall.planning_parts`: the structure holds the caches'
        addresses (a plan serves one cache set); no host bounds or memory facts beyond them."""
        return self.structure, (), ()

    def describe(self) -> str:
        """Every argument's shape and dtype and the scalars, one line each (errors)."""
        w = self.weights
        weights = (f"ContextKVWeights(L={w.num_layers}, Hk={w.num_kv_heads}, D={w.head_dim}, H={w.hidden_size}, "
                   f"R={w.rotary_dim}, {'neox' if w.is_neox else 'gptj'}, {dtype_name(w.dtype)})")
        return f"weights: {weights}\n" + describe_call(self, ("states", "positions", "key_caches", "value_caches",
                                                              "slot_mappings", "k_scales", "v_scales", "return_kv"))

    def summary(self) -> str:
        w = self.weights
        parts = [f"x={dtype_name(self.dtype)}", f"kv={dtype_name(self.cache_dtype)}",
                 f"L={w.num_layers}", f"Hk={w.num_kv_heads}", f"D={w.head_dim}", f"R={w.rotary_dim}",
                 "neox" if w.is_neox else "gptj", f"layers_written={len(self.written_layers)}"]
        if w.quantized:
            parts.append(f"w={dtype_name(w.dtype)}/{'tensor' if w.kv_weight_scale.numel() == 1 else 'channel'}")
        if w.per_layer_hidden_norm:
            parts.append("per_layer_norm")
        if w.nope_layers:
            parts.append(f"nope={','.join(map(str, w.nope_layers))}")
        if w.round_k_before_rope:
            parts.append("round_k")
        if self.return_kv:
            parts.append("return_kv")
        parts.append(f"dev={self.device.type}")
        return " ".join(parts)
