"""One record per GPU architecture: everything the package knows about it, in one place.

Launch tables (wave size, LDS, CU count), fp8 support (which e4m3 flavour the hardware
converts), floors (per-product bandwidth and bf16 peaks) and the compile checks (the
Triton target) all read :func:`arch_info`. Adding an architecture is one entry here
plus its launch-table rules. Figures are vendor numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contract import dtype_name


@dataclass(frozen=True)
class Product:
    """One product of an architecture, for the hardware floors."""

    name: str
    name_hint: str  # substring of the device name that tells products of one arch apart ("": any)
    bandwidth: float  # bytes/s
    bf16_flops: float  # dense FLOP/s


@dataclass(frozen=True)
class ArchInfo:
    arch: str  # "gfx942", "sm_90"
    family: str  # "cdna" | "rdna" | "nvidia"
    wave_size: int
    lds_bytes: int  # shared memory (LDS) per CU / SM usable by one workgroup
    compute_units: int  # of the flagship part; a detected device brings its own count
    example: str
    fp8_dtype: torch.dtype | None  # the fp8 cache format the hardware converts; None: no fp8
    products: tuple[Product, ...] = ()

    @property
    def vendor(self) -> str:
        return "cuda" if self.family == "nvidia" else "rocm"

    @property
    def compile_target(self) -> tuple[str, str | int, int]:
        """``(backend, arch, warp size)`` as Triton's ``GPUTarget`` takes them."""
        if self.family == "nvidia":
            return "cuda", int(self.arch[3:]), 32
        return "hip", self.arch, self.wave_size

    def product_for(self, device_name: str) -> Product | None:
        """The first product whose name hint the device name contains."""
        return next((p for p in self.products if p.name_hint.lower() in device_name.lower()), None)

    def fp8_reason(self, dtype: torch.dtype) -> str | None:
        """Why this architecture cannot convert fp8 ``dtype`` in hardware (None: it can)."""
        if self.fp8_dtype == dtype:
            return None
        if self.fp8_dtype is None:
            return f"{self.arch} has no fp8 conversion ({self.example})"
        return f"{self.arch} has no {dtype_name(dtype)} conversion (it uses {dtype_name(self.fp8_dtype)})"


_FN, _FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz

KNOWN_ARCHS: dict[str, ArchInfo] = {a.arch: a for a in (
    ArchInfo("gfx90a", "cdna", 64, 64 << 10, 110, "MI210/MI250X", None),
    ArchInfo("gfx942", "cdna", 64, 64 << 10, 304, "MI300X/MI325X", _FNUZ, (
        Product("MI325X", "MI325", 6.0e12, 1307e12), Product("MI300X", "", 5.3e12, 1307e12))),
    ArchInfo("gfx950", "cdna", 64, 160 << 10, 256, "MI350X/MI355X", _FN, (
        Product("MI355X", "", 8.0e12, 2500e12),)),
    ArchInfo("gfx1100", "rdna", 32, 128 << 10, 96, "RX 7900 XTX", None, (
        Product("RX 7900 XTX", "", 0.96e12, 123e12),)),
    ArchInfo("gfx1101", "rdna", 32, 128 << 10, 60, "RX 7800 XT", None),
    ArchInfo("gfx1151", "rdna", 32, 128 << 10, 40, "Ryzen AI Max (Strix Halo)", None),
    ArchInfo("gfx1200", "rdna", 32, 128 << 10, 32, "RX 9060 XT", _FN),
    ArchInfo("gfx1201", "rdna", 32, 128 << 10, 64, "RX 9070 XT / AI PRO R9700", _FN, (
        Product("Radeon AI PRO R9700", "", 0.64e12, 195e12),)),
    ArchInfo("sm_80", "nvidia", 32, 164 << 10, 108, "A100", None),
    ArchInfo("sm_89", "nvidia", 32, 100 << 10, 128, "L40S / RTX 4090", _FN),
    ArchInfo("sm_90", "nvidia", 32, 228 << 10, 132, "H100/H200", _FN, (
        Product("H200", "H200", 4.8e12, 990e12), Product("H100 SXM", "", 3.35e12, 990e12))),
    ArchInfo("sm_100", "nvidia", 32, 228 << 10, 148, "B200", _FN),
)}


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
    raise ValueError(f"unknown architecture {arch!r}")


def arch_info(arch: str) -> ArchInfo:
    """The record of ``arch``; an unlisted one of a known family gets that family's
    defaults (one compute unit, no fp8, no products) so it runs, untuned."""
    if arch in KNOWN_ARCHS:
        return KNOWN_ARCHS[arch]
    family = family_of(arch)
    wave, lds = {"cdna": (64, 64 << 10), "rdna": (32, 128 << 10), "nvidia": (32, 100 << 10)}[family]
    fp8 = _FN if family == "nvidia" and int(arch[3:]) >= 89 else None
    return ArchInfo(arch, family, wave, lds, 1, arch, fp8)
