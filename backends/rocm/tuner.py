"""The ROCm backend's use of :mod:`dflash_rocm.tuning`: identity, workloads, candidates
around the table's choice, and a runner that times the Triton kernel on the GPU."""

from __future__ import annotations

import functools
import hashlib
import inspect
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch

from dflash_rocm.version import __version__
from dflash_rocm import envs, tuning
from dflash_rocm.backends.triton import attention_kernels
from dflash_rocm.backends.triton.attention import plan_attention, run_draft_attention
from dflash_rocm.backends.triton.launch_config import MERGES, AttentionLaunchConfig
from dflash_rocm.contract import dtype_name
from dflash_rocm.ops import ATTENTION
from dflash_rocm.ops.attention import AttentionCall, AttentionSpec, attention_call
from dflash_rocm.planning import PlanningRecord, record_for
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


@functools.lru_cache(maxsize=256)
def cached_identity(platform: Platform, spec: AttentionSpec, query_limit: int) -> dict:
    """:func:`identity`, built once per (platform, spec, limit). Calls never need it: they
    find their tuned table by that triple (see :func:`tuned_config`)."""
    return identity(platform, spec, query_limit)


WARP_COUNTS = (1, 2, 4, 8, 16)
MAX_BLOCK = 256  # twice the largest tile the tables or the candidates use
MAX_STAGES = 8  # the tables and the candidates use 1 or 2
MAX_WAVES_PER_EU = 16
MAX_SEGMENT_KEYS = 1 << 20
MATRIX_INSTR_NONKDIMS = (0, 16, 32)  # 0: the compiler's choice; 16 or 32: MFMA tile edge
BOOL_FIELDS = ("fp16_dots", "fp8_k_at_load")  # the launch fields that are switches


def launch_config_from_dict(d: object, group: int, family: str) -> AttentionLaunchConfig:
    """A tuned entry's config, validated like a table entry: exactly the launch fields,
    ints (``merge`` one of :data:`MERGES`, the :data:`BOOL_FIELDS` bools), power-of-two tiles of 16..256 rows with
    ``block_m >= group`` (each tile holds whole query tokens), segments within the
    family's table limit, a warp count the compiler takes, stages >= 1 and waves per EU
    >= 0 within sane bounds. ``ValueError`` says what is wrong. (What still fails to
    compile is caught at launch: see ``TunedAttention`` in this package.)"""
    if not isinstance(d, dict):
        raise ValueError(f"config: expected an object, got {type(d).__name__}")
    fields = set(AttentionLaunchConfig.__dataclass_fields__)
    if set(d) != fields:
        unknown, missing = sorted(set(d) - fields), sorted(fields - set(d))
        raise ValueError(f"config keys: unknown {unknown}, missing {missing}")
    for name, value in d.items():
        if name == "merge":
            if value not in MERGES:
                raise ValueError(f"config merge: expected one of {MERGES}, got {value!r}")
        elif name in BOOL_FIELDS:
            if not isinstance(value, bool):
                raise ValueError(f"config {name}: expected a bool, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config {name}: expected an int, got {value!r}")
    for name in ("block_m", "block_n"):
        value = d[name]
        if not 16 <= value <= MAX_BLOCK or value & (value - 1):
            raise ValueError(f"config {name}: expected a power of two in 16..{MAX_BLOCK}, got {value}")
    if d["block_m"] < group:
        raise ValueError(f"config block_m {d['block_m']} is smaller than the GQA group {group}")
    max_segments = tables.MAX_SEGMENTS.get(family, 1)
    if not 1 <= d["num_segments"] <= max_segments:
        raise ValueError(f"config num_segments: expected 1..{max_segments} on {family}, got {d['num_segments']}")
    if d["num_warps"] not in WARP_COUNTS:
        raise ValueError(f"config num_warps: expected one of {WARP_COUNTS}, got {d['num_warps']}")
    if not 1 <= d["num_stages"] <= MAX_STAGES:
        raise ValueError(f"config num_stages: expected 1..{MAX_STAGES}, got {d['num_stages']}")
    if not 0 <= d["waves_per_eu"] <= MAX_WAVES_PER_EU:
        raise ValueError(f"config waves_per_eu: expected 0..{MAX_WAVES_PER_EU}, got {d['waves_per_eu']}")
    if not 0 <= d["min_segment_keys"] <= MAX_SEGMENT_KEYS:
        raise ValueError(f"config min_segment_keys: expected 0..{MAX_SEGMENT_KEYS}, got {d['min_segment_keys']}")
    if d["matrix_instr_nonkdim"] not in MATRIX_INSTR_NONKDIMS:
        raise ValueError(f"config matrix_instr_nonkdim: expected one of {MATRIX_INSTR_NONKDIMS}, "
                         f"got {d['matrix_instr_nonkdim']}")
    return AttentionLaunchConfig(**d)


def entry_check(spec: AttentionSpec, platform: Platform) -> tuning.EntryCheck:
    """What :func:`tuning.tune` runs on every loaded entry of this spec's table."""
    group = spec.num_q_heads // spec.num_kv_heads

    def check(entry: tuning.TunedEntry) -> None:
        config = launch_config_from_dict(entry.best, group, platform.family)
        if config.num_stages > tables.stage_limit(platform.arch):
            raise ValueError(f"config num_stages: at most {tables.stage_limit(platform.arch)} on {platform.arch}, "
                             f"got {config.num_stages}")

    return check


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
    stages, waves per EU and (when split) the merge."""
    s = default.num_segments
    variants = [replace(default, num_segments=n) for n in (s * 2, s // 2, s // 4, 1) if 1 <= n <= 64]
    variants += [replace(default, block_m=m) for m in (16, 32, 64, 128) if m >= max(group, default.merge_rows)]
    variants += [replace(default, block_n=n) for n in (32, 64, 128)]
    variants += [replace(default, num_warps=8 if default.num_warps == 4 else 4),
                 replace(default, num_stages=2 if default.num_stages == 1 else 1)]
    variants += [replace(default, waves_per_eu=w) for w in (1, 2, 4) if w != default.waves_per_eu]
    if s > 1:
        variants += [replace(default, merge=m) for m in MERGES]
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
        planned = plan_attention(*record_for(ATTENTION.name, "rocm", call), config)  # once, as a served call's plan
        return median_seconds(lambda _: planned.run(call), device, warmup=2, repeats=10,
                              setup=flush.zero_ if flush is not None else None)

    return tuning.Runner(run, time)


@dataclass(frozen=True)
class TunedConfigs:
    """A spec's tuned table with its configs built once, indexed for per-call lookups."""

    table: tuning.TunedTable
    index: tuning.WorkloadIndex[AttentionLaunchConfig]

    @classmethod
    def of(cls, table: tuning.TunedTable, spec: AttentionSpec, platform: Platform) -> "TunedConfigs":
        group = spec.num_q_heads // spec.num_kv_heads
        return cls(table, tuning.WorkloadIndex(
            (e.workload, launch_config_from_dict(e.best, group, platform.family)) for e in table.entries))


class TablesKey(NamedTuple):
    """What a tuned table in memory was tuned under: the platform, the spec, the query
    limit, the engine's batch limit and model length (they decide the workloads tuned) and
    the cache directory (``DFLASH_ROCM_CACHE_DIR``; "": the default location) it was read
    from and written to. A plan looks its table up under its record's values
    (:func:`planned_key`), so it never gets a table tuned under other settings."""

    platform: Platform
    spec: AttentionSpec
    query_limit: int
    batch_limit: int
    max_model_len: int
    cache_dir: str


_tables: dict[TablesKey, TunedConfigs] = {}
_tables_lock = threading.Lock()


def current_key(platform: Platform, spec: AttentionSpec) -> TablesKey:
    """The key of ``spec``'s table on ``platform`` under the settings now (tuning)."""
    engine = settings.current()
    return TablesKey(platform=platform, spec=spec, query_limit=settings.effective_query_limit(),
                     batch_limit=engine.batch_limit, max_model_len=engine.max_model_len,
                     cache_dir=envs.CACHE_DIR.setting())


def planned_key(record: PlanningRecord, spec: AttentionSpec) -> TablesKey:
    """:func:`current_key` as the planning ``record`` holds the settings."""
    return TablesKey(platform=record.platform, spec=spec, query_limit=settings.planned_effective_query_limit(record),
                     batch_limit=record.settings.batch_limit, max_model_len=record.settings.max_model_len,
                     cache_dir=record.switches.cache_dir)


def tune_attention(platform: Platform, spec: AttentionSpec, device: torch.device, *, runner_for=None,
                   progress=None, path: Path | None = None) -> tuning.TunedTable:
    """The tuned table for ``spec`` on this GPU under the settings now: from memory, from
    disk, or tuned now (``warm_up`` and ``dflash-rocm tune`` call this; a plan only looks
    the table up: :func:`tuned_config`). A cache fault never raises here (see
    :mod:`dflash_rocm.tuning`); a table that changes moves the tuned tables' generation."""
    key = current_key(platform, spec)
    with _tables_lock:
        if key in _tables:
            return _tables[key].table
    ident = cached_identity(platform, spec, key.query_limit)
    todo = workloads(key.query_limit, key.batch_limit, key.max_model_len, spec.sliding_window)

    def default_for(w):
        return tables.segmented_config(table_workload(platform, spec, w))[1]

    def candidates_for(w, default):  # only what a loaded entry may hold (launch_config_from_dict)
        return [c for c in candidates(default, spec.num_q_heads // spec.num_kv_heads)
                if c.num_segments <= tables.MAX_SEGMENTS[platform.family]
                and c.num_stages <= tables.stage_limit(platform.arch)]

    table = tuning.tune(ident, todo, default_for, candidates_for,
                        runner_for or (lambda w: gpu_runner(spec, w, device)), path=path, progress=progress,
                        check=entry_check(spec, platform))
    configs = TunedConfigs.of(table, spec, platform)
    with _tables_lock:
        tuning.tables_changed()
        return _tables.setdefault(key, configs).table


def tuned_config(key: TablesKey, batch: int, query_len: int, key_span: int) -> AttentionLaunchConfig | None:
    """The tuned config for one call, or None (no table tuned under ``key``, or no tuned
    workload covers the call: the table's config applies). A lookup: a dict and a few
    bisections; it never tunes."""
    configs = _tables.get(key)
    return None if configs is None else configs.index.find(batch, query_len, key_span)


def forget_config(key: TablesKey, spec: AttentionSpec, config: AttentionLaunchConfig) -> None:
    """Stop using ``config`` in the table under ``key`` in this process (it failed at launch)."""
    with _tables_lock:
        configs = _tables.get(key)
        if configs is None:
            return
        entries = [e for e in configs.table.entries if e.best != config.as_dict()]
        _tables[key] = TunedConfigs.of(tuning.TunedTable(configs.table.identity, entries), spec, key.platform)
        tuning.tables_changed()


def last_path(spec: AttentionSpec, platform: Platform) -> Path:
    """Where the table for ``spec`` on ``platform`` lives."""
    return tuning.table_path(cached_identity(platform, spec, settings.effective_query_limit()))


def forget_tables() -> None:
    """Drop the in-process tables (tests; a changed cache directory)."""
    with _tables_lock:
        _tables.clear()
        tuning.tables_changed()
