"""What this machine offers the tests, decided once."""

import importlib.util

import pytest
import torch

from dflash_rocm import envs

HAS_GPU = torch.cuda.is_available()
HAS_ROCM_GPU = HAS_GPU and bool(getattr(torch.version, "hip", None))
HAS_CUDA_GPU = HAS_GPU and not HAS_ROCM_GPU
HAS_VLLM = importlib.util.find_spec("vllm") is not None
HAS_AITER = importlib.util.find_spec("aiter") is not None
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = envs.TRITON_INTERPRET.value()

needs_interpreter = pytest.mark.skipif(
    not (INTERPRETING and HAS_TRITON),
    reason="runs Triton kernels on CPU tensors through the interpreter (machines without a GPU)")


def to_device(args: dict, device: str) -> dict:
    """A call's keyword arguments with every tensor (and the weights) moved to ``device``."""
    from dflash_rocm import ContextKVWeights

    def move(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, ContextKVWeights):
            return value.to(device)
        if isinstance(value, (list, tuple)):
            return type(value)(move(v) for v in value)
        return value
    return {k: move(v) for k, v in args.items()}

# Every backend that runs on this machine's CPU tensors (rocm on a simulated architecture,
# through the interpreter): what "on every backend" means for a CPU test.
SERVING_HERE = ["reference", "cpu", pytest.param("triton", marks=needs_interpreter),
                pytest.param("rocm", marks=needs_interpreter)]


def bare(cls, **children):
    """An instance of vLLM's module class ``cls`` holding ``children``, its ``__init__`` not
    run (a family member's layers arranged as vLLM builds them, without a vLLM config)."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    for name, value in children.items():
        setattr(obj, name, value)
    return obj


def replay(recorded) -> None:
    """Run launches recorded by :func:`dflash_rocm.launches.capture` again, by hand, with
    the tensors they recorded (as a CUDA graph replays its launches: same addresses)."""
    from dflash_rocm.backends.triton.launcher import options_for

    for launch in recorded:
        launch.kernel[launch.grid](*launch.args, **launch.constexprs, **options_for(launch.options, amd=False))


def bare_interpreter(cwd) -> tuple[list[str], dict]:
    """``(command prefix, environment)`` for a Python where this package is NOT installed, as
    on the lent GPU machine: ``python -S`` skips ``site`` (so no ``.pth`` file, hence no
    editable import hook, runs) and this environment's site-packages come back through
    ``PYTHONPATH`` for torch, Triton and pytest. Run with ``cwd``, ``python -S -m X`` puts
    ``cwd`` first on the path, as ``python -m X`` does."""
    import os
    import site
    import sys

    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PWD=str(cwd))
    return [sys.executable, "-S"], env


def refuse_every(tensors, refusal: Exception) -> None:
    """``dflash_rocm.derived``'s capture rule (``refuse_in_capture``) with every call
    refused: patched in, a host backend that is never captured must derive nothing."""
    raise refusal
