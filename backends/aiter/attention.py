"""aiter's paged attention: the probe, what it serves, the argument mapping, the first-call check.

aiter is never a dependency: it is probed at run time (``find_spec``, then an import
inside ``try`` since it raises without ROCm) and its features are read from signatures.
Of its kernels only the CK ``flash_attn_varlen_func`` takes a block table *and*
``causal=False`` (aiter's Triton ``unified_attention`` is causal-only); it needs pages of
a multiple of 128 rows, has sinks only where it takes ``sink_ptr`` (not the PyPI 0.1.7
release), and its fp8 path wants fp8 queries, so fp8 caches stay with the Triton kernel.

Trust, then verify: the first call of each call signature also runs the Triton kernel
and compares; a disagreement disables aiter for that signature with a warning. The check
reads the comparison back to the host, so it never runs while a CUDA graph is captured: a
signature not yet checked is served in the graph by the Triton kernel (logged once), and
checked at its first eager call.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from dflash_rocm import capture
from dflash_rocm.contract import relative_error, spec_tolerance
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.attention.varlen import varlen_kwargs
from dflash_rocm.platform import Platform
from dflash_rocm.process import process_constant

logger = logging.getLogger("dflash_rocm")
AITER_PAGE_MULTIPLE = 128


@dataclass(frozen=True)
class AiterFeatures:
    flash_attn_varlen_func: Callable
    block_table: bool
    sinks: bool


def probe(setting: bool | str) -> tuple[AiterFeatures | None, str | None]:
    """``(features, None)`` or ``(None, why aiter cannot be used)`` under ``setting``, the
    ``DFLASH_ROCM_AITER`` switch as the planning record holds it (off: disabled, whatever
    is installed)."""
    if setting is False:
        return None, "disabled (DFLASH_ROCM_AITER is off)"
    return installed()


@process_constant
def installed() -> tuple[AiterFeatures | None, str | None]:
    """``(features, None)`` or ``(None, why the installed aiter cannot be used)``: probed
    once per process."""
    if importlib.util.find_spec("aiter") is None:
        return None, "not installed (pip install amd-aiter in a ROCm environment)"
    try:
        aiter = importlib.import_module("aiter")
    except Exception as exc:  # aiter raises RuntimeError (and more) without a working ROCm
        return None, f"failed to import ({type(exc).__name__}: {exc})"
    fn = getattr(aiter, "flash_attn_varlen_func", None)
    if fn is None:
        return None, "this aiter has no flash_attn_varlen_func"
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None, "cannot read aiter.flash_attn_varlen_func's signature"
    if "block_table" not in params:
        return None, "this aiter's flash_attn_varlen_func takes no block_table"
    return AiterFeatures(fn, True, "sink_ptr" in params), None


def platform_reasons(platform: Platform, setting: bool | str) -> list[str]:
    """Why aiter cannot run on ``platform`` at all under the switch's ``setting`` (probe
    first: it says why best)."""
    _, why = probe(setting)
    if why:
        return [why]
    if platform.family != "cdna":
        return [f"aiter's CK attention targets CDNA; {platform.arch} is {platform.family}"]
    return []


def call_reasons(call: AttentionCall, features: AiterFeatures) -> list[str]:
    """Why aiter's kernel (``features``: what the probe found) cannot compute ``call``."""
    out = []
    if call.block_size % AITER_PAGE_MULTIPLE:
        out.append(f"aiter's paged path needs pages of a multiple of {AITER_PAGE_MULTIPLE} rows "
                   f"(block_size {call.block_size})")
    if call.is_fp8:
        out.append("aiter's fp8 attention needs fp8 queries")
    if call.dtype == torch.float32:
        out.append("aiter takes fp16/bf16 queries")
    if call.sinks is not None and not features.sinks:
        out.append("this aiter has no sinks (no sink_ptr: the PyPI 0.1.7 release)")
    if call.head_dim % 8 or call.head_dim > 256:
        out.append(f"aiter takes head dims up to 256, multiples of 8 (got {call.head_dim})")
    return out


def aiter_kwargs(call: AttentionCall) -> dict:
    """The contract's attention in aiter's terms: keys counted by ``cu_seqlens_k`` over the
    paged cache, the window as a tuple, sinks through ``sink_ptr``."""
    cu_seqlens_k = torch.zeros(call.num_seqs + 1, dtype=torch.int32, device=call.device)
    torch.cumsum(call.seq_lens, 0, out=cu_seqlens_k[1:])
    kwargs = varlen_kwargs(call)
    kwargs.update(cu_seqlens_k=cu_seqlens_k, window_size=tuple(kwargs["window_size"]))
    if call.sinks is not None:
        kwargs["sink_ptr"] = call.sinks.float()
    return kwargs


_verified: dict[str, bool] = {}
_lock = threading.Lock()
_captured_unchecked: set[str] = set()  # signatures already logged as served by the fallback in a graph


def run(call: AttentionCall, features: AiterFeatures, fallback: Callable[[AttentionCall], None]) -> None:
    """aiter's attention (``features``: what the plan's probe found); on the first call of
    a signature, checked against ``fallback`` (see the module for calls captured in a CUDA
    graph before that check)."""
    key = call.summary()
    with _lock:
        state = _verified.get(key)
    # Not a keep-or-not: the first-use check reads results on the host, which a capture cannot.
    if state is None and capture.graph_capturing(call.device):
        with _lock:
            first = key not in _captured_unchecked
            _captured_unchecked.add(key)
        if first:
            logger.info("aiter's attention is not yet checked against the Triton kernel for [%s], and the check "
                        "cannot run while a CUDA graph is captured: the Triton kernel serves this graph", key)
        fallback(call)
        return
    if state is False:
        fallback(call)
        return
    features.flash_attn_varlen_func(**aiter_kwargs(call))
    if state is None:
        got = call.out.clone()
        fallback(call)
        err = relative_error(got, call.out)
        ok = err <= spec_tolerance(call.dtype, call.cache_dtype)
        if not ok:
            logger.warning("aiter's attention disagrees with the Triton kernel (rel err %.2e) for [%s]; "
                           "using the Triton kernel for it from now on", err, key)
        with _lock:
            _verified[key] = ok
