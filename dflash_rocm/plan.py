"""Plan once, run many (FlashInfer's model) for both operations.

Both operations go through dispatch's one plan cache (:mod:`dflash_rocm.dispatch`); the
plans here bind a cache entry to the arguments a caller fixes, so that a run checks only
what changes.

A DFlash step runs the same attention for every draft layer: one batch (block table,
query start offsets, sequence lengths, host bounds), and per layer only the query, that
layer's caches, its fp8 scales and sinks, and the output change. :func:`plan_draft_attention`
does the host work of the batch once: every check :func:`dflash_rocm.draft_attention`
makes (index checks included, asynchronous on a GPU) and getting the batch's plan.
:meth:`DraftAttentionPlan.run` then checks only what a layer changes: each tensor's
shape, strides, dtype and device against the planned ones (a mismatch is a
:class:`PlanMismatch`, raised before anything is written) and that ``out`` shares no
memory with what the call reads.

The precompute's plan, :func:`plan_context_kv`, keeps what a serving engine fixes for a
model's life (weights, each layer's caches, fp8 scales) with their part of the checks'
key taken once, and the planning variables as they were when it was made;
:meth:`ContextKVPlan.run` takes each step's states, positions and slot mappings and checks
those as :func:`dflash_rocm.precompute_and_store_context_kv` does.
"""

from __future__ import annotations

import torch

from . import dispatch, planning
from .ops import ATTENTION, PRECOMPUTE
from .ops.attention.validation import batch_memory, check_out_apart
from .ops.precompute.validation import ModelArguments, bound_precompute_call, model_arguments
from .validation import IndexChecks, check_scale_values, holds_tensor, scale_tensor, signature


class PlanMismatch(ValueError):
    """A tensor given to :meth:`DraftAttentionPlan.run` is not laid out as the planned one."""


class _BoundToMemory:
    """A plan is bound to the memory of the tensors it was planned with (it holds them,
    and its keys hold their raw addresses): a copy or an unpickled plan would write the
    original's memory, or freed memory. Plans refuse both; make a new plan instead."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):  # what copy.copy, copy.deepcopy and pickle ask for
        raise TypeError(f"{type(self).__name__} cannot be copied or pickled: it is bound to the memory of the "
                        "tensors it was planned with; make a new plan for other tensors, or share this one")


class DraftAttentionPlan(_BoundToMemory):
    """The host work of one batch's draft-attention calls, done once (see the module)."""

    __slots__ = ("_call", "_plan", "backend", "_planned", "_validate", "_scales", "_refresh", "_batch_memory",
                 "_fresh_out_planned")

    def __init__(self, call, backend: str | None, validate: bool, given: dict):
        """``given``: the tensors the caller planned with, by name (index tensors, sinks,
        fp8 scales). A plan reads them at every run, as a call would: the fp8 scales are
        normalised again when a run gives none, and the contiguous copies validation made
        of strided views are refreshed from them."""
        self._call = call
        self._plan = dispatch.planned(ATTENTION, call, backend)
        self.backend = self._plan.backend  # the backend that serves every run
        self._validate = validate
        self._scales = {name: given[name] for name in ("k_scale", "v_scale") if holds_tensor(given[name])}
        self._refresh = tuple((name, given[name], getattr(call, name)) for name in _COPIED
                              if given[name] is not None and getattr(call, name) is not given[name])
        self._batch_memory = batch_memory(call)
        self._planned = {name: signature(getattr(call, name))
                         for name in ("query", "key_cache", "value_cache", "out", "sinks", "k_scale", "v_scale")}
        # A run's new out is laid out as empty_like(a query laid out as planned): checked once, here.
        self._fresh_out_planned = signature(torch.empty_like(call.query)) == self._planned["out"]

    def _same(self, name: str, value):
        planned = self._planned[name]
        got = signature(value)
        if got != planned:
            raise PlanMismatch(f"{name}: not laid out as planned (planned shape, strides, dtype, device "
                               f"{_describe(planned)}; got {_describe(got)}); make a plan for it")
        return value

    def run(self, query: torch.Tensor, key_cache, value_cache, *, out: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
            v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """One layer's attention over the planned batch; returns ``out``. ``out`` None:
        a new tensor like ``query``. ``sinks`` and the fp8 scale tensors: this layer's
        (a sinks tensor laid out as the planned one, one-element float scales); None keeps
        the planned ones (planned scale tensors are read again). Scales are ignored for
        caches that are not fp8, as by :func:`dflash_rocm.draft_attention`, and
        value-checked when the plan validates."""
        call = self._call
        query = self._same("query", query)
        key_cache = self._same("key_cache", key_cache)
        value_cache = self._same("value_cache", value_cache)
        fresh_out = out is None
        if fresh_out:
            out = torch.empty_like(query)
            if not self._fresh_out_planned:
                self._same("out", out)
        else:
            out = self._same("out", out)
        tensors = dict(query=query, key_cache=key_cache, value_cache=value_cache, out=out, sinks=call.sinks,
                       k_scale=call.k_scale, v_scale=call.v_scale)
        if sinks is not None:
            tensors["sinks"] = self._same("sinks", sinks if sinks.is_contiguous() else sinks.contiguous())
        if call.k_scale is not None:  # an fp8 cache
            for name, given in (("k_scale", k_scale), ("v_scale", v_scale)):
                given = self._scales.get(name) if given is None else given
                if given is not None:
                    tensors[name] = scale = self._same(name, scale_tensor(name, given, 1, call.device))
                    if self._validate:
                        check_scale_values(name, scale, IndexChecks(call.device))
        call = call.with_tensors(**tensors)
        if not fresh_out:
            check_out_apart(call, self._batch_memory)
        for name, source, copy in self._refresh:  # strided views the caller may have written since
            if name != "sinks" or sinks is None:  # (a run's own sinks replace the planned copy)
                copy.copy_(source)
        self._plan(call)
        return out


_COPIED = ("block_table", "query_start_loc", "seq_lens", "sinks")  # made contiguous by validation when strided


def _describe(sig: tuple) -> str:
    if len(sig) == 5:
        shape, strides, dtype, device, requires_grad = sig
        return f"{list(shape)}, {strides}, {dtype}, {device}" + (", requires grad" if requires_grad else "")
    return repr(sig[-1]) if len(sig) == 2 else repr(sig)


def plan_draft_attention(query: torch.Tensor, key_cache, value_cache, block_table: torch.Tensor,
                         query_start_loc: torch.Tensor, seq_lens: torch.Tensor, *, scale: float | None = None,
                         causal: bool = False, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                         k_scale=None, v_scale=None, out: torch.Tensor | None = None, backend: str | None = None,
                         validate: bool = True, max_query_len: int | None = None,
                         max_seq_len: int | None = None) -> DraftAttentionPlan:
    """Plan the draft attention of one batch: the arguments of
    :func:`dflash_rocm.draft_attention` (validated as there; nothing is computed), with
    the tensors of any one layer; then ``plan.run(query, key_cache, value_cache, ...)``
    per layer. Every run reads the batch's index tensors (and the planned sinks and scale
    tensors) as they are then; values written into them since the plan was made are the
    caller's to vouch for: they were checked, and host bounds derived from them, here."""
    call = ATTENTION.build_call(query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
                                scale=scale, causal=causal, sliding_window=sliding_window, sinks=sinks,
                                k_scale=k_scale, v_scale=v_scale, out=out, validate=validate,
                                max_query_len=max_query_len, max_seq_len=max_seq_len)
    return DraftAttentionPlan(call, backend, validate, dict(block_table=block_table, query_start_loc=query_start_loc,
                                                            seq_lens=seq_lens, sinks=sinks, k_scale=k_scale,
                                                            v_scale=v_scale))


class ContextKVPlan(_BoundToMemory):
    """The precompute of one model's weights into one set of caches (see the module). The
    planning variables (``DFLASH_ROCM_*``: :func:`dflash_rocm.planning.environment`) are
    read once, when the plan is made, as a draft-attention plan reads them: a changed
    variable reaches the plans made after it."""

    __slots__ = ("_model", "_backend", "_environment")

    def __init__(self, model: ModelArguments, backend: str | None):
        self._model, self._backend = model, backend
        self._environment = planning.environment()

    def run(self, context_states: torch.Tensor, positions: torch.Tensor, slot_mapping, *, return_kv: bool = False,
            validate: bool = True):
        """:func:`dflash_rocm.precompute_and_store_context_kv` with the planned weights,
        caches and scales; each new structure (token count, which layers are written) is
        planned on its first run and kept."""
        call = bound_precompute_call(self._model, context_states, positions, slot_mapping, return_kv=return_kv,
                                     validate=validate)
        return dispatch.planned(PRECOMPUTE, call, self._backend, self._environment)(call)


def plan_context_kv(weights, key_caches, value_caches, *, k_scales=None, v_scales=None,
                    backend: str | None = None) -> ContextKVPlan:
    """Plan the precompute for a model's weights and caches (the per-model arguments of
    :func:`dflash_rocm.precompute_and_store_context_kv`); then ``plan.run(states, positions,
    slot_mapping)`` per step. The plan holds the caches as they are now: the caller's lists
    may change later, the tensors must not be resized or re-pointed. Each step's arguments
    are checked at ``run``, the whole structure once per new shape."""
    return ContextKVPlan(model_arguments(weights, key_caches, value_caches, k_scales, v_scales), backend)
