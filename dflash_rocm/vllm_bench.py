"""``dflash-rocm bench --vllm``: one small DFlash generation end to end, with and without the plugin.

The plugin registers once per process, so every run is its own process: vLLM's own
DFlash path runs with ``DFLASH_ROCM_VLLM=0``, the plugin's without. Runs come in pairs
whose order alternates (drift on a shared machine then hits both sides alike), each
with an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: requests batch the same
way every run), prefix caching off and eager execution, after one warm-up generation
of the same prompts; a run counts its fastest of a few timed generations. Each run reports
its generate time (wall and process CPU time), the time spent inside the draft's
context-KV precompute and draft-layer attention calls (timed around vLLM's own call
sites, so both paths are timed alike), its decoding steps and its tokens.

The models (``--size``) are the tiny random Qwen3 target and DFlash draft of
:mod:`.tiny_models`, or a draft of Qwen3-8B-DFlash-b16's shapes with random weights on a
5-layer target of its width (``--size draft``: where compute, not host time, dominates;
fewer, shorter prompts), run in the chosen dtype. Every draft layer has the same K-norm
weight, so vLLM's own CPU path (whose grouped ``rms_norm`` applies row 0 to every layer)
computes the same draft. Low-bit
rounding differences can still flip a near-tied proposal of the random draft and change
how many steps decoding takes; the report gives the steps and the time per step.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Workload:
    prompts: int = 8
    min_prompt_len: int = 300
    max_prompt_len: int = 650
    max_tokens: int = 64
    num_speculative_tokens: int = 7
    dtype: str = "bfloat16"
    seed: int = 0
    repeats: int = 3  # timed generations per run; the fastest counts
    size: str = "tiny"  # the models: a key of SIZES

    def prompt_ids(self) -> list[list[int]]:
        import torch

        from .tiny_models import SPECIALS, VOCAB

        g = torch.Generator().manual_seed(self.seed)
        lengths = torch.linspace(self.min_prompt_len, self.max_prompt_len, self.prompts).round().long().tolist()
        return [torch.randint(len(SPECIALS), VOCAB, (n,), generator=g).tolist() for n in lengths]

    @property
    def max_model_len(self) -> int:
        return self.max_prompt_len + self.max_tokens + self.num_speculative_tokens + 64

    def describe(self) -> str:
        return (f"{SIZES[self.size]}; {self.prompts} prompts of {self.min_prompt_len}-{self.max_prompt_len} tokens, "
                f"{self.max_tokens} greedy tokens each, {self.num_speculative_tokens} speculative tokens, "
                f"{self.dtype}, fastest of {self.repeats} timed generation(s) per run")


FULL = Workload()
SMOKE = Workload(prompts=2, min_prompt_len=40, max_prompt_len=80, max_tokens=16, repeats=1)
# Fewer and shorter prompts than FULL: at these widths one generation takes tens of seconds on 2 CPU cores.
DRAFT = Workload(prompts=2, min_prompt_len=64, max_prompt_len=128, max_tokens=16, repeats=1, size="draft")
SIZES = {"tiny": "the tiny random models (hidden 128)",
         "draft": "a draft of Qwen3-8B-DFlash-b16's shapes (random bf16 weights: hidden 4096, 32/8 heads of 128, "
                  "MLP 12288, 5 layers, 5 taps) on a 5-layer target of Qwen3-8B's width"}
WORKLOADS = {"tiny": FULL, "draft": DRAFT}  # bench --vllm --size


def write_workload_models(root: str, workload: Workload) -> tuple[str, str]:
    """The target and draft paths of ``workload.size``'s models, written under ``root``."""
    from .tiny_models import DRAFT_SIZED, write_models, write_random_models

    if workload.size == "draft":
        return write_random_models(root, DRAFT_SIZED)
    return write_models(root, same_k_norm=True)


@dataclass
class Run:
    plugin: bool
    generate_s: float  # wall time of the timed generate call
    generate_cpu_s: float  # CPU time of the process (all threads) during it: less sensitive to other load
    draft_op_s: float
    precompute_s: float
    attention_s: float
    precompute_calls: int
    attention_calls: int
    outputs: list[list[int]]
    served_by: dict = field(default_factory=dict)  # dflash_rocm.dispatch_counts(), as "op/backend" keys

    @property
    def steps(self) -> int:
        """Decoding steps with a draft (one precompute each): acceptance sets how many."""
        return self.precompute_calls

    @property
    def step_s(self) -> float:
        return self.generate_s / max(1, self.steps)


class _OpTimer:
    """Accumulates the time spent in wrapped calls; re-entrant calls (the plugin handing
    a call back to vLLM's own method) count once."""

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0
        self._events: list = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            try:
                if self.cuda:
                    import torch
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    result = fn(*args, **kwargs)
                    end.record()
                    self._events.append((start, end))
                else:
                    t0 = time.perf_counter()
                    result = fn(*args, **kwargs)
                    self.seconds += time.perf_counter() - t0
                self.calls += 1
                return result
            finally:
                self._depth -= 1
        return timed

    def reset(self) -> None:
        self.seconds, self.calls, self._events = 0.0, 0, []

    def total(self) -> float:
        if self.cuda:
            import torch
            torch.cuda.synchronize()
            return self.seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1e3
        return self.seconds


def _install_timers(precompute: _OpTimer, attention: _OpTimer) -> None:
    """Time every loaded DFlash draft's precompute and draft-layer attention. Hooked into
    vLLM's own ``load_weights`` (which the plugin's model calls too), so the same call
    sites are timed whichever class vLLM built."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    original = DFlashQwen3ForCausalLM.load_weights

    def load_weights(self, weights):
        loaded = original(self, weights)
        self.precompute_and_store_context_kv = precompute.wrap(self.precompute_and_store_context_kv)
        for layer in self.model.layers:
            impl = layer.self_attn.attn.impl
            impl.forward = attention.wrap(impl.forward)
        return loaded

    DFlashQwen3ForCausalLM.load_weights = load_weights


def run_once(target: str, draft: str, workload: Workload, plugin: bool, backend: str | None = None) -> Run:
    """One engine, one warm-up, then the fastest of ``workload.repeats`` timed generations
    (the least disturbed by other load on a shared machine), in this process. Call in a fresh
    process: the plugin registers (or, with ``DFLASH_ROCM_VLLM=0``, does not) at vLLM start;
    ``backend`` is the plugin's ``DFLASH_ROCM_BACKEND`` (None: as set, else auto)."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["DFLASH_ROCM_VLLM"] = "1" if plugin else "0"
    if backend is not None:
        os.environ["DFLASH_ROCM_BACKEND"] = backend
    import torch
    from vllm import LLM, SamplingParams

    import dflash_rocm

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    precompute, attention = _OpTimer(device_type), _OpTimer(device_type)
    _install_timers(precompute, attention)
    if plugin:  # also where the entry point is not installed (a checkout on PYTHONPATH); idempotent
        from .vllm_plugin import register
        register()
    llm = LLM(model=target, tokenizer=target, dtype=workload.dtype, enforce_eager=True, seed=0,
              max_model_len=workload.max_model_len, max_num_seqs=workload.prompts, enable_prefix_caching=False,
              speculative_config={"method": "dflash", "model": draft,
                                  "num_speculative_tokens": workload.num_speculative_tokens})
    prompts = [{"prompt_token_ids": p} for p in workload.prompt_ids()]
    params = SamplingParams(temperature=0.0, max_tokens=workload.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-call work is not timed
    fastest = None
    for _ in range(workload.repeats):
        precompute.reset()
        attention.reset()
        dflash_rocm.reset_dispatch_counts()
        if device_type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        results = llm.generate(prompts, params, use_tqdm=False)
        if device_type == "cuda":
            torch.cuda.synchronize()
        generate_s, generate_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        p_s, a_s = precompute.total(), attention.total()
        run = Run(plugin=plugin, generate_s=generate_s, generate_cpu_s=generate_cpu_s, draft_op_s=p_s + a_s,
                  precompute_s=p_s, attention_s=a_s, precompute_calls=precompute.calls,
                  attention_calls=attention.calls, outputs=[list(r.outputs[0].token_ids) for r in results],
                  served_by={f"{op}/{name}": n for (op, name), n in dflash_rocm.dispatch_counts().items()})
        if fastest is None or run.generate_s < fastest.generate_s:
            fastest = run
    return fastest


@dataclass
class Report:
    workload: Workload
    runs: list[Run]  # (vLLM, plugin) per pair, in pair order
    backend: str | None  # the plugin runs' DFLASH_ROCM_BACKEND (None: auto)
    machine: str

    def side(self, plugin: bool) -> list[Run]:
        return [r for r in self.runs if r.plugin == plugin]

    def pair_ratios(self, attr: str) -> list[float]:
        return [getattr(p, attr) / getattr(v, attr) if getattr(v, attr) else float("nan")
                for v, p in zip(self.side(False), self.side(True))]

    def median_ratio(self, attr: str) -> float:
        return statistics.median(self.pair_ratios(attr))

    @property
    def outputs_match(self) -> bool:
        first = self.runs[0].outputs
        return all(r.outputs == first for r in self.runs)

    def summary(self) -> dict:
        medians = {f"{side}_{attr}": statistics.median(getattr(r, attr) for r in self.side(plugin))
                   for side, plugin in (("vllm", False), ("plugin", True))
                   for attr in ("generate_s", "generate_cpu_s", "precompute_s", "attention_s", "steps")}
        return {"pairs": len(self.runs) // 2, "generate_ratio": self.median_ratio("generate_s"),
                "generate_cpu_ratio": self.median_ratio("generate_cpu_s"),
                "step_time_ratio": self.median_ratio("step_s"),
                "draft_op_ratio": self.median_ratio("draft_op_s"), "outputs_match": self.outputs_match,
                **medians}


def machine_description() -> str:
    import platform

    import torch

    from .vllm_plugin.compat import vllm_version

    if torch.cuda.is_available():
        where = torch.cuda.get_device_name(0)
    else:
        where = (f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                 f"{torch.get_num_threads()} torch threads")
    return f"{where}; torch {torch.__version__}, vLLM {vllm_version()}"


def _worker_command(target: str, draft: str, workload: Workload, plugin: bool, backend: str | None,
                    out: str) -> list[str]:
    spec = json.dumps({"target": target, "draft": draft, "workload": asdict(workload), "plugin": plugin,
                       "backend": backend, "out": out})
    return [sys.executable, "-m", "dflash_rocm.vllm_bench", spec]


def run_pairs(workload: Workload = FULL, pairs: int = 3, backend: str | None = None, progress=None,
              timeout_s: float = 900) -> Report:
    """``pairs`` (vLLM, plugin) runs, each in a fresh process; the order within a pair alternates."""
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="dflash-bench-vllm-") as root:
        target, draft = write_workload_models(root, workload)
        for i in range(pairs):
            pair = {}
            for plugin in ((False, True) if i % 2 == 0 else (True, False)):
                side = "plugin" if plugin else "vLLM"
                if progress:
                    progress(f"pair {i + 1}/{pairs}: {side}")
                out = os.path.join(root, f"run{i}-{int(plugin)}.json")
                proc = subprocess.run(_worker_command(target, draft, workload, plugin, backend, out),
                                      capture_output=True, text=True, timeout=timeout_s)
                if proc.returncode != 0 or not os.path.exists(out):
                    raise RuntimeError(f"the {side} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
                with open(out) as f:
                    pair[plugin] = Run(**json.load(f))
            runs += [pair[False], pair[True]]
    return Report(workload=workload, runs=runs, backend=backend, machine=machine_description())


def format_report(report: Report) -> str:
    from .report import format_table

    rows = []
    for i, (v, p) in enumerate(zip(report.side(False), report.side(True))):
        rows.append((i + 1, f"{v.generate_s:.3f}", f"{p.generate_s:.3f}", f"{p.generate_s / v.generate_s:.3f}",
                     f"{p.generate_cpu_s / v.generate_cpu_s:.3f}", f"{v.steps}/{p.steps}", f"{v.draft_op_s * 1e3:.1f}",
                     f"{p.draft_op_s * 1e3:.1f}", f"{p.draft_op_s / v.draft_op_s:.3f}" if v.draft_op_s else ""))
    table = format_table(["pair", "vLLM s", "plugin s", "ratio", "CPU-time ratio", "steps", "vLLM draft-op ms",
                          "plugin draft-op ms", "ratio"], rows)
    s = report.summary()
    served = report.side(True)[-1].served_by
    lines = [f"machine: {report.machine}",
             f"workload: {report.workload.describe()}; {s['pairs']} pairs, one process per run, alternating order; "
             f"plugin backend: {report.backend or 'auto'}",
             table,
             f"generate time plugin/vLLM: median {s['generate_ratio']:.3f} (CPU time {s['generate_cpu_ratio']:.3f}; "
             f"per decoding step {s['step_time_ratio']:.3f}, steps {s['vllm_steps']:g} vs {s['plugin_steps']:g}: "
             "numerics can change which proposals are accepted)",
             f"draft-op time plugin/vLLM: median {s['draft_op_ratio']:.3f} (medians: precompute "
             f"{s['plugin_precompute_s'] * 1e3:.1f} vs {s['vllm_precompute_s'] * 1e3:.1f} ms, attention "
             f"{s['plugin_attention_s'] * 1e3:.1f} vs {s['vllm_attention_s'] * 1e3:.1f} ms)",
             "plugin calls served by: " + (", ".join(f"{k} x{n}" for k, n in sorted(served.items())) or "none")
             + ("" if any(k.startswith("draft_attention") for k in served)
                else " (draft attention: vLLM's own kernel, handed back)"),
             "outputs identical token for token: " + ("yes" if s["outputs_match"] else "NO")]
    return "\n".join(lines)


def report_json(report: Report) -> str:
    return json.dumps({"machine": report.machine, "workload": asdict(report.workload), "backend": report.backend,
                       "summary": report.summary(),
                       "runs": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in report.runs]},
                      indent=2)


def _main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    run = run_once(spec["target"], spec["draft"], Workload(**spec["workload"]), spec["plugin"], spec["backend"])
    with open(spec["out"], "w") as f:
        json.dump(asdict(run), f)


if __name__ == "__main__":
    _main(sys.argv[1])
