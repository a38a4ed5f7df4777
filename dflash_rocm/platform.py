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


@dataclass(frozen=True)
class ArchInfo:
    """Static facts about one GPU architecture (vendor figures, see shared/NOTES.md)."""

    family: str  # "cdna" | "rdna" | "nvidia"
    wave_size: int
    lds_bytes: int  # shared memory (LDS) per CU / SM usable by one workgroup
    compute_units: int  # of the flagship part; detection reads the real count
    example: str


KNOWN_ARCHS: dict[str, ArchInfo] = {
    "gfx90a": ArchInfo("cdna", 64, 64 * 1024, 110, "MI210/MI250X"),
    "gfx942": ArchInfo("cdna", 64, 64 * 1024, 304, "MI300X/MI325X"),
    "gfx950": ArchInfo("cdna", 64, 160 * 1024, 256, "MI350X/MI355X"),
    "gfx1100": ArchInfo("rdna", 32, 128 * 1024, 96, "RX 7900 XTX"),
    "gfx1101": ArchInfo("rdna", 32, 128 * 1024, 60, "RX 7800 XT"),
    "gfx1151": ArchInfo("rdna", 32, 128 * 1024, 40, "Ryzen AI Max (Strix Halo)"),
    "gfx1200": ArchInfo("rdna", 32, 128 * 1024, 32, "RX 9060 XT"),
    "gfx1201": ArchInfo("rdna", 32, 128 * 1024, 64, "RX 9070 XT / AI PRO R9700"),
    "sm_80": ArchInfo("nvidia", 32, 164 * 1024, 108, "A100"),
    "sm_89": ArchInfo("nvidia", 32, 100 * 1024, 128, "L40S / RTX 4090"),
    "sm_90": ArchInfo("nvidia", 32, 228 * 1024, 132, "H100/H200"),
    "sm_100": ArchInfo("nvidia", 32, 228 * 1024, 148, "B200"),
}


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


def parse_gcn_arch(gcn_arch_name: str) -> str:
    """``'gfx942:sramecc+:xnack-'`` -> ``'gfx942'`` (feature flags dropped)."""
    arch = gcn_arch_name.strip().split(":", 1)[0].lower()
    if not arch.startswith("gfx"):
        raise ValueError(f"not an AMD GCN architecture name: {gcn_arch_name!r}")
    return arch


def family_of(arch: str) -> str:
    """gfx9xx is CDNA (wave64), gfx10-12 RDNA (wave32), sm_* NVIDIA."""
    if arch in KNOWN_ARCHS:
        return KNOWN_ARCHS[arch].family
    if arch.startswith("sm_"):
        return "nvidia"
    if arch.startswith("gfx9"):
        return "cdna"
    if arch.startswith(("gfx10", "gfx11", "gfx12")):
        return "rdna"
    if arch == "cpu":
        return "cpu"
    raise ValueError(f"unknown architecture {arch!r}")


def platform_for_arch(arch: str, *, compute_units: int | None = None, name: str = "",
                      simulated: bool = False) -> Platform:
    """A Platform built from the static table (used by detection and simulation)."""
    family = family_of(arch)
    info = KNOWN_ARCHS.get(arch)
    wave = info.wave_size if info else (64 if family == "cdna" else 32)
    lds = info.lds_bytes if info else (64 * 1024 if family == "cdna" else 128 * 1024)
    cus = compute_units or (info.compute_units if info else 1)
    vendor = "cuda" if family == "nvidia" else "rocm"
    return Platform(vendor, arch, family, wave, cus, lds, name or (info.example if info else arch),
                    simulated)


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
    """The platform of ``device`` (default: the current GPU if any, else CPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _detect_gpu(index)
    if device.type == "cpu" and _simulated is not None:
        return _simulated
    if device.type == "cpu":
        return CPU_PLATFORM
    return replace(CPU_PLATFORM, vendor=device.type, arch=device.type, family=device.type,
                   name=device.type)


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


def triton_interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter now, read as Triton reads it
    (Triton reads it when kernels are decorated)."""
    from . import envs

    return envs.TRITON_INTERPRET.value()
