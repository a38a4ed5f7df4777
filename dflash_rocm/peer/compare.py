"""This package's draft attention beside vLLM's own kernels for the same call, one model.

For each case (target, batch, context; bf16 KV, fp8 KV, or a sliding window) the
package's launches are captured, compiled and modelled by the audit (:mod:`dflash_rocm.audit.run`),
and vLLM's by the same compiler and model after running vLLM's own host code on ``meta``
tensors (:mod:`.source`, :mod:`.capture`, :mod:`.traffic`), along each path vLLM has for a
non-causal DFlash draft:

- ``triton_2d``: TRITON_ATTN's ``unified_attention`` as vLLM 0.34 calls it (its builder's
  split-KV threshold and scratch; multi-row non-causal queries take the 2D launch);
- ``triton_3d``: the same host code where vLLM#57409's rule would send the call to the
  segmented 3D launch (+ ``reduce_segments``): non-causal rows without a sliding window,
  sinks or quantized KV, when the scratch (``min(128 // Hk, max_num_seqs) x (1 + k)`` rows)
  holds every query token; 128 segments on ROCm, vLLM's 16 on CUDA. The rule is applied
  here, from the PR's description (it is not in 0.34): 0.34's host code is run with its
  3D gate open (the causal flag set for the gate and cleared in the recorded launch,
  ``MAX_3D_QUERY_LEN`` raised to the block). Where the rule keeps the 2D launch, the row
  says so and carries the 2D time;
- ``rocm_attn``: ROCM_ATTN's ``chunked_prefill_paged_decode`` (``prefix_prefill``'s
  kernel for the multi-row queries, then the decode launch whose programs all skip them;
  the Triton decode kernel stands for vLLM's HIP ``paged_attention_rocm`` there) on its
  x-packed pages. ROCm only: on sm_90 vLLM runs FLASH_ATTN (CUDA C++, not modelled).

Caches are as vLLM allocates them: on CDNA (gfx942/gfx950) a per-layer tensor over 2 GiB
(no buffer loads, for either side), elsewhere the case's own size.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from dflash_rocm.audit import run, sweep
from dflash_rocm.audit.compiler import FactsCache, compile_all, specialise
from dflash_rocm.audit.model import model_launch
from dflash_rocm.audit.targets import TARGETS, Target
from dflash_rocm.audit.traffic import programs_of
from dflash_rocm.launches import Launch
from dflash_rocm.workloads import SHAPES, DraftShape

from . import capture, source, traffic

META = torch.device("meta")
SHAPE = SHAPES["qwen3-8b-dflash-b16"]
PEER_TARGETS = ("gfx942", "gfx950", "gfx1201", "sm_90")
BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
VARIANTS = ("bf16", "fp8", "swa")
SWA_WINDOW = 2048  # the sliding-window rows: a 2048-key window (as published DFlash drafts use), bf16 KV
PATHS = ("triton_2d", "triton_3d", "rocm_attn")
PATH_NAMES = {"triton_2d": "TRITON_ATTN 2D", "triton_3d": "TRITON_ATTN 3D (#57409)", "rocm_attn": "ROCM_ATTN"}
MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM 0.34 triton_attn.py: seq_threshold_3D = this // Hk
NUM_PAR_SOFTMAX_SEGMENTS = 16  # vLLM 0.34 triton_attn.py
ROCM_SEGMENTS = 128  # vLLM#57409 on ROCm
MAX_3D_QUERY_LEN_034 = 8  # vLLM 0.34: the longest query the builder sizes its scratch for


@dataclass(frozen=True)
class PeerCase:
    target: str
    variant: str  # "bf16" | "fp8" | "swa"
    batch: int
    context: int

    @property
    def label(self) -> str:
        return f"b{self.batch} {sweep.kilo(self.context)} {self.variant}"

    def case(self, shape: DraftShape = SHAPE) -> sweep.Case:
        """The audit's case (caches over 2 GiB on CDNA, as vLLM allocates them there)."""
        if self.variant == "swa":
            shape = replace(shape, name=f"{shape.name}+swa{SWA_WINDOW}", sliding_window=SWA_WINDOW)
        large = self.target in ("gfx942", "gfx950")
        return sweep.Case("attention", shape, self.variant == "fp8", batch=self.batch, context=self.context,
                          large_cache=large)


@dataclass
class PathResult:
    us: float | None  # modelled microseconds of the launches vLLM makes on this path (None: cannot serve)
    runs: str  # the launches' kernels, or the path vLLM takes instead
    note: str = ""
    launches: list = field(default_factory=list)  # per launch: kernel, grid, modelled us, bound

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class PeerRow:
    peer: PeerCase
    ours_us: float | None
    paths: dict[str, PathResult]
    ours_note: str = ""

    def ratio(self, path: str) -> float | None:
        """Ours over vLLM's modelled time on ``path`` (below 1: ours is faster)."""
        theirs = self.paths[path].us
        return None if theirs is None or self.ours_us is None else self.ours_us / theirs


def _caches(case: sweep.Case, dtype: torch.dtype, packed: bool):
    """K and V as vLLM's backend hands them to its kernel: TRITON_ATTN's
    ``[blocks, Hk, bs, 2D]`` tensor transposed and split; ROCM_ATTN's ``[blocks, 2, bs, Hk*D]``
    reread as x-packed K ``[blocks, Hk, D/x, bs, x]`` and V ``[blocks, Hk, D, bs]``."""
    s, bs = case.shape, sweep.BLOCK_SIZE
    needed = case.batch * -(-case.seq_len // bs) + 1
    per_block = 2 * bs * s.kv_heads * s.head_dim * dtype.itemsize
    blocks = max(needed, sweep.LARGE_CACHE_BYTES // per_block) if case.large_cache else needed
    if packed:
        x = 16 // dtype.itemsize
        kv = torch.empty(blocks, 2, bs, s.kv_heads * s.head_dim, dtype=dtype, device=META)
        return (kv[:, 0].view(blocks, s.kv_heads, s.head_dim // x, bs, x),
                kv[:, 1].view(blocks, s.kv_heads, s.head_dim, bs))
    kv = torch.empty(blocks, s.kv_heads, bs, 2 * s.head_dim, dtype=dtype, device=META).transpose(1, 2)
    key, value = kv.split(s.head_dim, dim=-1)
    return key, value


def _common(case: sweep.Case) -> dict:
    s = case.shape
    tokens = case.batch * case.query_len
    index = dict(dtype=torch.int32, device=META)
    q = torch.empty(tokens, s.q_heads, s.head_dim, dtype=torch.bfloat16, device=META)
    return dict(q=q, out=torch.empty_like(q), cu_seqlens_q=torch.empty(case.batch + 1, **index),
                seq_lens=torch.empty(case.batch, **index),
                block_table=torch.empty(case.batch, -(-case.seq_len // sweep.BLOCK_SIZE), **index))


def split_kv_refusal(case: sweep.Case) -> str:
    """Why vLLM#57409's rule keeps this call on the 2D launch ("" : it takes the 3D one)."""
    s = case.shape
    rows = min(MIN_LAUNCH_GRID_SIZE_2D // s.kv_heads, case.batch) * case.query_len  # max_num_seqs >= batch
    for reason, refused in (("causal", s.causal), ("sliding window", s.sliding_window), ("sinks", s.sinks),
                            ("fp8 KV", case.fp8),
                            (f"scratch {MIN_LAUNCH_GRID_SIZE_2D // s.kv_heads} x {case.query_len} rows < "
                             f"{case.batch * case.query_len} query tokens", case.batch * case.query_len > rows)):
        if refused:
            return reason
    return ""


@contextlib.contextmanager
def _attribute(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _with_argument(launch: Launch, name: str, value) -> Launch:
    names = list(launch.kernel.signature.parameters)
    args = list(launch.args)
    args[names.index(name)] = value
    return replace(launch, args=tuple(args))


def unified_attention_arguments(module, case: sweep.Case, target: Target, three_d: bool, tensors: dict,
                                descale: torch.Tensor) -> dict:
    """The keyword arguments TRITON_ATTN passes vLLM 0.34's ``unified_attention`` for ``case``
    (``three_d``: with vLLM#57409's split-KV scratch, see the module docstring): ``tensors``
    gives ``q``, ``out``, ``k``, ``v``, ``cu_seqlens_q``, ``seq_lens`` and ``block_table`` (on
    ``meta`` to record the launches, on the device to run them); ``descale`` is the fp8 KV
    scale, ``[1, 1]``. The builder's scratch is allocated beside ``q``."""
    s = case.shape
    threshold = MIN_LAUNCH_GRID_SIZE_2D // s.kv_heads
    segments = (ROCM_SEGMENTS if target.amd else NUM_PAR_SOFTMAX_SEGMENTS) if three_d else NUM_PAR_SOFTMAX_SEGMENTS
    rows = min(threshold, case.batch) * (case.query_len if three_d else min(case.query_len, MAX_3D_QUERY_LEN_034))
    padded = 1 << (s.head_dim - 1).bit_length()
    scratch = dict(dtype=torch.float32, device=tensors["q"].device)
    descale = descale.expand(case.batch, s.kv_heads)
    seq_threshold_3d = max(threshold, case.batch * case.query_len) if three_d else threshold
    return dict(q=tensors["q"], k=tensors["k"], v=tensors["v"], out=tensors["out"],
                cu_seqlens_q=tensors["cu_seqlens_q"], max_seqlen_q=case.query_len, seqused_k=tensors["seq_lens"],
                max_seqlen_k=case.seq_len, softmax_scale=s.head_dim ** -0.5, causal=s.causal or three_d,
                window_size=(s.sliding_window - 1, 0) if s.sliding_window else (-1, -1),
                block_table=tensors["block_table"], softcap=0.0, q_descale=None, k_descale=descale,
                v_descale=descale, seq_threshold_3D=seq_threshold_3d,
                num_par_softmax_segments=segments,
                softmax_segm_output=torch.empty(rows, s.q_heads, segments, padded, **scratch),
                softmax_segm_max=torch.empty(rows, s.q_heads, segments, **scratch),
                softmax_segm_expsum=torch.empty(rows, s.q_heads, segments, **scratch),
                sinks=torch.empty(s.q_heads, **scratch) if s.sinks else None,
                kv_quant_mode=module.KVQuantMode.FP8_PER_TENSOR if case.fp8 else module.KVQuantMode.NONE)


def triton_attn_launches(root: Path, case: sweep.Case, target: Target, split: bool) -> tuple[list[Launch], str]:
    """The launches vLLM 0.34's ``unified_attention`` makes for ``case`` as TRITON_ATTN calls
    it (``split``: under vLLM#57409's rule, see the module docstring), and a note."""
    module = source.load(root, "unified", target)
    dtype = target.fp8_dtype if case.fp8 else torch.bfloat16
    key, value = _caches(case, dtype, packed=False)
    refusal = split_kv_refusal(case) if split else ""
    three_d = split and not refusal
    kwargs = unified_attention_arguments(module=module, case=case, target=target, three_d=three_d,
                                         tensors={**_common(case), "k": key, "v": value},
                                         descale=torch.empty(1, 1, dtype=torch.float32, device=META))
    gate = _attribute(module, "MAX_3D_QUERY_LEN", case.query_len) if three_d else contextlib.nullcontext()
    with source.host_context(root, "unified", target), gate, capture.recording(module) as launches:
        module.unified_attention(**kwargs)
    if three_d and not case.shape.causal:
        launches[0] = _with_argument(launches[0], "USE_CAUSAL", False)
    if split and refusal:
        return launches, f"#57409 keeps 2D ({refusal}): vLLM runs the 2D launch"
    return launches, ""


def rocm_attn_launches(root: Path, case: sweep.Case, target: Target) -> tuple[list[Launch], str]:
    """The launches vLLM 0.34's ``chunked_prefill_paged_decode`` makes for ``case`` as
    ROCM_ATTN calls it (the block's own K/V passed beside the cache)."""
    module = source.load(root, "paged", target)
    prefix = source.load(root, "prefix", target)
    s = case.shape
    dtype = target.fp8_dtype if case.fp8 else torch.bfloat16
    key_cache, value_cache = _caches(case, dtype, packed=True)
    t = _common(case)
    new = torch.empty(t["q"].shape[0], s.kv_heads, s.head_dim, dtype=torch.bfloat16, device=META)
    scale = torch.empty(1, dtype=torch.float32, device=META)
    with source.host_context(root, "paged", target), capture.recording(module, prefix) as launches:
        module.chunked_prefill_paged_decode(
            query=t["q"], key=new, value=new, output=t["out"], kv_cache_dtype="fp8" if case.fp8 else "auto",
            key_cache=key_cache, value_cache=value_cache, block_table=t["block_table"],
            query_start_loc=t["cu_seqlens_q"], seq_lens=t["seq_lens"], max_seq_len=case.seq_len,
            max_query_len=case.query_len, k_scale=scale, v_scale=scale, sliding_window=s.sliding_window,
            sm_scale=s.head_dim ** -0.5, sinks=torch.empty(s.q_heads, dtype=torch.float32, device=META)
            if s.sinks else None, causal=s.causal)
    return launches, "decode launch: vLLM's Triton fallback stands for its HIP paged_attention_rocm (all rows skip)"


def model_peer_launches(case: sweep.Case, target: Target, launches: list[Launch],
                        cache: FactsCache) -> tuple[float | None, list[dict], str]:
    """(modelled seconds of all ``launches``, per-launch summaries, first error) with the
    audit's compiler and model. Compiled in this process: the kernel modules exist only
    here (loaded by path)."""
    specs = [specialise(launch, target) for launch in launches]
    facts, _ = compile_all(specs, cache, jobs=1)
    total, rows = 0.0, []
    for launch, spec in zip(launches, specs):
        found = facts[spec.key]
        if "error" in found:
            return None, rows, f"{launch.name}: {found['error'][:200]}"
        model = model_launch(programs_of(case, launch, traffic.PROGRAMS), found, target,
                             spec.options.get("num_stages", 1), traffic.trip_matrix_flops(launch))
        total += model.seconds
        rows.append({"kernel": launch.name, "grid": list(launch.grid), "us": model.seconds * 1e6,
                     "bound": model.bound, "num_warps": spec.options.get("num_warps"),
                     "num_stages": spec.options.get("num_stages"), "vgpr": found.get("vgpr"),
                     "spills": found.get("vgpr_spills"), "occupancy": model.occupancy.waves_per_simd})
    return total, rows, ""


def path_result(case: sweep.Case, target: Target, cache: FactsCache, make) -> PathResult:
    """One vLLM path: ``make()`` captures its launches; vLLM host code this tool cannot run
    (another vLLM's signature) is the row's finding, not the report's end."""
    try:
        launches, note = make()
    except Exception as exc:
        return PathResult(None, "-", f"vLLM's host code did not run here: {type(exc).__name__}: {exc}"[:200])
    seconds, rows, error = model_peer_launches(case, target, launches, cache)
    runs = " + ".join(launch.name for launch in launches)
    if error:
        return PathResult(None, runs, f"compile error: {error}", rows)
    return PathResult(seconds * 1e6, runs, note, rows)


def peer_paths(root: Path, case: sweep.Case, target: Target, cache: FactsCache) -> dict[str, PathResult]:
    paths = {name: path_result(case, target, cache, lambda split=split: triton_attn_launches(root, case, target, split))
             for name, split in (("triton_2d", False), ("triton_3d", True))}
    if target.amd:
        paths["rocm_attn"] = path_result(case, target, cache, lambda: rocm_attn_launches(root, case, target))
    else:
        paths["rocm_attn"] = PathResult(None, "FLASH_ATTN", "ROCm only: on sm_90 vLLM runs FLASH_ATTN (CUDA C++, "
                                                           "not Triton: not modelled here)")
    return paths


def ours_us(case: sweep.Case, target: Target, cache: FactsCache) -> tuple[float | None, str]:
    """The package's modelled microseconds for ``case`` (the launch table's plan), and an
    error note."""
    try:
        return run.model_case(case, target, cache).required_us(), ""
    except ValueError as why:
        return None, str(why)[:200]


def peer_cases(targets=PEER_TARGETS, batches=BATCHES, contexts=CONTEXTS, variants=VARIANTS) -> list[PeerCase]:
    """Every case of the grid; fp8 only on targets that convert fp8 (gfx1100 does not)."""
    return [PeerCase(t, v, b, c) for t in targets for v in variants for b in batches for c in contexts
            if v != "fp8" or TARGETS[t].fp8_dtype is not None]


def compare(root: Path, cases: list[PeerCase], cache: FactsCache, shape: DraftShape = SHAPE,
            progress=None) -> list[PeerRow]:
    """One row per case: ours and each vLLM path, modelled by the same model."""
    rows = []
    for i, peer in enumerate(cases):
        if progress:
            progress(i, len(cases), f"{peer.target} {peer.label}")
        target = TARGETS[peer.target]
        case = peer.case(shape)
        ours, note = ours_us(case, target, cache)
        rows.append(PeerRow(peer, ours, peer_paths(root, case, target, cache), note))
    return rows

