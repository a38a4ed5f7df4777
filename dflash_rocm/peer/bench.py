"""``dflash-rocm bench --peer PATH``: vLLM's own draft-attention kernel timed beside ours on
this device, at the same real shapes, each beside its modelled time.

For each case (batch, context; bf16 KV, fp8 KV or a 2048-key sliding window, Qwen3-8B draft
heads) one set of inputs serves both sides: our modelled backend (``rocm`` on AMD, ``triton``
elsewhere, as ``bench`` models) through :func:`dflash_rocm.api.draft_attention`, and vLLM
0.34's ``unified_attention`` loaded from the tree (:mod:`.source`) and called with the very
arguments TRITON_ATTN passes it (:func:`.compare.unified_attention_arguments`) on the same
paged cache (TRITON_ATTN's K and V halves are ``[blocks, block_size, Hk, D]``, our layout).
vLLM's own host code then picks its launch (the 2D one for 16-row queries in 0.34). Each
side's output is checked once against the reference (SPEC.md's tolerance), so a wrong launch
is an error row rather than a fast one; then both are timed in turns with
:mod:`dflash_rocm.timing` (device events, an L2 flush before each call, two input sets
rotating). Beside them: each side's modelled time on this device (the audit's model, as
``inspect --peer``), and measured / modelled. ROCM_ATTN and the split-KV 3D launch of
vLLM#57409 are modelled only (``inspect --peer``).

On a CPU (Triton's interpreter, a scaled-down draft, tiny contexts) it runs end to end as a
smoke test: vLLM's files load as for sm_90, nothing is modelled, and the "bf16" cases run in
fp16, as the interpreter computes bf16 wrongly (vLLM 0.34's own kernel there: relative error
2.5e9 in bf16, within tolerance in fp16).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_rocm import dispatch
from dflash_rocm.api import draft_attention
from dflash_rocm.audit import run, targets
from dflash_rocm.audit.compiler import FactsCache, default_cache_dir
from dflash_rocm.audit.targets import TARGETS, Target
from dflash_rocm.bench import MAX_CACHE_TOKENS
from dflash_rocm.contract import relative_error, spec_tolerance
from dflash_rocm.floors import peak_for
from dflash_rocm.ops import ATTENTION
from dflash_rocm.platform import platform_for
from dflash_rocm.report import format_table, wrap
from dflash_rocm.timing import interleaved_median_seconds, l2_flush
from dflash_rocm.workloads import attention_inputs

from . import compare, source

GPU_BATCHES = (1, 8)
GPU_CONTEXTS = (8192, 131072)
GPU_VARIANTS = compare.VARIANTS
CPU_BATCHES = (1,)
CPU_CONTEXTS = (24,)
CPU_VARIANTS = ("bf16",)
CPU_LOAD_TARGET = "sm_90"  # on a CPU vLLM's files load as for this target (its CUDA branches)


@dataclass
class PeerTiming:
    """One case: ours and vLLM's measured and modelled microseconds (None: not measured or
    not modelled; ``note`` says why; an ``ERROR`` note fails the run)."""

    case: str
    backend: str  # ours
    vllm_runs: str  # the kernels vLLM's host code launches for this case
    ours_us: float | None = None
    vllm_us: float | None = None
    ours_model_us: float | None = None
    vllm_model_us: float | None = None
    ours_error: float | None = None  # relative error against the reference
    vllm_error: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """Ours over vLLM's measured time (below 1: ours is faster)."""
        return _over(self.ours_us, self.vllm_us)

    @property
    def ours_vs_model(self) -> float | None:
        return _over(self.ours_us, self.ours_model_us)

    @property
    def vllm_vs_model(self) -> float | None:
        return _over(self.vllm_us, self.vllm_model_us)

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "ratio": self.ratio, "ours_vs_model": self.ours_vs_model,
                "vllm_vs_model": self.vllm_vs_model}


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def modelled_backend(device: torch.device) -> str:
    """Ours: the backend ``inspect`` models on this device (as :func:`dflash_rocm.bench.modelled_us`)."""
    return targets.modelled_backend(platform_for(device).vendor)


def device_target(device: torch.device) -> Target | None:
    """The audit's model of this device (None on a CPU or an unmodelled GPU)."""
    platform = platform_for(device)
    return run.target_for(platform, peak_for(platform))


def peer_cases(device: torch.device, batches=None, contexts=None) -> list[compare.PeerCase]:
    """The cases timed here; refuses, before any work, a batch x context past ``bench``'s
    cache limit (:data:`dflash_rocm.bench.MAX_CACHE_TOKENS`)."""
    cpu = device.type == "cpu"
    target = device_target(device)
    name = target.arch if target else CPU_LOAD_TARGET
    fp8 = (target or TARGETS[CPU_LOAD_TARGET]).fp8_dtype is not None
    cases = [compare.PeerCase(name, variant, b, c) for variant in (CPU_VARIANTS if cpu else GPU_VARIANTS)
             for b in (batches or (CPU_BATCHES if cpu else GPU_BATCHES))
             for c in (contexts or (CPU_CONTEXTS if cpu else GPU_CONTEXTS)) if variant != "fp8" or fp8]
    over = [c for c in cases if c.batch * c.context > MAX_CACHE_TOKENS]
    if over:
        raise ValueError(f"--peer: B={over[0].batch} ctx={over[0].context} needs more than {MAX_CACHE_TOKENS} cached "
                         "tokens (batch x context): choose a smaller --batch or --context")
    return cases


class _Vllm:
    """vLLM's ``unified_attention`` bound to one input set, as TRITON_ATTN calls it."""

    def __init__(self, module, case, target: Target, inputs):
        self.module = module
        scale = inputs.kwargs["k_scale"] or 1.0
        self.out = torch.empty_like(inputs.query)
        tensors = dict(q=inputs.query, out=self.out, k=inputs.key_cache, v=inputs.value_cache,
                       cu_seqlens_q=inputs.query_start_loc, seq_lens=inputs.seq_lens, block_table=inputs.block_table)
        descale = torch.full((1, 1), scale, dtype=torch.float32, device=inputs.query.device)
        self.kwargs = compare.unified_attention_arguments(module=module, case=case, target=target, three_d=False,
                                                          tensors=tensors, descale=descale)

    def __call__(self):
        self.module.unified_attention(**self.kwargs)
        return self.out


def time_case(root: Path, peer: compare.PeerCase, device: torch.device, cache: FactsCache | None, *, warmup: int,
              repeats: int) -> PeerTiming:
    """One case, both sides on ``device`` (see the module docstring)."""
    target = device_target(device)
    load_target = target or TARGETS[CPU_LOAD_TARGET]
    case = peer.case(compare.SHAPE.scaled_for_cpu() if device.type == "cpu" else compare.SHAPE)
    dtype = torch.float16 if device.type == "cpu" else torch.bfloat16
    cache_dtype = load_target.fp8_dtype if case.fp8 else dtype
    sets = [attention_inputs(case.shape, case.batch, case.context, dtype, cache_dtype, device, seed=s)
            for s in range(2)]
    case = dataclasses.replace(case, large_cache=sets[0].key_cache.untyped_storage().nbytes() > 2 ** 31 - 1)
    backend = modelled_backend(device)
    try:  # vLLM's host code on meta tensors: the launches it makes (and the model's input)
        launches, _ = compare.triton_attn_launches(root, case, load_target, split=False)
    except Exception as exc:  # another vLLM's signature: this case's finding, not the run's end
        return PeerTiming(case=peer.label, backend=backend, vllm_runs="-",
                          note=f"ERROR vLLM's host code did not run here: {type(exc).__name__}: {exc}"[:300])
    row = PeerTiming(case=peer.label, backend=backend, vllm_runs=" + ".join(x.name for x in launches))
    if target is not None:
        row.ours_model_us, note = compare.ours_us(case, target, cache)
        seconds, _, error = compare.model_peer_launches(case, target, launches, cache)
        row.vllm_model_us = None if seconds is None else seconds * 1e6
        row.note = "; ".join(f"ERROR model: {x}" for x in (note, error) if x)
    reasons = dispatch.reasons_for(backend, ATTENTION, ATTENTION.build_call(*sets[0].args(), **sets[0].kwargs))
    if reasons:
        row.note = f"ERROR {backend} cannot serve this case here: {'; '.join(reasons)}"[:300]
        return row
    module = source.load(root, "unified", load_target)
    ours = [lambda s=s: draft_attention(*s.args(), **s.kwargs, backend=backend, validate=False) for s in sets]
    tolerance = spec_tolerance(dtype, cache_dtype)
    with source.host_context(root, "unified", load_target):
        try:
            theirs = [_Vllm(module, case, load_target, s) for s in sets]
            reference = draft_attention(*sets[0].args(), **sets[0].kwargs, backend="reference", validate=False)
            row.ours_error = relative_error(ours[0](), reference)
            row.vllm_error = relative_error(theirs[0](), reference)
        except Exception as exc:  # the row says what failed; the other cases still run
            row.note = f"ERROR vLLM's unified_attention did not run here: {type(exc).__name__}: {exc}"[:300]
            return row
        wrong = [f"{name} {err:.2g}" for name, err in (("ours", row.ours_error), ("vLLM", row.vllm_error))
                 if not err <= tolerance]
        if wrong:
            row.note = f"ERROR output differs from the reference beyond {tolerance:g}: {', '.join(wrong)}"
            return row
        seconds = interleaved_median_seconds({"ours": lambda i: ours[i % 2](), "vllm": lambda i: theirs[i % 2]()},
                                             device, warmup=warmup, repeats=repeats, setup=l2_flush(device))
    row.ours_us, row.vllm_us = seconds["ours"] * 1e6, seconds["vllm"] * 1e6
    return row


def peer_timings(root: Path, device: torch.device, *, batches=None, contexts=None, repeats: int | None = None,
                 progress=None) -> list[PeerTiming]:
    cpu = device.type == "cpu"
    cache = FactsCache(default_cache_dir()) if device_target(device) else None  # None: nothing to model
    cases = peer_cases(device, batches, contexts)
    rows = []
    for i, peer in enumerate(cases):
        if progress:
            progress(i, len(cases), peer.label)
        rows.append(time_case(root, peer, device, cache, warmup=0 if cpu else 3, repeats=repeats or (1 if cpu else 20)))
    return rows


def header(root: Path, device: torch.device, version: str) -> str:
    platform = platform_for(device)
    where = (f"{platform.name} ({platform.arch})" if device.type != "cpu" else
             f"CPU: Triton's interpreter, a scaled-down draft in fp16, {CPU_LOAD_TARGET}'s branches of vLLM's "
             "files; the times say nothing about any GPU (a smoke test)")
    return (f"vLLM's TRITON_ATTN kernel ({version}, from {root}) beside ours, measured on {where}; "
            "model = the audit's (inspect --peer); ratio = ours / vLLM's measured; x = measured / model")


def _num(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_rows(rows: list[PeerTiming], head: str, width: int | None) -> str:
    table = format_table(
        ["case", "ours", "ours us", "vLLM us", "ratio", "ours model", "ours x", "vLLM model", "vLLM x",
         "vLLM runs", "note"],
        [(r.case, r.backend, _num(r.ours_us), _num(r.vllm_us), _num(r.ratio, ".2f"), _num(r.ours_model_us),
          _num(r.ours_vs_model, ".2f"), _num(r.vllm_model_us), _num(r.vllm_vs_model, ".2f"), r.vllm_runs, r.note)
         for r in rows], width=width, wrap_columns=("vLLM runs", "note"), omit_empty=("note",))
    return f"{wrap(head, width)}\n{table}"


def to_json(rows: list[PeerTiming], head: str) -> str:
    return json.dumps({"device": head, "rows": [r.as_dict() for r in rows]}, indent=2)


def failed(rows: list[PeerTiming]) -> list[PeerTiming]:
    """The rows that fail the run: an error, or no time for either side."""
    return [r for r in rows if "ERROR" in r.note or r.ours_us is None or r.vllm_us is None]
