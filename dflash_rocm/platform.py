"""Which accelerator a tensor lives on: vendor, architecture, family and wave size.

Backends decide what they can serve from this, and the ROCm launch tables are keyed
by its ``arch``. Detection is lazy (first use per device, then cached) so importing
dflash_rocm never touches a GPU driver. Tests pin a platform with
:func:`simulate_platform` to run per-architecture code paths on CPU tensors through
the Triton interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from .arch import ArchInfo, arch_info


@dataclass(frozen=True)
class Platform:
    vendor: str  # "rocm" | "cuda" | "cpu"
    arch: str  # "gfx942", "gfx1100", "sm_90", "cpu"
    family: str  # "cdna" | "rdna" | "nvidia" | "cpu"
    wave_size: int
    compute_units: int
    lds_bytes: int
    name: str
    # True when a test pinned this platform for CPU tensors: kernels then run
    # through the Triton interpreter and only an explicitly named backend uses it.
    simulated: bool = False

    @property
    def arch_info(self) -> ArchInfo | None:
        """The architecture's record (None for CPUs and other non-GPU devices)."""
        return arch_info(self.arch) if self.vendor in ("rocm", "cuda") else None


def cpu_gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU GEMM of ``dtype`` operands runs fast in: ``dtype`` itself where
    oneDNN has native kernels for it (AVX512-BF16/AMX for bf16, AVX512-FP16/AMX for fp16),
    else float32 (torch's non-oneDNN bf16/fp16 GEMM is 4-7x slower than float32 there,
    measured on the AVX2 EPYC of docs/benchmarks.md's Machines)."""
    if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return dtype
    if dtype == torch.float16 and torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return dtype
    return torch.float32


def parse_gcn_arch(gcn_arch_name: str) -> str:
    """``'gfx942:sramecc+:xnack-'`` -> ``'gfx942'`` (feature flags dropped)."""
    arch = gcn_arch_name.strip().split(":", 1)[0].lower()
    if not arch.startswith("gfx"):
        raise ValueError(f"not an AMD GCN architecture name: {gcn_arch_name!r}")
    return arch


def platform_for_arch(arch: str, *, compute_units: int | None = None, name: str = "",
                      simulated: bool = False) -> Platform:
    """A Platform of ``arch`` (used by detection and simulation): the architecture's record,
    with the device's own compute-unit count and name where known."""
    info = arch_info(arch)
    return Platform(info.vendor, arch, info.family, info.wave_size, compute_units or info.compute_units,
                    info.lds_bytes, name or info.example, simulated)


CPU_PLATFORM = Platform("cpu", "cpu", "cpu", 1, os.cpu_count() or 1, 0, "cpu")

_lock = threading.Lock()
_simulated: Platform | None = None


@functools.lru_cache(maxsize=None)
def _detect_gpu(index: int) -> Platform:
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        arch = parse_gcn_arch(getattr(props, "gcnArchName", "") or "gfx000")
    else:
        arch = f"sm_{props.major}{props.minor}"
    return platform_for_arch(arch, compute_units=props.multi_processor_count, name=props.name)


def platform_for(device: torch.device | str | None = None) -> Platform:
    """The platform of ``device`` (default: the current GPU if any, else CPU), under the
    platform :func:`simulate_platform` pins for CPU tensors now."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif type(device) is not torch.device:
        device = torch.device(device)
    return platform_of(device, _simulated)


def platform_of(device: torch.device, simulated: Platform | None) -> Platform:
    """The platform of ``device`` when ``simulated`` is what CPU tensors report (None: the
    CPU itself): a GPU's is detected on first use and kept for the process. A planning
    record holds the device and ``simulated`` and asks this only when a plan is made."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _detect_gpu(index)
    if device.type == "cpu":
        return CPU_PLATFORM if simulated is None else simulated
    return replace(CPU_PLATFORM, vendor=device.type, arch=device.type, family=device.type,
                   name=device.type)


def simulated_platform() -> Platform | None:
    """The platform :func:`simulate_platform` pins for CPU tensors now (None: none): part
    of every plan's key, as it changes what CPU tensors are served as."""
    return _simulated


@contextlib.contextmanager
def simulate_platform(arch: str, compute_units: int | None = None) -> Iterator[Platform]:
    """Make CPU tensors report ``arch`` (e.g. ``'gfx942'``) inside the block.

    This is how per-architecture kernels and tables are exercised on a CPU machine:
    the kernels run through the Triton interpreter, and ``auto`` dispatch still never
    picks a vendor backend for CPU tensors (only a named backend runs).
    """
    global _simulated
    platform = platform_for_arch(arch, compute_units=compute_units, simulated=True)
    with _lock:
        previous, _simulated = _simulated, platform
    try:
        yield platform
    finally:
        with _lock:
            _simulated = previous
