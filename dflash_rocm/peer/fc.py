"""The draft's ``fc`` context projection under tensor parallelism, modelled (``inspect --tp``).

vLLM builds ``fc`` (``[A x H] -> [H]``: the ``A`` target layers' hidden states concatenated,
projected to the draft's hidden size) as a ``ReplicatedLinear``: every rank reads the whole
weight every step (168 MB for the Qwen3-8B draft, A = 5). Column-parallel, each rank would
read ``1/TP`` of it, compute its ``H/TP`` output columns and all-gather the others' (the
precompute's RMSNorm and every draft layer need the whole hidden vector).

Per rank: a GEMM launch costs the launch gap plus the longer of its bytes at peak DRAM
bandwidth and its FLOPs at the dense bf16 peak (a vendor GEMM at its floor: the audit's
target figures); an all-gather costs a fixed latency plus the bytes one peer sends over one
link (a fully connected mesh: every peer's share arrives over its own link, in parallel).
The interconnect figures are assumptions, printed with the table: MI300X has 7 xGMI links of
16 lanes at 32 GT/s, 64 GB/s each way (AMD); the all-gather's latency is an estimate, not a
measurement, so the table also prints the latency at which the sharded ``fc`` stops paying.
Only targets with an interconnect figure here are modelled.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from dflash_rocm.audit.targets import TARGETS, Target
from dflash_rocm.report import WIDTH, format_table
from dflash_rocm.workloads import SHAPES, DraftShape

AUX_LAYERS = 5  # target layers whose states fc projects (z-lab's DFlash checkpoints: 5 target_layer_ids)
TOKENS = (16, 256, 1024)  # context tokens per step


@dataclass(frozen=True)
class Interconnect:
    name: str
    link_bytes_per_s: float  # one direction of one GPU-to-GPU link
    all_gather_latency_s: float  # a small all-gather's fixed cost (estimate)


INTERCONNECTS = {
    "gfx942": Interconnect("xGMI (7 links x 64 GB/s each way, fully connected)", 64e9, 10e-6),
}


@dataclass(frozen=True)
class FcCost:
    target: str
    shape: str
    tp: int
    tokens: int
    replicated_s: float
    sharded_gemm_s: float
    all_gather_s: float
    weight_bytes_per_rank: float  # sharded
    weight_bytes: float  # replicated

    @property
    def sharded_s(self) -> float:
        return self.sharded_gemm_s + self.all_gather_s

    @property
    def break_even_latency_s(self) -> float:
        """The all-gather latency at which the sharded fc costs what the replicated one does."""
        link = self.all_gather_s - INTERCONNECTS[self.target].all_gather_latency_s
        return self.replicated_s - self.sharded_gemm_s - link


def _gemm_s(target: Target, tokens: int, k: int, n: int) -> float:
    """A launch of a ``[tokens, k] x [k, n]`` bf16 GEMM at its floor."""
    bytes_moved = 2 * (k * n + tokens * k + tokens * n)
    flops = 2 * tokens * k * n
    return target.launch_gap_s + max(bytes_moved / target.peak.bandwidth, flops / target.peak.bf16_flops)


def fc_cost(shape: DraftShape, tp: int, tokens: int, arch: str = "gfx942", aux_layers: int = AUX_LAYERS) -> FcCost:
    """The replicated and the column-parallel ``fc`` of ``shape`` (the whole draft's, not a
    rank's share: fc is not sharded by vLLM) on one rank of ``tp``."""
    if arch not in INTERCONNECTS:
        raise ValueError(f"no interconnect figures for {arch}: modelled on {sorted(INTERCONNECTS)}")
    if tp < 2:
        raise ValueError(f"tp: a sharded fc needs at least 2 ranks, got {tp}")
    target, link = TARGETS[arch], INTERCONNECTS[arch]
    h, k = shape.hidden, aux_layers * shape.hidden
    shard = -(-h // tp)
    gather = link.all_gather_latency_s + 2 * tokens * shard / link.link_bytes_per_s
    return FcCost(arch, shape.name, tp, tokens, _gemm_s(target, tokens, k, h), _gemm_s(target, tokens, k, shard),
                  gather, 2.0 * k * shard, 2.0 * k * h)


def format_fc(shapes: list[DraftShape], archs) -> str:
    """The table ``inspect --tp`` prints: per modelled target, TP degree and token count,
    the replicated against the sharded fc of each (whole-draft) shape."""
    rows = []
    seen = set()
    for shape in shapes:
        base, _, tp = shape.name.partition("@tp")
        for arch in archs:
            if arch not in INTERCONNECTS or not tp or (base, tp, arch) in seen:
                continue
            seen.add((base, tp, arch))
            for tokens in TOKENS:
                c = fc_cost(SHAPES[base], int(tp), tokens, arch)
                weight = f"{c.weight_bytes / 1e6:.0f}->{c.weight_bytes_per_rank / 1e6:.0f}"
                times = (c.replicated_s, c.sharded_gemm_s, c.all_gather_s, c.replicated_s - c.sharded_s,
                         c.break_even_latency_s)
                rows.append((arch, base, c.tp, tokens, weight, *(f"{t * 1e6:.1f}" for t in times)))
    if not rows:
        return ""
    lines = textwrap.wrap(f"== fc (the draft's context projection of A = {AUX_LAYERS} target layers, outside the two "
                          "operations): replicated (vLLM) against column-parallel + all-gather, per rank. MODELLED, "
                          "NOT MEASURED", WIDTH)
    for arch, link in INTERCONNECTS.items():
        if arch in archs:
            lines += ["   " + w for w in textwrap.wrap(
                f"model: {arch} as {TARGETS[arch].peak.name}: {link.name}; all-gather latency "
                f"{link.all_gather_latency_s * 1e6:.0f} us (an estimate, not measured); GEMMs at the floor of the "
                "target's peak DRAM and bf16 figures plus its launch gap; MB: the fc weight a rank reads, replicated "
                "-> sharded; saved = replicated - sharded; even at: the all-gather latency at which the sharded "
                "fc stops paying", WIDTH - 3)]
    return "\n".join(lines + [format_table(
        ["target", "shape", "tp", "N", "MB", "repl us", "shard us", "gather us", "saved us", "even at us"],
        rows)])
