"""The two kernels ``bench --assumptions`` probes a device with.

:class:`ReadKernel` reads a buffer: the bandwidth a device reads at from its L2 when the
buffer fits there, from its DRAM when it does not (the ``l2-read`` and ``dram-read`` rows,
beside the model's ``l2_bandwidth`` and the vendor's peak). Each program reads ``TRIPS``
tiles of ``BLOCK`` float32 values and stores its ``BLOCK`` running sums (never a reduction
across lanes, so the interpreter computes it right on a CPU): the bytes moved are the
buffer once plus ``1 / TRIPS`` of it written. :func:`launch_empty` launches a kernel that
does nothing: what a dependent launch costs beyond its work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
TRIPS = 32


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, TRIPS: tl.constexpr):
    program = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    start = program * BLOCK * TRIPS
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for trip in range(TRIPS):
        offsets = start + trip * BLOCK + lanes
        total += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + program * BLOCK + lanes, total)


@triton.jit
def _empty_kernel(x_ptr):
    pass


def launch_empty(x: torch.Tensor) -> None:
    """One launch of a kernel that does nothing, one program (the ``gap-eager`` and
    ``gap-graph`` rows)."""
    _empty_kernel[(1,)](x)


class ReadKernel:
    """Reads ``buffer`` (float32, one dimension) once per call into ``sums``; ``bytes_moved``
    is what a call reads and writes."""

    def __init__(self, buffer: torch.Tensor):
        if buffer.dtype != torch.float32 or buffer.dim() != 1:
            raise TypeError(f"ReadKernel reads a one-dimensional float32 buffer, got {buffer.dtype} "
                            f"with {buffer.dim()} dimensions")
        self.buffer = buffer
        self.programs = triton.cdiv(buffer.numel(), BLOCK * TRIPS)
        self.sums = torch.empty(self.programs * BLOCK, dtype=torch.float32, device=buffer.device)
        self.bytes_moved = buffer.numel() * buffer.element_size() + self.sums.numel() * self.sums.element_size()

    def __call__(self) -> torch.Tensor:
        _read_kernel[(self.programs,)](self.buffer, self.sums, self.buffer.numel(), BLOCK=BLOCK, TRIPS=TRIPS)
        return self.sums
