"""A stand-in for a vLLM tree whose ``unified_attention`` really computes attention: vLLM
0.34's signature and imports (its platform, logger, ``triton_utils``, ``KVQuantMode``, a
sibling helpers file), one small Triton kernel (fp32 arithmetic, so Triton's interpreter
computes it right) over the same paged cache. ``bench --peer`` runs it on CPU where the
real vLLM files are not at hand (tests never download them)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from dflash_rocm.peer import source

HELPERS = """
from vllm.triton_utils import tl, triton


@triton.jit
def rescale(acc, alpha):
    return acc * alpha[:, None]
"""
UNIFIED = """
import torch

from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import rescale
from vllm.v1.kv_cache_interface import KVQuantMode

logger = init_logger(__name__)
IS_ROCM = current_platform.is_rocm()


@triton.jit
def kernel_unified_attention(out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, cu_q_ptr, seq_lens_ptr, k_descale_ptr,
                             v_descale_ptr, scale, window, num_seqs, stride_qt, stride_qh, stride_kb, stride_ks,
                             stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_ot, stride_oh,
                             GROUP: tl.constexpr, HEAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = 0
    for s in range(num_seqs):
        seq += (tl.load(cu_q_ptr + s + 1) <= token).to(tl.int32)
    q_start = tl.load(cu_q_ptr + seq)
    q_end = tl.load(cu_q_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    pos = seq_len - (q_end - q_start) + (token - q_start)
    g = tl.arange(0, GROUP)
    d = tl.arange(0, HEAD)
    rows = tl.arange(0, BLOCK_SIZE)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :]).to(tl.float32)
    m = tl.full([GROUP], -1e30, tl.float32)
    total = tl.zeros([GROUP], tl.float32)
    acc = tl.zeros([GROUP, HEAD], tl.float32)
    for blk in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        page = tl.load(block_table_ptr + seq * stride_bt + blk).to(tl.int64)
        j = blk * BLOCK_SIZE + rows
        k = tl.load(k_ptr + page * stride_kb + rows[:, None] * stride_ks + kv_head * stride_kh + d[None, :])
        v = tl.load(v_ptr + page * stride_vb + rows[:, None] * stride_vs + kv_head * stride_vh + d[None, :])
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if FP8:
            k = k * tl.load(k_descale_ptr)
            v = v * tl.load(v_descale_ptr)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        visible = (j < seq_len) & ((window == 0) | (j > pos - window))
        scores = tl.where(visible[None, :], scores, float("-inf"))
        top = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - top[:, None])
        alpha = tl.exp(m - top)
        total = total * alpha + tl.sum(p, axis=1)
        acc = rescale(acc, alpha) + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = top
    out = acc / total[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty))


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D=None,
                      num_par_softmax_segments=None, softmax_segm_output=None, softmax_segm_max=None,
                      softmax_segm_expsum=None, alibi_slopes=None, output_scale=None, qq_bias=None, sinks=None,
                      kv_quant_mode=KVQuantMode.NONE):
    assert not causal and sinks is None and softcap == 0, "the stand-in serves non-causal rows without sinks"
    logger.debug_once("stand-in unified_attention")
    group = q.shape[1] // k.shape[2]
    kernel_unified_attention[(q.shape[0], k.shape[2])](
        out, q, k, v, block_table, cu_seqlens_q, seqused_k, k_descale, v_descale, softmax_scale,
        window_size[0] + 1 if window_size[0] >= 0 else 0, len(seqused_k), q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), block_table.stride(0), out.stride(0),
        out.stride(1), GROUP=group, HEAD=q.shape[2], BLOCK_SIZE=v.shape[1],
        FP8=kv_quant_mode == KVQuantMode.FP8_PER_TENSOR, num_warps=4)
"""


def write_attention_tree(root: Path, unified: str = UNIFIED) -> Path:
    """The stand-in tree under ``root`` (the folder ``--peer`` takes), with ``unified`` as
    its ``triton_unified_attention.py``."""
    ops = root / source.ATTENTION_OPS
    ops.mkdir(parents=True)
    (ops / "triton_attention_helpers.py").write_text(textwrap.dedent(HELPERS))
    (ops / "triton_unified_attention.py").write_text(textwrap.dedent(unified))
    return root
