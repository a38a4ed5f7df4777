"""Vendor backends, one folder each, shipped as ``dflash_rocm.backends``.

``triton`` is the portable one (any Triton device, and CPU through the interpreter);
``rocm`` tunes it for AMD; ``aiter`` serves attention with aiter's CK kernel on CDNA where
aiter is installed, checked against ``rocm``; ``cuda`` composes vLLM's CUDA ops; ``cpu`` serves
CPU tensors with torch's kernels; ``reference`` is the plain-torch oracle.
"""
