"""The ROCm backend's use of :mod:`dflash_rocm.tuning`: identity, workloads, candidates
around the table's choice, and a runner that times the Triton kernel on the GPU."""

from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from dataclasses import replace
from pathlib import Path

import torch

from dflash_rocm.version import __version__
from dflash_rocm import tuning
from dflash_rocm.backends.triton import attention_kernels
from dflash_rocm.backends.triton.attention import run_draft_attention
from dflash_rocm.backends.triton.launch_config import AttentionLaunchConfig
from dflash_rocm.contract import dtype_name
from dflash_rocm.ops.attention import AttentionCall, AttentionSpec, attention_call
from dflash_rocm.platform import Platform
from dflash_rocm.timing import median_seconds

from . import settings, tables

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
SPAN_BUCKETS = (1024, 4096, 16384, 65536, 131072)


@functools.lru_cache(maxsize=1)
def kernel_source_hash() -> str:
    return hashlib.sha256(inspect.getsource(attention_kernels).encode()).hexdigest()[:16]


def identity(platform: Platform, spec: AttentionSpec, query_limit: int) -> dict:
    import triton
    return {"arch": platform.arch, "device": platform.name, "compute_units": platform.compute_units,
            "torch": torch.__version__, "triton": triton.__version__, "dflash_rocm": __version__,
            "kernel": kernel_source_hash(), "dtype": dtype_name(spec.dtype),
            "cache_dtype": dtype_name(spec.cache_dtype), "num_q_heads": spec.num_q_heads,
            "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "block_size": spec.block_size,
            "causal": spec.causal, "sliding_window": spec.sliding_window, "sinks": spec.sinks,
            "query_limit": query_limit}


def workloads(query_limit: int, batch_limit: int, max_model_len: int,
              sliding_window: int | None = None) -> list[tuning.Workload]:
    """DFlash steps within the limits: every request's query is the query limit; key
    spans from 1k to the model length (window-bounded)."""
    batches = sorted({b for b in BATCH_BUCKETS if b <= batch_limit} | {batch_limit})
    longest = max_model_len if sliding_window is None else min(max_model_len, sliding_window + query_limit - 1)
    spans = sorted({s for s in SPAN_BUCKETS if s < longest} | {longest})
    return [tuning.Workload(b, query_limit, s) for b in batches for s in spans]


def table_workload(platform: Platform, spec: AttentionSpec, w: tuning.Workload) -> tables.AttentionWorkload:
    return tables.AttentionWorkload(platform.arch, w.batch, w.query_len, w.key_span, spec.num_q_heads,
                                    spec.num_kv_heads, spec.head_dim, spec.fp8, platform.compute_units)


def candidates(default: AttentionLaunchConfig, group: int) -> list[AttentionLaunchConfig]:
    """Single changes around the table's config: the split, the tile shape, warps,
    stages and waves per EU."""
    s = default.num_segments
    variants = [replace(default, num_segments=n) for n in (s * 2, s // 2, s // 4, 1) if 1 <= n <= 64]
    variants += [replace(default, block_m=m) for m in (16, 32, 64, 128) if m >= group]
    variants += [replace(default, block_n=n) for n in (32, 64, 128)]
    variants += [replace(default, num_warps=8 if default.num_warps == 4 else 4),
                 replace(default, num_stages=2 if default.num_stages == 1 else 1)]
    variants += [replace(default, waves_per_eu=w) for w in (1, 2, 4) if w != default.waves_per_eu]
    unique = []
    for v in variants:
        if v != default and v not in unique:
            unique.append(v)
    return unique


def synthetic_call(spec: AttentionSpec, w: tuning.Workload, device: torch.device, seed: int = 1234) -> AttentionCall:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    blocks_per_seq = -(-w.key_span // spec.block_size)
    num_blocks = w.batch * blocks_per_seq
    G = spec.num_q_heads // spec.num_kv_heads

    def cache():
        return torch.randn(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim, generator=g,
                           device=device).to(spec.cache_dtype)

    table = torch.randperm(num_blocks, generator=g, device=device).view(w.batch, blocks_per_seq).to(torch.int32)
    sinks = torch.linspace(-1, 1, spec.num_q_heads, device=device) if spec.sinks else None
    return attention_call(
        torch.randn(w.batch * w.query_len, spec.num_kv_heads * G, spec.head_dim, generator=g,
                    device=device).to(spec.dtype),
        cache(), cache(), table, torch.arange(w.batch + 1, device=device, dtype=torch.int32) * w.query_len,
        torch.full((w.batch,), w.key_span, device=device, dtype=torch.int32), causal=spec.causal,
        sliding_window=spec.sliding_window, sinks=sinks, k_scale=0.125 if spec.fp8 else None,
        v_scale=0.125 if spec.fp8 else None, validate=False, max_query_len=w.query_len,
        max_seq_len=w.key_span)


def gpu_runner(spec: AttentionSpec, w: tuning.Workload, device: torch.device) -> tuning.Runner:
    call = synthetic_call(spec, w, device)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def run(config):
        call.out.fill_(float("nan"))
        run_draft_attention(call, config)
        return call.out

    def time(config):
        return median_seconds(lambda _: run_draft_attention(call, config), device, warmup=2, repeats=10,
                              setup=flush.zero_ if flush is not None else None)

    return tuning.Runner(run, time)


_tables: dict[str, tuning.TunedTable] = {}
_tables_lock = threading.Lock()


def tune_attention(platform: Platform, spec: AttentionSpec, device: torch.device, *, runner_for=None,
                   progress=None, path: Path | None = None) -> tuning.TunedTable:
    """The tuned table for ``spec`` on this GPU: from memory, from disk, or tuned now."""
    limit = settings.effective_query_limit()
    ident = identity(platform, spec, limit)
    key = tuning.identity_digest(ident)
    with _tables_lock:
        if key in _tables:
            return _tables[key]
    s = settings.current()
    todo = workloads(limit, s.batch_limit, s.max_model_len, spec.sliding_window)

    def default_for(w):
        return tables.segmented_config(table_workload(platform, spec, w))[1]

    table = tuning.tune(ident, todo, default_for,
                        lambda w, d: candidates(d, spec.num_q_heads // spec.num_kv_heads),
                        runner_for or (lambda w: gpu_runner(spec, w, device)), path=path, progress=progress)
    with _tables_lock:
        _tables[key] = table
    return table


def last_path(spec: AttentionSpec, platform: Platform) -> Path:
    """Where the table for ``spec`` on ``platform`` lives."""
    return tuning.table_path(identity(platform, spec, settings.effective_query_limit()))


def forget_tables() -> None:
    """Drop the in-process tables (tests; a changed cache directory)."""
    with _tables_lock:
        _tables.clear()
