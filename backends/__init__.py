"""Vendor backends, one folder each, shipped as ``dflash_rocm.backends``.

``triton`` is the portable one (any Triton device, and CPU through the interpreter);
``rocm`` tunes it for AMD and adds aiter where present; ``cuda`` composes vLLM's CUDA ops.
"""
