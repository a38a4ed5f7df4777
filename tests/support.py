"""What this machine offers the tests, decided once."""

import importlib.util

import pytest
import torch

from dflash_rocm import envs

HAS_GPU = torch.cuda.is_available()
HAS_ROCM_GPU = HAS_GPU and bool(getattr(torch.version, "hip", None))
HAS_CUDA_GPU = HAS_GPU and not HAS_ROCM_GPU
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = envs.TRITON_INTERPRET.value()

needs_interpreter = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON),
    reason="runs Triton kernels on CPU tensors through the interpreter (machines without a GPU)")
