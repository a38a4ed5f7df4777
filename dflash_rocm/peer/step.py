"""What the two operations are worth in one decode step of a deployment (a model).

One DFlash decode step of a deployment (target, draft, TP, batch, context, ``k`` draft
tokens) is, per rank: the target's verify forward over ``batch x (k + 1)`` tokens, the
draft's forward over the same block (its layers but attention, its ``fc`` over the
context states, the shared ``lm_head`` over the ``k`` drafted rows), and the two
operations this package serves: the precompute of the step's new context tokens
(``batch x acceptance`` of them) and the draft attention of every draft layer. The two
operations are modelled by the audit's model for both sides (:mod:`.compare`; vLLM's
precompute at its roofline, :mod:`.unfused`); the verify and the draft's other layers
at their roofline: the weights and the KV they read once at the vendor's peak bandwidth,
or their FLOPs at the peak bf16 rate, whichever is longer, with no launch gaps (a captured
graph) and no TP collectives. That roofline is a lower bound of those parts, so the
shares of the two operations and the tokens/s ratio it gives are upper bounds of what a
faster kernel can win. The tokens/s ratio of two steps at the same acceptance length is
the inverse ratio of their times (the same tokens are accepted either way).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_rocm.audit import sweep
from dflash_rocm.audit.compiler import FactsCache
from dflash_rocm.audit.targets import TARGETS, Target
from dflash_rocm.workloads import SHAPES, DraftShape

from . import compare, unfused

ELEMENT = 2  # bf16 weights, activations and KV


@dataclass(frozen=True)
class TargetModel:
    """The dense target's dimensions (Hugging Face config)."""

    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    def layer_params(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.q_heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate


TARGET_MODELS = {"qwen3-8b": TargetModel("Qwen/Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936)}
DRAFTS = {"qwen3-8b": (SHAPES["qwen3-8b-dflash-b16"], 12288)}  # the DFlash draft and its MLP width
ACCEPTANCE = 6.0  # tokens a step accepts (with the bonus token): stated, not measured
MEMORY_BYTES = {"MI300X": 192e9, "MI325X": 256e9, "MI355X": 288e9, "Radeon AI PRO R9700": 32e9, "H200": 141e9,
                "H100 SXM": 80e9, "RX 7900 XTX": 24e9}  # vendor figures, per GPU
STEP_BATCHES = (1, 8, 64)
STEP_CONTEXTS = (8192, 32768, 131072)
PLOT_CONTEXTS = (1024, 8192, 32768, 131072)


@dataclass(frozen=True)
class Deployment:
    target_model: str  # a key of TARGET_MODELS
    gpu: str  # an audit target
    tp: int
    batch: int
    context: int
    k: int  # draft tokens per step (the block is k + 1 rows)
    acceptance: float = ACCEPTANCE


@dataclass
class StepRow:
    deployment: Deployment
    verify_us: float
    draft_other_us: float
    ours_us: float | None  # precompute + every draft layer's attention, ours
    vllm_us: dict[str, float | None]  # the same, per vLLM attention path (vLLM's precompute sequence for all)
    notes: list[str]
    resident_bytes: float = 0.0  # per rank: both models' weights and the KV of the batch's contexts

    @property
    def fits(self) -> bool:
        """Whether the weights and KV fit the modelled part's memory (else no such step runs)."""
        return self.resident_bytes <= MEMORY_BYTES.get(TARGETS[self.deployment.gpu].peak.name, float("inf"))

    def step_us(self, ops_us: float | None) -> float | None:
        return None if ops_us is None else self.verify_us + self.draft_other_us + ops_us

    def share(self, ops_us: float | None) -> float | None:
        step = self.step_us(ops_us)
        return None if step is None else ops_us / step

    def speedup(self, path: str) -> float | None:
        """Tokens/s with the plugin over tokens/s with vLLM's own kernels on ``path``."""
        ours, theirs = self.step_us(self.ours_us), self.step_us(self.vllm_us.get(path))
        return None if ours is None or theirs is None else theirs / ours


def _roofline_us(target: Target, nbytes: float, flops: float) -> float:
    return max(nbytes / target.peak.bandwidth, flops / target.peak.bf16_flops) * 1e6


def verify_us(model: TargetModel, d: Deployment, target: Target) -> float:
    """The target's forward over ``batch x (k + 1)`` tokens at its roofline (per rank)."""
    rows = d.batch * (d.k + 1)
    weights = (model.layers * model.layer_params() + model.vocab * model.hidden) / d.tp
    kv = d.batch * d.context * model.layers * 2 * model.kv_heads * model.head_dim / d.tp
    attention = 4 * rows * d.context * model.q_heads * model.head_dim * model.layers / d.tp
    return _roofline_us(target, (weights + kv) * ELEMENT, 2 * weights * rows + attention)


def draft_other_us(model: TargetModel, draft: DraftShape, intermediate: int, d: Deployment, target: Target) -> float:
    """The draft's forward but its attention and precompute (its layers' projections and
    MLPs over the block, ``fc`` over the step's context states, the shared ``lm_head`` over
    the ``k`` drafted rows) at its roofline (per rank)."""
    rows = d.batch * (d.k + 1)
    layers = draft.layers * draft_layer_params(draft, intermediate) / d.tp
    fc, head = fc_params(model, draft), model.vocab * draft.hidden / d.tp
    new = d.batch * d.acceptance
    flops = 2 * layers * rows + 2 * fc * new + 2 * head * d.batch * d.k
    return _roofline_us(target, (layers + fc + head) * ELEMENT, flops)


def draft_layer_params(draft: DraftShape, intermediate: int) -> int:
    """One draft layer's projections (q, k, v, o) and MLP (gate, up, down)."""
    return draft.hidden * draft.head_dim * (2 * draft.q_heads + 2 * draft.kv_heads) + 3 * draft.hidden * intermediate


def fc_params(model: TargetModel, draft: DraftShape) -> int:
    """``fc``'s weights: the taps' concatenated hidden states (one per draft layer) to the
    draft's width; replicated on every rank (vLLM's ``ReplicatedLinear``)."""
    return draft.layers * model.hidden * draft.hidden


def resident_bytes(model: TargetModel, draft: DraftShape, intermediate: int, d: Deployment) -> float:
    """Per rank: the target's and the draft's weights and both models' KV for the batch."""
    target = (model.layers * model.layer_params() + 2 * model.vocab * model.hidden) / d.tp
    weights = target + draft.layers * draft_layer_params(draft, intermediate) / d.tp + fc_params(model, draft)
    kv_per_token = (model.layers * model.kv_heads + draft.layers * draft.kv_heads) * 2 * model.head_dim / d.tp
    return (weights + d.batch * (d.context + d.k + 1) * kv_per_token) * ELEMENT


def step_row(root: Path, d: Deployment, cache: FactsCache) -> StepRow:
    model = TARGET_MODELS[d.target_model]
    draft, intermediate = DRAFTS[d.target_model]
    rank = draft.per_rank(d.tp)
    target = TARGETS[d.gpu]
    tokens = max(1, round(d.batch * d.acceptance))
    notes = []
    pre_ours, note = compare.ours_us(sweep.Case("precompute", rank, False, tokens=tokens), target, cache)
    if note:
        notes.append(f"our precompute: {note}")
    pre_vllm = unfused.unfused_seconds(rank, tokens, ELEMENT, target) * 1e6
    case = compare.PeerCase(d.gpu, "bf16", d.batch, d.context).case(rank)
    attn_ours, note = compare.ours_us(case, target, cache)
    if note:
        notes.append(f"our attention: {note}")
    paths = compare.peer_paths(root, case, target, cache)
    ours = None if None in (pre_ours, attn_ours) else pre_ours + rank.layers * attn_ours
    vllm = {p: None if r.us is None else pre_vllm + rank.layers * r.us for p, r in paths.items()}
    notes += [f"{compare.PATH_NAMES[p]}: {r.note}" for p, r in paths.items() if r.note and r.us is None]
    return StepRow(deployment=d, verify_us=verify_us(model, d, target),
                   draft_other_us=draft_other_us(model, draft, intermediate, d, target), ours_us=ours, vllm_us=vllm,
                   notes=notes, resident_bytes=resident_bytes(model, draft, intermediate, d))


def step_rows(root: Path, cache: FactsCache, gpus=("gfx942",), batches=STEP_BATCHES, contexts=STEP_CONTEXTS,
              target_model: str = "qwen3-8b", tp: int = 1, acceptance: float = ACCEPTANCE) -> list[StepRow]:
    k = DRAFTS[target_model][0].block_tokens - 1
    return [step_row(root, Deployment(target_model=target_model, gpu=gpu, tp=tp, batch=b, context=c, k=k,
                                      acceptance=acceptance), cache)
            for gpu in gpus for b in batches for c in contexts]


def assumptions(rows: list[StepRow]) -> list[str]:
    d = rows[0].deployment
    model = TARGET_MODELS[d.target_model]
    draft, intermediate = DRAFTS[d.target_model]
    return [
        f"target {model.name} ({model.layers} layers, hidden {model.hidden}, {model.q_heads}/{model.kv_heads} heads, "
        f"MLP {model.intermediate}, vocab {model.vocab}), bf16; draft {draft.note or draft.name} ({draft.layers} "
        f"layers, MLP {intermediate}, lm_head shared); TP {d.tp}; k = {d.k} draft tokens (block {d.k + 1})",
        f"acceptance length {d.acceptance:g} tokens per step (stated, not measured): the step's precompute covers "
        "batch x acceptance new context tokens; tokens/s ratio = vLLM's step time / ours (same acceptance)",
        "verify and the draft's other layers: roofline at the vendor peaks (weights and KV read once, no launch "
        "gaps: a captured graph; no TP collectives): a lower bound, so the operations' shares are upper bounds",
        "the two operations: ours and vLLM's attention compiled and modelled by dflash-rocm inspect's model "
        "(one call per draft layer); vLLM's precompute at its roofline per launch (a lower bound)",
        "MODELLED, NOT MEASURED: no figure here ran on a GPU",
    ]


def format_steps(rows: list[StepRow]) -> str:
    from .report import _ratio, _us

    paths = compare.PATHS
    lines = ["== decode step model (per rank; us)", *("  - " + a for a in assumptions(rows))]
    head = (f"{'gpu':<7} {'batch':>5} {'ctx':>5} {'GB':>5} {'verify':>7} {'draft':>6} {'ours ops':>8} {'share':>6} "
            + " ".join(f"{compare.PATH_NAMES[p][:14] + ' ops/share/tok-s':>31}" for p in paths))
    lines.append(head)
    for r in rows:
        d = r.deployment
        memory = f"{r.resident_bytes / 1e9:.0f}" + ("" if r.fits else "!")
        cells = [f"{d.gpu:<7} {d.batch:>5} {sweep.kilo(d.context):>5} {memory:>5} {_us(r.verify_us):>7} "
                 f"{_us(r.draft_other_us):>6} {_us(r.ours_us):>8} {_share(r.share(r.ours_us)):>6}"]
        for p in paths:
            theirs = r.vllm_us[p]
            cells.append(f"{_us(theirs) + ' ' + _share(r.share(theirs)) + ' ' + _ratio(r.speedup(p)):>31}")
        lines.append(" ".join(cells))
    lines.append("GB = weights + KV per rank (! = more than the part's memory: no such step runs on one rank); "
                 "tok-s = modelled tokens/s with the plugin over tokens/s with vLLM's kernels on that path")
    return "\n".join(lines)


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def steps_as_dicts(rows: list[StepRow]) -> dict:
    out = []
    for r in rows:
        out.append({**r.deployment.__dict__, "verify_us": r.verify_us, "draft_other_us": r.draft_other_us,
                    "resident_gb": r.resident_bytes / 1e9, "fits": r.fits, "ours_ops_us": r.ours_us,
                    "ours_share": r.share(r.ours_us),
                    "vllm_ops_us": r.vllm_us, "vllm_share": {p: r.share(v) for p, v in r.vllm_us.items()},
                    "tokens_per_s_ratio": {p: r.speedup(p) for p in r.vllm_us}, "notes": r.notes})
    return {"measured": False, "assumptions": assumptions(rows) if rows else [], "steps": out}


def plot_steps(rows: list[StepRow], path: str) -> list[str]:
    """The two operations' share of the step over context length, one figure per GPU
    (``path`` with ``-<gpu>`` before its suffix when there are several): ours and each vLLM
    path, one line per batch. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = sorted({r.deployment.gpu for r in rows})
    written = []
    for gpu in gpus:
        mine = [r for r in rows if r.deployment.gpu == gpu and r.fits]  # no step runs where the KV does not fit
        fig, ax = plt.subplots(figsize=(8, 5))
        for batch, style in zip(sorted({r.deployment.batch for r in mine}), ("-", "--", ":", "-.")):
            series = sorted((r for r in mine if r.deployment.batch == batch), key=lambda r: r.deployment.context)
            x = [r.deployment.context for r in series]
            ax.plot(x, [100 * (r.share(r.ours_us) or 0) for r in series], style, color="C0", marker="o",
                    label=f"plugin, batch {batch}")
            for color, p in zip(("C1", "C2", "C3"), compare.PATHS):
                ax.plot(x, [100 * (r.share(r.vllm_us[p]) or 0) for r in series], style, color=color,
                        label=f"vLLM {compare.PATH_NAMES[p]}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("precompute + draft attention, % of the decode step")
        ax.set_title(f"{TARGETS[gpu].peak.name} ({gpu}): MODELLED, not measured")
        ax.legend(fontsize=6, ncol=2)
        out = path if len(gpus) == 1 else str(Path(path).with_name(f"{Path(path).stem}-{gpu}{Path(path).suffix}"))
        fig.savefig(out, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(out)
    return written
