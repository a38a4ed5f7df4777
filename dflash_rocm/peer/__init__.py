"""vLLM's own draft kernels beside this package's, under one compiler and one model.

``dflash-rocm inspect --peer PATH`` loads vLLM's Triton kernel files from an unpacked vLLM
tree (or the installed vLLM) at run time (:mod:`.source`; nothing of vLLM is copied into
this package), runs vLLM's own host code for each call on ``meta`` tensors and records the
launches it makes (:mod:`.capture`), compiles each for the audit's GPU targets with the
specialisation a real launch gets and models it with the audit's model (:mod:`.traffic`,
:mod:`.compare`). The sequence vLLM runs for the precompute is mostly not Triton (a BLAS
GEMM and C++ norm, RoPE and cache-write kernels): each of its launches is costed at its
roofline plus the launch gap (:mod:`.unfused`), a lower bound of vLLM's time, beside our
precompute (:mod:`.precompute`). The step model (:mod:`.step`) puts both operations into
one decode step of a deployment; :mod:`.fc` models vLLM's ``fc`` context projection under
tensor parallelism (``inspect --tp``), replicated as vLLM builds it against column-parallel.
All of that is modelled. :mod:`.bench` (``bench --peer``) is the one measurement: vLLM's
TRITON_ATTN kernel run on this device beside ours, checked against the reference, timed.
"""
